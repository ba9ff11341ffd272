/* The encode drivers: V's group scales and e4m3 codes (encode_v), and codes of given scales (quantize).
 * Pure C over KvRows with a level's function table; one copy of each pass, the CRC a parameter.
 *
 * Two ways over V: per_page_head 16-bit V page by page (a page's absmax, then its codes while its rows
 * are in L1: V read from memory once; a decline met at a page leaves the codes of the pages before it
 * written, and the reference then writes all of q or raises), other V in two passes (every scale, then
 * every code: nothing reaches q when V holds NaN/Inf or a scale is unusable). */
#include "kv_layout.h"

/* The scale a group's absmax gives (amax / 448, IEEE; 1.0 for zero), as stored in `sdt` and widened
 * back, which quantization then uses (as LMCache does). Returns a reason when the reference must take
 * the call. */
static const char *group_scale(float amax, int sdt, float *out) {
    float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (s == 0.0f) return "a group's scale underflows to zero (fp32 V with a subnormal absmax)";
    if (sdt == DT_F16) s = f16_to_f32(f32_to_f16(s));
    if (sdt == DT_BF16) s = bf16_to_f32(f32_to_bf16(s));
    if (!(finite_f32(s) && s > 0.0f)) return "a scale does not fit the stored scale dtype";
    *out = s;
    return NULL;
}

/* Head h's absmax over rows t0 .. t0 + n of 16-bit V (one vector pass); 0 when it is NaN or Inf. The
 * maximum of the bit patterns is the same whatever the order, so the scales are the row-by-row pass's. */
static int head_amax_u16(const KvRowOps *ops, const KvRows *v, int vdt, kv_ssize t0, kv_ssize n, kv_ssize h,
                         float *m) {
    uint16_t bits = ops->amax16(v->base + t0 * v->st + h * v->sh, v->st, n, v->D);
    *m = vdt == DT_F16 ? f16_to_f32(bits) : bf16_to_f32(bits);
    return finite_f32(*m);
}

/* Pass 1 for 16-bit V with a vector absmax: each group's (a page's or the whole tensor's tokens, one
 * head) absmax in one pass over its rows. */
static const char *group_amax_u16(const KvRowOps *ops, const KvRows *v, int vdt, int scope, kv_ssize page,
                                  float *scales) {
    kv_ssize block = scope == SC_PAGE_HEAD ? page : v->T;
    for (kv_ssize t0 = 0; t0 < v->T; t0 += block) {
        kv_ssize rows = v->T - t0 < block ? v->T - t0 : block;
        for (kv_ssize h = 0; h < v->H; h++) {
            float m;
            if (!head_amax_u16(ops, v, vdt, t0, rows, h, &m)) return "V holds NaN or Inf (the reference names the group)";
            float *g = scales + group_of(scope, page, v->H, t0, h);
            *g = f32_bits(m) > f32_bits(*g) ? m : *g;
        }
    }
    return NULL;
}

/* Pass 1: every group's absmax, then its scale, into `scales`. Nothing else is written. */
static const char *encode_scales(const KvRowOps *ops, const KvRows *v, int vdt, int scope, kv_ssize page, int sdt,
                                 float *scales, kv_ssize ng) {
    amax_fn amax = ops->amax[vdt];
    memset(scales, 0, (size_t)ng * sizeof(float));
    if (ops->amax16 && vdt != DT_F32) {
        const char *why = group_amax_u16(ops, v, vdt, scope, page, scales);
        if (why) return why;
    } else
        for (kv_ssize t = 0; t < v->T; t++)
            for (kv_ssize h = 0; h < v->H; h++) {
                float m = amax(v->base + t * v->st + h * v->sh, v->D);
                if (!finite_f32(m)) return "V holds NaN or Inf (the reference names the group)";
                float *g = scales + group_of(scope, page, v->H, t, h);
                *g = f32_bits(m) > f32_bits(*g) ? m : *g;
            }
    for (kv_ssize g = 0; g < ng; g++) {
        const char *why = group_scale(scales[g], sdt, scales + g);
        if (why) return why;
    }
    return NULL;
}

/* One pass of codes: its rows and scales, and the row function (`fold`: the rows carry the CRC). */
typedef struct {
    const KvRows *v, *q;
    int scope;
    kv_ssize page;
    const float *sc;
    quant_fn quant;
    quant_fold_fn fold_row;
    KvFold *fold; /* NULL: quant runs */
} Codes;

