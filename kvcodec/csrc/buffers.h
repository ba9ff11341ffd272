/* The Python side's buffers: every argument checked before any loop runs, so that no argument can make
 * the loops read or write outside the memory the buffers export.
 *
 * Two kinds of refusal. Arguments that cannot be meant (a 2-d buffer, the wrong item size or number of
 * scales, shapes that differ, an unknown code) raise kv_error. Layouts the loops do not take (negative
 * or odd strides, head_dim not contiguous, misaligned elements, an output whose elements share memory
 * or that overlaps an input) return a reason, so that the caller runs the reference. Either way
 * nothing has been read or written yet. */
#ifndef KV_BUFFERS_H
#define KV_BUFFERS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kv.h"

_Static_assert(sizeof(Py_ssize_t) == sizeof(kv_ssize), "Py_ssize_t is kv_ssize's size");

/* The exception class every error is raised as (set_error); a module-own one until then. */
extern PyObject *kv_error;

extern const int DT_SIZE[3];

/* A [T, H, D] array from a buffer: byte strides, the last one the item size. */
typedef struct {
    Py_buffer view;
    int held;
    KvRows r;
    char *lo, *hi; /* the bytes the elements span; lo == hi when empty */
} Arr;

/* A writable [N, H, S, C] cache view from a buffer. */
typedef struct {
    Py_buffer view;
    int held;
    KvCache c;
    char *lo, *hi;
} Cache4;

/* One call's buffers: the input rows, the output rows (same shape) and the scales. */
typedef struct {
    Arr in, out, s;
    kv_ssize ng;     /* scale groups */
    const char *why; /* set: the loops decline this layout */
} Bufs;

/* An optional byte copy that rides along with an encode or decode (K beside V's codes): one GIL release
 * per chunk instead of two. Both buffers C-contiguous, equal lengths. */
typedef struct {
    Py_buffer src, dst;
    int held;
} Copy;

/* bytes: a call whose buffers move fewer (read and written, roughly) keeps the GIL. A release is a hand-over:
 * a Python thread waiting for the GIL takes it, and one that is busy keeps it until its switch interval ends
 * (5 ms by default). Beside a busy thread, a 256 x 4 x 64 blob's decode (two C calls of 15-40 us) spent most
 * of its wall time waiting to get the GIL back (96 blobs: 18 ms of CPU, over a second of wall time); calls
 * this large (~100 us and more) take long enough that work beside them pays for the hand-over, as a
 * caller's thread pool of them does (docs/kernels.md, "Threads"). */
#ifndef KV_GIL_FREE_BYTES /* -DKV_GIL_FREE_BYTES=0: every call releases it, as before (bench/gil_handover.py) */
#define KV_GIL_FREE_BYTES ((size_t)1 << 20)
#endif

static inline size_t kv_add(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }
static inline PyThreadState *kv_release_gil(size_t bytes) {
    return bytes >= KV_GIL_FREE_BYTES ? PyEval_SaveThread() : NULL;
}
/* Py_BEGIN_ALLOW_THREADS / Py_END_ALLOW_THREADS for a call that moves `bytes`: the GIL released only where
 * they are at least KV_GIL_FREE_BYTES. */
#define KV_BEGIN_WORK(bytes) {                                                                              \
        PyThreadState *kv_save_ = kv_release_gil(bytes);
#define KV_END_WORK                                                                                         \
        if (kv_save_) PyEval_RestoreThread(kv_save_);                                                       \
    }

int fail(const char *fn, const char *what);
void rethrow(const char *fn);
int parse(PyObject *args, const char *fn, const char *fmt, ...);
int check_dtype(const char *fn, int dtype);
int check_scope(const char *fn, int scope, Py_ssize_t page);

int get_arr(PyObject *obj, Py_ssize_t itemsize, int writable, const char *fn, const char *name, Arr *a,
            const char **why);
int get_scales(PyObject *obj, Py_ssize_t n, int writable, const char *fn, Arr *a, const char **why);
int overlaps(const Arr *a, const Arr *b);
int take_bufs(const char *fn, PyObject *in, Py_ssize_t in_size, PyObject *out, Py_ssize_t out_size, PyObject *scales,
              int scales_out, int scope, Py_ssize_t page, Bufs *b);
void release_bufs(Bufs *b);
PyObject *result(Bufs *b, const char *why);

int take_copy(const char *fn, PyObject *src, PyObject *dst, Copy *c);
void release_copy(Copy *c);
int bufs_overlap(const Py_buffer *a, const Py_buffer *b);
int copy_overlaps(const Copy *c, const Py_buffer *buf, const Arr *a);
KvCopy copy_of(const Copy *c);

int take_crc(const char *fn, PyObject *obj, int *want, uint32_t *seed);
PyObject *crc_result(Bufs *b, int done, uint32_t state);

int get_cache(PyObject *obj, Py_ssize_t itemsize, const char *fn, Cache4 *c, const char **why);
int take_runs(PyObject *obj, const char *fn, Py_ssize_t T, Py_ssize_t H, Py_ssize_t D, const Cache4 *c,
              Py_ssize_t col, Py_buffer *r);
int cache_overlaps(const Cache4 *c, const Arr *a);

/* ---- module.c, py_codec.c, py_scatter.c: the entry points; each call runs at its receiver's level (the
 * module's default, or a Level object's). */
const KvLevel *level_of(PyObject *self);
PyObject *py_encode_v(PyObject *self, PyObject *args);
PyObject *py_quantize(PyObject *self, PyObject *args);
PyObject *py_dequantize(PyObject *self, PyObject *args);
PyObject *py_scatter_rows(PyObject *self, PyObject *args);
PyObject *py_scatter_dequant(PyObject *self, PyObject *args);
PyObject *py_k_planes(PyObject *self, PyObject *args); /* py_planes.c */
PyObject *py_v_nibbles(PyObject *self, PyObject *args); /* py_planes.c */
PyObject *py_v_nibbles_pairs(PyObject *self, PyObject *args); /* py_planes.c */
PyObject *py_huff_encode(PyObject *self, PyObject *args); /* py_huff.c */
PyObject *py_huff_decode(PyObject *self, PyObject *args);
PyObject *py_huff_encode_many(PyObject *self, PyObject *args);
PyObject *py_huff_encode_pairs_many(PyObject *self, PyObject *args); /* py_huff.c */
PyObject *py_huff_decode_many(PyObject *self, PyObject *args);
PyObject *py_lossless_expand(PyObject *self, PyObject *args); /* py_lossless.c */

#endif
