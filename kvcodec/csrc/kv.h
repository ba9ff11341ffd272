/*
 * kvcodec._cpu: the codec's FP8 row loops for CPU tensors, in C. The shared types and the function table.
 *
 * Same numerics as kvcodec/backends/reference.py (the torch reference), bit for bit:
 *   scale = amax(|V|) / 448           fp32, IEEE division; 1.0 for an all-zero group
 *   q     = RNE(clamp(V / scale, +-448)) as float8_e4m3fn
 *   V_hat = float(q) * scale          one fp32 rounding, then RNE to fp16/bf16
 * Why C: torch's fp32 -> e4m3 cast and its FP8 widening are scalar loops on CPU; here each is a few
 * integer operations, eight lanes at a time with AVX2 + F16C, sixteen or thirty-two with AVX-512 (the
 * quantize multiplying by 1 / scale and dividing only next to a rounding boundary), portable C
 * otherwise. The CRC-32 of the blob is folded into the same passes (PCLMULQDQ, or VPCLMULQDQ on 512-bit
 * registers).
 *
 * The library (docs/kernels.md has the map):
 *   kv.h, kv_bits.h, kv_rows.h    shared types and this table; bit helpers; the scalar rows (a template
 *                                 every tier instantiates for its tails)
 *   scalar.c, avx2.c,             the row tiers: one file per ISA, each compiled for its ISA alone by a
 *   avx512_quant.c, avx512_deq.c  target pragma at its top (no other target attribute, no clones)
 *   avx512_fold.c                 AVX-512 rows that carry the CRC (VPCLMULQDQ)
 *   crc.c, crc_clmul.c,           CRC-32: the byte loop and the driver; the folds on 128-bit lanes and
 *   crc_vclmul.c, crc_fold.h      on 512-bit registers
 *   encode.c, decode.c, scatter.c the drivers: pure C over KvRows, one copy each, the CRC a parameter
 *   dispatch.c                    the tiers' tables, filled once at import by CPU feature
 *   fold_emul.c                   portable stand-ins for the AVX-512 folds and tables (tests)
 *   buffers.c/.h, py_codec.c,     the Python side: buffer checks, the entry points, the module
 *   py_scatter.c, module.c
 * Only module.c, buffers.c and py_*.c include Python.h.
 */
#ifndef KV_H
#define KV_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The x86 tiers are compiled on x86-64 with GCC or clang, unless KV_PORTABLE_ONLY: that build has no
 * ISA-specific code at all (make test-portable checks its object for ymm/zmm and .arch_). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(KV_PORTABLE_ONLY)
#define KV_X86 1
#else
#define KV_X86 0
#endif

typedef ptrdiff_t kv_ssize; /* Py_ssize_t's type (module.c checks) */

enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2 };
enum { SC_TENSOR = 0, SC_LAYER_HEAD = 1, SC_PAGE_HEAD = 2 };

/* A [T, H, D] array of `item`-byte elements with byte strides (head_dim contiguous). */
typedef struct {
    char *base;
    kv_ssize T, H, D;
    kv_ssize st, sh; /* strides in bytes */
    kv_ssize item;
} KvRows;

/* A vLLM layer cache view [N blocks, H heads, S slots, C = K and V widths]. */
typedef struct {
    char *base;
    kv_ssize N, H, S, C;
    kv_ssize sn, sh, ss; /* strides in bytes */
    kv_ssize item;
} KvCache;

/* Per-head tables of a scale's 128 results (built and read by the AVX-512 rows). */
#define TABLE_HEADS 16

typedef struct {
    uint16_t tab[TABLE_HEADS][128] __attribute__((aligned(64)));
    uint32_t bits[TABLE_HEADS]; /* the scale each table was built for (a NaN pattern: none yet) */
    int odt;
} DeqTables;

/* A CRC carried by rows on a 512-bit register (avx512_fold.c): the register kept here between rows. */
typedef struct {
    uint8_t x[64] __attribute__((aligned(64)));
    int started;
    uint32_t state; /* the running state before the first 64 bytes */
} KvFold;

