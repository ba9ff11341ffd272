/* kvcodec._cpu, the module: its entry points' table, the levels they run at, and the small helpers.
 *
 * Every call runs on the calling thread only and releases the GIL around its loops. Arguments are
 * Python buffers (numpy arrays over torch tensors, memoryviews), checked by buffers.c before any loop
 * runs. Every error is raised as the class given to set_error() (kvcodec's UnsupportedConfigError).
 *
 * Levels: the module's functions run at its default level, the CPU's best at import (capped by
 * KVCODEC_CPU_LEVEL, dispatch.c). Level(simd, crc, paged) is an object with the same codec methods
 * bound to one level (capped at the best): a test holds one per level instead of changing the default;
 * Level(..., emulate=1) runs the drivers' folded and table paths with portable rows (fold_emul.c).
 * simd(), crc_fast() and paged() still move the module's default, for the tests and benchmarks that
 * drive the codec through kvcodec.backends.cpu. */
#include "buffers.h"

static KvLevel kv_default;

typedef struct {
    PyObject_HEAD KvLevel lv;
} LevelObject;

static PyTypeObject LevelType;

const KvLevel *level_of(PyObject *self) {
    if (self && PyObject_TypeCheck(self, &LevelType)) return &((LevelObject *)self)->lv;
    return &kv_default;
}


/* empty_bytearray(n): a bytearray of n bytes, not zeroed (the caller writes them all). */
static PyObject *py_empty_bytearray(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t n;
    if (parse(args, "empty_bytearray", "n", &n)) return NULL;
    if (n < 0) {
        fail("empty_bytearray", "negative size");
        return NULL;
    }
    return PyByteArray_FromStringAndSize(NULL, n);
}

/* bytes_to_fill(n) -> (bytes, writable memoryview of its n bytes), uninitialised. For a blob built
 * once and handed out as immutable `bytes` without a final copy. The view does not own the bytes:
 * the caller keeps the bytes object alive while it writes, and drops the view before the bytes
 * object is shared or hashed. */
static PyObject *py_bytes_to_fill(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t n;
    if (parse(args, "bytes_to_fill", "n", &n)) return NULL;
    if (n < 0) {
        fail("bytes_to_fill", "negative size");
        return NULL;
    }
    PyObject *b = PyBytes_FromStringAndSize(NULL, n);
    if (!b) return NULL;
    PyObject *mv = PyMemoryView_FromMemory(PyBytes_AS_STRING(b), n, PyBUF_WRITE);
    if (!mv) {
        Py_DECREF(b);
        return NULL;
    }
    return Py_BuildValue("(NN)", b, mv);
}

/* crc32(data[, value]) -> int: zlib.crc32 of a buffer with the loops the encode and decode fold in
 * (carry-less multiply where the CPU has it, else byte by byte); for tests. */
static PyObject *py_crc32(PyObject *self, PyObject *args) {
    Py_buffer b;
    PyObject *vo = NULL;
    int want;
    uint32_t value = 0;
    if (parse(args, "crc32", "y*|O", &b, &vo)) return NULL;
    if (vo && take_crc("crc32", vo, &want, &value)) return PyBuffer_Release(&b), NULL;
    uint32_t got;
    const KvLevel lv = *level_of(self);
    KV_BEGIN_WORK((size_t)b.len)
    got = kv_crc32(lv.crc, value, b.buf, (size_t)b.len);
    KV_END_WORK
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(got);
}

/* crc_fast(level) -> previous: which folded CRC runs (2: 512-bit VPCLMULQDQ, 1: 128-bit PCLMULQDQ, each
 * where the CPU has it, else the best below; the best is the default; 0: byte by byte, and encode_v /
 * dequantize leave the CRC to the caller; -1 only reads). */
static PyObject *py_crc_fast(PyObject *self, PyObject *args) {
    (void)self;
    int level;
    if (parse(args, "crc_fast", "i", &level)) return NULL;
    int prev = kv_default.crc->level;
    if (level >= 0) kv_default = kv_level(kv_default.rows->level, level, kv_default.paged);
    return PyLong_FromLong(prev);
}

/* paged(on) -> previous: 1 (the default) encodes per_page_head 16-bit V page by page, 0 in two passes
 * over V; -1 only reads. For tests and benchmarks of both ways. */
