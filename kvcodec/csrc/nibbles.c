/* V's codes split into exponents and sign + mantissa nibbles, and merged (nibbles.h). One pass each way
 * over a row of head_dim codes at a time (a row's exponents are contiguous in its head's plane): 32 codes
 * a step with AVX2 where the rows allow it (head_dim a multiple of 32), 8 a step in 64-bit words where
 * head_dim is a multiple of 8, a code at a time otherwise. py_planes.c is the entry. */
#include "nibbles.h"

#include "kv.h"

#include <string.h>

/* The 64-bit word path reads code i from byte i of a little-endian word; a big-endian CPU takes the
 * scalar loop. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define NIBBLES_WORDS 0
#else
#define NIBBLES_WORDS 1
#endif

#define EXP_MASK 0x0F0F0F0F0F0F0F0Full
#define MANT_MASK 0x0707070707070707ull
#define SIGN_MASK 0x0808080808080808ull

static inline uint64_t ld64(const uint8_t *p) {
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
}

/* The nibble a code keeps raw: its sign (bit 7) as bit 3, its mantissa (bits 0..2). */
static inline uint8_t raw_nibble(uint8_t x) { return (uint8_t)(((x >> 4) & 8) | (x & 7)); }
static inline uint8_t code_of(uint8_t e, uint8_t s) { return (uint8_t)(((s & 8) << 4) | ((e & 15) << 3) | (s & 7)); }

/* Eight bytes below 16 as four bytes of two (byte i: nibbles 2i and 2i + 1). */
static inline uint32_t pack8(uint64_t s) {
    s = (s | s >> 4) & 0x00FF00FF00FF00FFull;
    s = (s | s >> 8) & 0x0000FFFF0000FFFFull;
    return (uint32_t)(s | s >> 16);
}

/* Eight codes at once (64-bit words): little-endian byte order throughout. `pairs`: the exponents two a
 * byte too (4 bytes). */
static inline void split8(const uint8_t *v, uint8_t *exp, uint8_t *nib, int pairs) {
    uint64_t x = ld64(v), e = (x >> 3) & EXP_MASK, s = ((x >> 4) & SIGN_MASK) | (x & MANT_MASK);
    uint32_t w = pack8(s);
    memcpy(nib, &w, 4);
    if (pairs) {
        w = pack8(e);
        memcpy(exp, &w, 4);
    } else {
        memcpy(exp, &e, 8);
    }
}

static inline void merge8(const uint8_t *exp, const uint8_t *nib, uint8_t *v) {
    uint32_t w;
    memcpy(&w, nib, 4);
    uint64_t s = w;
    s = (s | s << 16) & 0x0000FFFF0000FFFFull;
    s = (s | s << 8) & 0x00FF00FF00FF00FFull;
    s = (s | s << 4) & EXP_MASK; /* byte i: nibble i */
    uint64_t x = ((s & SIGN_MASK) << 4) | ((ld64(exp) & EXP_MASK) << 3) | (s & MANT_MASK);
    memcpy(v, &x, 8);
}

#if KV_X86
#include <immintrin.h>
#define NIBBLES_AVX2 1

/* 32 bytes below 16 as 16 bytes of two (byte i: nibbles 2i and 2i + 1). */
__attribute__((target("avx2"))) static inline __m128i pack32(__m256i s) {
    /* word i: nibbles 2i, 2i + 1 in its low byte, its high byte cleared so that packus keeps it as is */
    __m256i p = _mm256_and_si256(_mm256_or_si256(s, _mm256_srli_epi16(s, 4)), _mm256_set1_epi16(0x00ff));
    p = _mm256_packus_epi16(p, p);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}

__attribute__((target("avx2"))) static void split_rows32(const uint8_t *v, uint8_t *exp, uint8_t *nib, size_t D,
                                                         int pairs) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(7), m8 = _mm256_set1_epi8(8);
    for (size_t d = 0; d < D; d += 32) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(v + d));
        __m256i e = _mm256_and_si256(_mm256_srli_epi16(x, 3), m4);
        __m256i s = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 4), m8), _mm256_and_si256(x, m3));
        if (pairs)
            _mm_storeu_si128((__m128i *)(exp + d / 2), pack32(e));
        else
            _mm256_storeu_si256((__m256i *)(exp + d), e);
        _mm_storeu_si128((__m128i *)(nib + d / 2), pack32(s));
    }
}

