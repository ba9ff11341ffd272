/*
 * kvcodec._cpu: the codec's FP8 row loops for CPU tensors, in C.
 *
 * Same numerics as kvcodec/backends/reference.py (the torch reference), bit for bit:
 *   scale = amax(|V|) / 448           fp32, IEEE division; 1.0 for an all-zero group
 *   q     = RNE(clamp(V / scale, +-448)) as float8_e4m3fn
 *   V_hat = float(q) * scale          one fp32 rounding, then RNE to fp16/bf16
 * Why C: torch's fp32 -> e4m3 cast and its FP8 widening are scalar loops on
 * CPU; here each is a few integer operations, eight lanes at a time with
 * AVX2 + F16C, sixteen or thirty-two with AVX-512 (the quantize multiplying by
 * 1 / scale and dividing only next to a rounding boundary), each when the CPU
 * has it (chosen at run time), portable C otherwise. The CRC-32 of the blob is
 * folded into the same passes (PCLMULQDQ, or VPCLMULQDQ on 512-bit registers).
 *
 * Every call runs on the calling thread only and releases the GIL around its
 * loops. Arguments are Python buffers (numpy arrays over torch tensors,
 * memoryviews): their dimensions, strides, item sizes, alignment and overlaps
 * are checked here before any loop runs, so no argument can make the loops
 * read or write outside the memory the buffers export. Every error is raised
 * as the class given to set_error() (kvcodec's UnsupportedConfigError).
 *
 * A call returns None when done, or a reason string when the reference must
 * take it: a layout the loops do not take (odd strides, misalignment, an
 * output overlapping itself or an input; see take_bufs) or data they cannot
 * reproduce bit for bit (NaN/Inf in V, NaN codes, unusable scales; torch's own
 * NaN bits differ with the tensor's size). All of these are found before any
 * output is written, except NaN met by quantize and dequantize, which stop at
 * that row, and NaN/Inf or an unusable scale met by the page-by-page encode
 * (encode_paged), which stops at that page: the reference then rewrites the
 * whole output (or raises), so no partial result is ever returned.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(KV_PORTABLE_ONLY)
#include <immintrin.h>
#define KV_HAVE_AVX2 1
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
/* The same AVX2 rows compiled for CPUs with AVX-512VL: EVEX encodings and 32 vector registers, so the
 * quantize loop keeps its constants and four lanes of work in registers (no spills). */
#define EVEX_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))
#endif

/* The portable build (KV_PORTABLE_ONLY) has no ISA-specific code at all: no clones either, so the loops
 * it runs are the baseline ones on any CPU (make test-portable checks its object for ymm/zmm and .arch_). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(KV_NO_CLONES) && \
    !defined(KV_PORTABLE_ONLY)
#define KV_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KV_CLONES
#endif

enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2 };
enum { SC_TENSOR = 0, SC_LAYER_HEAD = 1, SC_PAGE_HEAD = 2 };

/* Whether the AVX2 + F16C loops run: set at import from the CPU's features,
 * changed by simd() in tests. Read once per call. */
static int kv_simd = 0;

/* The exception class every error is raised as (set_error); a module-own one until then. */
static PyObject *kv_error = NULL;

/* ------------------------------------------------------------ bit helpers */

static inline uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static inline float bits_f32(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline int finite_f32(float x) { return (f32_bits(x) & 0x7FFFFFFFu) < 0x7F800000u; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* fp32 -> bf16, round to nearest even (finite inputs only: NaN never reaches it). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t b = f32_bits(f);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* fp16 -> fp32, exact, in integer operations the compiler vectorises. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t em = (uint32_t)(h & 0x7FFFu) << 13;
    uint32_t exp = em & 0x0F800000u;
    uint32_t normal = em + (112u << 23);                            /* rebias 15 -> 127 */
    uint32_t special = em + (224u << 23);                           /* Inf / NaN keep all-ones exponent */
    float sub = bits_f32(em + (113u << 23)) - bits_f32(113u << 23); /* subnormal: exact */
    uint32_t o = exp == 0x0F800000u ? special : (exp == 0 ? f32_bits(sub) : normal);
    return bits_f32(o | ((uint32_t)(h & 0x8000u) << 16));
}

/* fp32 -> fp16, round to nearest even, overflow to Inf, NaN to 0x7E00 (as torch). */
static inline uint16_t f32_to_f16(float x) {
    uint32_t f = f32_bits(x);
    uint32_t sign = (f >> 16) & 0x8000u;
    f &= 0x7FFFFFFFu;
    uint32_t big = f > 0x7F800000u ? 0x7E00u : 0x7C00u;                         /* >= 65536, Inf, NaN */
    uint32_t sub = f32_bits(bits_f32(f) + bits_f32(126u << 23)) - (126u << 23); /* < 2^-14 */
    uint32_t norm = (f + 0xC8000FFFu + ((f >> 13) & 1u)) >> 13;                  /* rebias, RNE */
    uint32_t o = f >= 0x47800000u ? big : (f < (113u << 23) ? sub : norm);
    return (uint16_t)(o | sign);
}

/* ------------------------------------------------------------------ amax */
/* amax(|x|) of one row as fp32, on raw bits: for non-negative IEEE values the
 * bit pattern orders like the value, and a NaN (bits above the infinity's)
 * comes out non-finite, which the caller refuses as the reference does. */

KV_CLONES static float amax_row_f16(const void *row, Py_ssize_t D) {
    const uint16_t *p = (const uint16_t *)row;
    uint16_t m = 0;
    for (Py_ssize_t d = 0; d < D; d++) {
        uint16_t a = p[d] & 0x7FFF;
        m = a > m ? a : m;
    }
    return f16_to_f32(m);
}

KV_CLONES static float amax_row_bf16(const void *row, Py_ssize_t D) {
    const uint16_t *p = (const uint16_t *)row;
    uint16_t m = 0;
    for (Py_ssize_t d = 0; d < D; d++) {
        uint16_t a = p[d] & 0x7FFF;
        m = a > m ? a : m;
    }
    return bf16_to_f32(m);
}

KV_CLONES static float amax_row_f32(const void *row, Py_ssize_t D) {
    const uint32_t *p = (const uint32_t *)row;
    uint32_t m = 0;
    for (Py_ssize_t d = 0; d < D; d++) {
        uint32_t a = p[d] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return bits_f32(m);
}

/* ---------------------------------------------------------------- CRC-32 */
/* zlib's CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, initial and final XOR 0xFFFFFFFF): the
 * CRC the format uses (kvcodec/format/crc.py, ISA-L's crc32_gzip_refl or zlib.crc32: the same value).
 * Computed inside the encode and decode passes over slices still in cache, so the payload is not read
 * a second time. Long runs fold 128 bytes at a time with carry-less multiplication (PCLMULQDQ, eight
 * independent 128-bit lanes folded by x^1024, then together by x^128, then Barrett-reduced; the
 * constants are x^n mod P bit-reflected, tests/backends/test_cpu_crc.py derives them);
 * short runs and tails go byte by byte through a table. kv_crc_fast says whether the folding runs
 * (chosen at import; without it callers leave the CRC to kvcodec.format.crc). */

static uint32_t crc_table[256];
static int kv_crc_fast = 0;
/* Whether encode_v takes per_page_head 16-bit V page by page (encode_paged) rather than in two passes. */
static int kv_paged = 1;


static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* The running (pre-inverted) state over n bytes, one byte at a time. */
static uint32_t crc_bytes(uint32_t state, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) state = crc_table[(state ^ p[i]) & 0xFF] ^ (state >> 8);
    return state;
}

#ifdef KV_HAVE_AVX2
#define CLMUL_FN __attribute__((target("pclmul,sse4.1")))

/* x * (k_lo, k_hi): the 128-bit lane x moved 2n bits ahead, as two carry-less products (low qword by
 * the first constant, high qword by the second). */
CLMUL_FN static inline __m128i crc_fold(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

CLMUL_FN static uint32_t crc_reduce(__m128i a);

/* The state over n >= 128 bytes (a multiple of 16), by folding; the caller does the rest of a run. */
CLMUL_FN static uint32_t crc_clmul(uint32_t state, const uint8_t *p, size_t n) {
    const __m128i k1024 = _mm_set_epi64x(0x14a7fe880LL, 0x1e88ef372LL); /* x^(1024-32), x^(1024+32) */
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  /* x^(128-32), x^(128+32) */
    __m128i x[8];
    for (int i = 0; i < 8; i++) x[i] = _mm_loadu_si128((const __m128i *)(p + 16 * i));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)state));
    p += 128;
    n -= 128;
    for (; n >= 128; p += 128, n -= 128)
        for (int i = 0; i < 8; i++)
            x[i] = _mm_xor_si128(crc_fold(x[i], k1024), _mm_loadu_si128((const __m128i *)(p + 16 * i)));
    __m128i a = x[0];
    for (int i = 1; i < 8; i++) a = _mm_xor_si128(crc_fold(a, k128), x[i]);
    for (; n >= 16; p += 16, n -= 16) a = _mm_xor_si128(crc_fold(a, k128), _mm_loadu_si128((const __m128i *)p));
    return crc_reduce(a);
}

/* The folded 128 bits to the 32-bit state: 128 -> 64 bits (x^64), then Barrett reduction by
 * P' = 0x1DB710641, mu = 0x1F7011641. */
CLMUL_FN static uint32_t crc_reduce(__m128i a) {
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

/* crc_clmul over src's n >= 128 bytes (a multiple of 16) that also stores every 16 bytes it loads to
 * dst: a copy and its CRC in one pass over the registers (the copy's stores ride beside the folds).
 * dst and src do not overlap. */
CLMUL_FN static uint32_t crc_clmul_copy(uint32_t state, uint8_t *dst, const uint8_t *p, size_t n) {
    const __m128i k1024 = _mm_set_epi64x(0x14a7fe880LL, 0x1e88ef372LL);
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    __m128i x[8];
    for (int i = 0; i < 8; i++) {
        x[i] = _mm_loadu_si128((const __m128i *)(p + 16 * i));
        _mm_storeu_si128((__m128i *)(dst + 16 * i), x[i]);
    }
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)state));
    p += 128, dst += 128, n -= 128;
    for (; n >= 128; p += 128, dst += 128, n -= 128)
        for (int i = 0; i < 8; i++) {
            __m128i d = _mm_loadu_si128((const __m128i *)(p + 16 * i));
            _mm_storeu_si128((__m128i *)(dst + 16 * i), d);
            x[i] = _mm_xor_si128(crc_fold(x[i], k1024), d);
        }
    __m128i a = x[0];
    for (int i = 1; i < 8; i++) a = _mm_xor_si128(crc_fold(a, k128), x[i]);
    for (; n >= 16; p += 16, dst += 16, n -= 16) {
        __m128i d = _mm_loadu_si128((const __m128i *)p);
        _mm_storeu_si128((__m128i *)dst, d);
        a = _mm_xor_si128(crc_fold(a, k128), d);
    }
    return crc_reduce(a);
}

/* The same folding four 128-bit lanes per instruction (VPCLMULQDQ on 512-bit registers, as ISA-L's
 * by16 loops): four registers of 64 bytes folded by x^2048 per 256 bytes, then together by x^512, then
 * their lanes by x^128. With `dst` every loaded register is also stored there (a copy in the same pass;
 * the compiler drops the stores from the copy-less instance). n >= 256, a multiple of 16. */
#define VCLMUL_FN __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,vpclmulqdq,pclmul,sse4.1")))

VCLMUL_FN static inline __m512i crc_fold512(__m512i x, __m512i k, __m512i data) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     data, 0x96);
}

VCLMUL_FN static inline __m512i crc_load512(const uint8_t *p, uint8_t *dst, size_t at) {
    __m512i d = _mm512_loadu_si512((const void *)(p + at));
    if (dst) _mm512_storeu_si512((void *)(dst + at), d);
    return d;
}

/* A 512-bit register's four 128-bit lanes (the first the earliest bytes) folded into one by x^128. */
VCLMUL_FN static inline __m128i crc_lanes(__m512i a) {
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    __m128i b = _mm512_castsi512_si128(a);
    b = _mm_xor_si128(crc_fold(b, k128), _mm512_extracti32x4_epi32(a, 1));
    b = _mm_xor_si128(crc_fold(b, k128), _mm512_extracti32x4_epi32(a, 2));
    return _mm_xor_si128(crc_fold(b, k128), _mm512_extracti32x4_epi32(a, 3));
}

__attribute__((always_inline)) VCLMUL_FN static inline uint32_t crc_vclmul_body(uint32_t state, uint8_t *dst,
                                                                                 const uint8_t *p, size_t n) {
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

VCLMUL_FN static uint32_t crc_vclmul(uint32_t state, const uint8_t *p, size_t n) {
    return crc_vclmul_body(state, NULL, p, n);
}

VCLMUL_FN static uint32_t crc_vclmul_copy(uint32_t state, uint8_t *dst, const uint8_t *p, size_t n) {
    return crc_vclmul_body(state, dst, p, n);
}
#endif

/* The running state continued over n bytes: folded where it pays (512-bit lanes from 256 bytes at
 * level 2, 128-bit lanes from 128 bytes), byte by byte otherwise. */
static uint32_t crc_update(uint32_t state, const uint8_t *p, size_t n) {
#ifdef KV_HAVE_AVX2
    if (kv_crc_fast && n >= 128) {
        size_t body = n & ~(size_t)15;
        state = kv_crc_fast >= 2 && body >= 256 ? crc_vclmul(state, p, body) : crc_clmul(state, p, body);
        p += body;
        n -= body;
    }
#endif
    return crc_bytes(state, p, n);
}

/* crc32_combine: the CRC of A || B from crc_a = CRC(A) and crc_b = CRC(B) (both from 0), multiplying
 * crc_a by x^(8 |B|) mod P in the reflected representation (bit 31 is x^0), by squaring. For a CRC
 * computed in two parts out of order (the codes before K, in the scatter's pre-pass). */
static uint32_t gf2_mulmod(uint32_t a, uint32_t b) {
    uint32_t p = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m) p ^= b;
        b = b & 1 ? (b >> 1) ^ 0xEDB88320u : b >> 1;
    }
    return p;
}

