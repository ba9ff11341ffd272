/* CRC-32 for the drivers: zlib's CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, initial and final
 * XOR 0xFFFFFFFF), the CRC the format uses (kvcodec/format/crc.py, ISA-L's crc32_gzip_refl or zlib.crc32:
 * the same value). Computed inside the encode and decode passes over slices still in cache, so the
 * payload is not read a second time. Long runs take the level's fold (crc_clmul.c, crc_vclmul.c); short
 * runs and tails go byte by byte through a table. A level without folds (0) makes the drivers leave
 * the CRC to kvcodec.format.crc. */
#include "kv.h"

static uint32_t crc_table[256];

void kv_crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* The running (pre-inverted) state over n bytes, one byte at a time. */
uint32_t kv_crc_bytes(uint32_t state, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) state = crc_table[(state ^ p[i]) & 0xFF] ^ (state >> 8);
    return state;
}

/* The running state continued over n bytes: folded where it pays (512-bit lanes from 256 bytes at
 * level 2, 128-bit lanes from 128 bytes), byte by byte otherwise. */
uint32_t kv_crc_update(const KvCrcOps *ops, uint32_t state, const uint8_t *p, size_t n) {
    if (ops->narrow && n >= 128) {
        size_t body = n & ~(size_t)15;
        state = ops->wide && body >= 256 ? ops->wide(state, p, body) : ops->narrow(state, p, body);
        p += body;
        n -= body;
    }
    return kv_crc_bytes(state, p, n);
}

/* n bytes copied from src to dst (not overlapping) with the running state carried over them, in one
 * pass where the folding runs. */
uint32_t kv_crc_copy(const KvCrcOps *ops, uint32_t state, uint8_t *dst, const uint8_t *src, size_t n) {
    if (ops->narrow && n >= 128) {
        size_t body = n & ~(size_t)15;
        state = ops->wide && body >= 256 ? ops->wide_copy(state, dst, src, body)
                                         : ops->narrow_copy(state, dst, src, body);
        dst += body, src += body, n -= body;
    }
    memcpy(dst, src, n);
    return kv_crc_bytes(state, src, n);
}

/* crc32_combine: the CRC of A || B from crc_a = CRC(A) and crc_b = CRC(B) (both from 0), multiplying
 * crc_a by x^(8 |B|) mod P in the reflected representation (bit 31 is x^0), by squaring. For a CRC
 * computed in two parts out of order (the codes before K, in the scatter's pre-pass). */
static uint32_t gf2_mulmod(uint32_t a, uint32_t b) {
    uint32_t p = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m) p ^= b;
        b = b & 1 ? (b >> 1) ^ 0xEDB88320u : b >> 1;
    }
    return p;
}

uint32_t kv_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    uint32_t sq = 1u << 23;    /* x^8: one byte */
    uint32_t shift = 1u << 31; /* x^0 */
    for (; len_b; len_b >>= 1) {
        if (len_b & 1) shift = gf2_mulmod(sq, shift);
        sq = gf2_mulmod(sq, sq);
    }
    return gf2_mulmod(shift, crc_a) ^ crc_b;
}

/* zlib.crc32(data, crc): the CRC of p[0..n) continuing from crc. */
uint32_t kv_crc32(const KvCrcOps *ops, uint32_t crc, const void *p, size_t n) {
    return ~kv_crc_update(ops, ~crc, (const uint8_t *)p, n);
}

/* A driver's CRC (KvCrc, slices from memory) continued over n bytes. */
void kv_crc_run(KvCrc *crc, const void *p, size_t n) { crc->state = kv_crc_update(crc->ops, crc->state, p, n); }

/* The optional copy (K's bytes) with a driver's CRC continued over it (not overlapping: the glue
 * checks), or a plain memmove when no CRC is wanted (source and destination may overlap then). */
void kv_copy_bytes(const KvCopy *copy, KvCrc *crc) {
    if (!copy->n) return;
    if (crc)
        crc->state = kv_crc_copy(crc->ops, crc->state, (uint8_t *)copy->dst, (const uint8_t *)copy->src, copy->n);
    else
        memmove(copy->dst, copy->src, copy->n);
}
