/* K's byte planes for the lossless payload (docs/FORMAT.md, "Lossless payload"): a 16-bit K
 * [tokens, heads, head_dim] split into its high bytes laid out channel by channel per head
 * [heads, head_dim, tokens] and its low bytes [tokens, heads, head_dim], and merged back; one pass over
 * K's bytes each way. Where SSE2 is there (every x86-64), blocks of 8 tokens x 8 channels: eight 8-byte
 * runs of the high plane transposed in registers and interleaved with the low bytes, 16 bytes of K a
 * store (or the reverse), two such blocks at once where AVX2 is there; elsewhere (and in the portable
 * build, so that its tests run it), and for the
 * edges, portable C eight tokens at a time, so that each channel's high bytes are written (or read) as
 * one 8-byte run. py_planes.c is the entry. */
#include "planes.h"

#include "kv.h"

#include <string.h>

#if defined(__SSE2__) && !defined(KV_PORTABLE_ONLY)
#include <emmintrin.h>
#define PLANES_SSE2 1

/* 8 rows of 8 bytes (each in a register's low half) transposed: out[j] holds column 2j in its low half
 * and column 2j + 1 in its high half. */
static inline void transpose8(const __m128i a[8], __m128i out[4]) {
    __m128i t0 = _mm_unpacklo_epi8(a[0], a[1]), t1 = _mm_unpacklo_epi8(a[2], a[3]);
    __m128i t2 = _mm_unpacklo_epi8(a[4], a[5]), t3 = _mm_unpacklo_epi8(a[6], a[7]);
    __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1);
    __m128i u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
    out[0] = _mm_unpacklo_epi32(u0, u2);
    out[1] = _mm_unpackhi_epi32(u0, u2);
    out[2] = _mm_unpacklo_epi32(u1, u3);
    out[3] = _mm_unpackhi_epi32(u1, u3);
}

/* Tokens [t, t + 8) x channels [e, e + 8). */
static inline void merge_block(const uint8_t *hi, const uint8_t *lo, uint8_t *k, size_t T, size_t E, size_t t,
                               size_t e) {
    __m128i a[8], c[4];
    for (int i = 0; i < 8; i++) a[i] = _mm_loadl_epi64((const __m128i *)(hi + (e + i) * T + t));
    transpose8(a, c);
    for (int j = 0; j < 8; j++) {
        __m128i h = (j & 1) ? _mm_srli_si128(c[j >> 1], 8) : c[j >> 1];
        __m128i l = _mm_loadl_epi64((const __m128i *)(lo + (t + j) * E + e));
        _mm_storeu_si128((__m128i *)(k + 2 * ((t + j) * E + e)), _mm_unpacklo_epi8(l, h));
    }
}

static inline void split_block(const uint8_t *k, uint8_t *hi, uint8_t *lo, size_t T, size_t E, size_t t, size_t e) {
    const __m128i low = _mm_set1_epi16(0x00ff);
    __m128i a[8], c[4];
    for (int j = 0; j < 8; j++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(k + 2 * ((t + j) * E + e)));
        _mm_storel_epi64((__m128i *)(lo + (t + j) * E + e), _mm_packus_epi16(_mm_and_si128(x, low), x));
        a[j] = _mm_packus_epi16(_mm_srli_epi16(x, 8), x);
    }
    transpose8(a, c);
    for (int i = 0; i < 8; i++) {
        __m128i r = (i & 1) ? _mm_srli_si128(c[i >> 1], 8) : c[i >> 1];
        _mm_storel_epi64((__m128i *)(hi + (e + i) * T + t), r);
    }
}

/* AVX2: two 8 x 8 blocks at once, tokens [t, t + 8) in the low 128-bit lane and [t + 8, t + 16) in the
 * high one (the unpacks work lane by lane), so each shuffle does twice the work: a 256-token blob of
 * 8 x 128 channels split 1.6x and merged 1.1-1.2x as fast as by the SSE2 blocks (one Xeon core). */
#include <immintrin.h>
#define PLANES_AVX2 1

/* Two 8-byte runs in the low halves of a 256-bit register's lanes. */
__attribute__((target("avx2"))) static inline __m256i load2x8(const uint8_t *a, const uint8_t *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)a)),
                                   _mm_loadl_epi64((const __m128i *)b), 1);
}