static uint32_t crc32_combine_len(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    uint32_t sq = 1u << 23; /* x^8: one byte */
    uint32_t shift = 1u << 31; /* x^0 */
    for (; len_b; len_b >>= 1) {
        if (len_b & 1) shift = gf2_mulmod(sq, shift);
        sq = gf2_mulmod(sq, sq);
    }
    return gf2_mulmod(shift, crc_a) ^ crc_b;
}

/* n bytes copied from src to dst (not overlapping) with the running state carried over them, in one
 * pass where the folding runs. */
static uint32_t crc_copy(uint32_t state, uint8_t *dst, const uint8_t *src, size_t n) {
#ifdef KV_HAVE_AVX2
    if (kv_crc_fast && n >= 128) {
        size_t body = n & ~(size_t)15;
        state = kv_crc_fast >= 2 && body >= 256 ? crc_vclmul_copy(state, dst, src, body)
                                                : crc_clmul_copy(state, dst, src, body);
        dst += body, src += body, n -= body;
    }
#endif
    memcpy(dst, src, n);
    return crc_bytes(state, src, n);
}

/* zlib.crc32(data, crc): the CRC of p[0..n) continuing from crc. */
static uint32_t kv_crc32(uint32_t crc, const void *p, size_t n) { return ~crc_update(~crc, (const uint8_t *)p, n); }

/* -------------------------------------------------------------- quantize */

/* e4m3fn code of a non-NaN fp32 y, rounded to nearest even, saturated at 448.
 * The fp32 adder rounds: |y| (clamped) lies in a binade [2^E, 2^(E+1)), with
 * E at least -6 (below that, e4m3's subnormal step 2^-9 applies); adding
 * M = 2^(E+20) leaves |y| + M in M's binade, whose step is |y|'s e4m3 step
 * 2^(E-3), so the addition rounds |y| exactly as the cast must, and
 * bits(|y| + M) - bits(M) counts steps above M: 8 to 16 for a normal |y|
 * (its code within the binade, plus 8), 0 to 8 below 2^-6 (the code itself).
 * Adding 8 per binade above 2^-6 gives the code. */
#define E4M3_MIN_EXP (121u << 23) /* 2^-6: the smallest normal e4m3 magnitude */
#define E4M3_MAX_BITS 0x43E00000u /* 448 */

static inline uint8_t e4m3_code(float y) {
    uint32_t b = f32_bits(y);
    uint32_t a = b & 0x7FFFFFFFu;
    a = a > E4M3_MAX_BITS ? E4M3_MAX_BITS : a;
    uint32_t e = a & 0x7F800000u;
    e = e > E4M3_MIN_EXP ? e : E4M3_MIN_EXP;
    uint32_t m = e + (20u << 23);
    uint32_t code = f32_bits(bits_f32(a) + bits_f32(m)) - m + ((e - E4M3_MIN_EXP) >> 20);
    return (uint8_t)(code | ((b >> 24) & 0x80u));
}

/* Each row returns whether it met a NaN (its code would not be torch's). Inf saturates, as in torch. */
#define QUANT_ROW(name, T, widen)                                                         \
    KV_CLONES static int name(const void *row, Py_ssize_t D, float scale, uint8_t *q) {   \
        const T *p = (const T *)row;                                                      \
        uint32_t nan = 0;                                                                 \
        for (Py_ssize_t d = 0; d < D; d++) {                                              \
            float y = widen(p[d]) / scale;                                                \
            nan |= (f32_bits(y) & 0x7FFFFFFFu) > 0x7F800000u;                             \
            q[d] = e4m3_code(y);                                                          \
        }                                                                                 \
        return nan != 0;                                                                  \
    }

static inline float f32_id(float x) { return x; }
QUANT_ROW(quant_row_f16, uint16_t, f16_to_f32)
QUANT_ROW(quant_row_bf16, uint16_t, bf16_to_f32)
QUANT_ROW(quant_row_f32, float, f32_id)

/* ------------------------------------------------------------ dequantize */

/* float(q) exactly for an e4m3fn code that is not NaN: normals rebias the
 * exponent (7 -> 127), subnormals are m * 2^-9. */
static inline float e4m3_value(uint8_t c) {
    uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
    uint32_t normal = ((e + 120u) << 23) | (m << 20);
    uint32_t mag = e ? normal : f32_bits((float)m * 0.001953125f);
    return bits_f32(mag | ((uint32_t)(c & 0x80u) << 24));
}

/* Whether a row holds a NaN code (0x7F or 0xFF). */
KV_CLONES static int has_nan_code(const uint8_t *q, Py_ssize_t D) {
    uint8_t any = 0;
    for (Py_ssize_t d = 0; d < D; d++) any |= (uint8_t)((q[d] & 0x7F) == 0x7F);
    return any != 0;
}

KV_CLONES static void deq_row_f16(const uint8_t *q, Py_ssize_t D, float s, void *out) {
    uint16_t *o = (uint16_t *)out;
    for (Py_ssize_t d = 0; d < D; d++) o[d] = f32_to_f16(e4m3_value(q[d]) * s);
}

KV_CLONES static void deq_row_bf16(const uint8_t *q, Py_ssize_t D, float s, void *out) {
    uint16_t *o = (uint16_t *)out;
    for (Py_ssize_t d = 0; d < D; d++) o[d] = f32_to_bf16(e4m3_value(q[d]) * s);
}

KV_CLONES static void deq_row_f32(const uint8_t *q, Py_ssize_t D, float s, void *out) {
    float *o = (float *)out;
    for (Py_ssize_t d = 0; d < D; d++) o[d] = e4m3_value(q[d]) * s;
}

/* Per-head tables of a scale's 128 results (built and read by the AVX-512 rows below). */
#define TABLE_HEADS 16

typedef struct {
    uint16_t tab[TABLE_HEADS][128] __attribute__((aligned(64)));
    uint32_t bits[TABLE_HEADS]; /* the scale each table was built for (a NaN pattern: none yet) */
    int odt;
} DeqTables;

static void tables_init(DeqTables *t, int odt) {
    t->odt = odt;
    for (int i = 0; i < TABLE_HEADS; i++) t->bits[i] = 0x7FC00001u;
}

/* Tables for a call's rows where they apply (AVX-512, fp16 / bf16 output), else NULL. */
static DeqTables *tables_if(DeqTables *t, int odt, int simd) {
#ifndef KV_HAVE_AVX2
    simd = 0;
#endif
    if (simd < 2 || (odt != DT_F16 && odt != DT_BF16)) return NULL;
    tables_init(t, odt);
    return t;
}

/* ------------------------------------------------------ AVX2 + F16C rows */
/* Same arithmetic as the portable rows above, eight lanes at a time; tails use the portable rows. */
#ifdef KV_HAVE_AVX2

/* e4m3_code, eight lanes at a time. `amax` keeps the largest |y| bits seen,
 * for the row's NaN check (above the infinity's bits) at its end. */
AVX2_FN static inline __m256i e4m3_codes8(__m256 y, __m256i *amax) {
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
AVX2_FN static inline void store_codes32(uint8_t *q, __m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, b);
}

#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD_F32(p) _mm256_loadu_ps(p)

#define QUANT_ROW_AVX2(attr, name, T, LOAD, tail)                                 \
    attr static int name(const void *row, Py_ssize_t D, float scale, uint8_t *q) {    \
        const T *p = (const T *)row;                                              \
        const __m256 vs = _mm256_set1_ps(scale);                                  \
        __m256i amax = _mm256_setzero_si256();                                    \
        Py_ssize_t d = 0;                                                         \
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

QUANT_ROW_AVX2(AVX2_FN, quant_row_f16_avx2, uint16_t, LOAD_F16, quant_row_f16)
QUANT_ROW_AVX2(AVX2_FN, quant_row_bf16_avx2, uint16_t, LOAD_BF16, quant_row_bf16)
QUANT_ROW_AVX2(AVX2_FN, quant_row_f32_avx2, float, LOAD_F32, quant_row_f32)
QUANT_ROW_AVX2(EVEX_FN, quant_row_f16_evex, uint16_t, LOAD_F16, quant_row_f16)
QUANT_ROW_AVX2(EVEX_FN, quant_row_bf16_evex, uint16_t, LOAD_BF16, quant_row_bf16)
QUANT_ROW_AVX2(EVEX_FN, quant_row_f32_evex, float, LOAD_F32, quant_row_f32)

/* Sixteen codes to two vectors of float(q): the code's bits placed in an fp16
 * read as q / 256 (the exponent biases differ by 8), then times 256, exact. */
AVX2_FN static inline void e4m3_values16(const uint8_t *q, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(~0x4000));
    const __m256 k = _mm256_set1_ps(256.0f);
    *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k);
    *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k);
}

AVX2_FN static inline __m256i bf16_rne8(__m256 x) {
    __m256i b = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd), 16);
}

AVX2_FN static int has_nan_code_avx2(const uint8_t *q, Py_ssize_t D) {
    const __m256i m7f = _mm256_set1_epi8(0x7F);
    __m256i any = _mm256_setzero_si256();
    Py_ssize_t d = 0;
    for (; d + 32 <= D; d += 32) {
        __m256i c = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(q + d)), m7f);
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(c, m7f));
    }
    return !_mm256_testz_si256(any, any) || (d < D && has_nan_code(q + d, D - d));
}

/* The largest |x| bit pattern (sign cleared) of `rows` rows of D 16-bit values `st` bytes apart: one
 * vector maximum over a whole group, one horizontal reduction at its end. */
AVX2_FN static uint16_t amax_rows_u16_avx2(const char *base, Py_ssize_t st, Py_ssize_t rows, Py_ssize_t D) {
    const __m256i mag = _mm256_set1_epi16(0x7FFF);
    __m256i acc = _mm256_setzero_si256();
    uint16_t tail = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint16_t *p = (const uint16_t *)(base + r * st);
        Py_ssize_t d = 0;
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

AVX2_FN static void deq_row_f16_avx2(const uint8_t *q, Py_ssize_t D, float s, void *out) {
    uint16_t *o = (uint16_t *)out;
    const __m256 vs = _mm256_set1_ps(s);
    Py_ssize_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 lo, hi;
        e4m3_values16(q + d, &lo, &hi);
        _mm_storeu_si128((__m128i *)(o + d), _mm256_cvtps_ph(_mm256_mul_ps(lo, vs), _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128((__m128i *)(o + d + 8),
                         _mm256_cvtps_ph(_mm256_mul_ps(hi, vs), _MM_FROUND_TO_NEAREST_INT));
    }
    if (d < D) deq_row_f16(q + d, D - d, s, o + d);
}

AVX2_FN static void deq_row_bf16_avx2(const uint8_t *q, Py_ssize_t D, float s, void *out) {
    uint16_t *o = (uint16_t *)out;
    const __m256 vs = _mm256_set1_ps(s);
    Py_ssize_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 lo, hi;
        e4m3_values16(q + d, &lo, &hi);
        __m256i w = _mm256_packus_epi32(bf16_rne8(_mm256_mul_ps(lo, vs)), bf16_rne8(_mm256_mul_ps(hi, vs)));
        _mm256_storeu_si256((__m256i *)(o + d), _mm256_permute4x64_epi64(w, 0xD8));
    }
    if (d < D) deq_row_bf16(q + d, D - d, s, o + d);
}

AVX2_FN static void deq_row_f32_avx2(const uint8_t *q, Py_ssize_t D, float s, void *out) {
    float *o = (float *)out;
    const __m256 vs = _mm256_set1_ps(s);
    Py_ssize_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 lo, hi;
        e4m3_values16(q + d, &lo, &hi);
        _mm256_storeu_ps(o + d, _mm256_mul_ps(lo, vs));
        _mm256_storeu_ps(o + d + 8, _mm256_mul_ps(hi, vs));
    }
    if (d < D) deq_row_f32(q + d, D - d, s, o + d);
}
/* --------------------------------------------------- AVX-512 dequantize rows */
/* The same products sixteen codes at a time on 512-bit registers (simd level 2), float(q) built from
 * the code's bits by integer operations rather than through fp16 (the conversions are the slow part):
 * exponent e and mantissa m placed under a biased exponent give 2^e (1 + m / 8) = float(q) * 2^7 for a
 * normal code; a subnormal one (e = 0) is 2 (1 + m / 8) - 2 = m / 4, exact. The factor 2^7 goes into
 * the scale, s * 2^-7, exact where s is zero or at least 2^-119 (else the AVX2 row runs), so
 * (float(q) * 2^7) * (s * 2^-7) is the same real product as float(q) * s and rounds the same. */
#define ZMM_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))

