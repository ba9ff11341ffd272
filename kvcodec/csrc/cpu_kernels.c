/*
 * kvcodec._cpu: the codec's hot loops for CPU tensors, in C.
 *
 * Same numerics as kvcodec/quant.py (the torch reference), bit for bit:
 *   scale = amax(|V|) / 448           fp32, IEEE division (done by the caller)
 *   q     = RNE(clamp(V / scale, +-448)) as float8_e4m3fn
 *   V_hat = float(q) * scale          one fp32 rounding, then RNE to fp16/bf16
 * Why C: torch's fp32 -> e4m3 cast and its FP8 widening are scalar loops on
 * CPU; here each is a few integer operations the compiler vectorises.
 *
 * Every function takes raw addresses and element strides from the Python
 * wrapper (kvcodec/native.py), which validates dtypes, shapes and bounds and
 * keeps the tensors alive. The GIL is released while the loops run, and large
 * inputs are split over two threads.
 *
 * Only finite, positive scales reach quantize, and it reports a NaN in V;
 * dequantize reports NaN codes before writing anything. Those rare inputs
 * take the reference instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_HAVE_AVX2 1
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KV_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KV_CLONES
#endif

enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2 };
enum { SC_TENSOR = 0, SC_LAYER_HEAD = 1, SC_PAGE_HEAD = 2 };

/* Whether the AVX2 + F16C loops run (set at import from the CPU's features). */
static int kv_simd = 0;
/* Whether CRC-32 folds with PCLMULQDQ. */
static int kv_clmul = 0;
/* Whether empty_bytearray pre-faults its pages (MADV_POPULATE_WRITE). */
static int kv_populate = 1;

/* The OpenMP runtime torch already loaded, when use_openmp() found it: a fused
 * encode then runs its two halves as a team of that runtime instead of on a
 * thread of its own. Why: after any parallel torch op, torch's OpenMP workers
 * spin for milliseconds waiting for more work; a second thread of ours must
 * share a core with such a spinner (measured 1.6 -> 2.7 ms per 2048-token
 * layer), whereas a team of the same runtime puts the spinner to work. The
 * entry points are libgomp's ABI (GOMP_parallel), which the LLVM and Intel
 * runtimes export too. */
typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_t)(void);
typedef struct {
    gomp_parallel_t parallel;
    omp_int_t thread_num;
    omp_int_t num_threads;
} OmpHooks;
/* Published whole with one atomic store (use_openmp, the fork handler); each
 * use loads it once, so a concurrent switch never shows half a set. */
static OmpHooks *kv_omp = NULL;

static OmpHooks *omp_hooks(void) { return __atomic_load_n(&kv_omp, __ATOMIC_ACQUIRE); }

/* Elements below which one thread does the work (thread start costs ~20 us). */
#define KV_PARALLEL_MIN (1 << 18)
/* The same for a fused chunk encode: measured no faster on two threads at 256K elements here. */
#define KV_PARALLEL_MIN_ENCODE (1 << 20)

typedef struct {
    const char *src;  /* V or q */
    char *dst;        /* q, out, or per-(token, head) amax */
    const float *scales;
    Py_ssize_t t0, t1, H, D;
    Py_ssize_t st, sh;  /* src strides in elements (D stride is 1) */
    Py_ssize_t dt, dh;  /* dst strides in elements (D stride is 1) */
    int dtype, out_dtype, scope;
    Py_ssize_t page;
    Py_ssize_t nan_codes; /* dequantize: NaN codes met */
} Job;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

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

/* fp16 -> fp32, exact, in integer operations the compiler vectorises
 * (gcc 12 does not vectorise _Float16 conversions). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t em = (uint32_t)(h & 0x7FFFu) << 13;
    uint32_t exp = em & 0x0F800000u;
    uint32_t normal = em + (112u << 23);                 /* rebias 15 -> 127 */
    uint32_t special = em + (224u << 23);                /* Inf / NaN keep all-ones exponent */
    float sub = bits_f32(em + (113u << 23)) - bits_f32(113u << 23); /* subnormal: exact */
    uint32_t o = exp == 0x0F800000u ? special : (exp == 0 ? f32_bits(sub) : normal);
    return bits_f32(o | ((uint32_t)(h & 0x8000u) << 16));
}

/* fp32 -> fp16, round to nearest even, overflow to Inf, NaN to 0x7E00 (as torch). */
static inline uint16_t f32_to_f16(float x) {
    uint32_t f = f32_bits(x);
    uint32_t sign = (f >> 16) & 0x8000u;
    f &= 0x7FFFFFFFu;
    uint32_t big = f > 0x7F800000u ? 0x7E00u : 0x7C00u;                 /* >= 65536, Inf, NaN */
    uint32_t sub = f32_bits(bits_f32(f) + bits_f32(126u << 23)) - (126u << 23); /* < 2^-14 */
    uint32_t norm = (f + 0xC8000FFFu + ((f >> 13) & 1u)) >> 13;          /* rebias, RNE */
    uint32_t o = f >= 0x47800000u ? big : (f < (113u << 23) ? sub : norm);
    return (uint16_t)(o | sign);
}

/* ------------------------------------------------------------------ amax */

