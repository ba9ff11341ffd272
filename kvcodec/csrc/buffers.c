/* The Python side's buffer checks (buffers.h). */
#include "buffers.h"

#include "kv_layout.h"

PyObject *kv_error = NULL;
const int DT_SIZE[3] = {2, 2, 4};

int fail(const char *fn, const char *what) {
    PyErr_Format(kv_error, "kvcodec._cpu.%s: %s", fn, what);
    return -1;
}

/* Re-raise the pending error (a TypeError from argument parsing, a BufferError...) as kv_error. */
void rethrow(const char *fn) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *msg = value ? PyObject_Str(value) : NULL;
    if (msg) {
        PyErr_Format(kv_error, "kvcodec._cpu.%s: %U", fn, msg);
        Py_DECREF(msg);
    } else {
        PyErr_Clear();
        PyErr_Format(kv_error, "kvcodec._cpu.%s: bad argument", fn);
    }
    if (value) {
        PyObject *t2, *v2, *tb2;
        PyErr_Fetch(&t2, &v2, &tb2);
        PyErr_NormalizeException(&t2, &v2, &tb2);
        PyException_SetCause(v2, value); /* steals value */
        PyErr_Restore(t2, v2, tb2);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
}

/* Bytes spanned by the elements (non-negative strides): 1 + sum((n_i - 1) * stride_i)
 * item sizes; 0 when empty, -1 on overflow. */
static Py_ssize_t span_of(int nd, const Py_ssize_t *shape, const Py_ssize_t *strides, Py_ssize_t itemsize) {
    Py_ssize_t span = itemsize;
    for (int i = 0; i < nd; i++) {
        if (shape[i] == 0) return 0;
        Py_ssize_t step;
        if (__builtin_mul_overflow(shape[i] - 1, strides[i], &step) || __builtin_add_overflow(span, step, &span))
            return -1;
    }
    return span;
}

/* Whether no two elements share a byte: the dimensions of extent > 1, by
 * increasing stride, each step past the whole of the previous one. */
static int no_self_overlap(int nd, const Py_ssize_t *shape, const Py_ssize_t *strides, Py_ssize_t itemsize) {
    Py_ssize_t n[4], s[4];
    int k = 0;
    for (int i = 0; i < nd; i++)
        if (shape[i] > 1) {
            int j = k++;
            while (j > 0 && s[j - 1] > strides[i]) {
                n[j] = n[j - 1];
                s[j] = s[j - 1];
                j--;
            }
            n[j] = shape[i];
            s[j] = strides[i];
        }
    Py_ssize_t need = itemsize;
    for (int i = 0; i < k; i++) {
        if (s[i] < need) return 0;
        if (__builtin_mul_overflow(s[i], n[i], &need)) return 1; /* nothing further can be closer */
    }
    return 1;
}

/* Take a [T, H, D] buffer of `itemsize`-byte elements into `a`. -1: error raised;
 * 0: taken, with *why set when the loops cannot take its layout. */