ZMM_FN static inline __m512 e4m3_x128(__m128i codes) {
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

#define DEQ_ROW_ZMM(name, T, STORE16, fallback)                                               \
    ZMM_FN static void name(const uint8_t *q, Py_ssize_t D, float s, void *out) {             \
        int ok;                                                                               \
        const __m512 vs = _mm512_set1_ps(scale_div128(s, &ok));                               \
        if (!ok) {                                                                            \
            fallback(q, D, s, out);                                                           \
            return;                                                                           \
        }                                                                                     \
        T *o = (T *)out;                                                                      \
        Py_ssize_t d = 0;                                                                     \
        for (; d + 16 <= D; d += 16)                                                          \
            STORE16(o + d, _mm512_mul_ps(e4m3_x128(_mm_loadu_si128((const __m128i *)(q + d))), vs)); \
        if (d < D) fallback(q + d, D - d, s, o + d);                                          \
    }

ZMM_FN static inline __m512i bf16_rne16(__m512 x) {
    __m512i b = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
}

ZMM_FN static inline void store16_f16(uint16_t *o, __m512 x) {
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

ZMM_FN static inline void store16_bf16(uint16_t *o, __m512 x) {
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(bf16_rne16(x)));
}

ZMM_FN static inline void store16_f32(float *o, __m512 x) { _mm512_storeu_ps(o, x); }

DEQ_ROW_ZMM(deq_row_f16_zmm, uint16_t, store16_f16, deq_row_f16_avx2)
DEQ_ROW_ZMM(deq_row_bf16_zmm, uint16_t, store16_bf16, deq_row_bf16_avx2)
DEQ_ROW_ZMM(deq_row_f32_zmm, float, store16_f32, deq_row_f32_avx2)

/* A group's 128 magnitudes looked up rather than computed: every code of one scale gives one of 128
 * results (the sign of the code flips the sign of the result: rounding is symmetric), so per head the
 * 128 fp16 / bf16 results of the current scale are built once (eight vectors of the row arithmetic
 * above) and each row becomes table lookups, 32 codes per pair of permutes (VPERMI2W over the four
 * registers of the table). A table is rebuilt when its head's scale changes (per page for
 * per_page_head: 16 tokens of rows per build). Heads beyond TABLE_HEADS, fp32 output and scales
 * whose 2^-7 product is not exact take the rows above. Used by the dense decode (dequantize). */
ZMM_FN static void build_table(uint16_t *tab, float s128, int odt) {
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

/* amax_rows_u16_avx2 on 512-bit registers: 32 values a load, one reduction at the end. */
ZMM_FN static uint16_t amax_rows_u16_zmm(const char *base, Py_ssize_t st, Py_ssize_t rows, Py_ssize_t D) {
    if (D % 32) return amax_rows_u16_avx2(base, st, rows, D);
    const __m512i mag = _mm512_set1_epi16(0x7FFF);
    __m512i acc = _mm512_setzero_si512();
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint16_t *p = (const uint16_t *)(base + r * st);
        for (Py_ssize_t d = 0; d < D; d += 32)
            acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512((const void *)(p + d)), mag));
    }
    __m256i m = _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    __m128i x = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    x = _mm_max_epu16(x, _mm_srli_si128(x, 8));
    x = _mm_max_epu16(x, _mm_srli_si128(x, 4));
    x = _mm_max_epu16(x, _mm_srli_si128(x, 2));
    return (uint16_t)_mm_extract_epi16(x, 0);
}

/* Head h's table for scale s, built if it holds another; NULL where the rows must compute. */
ZMM_FN static inline const uint16_t *table_for(DeqTables *t, Py_ssize_t h, float s) {
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

ZMM_FN static inline Table4 table4(const uint16_t *tab) {
    Table4 t = {_mm512_load_si512((const void *)tab), _mm512_load_si512((const void *)(tab + 32)),
                _mm512_load_si512((const void *)(tab + 64)), _mm512_load_si512((const void *)(tab + 96))};
    return t;
}

ZMM_FN static inline __m512i table32(const Table4 *t, __m256i codes) {
    __m512i idx = _mm512_cvtepu8_epi16(codes);
    __m512i lo = _mm512_permutex2var_epi16(t->t0, idx, t->t1); /* codes' bits 0-5 pick the word */
    __m512i hi = _mm512_permutex2var_epi16(t->t2, idx, t->t3);
    __m512i v = _mm512_mask_mov_epi16(lo, _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x40)), hi);
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(idx, 8), _mm512_set1_epi16((short)0x8000),
                                     0x78); /* v ^ (code's sign) */
}

ZMM_FN static void deq_row_table(const uint8_t *q, Py_ssize_t D, const uint16_t *tab, uint16_t *o) {
    const Table4 t = table4(tab);
    Py_ssize_t d = 0;
    for (; d + 32 <= D; d += 32)
        _mm512_storeu_si512((void *)(o + d), table32(&t, _mm256_loadu_si256((const __m256i *)(q + d))));
    for (; d < D; d++) o[d] = (uint16_t)(tab[q[d] & 0x7F] ^ ((q[d] & 0x80u) << 8));
}

/* One row by head h's table where it has one, else by the level's row. */
ZMM_FN static inline void deq_row_tables(DeqTables *t, Py_ssize_t h, const uint8_t *q, Py_ssize_t D, float s,
                                         void *out) {
    const uint16_t *tab = table_for(t, h, s);
    if (tab)
        deq_row_table(q, D, tab, (uint16_t *)out);
    else if (t->odt == DT_F16)
        deq_row_f16_zmm(q, D, s, out);
    else
        deq_row_bf16_zmm(q, D, s, out);
}

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
ZMM_FN static inline __m512i e4m3_mag16(__m512i a) {
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
ZMM_FN static inline __m512i quant16(__m512 x, __m512 vr, __m512 vs, uint8_t *q, __m512i *amax, int nan_check) {
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
ZMM_FN static inline __m512i quant64(const __m512 x[4], __m512 vr, __m512 vs, uint8_t *q, __m512i *amax, int nan_check) {
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

#define QUANT_ROW_ZMM(name, T, LOAD, fallback, nan_check)                               \
    ZMM_FN static int name(const void *row, Py_ssize_t D, float scale, uint8_t *q) {    \
        if (!reciprocal_ok(scale)) return fallback(row, D, scale, q);                   \
        const T *p = (const T *)row;                                                    \
        const __m512 vr = _mm512_set1_ps(1.0f / scale), vs = _mm512_set1_ps(scale);     \
        __m512i amax = _mm512_setzero_si512();                                          \
        Py_ssize_t d = 0;                                                               \
        for (; d + 64 <= D; d += 64) {                                                  \
            const __m512 x[4] = {LOAD(p + d), LOAD(p + d + 16), LOAD(p + d + 32), LOAD(p + d + 48)}; \
            (void)quant64(x, vr, vs, q + d, &amax, nan_check);                          \
        }                                                                               \
        for (; d + 16 <= D; d += 16) (void)quant16(LOAD(p + d), vr, vs, q + d, &amax, nan_check); \
        int bad = _mm512_cmpgt_epu32_mask(amax, _mm512_set1_epi32(0x7F800000)) != 0;    \
        if (d < D) bad |= fallback(p + d, D - d, scale, q + d);                         \
        return bad;                                                                     \
    }

QUANT_ROW_ZMM(quant_row_f16_zmm, uint16_t, LOADZ_F16, quant_row_f16_evex, 1)
QUANT_ROW_ZMM(quant_row_bf16_zmm, uint16_t, LOADZ_BF16, quant_row_bf16_evex, 1)
QUANT_ROW_ZMM(quant_row_f32_zmm, float, LOADZ_F32, quant_row_f32_evex, 1)
/* For V already checked finite (encode_v's scales pass): no NaN tracking. */
QUANT_ROW_ZMM(quant_row_f16_zmm_finite, uint16_t, LOADZ_F16, quant_row_f16_evex, 0)
QUANT_ROW_ZMM(quant_row_bf16_zmm_finite, uint16_t, LOADZ_BF16, quant_row_bf16_evex, 0)
QUANT_ROW_ZMM(quant_row_f32_zmm_finite, float, LOADZ_F32, quant_row_f32_evex, 0)

/* The codes' CRC carried by the quantize (encode_v, V finite, rows of whole 64-byte lines, codes
 * dense in blob order): each 64-byte store of quant64 also folded by x^512 into one running register,
 * so the codes are not read again. Rows whose scale has no usable reciprocal are quantized by the
 * division and their bytes folded from memory. */
#define ZMMC_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,vpclmulqdq,pclmul,sse4.1")))

typedef struct {
    __m512i x;
    int started;
    uint32_t state; /* the running state before the first 64 bytes */
} Crc1;

ZMMC_FN static inline void crc1_fold(Crc1 *a, __m512i d) {
    if (!a->started) {
        a->x = _mm512_xor_si512(d, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)a->state)));
        a->started = 1;
        return;
    }
    a->x = crc_fold512(a->x, _mm512_broadcast_i32x4(_mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL)), d);
}

ZMMC_FN static uint32_t crc1_state(const Crc1 *a) {
    return a->started ? crc_reduce(crc_lanes(a->x)) : a->state;
}

typedef void (*quant_crc_fn)(const void *, Py_ssize_t, float, uint8_t *, Crc1 *);

#define QUANT_ROW_CRC(name, T, LOAD, fallback)                                                     \
    ZMMC_FN static void name(const void *row, Py_ssize_t D, float scale, uint8_t *q, Crc1 *crc) {     \
        const T *p = (const T *)row;                                                               \
        if (!reciprocal_ok(scale)) {                                                               \
            (void)fallback(row, D, scale, q);                                                      \
            for (Py_ssize_t d = 0; d < D; d += 64) crc1_fold(crc, _mm512_loadu_si512((const void *)(q + d))); \
            return;                                                                                \
        }                                                                                          \
        const __m512 vr = _mm512_set1_ps(1.0f / scale), vs = _mm512_set1_ps(scale);                \
        __m512i unused = _mm512_setzero_si512();                                                   \
        for (Py_ssize_t d = 0; d < D; d += 64) {                                                   \
            const __m512 x[4] = {LOAD(p + d), LOAD(p + d + 16), LOAD(p + d + 32), LOAD(p + d + 48)}; \
            crc1_fold(crc, quant64(x, vr, vs, q + d, &unused, 0));                                 \
        }                                                                                          \
    }

QUANT_ROW_CRC(quant_crc_f16, uint16_t, LOADZ_F16, quant_row_f16_evex)
QUANT_ROW_CRC(quant_crc_bf16, uint16_t, LOADZ_BF16, quant_row_bf16_evex)
QUANT_ROW_CRC(quant_crc_f32, float, LOADZ_F32, quant_row_f32_evex)

/* The dense decode's rows with the codes' CRC carried by the row loop (the decode's counterpart of
 * QUANT_ROW_CRC; codes dense in blob order, rows of whole 64-byte lines): each row's codes are loaded
 * once, checked for NaN codes (1: the row is left unwritten), folded into the running register and
 * looked up in the head's table; rows without a table fold their codes, then take the level's row. */
ZMMC_FN static int deq_row_fold(DeqTables *t, Py_ssize_t h, const uint8_t *q, Py_ssize_t D, float s, void *out,
                                Crc1 *crc) {
    const __m512i m7f = _mm512_set1_epi8(0x7F);
    __mmask64 nan = 0;
    for (Py_ssize_t d = 0; d < D; d += 64)
        nan |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512((const void *)(q + d)), m7f), m7f);
    if (nan) return 1;
    const uint16_t *tab = table_for(t, h, s);
    if (!tab) {
        for (Py_ssize_t d = 0; d < D; d += 64) crc1_fold(crc, _mm512_loadu_si512((const void *)(q + d)));
        deq_row_tables(t, h, q, D, s, out);
        return 0;
    }
    const Table4 t4 = table4(tab);
    uint16_t *o = (uint16_t *)out;
    for (Py_ssize_t d = 0; d < D; d += 64) {
        __m512i c = _mm512_loadu_si512((const void *)(q + d));
        crc1_fold(crc, c);
        _mm512_storeu_si512((void *)(o + d), table32(&t4, _mm512_castsi512_si256(c)));
        _mm512_storeu_si512((void *)(o + d + 32), table32(&t4, _mm512_extracti64x4_epi64(c, 1)));
    }
    return 0;
}

ZMM_FN static int has_nan_code_zmm(const uint8_t *q, Py_ssize_t D) {
    const __m512i m7f = _mm512_set1_epi8(0x7F);
    __mmask64 any = 0;
    Py_ssize_t d = 0;
    for (; d + 64 <= D; d += 64)
        any |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512((const void *)(q + d)), m7f), m7f);
    return any != 0 || (d < D && has_nan_code_avx2(q + d, D - d));
}
#endif

/* The best row level the CPU runs: 0 portable, 1 AVX2 + F16C + FMA, 2 those compiled for AVX-512VL. */
static int cpu_simd_level(void) {
#ifdef KV_HAVE_AVX2
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))) return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")
               ? 2
               : 1;
#else
    return 0;
#endif
}

/* The best CRC folding the CPU runs: 0 none, 1 PCLMULQDQ on 128-bit lanes, 2 VPCLMULQDQ on 512-bit
 * registers (with AVX-512F/BW/VL/DQ). */
