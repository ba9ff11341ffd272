/* The codec's entry points: encode_v, quantize, dequantize. Arguments parsed and every buffer checked
 * (buffers.c), then one driver call without the GIL at the receiver's level. A call returns None when
 * done, an int (the CRC) when it carried one, or a reason string when the reference must take it: a
 * layout the loops do not take, or data they cannot reproduce bit for bit (NaN/Inf in V, NaN codes,
 * unusable scales; torch's own NaN bits differ with the tensor's size). All of these are found before
 * any output is written, except NaN met by quantize and dequantize, which stop at that row, and
 * NaN/Inf or an unusable scale met by the page-by-page encode, which stops at that page: the
 * reference then rewrites the whole output (or raises), so no partial result is ever returned. */
#include "buffers.h"
#include "kv_layout.h"

/* The bytes a call's rows and scales span: what it reads and writes, for KV_BEGIN_WORK. */
static size_t moved(const Bufs *b) {
    return kv_add(kv_add((size_t)b->in.view.len, (size_t)b->out.view.len), (size_t)b->s.view.len);
}

/* encode_v(v, v_dtype, scope, page, scale_dtype, q, scales[, copy_src, copy_dst[, crc]]) -> None, an
 * int, or why the reference must take it. V's group scales (fp32 values of the stored scale dtype)
 * into `scales`, and its e4m3 codes into `q` (encode.c). The optional copy (K's bytes into the blob) is
 * made only when the encode is served, in the same GIL release. With `crc` (an int: the CRC so far,
 * e.g. of the header) the result is that CRC continued over the copy's destination, then over q's
 * bytes (a blob's K and codes, in order); None when the CRC could not be folded in (no carry-less
 * multiply, q not dense, or a copy overlapping itself): the caller computes it. */
PyObject *py_encode_v(PyObject *self, PyObject *args) {
    static const char *fn = "encode_v";
    PyObject *vo, *qo, *so, *cs = Py_None, *cd = Py_None, *co = Py_None;
    int vdt, scope, sdt, want;
    uint32_t seed = 0;
    Py_ssize_t page;
    Bufs b;
    Copy c;
    if (parse(args, fn, "OiiniOO|OOO", &vo, &vdt, &scope, &page, &sdt, &qo, &so, &cs, &cd, &co) ||
        check_dtype(fn, vdt) || check_dtype(fn, sdt) || check_scope(fn, scope, page) || take_crc(fn, co, &want, &seed) ||
        take_bufs(fn, vo, DT_SIZE[vdt], qo, 1, so, 1, scope, page, &b))
        return NULL;
    if (take_copy(fn, cs, cd, &c) < 0) return release_bufs(&b), NULL;
    /* The copy's destination may touch nothing the encode reads or writes, and its source nothing
     * the encode writes. */
    if (!b.why && (copy_overlaps(&c, &c.dst, &b.in) || copy_overlaps(&c, &c.dst, &b.out) ||
                   copy_overlaps(&c, &c.dst, &b.s) || copy_overlaps(&c, &c.src, &b.out) ||
                   copy_overlaps(&c, &c.src, &b.s)))
        b.why = "the copy overlaps an input or output of the encode";
    if (b.why) return release_copy(&c), result(&b, b.why);
    const KvLevel lv = *level_of(self);
    int fold = want && lv.crc->level && dense_codes(&b.out.r) && !(c.held && bufs_overlap(&c.src, &c.dst));
    KvCrc crc = {.ops = lv.crc, .state = ~seed};
    KvCopy copy = copy_of(&c);
    const char *why;
    KV_BEGIN_WORK(kv_add(moved(&b), c.held ? 2 * (size_t)c.src.len : 0))
    why = kv_encode_v(&lv, &b.in.r, &b.out.r, vdt, scope, page, sdt, (float *)b.s.r.base, b.ng, &copy,
                      fold ? &crc : NULL);
    KV_END_WORK
    release_copy(&c);
    if (why || !want) return result(&b, why);
    return crc_result(&b, fold, crc.state);
}

