/* CRC-32 folded 128 bytes at a time on 128-bit lanes (PCLMULQDQ): eight independent lanes folded by
 * x^1024, then together by x^128, then Barrett-reduced. With `dst` every 16 bytes loaded are also stored
 * there (a copy and its CRC in one pass; the copy-less instance has no stores). One target region. */
#include "kv.h"

#if KV_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("pclmul,sse4.1"))), apply_to = function)
#else
#pragma GCC target("pclmul,sse4.1")
#endif

#include "crc_fold.h"

static inline __m128i crc_load128(const uint8_t *p, uint8_t *dst, size_t at) {
    __m128i d = _mm_loadu_si128((const __m128i *)(p + at));
    if (dst) _mm_storeu_si128((__m128i *)(dst + at), d);
    return d;
}

/* The state over n >= 128 bytes (a multiple of 16); dst and p do not overlap. */
__attribute__((always_inline)) static inline uint32_t crc_clmul_body(uint32_t state, uint8_t *dst, const uint8_t *p,
                                                                     size_t n) {
    const __m128i k1024 = _mm_set_epi64x(0x14a7fe880LL, 0x1e88ef372LL); /* x^(1024-32), x^(1024+32) */
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  /* x^(128-32), x^(128+32) */
    __m128i x[8];
    for (int i = 0; i < 8; i++) x[i] = crc_load128(p, dst, 16 * (size_t)i);
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)state));
    size_t at = 128;
    for (; n - at >= 128; at += 128)
        for (int i = 0; i < 8; i++) x[i] = _mm_xor_si128(crc_fold(x[i], k1024), crc_load128(p, dst, at + 16 * (size_t)i));
    __m128i a = x[0];
    for (int i = 1; i < 8; i++) a = _mm_xor_si128(crc_fold(a, k128), x[i]);
    for (; n - at >= 16; at += 16) a = _mm_xor_si128(crc_fold(a, k128), crc_load128(p, dst, at));
    return crc_reduce(a);
}

static uint32_t crc_clmul(uint32_t state, const uint8_t *p, size_t n) { return crc_clmul_body(state, NULL, p, n); }

static uint32_t crc_clmul_copy(uint32_t state, uint8_t *dst, const uint8_t *p, size_t n) {
    return crc_clmul_body(state, dst, p, n);
}

void kv_crc_clmul(KvCrcOps *ops) {
    ops->level = 1;
    ops->narrow = crc_clmul;
    ops->narrow_copy = crc_clmul_copy;
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