static int cpu_has_clmul(void) {
#ifdef KV_HAVE_AVX2
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"))) return 0;
    return __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512dq")
               ? 2
               : 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------- row dispatch */

typedef float (*amax_fn)(const void *, Py_ssize_t);
typedef int (*quant_fn)(const void *, Py_ssize_t, float, uint8_t *);
typedef void (*deq_fn)(const uint8_t *, Py_ssize_t, float, void *);
typedef int (*nan_fn)(const uint8_t *, Py_ssize_t);

static amax_fn pick_amax(int dt) {
    return dt == DT_F16 ? amax_row_f16 : dt == DT_BF16 ? amax_row_bf16 : amax_row_f32;
}

static quant_fn pick_quant(int dt, int simd) {
#ifdef KV_HAVE_AVX2
    if (simd >= 2) return dt == DT_F16 ? quant_row_f16_zmm : dt == DT_BF16 ? quant_row_bf16_zmm : quant_row_f32_zmm;
    if (simd) return dt == DT_F16 ? quant_row_f16_avx2 : dt == DT_BF16 ? quant_row_bf16_avx2 : quant_row_f32_avx2;
#endif
    (void)simd;
    return dt == DT_F16 ? quant_row_f16 : dt == DT_BF16 ? quant_row_bf16 : quant_row_f32;
}

/* pick_quant for V known finite (encode_v checked it in its scales pass). */
static quant_fn pick_quant_finite(int dt, int simd) {
#ifdef KV_HAVE_AVX2
    if (simd >= 2)
        return dt == DT_F16 ? quant_row_f16_zmm_finite : dt == DT_BF16 ? quant_row_bf16_zmm_finite : quant_row_f32_zmm_finite;
#endif
    return pick_quant(dt, simd);
}

static deq_fn pick_deq(int dt, int simd) {
#ifdef KV_HAVE_AVX2
    if (simd >= 2) return dt == DT_F16 ? deq_row_f16_zmm : dt == DT_BF16 ? deq_row_bf16_zmm : deq_row_f32_zmm;
    if (simd) return dt == DT_F16 ? deq_row_f16_avx2 : dt == DT_BF16 ? deq_row_bf16_avx2 : deq_row_f32_avx2;
#endif
    (void)simd;
    return dt == DT_F16 ? deq_row_f16 : dt == DT_BF16 ? deq_row_bf16 : deq_row_f32;
}

static nan_fn pick_nan(int simd) {
#ifdef KV_HAVE_AVX2
    if (simd >= 2) return has_nan_code_zmm;
    if (simd) return has_nan_code_avx2;
#endif
    (void)simd;
    return has_nan_code;
}

/* --------------------------------------------------- checked buffers */
/* Two kinds of refusal. Arguments that cannot be meant (a 2-d buffer, the wrong
 * item size or number of scales, shapes that differ, an unknown code) raise
 * kv_error. Layouts the loops do not take (negative or odd strides, head_dim
 * not contiguous, misaligned elements, an output whose elements share memory
 * or that overlaps an input) return a reason, so that the caller runs the
 * reference. Either way nothing has been read or written yet. */

/* A [T, H, D] array from a buffer: byte strides, the last one the item size. */
typedef struct {
    Py_buffer view;
    int held;
    char *base;
    Py_ssize_t T, H, D;
    Py_ssize_t st, sh; /* strides in bytes */
    char *lo, *hi;     /* the bytes the elements span; lo == hi when empty */
} Arr;

static const int DT_SIZE[] = {2, 2, 4};

static int fail(const char *fn, const char *what) {
    PyErr_Format(kv_error, "kvcodec._cpu.%s: %s", fn, what);
    return -1;
}

/* Re-raise the pending error (a TypeError from argument parsing, a BufferError...) as kv_error. */
static void rethrow(const char *fn) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *msg = value ? PyObject_Str(value) : NULL;
    if (msg) {
        PyErr_Format(kv_error, "kvcodec._cpu.%s: %U", fn, msg);
        Py_DECREF(msg);
    } else {
        PyErr_Clear();
        PyErr_Format(kv_error, "kvcodec._cpu.%s: bad argument", fn);
    }
    if (value) {
        PyObject *t2, *v2, *tb2;
        PyErr_Fetch(&t2, &v2, &tb2);
        PyErr_NormalizeException(&t2, &v2, &tb2);
        PyException_SetCause(v2, value); /* steals value */
        PyErr_Restore(t2, v2, tb2);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
}

/* Bytes spanned by the elements (non-negative strides): 1 + sum((n_i - 1) * stride_i)
 * item sizes; 0 when empty, -1 on overflow. */
static Py_ssize_t span_of(int nd, const Py_ssize_t *shape, const Py_ssize_t *strides, Py_ssize_t itemsize) {
    Py_ssize_t span = itemsize;
    for (int i = 0; i < nd; i++) {
        if (shape[i] == 0) return 0;
        Py_ssize_t step;
        if (__builtin_mul_overflow(shape[i] - 1, strides[i], &step) || __builtin_add_overflow(span, step, &span))
            return -1;
    }
    return span;
}

/* Whether no two elements share a byte: the dimensions of extent > 1, by
 * increasing stride, each step past the whole of the previous one. */
static int no_self_overlap(int nd, const Py_ssize_t *shape, const Py_ssize_t *strides, Py_ssize_t itemsize) {
    Py_ssize_t n[4], s[4];
    int k = 0;
    for (int i = 0; i < nd; i++)
        if (shape[i] > 1) {
            int j = k++;
            while (j > 0 && s[j - 1] > strides[i]) {
                n[j] = n[j - 1];
                s[j] = s[j - 1];
                j--;
            }
            n[j] = shape[i];
            s[j] = strides[i];
        }
    Py_ssize_t need = itemsize;
    for (int i = 0; i < k; i++) {
        if (s[i] < need) return 0;
        if (__builtin_mul_overflow(s[i], n[i], &need)) return 1; /* nothing further can be closer */
    }
    return 1;
}

/* Take a [T, H, D] buffer of `itemsize`-byte elements into `a`. -1: error raised;
 * 0: taken, with *why set when the loops cannot take its layout. */
static int get_arr(PyObject *obj, Py_ssize_t itemsize, int writable, const char *fn, const char *name, Arr *a,
                   const char **why) {
    if (PyObject_GetBuffer(obj, &a->view, writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO) < 0) {
        rethrow(fn);
        return -1;
    }
    a->held = 1;
    Py_buffer *v = &a->view;
    char msg[120];
    if (v->ndim != 3 || !v->shape || !v->strides) {
        snprintf(msg, sizeof msg, "%s must be a 3-d [tokens, heads, head_dim] buffer", name);
        return fail(fn, msg);
    }
    if (v->itemsize != itemsize) {
        snprintf(msg, sizeof msg, "%s has %zd-byte elements; expected %zd", name, v->itemsize, itemsize);
        return fail(fn, msg);
    }
    a->base = a->lo = a->hi = (char *)v->buf;
    a->T = v->shape[0];
    a->H = v->shape[1];
    a->D = v->shape[2];
    a->st = v->strides[0];
    a->sh = v->strides[1];
    const char *w = NULL;
    for (int i = 0; i < 3; i++)
        if (v->strides[i] < 0 || v->strides[i] % itemsize) w = "a buffer has a negative stride or one not a multiple of its item size";
    if (!w) {
        Py_ssize_t span = span_of(3, v->shape, v->strides, itemsize);
        if (span < 0 || (uintptr_t)v->buf > UINTPTR_MAX - (uintptr_t)span) {
            snprintf(msg, sizeof msg, "%s: extents times strides overflow", name);
            return fail(fn, msg);
        }
        a->hi = a->lo + span;
        if (a->D > 1 && v->strides[2] != itemsize)
            w = "a buffer's head_dim is not contiguous";
        else if ((uintptr_t)v->buf % (uintptr_t)itemsize)
            w = "a buffer is not aligned to its elements";
        else if (writable && !no_self_overlap(3, v->shape, v->strides, itemsize))
            w = "an output has elements sharing memory";
    }
    if (!*why) *why = w;
    return 0;
}

/* Take a C-contiguous buffer of exactly n fp32 values into `a` (-1: error raised). */
static int get_scales(PyObject *obj, Py_ssize_t n, int writable, const char *fn, Arr *a, const char **why) {
    if (PyObject_GetBuffer(obj, &a->view, writable ? (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) : PyBUF_C_CONTIGUOUS) <
        0) {
        rethrow(fn);
        return -1;
    }
    a->held = 1;
    Py_ssize_t want;
    if (__builtin_mul_overflow(n, (Py_ssize_t)4, &want) || a->view.len != want) {
        char msg[120];
        snprintf(msg, sizeof msg, "scales hold %zd bytes; the scope needs %zd fp32 values", a->view.len, n);
        return fail(fn, msg);
    }
    a->base = a->lo = (char *)a->view.buf;
    a->hi = a->lo + want;
    if (!*why && (uintptr_t)a->view.buf % 4) *why = "scales are not aligned to 4 bytes";
    return 0;
}

static int overlaps(const Arr *a, const Arr *b) { return a->lo < b->hi && b->lo < a->hi; }

/* Scale groups of a scope over T tokens x H heads (page >= 1), without overflow (-1 if it would). */
static Py_ssize_t groups_of(Py_ssize_t T, Py_ssize_t H, int scope, Py_ssize_t page) {
    if (scope == SC_TENSOR) return 1;
    if (scope == SC_LAYER_HEAD) return H;
    Py_ssize_t pages = T / page + (T % page != 0), n;
    return __builtin_mul_overflow(pages, H, &n) ? -1 : n;
}

static inline Py_ssize_t group_of(int scope, Py_ssize_t page, Py_ssize_t H, Py_ssize_t t, Py_ssize_t h) {
    if (scope == SC_TENSOR) return 0;
    if (scope == SC_LAYER_HEAD) return h;
    return (t / page) * H + h;
}

/* Token t's row of scales: head h's is [h] (or [0] for per_tensor): group_of's division once a token. */
static inline const float *token_scales(const float *sc, int scope, Py_ssize_t page, Py_ssize_t H, Py_ssize_t t) {
    return scope == SC_PAGE_HEAD ? sc + (t / page) * H : sc;
}

static int check_dtype(const char *fn, int dtype) {
    return dtype < DT_F16 || dtype > DT_F32 ? fail(fn, "dtype code must be 0 (fp16), 1 (bf16) or 2 (fp32)") : 0;
}

static int check_scope(const char *fn, int scope, Py_ssize_t page) {
    if (scope < SC_TENSOR || scope > SC_PAGE_HEAD)
        return fail(fn, "scope code must be 0 (per_tensor), 1 (per_layer_head) or 2 (per_page_head)");
    return page < 1 ? fail(fn, "page size must be >= 1") : 0;
}

/* Parse with PyArg_VaParse, re-raising a parse error as kv_error. */
static int parse(PyObject *args, const char *fn, const char *fmt, ...) {
    va_list va;
    va_start(va, fmt);
    int ok = PyArg_VaParse(args, fmt, va);
    va_end(va);
    if (!ok) rethrow(fn);
    return ok ? 0 : -1;
}

/* One call's buffers: the input rows, the output rows (same shape) and the scales. */
typedef struct {
    Arr in, out, s;
    Py_ssize_t ng;   /* scale groups */
    const char *why; /* set: the loops decline this layout */
} Bufs;

static void release_bufs(Bufs *b) {
    if (b->in.held) PyBuffer_Release(&b->in.view);
    if (b->out.held) PyBuffer_Release(&b->out.view);
    if (b->s.held) PyBuffer_Release(&b->s.view);
}

/* Take and check a call's three buffers (scales written when `scales_out`). -1: error raised
 * (buffers released); 0: taken, b->why set when the loops decline the layout. */
static int take_bufs(const char *fn, PyObject *in, Py_ssize_t in_size, PyObject *out, Py_ssize_t out_size,
                     PyObject *scales, int scales_out, int scope, Py_ssize_t page, Bufs *b) {
    memset(b, 0, sizeof(*b));
    if (get_arr(in, in_size, 0, fn, "the input", &b->in, &b->why) < 0 ||
        get_arr(out, out_size, 1, fn, "the output", &b->out, &b->why) < 0)
        goto error;
    if (b->in.T != b->out.T || b->in.H != b->out.H || b->in.D != b->out.D) {
        fail(fn, "the output's shape differs from the input's");
        goto error;
    }
    b->ng = groups_of(b->in.T, b->in.H, scope, page);
    if (b->ng < 0) {
        fail(fn, "too many scale groups");
        goto error;
    }
    if (get_scales(scales, b->ng, scales_out, fn, &b->s, &b->why) < 0) goto error;
    if (!b->why && (overlaps(&b->out, &b->in) || overlaps(&b->out, &b->s) || (scales_out && overlaps(&b->s, &b->in))))
        b->why = "an output overlaps an input or another output";
    return 0;
error:
    release_bufs(b);
    return -1;
}

/* None when the loops ran, else the reason they did not (see take_bufs and the loops). */
static PyObject *result(Bufs *b, const char *why) {
    release_bufs(b);
    return why ? PyUnicode_FromString(why) : Py_NewRef(Py_None);
}

/* ------------------------------------------------------------- encode_v */

/* The scale a group's absmax gives (amax / 448, IEEE; 1.0 for zero), as stored
 * in `sdt` and widened back, which quantization then uses (as LMCache does).
 * Returns a reason when the reference must take the call. */
static const char *group_scale(float amax, int sdt, float *out) {
    float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (s == 0.0f) return "a group's scale underflows to zero (fp32 V with a subnormal absmax)";
    if (sdt == DT_F16) s = f16_to_f32(f32_to_f16(s));
    if (sdt == DT_BF16) s = bf16_to_f32(f32_to_bf16(s));
    if (!(finite_f32(s) && s > 0.0f)) return "a scale does not fit the stored scale dtype";
    *out = s;
    return NULL;
}

/* Pass 1: every group's absmax, then its scale, into `scales`. Nothing else is written. */
/* Pass 1 for 16-bit V with AVX2: each group's (page's or the whole tensor's tokens, one head) absmax
 * bits in one vector pass over its rows. The maximum of the bit patterns is the same whatever the
 * order, so the scales are those of the row-by-row pass. */
#ifdef KV_HAVE_AVX2
/* Head h's absmax over rows t0 .. t0 + rows of 16-bit V (one vector pass); 0 when it is NaN or Inf. */
static int head_amax_u16(const Arr *v, int vdt, Py_ssize_t t0, Py_ssize_t rows, Py_ssize_t h, int simd, float *m) {
    const char *first = v->base + t0 * v->st + h * v->sh;
    uint16_t bits = simd >= 2 ? amax_rows_u16_zmm(first, v->st, rows, v->D) : amax_rows_u16_avx2(first, v->st, rows, v->D);
    *m = vdt == DT_F16 ? f16_to_f32(bits) : bf16_to_f32(bits);
    return finite_f32(*m);
}
#endif

static const char *group_amax_u16(const Arr *v, int vdt, int scope, Py_ssize_t page, float *scales, int simd) {
#ifdef KV_HAVE_AVX2
    Py_ssize_t block = scope == SC_PAGE_HEAD ? page : v->T;
    for (Py_ssize_t t0 = 0; t0 < v->T; t0 += block) {
        Py_ssize_t rows = v->T - t0 < block ? v->T - t0 : block;
        for (Py_ssize_t h = 0; h < v->H; h++) {
            float m;
            if (!head_amax_u16(v, vdt, t0, rows, h, simd, &m)) return "V holds NaN or Inf (the reference names the group)";
            float *g = scales + group_of(scope, page, v->H, t0, h);
            *g = f32_bits(m) > f32_bits(*g) ? m : *g;
        }
    }
#else
    (void)v, (void)vdt, (void)scope, (void)page, (void)scales, (void)simd;
#endif
    return NULL;
}

static const char *encode_scales(const Arr *v, int vdt, int scope, Py_ssize_t page, int sdt, float *scales,
                                 Py_ssize_t ng, int simd) {
    amax_fn amax = pick_amax(vdt);
    memset(scales, 0, (size_t)ng * sizeof(float));
    if (simd && vdt != DT_F32) {
        const char *why = group_amax_u16(v, vdt, scope, page, scales, simd);
        if (why) return why;
    } else
        for (Py_ssize_t t = 0; t < v->T; t++)
        for (Py_ssize_t h = 0; h < v->H; h++) {
            float m = amax(v->base + t * v->st + h * v->sh, v->D);
            if (!finite_f32(m)) return "V holds NaN or Inf (the reference names the group)";
            float *g = scales + group_of(scope, page, v->H, t, h);
            *g = f32_bits(m) > f32_bits(*g) ? m : *g;
        }
    for (Py_ssize_t g = 0; g < ng; g++) {
        const char *why = group_scale(scales[g], sdt, scales + g);
        if (why) return why;
    }
    return NULL;
}

/* The codes of rows t0 .. t1, each with its group's scale; returns whether a row met a NaN. */
static int quantize_span(const Arr *v, const Arr *q, quant_fn quant, int scope, Py_ssize_t page, const float *sc,
                         Py_ssize_t t0, Py_ssize_t t1) {
    for (Py_ssize_t t = t0; t < t1; t++) {
        const float *st = token_scales(sc, scope, page, v->H, t);
        for (Py_ssize_t h = 0; h < v->H; h++)
            if (quant(v->base + t * v->st + h * v->sh, v->D, st[scope == SC_TENSOR ? 0 : h],
                      (uint8_t *)q->base + t * q->st + h * q->sh))
                return 1;
    }
    return 0;
}

static int quantize_rows(const Arr *v, const Arr *q, int vdt, int scope, Py_ssize_t page, const float *sc, int simd) {
    return quantize_span(v, q, pick_quant(vdt, simd), scope, page, sc, 0, v->T);
}

/* Tokens per slice of a CRC folded into a row loop: about 16 KiB of one-byte codes, so that each
 * slice is checksummed while it is still in L1. */
static Py_ssize_t crc_slice_tokens(const Arr *q) {
    Py_ssize_t row = q->H * q->D;
    return row >= 16384 || row == 0 ? 1 : 16384 / row;
}

/* Whether q's codes lie densely in token-major order (the blob's order, which the CRC follows). */
static int dense_codes(const Arr *q) {
    return (q->H == 1 || q->sh == q->D) && (q->T == 1 || q->st == q->H * q->D);
}

/* memcpy of n bytes with the running CRC state carried over them, in the same pass. */
static uint32_t copy_crc(char *dst, const char *src, size_t n, uint32_t state) {
    return crc_copy(state, (uint8_t *)dst, (const uint8_t *)src, n);
}

/* quantize_span over every row, the CRC state carried over each slice of codes just written. */
static uint32_t quantize_rows_crc(const Arr *v, const Arr *q, quant_fn quant, int scope, Py_ssize_t page,
                                  const float *sc, uint32_t state) {
    Py_ssize_t step = crc_slice_tokens(q);
    for (Py_ssize_t t0 = 0; t0 < v->T; t0 += step) {
        Py_ssize_t t1 = v->T - t0 < step ? v->T : t0 + step;
        (void)quantize_span(v, q, quant, scope, page, sc, t0, t1); /* no NaN: encode_scales checked V */
        size_t row = (size_t)(q->H * q->D);
        state = crc_update(state, (const uint8_t *)q->base + (size_t)t0 * row, (size_t)(t1 - t0) * row);
    }
    return state;
}

#ifdef KV_HAVE_AVX2
/* quantize_rows_crc with the CRC carried by the rows (see QUANT_ROW_CRC): every row, in blob order. */
ZMMC_FN static uint32_t quantize_rows_fold(const Arr *v, const Arr *q, int vdt, int scope, Py_ssize_t page,
                                           const float *sc, uint32_t state) {
    quant_crc_fn quant = vdt == DT_F16 ? quant_crc_f16 : vdt == DT_BF16 ? quant_crc_bf16 : quant_crc_f32;
    Crc1 crc = {.started = 0, .state = state};
    for (Py_ssize_t t = 0; t < v->T; t++) {
        const float *st = token_scales(sc, scope, page, v->H, t);
        for (Py_ssize_t h = 0; h < v->H; h++)
            quant(v->base + t * v->st + h * v->sh, v->D, st[scope == SC_TENSOR ? 0 : h],
                  (uint8_t *)q->base + t * q->st + h * q->sh, &crc);
    }
    return crc1_state(&crc);
}

/* Whether quantize_rows_fold takes the codes' CRC (512-bit folding and rows, whole 64-byte rows). */
static int can_fold_codes(const Arr *q, int simd) {
    return simd >= 2 && kv_crc_fast >= 2 && q->D % 64 == 0;
}

/* per_page_head with 16-bit V: one page at a time, its scales (the absmax pass over its rows) and then
 * its codes while those rows are still in L1, so V comes from memory once instead of twice. A page
 * holding NaN/Inf, or one whose scale the stored dtype cannot hold, stops the pass with its reason:
 * the codes of the pages before it are written by then (the reference then writes all of q, or
 * raises). While a page is quantized its successor's rows are prefetched. */
static const char *page_scales(const Arr *v, int vdt, Py_ssize_t t0, Py_ssize_t rows, int sdt, float *sc, int simd) {
    for (Py_ssize_t h = 0; h < v->H; h++) {
        float m;
        if (!head_amax_u16(v, vdt, t0, rows, h, simd, &m)) return "V holds NaN or Inf (the reference names the group)";
        const char *why = group_scale(m, sdt, sc + h);
        if (why) return why;
    }
    return NULL;
}

static inline void prefetch_row(const char *row, Py_ssize_t bytes) {
    for (Py_ssize_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
}

/* How many tokens ahead the rows are prefetched: about 32 KiB of V (a page of 16 tokens x 8 heads x 128
 * in fp16), so the next page's absmax reads L1 while this page's quantize keeps the core busy. */
static inline Py_ssize_t prefetch_tokens(const Arr *v) {
    Py_ssize_t st = v->st > 0 ? v->st : 1;
    return (32768 + st - 1) / st;
}

/* The CRC state carried over the codes in blob order: `want` none (0), per page from memory (1). */
static const char *encode_paged(const Arr *v, const Arr *q, int vdt, Py_ssize_t page, int sdt, float *scales,
                                int simd, int want, uint32_t *state) {
    quant_fn quant = pick_quant_finite(vdt, simd);
    Py_ssize_t row_bytes = v->D * 2, lead = prefetch_tokens(v), ahead = lead * v->st;
    for (Py_ssize_t t0 = 0; t0 < v->T; t0 += page) {
        Py_ssize_t rows = v->T - t0 < page ? v->T - t0 : page;
        float *sc = scales + (t0 / page) * v->H;
        const char *why = page_scales(v, vdt, t0, rows, sdt, sc, simd);
        if (why) return why;
        for (Py_ssize_t t = t0; t < t0 + rows; t++)
            for (Py_ssize_t h = 0; h < v->H; h++) {
                const char *row = v->base + t * v->st + h * v->sh;
                if (t + lead < v->T) prefetch_row(row + ahead, row_bytes);
                (void)quant(row, v->D, sc[h], (uint8_t *)q->base + t * q->st + h * q->sh);
            }
        if (want) { /* dense codes: a token is H * D bytes whatever q's token stride says (T == 1) */
            size_t token = (size_t)(q->H * q->D);
            *state = crc_update(*state, (const uint8_t *)q->base + (size_t)t0 * token, (size_t)rows * token);
        }
    }
    return NULL;
}

/* encode_paged with the codes' CRC carried by the stores (can_fold_codes: codes dense). */
ZMMC_FN static const char *encode_paged_fold(const Arr *v, const Arr *q, int vdt, Py_ssize_t page, int sdt,
                                             float *scales, uint32_t *state) {
    quant_crc_fn quant = vdt == DT_F16 ? quant_crc_f16 : quant_crc_bf16;
    Crc1 crc = {.started = 0, .state = *state};
    Py_ssize_t row_bytes = v->D * 2, lead = prefetch_tokens(v), ahead = lead * v->st;
    for (Py_ssize_t t0 = 0; t0 < v->T; t0 += page) {
        Py_ssize_t rows = v->T - t0 < page ? v->T - t0 : page;
        float *sc = scales + (t0 / page) * v->H;
        const char *why = page_scales(v, vdt, t0, rows, sdt, sc, 2);
        if (why) return why;
        for (Py_ssize_t t = t0; t < t0 + rows; t++)
            for (Py_ssize_t h = 0; h < v->H; h++) {
                const char *row = v->base + t * v->st + h * v->sh;
                if (t + lead < v->T) prefetch_row(row + ahead, row_bytes);
                quant(row, v->D, sc[h], (uint8_t *)q->base + t * q->st + h * q->sh, &crc);
            }
    }
    *state = crc1_state(&crc);
    return NULL;
}
#endif

/* An optional byte copy that rides along with an encode (K beside V's codes): one GIL
 * release per chunk instead of two. Both buffers C-contiguous, equal lengths; they may overlap each
 * other (memmove), not the encode's outputs. */
typedef struct {
    Py_buffer src, dst;
    int held;
} Copy;

static void release_copy(Copy *c) {
    if (c->held) {
        PyBuffer_Release(&c->src);
        PyBuffer_Release(&c->dst);
    }
}

static int take_copy(const char *fn, PyObject *src, PyObject *dst, Copy *c) {
    memset(c, 0, sizeof(*c));
    if (src == Py_None && dst == Py_None) return 0;
    if (PyObject_GetBuffer(src, &c->src, PyBUF_C_CONTIGUOUS) < 0) return rethrow(fn), -1;
    if (PyObject_GetBuffer(dst, &c->dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&c->src);
        return rethrow(fn), -1;
    }
    c->held = 1;
    if (c->src.len != c->dst.len) return fail(fn, "the copy's source and destination differ in length"), release_copy(c), -1;
    return 0; /* they may overlap (K re-encoded into the blob it was decoded from): the copy is a memmove */
}

/* Whether two buffers share a byte. */
static int bufs_overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *a0 = a->buf, *b0 = b->buf;
    return a->len && b->len && a0 < b0 + b->len && b0 < a0 + a->len;
}

/* Whether the copy's `buf` (its source or destination) shares bytes with array `a`. */
static int copy_overlaps(const Copy *c, const Py_buffer *buf, const Arr *a) {
    if (!c->held || !buf->len || !a->held) return 0;
    const char *b0 = buf->buf, *a0 = a->lo;
    return b0 < a->hi && a0 < b0 + buf->len;
}

/* Take an optional CRC seed: Py_None (no CRC wanted: *want = 0) or an int 0 .. 2^32 - 1. -1: error raised. */
static int take_crc(const char *fn, PyObject *obj, int *want, uint32_t *seed) {
    *want = 0;
    if (obj == Py_None) return 0;
    unsigned long long v = PyLong_Check(obj) ? PyLong_AsUnsignedLongLong(obj) : (unsigned long long)-1;
    if (PyErr_Occurred()) PyErr_Clear();
    if (!PyLong_Check(obj) || v > 0xFFFFFFFFull) return fail(fn, "the CRC seed must be None or an int in 0 .. 2**32 - 1");
    *want = 1;
    *seed = (uint32_t)v;
    return 0;
}

/* What an encode or decode with a CRC seed returns: the CRC continued over the payload bytes it
 * went through when it could fold it in (`done`), else None (the caller computes it). */
static PyObject *crc_result(Bufs *b, int done, uint32_t state) {
    release_bufs(b);
    return done ? PyLong_FromUnsignedLong(~state & 0xFFFFFFFFu) : Py_NewRef(Py_None);
}

#ifdef KV_HAVE_AVX2
/* encode_paged (its codes' CRC from a fresh state when `fold`), then the copy once the encode is
 * served, its CRC continuing *state; the two CRCs joined in blob order (copy, then codes). */
static const char *encode_paged_then_copy(const Bufs *b, const Copy *c, int vdt, Py_ssize_t page, int sdt, int simd,
                                          int fold, uint32_t *state) {
    uint32_t codes = 0xFFFFFFFFu;
    const char *why = fold && can_fold_codes(&b->out, simd)
                          ? encode_paged_fold(&b->in, &b->out, vdt, page, sdt, (float *)b->s.base, &codes)
                          : encode_paged(&b->in, &b->out, vdt, page, sdt, (float *)b->s.base, simd, fold, &codes);
    if (why) return why;
    if (c->held && c->src.len) {
        if (fold)
            *state = copy_crc(c->dst.buf, c->src.buf, (size_t)c->src.len, *state);
        else
            memmove(c->dst.buf, c->src.buf, (size_t)c->src.len);
    }
    if (fold) *state = ~crc32_combine_len(~*state, ~codes, (uint64_t)(b->out.T * b->out.H * b->out.D));
    return NULL;
}
#endif

/* encode_v(v, v_dtype, scope, page, scale_dtype, q, scales[, copy_src, copy_dst[, crc]]) -> None, an
 * int, or why the reference must take it. V's group scales (fp32 values of the stored scale dtype)
 * into `scales`, and its e4m3 codes into `q`: per_page_head 16-bit V page by page (encode_paged: V
 * read from memory once; a decline met at a page leaves the codes of the pages before it written),
 * other V in two passes (every scale, then every code: nothing reaches q when V holds NaN/Inf or a
 * scale is unusable). The optional copy (K's bytes into the blob) is made only when the encode is
 * served, in the same GIL release. With `crc` (an int: the CRC so far, e.g. of the header)
 * the result is that CRC continued over the copy's destination, then over q's bytes (a blob's K and
 * codes, in order), each slice checksummed right after it is written; None when the CRC could not be
 * folded in (no carry-less multiply, q not dense, or a copy overlapping itself): the caller computes it. */
static PyObject *py_encode_v(PyObject *self, PyObject *args) {
    (void)self;
    static const char *fn = "encode_v";
    PyObject *vo, *qo, *so, *cs = Py_None, *cd = Py_None, *co = Py_None;
    int vdt, scope, sdt, want;
    uint32_t seed = 0;
    Py_ssize_t page;
    Bufs b;
    Copy c;
    if (parse(args, fn, "OiiniOO|OOO", &vo, &vdt, &scope, &page, &sdt, &qo, &so, &cs, &cd, &co) ||
        check_dtype(fn, vdt) || check_dtype(fn, sdt) || check_scope(fn, scope, page) || take_crc(fn, co, &want, &seed) ||
        take_bufs(fn, vo, DT_SIZE[vdt], qo, 1, so, 1, scope, page, &b))
        return NULL;
    if (take_copy(fn, cs, cd, &c) < 0) return release_bufs(&b), NULL;
    /* The copy's destination may touch nothing the encode reads or writes, and its source nothing
     * the encode writes. */
    if (!b.why && (copy_overlaps(&c, &c.dst, &b.in) || copy_overlaps(&c, &c.dst, &b.out) ||
                   copy_overlaps(&c, &c.dst, &b.s) || copy_overlaps(&c, &c.src, &b.out) ||
                   copy_overlaps(&c, &c.src, &b.s)))
        b.why = "the copy overlaps an input or output of the encode";
    if (b.why) return release_copy(&c), result(&b, b.why);
    const char *why;
    int simd = kv_simd;
    int fold = want && kv_crc_fast && dense_codes(&b.out) && !(c.held && bufs_overlap(&c.src, &c.dst));
    uint32_t state = ~seed;
    Py_BEGIN_ALLOW_THREADS
#ifdef KV_HAVE_AVX2
    if (scope == SC_PAGE_HEAD && vdt != DT_F32 && simd && kv_paged)
        why = encode_paged_then_copy(&b, &c, vdt, page, sdt, simd, fold, &state);
    else
#endif
    {
    why = encode_scales(&b.in, vdt, scope, page, sdt, (float *)b.s.base, b.ng, simd);
    if (!why && fold) {
        if (c.held) state = copy_crc(c.dst.buf, c.src.buf, (size_t)c.src.len, state);
#ifdef KV_HAVE_AVX2
        if (can_fold_codes(&b.out, simd))
            state = quantize_rows_fold(&b.in, &b.out, vdt, scope, page, (const float *)b.s.base, state);
        else
#endif
            state = quantize_rows_crc(&b.in, &b.out, pick_quant_finite(vdt, simd), scope, page,
                                      (const float *)b.s.base, state);
    } else if (!why) {
        (void)quantize_span(&b.in, &b.out, pick_quant_finite(vdt, simd), scope, page, (const float *)b.s.base, 0,
                            b.in.T); /* no NaN left */
        if (c.held && c.src.len) memmove(c.dst.buf, c.src.buf, (size_t)c.src.len);
    }
    }
    Py_END_ALLOW_THREADS
    release_copy(&c);
    if (why || !want) return result(&b, why);
    return crc_result(&b, fold, state);
}

/* ------------------------------------------------------------- quantize */

/* Whether n scales are all finite (and, if `positive`, > 0). */
static int scales_ok(const float *s, Py_ssize_t n, int positive) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (!finite_f32(s[i]) || (positive && !(s[i] > 0.0f))) return 0;
    return 1;
}

