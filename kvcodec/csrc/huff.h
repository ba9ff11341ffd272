/* The lossless payload's Huffman streams (huff.c; docs/FORMAT.md, "Huffman stream"): one order-0
 * canonical Huffman stream of n byte symbols, code lengths <= 11, four interleaved lanes. Portable C (no
 * Python); py_huff.c is the entry. */
#ifndef KV_HUFF_H
#define KV_HUFF_H

#include <stddef.h>
#include <stdint.h>

#define HUFF_MAX_LEN 11
#define HUFF_TABLE_BYTES 128 /* code lengths of symbols 0..255, 4 bits each */
#define HUFF_LANES 4
#define HUFF_HEAD_BYTES (HUFF_TABLE_BYTES + 4 * (HUFF_LANES - 1)) /* the table, then lanes 0..2's lengths */

/* Why a stream is refused (huff_decode's return; 0 = decoded). kvcodec/format/coding.py's HUFF_ERRORS
 * names each for the Python side: keep the numbers in step. */
enum {
    HUFF_OK = 0,
    HUFF_SHORT_HEAD = 1,      /* fewer bytes than the table and lane lengths */
    HUFF_BAD_LENGTH = 2,      /* a code length over HUFF_MAX_LEN */
    HUFF_OVERSUBSCRIBED = 3,  /* the lengths' Kraft sum exceeds 1 */
    HUFF_NO_SYMBOLS = 4,      /* n > 0 symbols and no code */
    HUFF_LANES_PAST_END = 5,  /* lanes 0..2's lengths exceed the stream */
    HUFF_UNASSIGNED = 6,      /* a lane's bits hit a code no symbol has */
    HUFF_LANE_SHORT = 7,      /* a lane's bits run out before its symbols */
    HUFF_LANE_LONG = 8,       /* a lane stores more bytes than its bits need */
    HUFF_BAD_PADDING = 9,     /* a lane's padding bits are not zero */
};

/* The most bytes a stream of n symbols takes: the head, 11 bits a symbol, a padding byte per lane. */
static inline size_t huff_bound(size_t n) { return HUFF_HEAD_BYTES + (n * HUFF_MAX_LEN + 7) / 8 + HUFF_LANES; }

/* Code lengths (0 = absent) of the symbols counted in freq: length-limited Huffman, deterministic. */
void huff_lengths(const uint64_t freq[256], uint8_t len[256]);

/* The stream of n symbols src[(j / row) * stride + j % row] (n a multiple of row; row <= stride) into
 * out (cap bytes). Returns the bytes written, or -1 (nothing promised written) when cap is too small.
 * scratch: n bytes the caller owns, used when row < stride (may be NULL otherwise). */
ptrdiff_t huff_encode(const uint8_t *src, size_t n, size_t row, size_t stride, uint8_t *out, size_t cap,
                      uint8_t *scratch);

/* huff_encode's stream of n symbols below 16 (n a multiple of 8) given as pairs, symbol 2i in the low
 * nibble of pairs[i] (n / 2 bytes): the same bytes, each lane's symbols counted and coded two at a time. */
ptrdiff_t huff_encode_pairs(const uint8_t *pairs, size_t n, uint8_t *out, size_t cap);

/* A section's streams: count streams of n symbols, stream i's src[i x step + (j / row) x stride + j % row]
 * (n a multiple of row, row <= stride), or with `pairs` symbols below 16 given two a byte in the n / 2
 * contiguous bytes from src + i x step (n a multiple of 8; row and stride unused). */
typedef struct {
    const uint8_t *src;
    size_t step, count, n, row, stride;
    int pairs;
} HuffSection;

/* A stream takes its section's shared code lengths (those of all its streams' symbols together) where they
 * cost it at most 1 / HUFF_SHARE_SLACK more bits than its own: a decoder then builds their tables once a
 * section (SmolLM2's KV, make lossless-ratio: K's streams 0.8% more bits, V's 0.4%, blobs 0.5555 -> 0.5566
 * of raw bf16). kvcodec/codec/huffman.py's SHARE_SLACK: keep them in step. */
#define HUFF_SHARE_SLACK 32

typedef struct HuffCounted HuffCounted;
typedef struct HuffWide HuffWide;

/* The bytes of work huff_encode_section needs for count streams (of byte symbols, or pairs): their counts
 * (~10 KiB a stream), and for byte symbols a table of two symbols' codes (320 KiB); 0 when the size
 * overflows. */
size_t huff_section_work(size_t count, int pairs);

/* The section's streams coded one after another into out (cap bytes), stream i's bytes in lens[i], each with
 * the section's shared lengths or its own (HUFF_SHARE_SLACK): the same bytes as huff_encode of each with
 * those lengths. Returns the bytes written, or -1 when they do not fit. work: huff_section_work(count,
 * pairs) bytes, aligned for uint64_t; scratch: count x n bytes where row < stride (else NULL). */
ptrdiff_t huff_encode_section(const HuffSection *s, uint8_t *out, size_t cap, size_t *lens, void *work,
                              uint8_t *scratch);

/* Decode stream src[0 .. len) to exactly n symbols written as huff_encode reads them from out. Returns
 * HUFF_OK or the first refusal (the first lane in order that fails; the first failure in a lane). Reads
 * only src[0 .. len); writes only the n symbols' places (possibly some of them before a refusal).
 * scratch: n bytes, used when row < stride. */
int huff_decode(const uint8_t *src, size_t len, size_t n, uint8_t *out, size_t row, size_t stride,
                uint8_t *scratch);

/* The count streams src[spans[2i] .. spans[2i] + spans[2i + 1]) decoded, stream i's n symbols written as
 * huff_decode writes them at out + i * out_step, two streams at a time where they allow it (the same
 * bytes as one at a time). Returns HUFF_OK, or the first refusal in stream order with *failed its stream.
 * scratch: 2n bytes, used when row < stride. */
int huff_decode_many(const uint8_t *src, const size_t *spans, size_t count, size_t n, uint8_t *out,
                     size_t out_step, size_t row, size_t stride, uint8_t *scratch, size_t *failed);

#endif
