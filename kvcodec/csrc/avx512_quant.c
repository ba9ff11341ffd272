/* The AVX-512 tier's quantize side (F, VL, BW, DQ): the AVX2 rows recompiled with EVEX encodings, the
 * 512-bit quantize rows, the NaN-code check and the 16-bit absmax. One target region. */
#include "kv.h"

#if KV_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")
#endif

#include "avx2_rows.h"
#include "avx512_quant.h"

QUANT_ROW_AVX2(, kv_quant_row_f16_evex, uint16_t, LOAD_F16, quant_row_f16)
QUANT_ROW_AVX2(, kv_quant_row_bf16_evex, uint16_t, LOAD_BF16, quant_row_bf16)
QUANT_ROW_AVX2(, kv_quant_row_f32_evex, float, LOAD_F32, quant_row_f32)

#define QUANT_ROW_ZMM(name, T, LOAD, fallback, nan_check)                               \
    static int name(const void *row, kv_ssize D, float scale, uint8_t *q) {    \
        if (!reciprocal_ok(scale)) return fallback(row, D, scale, q);                   \
        const T *p = (const T *)row;                                                    \
        const __m512 vr = _mm512_set1_ps(1.0f / scale), vs = _mm512_set1_ps(scale);     \
        __m512i amax = _mm512_setzero_si512();                                          \
        kv_ssize d = 0;                                                               \
        for (; d + 64 <= D; d += 64) {                                                  \
            const __m512 x[4] = {LOAD(p + d), LOAD(p + d + 16), LOAD(p + d + 32), LOAD(p + d + 48)}; \
            (void)quant64(x, vr, vs, q + d, &amax, nan_check);                          \
        }                                                                               \
        for (; d + 16 <= D; d += 16) (void)quant16(LOAD(p + d), vr, vs, q + d, &amax, nan_check); \
        int bad = _mm512_cmpgt_epu32_mask(amax, _mm512_set1_epi32(0x7F800000)) != 0;    \
        if (d < D) bad |= fallback(p + d, D - d, scale, q + d);                         \
        return bad;                                                                     \
    }

QUANT_ROW_ZMM(quant_row_f16_zmm, uint16_t, LOADZ_F16, kv_quant_row_f16_evex, 1)
QUANT_ROW_ZMM(quant_row_bf16_zmm, uint16_t, LOADZ_BF16, kv_quant_row_bf16_evex, 1)
QUANT_ROW_ZMM(quant_row_f32_zmm, float, LOADZ_F32, kv_quant_row_f32_evex, 1)
/* For V already checked finite (encode_v's scales pass): no NaN tracking. */
QUANT_ROW_ZMM(quant_row_f16_zmm_finite, uint16_t, LOADZ_F16, kv_quant_row_f16_evex, 0)
QUANT_ROW_ZMM(quant_row_bf16_zmm_finite, uint16_t, LOADZ_BF16, kv_quant_row_bf16_evex, 0)
QUANT_ROW_ZMM(quant_row_f32_zmm_finite, float, LOADZ_F32, kv_quant_row_f32_evex, 0)

static int has_nan_code_zmm(const uint8_t *q, kv_ssize D) {
    const __m512i m7f = _mm512_set1_epi8(0x7F);
    __mmask64 any = 0;
    kv_ssize d = 0;
    for (; d + 64 <= D; d += 64)
        any |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512((const void *)(q + d)), m7f), m7f);
    return any != 0 || (d < D && kv_has_nan_code_avx2(q + d, D - d));
}

/* amax_rows_u16_avx2 on 512-bit registers: 32 values a load, one reduction at the end. */
static uint16_t amax_rows_u16_zmm(const char *base, kv_ssize st, kv_ssize rows, kv_ssize D) {
    if (D % 32) return kv_amax_rows_u16_avx2(base, st, rows, D);
    const __m512i mag = _mm512_set1_epi16(0x7FFF);
    __m512i acc = _mm512_setzero_si512();
    for (kv_ssize r = 0; r < rows; r++) {
        const uint16_t *p = (const uint16_t *)(base + r * st);
        for (kv_ssize d = 0; d < D; d += 32)
            acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512((const void *)(p + d)), mag));
    }
    __m256i m = _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    __m128i x = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    x = _mm_max_epu16(x, _mm_srli_si128(x, 8));
    x = _mm_max_epu16(x, _mm_srli_si128(x, 4));
    x = _mm_max_epu16(x, _mm_srli_si128(x, 2));
    return (uint16_t)_mm_extract_epi16(x, 0);
}

/* Over the AVX2 tier's table: what this tier does differently (the dequantize side: avx512_deq.c). */
void kv_rows_avx512(KvRowOps *ops) {
    ops->level = 2;
    ops->quant[DT_F16] = quant_row_f16_zmm, ops->quant[DT_BF16] = quant_row_bf16_zmm;
    ops->quant[DT_F32] = quant_row_f32_zmm;
    ops->quant_finite[DT_F16] = quant_row_f16_zmm_finite, ops->quant_finite[DT_BF16] = quant_row_bf16_zmm_finite;
    ops->quant_finite[DT_F32] = quant_row_f32_zmm_finite;
    ops->has_nan = has_nan_code_zmm;
    ops->amax16 = amax_rows_u16_zmm;
    kv_rows_avx512_deq(ops);
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
