/* The lossless payload's Huffman streams (docs/FORMAT.md, "Huffman stream"): order-0 canonical Huffman
 * over byte symbols, code lengths limited to 11 bits, the n symbols cut in four lanes coded as four
 * independent LSB-first bit streams, so that the decoder runs four dependency chains at once on one core
 * (huff0's design). kvcodec/codec/huffman.py is the same coder in Python: the fallback and the oracle;
 * both write the same bytes and refuse with the same code.
 *
 * Encoding a section's streams: each one's symbols counted per lane, the section's shared lengths taken
 * where they cost little (huff.h, HUFF_SHARE_SLACK), then each lane packed LSB first through 64-bit bit
 * buffers, two lanes side by side; byte symbols two a lookup where they are few (WIDE).
 *
 * Decoding: one 2^11-entry table of uint16 (length | symbol << 8; 0 where no code lands). Where the
 * table is complete (no holes: every table a Huffman encoder writes but one of a single symbol), the
 * four lanes run side by side with no check per symbol: a round loads 8 bytes at each lane's bit
 * position and makes four lookups per lane (of one symbol each, or of runs of up to three where the
 * codes are short, up to five where the shortest has 2 bits); then each lane's tail, one symbol at a
 * time with every check, in lane order. An incomplete table takes that careful loop throughout. Either
 * way the code returned is the first failure in lane order (within a lane, the first symbol that
 * fails), as kvcodec/codec/huffman.py's. */
#include "huff.h"

#include "kv.h"

#include <stdlib.h>
#include <string.h>

#define TABLE_SIZE (1u << HUFF_MAX_LEN)
#define TABLE_MASK (TABLE_SIZE - 1)
/* A table entry: code length | symbol << 8, so that the bit buffer shifts by the entry itself (the
 * length is its low 6 bits; x86's shifts take those alone). 0: a hole, no code lands there. */
#define ENTRY_LEN(e) ((e) & 15u)
#define ENTRY_SYM(e) ((uint8_t)((e) >> 8))
#ifndef PAIR_MEAN
/* bits: the mean code length up to which the decoder looks up runs of symbols (measured: K's exponents,
 * ~3 bits, decode 1.3x faster; V's codes, ~6.5 bits, no faster) */
#define PAIR_MEAN 5
#endif

#if defined(__GNUC__)
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define LIKELY(x) (x)
#define UNLIKELY(x) (x)
#endif

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void store64(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

/* 4 bytes stored least significant first, as one store (the symbols of a run in their order). */
static inline void store32le(uint8_t *p, uint32_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, 4);
}

static inline uint32_t load32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

static inline void store32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* Lane i's symbol count: n cut in lanes of q = ceil(n / 4), the last ones shorter (or empty). */
static inline size_t lane_count(size_t n, size_t q, int i) {
    size_t at = q * (size_t)i;
    return at >= n ? 0 : (n - at < q ? n - at : q);
}

/* ------------------------------------------------------------------ lengths */

/* Sort keys ascending (bottom-up merge sort; at most 256 keys, no recursion). */
static void sort_keys(uint64_t *a, int m) {
    uint64_t tmp[256], *x = a, *y = tmp;
    for (int w = 1; w < m; w *= 2) {
        for (int lo = 0; lo < m; lo += 2 * w) {
            int mid = lo + w < m ? lo + w : m, hi = lo + 2 * w < m ? lo + 2 * w : m, i = lo, j = mid, k = lo;
            while (i < mid && j < hi) y[k++] = x[i] <= x[j] ? x[i++] : x[j++];
            while (i < mid) y[k++] = x[i++];
            while (j < hi) y[k++] = x[j++];
        }
        uint64_t *t = x;
        x = y, y = t;
    }
    if (x != a) memcpy(a, x, (size_t)m * sizeof *a);
}

typedef struct {
    uint64_t f;
    int s;
} Item;

void huff_lengths(const uint64_t freq[256], uint8_t len[256]) {
    /* ascending (frequency, symbol): one key each, frequency << 8 | symbol (counts are below 2^56) */
    uint64_t key[256];
    int m = 0;
    memset(len, 0, 256);
    for (int s = 0; s < 256; s++)
        if (freq[s]) key[m++] = freq[s] << 8 | (uint64_t)s;
    if (m == 0) return;
    if (m == 1) {
        len[key[0] & 255] = 1;
        return;
    }
    sort_keys(key, m);
    Item it[256];
    for (int i = 0; i < m; i++) it[i] = (Item){key[i] >> 8, (int)(key[i] & 255)};
    /* Huffman by two queues: leaves 0..m-1 (sorted), internal nodes m..2m-2 in the order made; a tie
     * takes the leaf first. */
    uint64_t w[511];
    int parent[511];
    int li = 0, ih = m, nt = m;
    for (int k = 0; k < m - 1; k++) {
        int pick[2];
        for (int j = 0; j < 2; j++) {
            if (li < m && (ih == nt || it[li].f <= w[ih])) {
                w[li] = it[li].f;
                pick[j] = li++;
            } else {
                pick[j] = ih++;
            }
        }
        w[nt] = w[pick[0]] + w[pick[1]];
        parent[pick[0]] = parent[pick[1]] = nt;
        nt++;
    }
    int depth[511];
    unsigned count[256] = {0};
    depth[2 * m - 2] = 0;
    for (int i = 2 * m - 3; i >= 0; i--) depth[i] = depth[parent[i]] + 1;
    for (int i = 0; i < m; i++) count[depth[i] > HUFF_MAX_LEN ? HUFF_MAX_LEN : depth[i]]++;
    /* the limit: lengths over 11 became 11; give back the Kraft excess by splitting the longest code
     * shorter than 11 for each 11-bit code dropped (deflate's classic fix) */
    uint32_t total = 0;
    for (int l = 1; l <= HUFF_MAX_LEN; l++) total += count[l] << (HUFF_MAX_LEN - l);
    while (total != TABLE_SIZE) {
        count[HUFF_MAX_LEN]--;
        for (int l = HUFF_MAX_LEN - 1; l > 0; l--)
            if (count[l]) {
                count[l]--;
                count[l + 1] += 2;
                break;
            }
        total--;
    }
    /* the most frequent symbols take the shortest lengths */
    int i = m - 1;
    for (int l = 1; l <= HUFF_MAX_LEN; l++)
        for (unsigned c = 0; c < count[l]; c++) len[it[i--].s] = (uint8_t)l;
}

/* Byte b's bits reversed, for all b (a table: canonical() runs once per stream, its lookups per symbol). */
static const uint8_t REV8[256] = {
#define R2(n) n, n + 2 * 64, n + 1 * 64, n + 3 * 64
#define R4(n) R2(n), R2(n + 2 * 16), R2(n + 1 * 16), R2(n + 3 * 16)
#define R6(n) R4(n), R4(n + 2 * 4), R4(n + 1 * 4), R4(n + 3 * 4)
    R6(0), R6(2), R6(1), R6(3)
#undef R2
#undef R4
#undef R6
};

/* Canonical codes of the present symbols sym[0 .. m) (in symbol order) of lengths len, count[l] of each
 * length: bit-reversed for LSB-first packing. code[] of absent symbols is left as it is. */
static void assign_codes(const uint8_t len[256], const uint8_t *sym, int m, const unsigned count[HUFF_MAX_LEN + 1],
                         uint16_t code[256]) {
    unsigned next[HUFF_MAX_LEN + 2];
    next[1] = 0;
    for (int l = 1; l <= HUFF_MAX_LEN; l++) next[l + 1] = (next[l] + count[l]) << 1;
    for (int i = 0; i < m; i++) {
        unsigned l = len[sym[i]], c = next[l]++;
        code[sym[i]] = (uint16_t)(((unsigned)REV8[c & 0xffu] << 8 | REV8[c >> 8]) >> (16 - l));
    }
}

/* Canonical codes of `len` (0 for absent symbols), bit-reversed for LSB-first packing. */
static void canonical(const uint8_t len[256], uint16_t code[256]) {
    unsigned count[HUFF_MAX_LEN + 1] = {0};
    uint8_t sym[256];
    int m = 0;
    memset(code, 0, 256 * sizeof *code);
    for (int s = 0; s < 256; s++)
        if (len[s]) count[len[s]]++, sym[m++] = (uint8_t)s;
    assign_codes(len, sym, m, count, code);
}

/* ------------------------------------------------------------------ encode */

static const uint8_t *gather(const uint8_t *src, size_t n, size_t row, size_t stride, uint8_t *scratch) {
    if (row >= stride || !n) return src;
    for (size_t r = 0, at = 0; at < n; r++, at += row) memcpy(scratch + at, src + r * stride, row);
    return scratch;
}

/* A lane being written: its bit buffer, the next byte and the end of its bytes. */
typedef struct {
    uint64_t buf;
    unsigned bits;
    uint8_t *p, *end;
} Out;

/* A symbol's code (bit-reversed, in a 64-bit word ready to shift) and its length: two tables, so that
 * coding a symbol is two loads, a shift, an or and an add (measured faster than one packed table). */
typedef struct {
    uint64_t code[256];
    uint8_t len[256];
} Codes;

/* The codes of two byte symbols side by side (the first's code, then the second's: up to 22 bits), indexed
 * by the two bytes as a little-endian 16-bit word: one lookup codes two symbols. Only the pairs of the
 * coder's present symbols are written (the others are never read: a stream holds only those), so a fill
 * costs m^2 for m present symbols. */
struct HuffWide {
    uint32_t code[1 << 16];
    uint8_t len[1 << 16];
};

