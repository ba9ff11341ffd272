/* The entry points of huff.c. Symbol j of a stream lies at buffer offset at + (j / row) * stride + j % row
 * (n a multiple of row, row <= stride): a head's V codes in a [tokens, heads, head_dim] payload, or a
 * contiguous plane (row = stride = n). Every span is checked against its buffer before the GIL is
 * released; source and destination must not share memory.
 *
 * huff_encode(src, at, n, row, stride, out, out_at) -> bytes written at out[out_at:], or -1 when they
 * do not fit (nothing promised about out[out_at:] then).
 * huff_decode(src, at, length, n, out, out_at, row, stride) -> 0, or huff.h's refusal code for the stream
 * src[at : at + length]. */
#include "buffers.h"
#include "huff.h"

/* Whether n symbols from `at` at (row, stride) fit a buffer of `len` bytes. */
static int span_ok(Py_ssize_t len, Py_ssize_t at, Py_ssize_t n, Py_ssize_t row, Py_ssize_t stride) {
    if (at < 0 || at > len) return 0;
    if (!n) return 1;
    Py_ssize_t rows = n / row, span;
    if (__builtin_mul_overflow(rows - 1, stride, &span) || __builtin_add_overflow(span, row, &span)) return 0;
    return span <= len - at;
}

static int check_rows(const char *fn, Py_ssize_t n, Py_ssize_t row, Py_ssize_t stride) {
    if (n < 0 || row < 1 || stride < row || n % row)
        return fail(fn, "need n >= 0, 1 <= row <= stride and n a multiple of row");
    return 0;
}

/* A span's bytes [lo, lo + len) against another buffer's. */
static int spans_overlap(const char *a, Py_ssize_t na, const char *b, Py_ssize_t nb) {
    return na && nb && a < b + nb && b < a + na;
}

/* streams x n bytes where the rows are strided (NULL otherwise, or when the size overflows: the caller
 * reports no memory). */
static uint8_t *scratch_for(Py_ssize_t n, Py_ssize_t row, Py_ssize_t stride, size_t streams) {
    size_t bytes;
    if (row >= stride || !n || __builtin_mul_overflow(streams, (size_t)n, &bytes)) return NULL;
    return PyMem_RawMalloc(bytes);
}