/* quantize(v, v_dtype, scales, scope, page, q) -> None, or why the reference must take it.
 * Scales not finite and positive: nothing written. NaN in V: stops at that row
 * (the reference then rewrites all of q). */
static PyObject *py_quantize(PyObject *self, PyObject *args) {
    (void)self;
    static const char *fn = "quantize";
    PyObject *vo, *so, *qo;
    int vdt, scope;
    Py_ssize_t page;
    Bufs b;
    if (parse(args, fn, "OiOinO", &vo, &vdt, &so, &scope, &page, &qo) || check_dtype(fn, vdt) ||
        check_scope(fn, scope, page) || take_bufs(fn, vo, DT_SIZE[vdt], qo, 1, so, 0, scope, page, &b))
        return NULL;
    if (b.why) return result(&b, b.why);
    const char *why = NULL;
    int simd = kv_simd;
    Py_BEGIN_ALLOW_THREADS
    if (!scales_ok((const float *)b.s.base, b.ng, 1))
        why = "scales must be finite and positive";
    else if (quantize_rows(&b.in, &b.out, vdt, scope, page, (const float *)b.s.base, simd))
        why = "V holds NaN";
    Py_END_ALLOW_THREADS
    return result(&b, why);
}

/* ----------------------------------------------------------- dequantize */