/* Any NaN as torch's reductions give it (0x7FC00000), whatever its payload or sign. */
static inline float canonical_nan(float x) {
    return (f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u ? bits_f32(0x7FC00000u) : x;
}

KV_CLONES static void amax_rows_f16(const uint16_t *p, Py_ssize_t D, float *out) {
    uint16_t m = 0;
    for (Py_ssize_t d = 0; d < D; d++) {
        uint16_t a = p[d] & 0x7FFF; /* |x| of a non-NaN orders like its bits */
        m = a > m ? a : m;
    }
    *out = canonical_nan(f16_to_f32(m));
}

KV_CLONES static void amax_rows_bf16(const uint16_t *p, Py_ssize_t D, float *out) {
    uint16_t m = 0;
    for (Py_ssize_t d = 0; d < D; d++) {
        uint16_t a = p[d] & 0x7FFF;
        m = a > m ? a : m;
    }
    *out = canonical_nan(bf16_to_f32(m));
}

KV_CLONES static void amax_rows_f32(const uint32_t *p, Py_ssize_t D, float *out) {
    uint32_t m = 0;
    for (Py_ssize_t d = 0; d < D; d++) {
        uint32_t a = p[d] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    *out = canonical_nan(bits_f32(m));
}

/* amax(|x|) over head_dim per (token, head) into a dense fp32 [T, H] array.
 * On raw bits: for non-negative IEEE values the bit pattern orders like the
 * value, and any NaN (bits above the infinity's) comes out as a NaN, which the
 * caller's finiteness check then refuses, as the reference does. */
static void *amax_job(void *arg) {
    Job *j = (Job *)arg;
    float *out = (float *)j->dst;
    for (Py_ssize_t t = j->t0; t < j->t1; t++) {
        for (Py_ssize_t h = 0; h < j->H; h++) {
            Py_ssize_t off = t * j->st + h * j->sh;
            float *o = out + t * j->H + h;
            if (j->dtype == DT_F32)
                amax_rows_f32((const uint32_t *)j->src + off, j->D, o);
            else if (j->dtype == DT_F16)
                amax_rows_f16((const uint16_t *)j->src + off, j->D, o);
            else
                amax_rows_bf16((const uint16_t *)j->src + off, j->D, o);
        }
    }
    return NULL;
}

/* -------------------------------------------------------------- quantize */

/* e4m3fn code of a finite fp32 y, rounded to nearest even, saturated at 448. */
static inline uint8_t e4m3_code(float y) {
    uint32_t b = f32_bits(y);
    uint32_t sign = (b >> 24) & 0x80u;
    uint32_t a = b & 0x7FFFFFFFu;
    a = a > 0x43E00000u ? 0x43E00000u : a; /* clamp |y| to 448 */
    /* normal range: keep 3 mantissa bits, ties to even */
    uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
    uint32_t normal = (r >> 20) - (120u << 3);
    /* below 2^-6: multiples of 2^-9, rounded by the fp32 adder (|y|*512 < 8 is exact) */
    float s = bits_f32(a) * 512.0f + 8388608.0f;
    uint32_t sub = f32_bits(s) - 0x4B000000u;
    uint32_t code = a < 0x3C800000u ? sub : normal;
    return (uint8_t)(code | sign);
}

/* Each row returns whether it met a NaN (its code would be wrong: the caller
 * then takes the reference for the whole call). Inf saturates, as in torch. */
#define QUANT_ROW(name, T, widen)                                                  \
    KV_CLONES static int name(const T *p, Py_ssize_t D, float scale, uint8_t *q) { \
        uint32_t nan = 0;                                                          \
        for (Py_ssize_t d = 0; d < D; d++) {                                       \
            float y = widen(p[d]) / scale;                                         \
            nan |= (f32_bits(y) & 0x7FFFFFFFu) > 0x7F800000u;                      \
            q[d] = e4m3_code(y);                                                   \
        }                                                                          \
        return nan != 0;                                                           \
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

static inline uint16_t f32_to_bf16(float f) {
    uint32_t b = f32_bits(f); /* never NaN here: NaN codes are refused first */
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

KV_CLONES static Py_ssize_t nan_count(const uint8_t *q, Py_ssize_t D) {
    Py_ssize_t n = 0;
    for (Py_ssize_t d = 0; d < D; d++) n += (q[d] & 0x7F) == 0x7F;
    return n;
}

KV_CLONES static void deq_row_f16(const uint8_t *q, Py_ssize_t D, float s, uint16_t *o) {
    for (Py_ssize_t d = 0; d < D; d++) o[d] = f32_to_f16(e4m3_value(q[d]) * s);
}

KV_CLONES static void deq_row_bf16(const uint8_t *q, Py_ssize_t D, float s, uint16_t *o) {
    for (Py_ssize_t d = 0; d < D; d++) o[d] = f32_to_bf16(e4m3_value(q[d]) * s);
}

KV_CLONES static void deq_row_f32(const uint8_t *q, Py_ssize_t D, float s, float *o) {
    for (Py_ssize_t d = 0; d < D; d++) o[d] = e4m3_value(q[d]) * s;
}

/* ------------------------------------------------------------------- CRC-32 */
/* zlib's CRC-32 (reflected polynomial 0xEDB88320), so blobs can be sealed and
 * checked without the GIL and split over threads. Long buffers fold 64 bytes
 * at a time with carry-less multiplies (PCLMULQDQ); what remains (the folded
 * 16-byte state and a tail under 16 bytes) goes through a byte table. */

#define CRC_POLY 0xEDB88320u
static uint32_t crc_table[256];

static void crc_table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t r = i;
        for (int b = 0; b < 8; b++) r = (r & 1u) ? (r >> 1) ^ CRC_POLY : r >> 1;
        crc_table[i] = r;
    }
}

/* The raw register update (no pre/post inversion). */
static uint32_t crc_bytes(uint32_t reg, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) reg = crc_table[(reg ^ p[i]) & 0xFFu] ^ (reg >> 8);
    return reg;
}

/* Polynomials mod P in the reflected form: bit 31 is x^0, bit 0 is x^31. */
static uint32_t gf2_mulmod(uint32_t a, uint32_t b) {
    uint32_t r = 0;
    for (int i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i)) r ^= b;
        b = (b & 1u) ? (b >> 1) ^ CRC_POLY : b >> 1; /* b *= x */
    }
    return r;
}

/* x^(8 n) mod P: the factor that moves a CRC past n more bytes. */
static uint32_t gf2_shift_bytes(uint64_t n) {
    uint32_t r = 0x80000000u, base = 0x00800000u; /* 1 and x^8 */
    for (; n; n >>= 1) {
        if (n & 1u) r = gf2_mulmod(r, base);
        base = gf2_mulmod(base, base);
    }
    return r;
}

/* CRC of A then B, from crc(A), crc(B) and len(B) (both zlib-conditioned). */
static uint32_t crc_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    return gf2_mulmod(gf2_shift_bytes(len_b), crc_a) ^ crc_b;
}

#ifdef KV_HAVE_AVX2
/* Fold distances as x^k mod P, reflected and shifted for PCLMULQDQ: 4 x 128
 * bits ahead (lo, hi lanes) and 128 bits ahead (lo, hi lanes). */
#define K_FOLD512_LO 0x154442bd4ull
#define K_FOLD512_HI 0x1c6e41596ull
#define K_FOLD128_LO 0x1751997d0ull
#define K_FOLD128_HI 0x0ccaa009eull

