/* k_planes(k, hi, lo, tokens, heads, dim, merge) -> None: the entry point of planes.c; v_nibbles(v, exp,
 * nib, tokens, heads, dim, merge) -> None and v_nibbles_pairs(v, exp2, nib, tokens, heads, dim) -> None
 * (a split, the exponents two a byte): nibbles.c's. Every buffer C-contiguous bytes of exactly its
 * plane's length (checked), none overlapping another; merge=0 splits into the planes, merge=1 writes
 * from them. The GIL is released around the pass. */
#include "buffers.h"
#include "nibbles.h"
#include "planes.h"

/* One buffer of exactly `len` bytes, C-contiguous, writable if asked. -1: error raised. */
static int take_for(const char *fn, PyObject *obj, Py_ssize_t len, int writable, const char *name, Py_buffer *b) {
    if (PyObject_GetBuffer(obj, b, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0) {
        rethrow(fn);
        return -1;
    }
    if (b->len != len) {
        PyBuffer_Release(b);
        char msg[160];
        snprintf(msg, sizeof msg, "%s is %zd bytes; the geometry needs %zd", name, b->len, len);
        return fail(fn, msg);
    }
    return 0;
}

static int take(PyObject *obj, Py_ssize_t len, int writable, const char *name, Py_buffer *b) {
    return take_for("k_planes", obj, len, writable, name, b);
}

/* tokens, heads, head_dim >= 0 with n = their product, and 2n, within a Py_ssize_t. -1: error raised. */
static int geometry(const char *fn, Py_ssize_t T, Py_ssize_t H, Py_ssize_t D) {
    if (T < 0 || H < 0 || D < 0 || (H && D > PY_SSIZE_T_MAX / H) || (H * D != 0 && T > PY_SSIZE_T_MAX / 2 / (H * D)))
        return fail(fn, "tokens, heads and head_dim must be >= 0 and their bytes fit a Py_ssize_t");
    return 0;
}

PyObject *py_k_planes(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ko, *ho, *lo_o;
    Py_ssize_t T, H, D;
    int m;
    if (parse(args, "k_planes", "OOOnnnp", &ko, &ho, &lo_o, &T, &H, &D, &m)) return NULL;
    if (geometry("k_planes", T, H, D) < 0) return NULL;
    Py_ssize_t n = T * H * D;
    Py_buffer k, hi, lo;
    if (take(ko, 2 * n, m, "k", &k) < 0) return NULL;
    if (take(ho, n, !m, "hi", &hi) < 0) return PyBuffer_Release(&k), NULL;
    if (take(lo_o, n, !m, "lo", &lo) < 0) return PyBuffer_Release(&k), PyBuffer_Release(&hi), NULL;
    PyObject *ret = NULL;
    if (bufs_overlap(&k, &hi) || bufs_overlap(&k, &lo) || bufs_overlap(&hi, &lo)) {
        fail("k_planes", "K and its planes must not share memory");
    } else {
        Py_BEGIN_ALLOW_THREADS
        if (m)
            kv_planes_merge(hi.buf, lo.buf, k.buf, (size_t)T, (size_t)(H * D));
        else
            kv_planes_split(k.buf, hi.buf, lo.buf, (size_t)T, (size_t)(H * D));
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&k);
    PyBuffer_Release(&hi);
    PyBuffer_Release(&lo);
    return ret;
}

PyObject *py_v_nibbles(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *vo, *eo, *so;
    Py_ssize_t T, H, D;
    int m;
    if (parse(args, "v_nibbles", "OOOnnnp", &vo, &eo, &so, &T, &H, &D, &m)) return NULL;
    if (geometry("v_nibbles", T, H, D) < 0) return NULL;
    Py_ssize_t n = T * H * D;
    Py_buffer v, e, s;
    if (take_for("v_nibbles", vo, n, m, "v", &v) < 0) return NULL;
    if (take_for("v_nibbles", eo, n, !m, "exp", &e) < 0) return PyBuffer_Release(&v), NULL;
    if (take_for("v_nibbles", so, (n + 1) / 2, !m, "nib", &s) < 0) return PyBuffer_Release(&v), PyBuffer_Release(&e), NULL;
    PyObject *ret = NULL;
    if (bufs_overlap(&v, &e) || bufs_overlap(&v, &s) || bufs_overlap(&e, &s)) {
        fail("v_nibbles", "V and its planes must not share memory");
    } else {
        Py_BEGIN_ALLOW_THREADS
        if (m)
            kv_nibbles_merge(e.buf, s.buf, v.buf, (size_t)T, (size_t)H, (size_t)D);
        else
            kv_nibbles_split(v.buf, e.buf, s.buf, (size_t)T, (size_t)H, (size_t)D);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&v);
    PyBuffer_Release(&e);
    PyBuffer_Release(&s);
    return ret;
}

PyObject *py_v_nibbles_pairs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *vo, *eo, *so;
    Py_ssize_t T, H, D;
    if (parse(args, "v_nibbles_pairs", "OOOnnn", &vo, &eo, &so, &T, &H, &D)) return NULL;
    if (geometry("v_nibbles_pairs", T, H, D) < 0) return NULL;
    Py_ssize_t n = T * H * D;
    if ((T * D) % 2) return fail("v_nibbles_pairs", "needs an even count of codes a head"), NULL;
    Py_buffer v, e, s;
    if (take_for("v_nibbles_pairs", vo, n, 0, "v", &v) < 0) return NULL;
    if (take_for("v_nibbles_pairs", eo, n / 2, 1, "exp2", &e) < 0) return PyBuffer_Release(&v), NULL;
    if (take_for("v_nibbles_pairs", so, n / 2, 1, "nib", &s) < 0) return PyBuffer_Release(&v), PyBuffer_Release(&e), NULL;
    PyObject *ret = NULL;
    if (bufs_overlap(&v, &e) || bufs_overlap(&v, &s) || bufs_overlap(&e, &s)) {
        fail("v_nibbles_pairs", "V and its planes must not share memory");
    } else {
        Py_BEGIN_ALLOW_THREADS
        kv_nibbles_split_pairs(v.buf, e.buf, s.buf, (size_t)T, (size_t)H, (size_t)D);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&v);
    PyBuffer_Release(&e);
    PyBuffer_Release(&s);
    return ret;
}