/* Rows t0 .. t1's float(q) * scale; stops before a row holding a NaN code (returns 1). */
/* The rows dequantize_span reaches `lead` tokens from now (about 16 KiB of codes ahead): the codes
 * prefetched for reading, the output rows for writing, so that their lines are owned before the
 * stores arrive (measured 5-10% off a dense 2048-token decode coming from memory). */
static inline Py_ssize_t deq_lead(const Arr *q) {
    Py_ssize_t st = q->st > 0 ? q->st : 1;
    return (16384 + st - 1) / st;
}

static inline void prefetch_deq_row(const Arr *q, const Arr *o, Py_ssize_t t, Py_ssize_t h) {
    const char *codes = q->base + t * q->st + h * q->sh;
    const char *out = o->base + t * o->st + h * o->sh;
    for (Py_ssize_t off = 0; off < q->D; off += 64) __builtin_prefetch(codes + off, 0, 3);
    for (Py_ssize_t off = 0, n = q->D * o->view.itemsize; off < n; off += 64) __builtin_prefetch(out + off, 1, 3);
}

static int dequantize_span(const Arr *q, const Arr *o, deq_fn deq, nan_fn has_nan, int scope, Py_ssize_t page,
                           const float *sc, Py_ssize_t t0, Py_ssize_t t1, DeqTables *tabs) {
#ifndef KV_HAVE_AVX2
    (void)tabs; /* tables_if gives none without the AVX-512 rows */
#endif
    Py_ssize_t lead = deq_lead(q);
    for (Py_ssize_t t = t0; t < t1; t++) {
        const float *st = token_scales(sc, scope, page, q->H, t);
        for (Py_ssize_t h = 0; h < q->H; h++) {
            const uint8_t *row = (const uint8_t *)q->base + t * q->st + h * q->sh;
            if (t + lead < q->T) prefetch_deq_row(q, o, t + lead, h);
            if (has_nan(row, q->D)) return 1;
            float s = st[scope == SC_TENSOR ? 0 : h];
#ifdef KV_HAVE_AVX2
            if (tabs) {
                deq_row_tables(tabs, h, row, q->D, s, o->base + t * o->st + h * o->sh);
                continue;
            }
#endif
            deq(row, q->D, s, o->base + t * o->st + h * o->sh);
        }
    }
    return 0;
}

/* Every row's float(q) * scale; stops before a row holding a NaN code (returns 1). */
static int dequantize_rows(const Arr *q, const Arr *o, int odt, int scope, Py_ssize_t page, const float *sc,
                           int simd) {
    DeqTables t;
    return dequantize_span(q, o, pick_deq(odt, simd), pick_nan(simd), scope, page, sc, 0, q->T,
                           tables_if(&t, odt, simd));
}

#ifdef KV_HAVE_AVX2
/* dequantize_rows_crc with the CRC carried by the rows (deq_row_fold): the codes read once. For 16-bit
 * output (tables) where can_fold_codes holds; the rows are in blob order (t, then h). */
ZMMC_FN static int dequantize_rows_fold(const Arr *q, const Arr *o, int scope, Py_ssize_t page, const float *sc,
                                        DeqTables *tabs, uint32_t *state) {
    Crc1 crc = {.started = 0, .state = *state};
    Py_ssize_t lead = deq_lead(q);
    int bad = 0;
    for (Py_ssize_t t = 0; t < q->T && !bad; t++) {
        const float *st = token_scales(sc, scope, page, q->H, t);
        for (Py_ssize_t h = 0; h < q->H && !bad; h++) {
            if (t + lead < q->T) prefetch_deq_row(q, o, t + lead, h);
            bad = deq_row_fold(tabs, h, (const uint8_t *)q->base + t * q->st + h * q->sh, q->D,
                               st[scope == SC_TENSOR ? 0 : h], o->base + t * o->st + h * o->sh, &crc);
        }
    }
    *state = crc1_state(&crc);
    return bad;
}
#endif

/* dequantize_rows with the running CRC state carried over q's bytes (dense), each slice checksummed
 * just before its rows are read for the dequantization. Returns 1 at a NaN code (the state then
 * covers only part of q). */
static int dequantize_rows_crc(const Arr *q, const Arr *o, int odt, int scope, Py_ssize_t page, const float *sc,
                               int simd, uint32_t *state) {
    deq_fn deq = pick_deq(odt, simd);
    nan_fn has_nan = pick_nan(simd);
    DeqTables t;
    DeqTables *tabs = tables_if(&t, odt, simd);
#ifdef KV_HAVE_AVX2
    if (tabs && can_fold_codes(q, simd)) return dequantize_rows_fold(q, o, scope, page, sc, tabs, state);
#endif
    Py_ssize_t step = crc_slice_tokens(q);
    size_t row = (size_t)(q->H * q->D);
    for (Py_ssize_t t0 = 0; t0 < q->T; t0 += step) {
        Py_ssize_t t1 = q->T - t0 < step ? q->T : t0 + step;
        *state = crc_update(*state, (const uint8_t *)q->base + (size_t)t0 * row, (size_t)(t1 - t0) * row);
        if (dequantize_span(q, o, deq, has_nan, scope, page, sc, t0, t1, tabs)) return 1;
    }
    return 0;
}