static inline void *code_row(const KvRows *q, kv_ssize t, kv_ssize h) { return q->base + t * q->st + h * q->sh; }

/* The codes of rows t0 .. t1, each with its group's scale; returns whether a row met a NaN. One loop for
 * both ways (`fold`: the rows carry the CRC), a constant in each instance (quantize_span). */
__attribute__((always_inline)) static inline int span(const Codes *p, kv_ssize t0, kv_ssize t1, const int fold) {
    const KvRows *v = p->v;
    for (kv_ssize t = t0; t < t1; t++) {
        const float *st = token_scales(p->sc, p->scope, p->page, v->H, t);
        for (kv_ssize h = 0; h < v->H; h++) {
            const char *row = v->base + t * v->st + h * v->sh;
            float s = st[p->scope == SC_TENSOR ? 0 : h];
            if (fold)
                p->fold_row(row, v->D, s, code_row(p->q, t, h), p->fold);
            else if (p->quant(row, v->D, s, code_row(p->q, t, h)))
                return 1;
        }
    }
    return 0;
}

static int quantize_span(const Codes *p, kv_ssize t0, kv_ssize t1) {
    return p->fold ? span(p, t0, t1, 1) : span(p, t0, t1, 0);
}

/* Every row's codes (V known finite), the CRC continued over them in blob order when given: by the
 * rows where the level's fold takes them, else slice by slice right after each slice is written. */
static void quantize_codes(const KvLevel *lv, Codes *p, int vdt, KvCrc *crc) {
    const KvFoldOps *fold = crc ? fold_rows(lv, p->q) : NULL;
    KvFold acc = {.started = 0, .state = crc ? crc->state : 0};
    if (fold) p->fold_row = fold->quant[vdt], p->fold = &acc;
    kv_ssize step = crc && !fold ? crc_slice_tokens(p->q) : p->v->T;
    size_t token = (size_t)(p->q->H * p->q->D); /* dense codes */
    for (kv_ssize t0 = 0; t0 < p->v->T; t0 += step) {
        kv_ssize t1 = p->v->T - t0 < step ? p->v->T : t0 + step;
        (void)quantize_span(p, t0, t1); /* no NaN: encode_scales checked V */
        if (crc && !fold) kv_crc_run(crc, p->q->base + (size_t)t0 * token, (size_t)(t1 - t0) * token);
    }
    if (fold) crc->state = fold->state(&acc);
}

/* A page's scales (the absmax pass over its rows); a reason when the page holds NaN/Inf or a scale the
 * stored dtype cannot hold. */
static const char *page_scales(const KvRowOps *ops, const KvRows *v, int vdt, kv_ssize t0, kv_ssize rows, int sdt,
                               float *sc) {
    for (kv_ssize h = 0; h < v->H; h++) {
        float m;
        if (!head_amax_u16(ops, v, vdt, t0, rows, h, &m)) return "V holds NaN or Inf (the reference names the group)";
        const char *why = group_scale(m, sdt, sc + h);
        if (why) return why;
    }
    return NULL;
}