int get_arr(PyObject *obj, Py_ssize_t itemsize, int writable, const char *fn, const char *name, Arr *a,
                   const char **why) {
    if (PyObject_GetBuffer(obj, &a->view, writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO) < 0) {
        rethrow(fn);
        return -1;
    }
    a->held = 1;
    Py_buffer *v = &a->view;
    char msg[120];
    if (v->ndim != 3 || !v->shape || !v->strides) {
        snprintf(msg, sizeof msg, "%s must be a 3-d [tokens, heads, head_dim] buffer", name);
        return fail(fn, msg);
    }
    if (v->itemsize != itemsize) {
        snprintf(msg, sizeof msg, "%s has %zd-byte elements; expected %zd", name, v->itemsize, itemsize);
        return fail(fn, msg);
    }
    a->r.base = a->lo = a->hi = (char *)v->buf;
    a->r.T = v->shape[0];
    a->r.H = v->shape[1];
    a->r.D = v->shape[2];
    a->r.st = v->strides[0];
    a->r.sh = v->strides[1];
    a->r.item = itemsize;
    const char *w = NULL;
    for (int i = 0; i < 3; i++)
        if (v->strides[i] < 0 || v->strides[i] % itemsize) w = "a buffer has a negative stride or one not a multiple of its item size";
    if (!w) {
        Py_ssize_t span = span_of(3, v->shape, v->strides, itemsize);
        if (span < 0 || (uintptr_t)v->buf > UINTPTR_MAX - (uintptr_t)span) {
            snprintf(msg, sizeof msg, "%s: extents times strides overflow", name);
            return fail(fn, msg);
        }
        a->hi = a->lo + span;
        if (a->r.D > 1 && v->strides[2] != itemsize)
            w = "a buffer's head_dim is not contiguous";
        else if ((uintptr_t)v->buf % (uintptr_t)itemsize)
            w = "a buffer is not aligned to its elements";
        else if (writable && !no_self_overlap(3, v->shape, v->strides, itemsize))
            w = "an output has elements sharing memory";
    }
    if (!*why) *why = w;
    return 0;
}

/* Take a C-contiguous buffer of exactly n fp32 values into `a` (-1: error raised). */
int get_scales(PyObject *obj, Py_ssize_t n, int writable, const char *fn, Arr *a, const char **why) {
    if (PyObject_GetBuffer(obj, &a->view, writable ? (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) : PyBUF_C_CONTIGUOUS) <
        0) {
        rethrow(fn);
        return -1;
    }
    a->held = 1;
    Py_ssize_t want;
    if (__builtin_mul_overflow(n, (Py_ssize_t)4, &want) || a->view.len != want) {
        char msg[120];
        snprintf(msg, sizeof msg, "scales hold %zd bytes; the scope needs %zd fp32 values", a->view.len, n);
        return fail(fn, msg);
    }
    a->r.base = a->lo = (char *)a->view.buf;
    a->r.item = 4;
    a->hi = a->lo + want;
    if (!*why && (uintptr_t)a->view.buf % 4) *why = "scales are not aligned to 4 bytes";
    return 0;
}

int overlaps(const Arr *a, const Arr *b) { return a->lo < b->hi && b->lo < a->hi; }

int check_dtype(const char *fn, int dtype) {
    return dtype < DT_F16 || dtype > DT_F32 ? fail(fn, "dtype code must be 0 (fp16), 1 (bf16) or 2 (fp32)") : 0;
}

int check_scope(const char *fn, int scope, Py_ssize_t page) {
    if (scope < SC_TENSOR || scope > SC_PAGE_HEAD)
        return fail(fn, "scope code must be 0 (per_tensor), 1 (per_layer_head) or 2 (per_page_head)");
    return page < 1 ? fail(fn, "page size must be >= 1") : 0;
}

/* Parse with PyArg_VaParse, re-raising a parse error as kv_error. */
int parse(PyObject *args, const char *fn, const char *fmt, ...) {
    va_list va;
    va_start(va, fmt);
    int ok = PyArg_VaParse(args, fmt, va);
    va_end(va);
    if (!ok) rethrow(fn);
    return ok ? 0 : -1;
}


void release_bufs(Bufs *b) {
    if (b->in.held) PyBuffer_Release(&b->in.view);
    if (b->out.held) PyBuffer_Release(&b->out.view);
    if (b->s.held) PyBuffer_Release(&b->s.view);
}

/* Take and check a call's three buffers (scales written when `scales_out`). -1: error raised
 * (buffers released); 0: taken, b->why set when the loops decline the layout. */
