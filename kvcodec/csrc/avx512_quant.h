/* The AVX-512 quantize pieces avx512_quant.c and avx512_fold.c share (static inline, compiled for the
 * including file's target). */
#ifndef KV_AVX512_QUANT_H
#define KV_AVX512_QUANT_H

#include <immintrin.h>

#include "kv_bits.h"

/* --------------------------------------------------- AVX-512 quantize rows */
/* y = V / scale by a multiplication with r = 1 / scale, sixteen lanes at a time, each code taken from
 * y where it cannot differ from the code of the IEEE quotient, else from the quotient itself.
 * - With scale and r normal, y is within a relative 3 * 2^-24 of fl(V / scale) (the roundings of r,
 *   of the product, of the quotient): at most six steps of their bit patterns, even across a binade.
 * - For |y| in e4m3's normal range (2^-6 .. 448, clamped above) the cast is round-to-nearest-even at
 *   bit 20 of |y|'s bits: code = (bits + 0x7FFFF + bit 20 - (120 << 23)) >> 20, the carry moving into
 *   the exponent where the mantissa rounds up. Its midpoints are the bits whose low 20 are 0x80000.
 * - The cast is monotone, so y's code is the quotient's unless a midpoint lies within eight steps of
 *   y. Those lanes, and those below 2^-6 (e4m3's subnormals, another rounding position; zeros), take
 *   the division and the general cast (e4m3_mag16): bit for bit the division's codes. */
static inline __m512i e4m3_mag16(__m512i a) {
    a = _mm512_min_epu32(a, _mm512_set1_epi32((int)E4M3_MAX_BITS));
    __m512i e = _mm512_max_epi32(_mm512_and_si512(a, _mm512_set1_epi32(0x7F800000)),
                                 _mm512_set1_epi32((int)E4M3_MIN_EXP));
    __m512i m = _mm512_add_epi32(e, _mm512_set1_epi32(20 << 23));
    __m512i sum = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(m)));
    __m512i binades = _mm512_srli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32((int)E4M3_MIN_EXP)), 20);
    return _mm512_add_epi32(_mm512_sub_epi32(sum, m), binades);
}

/* Sixteen codes of x / scale into q. Outside e4m3's subnormals and the lanes next to a midpoint, the
 * cast is round-half-up at bit 20 of min(|y|, 448)'s bits (a tie is next to a midpoint, so it never
 * gets here): code = (bits + 0x80000 - (120 << 23)) >> 20, the carry moving into the exponent where
 * the mantissa rounds up. "Next to a midpoint" is the low 20 bits of that sum within -8 .. +7 of zero.
 * `nan_check`: `amax` keeps the largest |y| bits (the row's NaN check; encode_v has checked V). */
static inline __m512i quant16(__m512 x, __m512 vr, __m512 vs, uint8_t *q, __m512i *amax, int nan_check) {
    __m512 y = _mm512_mul_ps(x, vr);
    __m512i b = _mm512_castps_si512(y);
    if (nan_check) *amax = _mm512_max_epu32(*amax, _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)));
    __m512i c = _mm512_castps_si512(_mm512_range_ps(y, _mm512_set1_ps(448.0f), 0x0A)); /* min(|y|, 448) */
    __m512i t = _mm512_add_epi32(c, _mm512_set1_epi32(0x80000 - (120 << 23)));
    __m512i code = _mm512_srli_epi32(t, 20);
    __mmask16 redo = _mm512_testn_epi32_mask(_mm512_add_epi32(t, _mm512_set1_epi32(8)), _mm512_set1_epi32(0xFFFF0)) |
                     _mm512_cmplt_epu32_mask(c, _mm512_set1_epi32((int)E4M3_MIN_EXP));
    if (__builtin_expect(redo != 0, 0)) {
        __m512i bd = _mm512_castps_si512(_mm512_div_ps(x, vs));
        code = _mm512_mask_mov_epi32(code, redo, e4m3_mag16(_mm512_and_si512(bd, _mm512_set1_epi32(0x7FFFFFFF))));
        b = _mm512_mask_mov_epi32(b, redo, bd);
    }
    code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80), 0xF8); /* code | (sign & 0x80) */
    if (q) _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(code));
    return code;
}

/* Sixty-four codes (quant16 four times) packed into one 512-bit store: two dword->word packs, one
 * word->byte pack (each per 128-bit lane), then the lanes put in order. */
static inline __m512i quant64(const __m512 x[4], __m512 vr, __m512 vs, uint8_t *q, __m512i *amax, int nan_check) {
    __m512i c0 = quant16(x[0], vr, vs, NULL, amax, nan_check), c1 = quant16(x[1], vr, vs, NULL, amax, nan_check);
    __m512i c2 = quant16(x[2], vr, vs, NULL, amax, nan_check), c3 = quant16(x[3], vr, vs, NULL, amax, nan_check);
    __m512i w = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    w = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
    _mm512_storeu_si512((void *)q, w);
    return w;
}

/* Whether 1 / scale stands for the division: scale and its reciprocal normal (2^-125 .. 2^125). */
static inline int reciprocal_ok(float scale) {
    uint32_t e = (f32_bits(scale) >> 23) & 0xFFu;
    return e >= 2u && e <= 252u;
}

#define LOADZ_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOADZ_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define LOADZ_F32(p) _mm512_loadu_ps(p)

#endif