static inline void prefetch_row(const char *row, kv_ssize bytes) {
    for (kv_ssize off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
}

/* How many tokens ahead the rows are prefetched: about 32 KiB of V (a page of 16 tokens x 8 heads x 128
 * in fp16), so the next page's absmax reads L1 while this page's quantize keeps the core busy. */
static inline kv_ssize prefetch_tokens(const KvRows *v) {
    kv_ssize st = v->st > 0 ? v->st : 1;
    return (32768 + st - 1) / st;
}

/* A page's codes (rows t0 .. t0 + rows), the rows `ahead` bytes on prefetched; `fold`: a constant (the
 * rows carry the CRC in acc), so each instance is its own loop. */
__attribute__((always_inline)) static inline void page_codes(const Codes *p, kv_ssize t0, kv_ssize rows,
                                                             const float *sc, KvFold *acc, const int fold) {
    const KvRows *v = p->v;
    kv_ssize row_bytes = v->D * 2, lead = prefetch_tokens(v), ahead = lead * v->st;
    for (kv_ssize t = t0; t < t0 + rows; t++)
        for (kv_ssize h = 0; h < v->H; h++) {
            const char *row = v->base + t * v->st + h * v->sh;
            if (t + lead < v->T) prefetch_row(row + ahead, row_bytes);
            if (fold)
                p->fold_row(row, v->D, sc[h], code_row(p->q, t, h), acc);
            else
                (void)p->quant(row, v->D, sc[h], code_row(p->q, t, h));
        }
}

/* per_page_head with 16-bit V: one page at a time, its scales and then its codes while those rows are
 * still in L1; the successor's rows prefetched meanwhile. The CRC (when given) over the codes in blob
 * order: carried by the rows, or per page from memory (a token is H * D bytes whatever q's token
 * stride says: T == 1). */
static const char *encode_paged(const KvLevel *lv, Codes *p, int vdt, int sdt, float *scales, KvCrc *crc) {
    const KvRows *v = p->v, *q = p->q;
    const KvFoldOps *fold = crc ? fold_rows(lv, q) : NULL;
    KvFold acc = {.started = 0, .state = crc ? crc->state : 0};
    if (fold) p->fold_row = fold->quant[vdt];
    size_t token = (size_t)(q->H * q->D);
    for (kv_ssize t0 = 0; t0 < v->T; t0 += p->page) {
        kv_ssize rows = v->T - t0 < p->page ? v->T - t0 : p->page;
        float *sc = scales + (t0 / p->page) * v->H;
        const char *why = page_scales(lv->rows, v, vdt, t0, rows, sdt, sc);
        if (why) return why;
        if (fold)
            page_codes(p, t0, rows, sc, &acc, 1);
        else
            page_codes(p, t0, rows, sc, NULL, 0);
        if (crc && !fold) kv_crc_run(crc, q->base + (size_t)t0 * token, (size_t)rows * token);
    }
    if (fold) crc->state = fold->state(&acc);
    return NULL;
}

/* encode_paged (its codes' CRC from a fresh state), then the copy once the encode is served, its CRC
 * continuing crc's; the two CRCs joined in blob order (copy, then codes). */
static const char *encode_paged_then_copy(const KvLevel *lv, Codes *p, int vdt, int sdt, float *scales,
                                          const KvCopy *copy, KvCrc *crc) {
    KvCrc codes = {.ops = crc ? crc->ops : NULL, .state = 0xFFFFFFFFu};
    const char *why = encode_paged(lv, p, vdt, sdt, scales, crc ? &codes : NULL);
    if (why) return why;
    kv_copy_bytes(copy, crc);
    if (crc) {
        uint64_t n = (uint64_t)(p->q->T * p->q->H * p->q->D);
        crc->state = ~kv_crc32_combine(~crc->state, ~codes.state, n);
    }
    return NULL;
}

/* Every scale, then every code; the copy before the codes when a CRC runs over both (blob order). */
static const char *encode_two_passes(const KvLevel *lv, Codes *p, int vdt, int sdt, float *scales, kv_ssize ng,
                                     const KvCopy *copy, KvCrc *crc) {
    const char *why = encode_scales(lv->rows, p->v, vdt, p->scope, p->page, sdt, scales, ng);
    if (why) return why;
    if (crc) kv_copy_bytes(copy, crc);
    quantize_codes(lv, p, vdt, crc);
    if (!crc) kv_copy_bytes(copy, NULL);
    return NULL;
}

/* encode_v: V's group scales into `scales`, its codes into q; the optional copy made only when the
 * encode is served; with `crc` its state continued over the copy's destination, then q's codes. */
const char *kv_encode_v(const KvLevel *lv, const KvRows *v, const KvRows *q, int vdt, int scope, kv_ssize page,
                        int sdt, float *scales, kv_ssize ng, const KvCopy *copy, KvCrc *crc) {
    Codes p = {.v = v, .q = q, .scope = scope, .page = page, .sc = scales, .quant = lv->rows->quant_finite[vdt]};
    if (scope == SC_PAGE_HEAD && vdt != DT_F32 && lv->rows->amax16 && lv->paged)
        return encode_paged_then_copy(lv, &p, vdt, sdt, scales, copy, crc);
    return encode_two_passes(lv, &p, vdt, sdt, scales, ng, copy, crc);
}

/* quantize: codes of given scales. Scales not finite and positive: nothing written. NaN in V: stops at
 * that row (the reference then rewrites all of q). */
const char *kv_quantize(const KvLevel *lv, const KvRows *v, const KvRows *q, int vdt, int scope, kv_ssize page,
                        const float *scales, kv_ssize ng) {
    if (!scales_ok(scales, ng, 1)) return "scales must be finite and positive";
    Codes p = {.v = v, .q = q, .scope = scope, .page = page, .sc = scales, .quant = lv->rows->quant[vdt]};
    return quantize_span(&p, 0, v->T) ? "V holds NaN" : NULL;
}
