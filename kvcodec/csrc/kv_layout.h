/* Scopes, scale groups and the codes' layout: what every driver and the glue ask of a call's shape. */
#ifndef KV_LAYOUT_H
#define KV_LAYOUT_H

#include "kv_bits.h"

/* Scale groups of a scope over T tokens x H heads (page >= 1), without overflow (-1 if it would). */
static inline kv_ssize groups_of(kv_ssize T, kv_ssize H, int scope, kv_ssize page) {
    if (scope == SC_TENSOR) return 1;
    if (scope == SC_LAYER_HEAD) return H;
    kv_ssize pages = T / page + (T % page != 0), n;
    return __builtin_mul_overflow(pages, H, &n) ? -1 : n;
}

static inline kv_ssize group_of(int scope, kv_ssize page, kv_ssize H, kv_ssize t, kv_ssize h) {
    if (scope == SC_TENSOR) return 0;
    if (scope == SC_LAYER_HEAD) return h;
    return (t / page) * H + h;
}

/* Token t's row of scales: head h's is [h] (or [0] for per_tensor): group_of's division once a token. */
static inline const float *token_scales(const float *sc, int scope, kv_ssize page, kv_ssize H, kv_ssize t) {
    return scope == SC_PAGE_HEAD ? sc + (t / page) * H : sc;
}

/* Whether n scales are all finite (and, if `positive`, > 0). */
static inline int scales_ok(const float *s, kv_ssize n, int positive) {
    for (kv_ssize i = 0; i < n; i++)
        if (!finite_f32(s[i]) || (positive && !(s[i] > 0.0f))) return 0;
    return 1;
}

/* Whether q's codes lie densely in token-major order (the blob's order, which the CRC follows). */
static inline int dense_codes(const KvRows *q) {
    return (q->H == 1 || q->sh == q->D) && (q->T == 1 || q->st == q->H * q->D);
}

/* Tokens per slice of a CRC continued from memory: about 16 KiB of one-byte codes, so that each
 * slice is checksummed while it is still in L1. */
static inline kv_ssize crc_slice_tokens(const KvRows *q) {
    kv_ssize row = q->H * q->D;
    return row >= 16384 || row == 0 ? 1 : 16384 / row;
}

/* The level's rows that carry the CRC for codes q (whole 64-byte rows), else NULL. */
static inline const KvFoldOps *fold_rows(const KvLevel *lv, const KvRows *q) {
    return lv->fold && q->D % 64 == 0 ? lv->fold : NULL;
}

#endif
