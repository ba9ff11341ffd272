/* The scalar rows: a template each tier instantiates (static inline, compiled for the including file's
 * ISA). scalar.c's instances are the scalar tier; the vector tiers call theirs for tails. */
#ifndef KV_ROWS_H
#define KV_ROWS_H

#include "kv_bits.h"

/* Out of line, as separate functions (the vector rows call them for tails only: inlined, they would
 * bloat every vector row's prologue). Unused in some tiers. */
#define KV_ROW static __attribute__((noinline, unused))

/* amax(|x|) of one row as fp32, on raw bits: for non-negative IEEE values the
 * bit pattern orders like the value, and a NaN (bits above the infinity's)
 * comes out non-finite, which the caller refuses as the reference does. */

KV_ROW float amax_row_f16(const void *row, kv_ssize D) {
    const uint16_t *p = (const uint16_t *)row;
    uint16_t m = 0;
    for (kv_ssize d = 0; d < D; d++) {
        uint16_t a = p[d] & 0x7FFF;
        m = a > m ? a : m;
    }
    return f16_to_f32(m);
}

KV_ROW float amax_row_bf16(const void *row, kv_ssize D) {
    const uint16_t *p = (const uint16_t *)row;
    uint16_t m = 0;
    for (kv_ssize d = 0; d < D; d++) {
        uint16_t a = p[d] & 0x7FFF;
        m = a > m ? a : m;
    }
    return bf16_to_f32(m);
}

KV_ROW float amax_row_f32(const void *row, kv_ssize D) {
    const uint32_t *p = (const uint32_t *)row;
    uint32_t m = 0;
    for (kv_ssize d = 0; d < D; d++) {
        uint32_t a = p[d] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return bits_f32(m);
}

/* Each row returns whether it met a NaN (its code would not be torch's). Inf saturates, as in torch. */
#define QUANT_ROW(name, T, widen)                                                         \
    KV_ROW int name(const void *row, kv_ssize D, float scale, uint8_t *q) {   \
        const T *p = (const T *)row;                                                      \
        uint32_t nan = 0;                                                                 \
        for (kv_ssize d = 0; d < D; d++) {                                              \
            float y = widen(p[d]) / scale;                                                \
            nan |= (f32_bits(y) & 0x7FFFFFFFu) > 0x7F800000u;                             \
            q[d] = e4m3_code(y);                                                          \
        }                                                                                 \
        return nan != 0;                                                                  \
    }

static inline float f32_id(float x) { return x; }
QUANT_ROW(quant_row_f16, uint16_t, f16_to_f32)
QUANT_ROW(quant_row_bf16, uint16_t, bf16_to_f32)
QUANT_ROW(quant_row_f32, float, f32_id)

/* Whether a row holds a NaN code (0x7F or 0xFF). */
KV_ROW int has_nan_code(const uint8_t *q, kv_ssize D) {
    uint8_t any = 0;
    for (kv_ssize d = 0; d < D; d++) any |= (uint8_t)((q[d] & 0x7F) == 0x7F);
    return any != 0;
}

KV_ROW void deq_row_f16(const uint8_t *q, kv_ssize D, float s, void *out) {
    uint16_t *o = (uint16_t *)out;
    for (kv_ssize d = 0; d < D; d++) o[d] = f32_to_f16(e4m3_value(q[d]) * s);
}

KV_ROW void deq_row_bf16(const uint8_t *q, kv_ssize D, float s, void *out) {
    uint16_t *o = (uint16_t *)out;
    for (kv_ssize d = 0; d < D; d++) o[d] = f32_to_bf16(e4m3_value(q[d]) * s);
}

KV_ROW void deq_row_f32(const uint8_t *q, kv_ssize D, float s, void *out) {
    float *o = (float *)out;
    for (kv_ssize d = 0; d < D; d++) o[d] = e4m3_value(q[d]) * s;
}

#endif
