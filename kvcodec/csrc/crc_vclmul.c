/* CRC-32 folded four 128-bit lanes per instruction (VPCLMULQDQ on 512-bit registers, as ISA-L's by16
 * loops): four registers of 64 bytes folded by x^2048 per 256 bytes, then together by x^512, then their
 * lanes by x^128. With `dst` every loaded register is also stored there (a copy in the same pass; the
 * compiler drops the stores from the copy-less instance). n >= 256, a multiple of 16. One target region. */
#include "kv.h"

#if KV_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,vpclmulqdq,pclmul,sse4.1"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,vpclmulqdq,pclmul,sse4.1")
#endif

#define KV_CRC_FOLD_512 1
#include "crc_fold.h"

__attribute__((always_inline)) static inline uint32_t crc_vclmul_body(uint32_t state, uint8_t *dst, const uint8_t *p,
                                                                      size_t n) {
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1322d1430LL, 0x11542778aLL)); /* x^(2048-+32) */
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL));  /* x^(512-+32) */
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    __m512i x0 = crc_load512(p, dst, 0), x1 = crc_load512(p, dst, 64);
    __m512i x2 = crc_load512(p, dst, 128), x3 = crc_load512(p, dst, 192);
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)state)));
    size_t at = 256;
    for (; n - at >= 256; at += 256) {
        x0 = crc_fold512(x0, k2048, crc_load512(p, dst, at));
        x1 = crc_fold512(x1, k2048, crc_load512(p, dst, at + 64));
        x2 = crc_fold512(x2, k2048, crc_load512(p, dst, at + 128));
        x3 = crc_fold512(x3, k2048, crc_load512(p, dst, at + 192));
    }
    __m512i a = crc_fold512(crc_fold512(crc_fold512(x0, k512, x1), k512, x2), k512, x3);
    for (; n - at >= 64; at += 64) a = crc_fold512(a, k512, crc_load512(p, dst, at));
    __m128i b = crc_lanes(a);
    for (; at < n; at += 16) {
        __m128i d = _mm_loadu_si128((const __m128i *)(p + at));
        if (dst) _mm_storeu_si128((__m128i *)(dst + at), d);
        b = _mm_xor_si128(crc_fold(b, k128), d);
    }
    return crc_reduce(b);
}

static uint32_t crc_vclmul(uint32_t state, const uint8_t *p, size_t n) {
    return crc_vclmul_body(state, NULL, p, n);
}

static uint32_t crc_vclmul_copy(uint32_t state, uint8_t *dst, const uint8_t *p, size_t n) {
    return crc_vclmul_body(state, dst, p, n);
}

void kv_crc_vclmul(KvCrcOps *ops) {
    ops->level = 2;
    ops->wide = crc_vclmul;
    ops->wide_copy = crc_vclmul_copy;
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
