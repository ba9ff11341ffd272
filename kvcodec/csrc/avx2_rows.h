/* The AVX2 quantize rows, a template: avx2.c instantiates them for AVX2 + FMA + F16C, avx512_quant.c
 * for AVX-512VL (EVEX encodings and 32 vector registers, so the quantize loop keeps its constants and
 * four lanes of work in registers). Included after the file's target pragma. */
#ifndef KV_AVX2_ROWS_H
#define KV_AVX2_ROWS_H

#include <immintrin.h>

#include "kv_rows.h"

/* e4m3_code, eight lanes at a time. `amax` keeps the largest |y| bits seen,
 * for the row's NaN check (above the infinity's bits) at its end. */
static inline __m256i e4m3_codes8(__m256 y, __m256i *amax) {
    const __m256i b = _mm256_castps_si256(y);
    __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
    *amax = _mm256_max_epu32(*amax, a);
    a = _mm256_min_epu32(a, _mm256_set1_epi32((int)E4M3_MAX_BITS));
    __m256i e = _mm256_max_epi32(_mm256_and_si256(a, _mm256_set1_epi32(0x7F800000)),
                                 _mm256_set1_epi32((int)E4M3_MIN_EXP));
    __m256i m = _mm256_add_epi32(e, _mm256_set1_epi32(20 << 23));
    __m256i sum = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(m)));
    __m256i binades = _mm256_srli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32((int)E4M3_MIN_EXP)), 20);
    __m256i code = _mm256_add_epi32(_mm256_sub_epi32(sum, m), binades);
    return _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80)));
}

/* Four vectors of eight codes (0..255 in int32 lanes) to 32 bytes in order. */
static inline void store_codes32(uint8_t *q, __m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, b);
}

#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD_F32(p) _mm256_loadu_ps(p)

#define QUANT_ROW_AVX2(linkage, name, T, LOAD, tail)                             \
    linkage int name(const void *row, kv_ssize D, float scale, uint8_t *q) {    \
        const T *p = (const T *)row;                                              \
        const __m256 vs = _mm256_set1_ps(scale);                                  \
        __m256i amax = _mm256_setzero_si256();                                    \
        kv_ssize d = 0;                                                         \
        for (; d + 32 <= D; d += 32) {                                            \
            __m256i c0 = e4m3_codes8(_mm256_div_ps(LOAD(p + d), vs), &amax);      \
            __m256i c1 = e4m3_codes8(_mm256_div_ps(LOAD(p + d + 8), vs), &amax);  \
            __m256i c2 = e4m3_codes8(_mm256_div_ps(LOAD(p + d + 16), vs), &amax); \
            __m256i c3 = e4m3_codes8(_mm256_div_ps(LOAD(p + d + 24), vs), &amax); \
            store_codes32(q + d, c0, c1, c2, c3);                                 \
        }                                                                         \
        __m256i nan = _mm256_cmpgt_epi32(amax, _mm256_set1_epi32(0x7F800000));    \
        int bad = !_mm256_testz_si256(nan, nan);                                  \
        if (d < D) bad |= tail(p + d, D - d, scale, q + d);                       \
        return bad;                                                               \
    }


#endif