__attribute__((target("pclmul,sse4.1"))) static inline __m128i fold(__m128i acc, __m128i k, __m128i next) {
    __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00);
    __m128i hi = _mm_clmulepi64_si128(acc, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* The raw register over n >= 64 bytes. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_clmul(uint32_t reg, const uint8_t *p, size_t n) {
    __m128i a0 = _mm_loadu_si128((const __m128i *)p);
    __m128i a1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i a3 = _mm_loadu_si128((const __m128i *)(p + 48));
    a0 = _mm_xor_si128(a0, _mm_cvtsi32_si128((int)reg)); /* the register joins the first bytes */
    p += 64;
    n -= 64;
    const __m128i k512 = _mm_set_epi64x((long long)K_FOLD512_HI, (long long)K_FOLD512_LO);
    for (; n >= 64; p += 64, n -= 64) {
        a0 = fold(a0, k512, _mm_loadu_si128((const __m128i *)p));
        a1 = fold(a1, k512, _mm_loadu_si128((const __m128i *)(p + 16)));
        a2 = fold(a2, k512, _mm_loadu_si128((const __m128i *)(p + 32)));
        a3 = fold(a3, k512, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    const __m128i k128 = _mm_set_epi64x((long long)K_FOLD128_HI, (long long)K_FOLD128_LO);
    __m128i a = fold(fold(fold(a0, k128, a1), k128, a2), k128, a3);
    for (; n >= 16; p += 16, n -= 16) a = fold(a, k128, _mm_loadu_si128((const __m128i *)p));
    /* The 16 state bytes stand for everything folded so far: finish them and
     * the tail bytewise from a zero register. */
    uint8_t state[16];
    _mm_storeu_si128((__m128i *)state, a);
    return crc_bytes(crc_bytes(0, state, 16), p, n);
}

/* The same over 256-bit lanes (VPCLMULQDQ): 128 bytes per step, folded down
 * to one 128-bit state for crc_clmul's tail. Constants as above, for 1024 and
 * 256 bits ahead (x^(d+32) and x^(d-32) mod P). */
#define K_FOLD1024_LO 0x1e88ef372ull
#define K_FOLD1024_HI 0x14a7fe880ull
#define K_FOLD256_LO 0x0f1da05aaull
#define K_FOLD256_HI 0x15a546366ull
#define VCLMUL_FN __attribute__((target("vpclmulqdq,avx2,pclmul,sse4.1")))

VCLMUL_FN static inline __m256i fold256(__m256i acc, __m256i k, __m256i next) {
    __m256i lo = _mm256_clmulepi64_epi128(acc, k, 0x00);
    __m256i hi = _mm256_clmulepi64_epi128(acc, k, 0x11);
    return _mm256_xor_si256(_mm256_xor_si256(lo, hi), next);
}

/* Loads 32 bytes for the CRC and, when copying, stores them to the destination too. */
#define LOAD_FOLD(off) _mm256_loadu_si256((const __m256i *)(p + (off)))
#define STORE_COPY(off, x) \
    if (copy) _mm256_storeu_si256((__m256i *)(dst + (off)), x)

/* `copy` is a constant at each call site, so each caller gets its own loop. */
VCLMUL_FN static inline uint32_t crc_vclmul_impl(uint32_t reg, const uint8_t *p, size_t n, uint8_t *dst,
                                                  const int copy) {
    __m256i a0 = LOAD_FOLD(0), a1 = LOAD_FOLD(32), a2 = LOAD_FOLD(64), a3 = LOAD_FOLD(96);
    STORE_COPY(0, a0);
    STORE_COPY(32, a1);
    STORE_COPY(64, a2);
    STORE_COPY(96, a3);
    a0 = _mm256_xor_si256(a0, _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)reg)));
    p += 128;
    dst += copy ? 128 : 0;
    n -= 128;
    const __m256i k1024 = _mm256_set_epi64x((long long)K_FOLD1024_HI, (long long)K_FOLD1024_LO,
                                            (long long)K_FOLD1024_HI, (long long)K_FOLD1024_LO);
    for (; n >= 128; p += 128, n -= 128) {
        __m256i b0 = LOAD_FOLD(0), b1 = LOAD_FOLD(32), b2 = LOAD_FOLD(64), b3 = LOAD_FOLD(96);
        if (copy) {
            STORE_COPY(0, b0);
            STORE_COPY(32, b1);
            STORE_COPY(64, b2);
            STORE_COPY(96, b3);
            dst += 128;
        }
        a0 = fold256(a0, k1024, b0);
        a1 = fold256(a1, k1024, b1);
        a2 = fold256(a2, k1024, b2);
        a3 = fold256(a3, k1024, b3);
    }
    const __m256i k256 = _mm256_set_epi64x((long long)K_FOLD256_HI, (long long)K_FOLD256_LO,
                                           (long long)K_FOLD256_HI, (long long)K_FOLD256_LO);
    __m256i a = fold256(fold256(fold256(a0, k256, a1), k256, a2), k256, a3);
    const __m128i k128 = _mm_set_epi64x((long long)K_FOLD128_HI, (long long)K_FOLD128_LO);
    __m128i x = fold(_mm256_castsi256_si128(a), k128, _mm256_extracti128_si256(a, 1));
    for (; n >= 16; p += 16, n -= 16) {
        __m128i y = _mm_loadu_si128((const __m128i *)p);
        if (copy) {
            _mm_storeu_si128((__m128i *)dst, y);
            dst += 16;
        }
        x = fold(x, k128, y);
    }
    if (copy) memcpy(dst, p, n);
    uint8_t state[16];
    _mm_storeu_si128((__m128i *)state, x);
    return crc_bytes(crc_bytes(0, state, 16), p, n);
}

VCLMUL_FN static uint32_t crc_vclmul(uint32_t reg, const uint8_t *p, size_t n) {
    return crc_vclmul_impl(reg, p, n, NULL, 0);
}

VCLMUL_FN static uint32_t crc_vclmul_copy(uint32_t reg, const uint8_t *p, size_t n, uint8_t *dst) {
    return crc_vclmul_impl(reg, p, n, dst, 1);
}
#endif

static uint32_t crc32_update(uint32_t crc, const uint8_t *p, size_t n);

/* memcpy(dst, p, n) and zlib.crc32(p, crc) in one read of p where the CPU allows. */
static uint32_t crc32_copy(uint32_t crc, const uint8_t *p, size_t n, uint8_t *dst) {
#ifdef KV_HAVE_AVX2
    if (kv_clmul > 1 && n >= 256) return ~crc_vclmul_copy(~crc, p, n, dst);
#endif
    memcpy(dst, p, n);
    return crc32_update(crc, p, n);
}

/* zlib.crc32(data, crc) without the GIL. */
static uint32_t crc32_update(uint32_t crc, const uint8_t *p, size_t n) {
    uint32_t reg = ~crc;
#ifdef KV_HAVE_AVX2
    if (kv_clmul > 1 && n >= 256) return ~crc_vclmul(reg, p, n);
    if (kv_clmul && n >= 64) return ~crc_clmul(reg, p, n);
#endif
    return ~crc_bytes(reg, p, n);
}

typedef struct {
    const uint8_t *p;
    size_t n;
    uint8_t *dst; /* NULL: CRC only */
    uint32_t crc;
} CrcJob;

static void *crc_job(void *arg) {
    CrcJob *j = (CrcJob *)arg;
    j->crc = j->dst ? crc32_copy(0, j->p, j->n, j->dst) : crc32_update(0, j->p, j->n);
    return NULL;
}

typedef struct {
    void *(*fn)(void *);
    void *arg[2];
    const OmpHooks *omp;
} Pair;

/* Members 0 and 1 of a team take one half each; a team of one takes both; the
 * others (the team is torch's default size, so its pool keeps its threads) idle. */
static void pair_body(void *p) {
    Pair *pr = (Pair *)p;
    int id = pr->omp->thread_num(), n = pr->omp->num_threads();
    if (id == 0) {
        pr->fn(pr->arg[0]);
        if (n < 2) pr->fn(pr->arg[1]);
    } else if (id == 1) {
        pr->fn(pr->arg[1]);
    }
}