__attribute__((target("avx2"))) static void merge_rows32(const uint8_t *exp, const uint8_t *nib, uint8_t *v, size_t D) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(7), m8 = _mm256_set1_epi8(8);
    for (size_t d = 0; d < D; d += 32) {
        __m128i n = _mm_loadu_si128((const __m128i *)(nib + d / 2));
        __m128i lo = _mm_and_si128(n, _mm256_castsi256_si128(m4));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(n, 4), _mm256_castsi256_si128(m4));
        __m256i s = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)), _mm_unpackhi_epi8(lo, hi), 1);
        __m256i e = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(exp + d)), m4);
        __m256i x = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(s, m8), 4), _mm256_slli_epi16(e, 3));
        _mm256_storeu_si256((__m256i *)(v + d), _mm256_or_si256(x, _mm256_and_si256(s, m3)));
    }
}
#endif

/* Row r = t x H + h: its codes at v + r x D, its exponents at exp + h x T x D + t x D (halved with
 * pairs), its nibbles from nibble r x D. */
static void split(const uint8_t *v, uint8_t *exp, uint8_t *nib, size_t T, size_t H, size_t D, int pairs) {
    const size_t per = pairs ? 2 : 1; /* codes an exponent byte holds */
#ifdef NIBBLES_AVX2
    if (D % 32 == 0 && kv_best_simd() >= 1) {
        for (size_t t = 0; t < T; t++)
            for (size_t h = 0; h < H; h++)
                split_rows32(v + (t * H + h) * D, exp + (h * T + t) * D / per, nib + (t * H + h) * D / 2, D, pairs);
        return;
    }
#endif
    if (D % 8 == 0 && NIBBLES_WORDS) {
        for (size_t t = 0; t < T; t++)
            for (size_t h = 0; h < H; h++) {
                const uint8_t *src = v + (t * H + h) * D;
                uint8_t *e = exp + (h * T + t) * D / per, *s = nib + (t * H + h) * D / 2;
                for (size_t d = 0; d < D; d += 8) split8(src + d, e + d / per, s + d / 2, pairs);
            }
        return;
    }
    for (size_t t = 0, j = 0; t < T; t++) /* rows in payload order: an even code's byte written first */
        for (size_t h = 0; h < H; h++)
            for (size_t d = 0; d < D; d++, j++) {
                uint8_t x = v[j], e = (uint8_t)((x >> 3) & 15);
                size_t i = (h * T + t) * D + d; /* the exponent's place in its head's plane */
                if (!pairs)
                    exp[i] = e;
                else if (i & 1)
                    exp[i / 2] |= (uint8_t)(e << 4);
                else
                    exp[i / 2] = e;
                if (j & 1)
                    nib[j / 2] |= (uint8_t)(raw_nibble(x) << 4);
                else
                    nib[j / 2] = raw_nibble(x);
            }
}

void kv_nibbles_split(const uint8_t *v, uint8_t *exp, uint8_t *nib, size_t T, size_t H, size_t D) {
    split(v, exp, nib, T, H, D, 0);
}

void kv_nibbles_split_pairs(const uint8_t *v, uint8_t *exp2, uint8_t *nib, size_t T, size_t H, size_t D) {
    split(v, exp2, nib, T, H, D, 1);
}

void kv_nibbles_merge(const uint8_t *exp, const uint8_t *nib, uint8_t *v, size_t T, size_t H, size_t D) {
#ifdef NIBBLES_AVX2
    if (D % 32 == 0 && kv_best_simd() >= 1) {
        for (size_t t = 0; t < T; t++)
            for (size_t h = 0; h < H; h++)
                merge_rows32(exp + (h * T + t) * D, nib + (t * H + h) * D / 2, v + (t * H + h) * D, D);
        return;
    }
#endif
    if (D % 8 == 0 && NIBBLES_WORDS) {
        for (size_t t = 0; t < T; t++)
            for (size_t h = 0; h < H; h++) {
                const uint8_t *e = exp + (h * T + t) * D, *s = nib + (t * H + h) * D / 2;
                uint8_t *dst = v + (t * H + h) * D;
                for (size_t d = 0; d < D; d += 8) merge8(e + d, s + d / 2, dst + d);
            }
        return;
    }
    for (size_t t = 0, j = 0; t < T; t++)
        for (size_t h = 0; h < H; h++)
            for (size_t d = 0; d < D; d++, j++)
                v[j] = code_of(exp[(h * T + t) * D + d], (uint8_t)(nib[j / 2] >> (4 * (j & 1))));
}