int take_bufs(const char *fn, PyObject *in, Py_ssize_t in_size, PyObject *out, Py_ssize_t out_size,
                     PyObject *scales, int scales_out, int scope, Py_ssize_t page, Bufs *b) {
    memset(b, 0, sizeof(*b));
    if (get_arr(in, in_size, 0, fn, "the input", &b->in, &b->why) < 0 ||
        get_arr(out, out_size, 1, fn, "the output", &b->out, &b->why) < 0)
        goto error;
    if (b->in.r.T != b->out.r.T || b->in.r.H != b->out.r.H || b->in.r.D != b->out.r.D) {
        fail(fn, "the output's shape differs from the input's");
        goto error;
    }
    b->ng = groups_of(b->in.r.T, b->in.r.H, scope, page);
    if (b->ng < 0) {
        fail(fn, "too many scale groups");
        goto error;
    }
    if (get_scales(scales, b->ng, scales_out, fn, &b->s, &b->why) < 0) goto error;
    if (!b->why && (overlaps(&b->out, &b->in) || overlaps(&b->out, &b->s) || (scales_out && overlaps(&b->s, &b->in))))
        b->why = "an output overlaps an input or another output";
    return 0;
error:
    release_bufs(b);
    return -1;
}

/* None when the loops ran, else the reason they did not (see take_bufs and the loops). */
PyObject *result(Bufs *b, const char *why) {
    release_bufs(b);
    return why ? PyUnicode_FromString(why) : Py_NewRef(Py_None);
}

/* ------------------------------------------------------------- encode_v */

void release_copy(Copy *c) {
    if (c->held) {
        PyBuffer_Release(&c->src);
        PyBuffer_Release(&c->dst);
    }
}

int take_copy(const char *fn, PyObject *src, PyObject *dst, Copy *c) {
    memset(c, 0, sizeof(*c));
    if (src == Py_None && dst == Py_None) return 0;
    if (PyObject_GetBuffer(src, &c->src, PyBUF_C_CONTIGUOUS) < 0) return rethrow(fn), -1;
    if (PyObject_GetBuffer(dst, &c->dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&c->src);
        return rethrow(fn), -1;
    }
    c->held = 1;
    if (c->src.len != c->dst.len) return fail(fn, "the copy's source and destination differ in length"), release_copy(c), -1;
    return 0; /* they may overlap (K re-encoded into the blob it was decoded from): the copy is a memmove */
}

/* Whether two buffers share a byte. */
int bufs_overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *a0 = a->buf, *b0 = b->buf;
    return a->len && b->len && a0 < b0 + b->len && b0 < a0 + a->len;
}

/* Whether the copy's `buf` (its source or destination) shares bytes with array `a`. */
int copy_overlaps(const Copy *c, const Py_buffer *buf, const Arr *a) {
    if (!c->held || !buf->len || !a->held) return 0;
    const char *b0 = buf->buf, *a0 = a->lo;
    return b0 < a->hi && a0 < b0 + buf->len;
}

/* Take an optional CRC seed: Py_None (no CRC wanted: *want = 0) or an int 0 .. 2^32 - 1. -1: error raised. */
int take_crc(const char *fn, PyObject *obj, int *want, uint32_t *seed) {
    *want = 0;
    if (obj == Py_None) return 0;
    unsigned long long v = PyLong_Check(obj) ? PyLong_AsUnsignedLongLong(obj) : (unsigned long long)-1;
    if (PyErr_Occurred()) PyErr_Clear();
    if (!PyLong_Check(obj) || v > 0xFFFFFFFFull) return fail(fn, "the CRC seed must be None or an int in 0 .. 2**32 - 1");
    *want = 1;
    *seed = (uint32_t)v;
    return 0;
}

/* What an encode or decode with a CRC seed returns: the CRC continued over the payload bytes it
 * went through when it could fold it in (`done`), else None (the caller computes it). */
PyObject *crc_result(Bufs *b, int done, uint32_t state) {
    release_bufs(b);
    return done ? PyLong_FromUnsignedLong(~state & 0xFFFFFFFFu) : Py_NewRef(Py_None);
}

