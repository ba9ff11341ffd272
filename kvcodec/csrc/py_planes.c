/* k_planes(k, hi, lo, tokens, heads, dim, merge) -> None: the entry point of planes.c; v_nibbles(v, exp,
 * nib, tokens, heads, dim, merge) -> None and v_nibbles_pairs(v, exp2, nib, tokens, heads, dim) -> None
 * (a split, the exponents two a byte): nibbles.c's. Every buffer C-contiguous bytes of exactly its
 * plane's length (checked), none overlapping another; merge=0 splits into the planes, merge=1 writes
 * from them. The GIL is released around the pass. */
#include "buffers.h"
#include "nibbles.h"
#include "planes.h"

/* One buffer a pass reads or writes: its name (for messages), object, exact length and whether written. */
typedef struct {
    const char *name;
    PyObject *obj;
    Py_ssize_t len;
    int writable;
} Want;

/* The three buffers of a pass, each C-contiguous bytes of exactly its length, writable where it is
 * written, none sharing memory with another (`overlap`: the refusal's message). -1: error raised, none
 * held. */
static int take3(const char *fn, const Want w[3], const char *overlap, Py_buffer b[3]) {
    for (int i = 0; i < 3; i++) {
        int flags = w[i].writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
        int bad = PyObject_GetBuffer(w[i].obj, &b[i], flags) < 0 ? (rethrow(fn), 1) : 0;
        if (!bad && b[i].len != w[i].len) {
            char msg[160];
            snprintf(msg, sizeof msg, "%s is %zd bytes; the geometry needs %zd", w[i].name, b[i].len, w[i].len);
            PyBuffer_Release(&b[i]);
            fail(fn, msg);
            bad = 1;
        }
        if (bad) {
            while (i--) PyBuffer_Release(&b[i]);
            return -1;
        }
    }
    if (bufs_overlap(&b[0], &b[1]) || bufs_overlap(&b[0], &b[2]) || bufs_overlap(&b[1], &b[2])) {
        for (int i = 0; i < 3; i++) PyBuffer_Release(&b[i]);
        return fail(fn, overlap);
    }
    return 0;
}

static PyObject *release3(Py_buffer b[3]) {
    for (int i = 0; i < 3; i++) PyBuffer_Release(&b[i]);
    return Py_NewRef(Py_None);
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
    const Want w[3] = {{"k", ko, 2 * n, m}, {"hi", ho, n, !m}, {"lo", lo_o, n, !m}};
    Py_buffer b[3];
    if (take3("k_planes", w, "K and its planes must not share memory", b) < 0) return NULL;
    KV_BEGIN_WORK(kv_add(kv_add((size_t)b[0].len, (size_t)b[1].len), (size_t)b[2].len))
    if (m)
        kv_planes_merge(b[1].buf, b[2].buf, b[0].buf, (size_t)T, (size_t)(H * D));
    else
        kv_planes_split(b[0].buf, b[1].buf, b[2].buf, (size_t)T, (size_t)(H * D));
    KV_END_WORK
    return release3(b);
}

PyObject *py_v_nibbles(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *vo, *eo, *so;
    Py_ssize_t T, H, D;
    int m;
    if (parse(args, "v_nibbles", "OOOnnnp", &vo, &eo, &so, &T, &H, &D, &m)) return NULL;
    if (geometry("v_nibbles", T, H, D) < 0) return NULL;
    Py_ssize_t n = T * H * D;
    const Want w[3] = {{"v", vo, n, m}, {"exp", eo, n, !m}, {"nib", so, (n + 1) / 2, !m}};
    Py_buffer b[3];
    if (take3("v_nibbles", w, "V and its planes must not share memory", b) < 0) return NULL;
    KV_BEGIN_WORK(kv_add(kv_add((size_t)b[0].len, (size_t)b[1].len), (size_t)b[2].len))
    if (m)
        kv_nibbles_merge(b[1].buf, b[2].buf, b[0].buf, (size_t)T, (size_t)H, (size_t)D);
    else
        kv_nibbles_split(b[0].buf, b[1].buf, b[2].buf, (size_t)T, (size_t)H, (size_t)D);
    KV_END_WORK
    return release3(b);
}

PyObject *py_v_nibbles_pairs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *vo, *eo, *so;
    Py_ssize_t T, H, D;
    if (parse(args, "v_nibbles_pairs", "OOOnnn", &vo, &eo, &so, &T, &H, &D)) return NULL;
    if (geometry("v_nibbles_pairs", T, H, D) < 0) return NULL;
    Py_ssize_t n = T * H * D;
    if ((T * D) % 2) return fail("v_nibbles_pairs", "needs an even count of codes a head"), NULL;
    const Want w[3] = {{"v", vo, n, 0}, {"exp2", eo, n / 2, 1}, {"nib", so, n / 2, 1}};
    Py_buffer b[3];
    if (take3("v_nibbles_pairs", w, "V and its planes must not share memory", b) < 0) return NULL;
    KV_BEGIN_WORK(kv_add(kv_add((size_t)b[0].len, (size_t)b[1].len), (size_t)b[2].len))
    kv_nibbles_split_pairs(b[0].buf, b[1].buf, b[2].buf, (size_t)T, (size_t)H, (size_t)D);
    KV_END_WORK
    return release3(b);
}