PyObject *py_huff_encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *so, *oo;
    Py_ssize_t at, n, row, stride, out_at;
    if (parse(args, "huff_encode", "OnnnnOn", &so, &at, &n, &row, &stride, &oo, &out_at)) return NULL;
    if (check_rows("huff_encode", n, row, stride) < 0) return NULL;
    Py_buffer s, o;
    if (PyObject_GetBuffer(so, &s, PyBUF_C_CONTIGUOUS) < 0) return rethrow("huff_encode"), NULL;
    if (PyObject_GetBuffer(oo, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return PyBuffer_Release(&s), rethrow("huff_encode"), NULL;
    PyObject *ret = NULL;
    if (!span_ok(s.len, at, n, row, stride) || out_at < 0 || out_at > o.len) {
        fail("huff_encode", "the symbols or the output's offset lie outside their buffers");
    } else if (bufs_overlap(&s, &o)) {
        fail("huff_encode", "the symbols and the output must not share memory");
    } else {
        uint8_t *scratch = scratch_for(n, row, stride, 1);
        if (row < stride && n && !scratch) {
            PyErr_NoMemory();
        } else {
            ptrdiff_t got;
            KV_BEGIN_WORK(2 * (size_t)n)
            got = huff_encode((const uint8_t *)s.buf + at, (size_t)n, (size_t)row, (size_t)stride,
                              (uint8_t *)o.buf + out_at, (size_t)(o.len - out_at), scratch);
            KV_END_WORK
            PyMem_RawFree(scratch);
            ret = PyLong_FromSsize_t((Py_ssize_t)got);
        }
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&o);
    return ret;
}

PyObject *py_huff_decode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *so, *oo;
    Py_ssize_t at, length, n, out_at, row, stride;
    if (parse(args, "huff_decode", "OnnnOnnn", &so, &at, &length, &n, &oo, &out_at, &row, &stride)) return NULL;
    if (check_rows("huff_decode", n, row, stride) < 0) return NULL;
    Py_buffer s, o;
    if (PyObject_GetBuffer(so, &s, PyBUF_C_CONTIGUOUS) < 0) return rethrow("huff_decode"), NULL;
    if (PyObject_GetBuffer(oo, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return PyBuffer_Release(&s), rethrow("huff_decode"), NULL;
    PyObject *ret = NULL;
    if (at < 0 || length < 0 || at > s.len || length > s.len - at || !span_ok(o.len, out_at, n, row, stride)) {
        fail("huff_decode", "the stream or the symbols' places lie outside their buffers");
    } else if (spans_overlap((const char *)s.buf + at, length, o.buf, o.len)) {
        fail("huff_decode", "the stream and the output must not share memory");
    } else {
        uint8_t *scratch = scratch_for(n, row, stride, 1);
        if (row < stride && n && !scratch) {
            PyErr_NoMemory();
        } else {
            int err;
            KV_BEGIN_WORK(kv_add((size_t)n, (size_t)length))
            err = huff_decode((const uint8_t *)s.buf + at, (size_t)length, (size_t)n, (uint8_t *)o.buf + out_at,
                              (size_t)row, (size_t)stride, scratch);
            KV_END_WORK
            PyMem_RawFree(scratch);
            ret = PyLong_FromLong(err);
        }
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&o);
    return ret;
}

/* `count` streams of n symbols each, stream i's from src offset at + i * step, coded one after another
 * from out[out_at:] by huff_encode_section (a section's shared lengths where they cost little): at (row,
 * stride), or with `pairs` from n / 2 contiguous bytes. Their lengths as a list; raises when a span lies
 * outside its buffer or they do not fit. The one body of huff_encode_many and huff_encode_pairs_many. */
typedef struct {
    Py_ssize_t at, step, count, n, row, stride, out_at;
    int pairs;
} Many;

static PyObject *encode_many(const char *fn, PyObject *so, PyObject *oo, Many m) {
    if (m.count < 0 || m.step < 0 || m.count > (1 << 24)) return fail(fn, "need 0 <= count <= 2^24 and step >= 0"), NULL;
    Py_buffer s, o;
    if (PyObject_GetBuffer(so, &s, PyBUF_C_CONTIGUOUS) < 0) return rethrow(fn), NULL;
    if (PyObject_GetBuffer(oo, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return PyBuffer_Release(&s), rethrow(fn), NULL;
    PyObject *ret = NULL;
    Py_ssize_t last, bytes = m.pairs ? m.n / 2 : m.n; /* a stream's symbol bytes */
    if (m.out_at < 0 || m.out_at > o.len || !span_ok(s.len, m.at, bytes, m.row, m.stride) ||
        (m.count && (__builtin_mul_overflow(m.count - 1, m.step, &last) || __builtin_add_overflow(last, m.at, &last) ||
                     !span_ok(s.len, last, bytes, m.row, m.stride)))) {
        fail(fn, "the symbols or the output's offset lie outside their buffers");
    } else if (bufs_overlap(&s, &o)) {
        fail(fn, "the symbols and the output must not share memory");
    } else if (m.count > (o.len - m.out_at) / HUFF_HEAD_BYTES) { /* before any work is sized by the count */
        fail(fn, "the streams do not fit the output");
    } else {
        size_t count = (size_t)m.count;
        uint8_t *scratch = m.pairs ? NULL : scratch_for(m.n, m.row, m.stride, count ? count : 1);
        size_t *lens = PyMem_RawMalloc((count ? count : 1) * sizeof *lens);
        size_t work_bytes = huff_section_work(count ? count : 1, m.pairs);
        void *work = work_bytes ? PyMem_RawMalloc(work_bytes) : NULL;
        if ((!m.pairs && m.row < m.stride && m.n && !scratch) || !lens || !work) {
            PyErr_NoMemory();
        } else {
            HuffSection sec = {(const uint8_t *)s.buf + m.at, (size_t)m.step, count, (size_t)m.n,
                               (size_t)m.row, (size_t)m.stride, m.pairs};
            ptrdiff_t got;
            KV_BEGIN_WORK(2 * (size_t)bytes * count)
            got = huff_encode_section(&sec, (uint8_t *)o.buf + m.out_at, (size_t)(o.len - m.out_at), lens, work, scratch);
            KV_END_WORK
            if (got < 0) {
                fail(fn, "the streams do not fit the output");
            } else if ((ret = PyList_New(m.count))) {
                for (Py_ssize_t i = 0; i < m.count; i++) PyList_SET_ITEM(ret, i, PyLong_FromSize_t(lens[i]));
            }
        }
        PyMem_RawFree(scratch);
        PyMem_RawFree(lens);
        PyMem_RawFree(work);
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&o);
    return ret;
}

/* huff_encode_many(src, at, step, count, n, row, stride, out, out_at) -> [length, ...]: `count` streams,
 * stream i of the n symbols from src offset at + i * step (each at row, stride), written one after
 * another from out[out_at:]; raises when they do not fit. One call for a section's heads. */
PyObject *py_huff_encode_many(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *so, *oo;
    Many m = {.pairs = 0};
    if (parse(args, "huff_encode_many", "OnnnnnnOn", &so, &m.at, &m.step, &m.count, &m.n, &m.row, &m.stride, &oo,
              &m.out_at))
        return NULL;
    if (check_rows("huff_encode_many", m.n, m.row, m.stride) < 0) return NULL;
    return encode_many("huff_encode_many", so, oo, m);
}

/* huff_encode_pairs_many(src, at, step, count, n, out, out_at) -> [length, ...]: huff_encode_many of
 * `count` streams of n symbols below 16 (n a multiple of 8), stream i's given two a byte in the n / 2
 * bytes from src offset at + i * step (huff_encode_pairs: the same bytes, coded two at a time). */
PyObject *py_huff_encode_pairs_many(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *so, *oo;
    Many m = {.pairs = 1};
    if (parse(args, "huff_encode_pairs_many", "OnnnnOn", &so, &m.at, &m.step, &m.count, &m.n, &oo, &m.out_at))
        return NULL;
    if (m.n < 0 || m.n % 8) return fail("huff_encode_pairs_many", "need n >= 0 a multiple of 8"), NULL;
    m.row = m.stride = m.n ? m.n / 2 : 1; /* contiguous bytes */
    return encode_many("huff_encode_pairs_many", so, oo, m);
}

/* huff_decode_many(src, streams, n, out, out_at, out_step, row, stride) -> None or (i, code): each
 * (at, length) of `streams` (a sequence) decoded to n symbols written from out offset out_at + i * out_step
 * (at row, stride); the first refusal stops it. One call for a section's heads. */
PyObject *py_huff_decode_many(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *so, *lo, *oo;
    Py_ssize_t n, out_at, out_step, row, stride, last;
    if (parse(args, "huff_decode_many", "OOnOnnnn", &so, &lo, &n, &oo, &out_at, &out_step, &row, &stride)) return NULL;
    if (check_rows("huff_decode_many", n, row, stride) < 0) return NULL;
    PyObject *seq = PySequence_Fast(lo, "huff_decode_many: streams must be a sequence of (offset, length)");
    if (!seq) return rethrow("huff_decode_many"), NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t *span = PyMem_RawMalloc((size_t)(count ? 2 * count : 1) * sizeof *span);
    if (!span) return Py_DECREF(seq), PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 ||
            (span[2 * i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0))) == -1 ||
            (span[2 * i + 1] = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1))) == -1) {
            if (PyErr_Occurred()) PyErr_Clear();
            Py_DECREF(seq);
            PyMem_RawFree(span);
            return fail("huff_decode_many", "each stream must be a tuple (offset >= 0, length >= 0)"), NULL;
        }
    }
    Py_DECREF(seq);
    Py_buffer s, o;
    if (PyObject_GetBuffer(so, &s, PyBUF_C_CONTIGUOUS) < 0) return PyMem_RawFree(span), rethrow("huff_decode_many"), NULL;
    if (PyObject_GetBuffer(oo, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return PyMem_RawFree(span), PyBuffer_Release(&s), rethrow("huff_decode_many"), NULL;
    PyObject *ret = NULL;
    int ok = out_step >= 0 && span_ok(o.len, out_at, n, row, stride) &&
             (!count || (!__builtin_mul_overflow(count - 1, out_step, &last) &&
                         !__builtin_add_overflow(last, out_at, &last) && span_ok(o.len, last, n, row, stride)));
    for (Py_ssize_t i = 0; ok && i < count; i++) {
        Py_ssize_t a = span[2 * i], l = span[2 * i + 1];
        ok = a >= 0 && l >= 0 && a <= s.len && l <= s.len - a &&
             !spans_overlap((const char *)s.buf + a, l, o.buf, o.len);
    }
    if (!ok) {
        fail("huff_decode_many", "a stream or the symbols' places lie outside their buffers, or overlap");
    } else {
        uint8_t *scratch = scratch_for(n, row, stride, 2); /* two streams at a time */
        if (row < stride && n && !scratch) {
            PyErr_NoMemory();
        } else {
            int err;
            size_t failed = 0;
            KV_BEGIN_WORK(2 * (size_t)n * (size_t)count)
            err = huff_decode_many((const uint8_t *)s.buf, (const size_t *)span, (size_t)count, (size_t)n,
                                   (uint8_t *)o.buf + out_at, (size_t)out_step, (size_t)row, (size_t)stride, scratch,
                                   &failed);
            KV_END_WORK
            Py_ssize_t i = (Py_ssize_t)failed;
            ret = err ? Py_BuildValue("(ni)", i, err) : Py_NewRef(Py_None);
        }
        PyMem_RawFree(scratch);
    }
    PyMem_RawFree(span);
    PyBuffer_Release(&s);
    PyBuffer_Release(&o);
    return ret;
}
