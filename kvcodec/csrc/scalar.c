/* The scalar tier: the rows of kv_rows.h compiled for the baseline ISA (no target pragma), and the
 * scatter's generic inner loop. Every build has it; KV_PORTABLE_ONLY builds only it. */
#include "kv_rows.h"
#include "scatter_head.h"

#define CALL_DEQ(row, D, s, out) deq(row, D, s, out)
SCATTER_HEAD(scatter_head_any, CALL_DEQ, memcpy)

void kv_rows_scalar(KvRowOps *ops) {
    *ops = (KvRowOps){
        .level = 0,
        .amax = {amax_row_f16, amax_row_bf16, amax_row_f32},
        .quant = {quant_row_f16, quant_row_bf16, quant_row_f32},
        .quant_finite = {quant_row_f16, quant_row_bf16, quant_row_f32},
        .deq = {deq_row_f16, deq_row_bf16, deq_row_f32},
        .has_nan = has_nan_code,
        .amax16 = NULL,
        .deq_tables = NULL,
        .scatter_head = {scatter_head_any, scatter_head_any, scatter_head_any},
    };
}
