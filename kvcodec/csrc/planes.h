/* K's byte planes (planes.c): E = heads x head_dim elements per token, T tokens; hi [E, T], lo [T, E]. */
#ifndef KV_PLANES_H
#define KV_PLANES_H

#include <stddef.h>
#include <stdint.h>

void kv_planes_split(const uint8_t *k, uint8_t *hi, uint8_t *lo, size_t T, size_t E);
void kv_planes_merge(const uint8_t *hi, const uint8_t *lo, uint8_t *k, size_t T, size_t E);

#endif
