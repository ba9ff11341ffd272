/* V's FP8 e4m3 codes for the lossless payload of schemes LOSSLESS_SPLIT(_UNIT) (nibbles.c; docs/FORMAT.md,
 * "Split V codes"): V [tokens, heads, head_dim] split into each head's exponents [heads, tokens x
 * head_dim] (bits 3..6 of a code, one byte each: the symbols its Huffman stream codes) and the sign and
 * mantissa of every code in payload order, two a byte (bit 7 as bit 3, bits 0..2 as they are; code j in
 * the low nibble of byte j / 2 for even j, the high for odd j; an odd count's last high nibble 0), and
 * merged back. */
#ifndef KV_NIBBLES_H
#define KV_NIBBLES_H

#include <stddef.h>
#include <stdint.h>

void kv_nibbles_split(const uint8_t *v, uint8_t *exp, uint8_t *nib, size_t T, size_t H, size_t D);
/* kv_nibbles_split with each head's exponents two a byte (exponent 2i of a head in the low nibble of
 * its byte i; T x H x D / 2 bytes): what huff_encode_pairs codes. T x D even (a byte never holds two
 * heads' exponents). */
void kv_nibbles_split_pairs(const uint8_t *v, uint8_t *exp2, uint8_t *nib, size_t T, size_t H, size_t D);
void kv_nibbles_merge(const uint8_t *exp, const uint8_t *nib, uint8_t *v, size_t T, size_t H, size_t D);

#endif
