/* The AVX2 + F16C + FMA tier: the same arithmetic as the scalar rows, eight lanes at a time; tails take
 * the scalar rows (kv_rows.h) compiled here. The whole file is one target region. */
#include "kv.h"

#if KV_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

#include "avx2_rows.h"

QUANT_ROW_AVX2(static, quant_row_f16_avx2, uint16_t, LOAD_F16, quant_row_f16)
QUANT_ROW_AVX2(static, quant_row_bf16_avx2, uint16_t, LOAD_BF16, quant_row_bf16)
QUANT_ROW_AVX2(static, quant_row_f32_avx2, float, LOAD_F32, quant_row_f32)

/* Sixteen codes to two vectors of float(q): the code's bits placed in an fp16
 * read as q / 256 (the exponent biases differ by 8), then times 256, exact. */
static inline void e4m3_values16(const uint8_t *q, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(~0x4000));
    const __m256 k = _mm256_set1_ps(256.0f);
    *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k);
    *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k);
}

static inline __m256i bf16_rne8(__m256 x) {
    __m256i b = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd), 16);
}

int kv_has_nan_code_avx2(const uint8_t *q, kv_ssize D) {
    const __m256i m7f = _mm256_set1_epi8(0x7F);
    __m256i any = _mm256_setzero_si256();
    kv_ssize d = 0;
    for (; d + 32 <= D; d += 32) {
        __m256i c = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(q + d)), m7f);
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(c, m7f));
    }
    return !_mm256_testz_si256(any, any) || (d < D && has_nan_code(q + d, D - d));
}

/* The largest |x| bit pattern (sign cleared) of `rows` rows of D 16-bit values `st` bytes apart: one
 * vector maximum over a whole group, one horizontal reduction at its end. */
uint16_t kv_amax_rows_u16_avx2(const char *base, kv_ssize st, kv_ssize rows, kv_ssize D) {
    const __m256i mag = _mm256_set1_epi16(0x7FFF);
    __m256i acc = _mm256_setzero_si256();
    uint16_t tail = 0;
    for (kv_ssize r = 0; r < rows; r++) {
        const uint16_t *p = (const uint16_t *)(base + r * st);
        kv_ssize d = 0;
        for (; d + 16 <= D; d += 16)
            acc = _mm256_max_epu16(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + d)), mag));
        for (; d < D; d++) tail = (uint16_t)(p[d] & 0x7FFF) > tail ? (uint16_t)(p[d] & 0x7FFF) : tail;
    }
    __m128i m = _mm_max_epu16(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    m = _mm_max_epu16(m, _mm_srli_si128(m, 8));
    m = _mm_max_epu16(m, _mm_srli_si128(m, 4));
    m = _mm_max_epu16(m, _mm_srli_si128(m, 2));
    uint16_t v = (uint16_t)_mm_extract_epi16(m, 0);
    return v > tail ? v : tail;
}

void kv_deq_row_f16_avx2(const uint8_t *q, kv_ssize D, float s, void *out) {
    uint16_t *o = (uint16_t *)out;
    const __m256 vs = _mm256_set1_ps(s);
    kv_ssize d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 lo, hi;
        e4m3_values16(q + d, &lo, &hi);
        _mm_storeu_si128((__m128i *)(o + d), _mm256_cvtps_ph(_mm256_mul_ps(lo, vs), _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128((__m128i *)(o + d + 8),
                         _mm256_cvtps_ph(_mm256_mul_ps(hi, vs), _MM_FROUND_TO_NEAREST_INT));
    }
    if (d < D) deq_row_f16(q + d, D - d, s, o + d);
}

void kv_deq_row_bf16_avx2(const uint8_t *q, kv_ssize D, float s, void *out) {
    uint16_t *o = (uint16_t *)out;
    const __m256 vs = _mm256_set1_ps(s);
    kv_ssize d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 lo, hi;
        e4m3_values16(q + d, &lo, &hi);
        __m256i w = _mm256_packus_epi32(bf16_rne8(_mm256_mul_ps(lo, vs)), bf16_rne8(_mm256_mul_ps(hi, vs)));
        _mm256_storeu_si256((__m256i *)(o + d), _mm256_permute4x64_epi64(w, 0xD8));
    }
    if (d < D) deq_row_bf16(q + d, D - d, s, o + d);
}

void kv_deq_row_f32_avx2(const uint8_t *q, kv_ssize D, float s, void *out) {
    float *o = (float *)out;
    const __m256 vs = _mm256_set1_ps(s);
    kv_ssize d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 lo, hi;
        e4m3_values16(q + d, &lo, &hi);
        _mm256_storeu_ps(o + d, _mm256_mul_ps(lo, vs));
        _mm256_storeu_ps(o + d + 8, _mm256_mul_ps(hi, vs));
    }
    if (d < D) deq_row_f32(q + d, D - d, s, o + d);
}
/* --------------------------------------------------- AVX-512 dequantize rows */

/* The absmax rows are the scalar ones compiled for this ISA (what the old x86-64-v3 clones were). */
/* Over the scalar tier's table: what this tier does differently. */
void kv_rows_avx2(KvRowOps *ops) {
    ops->level = 1;
    ops->amax[DT_F16] = amax_row_f16, ops->amax[DT_BF16] = amax_row_bf16, ops->amax[DT_F32] = amax_row_f32;
    ops->quant[DT_F16] = ops->quant_finite[DT_F16] = quant_row_f16_avx2;
    ops->quant[DT_BF16] = ops->quant_finite[DT_BF16] = quant_row_bf16_avx2;
    ops->quant[DT_F32] = ops->quant_finite[DT_F32] = quant_row_f32_avx2;
    ops->deq[DT_F16] = kv_deq_row_f16_avx2, ops->deq[DT_BF16] = kv_deq_row_bf16_avx2;
    ops->deq[DT_F32] = kv_deq_row_f32_avx2;
    ops->has_nan = kv_has_nan_code_avx2;
    ops->amax16 = kv_amax_rows_u16_avx2;
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