static PyObject *py_paged(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (parse(args, "paged", "i", &on)) return NULL;
    int prev = kv_default.paged;
    if (on >= 0) kv_default = kv_level(kv_default.rows->level, kv_default.crc->level, on);
    return PyLong_FromLong(prev);
}

/* simd(level) -> previous level. 0: portable C rows; 1: AVX2 + F16C rows; 2: AVX-512 rows; each where the
 * CPU has it (else the best below; the best is the default); -1 only reads. */
static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    int level;
    if (parse(args, "simd", "i", &level)) return NULL;
    int prev = kv_default.rows->level;
    if (level >= 0) kv_default = kv_level(level, kv_default.crc->level, kv_default.paged);
    return PyLong_FromLong(prev);
}

/* set_error(cls): raise every later error as `cls` (an Exception subclass). */
static PyObject *py_set_error(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cls;
    if (parse(args, "set_error", "O", &cls)) return NULL;
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception)) {
        fail("set_error", "expected an Exception subclass");
        return NULL;
    }
    Py_INCREF(cls);
    Py_SETREF(kv_error, cls);
    Py_RETURN_NONE;
}

/* The codec's methods: the module's and every Level's. */
#define CODEC_METHODS                                                                                           \
    {"encode_v", py_encode_v, METH_VARARGS,                                                                     \
     "encode_v(v, v_dtype, scope, page, scale_dtype, q, scales[, copy_src, copy_dst[, crc]]) -> None, CRC or "  \
     "reason: V's scales and e4m3 codes."},                                                                     \
        {"quantize", py_quantize, METH_VARARGS,                                                                 \
         "quantize(v, v_dtype, scales, scope, page, q) -> None or reason: e4m3 codes of V / scale."},           \
        {"dequantize", py_dequantize, METH_VARARGS,                                                             \
         "dequantize(q, scales, scope, page, out, out_dtype[, copy_src, copy_dst[, crc]]) -> None, CRC or "     \
         "reason: float(q) * scale."},                                                                          \
        {"scatter_rows", py_scatter_rows, METH_VARARGS,                                                         \
         "scatter_rows(src, cache, col, runs) -> None or reason: [T, H, D] rows into a [N, H, S, C] cache view."}, \
        {"scatter_dequant", py_scatter_dequant, METH_VARARGS,                                                   \
         "scatter_dequant(q, scales, scope, page, cache, col, out_dtype, runs[, k, k_col[, crc]]) -> None, CRC " \
         "or reason: dequantized rows (and K's rows) into a cache view."},                                      \
        {"crc32", py_crc32, METH_VARARGS,                                                                       \
         "crc32(data[, value]) -> int: zlib's CRC-32, with the loops the codec folds in."},                      \
        {"lossless_expand", py_lossless_expand, METH_VARARGS,                                                   \
         "lossless_expand(payload, k_len, v_len, k_spans, k_raw_at, v_spans, v_raw_at, T, H, D, k_out, v_out, " \
         "plane, crc[, deq]) -> None, ('crc', got), (section, i, code) or reason: a split lossless payload, one " \
         "call (with deq, V's codes dequantized in it)."}