/* Take a writable [N, H, S, C] buffer of `itemsize`-byte elements. -1: error raised; 0: taken, *why
 * set when the loops cannot take its layout. */
int get_cache(PyObject *obj, Py_ssize_t itemsize, const char *fn, Cache4 *c, const char **why) {
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_RECORDS) < 0) return rethrow(fn), -1;
    c->held = 1;
    Py_buffer *v = &c->view;
    if (v->ndim != 4 || !v->shape || !v->strides) return fail(fn, "the cache must be a 4-d [blocks, heads, slots, width] buffer");
    if (v->itemsize != itemsize) return fail(fn, "the cache's item size is not the rows'");
    c->c.base = c->lo = c->hi = (char *)v->buf;
    c->c.N = v->shape[0];
    c->c.H = v->shape[1];
    c->c.S = v->shape[2];
    c->c.C = v->shape[3];
    c->c.sn = v->strides[0];
    c->c.sh = v->strides[1];
    c->c.ss = v->strides[2];
    c->c.item = itemsize;
    const char *w = NULL;
    for (int i = 0; i < 4; i++)
        if (v->strides[i] < 0 || v->strides[i] % itemsize) w = "the cache has a negative stride or one not a multiple of its item size";
    if (!w) {
        Py_ssize_t span = span_of(4, v->shape, v->strides, itemsize);
        if (span < 0 || (uintptr_t)v->buf > UINTPTR_MAX - (uintptr_t)span) return fail(fn, "the cache's extents times strides overflow");
        c->hi = c->lo + span;
        if (c->c.C > 1 && v->strides[3] != itemsize)
            w = "the cache's width is not contiguous";
        else if ((uintptr_t)v->buf % (uintptr_t)itemsize)
            w = "the cache is not aligned to its elements";
        else if (!no_self_overlap(4, v->shape, v->strides, itemsize))
            w = "the cache has elements sharing memory";
    }
    if (!*why) *why = w;
    return 0;
}

/* Take the runs (C-contiguous int64, a multiple of 4 values) and check each against the source rows
 * `src` and the cache, and the columns col .. col + D against the cache's width. -1: error raised. */
int take_runs(PyObject *obj, const char *fn, Py_ssize_t T, Py_ssize_t H, Py_ssize_t D, const Cache4 *c,
                     Py_ssize_t col, Py_buffer *r) {
    if (PyObject_GetBuffer(obj, r, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return rethrow(fn), -1;
    const char *f = r->format ? r->format : "B";
    int i64 = r->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0 || strcmp(f, "<q") == 0 || strcmp(f, "=q") == 0);
    if (!i64 || r->len % 32) return PyBuffer_Release(r), fail(fn, "runs must be int64 quadruples (block, slot, token, count)");
    if (H != c->c.H) return PyBuffer_Release(r), fail(fn, "the rows' heads are not the cache's");
    if (col < 0 || D > c->c.C || col > c->c.C - D) return PyBuffer_Release(r), fail(fn, "the columns do not fit the cache's width");
    const int64_t *q = (const int64_t *)r->buf;
    for (Py_ssize_t i = 0; i < r->len / 8; i += 4) {
        int64_t b = q[i], s = q[i + 1], t = q[i + 2], n = q[i + 3];
        if (b < 0 || b >= c->c.N || s < 0 || t < 0 || n < 0 || n > c->c.S - s || n > T - t)
            return PyBuffer_Release(r), fail(fn, "a run lies outside the cache or the rows");
    }
    return 0;
}

int cache_overlaps(const Cache4 *c, const Arr *a) { return a->held && a->lo < a->hi && c->lo < a->hi && a->lo < c->hi; }

/* The copy as the drivers take it (n == 0: none). */
KvCopy copy_of(const Copy *c) {
    KvCopy k = {NULL, NULL, 0};
    if (c->held) k = (KvCopy){c->dst.buf, c->src.buf, (size_t)c->src.len};
    return k;
}
