/* K's byte planes for the lossless payload (docs/FORMAT.md, "Lossless payload"): a 16-bit K
 * [tokens, heads, head_dim] split into its high bytes laid out channel by channel per head
 * [heads, head_dim, tokens] and its low bytes [tokens, heads, head_dim], and merged back; one pass over
 * K's bytes each way. Portable C (no Python): eight tokens at a time, so that each channel's high bytes
 * are written (or read) as one 8-byte run instead of eight scattered bytes. py_planes.c is the entry. */
#include "planes.h"

#include <string.h>

#define RUN 8 /* tokens per pass: one 8-byte run of a channel's high bytes */

void kv_planes_split(const uint8_t *k, uint8_t *hi, uint8_t *lo, size_t T, size_t E) {
    size_t t = 0;
    for (; t + RUN <= T; t += RUN) {
        for (size_t e = 0; e < E; e++) {
            uint8_t run[RUN];
            for (size_t j = 0; j < RUN; j++) {
                const uint8_t *p = k + 2 * ((t + j) * E + e);
                lo[(t + j) * E + e] = p[0];
                run[j] = p[1];
            }
            memcpy(hi + e * T + t, run, RUN);
        }
    }
    for (; t < T; t++) {
        for (size_t e = 0; e < E; e++) {
            lo[t * E + e] = k[2 * (t * E + e)];
            hi[e * T + t] = k[2 * (t * E + e) + 1];
        }
    }
}

void kv_planes_merge(const uint8_t *hi, const uint8_t *lo, uint8_t *k, size_t T, size_t E) {
    size_t t = 0;
    for (; t + RUN <= T; t += RUN) {
        for (size_t e = 0; e < E; e++) {
            uint8_t run[RUN];
            memcpy(run, hi + e * T + t, RUN);
            for (size_t j = 0; j < RUN; j++) {
                uint8_t *p = k + 2 * ((t + j) * E + e);
                p[0] = lo[(t + j) * E + e];
                p[1] = run[j];
            }
        }
    }
    for (; t < T; t++) {
        for (size_t e = 0; e < E; e++) {
            k[2 * (t * E + e)] = lo[t * E + e];
            k[2 * (t * E + e) + 1] = hi[e * T + t];
        }
    }
}