/* transpose8 on both 128-bit lanes at once. */
__attribute__((target("avx2"))) static inline void transpose8x2(const __m256i a[8], __m256i out[4]) {
    __m256i t0 = _mm256_unpacklo_epi8(a[0], a[1]), t1 = _mm256_unpacklo_epi8(a[2], a[3]);
    __m256i t2 = _mm256_unpacklo_epi8(a[4], a[5]), t3 = _mm256_unpacklo_epi8(a[6], a[7]);
    __m256i u0 = _mm256_unpacklo_epi16(t0, t1), u1 = _mm256_unpackhi_epi16(t0, t1);
    __m256i u2 = _mm256_unpacklo_epi16(t2, t3), u3 = _mm256_unpackhi_epi16(t2, t3);
    out[0] = _mm256_unpacklo_epi32(u0, u2);
    out[1] = _mm256_unpackhi_epi32(u0, u2);
    out[2] = _mm256_unpacklo_epi32(u1, u3);
    out[3] = _mm256_unpackhi_epi32(u1, u3);
}

/* Tokens [t, t + 16) x channels [e, e + 8). */
__attribute__((target("avx2"))) static inline void merge_block16(const uint8_t *hi, const uint8_t *lo, uint8_t *k,
                                                                 size_t T, size_t E, size_t t, size_t e) {
    __m256i a[8], c[4];
    for (int i = 0; i < 8; i++) a[i] = load2x8(hi + (e + i) * T + t, hi + (e + i) * T + t + 8);
    transpose8x2(a, c);
    for (int j = 0; j < 8; j++) {
        __m256i h = (j & 1) ? _mm256_srli_si256(c[j >> 1], 8) : c[j >> 1];
        __m256i r = _mm256_unpacklo_epi8(load2x8(lo + (t + j) * E + e, lo + (t + 8 + j) * E + e), h);
        _mm_storeu_si128((__m128i *)(k + 2 * ((t + j) * E + e)), _mm256_castsi256_si128(r));
        _mm_storeu_si128((__m128i *)(k + 2 * ((t + 8 + j) * E + e)), _mm256_extracti128_si256(r, 1));
    }
}

__attribute__((target("avx2"))) static inline void split_block16(const uint8_t *k, uint8_t *hi, uint8_t *lo, size_t T,
                                                                 size_t E, size_t t, size_t e) {
    const __m256i low = _mm256_set1_epi16(0x00ff);
    __m256i a[8], c[4];
    for (int j = 0; j < 8; j++) {
        const uint8_t *r0 = k + 2 * ((t + j) * E + e), *r1 = k + 2 * ((t + 8 + j) * E + e);
        __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)r0)),
                                            _mm_loadu_si128((const __m128i *)r1), 1);
        __m256i l = _mm256_packus_epi16(_mm256_and_si256(x, low), x);
        _mm_storel_epi64((__m128i *)(lo + (t + j) * E + e), _mm256_castsi256_si128(l));
        _mm_storel_epi64((__m128i *)(lo + (t + 8 + j) * E + e), _mm256_extracti128_si256(l, 1));
        a[j] = _mm256_packus_epi16(_mm256_srli_epi16(x, 8), x);
    }
    transpose8x2(a, c);
    for (int j = 0; j < 4; j++) { /* channels e + 2j, e + 2j + 1: tokens t .. t + 8 from the low lane, the
                                    * rest from the high (immediates constant at any optimization level) */
        __m256i even = _mm256_permute4x64_epi64(c[j], 0x08), odd = _mm256_permute4x64_epi64(c[j], 0x0D);
        _mm_storeu_si128((__m128i *)(hi + (e + 2 * j) * T + t), _mm256_castsi256_si128(even));
        _mm_storeu_si128((__m128i *)(hi + (e + 2 * j + 1) * T + t), _mm256_castsi256_si128(odd));
    }
}

/* A 16 x 16 byte transpose in each 128-bit lane of r[0 .. 16): lane L of r[j] becomes column j of the
 * 16 x 16 matrix whose row i was lane L of r[i]. Four rounds of unpacks, 64 in all (bytes, words,
 * dwords, qwords). */
__attribute__((target("avx2"))) static inline void transpose16x2(__m256i r[16]) {
    __m256i a[16], b[16];
    for (int i = 0; i < 8; i++) { /* rows 2i, 2i + 1: byte pairs, columns 0-7 then 8-15 */
        a[2 * i] = _mm256_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int q = 0; q < 4; q++) /* rows 4q .. 4q + 3: word quads of columns 4g .. 4g + 3 in b[4q + g] */
        for (int h = 0; h < 2; h++) {
            b[4 * q + 2 * h] = _mm256_unpacklo_epi16(a[4 * q + h], a[4 * q + 2 + h]);
            b[4 * q + 2 * h + 1] = _mm256_unpackhi_epi16(a[4 * q + h], a[4 * q + 2 + h]);
        }
    for (int h = 0; h < 2; h++) /* rows 8h .. 8h + 7: columns 2c, 2c + 1 in a[8h + c] */
        for (int g = 0; g < 4; g++) {
            a[8 * h + 2 * g] = _mm256_unpacklo_epi32(b[8 * h + g], b[8 * h + 4 + g]);
            a[8 * h + 2 * g + 1] = _mm256_unpackhi_epi32(b[8 * h + g], b[8 * h + 4 + g]);
        }
    for (int c = 0; c < 8; c++) { /* all 16 rows: columns 2c and 2c + 1 */
        r[2 * c] = _mm256_unpacklo_epi64(a[c], a[8 + c]);
        r[2 * c + 1] = _mm256_unpackhi_epi64(a[c], a[8 + c]);
    }
}