/* How a stream's lanes are coded, a round being four symbols: BYTES one lookup a symbol; PAIRS one a byte
 * of two symbols below 16 (two bytes a round); WIDE one a two-byte word (HuffWide). */
enum { BYTES, PAIRS, WIDE };

static inline uint16_t load16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* One lane's symbols sym[k .. cnt) from state o (single symbols, or pair bytes with PAIRS): 8-byte stores
 * while they stay inside the lane (the bits above the buffer's count are zero, so a store's spill is the
 * lane's own zero padding), then a byte at a time; the last byte's unused high bits zero. */
static inline __attribute__((always_inline)) void finish_out(Out *o, const uint8_t *sym, size_t k, size_t cnt,
                                                             const Codes *cl, int g) {
    uint64_t buf = o->buf;
    unsigned bits = o->bits;
    uint8_t *p = o->p;
    while (k + (size_t)g <= cnt && o->end - p >= 8) {
        for (int j = 0; j < g; j++) {
            unsigned x = sym[k + j];
            buf |= cl->code[x] << bits;
            bits += cl->len[x];
        }
        k += (size_t)g;
        store64(p, buf);
        p += bits >> 3;
        buf >>= bits & ~7u;
        bits &= 7;
    }
    for (; k < cnt; k++) {
        unsigned x = sym[k];
        buf |= cl->code[x] << bits;
        bits += cl->len[x];
        while (bits >= 8) {
            *p++ = (uint8_t)buf;
            buf >>= 8;
            bits -= 8;
        }
    }
    if (bits) *p = (uint8_t)buf;
}

/* Two lanes' symbols coded side by side (two independent bit buffers: twice the work per dependency
 * step, few enough registers that nothing spills) while each has a round left and 8 bytes of its own
 * room, then each one's rest; the counts and bytes are exact (from the histograms), so no store leaves
 * its lane. A round codes four symbols of up to 11 bits a lane (44 bits: under 6 bytes with the 7 left
 * over), in four lookups (BYTES), or two (PAIRS, WIDE); k counts symbols, or pair bytes with PAIRS. */
static inline __attribute__((always_inline)) void encode_two(const uint8_t *s0, const uint8_t *s1, size_t c0, size_t c1,
                                                             const Codes *cl, const HuffWide *w, Out *o0, Out *o1,
                                                             int mode) {
    const size_t g = mode == PAIRS ? 2 : 4; /* symbols (pair bytes) a round */
    uint64_t b0 = 0, b1 = 0;
    unsigned n0 = 0, n1 = 0;
    uint8_t *p0 = o0->p, *p1 = o1->p;
    size_t k = 0;
    for (;;) {
        /* a round writes at most 6 bytes a lane (7 bits left + 44): rounds that keep 8 bytes of room */
        ptrdiff_t r0 = o0->end - p0 - 8, r1 = o1->end - p1 - 8;
        size_t run = (c1 - k) / g;
        if (r0 < 0 || r1 < 0 || !run) break;
        if ((size_t)r0 / 6 + 1 < run) run = (size_t)r0 / 6 + 1;
        if ((size_t)r1 / 6 + 1 < run) run = (size_t)r1 / 6 + 1;
        for (size_t end = k + g * run; k < end; k += g) {
#define E(b, n, s)                                      \
    {                                                   \
        unsigned x_ = s;                                \
        b |= cl->code[x_] << n;                         \
        n += cl->len[x_];                               \
    }
#define W(b, n, s)                                      \
    {                                                   \
        unsigned x_ = load16(s);                        \
        b |= (uint64_t)w->code[x_] << n;                \
        n += w->len[x_];                                \
    }
#define F(b, n, p)                                      \
    store64(p, b);                                      \
    p += n >> 3;                                        \
    b >>= n & ~7u;                                      \
    n &= 7;
            if (mode == WIDE) {
                W(b0, n0, s0 + k) W(b1, n1, s1 + k) W(b0, n0, s0 + k + 2) W(b1, n1, s1 + k + 2)
            } else {
                E(b0, n0, s0[k]) E(b1, n1, s1[k]) E(b0, n0, s0[k + 1]) E(b1, n1, s1[k + 1])
                if (mode == BYTES) {
                    E(b0, n0, s0[k + 2]) E(b1, n1, s1[k + 2]) E(b0, n0, s0[k + 3]) E(b1, n1, s1[k + 3])
                }
            }
            F(b0, n0, p0) F(b1, n1, p1)
#undef E
#undef W
#undef F
        }
    }
    o0->buf = b0, o0->bits = n0, o0->p = p0;
    o1->buf = b1, o1->bits = n1, o1->p = p1;
    finish_out(o0, s0, k, c0, cl, (int)g);
    finish_out(o1, s1, k, c1, cl, (int)g);
}

/* The four lanes: 0 beside 1, then 2 beside 3 (a lane's count is at least the next one's). Inlined into a
 * copy per mode, generic and BMI2. */
static inline __attribute__((always_inline)) void encode_body(const uint8_t *sym, size_t q, const size_t cnt[HUFF_LANES],
                                                              const Codes *cl, const HuffWide *w, Out o[HUFF_LANES],
                                                              int mode) {
    encode_two(sym, sym + q, cnt[0], cnt[1], cl, w, &o[0], &o[1], mode);
    encode_two(sym + 2 * q, sym + 3 * q, cnt[2], cnt[3], cl, w, &o[2], &o[3], mode);
}

typedef void (*EncodeFn)(const uint8_t *, size_t, const size_t *, const Codes *, const HuffWide *, Out *);
#define ENCODE_FN(name, mode, attr)                                                                          \
    attr static void name(const uint8_t *sym, size_t q, const size_t cnt[HUFF_LANES], const Codes *cl,       \
                          const HuffWide *w, Out o[HUFF_LANES]) {                                            \
        encode_body(sym, q, cnt, cl, w, o, mode);                                                            \
    }
ENCODE_FN(encode_bytes, BYTES, )
ENCODE_FN(encode_pairs, PAIRS, )
ENCODE_FN(encode_wide, WIDE, )
#if KV_X86
ENCODE_FN(encode_bytes_bmi2, BYTES, __attribute__((target("bmi2"))))
ENCODE_FN(encode_pairs_bmi2, PAIRS, __attribute__((target("bmi2"))))
ENCODE_FN(encode_wide_bmi2, WIDE, __attribute__((target("bmi2"))))
#endif
#undef ENCODE_FN

/* The lanes' loop of each mode this CPU runs. */
static EncodeFn encode_fn(int mode) {
#if KV_X86
    if (__builtin_cpu_supports("bmi2")) return mode == WIDE ? encode_wide_bmi2 : mode == PAIRS ? encode_pairs_bmi2 : encode_bytes_bmi2;
#endif
    return mode == WIDE ? encode_wide : mode == PAIRS ? encode_pairs : encode_bytes;
}

#ifndef HUFF_COUNT_CHUNK /* rounds counted in 32-bit counters before they are added up (make test-asan: 6) */
#define HUFF_COUNT_CHUNK ((size_t)1 << 30)
#endif

/* Each lane's count of each byte value: lane i's cnt[i] symbols from sym + i x q. Two histograms per
 * lane, counted side by side (a run of one symbol, as K's exponents make, alternates between two
 * counters instead of waiting on one), in 32-bit counters added into the 64-bit counts every
 * HUFF_COUNT_CHUNK rounds: half the bytes of 64-bit counters in L1 (K's streams: a histogram 18 -> 10 us). */
static void count_lanes(const uint8_t *sym, size_t q, const size_t cnt[HUFF_LANES], uint64_t lane[HUFF_LANES][256]) {
    uint32_t h[2 * HUFF_LANES][256];
    const uint8_t *s0 = sym, *s1 = sym + q, *s2 = sym + 2 * q, *s3 = sym + 3 * q;
    memset(lane, 0, sizeof(uint64_t) * HUFF_LANES * 256);
    size_t k = 0;
    do {
        memset(h, 0, sizeof h);
        size_t end = cnt[3] - k > HUFF_COUNT_CHUNK ? k + HUFF_COUNT_CHUNK : cnt[3];
        for (; k + 2 <= end; k += 2) {
            h[0][s0[k]]++, h[2][s1[k]]++, h[4][s2[k]]++, h[6][s3[k]]++;
            h[1][s0[k + 1]]++, h[3][s1[k + 1]]++, h[5][s2[k + 1]]++, h[7][s3[k + 1]]++;
        }
        for (int i = 0; i < HUFF_LANES; i++)
            for (int v = 0; v < 256; v++) lane[i][v] += (uint64_t)h[2 * i][v] + h[2 * i + 1][v];
    } while (k + 2 <= cnt[3]);
    for (int i = 0; i < HUFF_LANES; i++) /* each lane's symbols past those */
        for (size_t j = k; j < cnt[i]; j++) lane[i][sym[q * (size_t)i + j]]++;
}

/* What codes a stream: its code lengths as stored, its codes (per symbol, or per pair byte), the mode of
 * its lanes' loop, and with WIDE the two-symbol table it needs filled. */
typedef struct {
    uint8_t len[256];
    Codes cl;
    int mode;
} Coder;

/* bits: a stream's byte symbols are coded two a lookup (WIDE) where at most this many are present (their
 * pairs' codes stay in L1 and L2: measured on K's exponents of ~20-30 symbols 1.4x faster, on fp16 K's
 * ~110 slower), and the pairs are few beside its symbols. */
#define WIDE_MAX_SYMBOLS 64

/* A coder of lengths len: per symbol, or per pair byte (pairs); WIDE where a HuffWide is at hand and the
 * present symbols are few (m^2 <= n / 4: filling their pairs costs little beside n symbols). */
static void coder_of(const uint8_t len[256], int pairs, int wide_ok, size_t n, Coder *c) {
    uint16_t code[256];
    unsigned m = 0;
    canonical(len, code);
    memcpy(c->len, len, sizeof c->len);
    for (int p = 0; p < 256; p++) {
        unsigned a = pairs ? p & 15 : (unsigned)p, b = (unsigned)p >> 4;
        c->cl.code[p] = pairs ? (uint64_t)code[a] | (uint64_t)code[b] << len[a] : code[p];
        c->cl.len[p] = (uint8_t)(pairs ? len[a] + len[b] : len[p]);
        m += len[p] != 0;
    }
    c->mode = pairs ? PAIRS : wide_ok && m <= WIDE_MAX_SYMBOLS && (size_t)m * m <= n / 4 ? WIDE : BYTES;
}

/* w filled for coder c: the codes of every two of its present symbols. */
static void fill_wide(const Coder *c, HuffWide *w) {
    uint8_t sym[256];
    int m = 0;
    for (int s = 0; s < 256; s++)
        if (c->len[s]) sym[m++] = (uint8_t)s;
    for (int j = 0; j < m; j++) {
        unsigned b = sym[j];
        uint64_t cb = c->cl.code[b];
        for (int i = 0; i < m; i++) {
            unsigned a = sym[i], x = a | b << 8;
            w->code[x] = (uint32_t)(c->cl.code[a] | cb << c->len[a]);
            w->len[x] = (uint8_t)(c->len[a] + c->len[b]);
        }
    }
}

/* The bits of the symbols counted in freq at code lengths len. */
static uint64_t cost(const uint64_t freq[256], const uint8_t len[256]) {
    uint64_t bits = 0;
    for (int v = 0; v < 256; v++) bits += freq[v] * len[v];
    return bits;
}

/* A stream written: its head (code lengths, lanes 0..2's bytes), then each lane's symbols (lane i's cnt[i]
 * from sym + i x q) coded by c (w: its two-symbol table with WIDE), lane i's bits being its counts lane[i]
 * times c's lengths (a pairs stream's lanes count symbols, not pair bytes). Its bytes, or -1 (nothing
 * written) when they exceed cap. */
static ptrdiff_t write_stream(const Coder *c, const HuffWide *w, const uint64_t lane[HUFF_LANES][256],
                              const uint8_t *sym, size_t q, const size_t cnt[HUFF_LANES], uint8_t *out, size_t cap) {
    size_t total = HUFF_HEAD_BYTES, bytes[HUFF_LANES];
    for (int i = 0; i < HUFF_LANES; i++) {
        bytes[i] = (size_t)((cost(lane[i], c->mode == PAIRS ? c->len : c->cl.len) + 7) / 8);
        total += bytes[i];
    }
    if (total > cap) return -1;
    for (int i = 0; i < HUFF_TABLE_BYTES; i++) out[i] = (uint8_t)(c->len[2 * i] | c->len[2 * i + 1] << 4);
    for (int i = 0; i < HUFF_LANES - 1; i++) store32(out + HUFF_TABLE_BYTES + 4 * i, (uint32_t)bytes[i]);
    Out o[HUFF_LANES];
    uint8_t *p = out + HUFF_HEAD_BYTES;
    for (int i = 0; i < HUFF_LANES; i++) {
        o[i] = (Out){0, 0, p, p + bytes[i]};
        p += bytes[i];
    }
    encode_fn(c->mode)(sym, q, cnt, &c->cl, w, o);
    return (ptrdiff_t)total;
}

/* Stream i of a section counted: its symbols (gathered where its rows are strided), each lane's count of
 * each symbol (a pairs stream's: of the 4-bit symbols in its pair bytes), the stream's symbol counts, and
 * its lanes (cnt[j] bytes from sym + j x q). */
struct HuffCounted {
    uint64_t lane[HUFF_LANES][256], freq[256];
    const uint8_t *sym;
    size_t q, cnt[HUFF_LANES];
};

/* The lanes' counts added into tot. */
static void lanes_total(const uint64_t lane[HUFF_LANES][256], uint64_t tot[256]) {
    for (int j = 0; j < HUFF_LANES; j++)
        for (int v = 0; v < 256; v++) tot[v] += lane[j][v];
}

/* Each symbol's count added into freq from the counts tot of pair bytes (low symbol | high << 4): each row
 * of 16 pair values summed for its high symbol and added across for its low ones, in locals (adding into
 * freq[p >> 4] pair by pair waited on the store before it: ~1.4 us a V stream). */
static void pair_freq(const uint64_t tot[256], uint64_t freq[256]) {
    uint64_t low[16] = {0};
    for (int a = 0; a < 16; a++) {
        uint64_t row = 0;
        for (int b = 0; b < 16; b++) row += tot[a << 4 | b], low[b] += tot[a << 4 | b];
        freq[a] += row;
    }
    for (int b = 0; b < 16; b++) freq[b] += low[b];
}

#if KV_X86
#include <immintrin.h>
#define HUFF_AVX2 1

#ifndef HUFF_NIBBLE_CHUNK /* 32-byte blocks counted in byte counters before they are added up (<= 127) */
#define HUFF_NIBBLE_CHUNK 127
#endif

/* AVX2: per symbol value a vector of byte counters, one compare and subtract per nibble half (a block adds
 * at most 2 to a counter), added up every HUFF_NIBBLE_CHUNK blocks; 1.35x the pair bytes a second of
 * count_lanes' pair counts (C harness, the bench's V: 39 -> 29 us a blob). */
__attribute__((target("avx2"))) static void count_nibbles_avx2(const uint8_t *sym, size_t q,
                                                              uint64_t lane[HUFF_LANES][256]) {
    const __m256i m = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
    for (int j = 0; j < HUFF_LANES; j++) {
        const uint8_t *s = sym + (size_t)j * q;
        uint64_t *w = lane[j];
        memset(w, 0, sizeof lane[j]);
        size_t i = 0;
        while (q - i >= 32) {
            __m256i acc[16];
            for (int v = 0; v < 16; v++) acc[v] = zero;
            size_t end = (q - i) / 32 > HUFF_NIBBLE_CHUNK ? i + 32 * HUFF_NIBBLE_CHUNK : q;
            for (; end - i >= 32; i += 32) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(s + i));
                __m256i lo = _mm256_and_si256(x, m), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
                for (int v = 0; v < 16; v++) {
                    __m256i val = _mm256_set1_epi8((char)v);
                    acc[v] = _mm256_sub_epi8(acc[v], _mm256_cmpeq_epi8(lo, val));
                    acc[v] = _mm256_sub_epi8(acc[v], _mm256_cmpeq_epi8(hi, val));
                }
            }
            for (int v = 0; v < 16; v++) {
                __m256i t = _mm256_sad_epu8(acc[v], zero);
                w[v] += (uint64_t)_mm256_extract_epi64(t, 0) + (uint64_t)_mm256_extract_epi64(t, 1) +
                        (uint64_t)_mm256_extract_epi64(t, 2) + (uint64_t)_mm256_extract_epi64(t, 3);
            }
        }
        for (; i < q; i++) w[s[i] & 15]++, w[s[i] >> 4]++;
    }
}