/* dequantize(q, scales, scope, page, out, out_dtype[, copy_src, copy_dst[, crc]]) -> None, an int, or
 * why the reference must take it. Non-finite scales, or a copy touching another buffer: nothing
 * written. NaN codes: stops before that row (the reference then rewrites all of out). The optional
 * copy (a blob's K bytes into the caller's K) runs first, in the same GIL release. With `crc` (the
 * CRC so far: of the header) the result is that CRC continued over the copy's source, then q's bytes
 * (a blob's K and codes, in order), each slice checksummed while in cache, so that a decode reads
 * its payload once; None when it could not be folded in (the caller computes it). */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    (void)self;
    static const char *fn = "dequantize";
    PyObject *qo, *so, *oo, *cs = Py_None, *cd = Py_None, *co = Py_None;
    int scope, odt, want;
    uint32_t seed = 0;
    Py_ssize_t page;
    Bufs b;
    Copy c;
    if (parse(args, fn, "OOinOi|OOO", &qo, &so, &scope, &page, &oo, &odt, &cs, &cd, &co) || check_dtype(fn, odt) ||
        check_scope(fn, scope, page) || take_crc(fn, co, &want, &seed) ||
        take_bufs(fn, qo, 1, oo, DT_SIZE[odt], so, 0, scope, page, &b))
        return NULL;
    if (take_copy(fn, cs, cd, &c) < 0) return release_bufs(&b), NULL;
    if (!b.why && c.held &&
        (bufs_overlap(&c.src, &c.dst) || copy_overlaps(&c, &c.dst, &b.in) || copy_overlaps(&c, &c.dst, &b.out) ||
         copy_overlaps(&c, &c.dst, &b.s) || copy_overlaps(&c, &c.src, &b.out)))
        b.why = "the copy overlaps an input or output of the dequantization";
    if (b.why) return release_copy(&c), result(&b, b.why);
    const char *why = NULL;
    int simd = kv_simd;
    int fold = want && kv_crc_fast && dense_codes(&b.in);
    uint32_t state = ~seed;
    Py_BEGIN_ALLOW_THREADS
    if (!scales_ok((const float *)b.s.base, b.ng, 0))
        why = "scales must be finite";
    else if (fold) {
        if (c.held) state = copy_crc(c.dst.buf, c.src.buf, (size_t)c.src.len, state);
        if (dequantize_rows_crc(&b.in, &b.out, odt, scope, page, (const float *)b.s.base, simd, &state))
            why = "q holds NaN codes";
    } else {
        if (c.held && c.src.len) memcpy(c.dst.buf, c.src.buf, (size_t)c.src.len);
        if (dequantize_rows(&b.in, &b.out, odt, scope, page, (const float *)b.s.base, simd)) why = "q holds NaN codes";
    }
    Py_END_ALLOW_THREADS
    release_copy(&c);
    if (why || !want) return result(&b, why);
    return crc_result(&b, fold, state);
}

/* ------------------------------------------------------ scatter into a cache */
/* A vLLM layer cache view [N blocks, H heads, S slots, C = K and V widths] and the runs of a chunk's
 * tokens in it: (view block, first slot, first source token, tokens) as int64 quadruples. K rows are
 * copied (scatter_rows) and V's codes dequantized (scatter_dequant) straight into the view, one call
 * per layer: no token-major staging copy and no per-run Python. Every run is checked against the
 * view and the source before any row is written. */

typedef struct {
    Py_buffer view;
    int held;
    char *base;
    Py_ssize_t N, H, S, C;
    Py_ssize_t sn, sh, ss; /* strides in bytes */
    char *lo, *hi;
} Cache4;

/* Take a writable [N, H, S, C] buffer of `itemsize`-byte elements. -1: error raised; 0: taken, *why
 * set when the loops cannot take its layout. */
static int get_cache(PyObject *obj, Py_ssize_t itemsize, const char *fn, Cache4 *c, const char **why) {
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_RECORDS) < 0) return rethrow(fn), -1;
    c->held = 1;
    Py_buffer *v = &c->view;
    if (v->ndim != 4 || !v->shape || !v->strides) return fail(fn, "the cache must be a 4-d [blocks, heads, slots, width] buffer");
    if (v->itemsize != itemsize) return fail(fn, "the cache's item size is not the rows'");
    c->base = c->lo = c->hi = (char *)v->buf;
    c->N = v->shape[0];
    c->H = v->shape[1];
    c->S = v->shape[2];
    c->C = v->shape[3];
    c->sn = v->strides[0];
    c->sh = v->strides[1];
    c->ss = v->strides[2];
    const char *w = NULL;
    for (int i = 0; i < 4; i++)
        if (v->strides[i] < 0 || v->strides[i] % itemsize) w = "the cache has a negative stride or one not a multiple of its item size";
    if (!w) {
        Py_ssize_t span = span_of(4, v->shape, v->strides, itemsize);
        if (span < 0 || (uintptr_t)v->buf > UINTPTR_MAX - (uintptr_t)span) return fail(fn, "the cache's extents times strides overflow");
        c->hi = c->lo + span;
        if (c->C > 1 && v->strides[3] != itemsize)
            w = "the cache's width is not contiguous";
        else if ((uintptr_t)v->buf % (uintptr_t)itemsize)
            w = "the cache is not aligned to its elements";
        else if (!no_self_overlap(4, v->shape, v->strides, itemsize))
            w = "the cache has elements sharing memory";
    }
    if (!*why) *why = w;
    return 0;
}

/* Take the runs (C-contiguous int64, a multiple of 4 values) and check each against the source rows
 * `src` and the cache, and the columns col .. col + D against the cache's width. -1: error raised. */