static PyMethodDef methods[] = {
    CODEC_METHODS,
    {"empty_bytearray", py_empty_bytearray, METH_VARARGS, "empty_bytearray(n): an uninitialised bytearray."},
    {"k_planes", py_k_planes, METH_VARARGS,
     "k_planes(k, hi, lo, tokens, heads, dim, merge): 16-bit K's byte planes split (merge=0) or merged."},
    {"v_nibbles", py_v_nibbles, METH_VARARGS,
     "v_nibbles(v, exp, nib, tokens, heads, dim, merge): V's codes split into exponents and sign + mantissa "
     "nibbles (merge=0) or merged."},
    {"v_nibbles_pairs", py_v_nibbles_pairs, METH_VARARGS,
     "v_nibbles_pairs(v, exp2, nib, tokens, heads, dim): v_nibbles' split, each head's exponents two a byte."},
    {"huff_encode_pairs_many", py_huff_encode_pairs_many, METH_VARARGS,
     "huff_encode_pairs_many(src, at, step, count, n, out, out_at) -> [length, ...]: streams of n symbols "
     "below 16 given two a byte."},
    {"huff_encode", py_huff_encode, METH_VARARGS,
     "huff_encode(src, at, n, row, stride, out, out_at) -> bytes written or -1: one Huffman stream."},
    {"huff_decode", py_huff_decode, METH_VARARGS,
     "huff_decode(src, at, length, n, out, out_at, row, stride) -> 0 or a refusal code: one Huffman stream."},
    {"huff_encode_many", py_huff_encode_many, METH_VARARGS,
     "huff_encode_many(src, at, step, count, n, row, stride, out, out_at) -> [length, ...]: a section's streams."},
    {"huff_decode_many", py_huff_decode_many, METH_VARARGS,
     "huff_decode_many(src, streams, n, out, out_at, out_step, row, stride) -> None or (i, code): a section's "
     "streams."},
    {"bytes_to_fill", py_bytes_to_fill, METH_VARARGS, "bytes_to_fill(n): (bytes, its writable view), uninitialised."},
    {"crc_fast", py_crc_fast, METH_VARARGS,
     "crc_fast(level) -> previous: 2 folded on 512-bit registers, 1 on 128-bit lanes, 0 off, -1 read only."},
    {"paged", py_paged, METH_VARARGS,
     "paged(on) -> previous: 1 encodes per_page_head 16-bit V a page at a time (scales, then codes), 0 in two "
     "passes over V; -1 read only."},
    {"simd", py_simd, METH_VARARGS, "simd(level) -> previous: 0 portable, 1 AVX2 + F16C, 2 AVX-512, -1 read only."},
    {"set_error", py_set_error, METH_VARARGS, "set_error(cls): the exception class of every error."},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------ Level */

static PyMethodDef level_methods[] = {CODEC_METHODS, {NULL, NULL, 0, NULL}};

static PyObject *level_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"simd", "crc", "paged", "emulate", NULL};
    int simd = 2, crc = 2, paged = 1, emulate = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|iiii:Level", names, &simd, &crc, &paged, &emulate)) return NULL;
    LevelObject *self = (LevelObject *)type->tp_alloc(type, 0);
    if (self) self->lv = emulate ? kv_level_emulated(simd, crc, paged) : kv_level(simd, crc, paged);
    return (PyObject *)self;
}

static PyObject *level_get(PyObject *self, void *which) {
    const KvLevel *lv = &((LevelObject *)self)->lv;
    intptr_t w = (intptr_t)which;
    return PyLong_FromLong(w == 0 ? lv->rows->level : w == 1 ? lv->crc->level : lv->paged);
}

static PyGetSetDef level_getset[] = {
    {"simd", level_get, NULL, "the row level: 0 portable, 1 AVX2 + F16C, 2 AVX-512", (void *)0},
    {"crc", level_get, NULL, "the CRC folding: 0 byte by byte, 1 PCLMULQDQ, 2 VPCLMULQDQ", (void *)1},
    {"paged", level_get, NULL, "1: per_page_head 16-bit V encoded page by page", (void *)2},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LevelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcodec._cpu.Level",
    .tp_basicsize = sizeof(LevelObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Level(simd=2, crc=2, paged=1, emulate=0): the codec's methods at one level (each capped at the CPU's "
              "best); emulate=1: the AVX-512 folds and tables in portable C (tests of the drivers' paths).",
    .tp_new = level_new,
    .tp_methods = level_methods,
    .tp_getset = level_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvcodec._cpu",
                                    "The codec's FP8 row loops in C (see kvcodec.backends.cpu).", -1, methods};

static int add_constants(PyObject *m) {
    if (!kv_error) kv_error = PyErr_NewException("kvcodec._cpu.KernelError", NULL, NULL);
    if (!kv_error || PyModule_AddObjectRef(m, "KernelError", kv_error) < 0) return -1;
    if (PyModule_AddObjectRef(m, "Level", (PyObject *)&LevelType) < 0) return -1;
    if (PyModule_AddIntConstant(m, "BEST_SIMD", kv_best_simd()) < 0 ||
        PyModule_AddIntConstant(m, "BEST_CRC", kv_best_crc()) < 0)
        return -1;
    return PyModule_AddIntConstant(m, "FP16", DT_F16) < 0 || PyModule_AddIntConstant(m, "BF16", DT_BF16) < 0 ||
                   PyModule_AddIntConstant(m, "FP32", DT_F32) < 0
               ? -1
               : 0;
}

PyMODINIT_FUNC PyInit__cpu(void) {
    kv_dispatch_init();
    kv_default = kv_level(kv_best_simd(), kv_best_crc(), 1);
    if (PyType_Ready(&LevelType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (add_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