/* AVX-512 (BW): count_nibbles_avx2's counters in 64-byte registers, each compare into a mask register that
 * adds 1 under it (one masked add where AVX2 compares into a vector and subtracts it); all sixteen values'
 * counters fit the 32 registers. On Zen 4, whose 512-bit operations take two passes: the bench's V, a
 * lane of 32 KiB of pair bytes, 30.5 -> 22 us (C harness). */
__attribute__((target("avx512f,avx512bw"))) static void count_nibbles_zmm(const uint8_t *sym, size_t q,
                                                                        uint64_t lane[HUFF_LANES][256]) {
    const __m512i m = _mm512_set1_epi8(15), zero = _mm512_setzero_si512(), one = _mm512_set1_epi8(1);
    for (int j = 0; j < HUFF_LANES; j++) {
        const uint8_t *s = sym + (size_t)j * q;
        uint64_t *w = lane[j];
        memset(w, 0, sizeof lane[j]);
        size_t i = 0;
        while (q - i >= 64) {
            __m512i acc[16];
            for (int v = 0; v < 16; v++) acc[v] = zero;
            size_t end = (q - i) / 64 > HUFF_NIBBLE_CHUNK ? i + 64 * HUFF_NIBBLE_CHUNK : q;
            for (; end - i >= 64; i += 64) {
                __m512i x = _mm512_loadu_si512((const void *)(s + i));
                __m512i lo = _mm512_and_si512(x, m), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m);
                for (int v = 0; v < 16; v++) {
                    __m512i val = _mm512_set1_epi8((char)v);
                    acc[v] = _mm512_mask_add_epi8(acc[v], _mm512_cmpeq_epi8_mask(lo, val), acc[v], one);
                    acc[v] = _mm512_mask_add_epi8(acc[v], _mm512_cmpeq_epi8_mask(hi, val), acc[v], one);
                }
            }
            for (int v = 0; v < 16; v++) w[v] += (uint64_t)_mm512_reduce_add_epi64(_mm512_sad_epu8(acc[v], zero));
        }
        for (; i < q; i++) w[s[i] & 15]++, w[s[i] >> 4]++;
    }
}
#endif

#ifdef HUFF_AVX2
#ifndef HUFF_SET_CHUNK /* 32-byte blocks counted in byte counters before they are added up (<= 255) */
#define HUFF_SET_CHUNK 255
#endif
#define SET_MAX 32 /* the most symbols counted by compares: past ~40, count_lanes is faster */
#define SET_PASS 7 /* symbols a pass: a counter and a compare value each in 16 registers */

