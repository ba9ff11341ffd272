/* lossless_expand: a split lossless payload (schemes LOSSLESS_SPLIT(_UNIT); docs/FORMAT.md, "Lossless
 * payload") expanded to K's bytes and V's codes in one call, so that a blob's decode hands the GIL over
 * once instead of once per stage (the coded payload's CRC, V's streams, V's merge, K's streams, K's merge).
 * Each hand-over lets another Python thread take the GIL and keep it until its switch interval runs out:
 * with a busy Python thread beside it (an engine's loop beside its connector's loader), 96 small blobs
 * took 54 ms of wall time for 19 ms of CPU (bench/connector_load.py's lossless rows).
 *
 * lossless_expand(payload, k_len, v_len, k_spans, k_raw_at, v_spans, v_raw_at, T, H, D, k_out, v_out,
 *                 plane, crc[, deq]) -> None | ("crc", got) | ("V" or "K", stream, code) | reason
 *   payload: the coded payload (K's section [0, k_len), V's [k_len, k_len + v_len), the scales after);
 *   k_spans, v_spans: each section's H streams, (offset, length) from the section's start (k_spans empty
 *   and k_out None for a blob without K); k_raw_at, v_raw_at: where K's low plane and V's sign and
 *   mantissa nibbles start in their sections; k_out: 2 x T x H x D bytes, v_out: T x H x D, plane: T x H
 *   x D bytes of scratch; crc: None, or (prefix, stored): the CRC of prefix then the whole payload must
 *   be stored, checked before any stream is decoded ("crc", the CRC found, when it is not);
 *   deq: None, or (scales, scope, page, out, out_dtype) as dequantize takes them: V's codes (v_out, given
 *   then as a [T, H, D] array) dequantized into out once the payload is expanded, in the same call, while
 *   they are still in cache (a decode into out_v: no second call and its Python). A reason string when
 *   the loops decline it: a layout they do not take (found before any work; the expansion still runs)
 *   or NaN codes (out partly written): the caller dequantizes the codes another way.
 * Every span is checked against its buffer, and the outputs against each other and the inputs, before
 * the GIL is released; a refused stream stops the call (V's streams first, then K's, each in order). */
#include "buffers.h"
#include "huff.h"
#include "nibbles.h"
#include "planes.h"

/* A section's streams read from a sequence of H (offset, length) tuples into spans[2i], spans[2i + 1],
 * each inside the section's sec_len bytes. -1: error raised. */
static int read_spans(PyObject *obj, Py_ssize_t H, Py_ssize_t sec_len, size_t *spans) {
    PyObject *seq = PySequence_Fast(obj, "lossless_expand: streams must be a sequence of (offset, length)");
    if (!seq) return rethrow("lossless_expand"), -1;
    int ok = PySequence_Fast_GET_SIZE(seq) == H;
    for (Py_ssize_t i = 0; ok && i < H; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t a = -1, l = -1;
        if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2) {
            a = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0));
            l = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
            if (PyErr_Occurred()) PyErr_Clear(), a = l = -1;
        }
        ok = a >= 0 && l >= 0 && a <= sec_len && l <= sec_len - a;
        spans[2 * i] = (size_t)a, spans[2 * i + 1] = (size_t)l;
    }
    Py_DECREF(seq);
    return ok ? 0 : fail("lossless_expand", "each section needs one (offset, length) a head, inside the section");
}

/* The optional CRC argument: None, or (prefix buffer, stored CRC). -1: error raised. */
static int read_crc(PyObject *obj, Py_buffer *prefix, int *want, uint32_t *stored) {
    *want = obj != Py_None;
    if (!*want) return 0;
    unsigned long long v = 0;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2 ||
        ((v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(obj, 1))) == (unsigned long long)-1 && PyErr_Occurred()) ||
        v > 0xFFFFFFFFull) {
        if (PyErr_Occurred()) PyErr_Clear();
        return fail("lossless_expand", "crc must be None or (prefix, stored CRC of 32 bits)");
    }
    *stored = (uint32_t)v;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(obj, 0), prefix, PyBUF_C_CONTIGUOUS) < 0)
        return rethrow("lossless_expand"), -1;
    return 0;
}

typedef struct {
    const uint8_t *payload;
    size_t k_len, k_raw_at, v_raw_at, T, H, D;
    const size_t *k_spans, *v_spans; /* k_spans NULL: no K */
    uint8_t *k_out, *v_out, *plane;
    const uint8_t *prefix; /* NULL: no CRC check */
    size_t prefix_len, payload_len;
    uint32_t stored;
} Expand;

/* The work, without the GIL: 0, or 1 (a CRC mismatch: *got), or 2 + section (0 V, 1 K) with the stream
 * and code. */