/* fn(a) and fn(b) at once: as a team of torch's OpenMP runtime when use_openmp()
 * found it (see there), else with a thread of our own; in turn if neither can be had. */
static void run_pair(void *(*fn)(void *), void *a, void *b) {
    const OmpHooks *omp = omp_hooks();
    if (omp) {
        Pair pr = {fn, {a, b}, omp};
        omp->parallel(pair_body, &pr, 0, 0); /* 0: the runtime's default team size */
        return;
    }
    pthread_t tid;
    if (pthread_create(&tid, NULL, fn, b) != 0) {
        fn(a);
        fn(b);
        return;
    }
    fn(a);
    pthread_join(tid, NULL);
}

/* CRC (and copy, when dst is given) over two threads for long buffers: halves, then combined. */
static uint32_t crc32_parallel(uint32_t crc, const uint8_t *p, size_t n, uint8_t *dst, int threads) {
    if (threads < 2 || n < ((size_t)1 << 20)) return dst ? crc32_copy(crc, p, n, dst) : crc32_update(crc, p, n);
    size_t half = (n / 2) & ~(size_t)63;
    CrcJob first = {p, half, dst, 0}, second = {p + half, n - half, dst ? dst + half : NULL, 0};
    run_pair(crc_job, &first, &second);
    /* crc_job starts from 0: the caller's crc joins the first half by combination */
    return crc_combine(crc_combine(crc, first.crc, half), second.crc, n - half);
}

/* ------------------------------------------------------ AVX2 + F16C paths */
/* Same arithmetic as the portable loops above, eight lanes at a time, chosen at
 * run time (kv_simd) on CPUs that have AVX2 and F16C; tails use the portable loops. */
#ifdef KV_HAVE_AVX2

AVX2_FN static inline __m256i e4m3_codes8(__m256 y, __m256i *nan) {
    const __m256i b = _mm256_castps_si256(y);
    __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
    *nan = _mm256_or_si256(*nan, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
    a = _mm256_min_epu32(a, _mm256_set1_epi32(0x43E00000)); /* clamp |y| to 448 */
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFFF)), odd);
    __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
    /* below 2^-6: |y| + 2^14 rounds (RNE) at 2^-9, the subnormal step */
    const __m256i magic = _mm256_set1_epi32(141 << 23);
    __m256i sub = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic))), magic);
    __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a);
    __m256i code = _mm256_blendv_epi8(normal, sub, is_sub);
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

#define QUANT_ROW_AVX2(name, T, LOAD, tail)                                            \
    AVX2_FN static int name(const T *p, Py_ssize_t D, float scale, uint8_t *q) {      \
        const __m256 vs = _mm256_set1_ps(scale);                                       \
        __m256i nan = _mm256_setzero_si256();                                          \
        Py_ssize_t d = 0;                                                              \
        for (; d + 32 <= D; d += 32) {                                                 \
            __m256i c0 = e4m3_codes8(_mm256_div_ps(LOAD(p + d), vs), &nan);           \
            __m256i c1 = e4m3_codes8(_mm256_div_ps(LOAD(p + d + 8), vs), &nan);       \
            __m256i c2 = e4m3_codes8(_mm256_div_ps(LOAD(p + d + 16), vs), &nan);      \
            __m256i c3 = e4m3_codes8(_mm256_div_ps(LOAD(p + d + 24), vs), &nan);      \
            store_codes32(q + d, c0, c1, c2, c3);                                      \
        }                                                                              \
        int bad = !_mm256_testz_si256(nan, nan);                                       \
        if (d < D) bad |= tail(p + d, D - d, scale, q + d);                            \
        return bad;                                                                    \
    }

QUANT_ROW_AVX2(quant_row_f16_avx2, uint16_t, LOAD_F16, quant_row_f16)
QUANT_ROW_AVX2(quant_row_bf16_avx2, uint16_t, LOAD_BF16, quant_row_bf16)
QUANT_ROW_AVX2(quant_row_f32_avx2, float, LOAD_F32, quant_row_f32)

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