/* The range of n bytes under 0x80 (r[0] .. r[1]) and of those from 0x80 (r[2] .. r[3]); an empty one
 * has r[0] > r[1] (or r[2] > r[3]). K's high bytes: a sign and the top of the exponent. */
__attribute__((target("avx2"))) static void byte_ranges(const uint8_t *s, size_t n, unsigned r[4]) {
    const __m256i ones = _mm256_set1_epi8((char)0xFF), zero = _mm256_setzero_si256();
    __m256i lo = ones, hi_pos = zero, lo_neg = ones, hi = zero;
    size_t i = 0;
    for (; n - i >= 32; i += 32) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(s + i)), neg = _mm256_cmpgt_epi8(zero, x);
        lo = _mm256_min_epu8(lo, x), hi = _mm256_max_epu8(hi, x);
        hi_pos = _mm256_max_epu8(hi_pos, _mm256_andnot_si256(neg, x));      /* the bytes from 0x80 as 0 */
        lo_neg = _mm256_min_epu8(lo_neg, _mm256_or_si256(x, _mm256_andnot_si256(neg, ones))); /* under: 0xFF */
    }
    uint8_t v[4][32];
    _mm256_storeu_si256((__m256i *)v[0], lo), _mm256_storeu_si256((__m256i *)v[1], hi_pos);
    _mm256_storeu_si256((__m256i *)v[2], lo_neg), _mm256_storeu_si256((__m256i *)v[3], hi);
    unsigned a = 255, b = 0, c = 255, d = 0;
    for (int j = 0; j < 32; j++) {
        a = v[0][j] < a ? v[0][j] : a, b = v[1][j] > b ? v[1][j] : b;
        c = v[2][j] < c ? v[2][j] : c, d = v[3][j] > d ? v[3][j] : d;
    }
    for (; i < n; i++) {
        unsigned x = s[i];
        a = x < a ? x : a, d = x > d ? x : d;
        if (x < 0x80) b = x > b ? x : b;
        else c = x < c ? x : c;
    }
    r[0] = a < 0x80 ? a : 1, r[1] = a < 0x80 ? b : 0; /* 1 .. 0: empty */
    r[2] = d >= 0x80 ? c : 1, r[3] = d >= 0x80 ? d : 0;
}

/* Each of the m symbols vals counted in n bytes (a multiple of 32) into h: per pass of up to SET_PASS of
 * them, a vector of byte counters each, one compare and subtract a block. */
__attribute__((target("avx2"))) static void count_set(const uint8_t *s, size_t n, const uint8_t *vals, int m,
                                                     uint64_t h[256]) {
    const __m256i zero = _mm256_setzero_si256();
    for (int p = 0; p < m; p += SET_PASS) {
        int pm = m - p < SET_PASS ? m - p : SET_PASS;
        __m256i val[SET_PASS], acc[SET_PASS];
        for (int j = 0; j < SET_PASS; j++) val[j] = _mm256_set1_epi8((char)vals[p + (j < pm ? j : 0)]);
        for (size_t i = 0; i < n;) {
            for (int j = 0; j < SET_PASS; j++) acc[j] = zero;
            size_t end = (n - i) / 32 > HUFF_SET_CHUNK ? i + 32 * HUFF_SET_CHUNK : n;
            for (; i < end; i += 32) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(s + i));
                for (int j = 0; j < SET_PASS; j++)
                    if (j < pm) acc[j] = _mm256_sub_epi8(acc[j], _mm256_cmpeq_epi8(x, val[j]));
            }
            for (int j = 0; j < pm; j++) {
                __m256i t = _mm256_sad_epu8(acc[j], zero);
                h[vals[p + j]] += (uint64_t)_mm256_extract_epi64(t, 0) + (uint64_t)_mm256_extract_epi64(t, 1) +
                                  (uint64_t)_mm256_extract_epi64(t, 2) + (uint64_t)_mm256_extract_epi64(t, 3);
            }
        }
    }
}

#define SET_PASS_ZMM 8 /* symbols a pass: one of the 8 mask registers each */

/* count_set with AVX-512 (BW), whole 64-byte blocks of n (the rest is the caller's): eight values a pass, each
 * compared into a mask register that adds 1 under it (as count_nibbles_zmm). C harness, 256 KiB of 28
 * values: 40.7 -> 31.8 us. */
__attribute__((target("avx512f,avx512bw"))) static void count_set_zmm(const uint8_t *s, size_t n, const uint8_t *vals,
                                                                    int m, uint64_t h[256]) {
    const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi8(1);
    for (int p = 0; p < m; p += SET_PASS_ZMM) {
        int pm = m - p < SET_PASS_ZMM ? m - p : SET_PASS_ZMM;
        __m512i val[SET_PASS_ZMM], acc[SET_PASS_ZMM];
        for (int j = 0; j < SET_PASS_ZMM; j++) val[j] = _mm512_set1_epi8((char)vals[p + (j < pm ? j : 0)]);
        for (size_t i = 0; n - i >= 64;) {
            for (int j = 0; j < SET_PASS_ZMM; j++) acc[j] = zero;
            size_t end = (n - i) / 64 > HUFF_SET_CHUNK ? i + 64 * HUFF_SET_CHUNK : n;
            for (; end - i >= 64; i += 64) {
                __m512i x = _mm512_loadu_si512((const void *)(s + i));
                for (int j = 0; j < SET_PASS_ZMM; j++)
                    if (j < pm) acc[j] = _mm512_mask_add_epi8(acc[j], _mm512_cmpeq_epi8_mask(x, val[j]), acc[j], one);
            }
            for (int j = 0; j < pm; j++)
                h[vals[p + j]] += (uint64_t)_mm512_reduce_add_epi64(_mm512_sad_epu8(acc[j], zero));
        }
    }
}

/* count_lanes for a stream whose bytes lie in at most SET_MAX values, as K's high bytes in bf16 do (a sign
 * and the top 7 of 8 exponent bits; SmolLM2's: 16-24 values a head): each value compared across the
 * lanes' blocks instead of a counter written for every byte (C harness, the bench's K: a blob's 76 ->
 * 43 us; SmolLM2's: 2.2x). 0 (nothing counted) for a wider stream: fp16's high bytes (a sign, 5 exponent
 * and 2 mantissa bits: ~110 values), known from its first 1 KiB alone. */
static int count_few(const uint8_t *sym, size_t q, const size_t cnt[HUFF_LANES], uint64_t lane[HUFF_LANES][256]) {
    size_t n = q * (HUFF_LANES - 1) + cnt[HUFF_LANES - 1]; /* the lanes lie one after another */
    unsigned r[4];
    uint8_t vals[SET_MAX];
    for (size_t look = n < 1024 ? n : 1024;; look = n) { /* the first 1 KiB, then all of it */
        byte_ranges(sym, look, r);
        if ((r[1] + 1 - r[0]) + (r[3] + 1 - r[2]) > SET_MAX) return 0; /* an empty range adds 0 */
        if (look == n) break;
    }
    int m = 0;
    for (unsigned v = r[0]; v <= r[1]; v++) vals[m++] = (uint8_t)v;
    for (unsigned v = r[2]; v <= r[3]; v++) vals[m++] = (uint8_t)v;
    memset(lane, 0, sizeof(uint64_t) * HUFF_LANES * 256);
    int zmm = kv_best_simd() >= 2; /* dispatch.c's level: AVX-512 */
    for (int j = 0; j < HUFF_LANES; j++) {
        const uint8_t *s = sym + q * (size_t)j;
        size_t whole = cnt[j] / (zmm ? 64 : 32) * (zmm ? 64 : 32);
        (zmm ? count_set_zmm : count_set)(s, whole, vals, m, lane[j]);
        for (size_t i = whole; i < cnt[j]; i++) lane[j][s[i]]++;
    }
    return 1;
}
#endif

/* count_lanes, or count_few where AVX2 is there and it takes the stream. */
static void count_bytes(const uint8_t *sym, size_t q, const size_t cnt[HUFF_LANES], uint64_t lane[HUFF_LANES][256]) {
#ifdef HUFF_AVX2
    if (q >= 32 && kv_best_simd() >= 1 && count_few(sym, q, cnt, lane)) return;
#endif
    count_lanes(sym, q, cnt, lane);
}

/* Lane j's count of each 4-bit symbol (both nibbles of its q pair bytes from sym + j x q) in lane[j][0..16),
 * the rest 0: all a pairs stream's lengths and lane sizes need (a pair's code is its two symbols' codes).
 * AVX2 where there (dispatch.c's level), else the pair counts folded. */
static void count_nibbles(const uint8_t *sym, size_t q, uint64_t lane[HUFF_LANES][256]) {
#ifdef HUFF_AVX2
    if (kv_best_simd() >= 1) { /* dispatch.c's level: the CPU's, capped by KVCODEC_CPU_LEVEL */
        (kv_best_simd() >= 2 ? count_nibbles_zmm : count_nibbles_avx2)(sym, q, lane);
        return;
    }
#endif
    uint64_t pairs[HUFF_LANES][256];
    const size_t cnt[HUFF_LANES] = {q, q, q, q};
    count_lanes(sym, q, cnt, pairs);
    memset(lane, 0, sizeof(uint64_t) * HUFF_LANES * 256);
    for (int j = 0; j < HUFF_LANES; j++) pair_freq(pairs[j], lane[j]);
}

