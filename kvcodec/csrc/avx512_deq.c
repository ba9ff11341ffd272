/* The AVX-512 tier's dequantize side: 512-bit rows, rows by per-head tables (the dense decode), and the
 * scatter's 16-bit inner loops with those rows inlined. One target region. */
#include "kv.h"

#if KV_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")
#endif

#include "avx512_deq.h"
#include "scatter_head.h"

#define DEQ_ROW_ZMM(name, T, STORE16, fallback)                                               \
    static void name(const uint8_t *q, kv_ssize D, float s, void *out) {             \
        int ok;                                                                               \
        const __m512 vs = _mm512_set1_ps(scale_div128(s, &ok));                               \
        if (!ok) {                                                                            \
            fallback(q, D, s, out);                                                           \
            return;                                                                           \
        }                                                                                     \
        T *o = (T *)out;                                                                      \
        kv_ssize d = 0;                                                                     \
        for (; d + 16 <= D; d += 16)                                                          \
            STORE16(o + d, _mm512_mul_ps(e4m3_x128(_mm_loadu_si128((const __m128i *)(q + d))), vs)); \
        if (d < D) fallback(q + d, D - d, s, o + d);                                          \
    }

DEQ_ROW_ZMM(deq_row_f16_zmm, uint16_t, store16_f16, kv_deq_row_f16_avx2)
DEQ_ROW_ZMM(deq_row_bf16_zmm, uint16_t, store16_bf16, kv_deq_row_bf16_avx2)
DEQ_ROW_ZMM(deq_row_f32_zmm, float, store16_f32, kv_deq_row_f32_avx2)

static void deq_row_table(const uint8_t *q, kv_ssize D, const uint16_t *tab, uint16_t *o) {
    const Table4 t = table4(tab);
    kv_ssize d = 0;
    for (; d + 32 <= D; d += 32)
        _mm512_storeu_si512((void *)(o + d), table32(&t, _mm256_loadu_si256((const __m256i *)(q + d))));
    for (; d < D; d++) o[d] = (uint16_t)(tab[q[d] & 0x7F] ^ ((q[d] & 0x80u) << 8));
}

/* One row by head h's table where it has one, else by the level's row. */
void kv_deq_row_tables(DeqTables *t, kv_ssize h, const uint8_t *q, kv_ssize D, float s,
                                         void *out) {
    const uint16_t *tab = table_for(t, h, s);
    if (tab)
        deq_row_table(q, D, tab, (uint16_t *)out);
    else if (t->odt == DT_F16)
        deq_row_f16_zmm(q, D, s, out);
    else
        deq_row_bf16_zmm(q, D, s, out);
}

/* A K row of whole 64-byte lines (head_dim 32, 64, 128, 256 of a 16-bit dtype) by 512-bit moves, inline;
 * other sizes by memcpy. */
static inline void copy_k_row(char *dst, const char *src, size_t n) {
    if (n % 64 || n > 512) {
        memcpy(dst, src, n);
        return;
    }
    for (size_t i = 0; i < n; i += 64) _mm512_storeu_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
}

/* The rows computed, not looked up: a run covers a page or two of each head, and rebuilding tables per
 * run measured 8-10% slower here than computing (the decode into dense rows gains from them). */
SCATTER_HEAD(scatter_head_f16_zmm, deq_row_f16_zmm, copy_k_row)
SCATTER_HEAD(scatter_head_bf16_zmm, deq_row_bf16_zmm, copy_k_row)

/* The AVX-512 tier's dequantize rows over the AVX2 tier's table (kv_rows_avx512 calls it). */
void kv_rows_avx512_deq(KvRowOps *ops) {
    ops->deq[DT_F16] = deq_row_f16_zmm, ops->deq[DT_BF16] = deq_row_bf16_zmm, ops->deq[DT_F32] = deq_row_f32_zmm;
    ops->deq_tables = kv_deq_row_tables;
    ops->scatter_head[DT_F16] = scatter_head_f16_zmm, ops->scatter_head[DT_BF16] = scatter_head_bf16_zmm;
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