/* quantize(v, v_dtype, scales, scope, page, q) -> None, or why the reference must take it.
 * Scales not finite and positive: nothing written. NaN in V: stops at that row
 * (the reference then rewrites all of q). */
PyObject *py_quantize(PyObject *self, PyObject *args) {
    static const char *fn = "quantize";
    PyObject *vo, *so, *qo;
    int vdt, scope;
    Py_ssize_t page;
    Bufs b;
    if (parse(args, fn, "OiOinO", &vo, &vdt, &so, &scope, &page, &qo) || check_dtype(fn, vdt) ||
        check_scope(fn, scope, page) || take_bufs(fn, vo, DT_SIZE[vdt], qo, 1, so, 0, scope, page, &b))
        return NULL;
    if (b.why) return result(&b, b.why);
    const KvLevel lv = *level_of(self);
    const char *why;
    KV_BEGIN_WORK(moved(&b))
    why = kv_quantize(&lv, &b.in.r, &b.out.r, vdt, scope, page, (const float *)b.s.r.base, b.ng);
    KV_END_WORK
    return result(&b, why);
}

/* dequantize(q, scales, scope, page, out, out_dtype[, copy_src, copy_dst[, crc]]) -> None, an int, or
 * why the reference must take it. Non-finite scales, or a copy touching another buffer: nothing
 * written. NaN codes: stops before that row (the reference then rewrites all of out). The optional
 * copy (a blob's K bytes into the caller's K) runs first, in the same GIL release. With `crc` (the
 * CRC so far: of the header) the result is that CRC continued over the copy's source, then q's bytes
 * (a blob's K and codes, in order), each slice checksummed while in cache, so that a decode reads
 * its payload once; None when it could not be folded in (the caller computes it). */
PyObject *py_dequantize(PyObject *self, PyObject *args) {
    static const char *fn = "dequantize";
    PyObject *qo, *so, *oo, *cs = Py_None, *cd = Py_None, *co = Py_None;
    int scope, odt, want;
    uint32_t seed = 0;
    Py_ssize_t page;
    Bufs b;
    Copy c;
    if (parse(args, fn, "OOinOi|OOO", &qo, &so, &scope, &page, &oo, &odt, &cs, &cd, &co) || check_dtype(fn, odt) ||
        check_scope(fn, scope, page) || take_crc(fn, co, &want, &seed) ||
        take_bufs(fn, qo, 1, oo, DT_SIZE[odt], so, 0, scope, page, &b))
        return NULL;
    if (take_copy(fn, cs, cd, &c) < 0) return release_bufs(&b), NULL;
    if (!b.why && c.held &&
        (bufs_overlap(&c.src, &c.dst) || copy_overlaps(&c, &c.dst, &b.in) || copy_overlaps(&c, &c.dst, &b.out) ||
         copy_overlaps(&c, &c.dst, &b.s) || copy_overlaps(&c, &c.src, &b.out)))
        b.why = "the copy overlaps an input or output of the dequantization";
    if (b.why) return release_copy(&c), result(&b, b.why);
    const KvLevel lv = *level_of(self);
    int fold = want && lv.crc->level && dense_codes(&b.in.r);
    KvCrc crc = {.ops = lv.crc, .state = ~seed};
    KvCopy copy = copy_of(&c);
    const char *why;
    KV_BEGIN_WORK(kv_add(moved(&b), c.held ? 2 * (size_t)c.src.len : 0))
    why = kv_dequantize(&lv, &b.in.r, &b.out.r, odt, scope, page, (const float *)b.s.r.base, b.ng, &copy,
                        fold ? &crc : NULL);
    KV_END_WORK
    release_copy(&c);
    if (why || !want) return result(&b, why);
    return crc_result(&b, fold, crc.state);
}