static void count_stream(const HuffSection *s, size_t i, uint8_t *scratch, HuffCounted *c) {
    const uint8_t *src = s->src + i * s->step;
    memset(c->freq, 0, sizeof c->freq);
    if (s->pairs) { /* symbol counts per lane (the nibbles of its pair bytes) */
        c->sym = src, c->q = s->n / HUFF_LANES / 2;
        for (int j = 0; j < HUFF_LANES; j++) c->cnt[j] = c->q;
        count_nibbles(c->sym, c->q, c->lane);
        lanes_total(c->lane, c->freq);
        return;
    }
    c->sym = gather(src, s->n, s->row, s->stride, scratch ? scratch + i * s->n : NULL);
    c->q = (s->n + HUFF_LANES - 1) / HUFF_LANES;
    for (int j = 0; j < HUFF_LANES; j++) c->cnt[j] = lane_count(s->n, c->q, j);
    count_bytes(c->sym, c->q, c->cnt, c->lane);
    lanes_total(c->lane, c->freq);
}

size_t huff_section_work(size_t count, int pairs) {
    size_t bytes;
    if (__builtin_mul_overflow(count, sizeof(HuffCounted), &bytes) ||
        __builtin_add_overflow(bytes, pairs ? 0 : sizeof(HuffWide), &bytes))
        return 0;
    return bytes;
}

/* The section's streams (huff_encode_section), counted into counted[0 .. count), WIDE where w is given. */
static ptrdiff_t encode_section(const HuffSection *s, uint8_t *out, size_t cap, size_t *lens, HuffCounted *counted,
                                HuffWide *w, uint8_t *scratch) {
    const Coder *in_w = NULL; /* whose pairs w holds */
    uint64_t all[256] = {0};
    for (size_t i = 0; i < s->count; i++) {
        count_stream(s, i, scratch, &counted[i]);
        for (int v = 0; v < 256; v++) all[v] += counted[i].freq[v];
    }
    uint8_t len[256];
    Coder shared, own;
    huff_lengths(all, len);
    coder_of(len, s->pairs, w != NULL, s->n, &shared);
    size_t pos = 0;
    for (size_t i = 0; i < s->count; i++) {
        const HuffCounted *c = &counted[i];
        huff_lengths(c->freq, len);
        /* the shared lengths where they cost the stream at most 1/HUFF_SHARE_SLACK more bits than its own */
        const Coder *use = &shared;
        if (cost(c->freq, shared.len) * HUFF_SHARE_SLACK > cost(c->freq, len) * (HUFF_SHARE_SLACK + 1)) {
            coder_of(len, s->pairs, w != NULL, s->n, &own);
            use = &own, in_w = in_w == &own ? NULL : in_w; /* w held another stream's own pairs */
        }
        if (use->mode == WIDE && in_w != use) fill_wide(use, w), in_w = use;
        ptrdiff_t got = write_stream(use, w, c->lane, c->sym, c->q, c->cnt, out + pos, cap - pos);
        if (got < 0) return -1;
        lens[i] = (size_t)got;
        pos += (size_t)got;
    }
    return (ptrdiff_t)pos;
}

ptrdiff_t huff_encode_section(const HuffSection *s, uint8_t *out, size_t cap, size_t *lens, void *work,
                              uint8_t *scratch) {
    HuffCounted *counted = work;
    return encode_section(s, out, cap, lens, counted, s->pairs ? NULL : (HuffWide *)(counted + s->count), scratch);
}

/* One stream: a section of one (its own lengths, as any stream alone), counted on the stack, one lookup a
 * symbol or pair byte. */
static ptrdiff_t encode_one(HuffSection s, uint8_t *out, size_t cap, uint8_t *scratch) {
    HuffCounted counted;
    size_t len;
    return encode_section(&s, out, cap, &len, &counted, NULL, scratch);
}

ptrdiff_t huff_encode(const uint8_t *src, size_t n, size_t row, size_t stride, uint8_t *out, size_t cap,
                      uint8_t *scratch) {
    return encode_one((HuffSection){src, 0, 1, n, row, stride, 0}, out, cap, scratch);
}

ptrdiff_t huff_encode_pairs(const uint8_t *pairs, size_t n, uint8_t *out, size_t cap) {
    return encode_one((HuffSection){pairs, 0, 1, n, 1, 1, 1}, out, cap, NULL);
}

/* ------------------------------------------------------------------ decode */

typedef struct {
    const uint8_t *start, *p, *end;
    uint64_t buf;
    unsigned bits;
    size_t k, cnt;
    uint8_t *dst;
} Lane;

/* The rest of one lane from its state (locals: a store through a uint8_t pointer may alias any struct
 * field): four symbols a refill while 8 bytes remain, a hole tested once per four; then a byte at a
 * time; then its length and padding checked. */
static int finish_lane(Lane *L, const uint16_t *t) {
    const uint8_t *p = L->p, *end = L->end;
    uint64_t buf = L->buf;
    unsigned bits = L->bits;
    uint8_t *d = L->dst + L->k, *stop = L->dst + L->cnt;
    while (stop - d >= 4 && end - p >= 8) {
        buf |= load64(p) << bits;
        p += (63 - bits) >> 3;
        bits |= 56;
        for (int j = 0; j < 4; j++) {
            uint32_t e = t[buf & TABLE_MASK];
            if (UNLIKELY(!e)) return HUFF_UNASSIGNED;
            d[j] = ENTRY_SYM(e);
            buf >>= ENTRY_LEN(e);
            bits -= ENTRY_LEN(e);
        }
        d += 4;
    }
    for (; d < stop; d++) {
        while (bits <= 56 && p < end) {
            buf |= (uint64_t)*p++ << bits;
            bits += 8;
        }
        uint32_t e = t[buf & TABLE_MASK];
        if (UNLIKELY(!e)) return HUFF_UNASSIGNED;
        unsigned l = ENTRY_LEN(e);
        if (UNLIKELY(l > bits)) return HUFF_LANE_SHORT;
        *d = ENTRY_SYM(e);
        buf >>= l;
        bits -= l;
    }
    size_t used = (size_t)(p - L->start) * 8 - bits, len = (size_t)(end - L->start);
    if ((used + 7) / 8 != len) return HUFF_LANE_LONG;
    if ((used & 7) && (L->start[used / 8] >> (used & 7))) return HUFF_BAD_PADDING;
    return HUFF_OK;
}

/* The fast loop's table of runs: for each 11-bit window, up to three symbols, each next one where its
 * code fits in the bits the ones before leave (so that decoding them is exactly what decoding one at a
 * time gives): total length | count << 6 | symbols << 8 (the first in bits 8..15). Only for a complete
 * table (no holes). What follows a first code of l bits depends on l alone, so it is worked out once
 * per length present (`rest`, the windows' 11 - l bits after that code: up to two more symbols) and each
 * first symbol of that length adds its own length, count and symbol to it (C harness, the bench's
 * streams: 3.5 -> 2.1-2.5 us a table, from two lookups a window to one). */
static void pair_table(const uint8_t cl[256], const uint16_t code[256], const uint16_t *t, uint32_t *t2) {
    uint32_t rest[TABLE_SIZE]; /* each length's 2^(11 - l) windows; all of them fit (Kraft) */
    uint32_t *at[HUFF_MAX_LEN + 1] = {0};
    size_t used = 0;
    for (int s = 0; s < 256; s++) {
        unsigned l1 = cl[s];
        if (!l1) continue;
        unsigned m = TABLE_SIZE >> l1, room = HUFF_MAX_LEN - l1;
        uint32_t *r = at[l1];
        if (!r) {
            r = at[l1] = rest + used;
            used += m;
            for (unsigned x = 0; x < m; x++) {
                uint32_t e2 = t[x], l2 = ENTRY_LEN(e2);
                if (l2 > room) {
                    r[x] = 0;
                    continue;
                }
                uint32_t e3 = t[x >> l2], l3 = ENTRY_LEN(e3);
                r[x] = l2 + l3 <= room ? (l2 + l3) | 2u << 6 | (e2 >> 8) << 16 | (e3 >> 8) << 24
                                       : l2 | 1u << 6 | (e2 >> 8) << 16;
            }
        }
        uint32_t head = l1 | 1u << 6 | (uint32_t)s << 8;
        for (unsigned x = 0, w = code[s]; x < m; x++, w += 1u << l1) t2[w] = head + r[x];
    }
}

/* The fast loop's table of long runs, for a complete table whose shortest code has 2 bits (V's exponents):
 * for each 11-bit window up to five symbols, each next one where its code fits in the bits the ones
 * before leave (five 2-bit codes fill 10 of the 11 bits, so no run is ever cut short by the count):
 * total length | count << 4 | symbols << 8 (the first in bits 8..15), 64 bits an entry. The runs of the
 * bits left after c bits taken depend on c alone: worked out for each c a run can take (a sum of the
 * lengths present), the most taken first, each window's one lookup and one entry of c + its length's
 * (C harness, the bench's V streams: 3.5 of their exponents a lookup instead of 2.9, a stream's
 * decode 10% faster; a table in ~4.8 us instead of pair_table's ~2.2). */
