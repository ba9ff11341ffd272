/* Portable stand-ins for the AVX-512 rows that carry the CRC (KvFoldOps) and for the per-head tables
 * (KvRowOps.deq_tables), with the same contracts: the drivers' folded and table paths then run, and are
 * tested, on any CPU (Level(..., emulate=1)). Their CRC goes byte by byte: slow, never chosen by the
 * dispatch. */
#include "kv_rows.h"

#define QUANT_FOLD(name, row_fn)                                                         \
    static void name(const void *row, kv_ssize D, float s, uint8_t *q, KvFold *acc) {   \
        (void)row_fn(row, D, s, q);                                                      \
        acc->state = kv_crc_bytes(acc->state, q, (size_t)D);                             \
    }

QUANT_FOLD(quant_fold_f16, quant_row_f16)
QUANT_FOLD(quant_fold_bf16, quant_row_bf16)
QUANT_FOLD(quant_fold_f32, quant_row_f32)

/* A row "by its head's table": computed (the results are the table's by construction). */
static void deq_by_table(DeqTables *t, kv_ssize h, const uint8_t *q, kv_ssize D, float s, void *out) {
    (void)h;
    if (t->odt == DT_F16)
        deq_row_f16(q, D, s, out);
    else
        deq_row_bf16(q, D, s, out);
}

/* As deq_row_fold: a row with a NaN code is left unwritten and its bytes are not folded (1). */
static int deq_fold(DeqTables *t, kv_ssize h, const uint8_t *q, kv_ssize D, float s, void *out, KvFold *acc) {
    if (has_nan_code(q, D)) return 1;
    acc->state = kv_crc_bytes(acc->state, q, (size_t)D);
    deq_by_table(t, h, q, D, s, out);
    return 0;
}

static uint32_t fold_state(const KvFold *acc) { return acc->state; }

void kv_emulate_fold(KvRowOps *rows, KvFoldOps *fold) {
    rows->deq_tables = deq_by_table;
    *fold = (KvFoldOps){.quant = {quant_fold_f16, quant_fold_bf16, quant_fold_f32}, .deq = deq_fold, .state = fold_state};
}
