/* The scatter's entry points: scatter_rows (K rows) and scatter_dequant (V's codes, and K's rows beside
 * them) straight into a vLLM layer cache view, one call per layer: no token-major staging copy and no
 * per-run Python. Every run is checked against the view and the source before any row is written. */
#include "buffers.h"
#include "kv_layout.h"

/* scatter_rows(src, cache, col, runs) -> None, or why numpy must take it: src [T, H, D] rows into
 * columns col .. col + D of the cache view, run by run. */
PyObject *py_scatter_rows(PyObject *self, PyObject *args) {
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
    if (take_runs(ro, fn, src.r.T, src.r.H, src.r.D, &c, col, &r) < 0) goto done;
    if (!why && cache_overlaps(&c, &src)) why = "the cache overlaps the rows";
    if (!why) {
        KV_BEGIN_WORK(2 * (size_t)src.view.len)
        kv_copy_runs(&src.r, &c.c, col, (const int64_t *)r.buf, r.len / 8);
        KV_END_WORK
    }
    PyBuffer_Release(&r);
    ret = why ? PyUnicode_FromString(why) : Py_NewRef(Py_None);
done:
    if (src.held) PyBuffer_Release(&src.view);
    if (c.held) PyBuffer_Release(&c.view);
    return ret;
}

/* K's rows for scatter_dequant: q's tokens and heads, each row the bytes of Dk elements of the cache's
 * dtype (any alignment), their runs checked against columns k_col .. k_col + Dk. -1: error raised. */
static int take_k(PyObject *ko, const char *fn, const Arr *q, int odt, Py_ssize_t col, Py_ssize_t k_col,
                  const Cache4 *c, PyObject *ro, Arr *k, Py_buffer *rk, const char **why) {
    if (get_arr(ko, 1, 0, fn, "K", k, why) < 0) return -1; /* bytes: memcpy needs no alignment */
    if (k->r.T != q->r.T || k->r.H != q->r.H || k->r.D % DT_SIZE[odt])
        return fail(fn, "K's tokens or heads are not the codes', or its rows not whole elements of the cache");
    Py_ssize_t k_d = k->r.D / DT_SIZE[odt];
    if (take_runs(ro, fn, k->r.T, k->r.H, k_d, c, k_col, rk) < 0) return -1;
    if (!*why && (k_col < col + q->r.D && col < k_col + k_d)) *why = "K's columns overlap V's";
    if (!*why && cache_overlaps(c, k)) *why = "the cache overlaps K";
    return 0;
}

/* scatter_dequant(q, scales, scope, page, cache, col, out_dtype, runs[, k, k_col[, crc]]) -> None, an
 * int, or why the reference must take it: float(q) * scale of the runs' rows into columns col .. col + D
 * of the cache view; with `k`, K's rows into columns k_col .. k_col + Dk in the same pass (a layer's
 * whole chunk in one call). NaN codes anywhere in q, non-finite scales or a layout the loops do not
 * take: nothing written. With `crc` (the CRC of the blob's header, or 0) and `k` and q dense (a blob's
 * K and codes), the result is that CRC continued over all of K then all of q (scatter.c). None: not
 * folded. */
PyObject *py_scatter_dequant(PyObject *self, PyObject *args) {
    static const char *fn = "scatter_dequant";
    PyObject *qo, *so, *co, *ro, *ko = Py_None, *cro = Py_None;
    int scope, odt, want, fold = 0, have_r = 0;
    Py_ssize_t page, col, k_col = 0;
    Arr q, s, k;
    Cache4 c;
    Py_buffer r, rk;
    const char *why = NULL;
    uint32_t seed = 0, state = 0;
    memset(&q, 0, sizeof q), memset(&s, 0, sizeof s), memset(&k, 0, sizeof k), memset(&c, 0, sizeof c);
    memset(&rk, 0, sizeof rk);
    if (parse(args, fn, "OOinOniO|OnO", &qo, &so, &scope, &page, &co, &col, &odt, &ro, &ko, &k_col, &cro) ||
        check_dtype(fn, odt) || check_scope(fn, scope, page) || take_crc(fn, cro, &want, &seed))
        return NULL;
    PyObject *ret = NULL;
    if (get_arr(qo, 1, 0, fn, "the codes", &q, &why) < 0) goto done;
    Py_ssize_t ng = groups_of(q.r.T, q.r.H, scope, page);
    if (ng < 0) {
        fail(fn, "too many scale groups");
        goto done;
    }
    if (get_scales(so, ng, 0, fn, &s, &why) < 0 || get_cache(co, DT_SIZE[odt], fn, &c, &why) < 0) goto done;
    if (take_runs(ro, fn, q.r.T, q.r.H, q.r.D, &c, col, &r) < 0) goto done;
    have_r = 1;
    if (ko != Py_None && take_k(ko, fn, &q, odt, col, k_col, &c, ro, &k, &rk, &why) < 0) goto done;
    if (!why && (cache_overlaps(&c, &q) || cache_overlaps(&c, &s))) why = "the cache overlaps the codes or the scales";
    if (!why) {
        const KvLevel lv = *level_of(self);
        fold = want && lv.crc->level && k.held && dense_codes(&q.r) && dense_codes(&k.r);
        KvCrc crc = {.ops = lv.crc, .state = ~seed};
        ScatterJob job = {&q.r, k.held ? &k.r : NULL, &c.c, (const float *)s.r.base, scope, page,
                          c.c.base + col * c.view.itemsize, c.c.base + k_col * c.view.itemsize, (size_t)k.r.D};
        KV_BEGIN_WORK(kv_add((size_t)q.view.len * (1 + (size_t)DT_SIZE[odt]), k.held ? 2 * (size_t)k.view.len : 0))
        why = kv_scatter_dequant(&lv, &job, odt, (const int64_t *)r.buf, r.len / 8, ng, fold ? &crc : NULL);
        KV_END_WORK
        state = crc.state;
    }
    if (why || !want || !fold)
        ret = why ? PyUnicode_FromString(why) : Py_NewRef(Py_None);
    else
        ret = PyLong_FromUnsignedLong(~state & 0xFFFFFFFFu);
done:
    if (have_r) PyBuffer_Release(&r);
    if (rk.obj) PyBuffer_Release(&rk);
    if (q.held) PyBuffer_Release(&q.view);
    if (s.held) PyBuffer_Release(&s.view);
    if (k.held) PyBuffer_Release(&k.view);
    if (c.held) PyBuffer_Release(&c.view);
    return ret;
}