static void long_runs_table(const uint8_t cl[256], const uint16_t *t, uint64_t *t2) {
    unsigned lens = 0, reach = 1; /* bit l: a code of l bits is present; bit c: c bits can be taken */
    for (int s = 0; s < 256; s++) lens |= 1u << cl[s];
    lens &= ~1u;
    for (unsigned c = 0; c < HUFF_MAX_LEN; c++)
        if (reach >> c & 1) reach |= (lens << c) & ((1u << HUFF_MAX_LEN) - 1);
    uint64_t rest[TABLE_SIZE]; /* the runs after c = 1 .. 10 bits one after another, 2^(11 - c) each */
    uint64_t *at[HUFF_MAX_LEN + 1] = {0};
    size_t used = 0;
    for (unsigned c = 1; c < HUFF_MAX_LEN; c++)
        if (reach >> c & 1) at[c] = rest + used, used += TABLE_SIZE >> c;
    at[0] = t2;
    for (unsigned c = HUFF_MAX_LEN; c-- > 0;) {
        if (!(reach >> c & 1)) continue;
        uint64_t *r = at[c];
        unsigned room = HUFF_MAX_LEN - c;
        for (unsigned z = 0; z < (TABLE_SIZE >> c); z++) {
            uint32_t e = t[z];
            unsigned l = ENTRY_LEN(e);
            if (l > room) {
                r[z] = 0;
                continue;
            }
            uint64_t next = l < room ? at[c + l][z >> l] : 0; /* c + l is reachable: it was worked out */
            r[z] = (next >> 8) << 16 | (uint64_t)ENTRY_SYM(e) << 8 | ((next & 0xFF) + l + (1u << 4));
        }
    }
}

/* What a lanes loop takes: one symbol a lookup, runs of up to three (pair_table, 32-bit entries), runs of
 * up to five (long_runs_table, 64-bit entries). */
enum { RUNS_NONE = 0, RUNS_SHORT = 1, RUNS_LONG = 2 };

/* Rounds the first nl lanes can all run: an 8-byte load inside each lane's bytes (a round moves a lane at
 * most 44 bits, under 6 bytes) and room in each lane's output: a round's four lookups write 4 bytes
 * each, of which up to three symbols (up to twelve a round), or with RUNS_LONG 8 bytes each, of which up
 * to five (twenty a round). */
static inline size_t safe_rounds(const uint8_t *src, const size_t *pos, const uint8_t *const *end, uint8_t *const *d,
                                 uint8_t *const *stop, int nl, int mode) {
    const ptrdiff_t room = mode == RUNS_LONG ? 28 : 16;
    const size_t over = mode == RUNS_LONG ? 8 : 4, per = mode == RUNS_LONG ? 20 : 12;
    size_t safe = SIZE_MAX;
    for (int i = 0; i < nl; i++) {
        const uint8_t *p = src + (pos[i] >> 3);
        if (end[i] - p < 8 || stop[i] - d[i] < room) return 0;
        size_t r = (size_t)(end[i] - 8 - p) / 6 + 1, w = (size_t)(stop[i] - d[i] - over) / per;
        if (r < safe) safe = r;
        if (w < safe) safe = w;
    }
    return safe;
}

/* One lookup of a table of runs: up to three symbols stored (4 bytes written; pair_table's), or up to
 * five (8 bytes; long_runs_table's), the output and the bit position moved on. */
#define RUN_STEP(t2, b, p, d, mode)                                        \
    {                                                                      \
        if ((mode) == RUNS_LONG) {                                         \
            uint64_t e_ = ((const uint64_t *)(t2))[b & TABLE_MASK];        \
            store64(d, e_ >> 8);                                           \
            d += (e_ >> 4) & 7;                                            \
            b >>= e_ & 15;                                                 \
            p += e_ & 15;                                                  \
        } else {                                                           \
            uint32_t e_ = ((const uint32_t *)(t2))[b & TABLE_MASK];        \
            store32le(d, e_ >> 8);                                         \
            d += (e_ >> 6) & 3;                                            \
            b >>= e_ & 63;                                                 \
            p += e_ & 15;                                                  \
        }                                                                  \
    }

/* A lane's bit position from src, and its state set back from one (a byte pointer and the bits left of
 * its byte, as finish_lane reads it). */
static inline size_t lane_pos(const Lane *L, const uint8_t *src) { return (size_t)(L->p - src) * 8 - L->bits; }
static inline void lane_set(Lane *L, const uint8_t *src, size_t pos, const uint8_t *d) {
    const uint8_t *p = src + (pos >> 3);
    unsigned skip = pos & 7;
    L->k = (size_t)(d - L->dst);
    L->p = p + (skip != 0);
    L->buf = skip ? (uint64_t)(*p >> skip) : 0;
    L->bits = skip ? 8 - skip : 0;
}

/* Runs for nl (1 or 2) lanes on their own: what is left once the four no longer all can run. A lookup
 * gives one to three (or five) symbols, so the lanes drift apart: when the first is near its end another may have
 * hundreds of symbols left (the bench's K: ~370 a lane of 8192), which one symbol a lookup (finish_lane)
 * took 13% of the streams' decode. */
static inline __attribute__((always_inline)) void runs_apart(const uint8_t *src, Lane *const *L, int nl,
                                                             const void *t2, int mode) {
    size_t pos[2];
    uint8_t *d[2], *stop[2];
    const uint8_t *end[2];
    for (int i = 0; i < nl; i++)
        pos[i] = lane_pos(L[i], src), d[i] = L[i]->dst + L[i]->k, stop[i] = L[i]->dst + L[i]->cnt, end[i] = L[i]->end;
    for (size_t run; (run = safe_rounds(src, pos, end, d, stop, nl, mode));)
        for (; run; run--)
            for (int i = 0; i < nl; i++) {
                uint64_t b = load64(src + (pos[i] >> 3)) >> (pos[i] & 7);
                RUN_STEP(t2, b, pos[i], d[i], mode) RUN_STEP(t2, b, pos[i], d[i], mode)
                RUN_STEP(t2, b, pos[i], d[i], mode) RUN_STEP(t2, b, pos[i], d[i], mode)
            }
    for (int i = 0; i < nl; i++) lane_set(L[i], src, pos[i], d[i]);
}

/* After the four lanes side by side: the two with the most symbols left side by side while both can
 * run, then each alone; finish_lane does the last few. */
static inline __attribute__((always_inline)) void runs_tail(const uint8_t *src, Lane L[HUFF_LANES], const void *t2,
                                                            int mode) {
    for (;;) {
        int a = 0, b = 1;
        for (int i = 1; i < HUFF_LANES; i++) {
            size_t left = L[i].cnt - L[i].k;
            if (left > L[a].cnt - L[a].k) b = a, a = i;
            else if (i != b && (b == a || left > L[b].cnt - L[b].k)) b = i;
        }
        if (L[b].cnt - L[b].k < 32) break; /* little left: each alone */
        size_t before = L[a].k + L[b].k;
        Lane *two[2] = {&L[a], &L[b]};
        runs_apart(src, two, 2, t2, mode);
        if (L[a].k + L[b].k == before) break; /* one of them cannot run */
    }
    for (int i = 0; i < HUFF_LANES; i++) {
        Lane *one = &L[i];
        runs_apart(src, &one, 1, t2, mode);
    }
}

/* Four lanes side by side, for a complete table (nothing to test per symbol). Each lane's state is one
 * bit position from the stream's start (and, with runs, its output pointer): a round loads 8 bytes at
 * the position (57+ bits: four lookups of 11), makes four lookups per lane and moves the position on.
 * `pairs`: RUNS_SHORT, the table of runs (pair_table), each lookup one to three symbols (a 4-byte store,
 * the pointer moved by the count), or RUNS_LONG (long_runs_table), one to five (an 8-byte store); else
 * the plain table, one symbol a lookup. Inlined into a generic and a
 * BMI2 copy (shifts by any register: without them every variable shift waits on cl, measured 1.5x
 * slower). */
static inline __attribute__((always_inline)) void lanes_body(const uint8_t *src, Lane L[HUFF_LANES],
                                                             const void *table, int pairs) {
    size_t p0 = (size_t)(L[0].p - src) * 8, p1 = (size_t)(L[1].p - src) * 8;
    size_t p2 = (size_t)(L[2].p - src) * 8, p3 = (size_t)(L[3].p - src) * 8;
    uint8_t *d0 = L[0].dst + L[0].k, *d1 = L[1].dst + L[1].k, *d2 = L[2].dst + L[2].k, *d3 = L[3].dst + L[3].k;
    const uint8_t *const end[HUFF_LANES] = {L[0].end, L[1].end, L[2].end, L[3].end};
    uint8_t *const stop[HUFF_LANES] = {L[0].dst + L[0].cnt, L[1].dst + L[1].cnt, L[2].dst + L[2].cnt,
                                       L[3].dst + L[3].cnt};
    const uint16_t *t = table;
    for (;;) {
        const size_t pos[HUFF_LANES] = {p0, p1, p2, p3};
        uint8_t *const d[HUFF_LANES] = {d0, d1, d2, d3};
        size_t run = safe_rounds(src, pos, end, d, stop, HUFF_LANES, pairs);
        if (!run) break;
        if (pairs) {
            for (; run; run--) {
                uint64_t b0 = load64(src + (p0 >> 3)) >> (p0 & 7), b1 = load64(src + (p1 >> 3)) >> (p1 & 7);
                uint64_t b2 = load64(src + (p2 >> 3)) >> (p2 & 7), b3 = load64(src + (p3 >> 3)) >> (p3 & 7);
#define S(b, p, d) RUN_STEP(table, b, p, d, pairs)
                S(b0, p0, d0) S(b1, p1, d1) S(b2, p2, d2) S(b3, p3, d3)
                S(b0, p0, d0) S(b1, p1, d1) S(b2, p2, d2) S(b3, p3, d3)
                S(b0, p0, d0) S(b1, p1, d1) S(b2, p2, d2) S(b3, p3, d3)
                S(b0, p0, d0) S(b1, p1, d1) S(b2, p2, d2) S(b3, p3, d3)
#undef S
            }
        } else {
            size_t q = (size_t)(d1 - d0); /* the lanes' outputs move together: one pointer, one offset */
            uint8_t *o2 = d2;
            for (uint8_t *o_end = d0 + 4 * run; d0 < o_end; d0 += 4, o2 += 4) {
                uint64_t b0 = load64(src + (p0 >> 3)) >> (p0 & 7), b1 = load64(src + (p1 >> 3)) >> (p1 & 7);
                uint64_t b2 = load64(src + (p2 >> 3)) >> (p2 & 7), b3 = load64(src + (p3 >> 3)) >> (p3 & 7);
#define S(b, p, d, j)                               \
    {                                               \
        uint32_t e_ = t[b & TABLE_MASK];            \
        d[j] = ENTRY_SYM(e_);                       \
        b >>= e_ & 63;                              \
        p += ENTRY_LEN(e_);                         \
    }
                S(b0, p0, d0, 0) S(b1, p1, d0, q) S(b2, p2, o2, 0) S(b3, p3, o2, q)
                S(b0, p0, d0, 1) S(b1, p1, d0, q + 1) S(b2, p2, o2, 1) S(b3, p3, o2, q + 1)
                S(b0, p0, d0, 2) S(b1, p1, d0, q + 2) S(b2, p2, o2, 2) S(b3, p3, o2, q + 2)
                S(b0, p0, d0, 3) S(b1, p1, d0, q + 3) S(b2, p2, o2, 3) S(b3, p3, o2, q + 3)
#undef S
            }
            d1 = d0 + q, d2 = o2, d3 = o2 + q;
        }
    }
    const size_t pos[HUFF_LANES] = {p0, p1, p2, p3};
    uint8_t *const d[HUFF_LANES] = {d0, d1, d2, d3};
    for (int i = 0; i < HUFF_LANES; i++) lane_set(&L[i], src, pos[i], d[i]);
    if (pairs) runs_tail(src, L, table, pairs);
}