AVX2_FN static void deq_row_f16_avx2(const uint8_t *q, Py_ssize_t D, float s, uint16_t *o) {
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

AVX2_FN static void deq_row_bf16_avx2(const uint8_t *q, Py_ssize_t D, float s, uint16_t *o) {
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

AVX2_FN static void deq_row_f32_avx2(const uint8_t *q, Py_ssize_t D, float s, float *o) {
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
#endif

static inline Py_ssize_t scale_index(const Job *j, Py_ssize_t t, Py_ssize_t h) {
    if (j->scope == SC_TENSOR) return 0;
    if (j->scope == SC_LAYER_HEAD) return h;
    return (t / j->page) * j->H + h;
}

static void *quant_job(void *arg) {
    Job *j = (Job *)arg;
    uint8_t *q = (uint8_t *)j->dst;
    int nan = 0;
    for (Py_ssize_t t = j->t0; t < j->t1 && !nan; t++) {
        for (Py_ssize_t h = 0; h < j->H; h++) {
            Py_ssize_t off = t * j->st + h * j->sh;
            float s = j->scales[scale_index(j, t, h)];
            uint8_t *o = q + t * j->dt + h * j->dh;
#ifdef KV_HAVE_AVX2
            if (kv_simd) {
                if (j->dtype == DT_F16)
                    nan |= quant_row_f16_avx2((const uint16_t *)j->src + off, j->D, s, o);
                else if (j->dtype == DT_BF16)
                    nan |= quant_row_bf16_avx2((const uint16_t *)j->src + off, j->D, s, o);
                else
                    nan |= quant_row_f32_avx2((const float *)j->src + off, j->D, s, o);
                continue;
            }
#endif
            if (j->dtype == DT_F16)
                nan |= quant_row_f16((const uint16_t *)j->src + off, j->D, s, o);
            else if (j->dtype == DT_BF16)
                nan |= quant_row_bf16((const uint16_t *)j->src + off, j->D, s, o);
            else
                nan |= quant_row_f32((const float *)j->src + off, j->D, s, o);
        }
    }
    j->nan_codes = nan;
    return NULL;
}

static void *nan_job(void *arg) {
    Job *j = (Job *)arg;
    const uint8_t *q = (const uint8_t *)j->src;
    Py_ssize_t nans = 0;
    for (Py_ssize_t t = j->t0; t < j->t1 && !nans; t++)
        for (Py_ssize_t h = 0; h < j->H; h++) nans += nan_count(q + t * j->st + h * j->sh, j->D);
    j->nan_codes = nans;
    return NULL;
}

static void *deq_job(void *arg) {
    Job *j = (Job *)arg;
    const uint8_t *q = (const uint8_t *)j->src;
    for (Py_ssize_t t = j->t0; t < j->t1; t++) {
        for (Py_ssize_t h = 0; h < j->H; h++) {
            const uint8_t *r = q + t * j->st + h * j->sh;
            float s = j->scales[scale_index(j, t, h)];
            Py_ssize_t off = t * j->dt + h * j->dh;
#ifdef KV_HAVE_AVX2
            if (kv_simd) {
                if (j->out_dtype == DT_F16)
                    deq_row_f16_avx2(r, j->D, s, (uint16_t *)j->dst + off);
                else if (j->out_dtype == DT_BF16)
                    deq_row_bf16_avx2(r, j->D, s, (uint16_t *)j->dst + off);
                else
                    deq_row_f32_avx2(r, j->D, s, (float *)j->dst + off);
                continue;
            }
#endif
            if (j->out_dtype == DT_F16)
                deq_row_f16(r, j->D, s, (uint16_t *)j->dst + off);
            else if (j->out_dtype == DT_BF16)
                deq_row_bf16(r, j->D, s, (uint16_t *)j->dst + off);
            else
                deq_row_f32(r, j->D, s, (float *)j->dst + off);
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------- driver */

/* 0: bytewise CRC; 1: PCLMULQDQ; 2: VPCLMULQDQ as well. */
static int cpu_clmul(void) {
#ifdef KV_HAVE_AVX2
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"))) return 0;
    return (__builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx2")) ? 2 : 1;
#else
    return 0;
#endif
}

static int cpu_has_simd(void) {
#ifdef KV_HAVE_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* Run fn over tokens [0, T) in one or two pieces; the second on a new thread. */
static int run_split(void *(*fn)(void *), Job *base, Py_ssize_t T, int threads, Py_ssize_t *nan_codes) {
    Job jobs[2];
    jobs[0] = *base;
    jobs[0].t0 = 0;
    jobs[0].t1 = T;
    jobs[0].nan_codes = 0;
    int n = (threads > 1 && T >= 2 && T * base->H * base->D >= KV_PARALLEL_MIN) ? 2 : 1;
    if (n == 2) {
        jobs[1] = jobs[0];
        jobs[0].t1 = jobs[1].t0 = T / 2;
        run_pair(fn, &jobs[0], &jobs[1]); /* the same two-thread mechanism as the CRC's */
    } else {
        fn(&jobs[0]);
    }
    if (nan_codes) *nan_codes = jobs[0].nan_codes + (n == 2 ? jobs[1].nan_codes : 0);
    return n;
}

/* Scales a scope needs over T tokens x H heads. */
static Py_ssize_t scales_needed(Py_ssize_t T, Py_ssize_t H, int scope, Py_ssize_t page) {
    if (scope == SC_TENSOR) return 1;
    if (scope == SC_LAYER_HEAD) return H;
    return ((T + page - 1) / page) * H;
}

static int check_scales(Py_ssize_t T, Py_ssize_t H, int scope, Py_ssize_t page, Py_ssize_t n) {
    if (n < scales_needed(T, H, scope, page)) {
        PyErr_SetString(PyExc_ValueError, "fewer scales than the scope needs");
        return -1;
    }
    return 0;
}

static int check_common(Py_ssize_t T, Py_ssize_t H, Py_ssize_t D, int dtype, int scope, Py_ssize_t page) {
    if (T < 0 || H < 0 || D < 0) {
        PyErr_SetString(PyExc_ValueError, "negative extent");
        return -1;
    }
    if (dtype < DT_F16 || dtype > DT_F32) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code");
        return -1;
    }
    if (scope < SC_TENSOR || scope > SC_PAGE_HEAD || (scope == SC_PAGE_HEAD && page < 1)) {
        PyErr_SetString(PyExc_ValueError, "bad scope or page size");
        return -1;
    }
    return 0;
}

/* token_head_amax(v, T, H, D, st, sh, dtype, out, threads) */
static PyObject *py_token_head_amax(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t v, T, H, D, st, sh, out;
    int dtype, threads;
    if (!PyArg_ParseTuple(args, "nnnnnnini", &v, &T, &H, &D, &st, &sh, &dtype, &out, &threads)) return NULL;
    if (check_common(T, H, D, dtype, SC_TENSOR, 1)) return NULL;
    Job j = {.src = (const char *)v, .dst = (char *)out, .H = H, .D = D, .st = st, .sh = sh, .dtype = dtype};
    Py_BEGIN_ALLOW_THREADS run_split(amax_job, &j, T, threads, NULL);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* quantize(v, T, H, D, st, sh, dtype, scales, n_scales, scope, page, q, qt, qh, threads) -> met a NaN */
static PyObject *py_quantize(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t v, T, H, D, st, sh, scales, n_scales, page, q, qt, qh, nans = 0;
    int dtype, scope, threads;
    if (!PyArg_ParseTuple(args, "nnnnnninninnnni", &v, &T, &H, &D, &st, &sh, &dtype, &scales, &n_scales, &scope,
                          &page, &q, &qt, &qh, &threads))
        return NULL;
    if (check_common(T, H, D, dtype, scope, page) || check_scales(T, H, scope, page, n_scales)) return NULL;
    Job j = {.src = (const char *)v, .dst = (char *)q, .scales = (const float *)scales, .H = H, .D = D,
             .st = st, .sh = sh, .dt = qt, .dh = qh, .dtype = dtype, .scope = scope, .page = page};
    Py_BEGIN_ALLOW_THREADS run_split(quant_job, &j, T, threads, &nans);
    Py_END_ALLOW_THREADS return PyBool_FromLong(nans != 0);
}

/* dequantize(q, T, H, D, qt, qh, scales, n_scales, scope, page, out, ot, oh, out_dtype, threads) -> NaN codes met */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t q, T, H, D, qt, qh, scales, n_scales, page, out, ot, oh, nans = 0;
    int scope, out_dtype, threads;
    if (!PyArg_ParseTuple(args, "nnnnnnnninnnnii", &q, &T, &H, &D, &qt, &qh, &scales, &n_scales, &scope, &page,
                          &out, &ot, &oh, &out_dtype, &threads))
        return NULL;
    if (check_common(T, H, D, out_dtype, scope, page) || check_scales(T, H, scope, page, n_scales)) return NULL;
    Job j = {.src = (const char *)q, .dst = (char *)out, .scales = (const float *)scales, .H = H, .D = D,
             .st = qt, .sh = qh, .dt = ot, .dh = oh, .out_dtype = out_dtype, .scope = scope, .page = page};
    /* NaN codes first, so nothing is written when the reference must take over. */
    Py_BEGIN_ALLOW_THREADS run_split(nan_job, &j, T, threads, &nans);
    if (!nans) run_split(deq_job, &j, T, threads, NULL);
    Py_END_ALLOW_THREADS return PyLong_FromSsize_t(nans);
}

/* ------------------------------------------------------- fused chunk encode */

/* One row's amax(|x|) as fp32 (see amax_job). */
static float row_amax(int dtype, const char *base, Py_ssize_t off, Py_ssize_t D) {
    float m;
    if (dtype == DT_F32)
        amax_rows_f32((const uint32_t *)base + off, D, &m);
    else if (dtype == DT_F16)
        amax_rows_f16((const uint16_t *)base + off, D, &m);
    else
        amax_rows_bf16((const uint16_t *)base + off, D, &m);
    return m;
}

/* One row's codes with the fastest loop this CPU has; returns whether it met a NaN. */
static int quant_row(int dtype, const char *base, Py_ssize_t off, Py_ssize_t D, float s, uint8_t *o) {
#ifdef KV_HAVE_AVX2
    if (kv_simd) {
        if (dtype == DT_F16) return quant_row_f16_avx2((const uint16_t *)base + off, D, s, o);
        if (dtype == DT_BF16) return quant_row_bf16_avx2((const uint16_t *)base + off, D, s, o);
        return quant_row_f32_avx2((const float *)base + off, D, s, o);
    }
#endif
    if (dtype == DT_F16) return quant_row_f16((const uint16_t *)base + off, D, s, o);
    if (dtype == DT_BF16) return quant_row_bf16((const uint16_t *)base + off, D, s, o);
    return quant_row_f32((const float *)base + off, D, s, o);
}

static inline int finite_f32(float x) { return (f32_bits(x) & 0x7FFFFFFFu) < 0x7F800000u; }

/* The scale of a group from its absmax: amax / 448 (IEEE division), 1.0 for zero. */
static inline float scale_of(float amax) { return amax > 0.0f ? amax / 448.0f : 1.0f; }

/* One chunk's payload in one call: K copied and CRC'd on the calling thread,
 * V's scales and codes (each block CRC'd while still in cache) taken block by
 * block from a shared counter by both threads, then the block CRCs combined in
 * order and the scales appended. Blocks are pages (per_page_head) or 16-token
 * runs (the wider scopes, whose scales the worker computes first). */
typedef struct {
    const char *v;
    Py_ssize_t vst, vsh;
    int vdt;
    Py_ssize_t T, H, D;
    int scope;
    Py_ssize_t page;
    uint8_t *q;     /* dense [T, H, D] */
    float *scales;  /* dense fp32, one per group */
    const char *k;
    Py_ssize_t kst, ksh, kes;
    char *kdst;     /* dense [T, H, D] */
    Py_ssize_t bt, nblocks;
    uint32_t *block_crc;
    Py_ssize_t next;   /* atomic: the next block to take */
    int ready;         /* atomic: 0 scales pending, 1 ready, -1 failed (wider scopes) */
    int stop;          /* atomic: set on failure */
    Py_ssize_t bad;    /* -1 fine; else a reason for the caller to take the reference */
} Enc;

static void enc_fail(Enc *e, Py_ssize_t why) {
    __atomic_store_n(&e->bad, why, __ATOMIC_RELAXED);
    __atomic_store_n(&e->stop, 1, __ATOMIC_RELEASE);
}

/* Block b: (per_page_head) its groups' absmax and scales, then codes; its CRC. */
static void enc_block(Enc *e, Py_ssize_t b) {
    const Py_ssize_t H = e->H, D = e->D;
    Py_ssize_t t0 = b * e->bt, t1 = t0 + e->bt < e->T ? t0 + e->bt : e->T;
    int nan = 0;
    for (Py_ssize_t h = 0; h < H; h++) {
        float s;
        if (e->scope == SC_PAGE_HEAD) {
            float m = 0.0f;
            for (Py_ssize_t t = t0; t < t1; t++) {
                float r = row_amax(e->vdt, e->v, t * e->vst + h * e->vsh, D);
                m = (f32_bits(r) > f32_bits(m)) ? r : m; /* on bits: a NaN wins, as in torch */
            }
            if (!finite_f32(m)) {
                enc_fail(e, b * H + h);
                return;
            }
            s = scale_of(m);
            if (s == 0.0f) { /* fp32 V with a subnormal absmax */
                enc_fail(e, -3);
                return;
            }
            e->scales[b * H + h] = s;
        } else {
            s = e->scales[e->scope == SC_TENSOR ? 0 : h];
        }
        for (Py_ssize_t t = t0; t < t1; t++)
            nan |= quant_row(e->vdt, e->v, t * e->vst + h * e->vsh, D, s, e->q + (t * H + h) * D);
    }
    if (nan) { /* cannot happen with a finite absmax; a guard */
        enc_fail(e, -4);
        return;
    }
    e->block_crc[b] = crc32_update(0, e->q + t0 * H * D, (size_t)((t1 - t0) * H * D));
}

static void enc_take_blocks(Enc *e) {
    for (;;) {
        if (__atomic_load_n(&e->stop, __ATOMIC_ACQUIRE)) return;
        Py_ssize_t b = __atomic_fetch_add(&e->next, 1, __ATOMIC_RELAXED);
        if (b >= e->nblocks) return;
        enc_block(e, b);
    }
}

/* The wider scopes' scales: absmax over all tokens per group (per_tensor: one). */
static void enc_wide_scales(Enc *e) {
    Py_ssize_t groups = e->scope == SC_TENSOR ? 1 : e->H;
    for (Py_ssize_t g = 0; g < groups; g++) e->scales[g] = 0.0f;
    for (Py_ssize_t t = 0; t < e->T; t++)
        for (Py_ssize_t h = 0; h < e->H; h++) {
            float r = row_amax(e->vdt, e->v, t * e->vst + h * e->vsh, e->D);
            float *g = e->scales + (e->scope == SC_TENSOR ? 0 : h);
            *g = (f32_bits(r) > f32_bits(*g)) ? r : *g;
        }
    for (Py_ssize_t g = 0; g < groups; g++) {
        if (!finite_f32(e->scales[g])) {
            enc_fail(e, g);
            __atomic_store_n(&e->ready, -1, __ATOMIC_RELEASE);
            return;
        }
        e->scales[g] = scale_of(e->scales[g]);
        if (e->scales[g] == 0.0f) {
            enc_fail(e, -3);
            __atomic_store_n(&e->ready, -1, __ATOMIC_RELEASE);
            return;
        }
    }
    __atomic_store_n(&e->ready, 1, __ATOMIC_RELEASE);
}

static void *enc_worker(void *arg) {
    Enc *e = (Enc *)arg;
    if (e->scope != SC_PAGE_HEAD) enc_wide_scales(e);
    enc_take_blocks(e);
    return NULL;
}

/* K's rows into their dense place, CRC'd every ~64 KiB while in cache. */
static uint32_t enc_copy_k(Enc *e, uint32_t crc) {
    const Py_ssize_t H = e->H, D = e->D, row = D * e->kes;
    Py_ssize_t per = (65536 / (H * row > 0 ? H * row : 1));
    per = per > 0 ? per : 1;
    for (Py_ssize_t t0 = 0; t0 < e->T; t0 += per) {
        Py_ssize_t t1 = t0 + per < e->T ? t0 + per : e->T;
        for (Py_ssize_t t = t0; t < t1; t++)
            for (Py_ssize_t h = 0; h < H; h++)
                memcpy(e->kdst + (t * H + h) * row, e->k + (t * e->kst + h * e->ksh) * e->kes, (size_t)row);
        crc = crc32_update(crc, (const uint8_t *)e->kdst + t0 * H * row, (size_t)((t1 - t0) * H * row));
    }
    return crc;
}

/* The calling thread's share once K is done: wait for the wider scopes' scales,
 * then take V blocks beside the worker. */
static void enc_caller_blocks(Enc *e) {
    if (e->scope != SC_PAGE_HEAD)
        while (__atomic_load_n(&e->ready, __ATOMIC_ACQUIRE) == 0) sched_yield();
    enc_take_blocks(e);
}

typedef struct {
    Enc *e;
    uint32_t crc; /* in: the CRC so far; out: continued over K */
    int size;     /* threads that worked (1 or 2) */
    const OmpHooks *omp;
} EncTeam;

/* One OpenMP team member: thread 0 plays the caller, thread 1 the worker; a team
 * of one (torch set to one thread, say) does both, in order; others idle. */
static void enc_team_body(void *arg) {
    EncTeam *t = (EncTeam *)arg;
    int id = t->omp->thread_num(), n = t->omp->num_threads();
    if (id == 0) {
        t->size = n < 2 ? 1 : 2;
        t->crc = enc_copy_k(t->e, t->crc);
        if (n < 2)
            enc_worker(t->e);
        else
            enc_caller_blocks(t->e);
    } else if (id == 1) {
        enc_worker(t->e);
    }
}

/* encode_chunk(v, vst, vsh, vdtype, T, H, D, scope, page, q, scales32,
 *              k, kst, ksh, k_itemsize, kdst, sdst, crc, threads) -> (status, crc, threads used)
 * Fills K (dense) at kdst, V's codes at q, the fp32 scales at scales32 and, as
 * bytes, at sdst; `crc` is the CRC so far (of the v2 header prefix, or 0) and the
 * result continues it over K, V and the scales. status -1: done; anything else:
 * the reference must redo V (a NaN/Inf group index, or -2..-4). */
static PyObject *py_encode_chunk(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t v, vst, vsh, T, H, D, page, q, scales, k, kst, ksh, kes, kdst, sdst;
    int vdt, scope, threads;
    unsigned int crc_in;
    if (!PyArg_ParseTuple(args, "nnninnninnnnnnnnnIi", &v, &vst, &vsh, &vdt, &T, &H, &D, &scope, &page, &q,
                          &scales, &k, &kst, &ksh, &kes, &kdst, &sdst, &crc_in, &threads))
        return NULL;
    if (check_common(T, H, D, vdt, scope, page)) return NULL;
    if (kes != 2 && kes != 4) {
        PyErr_SetString(PyExc_ValueError, "K itemsize must be 2 or 4");
        return NULL;
    }
    Enc e = {.v = (const char *)v, .vst = vst, .vsh = vsh, .vdt = vdt, .T = T, .H = H, .D = D, .scope = scope,
             .page = page, .q = (uint8_t *)q, .scales = (float *)scales, .k = (const char *)k, .kst = kst,
             .ksh = ksh, .kes = kes, .kdst = (char *)kdst, .bad = -1};
    e.bt = scope == SC_PAGE_HEAD ? page : 16;
    e.nblocks = (T + e.bt - 1) / e.bt;
    e.block_crc = (uint32_t *)malloc((size_t)(e.nblocks > 0 ? e.nblocks : 1) * sizeof(uint32_t));
    if (!e.block_crc) return PyErr_NoMemory();
    uint32_t crc = crc_in;
    Py_ssize_t groups = scope == SC_TENSOR ? 1 : scope == SC_LAYER_HEAD ? H : e.nblocks * H;
    int two = 0;
    Py_BEGIN_ALLOW_THREADS
    int want_two = threads > 1 && T * H * D >= KV_PARALLEL_MIN_ENCODE;
    const OmpHooks *omp = omp_hooks();
    if (want_two && omp) {
        EncTeam team = {.e = &e, .crc = crc, .omp = omp};
        omp->parallel(enc_team_body, &team, 0, 0); /* 0: the runtime's default team size */
        crc = team.crc;
        two = team.size;
    } else {
        pthread_t tid;
        two = want_two && pthread_create(&tid, NULL, enc_worker, &e) == 0 ? 2 : 1;
        crc = enc_copy_k(&e, crc);
        if (two == 1) {
            enc_worker(&e);
        } else {
            enc_caller_blocks(&e);
            pthread_join(tid, NULL);
        }
    }
    if (e.bad == -1) {
        /* the blocks' CRCs in order: crc(A B) = crc(A) * x^(8 len B) + crc(B) mod P */
        Py_ssize_t full = e.bt * H * D, last = (T - (e.nblocks - 1) * e.bt) * H * D;
        uint32_t shift_full = gf2_shift_bytes((uint64_t)full);
        for (Py_ssize_t b = 0; b < e.nblocks; b++) {
            uint32_t sh = b == e.nblocks - 1 && last != full ? gf2_shift_bytes((uint64_t)last) : shift_full;
            crc = gf2_mulmod(sh, crc) ^ e.block_crc[b];
        }
        memcpy((void *)sdst, e.scales, (size_t)groups * sizeof(float));
        crc = crc32_update(crc, (const uint8_t *)sdst, (size_t)groups * sizeof(float));
    }
    Py_END_ALLOW_THREADS
    free(e.block_crc);
    return Py_BuildValue("(nIi)", e.bad, crc, two);
}

#if defined(__linux__)
/* Whether every page of [p, p + len) is resident (memory malloc recycled): then
 * populating would only cost time (~0.15 us a page even when nothing is missing). */
static int all_resident(void *p, size_t len) {
    long pg = sysconf(_SC_PAGESIZE);
    size_t pages = (len + (size_t)pg - 1) / (size_t)pg;
    unsigned char *vec = (unsigned char *)malloc(pages);
    if (!vec) return 0;
    int all = mincore(p, len, vec) == 0;
    for (size_t i = 0; all && i < pages; i++) all = vec[i] & 1;
    free(vec);
    return all;
}
#endif

/* empty_bytearray(n): a bytearray whose bytes are not zeroed (the caller writes
 * them all), its pages faulted in up front when they are not resident yet. */
static PyObject *py_empty_bytearray(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "negative size");
        return NULL;
    }
    PyObject *b = PyByteArray_FromStringAndSize(NULL, n);
    if (!b) return NULL;
#if defined(__linux__)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    /* Fault the pages in with one call (Linux >= 5.14) rather than one trap per 4 KiB
     * page as the payload is written: several times cheaper on a VM. Advice only. */
    if (n >= (Py_ssize_t)(1 << 20) && kv_populate) {
        const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t lo = ((uintptr_t)PyByteArray_AS_STRING(b) + pg - 1) & ~(pg - 1);
        uintptr_t hi = ((uintptr_t)PyByteArray_AS_STRING(b) + (uintptr_t)n) & ~(pg - 1);
        /* the new object is not shared yet: no need to hold the GIL */
        Py_BEGIN_ALLOW_THREADS
        if (hi > lo && !all_resident((void *)lo, hi - lo))
            (void)madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
        Py_END_ALLOW_THREADS
    }
#endif
    return b;
}

/* crc32(buffer, crc=0, threads=1) -> zlib.crc32(buffer, crc), without the GIL. */
static PyObject *py_crc32(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    unsigned int crc = 0;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "y*|Ii", &view, &crc, &threads)) return NULL;
    uint32_t out;
    Py_BEGIN_ALLOW_THREADS out = crc32_parallel(crc, (const uint8_t *)view.buf, (size_t)view.len, NULL, threads);
    Py_END_ALLOW_THREADS PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(out);
}

/* copy_crc(dst, src, crc=0, threads=1) -> zlib.crc32(src, crc), with src copied
 * into dst (same length) in the same pass, without the GIL. */
static PyObject *py_copy_crc(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer dst, src;
    unsigned int crc = 0;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "w*y*|Ii", &dst, &src, &crc, &threads)) return NULL;
    if (dst.len != src.len) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "copy_crc: dst and src differ in length");
        return NULL;
    }
    uint32_t out;
    const char *a = (const char *)src.buf, *b = (const char *)dst.buf;
    int overlap = src.len > 0 && a < b + dst.len && b < a + src.len;
    Py_BEGIN_ALLOW_THREADS
    if (overlap) { /* CRC what src holds before the copy changes it */
        out = crc32_parallel(crc, (const uint8_t *)src.buf, (size_t)src.len, NULL, threads);
        memmove(dst.buf, src.buf, (size_t)src.len);
    } else {
        out = crc32_parallel(crc, (const uint8_t *)src.buf, (size_t)src.len, (uint8_t *)dst.buf, threads);
    }
    Py_END_ALLOW_THREADS PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLong(out);
}