static int expand(const KvLevel *lv, const Expand *e, uint32_t *got, size_t *stream, int *code) {
    if (e->prefix) {
        *got = kv_crc32(lv->crc, kv_crc32(lv->crc, 0, e->prefix, e->prefix_len), e->payload, e->payload_len);
        if (*got != e->stored) return 1;
    }
    size_t raw = e->T * e->D, n = raw * e->H;
    const uint8_t *v = e->payload + e->k_len;
    if ((*code = huff_decode_many(v, e->v_spans, e->H, raw, e->plane, raw, raw, raw, NULL, stream))) return 2;
    kv_nibbles_merge(e->plane, v + e->v_raw_at, e->v_out, e->T, e->H, e->D);
    if (!e->k_spans || !n) return 0;
    if ((*code = huff_decode_many(e->payload, e->k_spans, e->H, raw, e->plane, raw, raw, raw, NULL, stream)))
        return 3;
    kv_planes_merge(e->plane, e->payload + e->k_raw_at, e->k_out, e->T, e->H * e->D);
    return 0;
}

/* The sizes and places of everything e reads and writes, checked (0), else an error raised (-1). */
static int check_expand(Py_ssize_t k_len, Py_ssize_t v_len, Py_ssize_t k_raw_at, Py_ssize_t v_raw_at, Py_ssize_t n,
                        const Py_buffer *p, const Py_buffer *ko, const Py_buffer *vo, const Py_buffer *pl,
                        const Py_buffer *prefix) {
    if (k_len < 0 || v_len < 0 || k_len > p->len || v_len > p->len - k_len)
        return fail("lossless_expand", "the sections lie outside the payload");
    if (ko ? k_raw_at < 0 || k_raw_at > k_len || k_len - k_raw_at < n : k_len != 0)
        return fail("lossless_expand", "K's low plane lies outside K's section (or K's section is there without K)");
    if (v_raw_at < 0 || v_raw_at > v_len || v_len - v_raw_at < (n + 1) / 2)
        return fail("lossless_expand", "V's nibbles lie outside V's section");
    if ((ko && ko->len != 2 * n) || vo->len != n || pl->len != n)
        return fail("lossless_expand", "k_out, v_out and plane must hold exactly K's bytes, V's codes and one plane");
    const Py_buffer *outs[3] = {vo, pl, ko};
    for (int i = 0; i < 3 && outs[i]; i++) {
        if (bufs_overlap(outs[i], p) || (prefix && bufs_overlap(outs[i], prefix)))
            return fail("lossless_expand", "an output shares memory with the payload");
        for (int j = i + 1; j < 3 && outs[j]; j++)
            if (bufs_overlap(outs[i], outs[j])) return fail("lossless_expand", "the outputs must not share memory");
    }
    return 0;
}

/* Whether array a shares a byte with buffer v. */
static int arr_touches(const Arr *a, const Py_buffer *v) {
    const char *v0 = v->buf;
    return v->len && a->lo < v0 + v->len && v0 < a->hi;
}

/* The optional dequantization (see the top): none (0, *want 0), or its buffers taken into b (0, *want 1),
 * b->why set where the loops decline it, including any overlap of its output or scales with what the
 * expansion reads or writes. -1: error raised. */
static int take_deq(PyObject *obj, PyObject *codes, const Py_buffer *const *others, int n_others, Bufs *b, int *want,
                    int *odt, int *scope, Py_ssize_t *page) {
    static const char *fn = "lossless_expand";
    *want = obj != Py_None;
    if (!*want) return 0;
    PyObject *so, *oo;
    if (!PyTuple_Check(obj) || !PyArg_ParseTuple(obj, "OinOi", &so, scope, page, &oo, odt)) {
        if (PyErr_Occurred()) PyErr_Clear();
        return fail(fn, "deq must be None or (scales, scope, page, out, out_dtype)");
    }
    if (check_dtype(fn, *odt) || check_scope(fn, *scope, *page) ||
        take_bufs(fn, codes, 1, oo, DT_SIZE[*odt], so, 0, *scope, *page, b))
        return -1;
    for (int i = 0; i < n_others && !b->why; i++)
        if (others[i] && (arr_touches(&b->out, others[i]) || arr_touches(&b->s, others[i])))
            b->why = "the dequantized output or its scales share memory with the payload or the expansion's outputs";
    return 0;
}

/* The result object of expand's return r. */
static PyObject *expand_result(int r, uint32_t got, size_t stream, int code) {
    if (r == 0) return Py_NewRef(Py_None);
    if (r == 1) return Py_BuildValue("(sk)", "crc", (unsigned long)got);
    return Py_BuildValue("(sni)", r == 2 ? "V" : "K", (Py_ssize_t)stream, code);
}