static void lanes_1(const uint8_t *src, Lane L[HUFF_LANES], const void *t) { lanes_body(src, L, t, RUNS_NONE); }
static void lanes_2(const uint8_t *src, Lane L[HUFF_LANES], const void *t) { lanes_body(src, L, t, RUNS_SHORT); }
static void lanes_5(const uint8_t *src, Lane L[HUFF_LANES], const void *t) { lanes_body(src, L, t, RUNS_LONG); }
#if KV_X86
__attribute__((target("bmi2"))) static void lanes_1_bmi2(const uint8_t *src, Lane L[HUFF_LANES], const void *t) {
    lanes_body(src, L, t, RUNS_NONE);
}
__attribute__((target("bmi2"))) static void lanes_2_bmi2(const uint8_t *src, Lane L[HUFF_LANES], const void *t) {
    lanes_body(src, L, t, RUNS_SHORT);
}
__attribute__((target("bmi2"))) static void lanes_5_bmi2(const uint8_t *src, Lane L[HUFF_LANES], const void *t) {
    lanes_body(src, L, t, RUNS_LONG);
}
#endif

typedef void (*LanesFn)(const uint8_t *, Lane *, const void *);

/* The fast loops this CPU runs, by what a lookup gives: RUNS_NONE one symbol, RUNS_SHORT runs of up to
 * three, RUNS_LONG of up to five. */
static void lanes_fns(LanesFn fn[3]) {
    fn[RUNS_NONE] = lanes_1, fn[RUNS_SHORT] = lanes_2, fn[RUNS_LONG] = lanes_5;
#if KV_X86
    if (__builtin_cpu_supports("bmi2"))
        fn[RUNS_NONE] = lanes_1_bmi2, fn[RUNS_SHORT] = lanes_2_bmi2, fn[RUNS_LONG] = lanes_5_bmi2;
#endif
}

static void lane_init(Lane *L, const uint8_t *start, size_t len, size_t cnt, uint8_t *dst) {
    L->start = L->p = start;
    L->end = start + len;
    L->buf = 0;
    L->bits = 0;
    L->k = 0;
    L->cnt = cnt;
    L->dst = dst;
}

/* A stream's decoding tables, from its code lengths (the head's first 128 bytes, kept as stored). A
 * decode keeps the last two built and a stream whose lengths are the same bytes takes them as they are:
 * kvcodec's encoder gives a section's heads one set of lengths where that costs little
 * (huff_encode_many), so their tables are built once a section instead of once a stream. */
typedef struct {
    uint8_t head[HUFF_TABLE_BYTES];
    int built; /* head and the tables hold a checked stream's */
    int runs;  /* the table of runs built too: RUNS_SHORT (t2.r3) or RUNS_LONG (t2.r5) */
    uint16_t t[TABLE_SIZE];
    uint16_t code[256];
    uint8_t cl[256];
    uint32_t kraft, mean; /* the lengths' Kraft sum and own mean (sum l 2^-l), both x 2^11 */
    unsigned shortest;    /* the shortest code's length */
    union {
        uint32_t r3[TABLE_SIZE];
        uint64_t r5[TABLE_SIZE];
    } t2;
} Tables;

/* One stream being decoded: its tables, lanes and where its symbols go. */
typedef struct {
    Tables *tab;
    Lane L[HUFF_LANES];
    uint8_t *dst, *out;
    size_t n, row, stride;
} Stream;

/* A stream's canonical codes (assign_codes, as the encoder's) and decoding table, from its
 * present symbols sym[0 .. m) in symbol order and the count of each length: the table built by doubling
 * (the entries of the codes of up to l bits in t[0 .. 2^l), copied to t[2^l .. 2^(l+1)), then the
 * (l+1)-bit codes written), so that each code is written once and the rest is copying; holes stay 0.
 * Only present symbols are visited (V's exponents: 16 of 256), and code[] is set for them alone. */
static void decode_tables(Tables *tb, const uint8_t *sym, int m, const unsigned count[HUFF_MAX_LEN + 1]) {
    assign_codes(tb->cl, sym, m, count, tb->code);
    unsigned start[HUFF_MAX_LEN + 2], at[HUFF_MAX_LEN + 2];
    start[1] = 0;
    for (int l = 1; l <= HUFF_MAX_LEN; l++) start[l + 1] = start[l] + count[l];
    memcpy(at, start, sizeof at);
    uint8_t by_len[256];
    for (int i = 0; i < m; i++) by_len[at[tb->cl[sym[i]]]++] = sym[i];
    uint16_t *t = tb->t;
    t[0] = t[1] = 0;
    for (unsigned l = 1; l <= HUFF_MAX_LEN; l++) {
        if (l > 1) memcpy(t + (1u << (l - 1)), t, sizeof *t << (l - 1));
        for (unsigned i = start[l]; i < start[l + 1]; i++)
            t[tb->code[by_len[i]]] = (uint16_t)(l | (unsigned)by_len[i] << 8);
    }
}

/* The code lengths of head src (HUFF_TABLE_BYTES) read and checked for n symbols, and tb's tables built
 * from them (tb not built on a refusal). */
static int build_tables(Tables *tb, const uint8_t *src, size_t n) {
    uint8_t *cl = tb->cl, sym[256];
    uint32_t kraft = 0, mean = 0;
    unsigned count[HUFF_MAX_LEN + 1] = {0}, shortest = HUFF_MAX_LEN + 1;
    int m = 0;
    tb->built = tb->runs = 0;
    for (int i = 0; i < HUFF_TABLE_BYTES; i++) {
        cl[2 * i] = src[i] & 15;
        cl[2 * i + 1] = src[i] >> 4;
    }
    for (int s = 0; s < 256; s++) {
        unsigned l = cl[s];
        if (!l) continue;
        if (l > HUFF_MAX_LEN) return HUFF_BAD_LENGTH;
        kraft += 1u << (HUFF_MAX_LEN - l), mean += l << (HUFF_MAX_LEN - l);
        count[l]++;
        shortest = l < shortest ? l : shortest;
        sym[m++] = (uint8_t)s;
    }
    if (kraft > TABLE_SIZE) return HUFF_OVERSUBSCRIBED;
    if (!kraft && n) return HUFF_NO_SYMBOLS;
    decode_tables(tb, sym, m, count);
    tb->kraft = kraft, tb->mean = mean, tb->shortest = shortest;
    memcpy(tb->head, src, HUFF_TABLE_BYTES);
    tb->built = 1;
    return HUFF_OK;
}

/* The tables of head src: a slot of pool's where built from the same lengths, else built into one that is
 * not `busy` (another stream's, still to be decoded; two slots then). */
static int tables_for(Tables **tab, const uint8_t *src, size_t n, Tables *pool, int slots, const Tables *busy) {
    for (int j = 0; j < slots; j++)
        if (pool[j].built && !memcmp(pool[j].head, src, HUFF_TABLE_BYTES)) {
            *tab = &pool[j];
            return HUFF_OK; /* n is the same for every stream of a call: the same checks pass */
        }
    *tab = busy == &pool[0] && slots > 1 ? &pool[1] : &pool[0];
    return build_tables(*tab, src, n);
}

/* The stream's head read and checked, its tables found or built and its lanes laid out; nothing
 * written. */