/* Tokens [t, t + 16) x channels [e, e + 32): sixteen 16-byte runs of each half's high bytes transposed
 * in the two lanes at once, each token's 32 high bytes then interleaved with its 32 low bytes (the
 * unpacks give channels e .. e + 7 and e + 16 .. e + 23 in one register, e + 8 .. e + 15 and e + 24 ..
 * e + 31 in the other, put back in order for two 32-byte stores). Half the shuffles a byte of
 * merge_block16's 8 x 8 blocks. */
__attribute__((target("avx2"))) static inline void merge_block32(const uint8_t *hi, const uint8_t *lo, uint8_t *k,
                                                                 size_t T, size_t E, size_t t, size_t e) {
    __m256i r[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm256_loadu2_m128i((const __m128i *)(hi + (e + 16 + i) * T + t), (const __m128i *)(hi + (e + i) * T + t));
    transpose16x2(r);
    for (int j = 0; j < 16; j++) {
        __m256i l = _mm256_loadu_si256((const __m256i *)(lo + (t + j) * E + e));
        __m256i u = _mm256_unpacklo_epi8(l, r[j]), v = _mm256_unpackhi_epi8(l, r[j]);
        uint8_t *row = k + 2 * ((t + j) * E + e);
        _mm256_storeu_si256((__m256i *)row, _mm256_permute2x128_si256(u, v, 0x20));
        _mm256_storeu_si256((__m256i *)(row + 32), _mm256_permute2x128_si256(u, v, 0x31));
    }
}

/* merge_block32's reverse: each token's 32 channels split (the low bytes put back in order by one
 * qword permute; the high bytes left in the packs' order, which the stores follow), the sixteen
 * tokens' high bytes transposed into each channel's 16-byte run. */
__attribute__((target("avx2"))) static inline void split_block32(const uint8_t *k, uint8_t *hi, uint8_t *lo, size_t T,
                                                                 size_t E, size_t t, size_t e) {
    const __m256i low = _mm256_set1_epi16(0x00ff);
    __m256i r[16];
    for (int j = 0; j < 16; j++) {
        const uint8_t *row = k + 2 * ((t + j) * E + e);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)row), x1 = _mm256_loadu_si256((const __m256i *)(row + 32));
        __m256i l = _mm256_packus_epi16(_mm256_and_si256(x0, low), _mm256_and_si256(x1, low));
        _mm256_storeu_si256((__m256i *)(lo + (t + j) * E + e), _mm256_permute4x64_epi64(l, 0xD8));
        r[j] = _mm256_packus_epi16(_mm256_srli_epi16(x0, 8), _mm256_srli_epi16(x1, 8));
    }
    transpose16x2(r); /* r[c]: lane 0 channel e + c (c < 8) or e + 8 + c; lane 1 eight channels on */
    for (int c = 0; c < 16; c++) {
        size_t c0 = e + (c < 8 ? c : c + 8);
        _mm_storeu_si128((__m128i *)(hi + c0 * T + t), _mm256_castsi256_si128(r[c]));
        _mm_storeu_si128((__m128i *)(hi + (c0 + 8) * T + t), _mm256_extracti128_si256(r[c], 1));
    }
}

/* Whole 16 x 8 blocks of tokens [t, t + 16), channels [0, E - E % 8). */
__attribute__((target("avx2"))) static void merge_row16(const uint8_t *hi, const uint8_t *lo, uint8_t *k, size_t T,
                                                        size_t E, size_t t) {
    size_t e = 0;
    for (; e + 32 <= E; e += 32) merge_block32(hi, lo, k, T, E, t, e);
    for (; e + 8 <= E; e += 8) merge_block16(hi, lo, k, T, E, t, e);
}