static int take_runs(PyObject *obj, const char *fn, Py_ssize_t T, Py_ssize_t H, Py_ssize_t D, const Cache4 *c,
                     Py_ssize_t col, Py_buffer *r) {
    if (PyObject_GetBuffer(obj, r, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return rethrow(fn), -1;
    const char *f = r->format ? r->format : "B";
    int i64 = r->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0 || strcmp(f, "<q") == 0 || strcmp(f, "=q") == 0);
    if (!i64 || r->len % 32) return PyBuffer_Release(r), fail(fn, "runs must be int64 quadruples (block, slot, token, count)");
    if (H != c->H) return PyBuffer_Release(r), fail(fn, "the rows' heads are not the cache's");
    if (col < 0 || D > c->C || col > c->C - D) return PyBuffer_Release(r), fail(fn, "the columns do not fit the cache's width");
    const int64_t *q = (const int64_t *)r->buf;
    for (Py_ssize_t i = 0; i < r->len / 8; i += 4) {
        int64_t b = q[i], s = q[i + 1], t = q[i + 2], n = q[i + 3];
        if (b < 0 || b >= c->N || s < 0 || t < 0 || n < 0 || n > c->S - s || n > T - t)
            return PyBuffer_Release(r), fail(fn, "a run lies outside the cache or the rows");
    }
    return 0;
}

static int cache_overlaps(const Cache4 *c, const Arr *a) { return a->held && a->lo < a->hi && c->lo < a->hi && a->lo < c->hi; }

static void copy_runs(const Arr *src, const Cache4 *c, Py_ssize_t col, const int64_t *q, Py_ssize_t nq) {
    size_t row = (size_t)(src->D * src->view.itemsize);
    char *dst0 = c->base + col * c->view.itemsize;
    for (Py_ssize_t i = 0; i < nq; i += 4)
        for (Py_ssize_t h = 0; h < src->H; h++)
            for (int64_t j = 0; j < q[i + 3]; j++)
                memcpy(dst0 + q[i] * c->sn + h * c->sh + (q[i + 1] + j) * c->ss,
                       src->base + (q[i + 2] + j) * src->st + h * src->sh, row);
}

/* scatter_rows(src, cache, col, runs) -> None, or why numpy must take it: src [T, H, D] rows into
 * columns col .. col + D of the cache view, run by run. */
static PyObject *py_scatter_rows(PyObject *self, PyObject *args) {
    (void)self;
    static const char *fn = "scatter_rows";
    PyObject *so, *co, *ro;
    Py_ssize_t col;
    Arr src;
    Cache4 c;
    Py_buffer r;
    const char *why = NULL;
    memset(&src, 0, sizeof src);
    memset(&c, 0, sizeof c);
    if (parse(args, fn, "OOnO", &so, &co, &col, &ro)) return NULL;
    PyObject *ret = NULL;
    Py_buffer probe;
    if (PyObject_GetBuffer(so, &probe, PyBUF_RECORDS_RO) < 0) return rethrow(fn), NULL;
    Py_ssize_t item = probe.itemsize;
    PyBuffer_Release(&probe);
    if (get_arr(so, item, 0, fn, "the rows", &src, &why) < 0 || get_cache(co, item, fn, &c, &why) < 0) goto done;
    if (take_runs(ro, fn, src.T, src.H, src.D, &c, col, &r) < 0) goto done;
    if (!why && cache_overlaps(&c, &src)) why = "the cache overlaps the rows";
    if (!why) {
        Py_BEGIN_ALLOW_THREADS
        copy_runs(&src, &c, col, (const int64_t *)r.buf, r.len / 8);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&r);
    ret = why ? PyUnicode_FromString(why) : Py_NewRef(Py_None);
done:
    if (src.held) PyBuffer_Release(&src.view);
    if (c.held) PyBuffer_Release(&c.view);
    return ret;
}

/* Whether any of the rows holds a NaN code. */
static int rows_have_nan(const Arr *q, nan_fn has_nan) {
    if (dense_codes(q)) return has_nan((const uint8_t *)q->base, q->T * q->H * q->D); /* one call, no row loop */
    for (Py_ssize_t t = 0; t < q->T; t++)
        for (Py_ssize_t h = 0; h < q->H; h++)
            if (has_nan((const uint8_t *)q->base + t * q->st + h * q->sh, q->D)) return 1;
    return 0;
}

/* rows_have_nan with the running CRC state carried over q's bytes (dense), slice by slice. */
static int rows_have_nan_crc(const Arr *q, nan_fn has_nan, uint32_t *state) {
    Py_ssize_t step = crc_slice_tokens(q);
    size_t row = (size_t)(q->H * q->D);
    for (Py_ssize_t t0 = 0; t0 < q->T; t0 += step) {
        Py_ssize_t t1 = q->T - t0 < step ? q->T : t0 + step;
        const uint8_t *slice = (const uint8_t *)q->base + (size_t)t0 * row; /* dense: the caller's fold */
        *state = crc_update(*state, slice, (size_t)(t1 - t0) * row);
        if (has_nan(slice, (Py_ssize_t)((size_t)(t1 - t0) * row))) return 1;
    }
    return 0;
}

/* Whether the runs take the tokens in increasing order without overlap (K's CRC can then follow them). */
static int runs_in_order(const int64_t *rq, Py_ssize_t nq) {
    int64_t end = 0;
    for (Py_ssize_t i = 0; i < nq; i += 4) {
        if (rq[i + 2] < end) return 0;
        end = rq[i + 2] + rq[i + 3];
    }
    return 1;
}

/* One scatter_dequant call's fixed parts: the codes, K's rows (NULL: V only), the cache, the scales. */
typedef struct {
    const Arr *q, *k;
    const Cache4 *c;
    const float *sc;
    int scope;
    Py_ssize_t page;
    char *v0, *k0; /* the cache's first V and K columns */
    size_t k_row;  /* bytes of one K row */
} ScatterJob;

typedef void (*scatter_head_fn)(const ScatterJob *, deq_fn, const int64_t *, Py_ssize_t);

/* One run's rows of head h (run: view block, first slot, first token, tokens): V dequantized by DEQ
 * (a row function called directly, so the compiler inlines it; `deq` for the generic instance), K's
 * row copied beside it. The scale group is followed token by token (no division per row). */
#define SCATTER_HEAD(attr, name, DEQ, ROW_COPY)                                                       \
    attr static void name(const ScatterJob *j, deq_fn deq, const int64_t *run, Py_ssize_t h) {        \
        (void)deq;                                                                                      \
        const Arr *q = j->q, *k = j->k;                                                                 \
        const Cache4 *c = j->c;                                                                         \
        Py_ssize_t t = (Py_ssize_t)run[2], tp = t / j->page, in_page = t % j->page;                     \
        Py_ssize_t head_scale = j->scope == SC_TENSOR ? 0 : h;                                          \
        Py_ssize_t at = run[0] * c->sn + h * c->sh + run[1] * c->ss; /* the slot's offset in the view */ \
        for (int64_t r = 0; r < run[3]; r++, t++, at += c->ss) {                                        \
            float scale = j->sc[j->scope == SC_PAGE_HEAD ? tp * q->H + h : head_scale];                 \
            DEQ((const uint8_t *)q->base + t * q->st + h * q->sh, q->D, scale, j->v0 + at);             \
            if (k) ROW_COPY(j->k0 + at, k->base + t * k->st + h * k->sh, j->k_row);                     \
            if (++in_page == j->page) in_page = 0, tp++;                                                \
        }                                                                                               \
    }

#define CALL_DEQ(row, D, s, out) deq(row, D, s, out)
SCATTER_HEAD(, scatter_head_any, CALL_DEQ, memcpy)

#ifdef KV_HAVE_AVX2
/* A K row of whole 64-byte lines (head_dim 32, 64, 128, 256 of a 16-bit dtype) by 512-bit moves, inline;
 * other sizes by memcpy. */
ZMM_FN static inline void copy_k_row(char *dst, const char *src, size_t n) {
    if (n % 64 || n > 512) {
        memcpy(dst, src, n);
        return;
    }
    for (size_t i = 0; i < n; i += 64) _mm512_storeu_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
}

/* The rows computed, not looked up: a run covers a page or two of each head, and rebuilding tables per
 * run measured 8-10% slower here than computing (the decode into dense rows gains from them). */
SCATTER_HEAD(ZMM_FN, scatter_head_f16_zmm, deq_row_f16_zmm, copy_k_row)
SCATTER_HEAD(ZMM_FN, scatter_head_bf16_zmm, deq_row_bf16_zmm, copy_k_row)
#endif

static scatter_head_fn pick_scatter_head(int odt, int simd) {
#ifdef KV_HAVE_AVX2
    if (simd >= 2 && odt == DT_F16) return scatter_head_f16_zmm;
    if (simd >= 2 && odt == DT_BF16) return scatter_head_bf16_zmm;
#endif
    (void)odt, (void)simd;
    return scatter_head_any;
}

/* scatter_dequant(q, scales, scope, page, cache, col, out_dtype, runs[, k, k_col[, crc]]) -> None, an
 * int, or why the reference must take it: float(q) * scale of the runs' rows into columns col .. col + D
 * of the cache view; with `k` (q's tokens and heads, each row the bytes of Dk elements of the cache's
 * dtype, any alignment), K's rows into columns k_col .. k_col + Dk in the same pass (a layer's whole
 * chunk in one call). NaN codes anywhere in q, non-finite scales or a layout the loops do not take:
 * nothing written. With `crc` (the CRC of the blob's header, or 0) and `k` and q dense (a blob's K and
 * codes), the result is that CRC continued over all of K then all of q, whatever the runs cover: q's
 * folded into the NaN check that precedes the writes, K's after each run's rows are copied (runs in
 * token order; else in a pass of its own), the two joined by crc32_combine_len. None: not folded. */
static PyObject *py_scatter_dequant(PyObject *self, PyObject *args) {
    (void)self;
    static const char *fn = "scatter_dequant";
    PyObject *qo, *so, *co, *ro, *ko = Py_None;
    int scope, odt;
    Py_ssize_t page, col, k_col = 0, k_d = 0;
    Arr q, s, k;
    Cache4 c;
    Py_buffer r, rk;
    int have_r = 0, have_rk = 0;
    const char *why = NULL;
    memset(&q, 0, sizeof q);
    memset(&s, 0, sizeof s);
    memset(&k, 0, sizeof k);
    memset(&c, 0, sizeof c);
    PyObject *cro = Py_None;
    int want;
    uint32_t seed = 0;
    if (parse(args, fn, "OOinOniO|OnO", &qo, &so, &scope, &page, &co, &col, &odt, &ro, &ko, &k_col, &cro) ||
        check_dtype(fn, odt) || check_scope(fn, scope, page) || take_crc(fn, cro, &want, &seed))
        return NULL;
    int fold = 0;
    uint32_t crc_k = 0, crc_q = 0;
    PyObject *ret = NULL;
    if (get_arr(qo, 1, 0, fn, "the codes", &q, &why) < 0) goto done;
    Py_ssize_t ng = groups_of(q.T, q.H, scope, page);
    if (ng < 0) {
        fail(fn, "too many scale groups");
        goto done;
    }
    if (get_scales(so, ng, 0, fn, &s, &why) < 0 || get_cache(co, DT_SIZE[odt], fn, &c, &why) < 0) goto done;
    if (take_runs(ro, fn, q.T, q.H, q.D, &c, col, &r) < 0) goto done;
    have_r = 1;
    if (ko != Py_None) {
        if (get_arr(ko, 1, 0, fn, "K", &k, &why) < 0) goto done; /* bytes: memcpy needs no alignment */
        if (k.T != q.T || k.H != q.H || k.D % DT_SIZE[odt]) {
            fail(fn, "K's tokens or heads are not the codes', or its rows not whole elements of the cache");
            goto done;
        }
        k_d = k.D / DT_SIZE[odt];
        if (take_runs(ro, fn, k.T, k.H, k_d, &c, k_col, &rk) < 0) goto done;
        have_rk = 1;
        if (!why && (k_col < col + q.D && col < k_col + k_d)) why = "K's columns overlap V's";
        if (!why && cache_overlaps(&c, &k)) why = "the cache overlaps K";
    }
    if (!why && (cache_overlaps(&c, &q) || cache_overlaps(&c, &s))) why = "the cache overlaps the codes or the scales";
    if (!why) {
        int simd = kv_simd;
        deq_fn deq = pick_deq(odt, simd);
        const int64_t *rq = (const int64_t *)r.buf;
        Py_ssize_t nq = r.len / 8;
        const float *sc = (const float *)s.base;
        size_t k_row = (size_t)k.D;
        fold = want && kv_crc_fast && k.held && dense_codes(&q) && dense_codes(&k);
        uint32_t sq = ~0u, sk = ~seed;
        size_t k_tok = (size_t)(k.H * k.D);
        int64_t k_next = 0;
        Py_BEGIN_ALLOW_THREADS
        int ordered = fold && runs_in_order(rq, nq);
        if (fold && !ordered) sk = crc_update(sk, (const uint8_t *)k.base, (size_t)k.T * k_tok);
        if (!scales_ok(sc, ng, 0))
            why = "scales must be finite";
        else if (fold ? rows_have_nan_crc(&q, pick_nan(simd), &sq) : rows_have_nan(&q, pick_nan(simd)))
            why = "q holds NaN codes";
        else {
            ScatterJob job = {&q, k.held ? &k : NULL, &c, sc, scope, page,
                              c.base + col * c.view.itemsize, c.base + k_col * c.view.itemsize, k_row};
            scatter_head_fn head = pick_scatter_head(odt, simd);
            for (Py_ssize_t i = 0; i < nq; i += 4) {
                for (Py_ssize_t h = 0; h < q.H; h++) head(&job, deq, rq + i, h);
                if (ordered) { /* K's bytes up to this run's end, the run's own still in cache */
                    sk = crc_update(sk, (const uint8_t *)k.base + (size_t)k_next * k_tok,
                                    (size_t)(rq[i + 2] + rq[i + 3] - k_next) * k_tok);
                    k_next = rq[i + 2] + rq[i + 3];
                }
            }
            if (ordered) sk = crc_update(sk, (const uint8_t *)k.base + (size_t)k_next * k_tok, (size_t)(k.T - k_next) * k_tok);
        }
        Py_END_ALLOW_THREADS
        crc_k = ~sk;
        crc_q = ~sq;
    }
    if (why || !want || !fold)
        ret = why ? PyUnicode_FromString(why) : Py_NewRef(Py_None);
    else
        ret = PyLong_FromUnsignedLong(crc32_combine_len(crc_k, crc_q, (uint64_t)q.T * (uint64_t)(q.H * q.D)));
done:
    if (have_r) PyBuffer_Release(&r);
    if (have_rk) PyBuffer_Release(&rk);
    if (q.held) PyBuffer_Release(&q.view);
    if (s.held) PyBuffer_Release(&s.view);
    if (k.held) PyBuffer_Release(&k.view);
    if (c.held) PyBuffer_Release(&c.view);
    return ret;
}

/* ---------------------------------------------------------------- misc */

/* empty_bytearray(n): a bytearray of n bytes, not zeroed (the caller writes them all). */
static PyObject *py_empty_bytearray(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t n;
    if (parse(args, "empty_bytearray", "n", &n)) return NULL;
    if (n < 0) {
        fail("empty_bytearray", "negative size");
        return NULL;
    }
    return PyByteArray_FromStringAndSize(NULL, n);
}

/* bytes_to_fill(n) -> (bytes, writable memoryview of its n bytes), uninitialised. For a blob built
 * once and handed out as immutable `bytes` without a final copy. The view does not own the bytes:
 * the caller keeps the bytes object alive while it writes, and drops the view before the bytes
 * object is shared or hashed. */
static PyObject *py_bytes_to_fill(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t n;
    if (parse(args, "bytes_to_fill", "n", &n)) return NULL;
    if (n < 0) {
        fail("bytes_to_fill", "negative size");
        return NULL;
    }
    PyObject *b = PyBytes_FromStringAndSize(NULL, n);
    if (!b) return NULL;
    PyObject *mv = PyMemoryView_FromMemory(PyBytes_AS_STRING(b), n, PyBUF_WRITE);
    if (!mv) {
        Py_DECREF(b);
        return NULL;
    }
    return Py_BuildValue("(NN)", b, mv);
}

/* crc32(data[, value]) -> int: zlib.crc32 of a buffer with the loops the encode and decode fold in
 * (carry-less multiply where the CPU has it, else byte by byte); for tests. */
static PyObject *py_crc32(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    PyObject *vo = NULL;
    int want;
    uint32_t value = 0;
    if (parse(args, "crc32", "y*|O", &b, &vo)) return NULL;
    if (vo && take_crc("crc32", vo, &want, &value)) return PyBuffer_Release(&b), NULL;
    uint32_t got;
    Py_BEGIN_ALLOW_THREADS
    got = kv_crc32(value, b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(got);
}

/* crc_fast(level) -> previous: which folded CRC runs (2: 512-bit VPCLMULQDQ, 1: 128-bit PCLMULQDQ, each
 * where the CPU has it, else the best below; the best is the default; 0: byte by byte, and encode_v /
 * dequantize leave the CRC to the caller; -1 only reads). */
static PyObject *py_crc_fast(PyObject *self, PyObject *args) {
    (void)self;
    int level;
    if (parse(args, "crc_fast", "i", &level)) return NULL;
    int prev = kv_crc_fast;
    int best = cpu_has_clmul();
    if (level >= 0) kv_crc_fast = level < best ? level : best;
    return PyLong_FromLong(prev);
}

/* paged(on) -> previous: 1 (the default) encodes per_page_head 16-bit V page by page, 0 in two passes
 * over V; -1 only reads. For tests and benchmarks of both ways. */
static PyObject *py_paged(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (parse(args, "paged", "i", &on)) return NULL;
    int prev = kv_paged;
    if (on >= 0) kv_paged = on != 0;
    return PyLong_FromLong(prev);
}

/* simd(level) -> previous level. 0: portable C rows; 1: AVX2 + F16C rows; 2: the quantize rows
 * compiled for AVX-512VL; each where the CPU has it (else the best below; the best is the default);
 * -1 only reads. For tests of every path. */
static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    int level;
    if (parse(args, "simd", "i", &level)) return NULL;
    int prev = kv_simd, best = cpu_simd_level();
    if (level >= 0) kv_simd = level < best ? level : best;
    return PyLong_FromLong(prev);
}

/* set_error(cls): raise every later error as `cls` (an Exception subclass). */
static PyObject *py_set_error(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cls;
    if (parse(args, "set_error", "O", &cls)) return NULL;
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception)) {
        fail("set_error", "expected an Exception subclass");
        return NULL;
    }
    Py_INCREF(cls);
    Py_SETREF(kv_error, cls);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode_v", py_encode_v, METH_VARARGS,
     "encode_v(v, v_dtype, scope, page, scale_dtype, q, scales[, copy_src, copy_dst[, crc]]) -> None, CRC or "
     "reason: V's scales and e4m3 codes."},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(v, v_dtype, scales, scope, page, q) -> None or reason: e4m3 codes of V / scale."},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(q, scales, scope, page, out, out_dtype[, copy_src, copy_dst[, crc]]) -> None, CRC or reason: "
     "float(q) * scale."},
    {"scatter_rows", py_scatter_rows, METH_VARARGS,
     "scatter_rows(src, cache, col, runs) -> None or reason: [T, H, D] rows into a [N, H, S, C] cache view."},
    {"scatter_dequant", py_scatter_dequant, METH_VARARGS,
     "scatter_dequant(q, scales, scope, page, cache, col, out_dtype, runs[, k, k_col]) -> None or reason: "
     "dequantized rows (and K's rows) into a cache view."},
    {"empty_bytearray", py_empty_bytearray, METH_VARARGS, "empty_bytearray(n): an uninitialised bytearray."},
    {"bytes_to_fill", py_bytes_to_fill, METH_VARARGS, "bytes_to_fill(n): (bytes, its writable view), uninitialised."},
    {"crc32", py_crc32, METH_VARARGS, "crc32(data[, value]) -> int: zlib's CRC-32, with the loops the codec folds in."},
    {"crc_fast", py_crc_fast, METH_VARARGS,
     "crc_fast(level) -> previous: 2 folded on 512-bit registers, 1 on 128-bit lanes, 0 off, -1 read only."},
    {"paged", py_paged, METH_VARARGS,
     "paged(on) -> previous: 1 encodes per_page_head 16-bit V a page at a time (scales, then codes), 0 in two "
     "passes over V; -1 read only."},
    {"simd", py_simd, METH_VARARGS, "simd(level) -> previous: 0 portable, 1 AVX2 + F16C, 2 with AVX-512VL, -1 read only."},
    {"set_error", py_set_error, METH_VARARGS, "set_error(cls): the exception class of every error."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvcodec._cpu",
                                    "The codec's FP8 row loops in C (see kvcodec.backends.cpu).", -1, methods};

PyMODINIT_FUNC PyInit__cpu(void) {
    kv_simd = cpu_simd_level();
    crc_init();
    kv_crc_fast = cpu_has_clmul();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (!kv_error) kv_error = PyErr_NewException("kvcodec._cpu.KernelError", NULL, NULL);
    if (!kv_error || PyModule_AddObjectRef(m, "KernelError", kv_error) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "FP16", DT_F16) < 0 || PyModule_AddIntConstant(m, "BF16", DT_BF16) < 0 ||
        PyModule_AddIntConstant(m, "FP32", DT_F32) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