/* One scatter_dequant call's fixed parts: the codes, K's rows (NULL: V only), the cache, the scales. */
typedef struct {
    const KvRows *q, *k;
    const KvCache *c;
    const float *sc;
    int scope;
    kv_ssize page;
    char *v0, *k0; /* the cache's first V and K columns */
    size_t k_row;  /* bytes of one K row */
} ScatterJob;

typedef float (*amax_fn)(const void *row, kv_ssize D);
typedef int (*quant_fn)(const void *row, kv_ssize D, float scale, uint8_t *q); /* 1: met a NaN */
typedef void (*deq_fn)(const uint8_t *q, kv_ssize D, float s, void *out);
typedef int (*nan_fn)(const uint8_t *q, kv_ssize D);
typedef uint16_t (*amax16_fn)(const char *base, kv_ssize st, kv_ssize rows, kv_ssize D);
typedef void (*deq_tables_fn)(DeqTables *t, kv_ssize h, const uint8_t *q, kv_ssize D, float s, void *out);
typedef void (*scatter_head_fn)(const ScatterJob *j, deq_fn deq, const int64_t *run, kv_ssize h);
typedef void (*quant_fold_fn)(const void *row, kv_ssize D, float scale, uint8_t *q, KvFold *crc);
typedef int (*deq_fold_fn)(DeqTables *t, kv_ssize h, const uint8_t *q, kv_ssize D, float s, void *out,
                           KvFold *crc);
typedef uint32_t (*crc_fold_fn)(uint32_t state, const uint8_t *p, size_t n);
typedef uint32_t (*crc_copy_fn)(uint32_t state, uint8_t *dst, const uint8_t *p, size_t n);

/* One row tier's loops, indexed by dtype code where they differ by it. */
typedef struct {
    int level;                          /* 0 scalar, 1 AVX2 + F16C + FMA, 2 AVX-512 (F, VL, BW, DQ) */
    amax_fn amax[3];
    quant_fn quant[3];
    quant_fn quant_finite[3];           /* for V already checked finite (encode_v's scales pass) */
    deq_fn deq[3];
    nan_fn has_nan;
    amax16_fn amax16;                   /* a group's 16-bit absmax bits in one pass; NULL: row by row */
    deq_tables_fn deq_tables;           /* a row by its head's table (16-bit output); NULL: none */
    scatter_head_fn scatter_head[3];
} KvRowOps;

/* One CRC tier: the folds a run of bytes takes (NULL: byte by byte). */
typedef struct {
    int level;                     /* 0 byte by byte, 1 PCLMULQDQ on 128-bit lanes, 2 VPCLMULQDQ on 512 bits */
    crc_fold_fn narrow, wide;      /* n >= 128 (narrow) or 256 (wide), a multiple of 16 */
    crc_copy_fn narrow_copy, wide_copy;
} KvCrcOps;

/* Rows that carry the codes' CRC on a 512-bit register (the AVX-512 row tier with VPCLMULQDQ). */
typedef struct {
    quant_fold_fn quant[3];
    deq_fold_fn deq;
    uint32_t (*state)(const KvFold *crc);
} KvFoldOps;

/* A level: what one call runs. Filled from the tiers once (dispatch.c), never changed after. */
typedef struct {
    const KvRowOps *rows;
    const KvCrcOps *crc;
    const KvFoldOps *fold; /* NULL unless rows and CRC are both at level 2 */
    int paged;             /* per_page_head 16-bit V page by page (1) or in two passes (0) */
} KvLevel;

/* A CRC continued through a driver (NULL: none wanted): `state` is the running (inverted) state. The
 * driver carries it in its rows where the level's KvFoldOps take them (codes dense, whole 64-byte
 * rows), else slice by slice from memory while each slice is still in cache. */
typedef struct {
    const KvCrcOps *ops;
    uint32_t state;
} KvCrc;

/* An optional byte copy riding with an encode or decode (K's bytes). n == 0: none. */
typedef struct {
    void *dst;
    const void *src;
    size_t n;
} KvCopy;