/* The split reads sixteen rows of K at once, 16 bytes of each a block, which the hardware's prefetchers
 * follow poorly from memory: each 64 bytes of the next sixteen rows are fetched while these are split
 * (C harness, a 256-token blob of 8 x 128 from memory: 50 -> 36 us; from L3 26 -> 28 us; the bench's
 * lossless encode 3% faster: its K, like a connector's, comes from memory). */
__attribute__((target("avx2"))) static void split_row16(const uint8_t *k, uint8_t *hi, uint8_t *lo, size_t T,
                                                        size_t E, size_t t) {
    int ahead = t + 32 <= T;
    size_t e = 0;
    for (; e + 32 <= E; e += 32) {
        if (ahead) /* the next 16 tokens' same 64 bytes of each row */
            for (size_t j = 0; j < 16; j++) __builtin_prefetch(k + 2 * ((t + 16 + j) * E + e), 0, 2);
        split_block32(k, hi, lo, T, E, t, e);
    }
    for (; e + 8 <= E; e += 8) {
        if (ahead && e % 32 == 0)
            for (size_t j = 0; j < 16; j++) __builtin_prefetch(k + 2 * ((t + 16 + j) * E + e), 0, 2);
        split_block16(k, hi, lo, T, E, t, e);
    }
}

#endif

#define RUN 8 /* tokens per pass: one 8-byte run of a channel's high bytes */

/* Tokens [t, t + 8), channels from e: portable C, one 8-byte run of each channel's high bytes. */
static void split_tail(const uint8_t *k, uint8_t *hi, uint8_t *lo, size_t T, size_t E, size_t t, size_t e) {
    for (; e < E; e++) {
        uint8_t run[RUN];
        for (size_t j = 0; j < RUN; j++) {
            const uint8_t *p = k + 2 * ((t + j) * E + e);
            lo[(t + j) * E + e] = p[0];
            run[j] = p[1];
        }
        memcpy(hi + e * T + t, run, RUN);
    }
}

static void merge_tail(const uint8_t *hi, const uint8_t *lo, uint8_t *k, size_t T, size_t E, size_t t, size_t e) {
    for (; e < E; e++) {
        uint8_t run[RUN];
        memcpy(run, hi + e * T + t, RUN);
        for (size_t j = 0; j < RUN; j++) {
            uint8_t *p = k + 2 * ((t + j) * E + e);
            p[0] = lo[(t + j) * E + e];
            p[1] = run[j];
        }
    }
}

void kv_planes_split(const uint8_t *k, uint8_t *hi, uint8_t *lo, size_t T, size_t E) {
    size_t t = 0;
#ifdef PLANES_AVX2
    if (kv_best_simd() >= 1) /* dispatch.c's level: the CPU's, capped by KVCODEC_CPU_LEVEL */
        for (; t + 2 * RUN <= T; t += 2 * RUN) {
            split_row16(k, hi, lo, T, E, t);
            split_tail(k, hi, lo, T, E, t, E - E % 8);
            split_tail(k, hi, lo, T, E, t + RUN, E - E % 8);
        }
#endif
    for (; t + RUN <= T; t += RUN) {
        size_t e = 0;
#ifdef PLANES_SSE2
        for (; e + 8 <= E; e += 8) split_block(k, hi, lo, T, E, t, e);
#endif
        split_tail(k, hi, lo, T, E, t, e);
    }
    for (; t < T; t++) {
        for (size_t e = 0; e < E; e++) {
            lo[t * E + e] = k[2 * (t * E + e)];
            hi[e * T + t] = k[2 * (t * E + e) + 1];
        }
    }
}

void kv_planes_merge(const uint8_t *hi, const uint8_t *lo, uint8_t *k, size_t T, size_t E) {
    size_t t = 0;
#ifdef PLANES_AVX2
    if (kv_best_simd() >= 1) /* dispatch.c's level: the CPU's, capped by KVCODEC_CPU_LEVEL */
        for (; t + 2 * RUN <= T; t += 2 * RUN) {
            merge_row16(hi, lo, k, T, E, t);
            merge_tail(hi, lo, k, T, E, t, E - E % 8);
            merge_tail(hi, lo, k, T, E, t + RUN, E - E % 8);
        }
#endif
    for (; t + RUN <= T; t += RUN) {
        size_t e = 0;
#ifdef PLANES_SSE2
        for (; e + 8 <= E; e += 8) merge_block(hi, lo, k, T, E, t, e);
#endif
        merge_tail(hi, lo, k, T, E, t, e);
    }
    for (; t < T; t++) {
        for (size_t e = 0; e < E; e++) {
            k[2 * (t * E + e)] = lo[t * E + e];
            k[2 * (t * E + e) + 1] = hi[e * T + t];
        }
    }
}
