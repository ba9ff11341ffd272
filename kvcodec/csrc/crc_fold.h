/* CRC-32 folding pieces the folds share (static inline, compiled for the including file's target, which
 * has PCLMULQDQ; the 512-bit ones where it defines KV_CRC_FOLD_512: VPCLMULQDQ and AVX-512). The constants are x^n mod P
 * bit-reflected; tests/backends/test_cpu_crc.py derives them from the polynomial. */
#ifndef KV_CRC_FOLD_H
#define KV_CRC_FOLD_H

#include <immintrin.h>

/* x * (k_lo, k_hi): the 128-bit lane x moved 2n bits ahead, as two carry-less products (low qword by
 * the first constant, high qword by the second). */
static inline __m128i crc_fold(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

/* The folded 128 bits to the 32-bit state: 128 -> 64 bits (x^64), then Barrett reduction by
 * P' = 0x1DB710641, mu = 0x1F7011641. */
static __attribute__((unused)) uint32_t crc_reduce(__m128i a) {
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    const __m128i mask32 = _mm_setr_epi32(-1, 0, -1, 0);
    __m128i t = _mm_clmulepi64_si128(a, k128, 0x10);
    a = _mm_xor_si128(_mm_srli_si128(a, 8), t);
    t = _mm_srli_si128(a, 4);
    a = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(a, mask32), _mm_set_epi64x(0, 0x163cd6124LL), 0x00), t);
    const __m128i poly = _mm_set_epi64x(0x1f7011641LL, 0x1db710641LL);
    t = _mm_clmulepi64_si128(_mm_and_si128(a, mask32), poly, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(a, t), 1);
}

#ifdef KV_CRC_FOLD_512 /* defined by the files compiled for VPCLMULQDQ and AVX-512 */
static inline __m512i crc_fold512(__m512i x, __m512i k, __m512i data) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     data, 0x96);
}

static inline __m512i crc_load512(const uint8_t *p, uint8_t *dst, size_t at) {
    __m512i d = _mm512_loadu_si512((const void *)(p + at));
    if (dst) _mm512_storeu_si512((void *)(dst + at), d);
    return d;
}

/* A 512-bit register's four 128-bit lanes (the first the earliest bytes) folded into one by x^128. */
static inline __m128i crc_lanes(__m512i a) {
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    __m128i b = _mm512_castsi512_si128(a);
    b = _mm_xor_si128(crc_fold(b, k128), _mm512_extracti32x4_epi32(a, 1));
    b = _mm_xor_si128(crc_fold(b, k128), _mm512_extracti32x4_epi32(a, 2));
    return _mm_xor_si128(crc_fold(b, k128), _mm512_extracti32x4_epi32(a, 3));
}

#endif

#endif