/* ---- the tiers (dispatch.c fills a table from each; an absent tier leaves it untouched) */
void kv_rows_scalar(KvRowOps *ops);
void kv_rows_avx2(KvRowOps *ops);
void kv_rows_avx512(KvRowOps *ops);
void kv_fold_avx512(KvFoldOps *ops);
void kv_crc_clmul(KvCrcOps *ops);
void kv_crc_vclmul(KvCrcOps *ops);
void kv_emulate_fold(KvRowOps *rows, KvFoldOps *fold); /* fold_emul.c: for tests */

/* ---- dispatch.c */
void kv_dispatch_init(void);                     /* once, at import */
int kv_best_simd(void);                          /* the CPU's best row level in this build */
int kv_best_crc(void);                           /* the CPU's best CRC level in this build */
KvLevel kv_level(int simd, int crc, int paged);  /* levels above the best give the best */
KvLevel kv_level_emulated(int simd, int crc, int paged); /* with fold_emul.c's folds and tables */
int kv_forced_level(void);                       /* KVCODEC_CPU_LEVEL, -1 when unset */

/* ---- crc.c */
void kv_crc_init(void);
uint32_t kv_crc_update(const KvCrcOps *ops, uint32_t state, const uint8_t *p, size_t n);
uint32_t kv_crc_copy(const KvCrcOps *ops, uint32_t state, uint8_t *dst, const uint8_t *src, size_t n);
uint32_t kv_crc_bytes(uint32_t state, const uint8_t *p, size_t n);
uint32_t kv_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
uint32_t kv_crc32(const KvCrcOps *ops, uint32_t crc, const void *p, size_t n);
void kv_crc_run(KvCrc *crc, const void *p, size_t n);

/* ---- the AVX-512 tiers' helpers across their files */
uint16_t kv_amax_rows_u16_avx2(const char *base, kv_ssize st, kv_ssize rows, kv_ssize D);
int kv_has_nan_code_avx2(const uint8_t *q, kv_ssize D);
void kv_deq_row_f16_avx2(const uint8_t *q, kv_ssize D, float s, void *out);
void kv_deq_row_bf16_avx2(const uint8_t *q, kv_ssize D, float s, void *out);
void kv_deq_row_f32_avx2(const uint8_t *q, kv_ssize D, float s, void *out);
int kv_quant_row_f16_evex(const void *row, kv_ssize D, float scale, uint8_t *q);
int kv_quant_row_bf16_evex(const void *row, kv_ssize D, float scale, uint8_t *q);
int kv_quant_row_f32_evex(const void *row, kv_ssize D, float scale, uint8_t *q);
void kv_deq_row_tables(DeqTables *t, kv_ssize h, const uint8_t *q, kv_ssize D, float s, void *out);
void kv_rows_avx512_deq(KvRowOps *ops);

/* ---- the drivers (encode.c, decode.c, scatter.c): a reason string when the reference must take the
 * call, NULL when served. They run without the GIL and touch only the memory their arguments give. */
const char *kv_encode_v(const KvLevel *lv, const KvRows *v, const KvRows *q, int vdt, int scope, kv_ssize page,
                        int sdt, float *scales, kv_ssize ng, const KvCopy *copy, KvCrc *crc);
const char *kv_quantize(const KvLevel *lv, const KvRows *v, const KvRows *q, int vdt, int scope, kv_ssize page,
                        const float *scales, kv_ssize ng);
const char *kv_dequantize(const KvLevel *lv, const KvRows *q, const KvRows *o, int odt, int scope, kv_ssize page,
                          const float *scales, kv_ssize ng, const KvCopy *copy, KvCrc *crc);
const char *kv_scatter_dequant(const KvLevel *lv, const ScatterJob *job, int odt, const int64_t *runs, kv_ssize nq,
                               kv_ssize ng, KvCrc *crc);
void kv_copy_runs(const KvRows *src, const KvCache *c, kv_ssize col, const int64_t *q, kv_ssize nq);
void kv_copy_bytes(const KvCopy *copy, KvCrc *crc);

#endif