/* crc32_combine(crc_a, crc_b, len_b) -> CRC of A followed by B. */
static PyObject *py_crc32_combine(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int a, b;
    unsigned long long n;
    if (!PyArg_ParseTuple(args, "IIK", &a, &b, &n)) return NULL;
    return PyLong_FromUnsignedLong(crc_combine(a, b, n));
}

/* A forked child has the runtime's state but not its threads: GNU libgomp then
 * waits forever for them. Children use threads of their own instead. */
static void kv_after_fork_child(void) { __atomic_store_n(&kv_omp, NULL, __ATOMIC_RELEASE); }

/* use_openmp(path) -> bool: take GOMP_parallel from the OpenMP runtime at `path`
 * if (and only if) it is already loaded in this process; "" turns it off. */
static PyObject *py_use_openmp(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (!path[0]) {
        __atomic_store_n(&kv_omp, NULL, __ATOMIC_RELEASE);
        Py_RETURN_FALSE;
    }
    void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD); /* never loads a second runtime */
    OmpHooks found = {NULL, NULL, NULL};
    if (h) {
        found.parallel = (gomp_parallel_t)dlsym(h, "GOMP_parallel");
        found.thread_num = (omp_int_t)dlsym(h, "omp_get_thread_num");
        found.num_threads = (omp_int_t)dlsym(h, "omp_get_num_threads");
    } /* the handle stays open: the runtime is loaded anyway */
    static int atfork_done = 0;
    if (!found.parallel || !found.thread_num || !found.num_threads ||
        (!atfork_done && pthread_atfork(NULL, NULL, kv_after_fork_child) != 0)) {
        __atomic_store_n(&kv_omp, NULL, __ATOMIC_RELEASE);
        Py_RETURN_FALSE;
    }
    atfork_done = 1;
    /* One allocation per successful call, never freed: a thread may still hold the old one. */
    OmpHooks *pub = (OmpHooks *)malloc(sizeof(OmpHooks));
    if (!pub) return PyErr_NoMemory();
    *pub = found;
    __atomic_store_n(&kv_omp, pub, __ATOMIC_RELEASE);
    Py_RETURN_TRUE;
}

