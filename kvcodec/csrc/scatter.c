/* The scatter drivers: a chunk's rows written straight into a vLLM layer cache view [N blocks, H heads,
 * S slots, C = K and V widths], run by run (runs: view block, first slot, first source token, tokens, as
 * int64 quadruples, checked by the glue before any row is written). K rows are copied (copy_runs) and
 * V's codes dequantized (scatter_dequant), one call per layer. */
#include "kv_layout.h"

void kv_copy_runs(const KvRows *src, const KvCache *c, kv_ssize col, const int64_t *q, kv_ssize nq) {
    size_t row = (size_t)(src->D * src->item);
    char *dst0 = c->base + col * c->item;
    for (kv_ssize i = 0; i < nq; i += 4)
        for (kv_ssize h = 0; h < src->H; h++)
            for (int64_t j = 0; j < q[i + 3]; j++)
                memcpy(dst0 + q[i] * c->sn + h * c->sh + (q[i + 1] + j) * c->ss,
                       src->base + (q[i + 2] + j) * src->st + h * src->sh, row);
}

/* Whether any of the rows holds a NaN code; with `crc` (q dense) its state continued over q's bytes,
 * slice by slice. */
static int rows_have_nan(const KvRows *q, nan_fn has_nan, KvCrc *crc) {
    if (crc) {
        kv_ssize step = crc_slice_tokens(q);
        size_t row = (size_t)(q->H * q->D);
        for (kv_ssize t0 = 0; t0 < q->T; t0 += step) {
            kv_ssize t1 = q->T - t0 < step ? q->T : t0 + step;
            const uint8_t *slice = (const uint8_t *)q->base + (size_t)t0 * row;
            kv_crc_run(crc, slice, (size_t)(t1 - t0) * row);
            if (has_nan(slice, (kv_ssize)((size_t)(t1 - t0) * row))) return 1;
        }
        return 0;
    }
    if (dense_codes(q)) return has_nan((const uint8_t *)q->base, q->T * q->H * q->D); /* one call, no row loop */
    for (kv_ssize t = 0; t < q->T; t++)
        for (kv_ssize h = 0; h < q->H; h++)
            if (has_nan((const uint8_t *)q->base + t * q->st + h * q->sh, q->D)) return 1;
    return 0;
}

/* Whether the runs take the tokens in increasing order without overlap (K's CRC can then follow them). */
static int runs_in_order(const int64_t *rq, kv_ssize nq) {
    int64_t end = 0;
    for (kv_ssize i = 0; i < nq; i += 4) {
        if (rq[i + 2] < end) return 0;
        end = rq[i + 2] + rq[i + 3];
    }
    return 1;
}

/* scatter_dequant: float(q) * scale of the runs' rows into the job's V columns, K's rows (job->k) into
 * its K columns in the same pass. NaN codes anywhere in q or non-finite scales: nothing written. With
 * `crc` (K and q dense) its state continued over all of K, then all of q, whatever the runs cover: q's
 * in the NaN check that precedes the writes, K's after each run's rows are copied (runs in token
 * order; else in a pass of its own), the two joined by kv_crc32_combine. */
const char *kv_scatter_dequant(const KvLevel *lv, const ScatterJob *job, int odt, const int64_t *rq, kv_ssize nq,
                               kv_ssize ng, KvCrc *crc) {
    const KvRows *q = job->q, *k = job->k;
    const KvRowOps *ops = lv->rows;
    KvCrc codes = {.ops = crc ? crc->ops : NULL, .state = ~0u};
    size_t k_tok = k ? (size_t)(k->H * k->D) : 0;
    int ordered = crc && runs_in_order(rq, nq);
    if (crc && !ordered) kv_crc_run(crc, k->base, (size_t)k->T * k_tok);
    if (!scales_ok(job->sc, ng, 0)) return "scales must be finite";
    if (rows_have_nan(q, ops->has_nan, crc ? &codes : NULL)) return "q holds NaN codes";
    scatter_head_fn head = ops->scatter_head[odt];
    deq_fn deq = ops->deq[odt];
    int64_t k_next = 0;
    for (kv_ssize i = 0; i < nq; i += 4) {
        for (kv_ssize h = 0; h < q->H; h++) head(job, deq, rq + i, h);
        if (ordered) { /* K's bytes up to this run's end, the run's own still in cache */
            kv_crc_run(crc, k->base + (size_t)k_next * k_tok, (size_t)(rq[i + 2] + rq[i + 3] - k_next) * k_tok);
            k_next = rq[i + 2] + rq[i + 3];
        }
    }
    if (ordered) kv_crc_run(crc, k->base + (size_t)k_next * k_tok, (size_t)(k->T - k_next) * k_tok);
    if (crc) crc->state = ~kv_crc32_combine(~crc->state, ~codes.state, (uint64_t)q->T * (uint64_t)(q->H * q->D));
    return NULL;
}