static int prepare(Stream *st, const uint8_t *src, size_t len, size_t n, uint8_t *out, size_t row, size_t stride,
                   uint8_t *scratch, Tables *pool, int slots, const Tables *busy) {
    if (len < HUFF_HEAD_BYTES) return HUFF_SHORT_HEAD;
    int err = tables_for(&st->tab, src, n, pool, slots, busy);
    if (err) return err;
    size_t lane_len[HUFF_LANES], rest = len - HUFF_HEAD_BYTES;
    for (int i = 0; i < HUFF_LANES - 1; i++) {
        lane_len[i] = load32(src + HUFF_TABLE_BYTES + 4 * i);
        if (lane_len[i] > rest) return HUFF_LANES_PAST_END;
        rest -= lane_len[i];
    }
    lane_len[3] = rest;
    st->n = n, st->row = row, st->stride = stride, st->out = out;
    st->dst = row < stride && n ? scratch : out;
    size_t q = (n + HUFF_LANES - 1) / HUFF_LANES;
    const uint8_t *at = src + HUFF_HEAD_BYTES;
    for (int i = 0; i < HUFF_LANES; i++) {
        lane_init(&st->L[i], at, lane_len[i], lane_count(n, q, i), st->dst + q * (size_t)i);
        at += lane_len[i];
    }
    return HUFF_OK;
}

/* Whether the fast loops take the stream (a complete table, enough symbols), and with runs. */
static inline int fast(const Stream *st) { return st->tab->kraft == TABLE_SIZE && st->n >= 64; }
static inline int with_pairs(const Stream *st) { return st->tab->mean <= PAIR_MEAN * TABLE_SIZE; }

/* Each lane's rest, in lane order (the first refusal returned), then the symbols into their rows. */
static int finish(Stream *st) {
    for (int i = 0; i < HUFF_LANES; i++) {
        int err = finish_lane(&st->L[i], st->tab->t);
        if (err) return err;
    }
    if (st->dst != st->out)
        for (size_t r = 0, o = 0; o < st->n; r++, o += st->row) memcpy(st->out + r * st->stride, st->dst + o, st->row);
    return HUFF_OK;
}

/* One stream's four lanes side by side (runs where its codes are short: their table built once for
 * its tables; long runs where the shortest code has 2 bits, so that up to five fit a window: with one of
 * 1 bit a run of three would be cut short, with none under 3 bits no four fit). */
static void run_fast(Stream *st, const uint8_t *src) {
    LanesFn fn[3];
    lanes_fns(fn);
    Tables *tb = st->tab;
    if (!with_pairs(st)) {
        fn[RUNS_NONE](src, st->L, tb->t);
    } else if (tb->shortest == 2) {
        if (tb->runs != RUNS_LONG) long_runs_table(tb->cl, tb->t, tb->t2.r5), tb->runs = RUNS_LONG;
        fn[RUNS_LONG](src, st->L, tb->t2.r5);
    } else {
        if (tb->runs != RUNS_SHORT) pair_table(tb->cl, tb->code, tb->t, tb->t2.r3), tb->runs = RUNS_SHORT;
        fn[RUNS_SHORT](src, st->L, tb->t2.r3);
    }
}

int huff_decode(const uint8_t *src, size_t len, size_t n, uint8_t *out, size_t row, size_t stride,
                uint8_t *scratch) {
    Stream st;
    Tables tab;
    tab.built = 0;
    int err = prepare(&st, src, len, n, out, row, stride, scratch, &tab, 1, NULL);
    if (err) return err;
    if (fast(&st)) run_fast(&st, src);
    return finish(&st);
}

/* ------------------------------------------------------------------ two streams at once */

/* Two streams' eight lanes side by side: one stream's four chains of dependent lookups (shift, mask,
 * load, shift) keep a core waiting on its L1 most of the time; eight keep it busy (measured on V's
 * codes: 1.3x the symbols a second of one stream at a time). For two streams of one length n (a
 * multiple of 4) with complete tables and one symbol a lookup, the second's symbols written right after
 * the first's, so that the eight lanes' outputs lie q apart. A lane's state in a round is its bit
 * buffer alone: 7 bytes loaded with a 1 above them (the sentinel), so the bits a round used are read
 * off the sentinel's place (count of leading zeros) and no position is added up per symbol. */

static inline __attribute__((always_inline)) void pair_body(const uint8_t *src, Stream st[2]) {
    Lane *L[8] = {&st[0].L[0], &st[0].L[1], &st[0].L[2], &st[0].L[3],
                  &st[1].L[0], &st[1].L[1], &st[1].L[2], &st[1].L[3]};
    int64_t pos[8]; /* each lane's bit position from src */
    for (int i = 0; i < 8; i++) pos[i] = (int64_t)(L[i]->p - src) * 8;
    uint8_t *o = L[0]->dst, *const base = o;
    const size_t q = (size_t)(L[1]->dst - L[0]->dst);
    const uint16_t *t = st[0].tab->t, *u = st[1].tab->t; /* the same table when they share lengths */
    const uint64_t low56 = 0x00FFFFFFFFFFFFFFull, sentinel = 1ull << 56;
    for (;;) {
        size_t done = (size_t)(o - base), run = SIZE_MAX; /* rounds every lane can run (as safe_rounds) */
        for (int i = 0; i < 8; i++) {
            const uint8_t *p = src + (pos[i] >> 3);
            size_t r = L[i]->end - p < 8 ? 0 : (size_t)(L[i]->end - 8 - p) / 6 + 1, w = (L[i]->cnt - done) / 4;
            run = r < run ? r : run;
            run = w < run ? w : run;
        }
        if (!run) break;
        uint8_t *o3 = o + 3 * q, *o6 = o + 6 * q;
        for (uint8_t *o_end = o + 4 * run; o < o_end; o += 4, o3 += 4, o6 += 4) {
#define LD(i) (((load64(src + (pos[i] >> 3)) & low56) | sentinel) >> (pos[i] & 7))
            uint64_t x0 = LD(0), x1 = LD(1), x2 = LD(2), x3 = LD(3), y0 = LD(4), y1 = LD(5), y2 = LD(6), y3 = LD(7);
#define S(tab, b, d)                                \
    {                                               \
        uint32_t e_ = (tab)[b & TABLE_MASK];        \
        d = ENTRY_SYM(e_);                          \
        b >>= e_ & 63;                              \
    }
#define R(j)                                                                                          \
    S(t, x0, o[j]) S(t, x1, o[q + j]) S(t, x2, o[2 * q + j]) S(t, x3, o3[j])                          \
    S(u, y0, o3[q + j]) S(u, y1, o3[2 * q + j]) S(u, y2, o6[j]) S(u, y3, o6[q + j])
            R(0) R(1) R(2) R(3)
#define UP(i, b) pos[i] = (pos[i] & ~(int64_t)7) + (int64_t)__builtin_clzll(b) - 7;
            UP(0, x0) UP(1, x1) UP(2, x2) UP(3, x3) UP(4, y0) UP(5, y1) UP(6, y2) UP(7, y3)
#undef UP
#undef R
#undef S
#undef LD
        }
    }
    for (int i = 0; i < 8; i++) { /* back to a byte pointer and the bits left of its byte (as lanes_body) */
        const uint8_t *p = src + (pos[i] >> 3);
        unsigned skip = (unsigned)(pos[i] & 7);
        L[i]->k = (size_t)(o - base);
        L[i]->p = p + (skip != 0);
        L[i]->buf = skip ? (uint64_t)(*p >> skip) : 0;
        L[i]->bits = skip ? 8 - skip : 0;
    }
}

static void pair_lanes(const uint8_t *src, Stream st[2]) { pair_body(src, st); }
#if KV_X86
__attribute__((target("bmi2,lzcnt"))) static void pair_lanes_bmi2(const uint8_t *src, Stream st[2]) { pair_body(src, st); }
#endif

/* Whether st[0] can lead a pair, and st[1] follow it (the second's symbols right after the first's). */
static inline int pair_lead(const Stream *a) { return fast(a) && !with_pairs(a) && a->n % HUFF_LANES == 0; }
static inline int pair_follows(const Stream *a, const Stream *b) {
    return pair_lead(b) && b->n == a->n && b->dst == a->dst + a->n;
}

int huff_decode_many(const uint8_t *src, const size_t *spans, size_t count, size_t n, uint8_t *out,
                     size_t out_step, size_t row, size_t stride, uint8_t *scratch, size_t *failed) {
    Stream st[2];
    Tables pool[2]; /* the last tables built (st[0]'s and st[1]'s, or kept for a next stream) */
    pool[0].built = pool[1].built = 0;
    int have_next = 0, err;
    void (*pair_fn)(const uint8_t *, Stream *) = pair_lanes;
#if KV_X86
    if (__builtin_cpu_supports("bmi2") && __builtin_cpu_supports("lzcnt")) pair_fn = pair_lanes_bmi2;
#endif
    for (size_t i = 0; i < count; i++) {
        *failed = i;
        if (have_next) { /* the stream prepared as a follower that could not follow: it leads now */
            memcpy(&st[0], &st[1], sizeof st[0]);
            have_next = 0;
        } else if ((err = prepare(&st[0], src + spans[2 * i], spans[2 * i + 1], n, out + i * out_step, row, stride,
                                  scratch, pool, 2, NULL))) {
            return err;
        }
        if (i + 1 < count && pair_lead(&st[0])) {
            uint8_t *room = scratch && st[0].dst == scratch ? scratch + n : scratch; /* each its own scratch */
            if (prepare(&st[1], src + spans[2 * i + 2], spans[2 * i + 3], n, out + (i + 1) * out_step, row, stride,
                        room, pool, 2, st[0].tab) == HUFF_OK) {
                if (pair_follows(&st[0], &st[1])) {
                    pair_fn(src, st);
                    if ((err = finish(&st[0]))) return err;
                    *failed = ++i;
                    if ((err = finish(&st[1]))) return err;
                    continue;
                }
                have_next = 1;
            } /* else: it is prepared again, and refused, as the next one's turn comes */
        }
        if (fast(&st[0])) run_fast(&st[0], src + spans[2 * i]);
        if ((err = finish(&st[0]))) return err;
    }
    return HUFF_OK;
}
