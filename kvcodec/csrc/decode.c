/* The dense decode's driver (dequantize): float(q) * scale of every row, one copy of the pass, the CRC
 * a parameter (carried by the rows where the level folds them, else slice by slice from memory). */
#include "kv_layout.h"

/* The rows the pass reaches `lead` tokens from now (about 16 KiB of codes ahead): the codes prefetched
 * for reading, the output rows for writing, so that their lines are owned before the stores arrive
 * (measured 5-10% off a dense 2048-token decode coming from memory). */
static inline kv_ssize deq_lead(const KvRows *q) {
    kv_ssize st = q->st > 0 ? q->st : 1;
    return (16384 + st - 1) / st;
}

static inline void prefetch_deq_row(const KvRows *q, const KvRows *o, kv_ssize t, kv_ssize h) {
    const char *codes = q->base + t * q->st + h * q->sh;
    const char *out = o->base + t * o->st + h * o->sh;
    for (kv_ssize off = 0; off < q->D; off += 64) __builtin_prefetch(codes + off, 0, 3);
    for (kv_ssize off = 0, n = q->D * o->item; off < n; off += 64) __builtin_prefetch(out + off, 1, 3);
}

/* Tables for a call's rows where the level has them (16-bit output), else NULL. */
static DeqTables *tables_if(DeqTables *t, int odt, const KvRowOps *ops) {
    if (!ops->deq_tables || (odt != DT_F16 && odt != DT_BF16)) return NULL;
    t->odt = odt;
    for (int i = 0; i < TABLE_HEADS; i++) t->bits[i] = 0x7FC00001u;
    return t;
}

/* One pass of rows: codes, outputs, scales and the row functions. */
typedef struct {
    const KvRows *q, *o;
    int scope;
    kv_ssize page;
    const float *sc;
    deq_fn deq;
    nan_fn has_nan;
    deq_tables_fn tables_row;
    DeqTables *tabs;      /* NULL: deq computes every row */
    deq_fold_fn fold_row; /* with `fold`: NaN check, CRC and table lookups in one load of the codes */
    KvFold *fold;
} Rows;

/* Rows t0 .. t1's float(q) * scale; stops before a row holding a NaN code (returns 1). The pass's
 * fields are read once into locals: the row calls could otherwise make the compiler reload them. */
static int dequantize_span(const Rows *p, kv_ssize t0, kv_ssize t1) {
    const KvRows *q = p->q, *o = p->o;
    const int scope = p->scope;
    const kv_ssize page = p->page, lead = deq_lead(q), D = q->D, H = q->H, T = q->T;
    const deq_fn deq = p->deq;
    const nan_fn has_nan = p->has_nan;
    const deq_tables_fn tables_row = p->tables_row;
    const deq_fold_fn fold_row = p->fold_row;
    DeqTables *const tabs = p->tabs;
    KvFold *const fold = p->fold;
    for (kv_ssize t = t0; t < t1; t++) {
        const float *st = token_scales(p->sc, scope, page, H, t);
        for (kv_ssize h = 0; h < H; h++) {
            const uint8_t *row = (const uint8_t *)q->base + t * q->st + h * q->sh;
            if (t + lead < T) prefetch_deq_row(q, o, t + lead, h);
            if (fold) {
                if (fold_row(tabs, h, row, D, st[scope == SC_TENSOR ? 0 : h], o->base + t * o->st + h * o->sh, fold))
                    return 1;
                continue;
            }
            if (has_nan(row, D)) return 1;
            float s = st[scope == SC_TENSOR ? 0 : h];
            if (tabs)
                tables_row(tabs, h, row, D, s, o->base + t * o->st + h * o->sh);
            else
                deq(row, D, s, o->base + t * o->st + h * o->sh);
        }
    }
    return 0;
}

/* Every row, the CRC (when given; q dense) continued over q's bytes: by the rows where the level folds
 * them (tables, whole 64-byte rows), else each slice checksummed just before its rows are read.
 * Returns 1 at a NaN code (the state then covers only part of q). */
static int dequantize_rows(const KvLevel *lv, Rows *p, int odt, KvCrc *crc) {
    DeqTables t;
    const KvRows *q = p->q;
    p->tabs = tables_if(&t, odt, lv->rows);
    const KvFoldOps *fold = crc && p->tabs ? fold_rows(lv, q) : NULL;
    KvFold acc = {.started = 0, .state = crc ? crc->state : 0};
    if (fold) p->fold_row = fold->deq, p->fold = &acc;
    kv_ssize step = crc && !fold ? crc_slice_tokens(q) : q->T;
    size_t token = (size_t)(q->H * q->D);
    int bad = 0;
    for (kv_ssize t0 = 0; t0 < q->T && !bad; t0 += step) {
        kv_ssize t1 = q->T - t0 < step ? q->T : t0 + step;
        if (crc && !fold) kv_crc_run(crc, q->base + (size_t)t0 * token, (size_t)(t1 - t0) * token);
        bad = dequantize_span(p, t0, t1);
    }
    if (fold) crc->state = fold->state(&acc);
    return bad;
}

/* dequantize: non-finite scales: nothing written. NaN codes: stops before that row (the reference then
 * rewrites all of out). The optional copy (a blob's K bytes into the caller's K) runs first; with `crc`
 * its state is continued over the copy's source, then q's bytes (a blob's K and codes, in order). */
const char *kv_dequantize(const KvLevel *lv, const KvRows *q, const KvRows *o, int odt, int scope, kv_ssize page,
                          const float *scales, kv_ssize ng, const KvCopy *copy, KvCrc *crc) {
    if (!scales_ok(scales, ng, 0)) return "scales must be finite";
    kv_copy_bytes(copy, crc);
    const KvRowOps *ops = lv->rows;
    Rows p = {.q = q, .o = o, .scope = scope, .page = page, .sc = scales, .deq = ops->deq[odt],
              .has_nan = ops->has_nan, .tables_row = ops->deq_tables};
    return dequantize_rows(lv, &p, odt, crc) ? "q holds NaN codes" : NULL;
}