/* simd(level) -> (previous AVX2 flag, previous CRC level). Level 0: portable
 * loops and bytewise CRC; 1: AVX2 loops and 128-bit PCLMULQDQ; 2: all this CPU
 * has (the default); -1 only reads. For tests of every path. */
static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    int level;
    if (!PyArg_ParseTuple(args, "i", &level)) return NULL;
    PyObject *prev = Py_BuildValue("(ii)", kv_simd, kv_clmul);
    if (level >= 0) {
        kv_simd = level > 0 && cpu_has_simd();
        int c = cpu_clmul();
        kv_clmul = level < c ? level : c;
    }
    return prev;
}

static PyMethodDef methods[] = {
    {"encode_chunk", py_encode_chunk, METH_VARARGS, "K, V's codes, scales and the CRC of one chunk (two threads)."},
    {"empty_bytearray", py_empty_bytearray, METH_VARARGS, "An uninitialised bytearray (huge pages advised)."},
    {"use_openmp", py_use_openmp, METH_VARARGS, "use_openmp(path): run fused encodes on that (loaded) OpenMP runtime."},
    {"crc32", py_crc32, METH_VARARGS, "crc32(buffer, crc=0, threads=1): zlib's CRC-32, GIL released."},
    {"copy_crc", py_copy_crc, METH_VARARGS, "copy_crc(dst, src, crc=0, threads=1): copy and CRC in one pass."},
    {"crc32_combine", py_crc32_combine, METH_VARARGS, "crc32_combine(a, b, len_b): CRC of A then B."},
    {"simd", py_simd, METH_VARARGS, "simd(level) -> previous (avx2, crc): 0 portable, 1 AVX2 + PCLMUL, 2 all, -1 read."},
    {"token_head_amax", py_token_head_amax, METH_VARARGS, "amax(|V|) per (token, head) into fp32 [T, H]."},
    {"quantize", py_quantize, METH_VARARGS, "V / scale to e4m3fn codes (finite V, positive scales)."},
    {"dequantize", py_dequantize, METH_VARARGS, "e4m3fn codes times scale to fp16/bf16/fp32; returns NaN codes met."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvcodec._cpu",
                                    "The codec's CPU loops in C (see kvcodec.native).", -1, methods};

PyMODINIT_FUNC PyInit__cpu(void) {
    kv_simd = cpu_has_simd();
    crc_table_init();
#ifdef KV_HAVE_AVX2
    kv_clmul = cpu_clmul();
#endif
    return PyModule_Create(&module);
}