PyObject *py_lossless_expand(PyObject *self, PyObject *args) {
    PyObject *po, *kso, *vso, *koo, *voo, *plo, *crco, *deqo = Py_None;
    Py_ssize_t k_len, v_len, k_raw_at, v_raw_at, T, H, D, page = 0;
    if (parse(args, "lossless_expand", "OnnOnOnnnnOOOO|O", &po, &k_len, &v_len, &kso, &k_raw_at, &vso, &v_raw_at, &T,
              &H, &D, &koo, &voo, &plo, &crco, &deqo))
        return NULL;
    if (T < 0 || H < 1 || H > PY_SSIZE_T_MAX / 64 || D < 0 || D > PY_SSIZE_T_MAX / H ||
        (D && T > PY_SSIZE_T_MAX / 2 / (H * D)))
        return fail("lossless_expand", "tokens, heads and head_dim must be >= 0 (heads >= 1) and fit"), NULL;
    Py_ssize_t n = T * H * D;
    size_t *spans = PyMem_RawMalloc(4 * (size_t)H * sizeof *spans);
    if (!spans) return PyErr_NoMemory();
    Py_buffer p = {0}, ko = {0}, vo = {0}, pl = {0}, prefix = {0};
    Bufs deq = {0};
    int have_k = koo != Py_None, want = 0, held = 0, want_deq = 0, odt = 0, scope = 0;
    uint32_t stored = 0;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(po, &p, PyBUF_C_CONTIGUOUS) < 0) goto error;
    held = 1;
    if (have_k && PyObject_GetBuffer(koo, &ko, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto error;
    held = 2;
    if (PyObject_GetBuffer(voo, &vo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto error;
    held = 3;
    if (PyObject_GetBuffer(plo, &pl, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto error;
    held = 4;
    if (read_crc(crco, &prefix, &want, &stored) < 0) goto done;
    held = 5;
    if (check_expand(k_len, v_len, k_raw_at, v_raw_at, n, &p, have_k ? &ko : NULL, &vo, &pl, want ? &prefix : NULL) < 0)
        goto done;
    if (read_spans(vso, H, v_len, spans + 2 * H) < 0 || (have_k && read_spans(kso, H, k_len, spans) < 0)) goto done;
    const Py_buffer *others[5] = {&p, &vo, &pl, have_k ? &ko : NULL, want ? &prefix : NULL};
    if (take_deq(deqo, voo, others, 5, &deq, &want_deq, &odt, &scope, &page) < 0) goto done;
    held = 6;
    Py_ssize_t k_count = have_k ? 0 : PyObject_Length(kso);
    if (k_count) { /* without K: no K streams */
        k_count < 0 ? rethrow("lossless_expand") : (void)fail("lossless_expand", "k_spans must be empty without k_out");
        goto done;
    }
    Expand e = {p.buf, (size_t)k_len, (size_t)k_raw_at, (size_t)v_raw_at, (size_t)T, (size_t)H, (size_t)D,
                have_k ? spans : NULL, spans + 2 * H, ko.buf, vo.buf, pl.buf, want ? prefix.buf : NULL,
                want ? (size_t)prefix.len : 0, (size_t)p.len, stored};
    const KvLevel lv = *level_of(self);
    uint32_t got = 0;
    size_t stream = 0;
    int code = 0, r, deq_now = want_deq && !deq.why;
    const char *why = deq.why;
    KvCopy none = {NULL, NULL, 0};
    KV_BEGIN_WORK(kv_add(kv_add((size_t)p.len, 5 * (size_t)n), deq_now ? (size_t)deq.out.view.len : 0))
    r = expand(&lv, &e, &got, &stream, &code);
    if (r == 0 && deq_now)
        why = kv_dequantize(&lv, &deq.in.r, &deq.out.r, odt, scope, page, (const float *)deq.s.r.base, deq.ng, &none,
                            NULL);
    KV_END_WORK
    ret = r == 0 && why ? PyUnicode_FromString(why) : expand_result(r, got, stream, code);
    goto done;
error:
    rethrow("lossless_expand");
done:
    if (held >= 6 && want_deq) release_bufs(&deq);
    if (held >= 5 && want) PyBuffer_Release(&prefix);
    if (held >= 4) PyBuffer_Release(&pl);
    if (held >= 3) PyBuffer_Release(&vo);
    if (held >= 2 && have_k) PyBuffer_Release(&ko);
    if (held >= 1) PyBuffer_Release(&p);
    PyMem_RawFree(spans);
    return ret;
}
