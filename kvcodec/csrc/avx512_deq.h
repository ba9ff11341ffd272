/* The AVX-512 dequantize pieces avx512_deq.c and avx512_fold.c share (static inline, compiled for the
 * including file's target). */
#ifndef KV_AVX512_DEQ_H
#define KV_AVX512_DEQ_H

#include <immintrin.h>

#include "kv_bits.h"

/* The same products sixteen codes at a time on 512-bit registers (simd level 2), float(q) built from
 * the code's bits by integer operations rather than through fp16 (the conversions are the slow part):
 * exponent e and mantissa m placed under a biased exponent give 2^e (1 + m / 8) = float(q) * 2^7 for a
 * normal code; a subnormal one (e = 0) is 2 (1 + m / 8) - 2 = m / 4, exact. The factor 2^7 goes into
 * the scale, s * 2^-7, exact where s is zero or at least 2^-119 (else the AVX2 row runs), so
 * (float(q) * 2^7) * (s * 2^-7) is the same real product as float(q) * s and rounds the same. */

static inline __m512 e4m3_x128(__m128i codes) {
    __m512i c = _mm512_cvtepu8_epi32(codes);
    __m512i mag = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)), 20);
    __m512 f = _mm512_castsi512_ps(_mm512_add_epi32(mag, _mm512_set1_epi32(127 << 23)));
    __mmask16 sub = _mm512_testn_epi32_mask(c, _mm512_set1_epi32(0x78));
    f = _mm512_mask_sub_ps(f, sub, _mm512_add_ps(f, f), _mm512_set1_ps(2.0f));
    __m512i sign = _mm512_slli_epi32(c, 24); /* bit 7 to bit 31 */
    return _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(_mm512_castps_si512(f), sign, _mm512_set1_epi32((int)0x80000000u), 0xF8));
}

/* s * 2^-7 where that is exact (s zero or |s| >= 2^-119, finite): *ok; else *ok cleared. */
static inline float scale_div128(float s, int *ok) {
    uint32_t e = (f32_bits(s) >> 23) & 0xFFu;
    *ok = (f32_bits(s) & 0x7FFFFFFFu) == 0 || (e >= 8u && e < 255u);
    return *ok ? s * 0.0078125f : 0.0f;
}

static inline __m512i bf16_rne16(__m512 x) {
    __m512i b = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
}

static inline void store16_f16(uint16_t *o, __m512 x) {
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static inline void store16_bf16(uint16_t *o, __m512 x) {
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(bf16_rne16(x)));
}

static inline void store16_f32(float *o, __m512 x) { _mm512_storeu_ps(o, x); }

/* A group's 128 magnitudes looked up rather than computed: every code of one scale gives one of 128
 * results (the sign of the code flips the sign of the result: rounding is symmetric), so per head the
 * 128 fp16 / bf16 results of the current scale are built once (eight vectors of the row arithmetic
 * above) and each row becomes table lookups, 32 codes per pair of permutes (VPERMI2W over the four
 * registers of the table). A table is rebuilt when its head's scale changes (per page for
 * per_page_head: 16 tokens of rows per build). Heads beyond TABLE_HEADS, fp32 output and scales
 * whose 2^-7 product is not exact take the rows above. Used by the dense decode (dequantize). */
static __attribute__((unused)) void build_table(uint16_t *tab, float s128, int odt) {
    const __m512 vs = _mm512_set1_ps(s128);
    const __m128i lane = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < 128; i += 16) {
        __m512 x = _mm512_mul_ps(e4m3_x128(_mm_add_epi8(lane, _mm_set1_epi8((char)i))), vs);
        if (odt == DT_F16)
            store16_f16(tab + i, x);
        else
            store16_bf16(tab + i, x);
    }
}

/* Head h's table for scale s, built if it holds another; NULL where the rows must compute. */
static inline const uint16_t *table_for(DeqTables *t, kv_ssize h, float s) {
    int ok;
    float s128 = scale_div128(s, &ok);
    if (!ok || h >= TABLE_HEADS) return NULL;
    if (t->bits[h] != f32_bits(s)) {
        build_table(t->tab[h], s128, t->odt);
        t->bits[h] = f32_bits(s);
    }
    return t->tab[h];
}

/* A table's four registers, and the 32 results of 32 codes looked up in them. */
typedef struct {
    __m512i t0, t1, t2, t3;
} Table4;

static inline Table4 table4(const uint16_t *tab) {
    Table4 t = {_mm512_load_si512((const void *)tab), _mm512_load_si512((const void *)(tab + 32)),
                _mm512_load_si512((const void *)(tab + 64)), _mm512_load_si512((const void *)(tab + 96))};
    return t;
}

static inline __m512i table32(const Table4 *t, __m256i codes) {
    __m512i idx = _mm512_cvtepu8_epi16(codes);
    __m512i lo = _mm512_permutex2var_epi16(t->t0, idx, t->t1); /* codes' bits 0-5 pick the word */
    __m512i hi = _mm512_permutex2var_epi16(t->t2, idx, t->t3);
    __m512i v = _mm512_mask_mov_epi16(lo, _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x40)), hi);
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(idx, 8), _mm512_set1_epi16((short)0x8000),
                                     0x78); /* v ^ (code's sign) */
}

#endif
