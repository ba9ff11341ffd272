/* The AVX-512 rows that carry the codes' CRC on a 512-bit register (VPCLMULQDQ): the quantize's and the
 * dense decode's. One target region. */
#include "kv.h"

#if KV_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,vpclmulqdq,pclmul,sse4.1"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,vpclmulqdq,pclmul,sse4.1")
#endif

#include "avx512_deq.h"
#include "avx512_quant.h"
#define KV_CRC_FOLD_512 1
#include "crc_fold.h"

/* The codes' CRC carried by the quantize (encode_v, V finite, rows of whole 64-byte lines, codes
 * dense in blob order): each 64-byte store of quant64 also folded by x^512 into one running register,
 * so the codes are not read again. Rows whose scale has no usable reciprocal are quantized by the
 * division and their bytes folded from memory. */
static inline void crc1_fold(KvFold *a, __m512i d) {
    if (!a->started) {
        _mm512_store_si512((void *)a->x, _mm512_xor_si512(d, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)a->state))));
        a->started = 1;
        return;
    }
    __m512i x = _mm512_load_si512((const void *)a->x);
    _mm512_store_si512((void *)a->x, crc_fold512(x, _mm512_broadcast_i32x4(_mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL)), d));
}

static uint32_t crc1_state(const KvFold *a) {
    return a->started ? crc_reduce(crc_lanes(_mm512_load_si512((const void *)a->x))) : a->state;
}

#define QUANT_ROW_CRC(name, T, LOAD, fallback)                                                     \
    static void name(const void *row, kv_ssize D, float scale, uint8_t *q, KvFold *crc) {     \
        const T *p = (const T *)row;                                                               \
        if (!reciprocal_ok(scale)) {                                                               \
            (void)fallback(row, D, scale, q);                                                      \
            for (kv_ssize d = 0; d < D; d += 64) crc1_fold(crc, _mm512_loadu_si512((const void *)(q + d))); \
            return;                                                                                \
        }                                                                                          \
        const __m512 vr = _mm512_set1_ps(1.0f / scale), vs = _mm512_set1_ps(scale);                \
        __m512i unused = _mm512_setzero_si512();                                                   \
        for (kv_ssize d = 0; d < D; d += 64) {                                                   \
            const __m512 x[4] = {LOAD(p + d), LOAD(p + d + 16), LOAD(p + d + 32), LOAD(p + d + 48)}; \
            crc1_fold(crc, quant64(x, vr, vs, q + d, &unused, 0));                                 \
        }                                                                                          \
    }

QUANT_ROW_CRC(quant_crc_f16, uint16_t, LOADZ_F16, kv_quant_row_f16_evex)
QUANT_ROW_CRC(quant_crc_bf16, uint16_t, LOADZ_BF16, kv_quant_row_bf16_evex)
QUANT_ROW_CRC(quant_crc_f32, float, LOADZ_F32, kv_quant_row_f32_evex)

/* The dense decode's rows with the codes' CRC carried by the row loop (the decode's counterpart of
 * QUANT_ROW_CRC; codes dense in blob order, rows of whole 64-byte lines): each row's codes are loaded
 * once, checked for NaN codes (1: the row is left unwritten), folded into the running register and
 * looked up in the head's table; rows without a table fold their codes, then take the level's row. */
static int deq_row_fold(DeqTables *t, kv_ssize h, const uint8_t *q, kv_ssize D, float s, void *out,
                        KvFold *crc) {
    const __m512i m7f = _mm512_set1_epi8(0x7F);
    __mmask64 nan = 0;
    for (kv_ssize d = 0; d < D; d += 64)
        nan |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512((const void *)(q + d)), m7f), m7f);
    if (nan) return 1;
    const uint16_t *tab = table_for(t, h, s);
    if (!tab) {
        for (kv_ssize d = 0; d < D; d += 64) crc1_fold(crc, _mm512_loadu_si512((const void *)(q + d)));
        kv_deq_row_tables(t, h, q, D, s, out);
        return 0;
    }
    const Table4 t4 = table4(tab);
    uint16_t *o = (uint16_t *)out;
    for (kv_ssize d = 0; d < D; d += 64) {
        __m512i c = _mm512_loadu_si512((const void *)(q + d));
        crc1_fold(crc, c);
        _mm512_storeu_si512((void *)(o + d), table32(&t4, _mm512_castsi512_si256(c)));
        _mm512_storeu_si512((void *)(o + d + 32), table32(&t4, _mm512_extracti64x4_epi64(c, 1)));
    }
    return 0;
}

void kv_fold_avx512(KvFoldOps *ops) {
    *ops = (KvFoldOps){.quant = {quant_crc_f16, quant_crc_bf16, quant_crc_f32}, .deq = deq_row_fold, .state = crc1_state};
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
