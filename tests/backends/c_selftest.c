/* The C library without Python (`make test-cross`): fixed inputs through the drivers (encode every V
 * dtype and scope, dequantize to every output dtype, the scatter with K and its CRC, a NaN code), at
 * the level given (rows, CRC) and with the AVX-512 folds emulated, every output hashed. Builds for
 * other levels, ISAs or machines print the same lines exactly when their bytes agree. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_layout.h"
#include "planes.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float next(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return ((float)(rng >> 40) / (float)(1 << 24) - 0.5f) * 12.0f;
}

static uint32_t hash(const void *p, size_t n) { return ~kv_crc_bytes(~0u, (const uint8_t *)p, n); }

/* A blob's K and codes into a cache view of 4 blocks x 16 slots, runs out of token order, with the CRC
 * through K and the codes; then a NaN code, declined with nothing written. */
static void scatter_check(const KvLevel *lv, uint8_t *kbytes) {
    enum { T = 40, H = 2, D = 64, N = 4, S = 16 };
    static uint8_t q[T * H * D];
    static uint16_t cache[N * H * S * 2 * D];
    static float sc[H] = {0.25f, 3.0f};
    for (int i = 0; i < T * H * D; i++) q[i] = (uint8_t)((i * 37) % 0x7E);
    KvRows qr = {(char *)q, T, H, D, H * D, D, 1};
    KvRows kr = {(char *)kbytes, T, H, 2 * D, H * 2 * D, 2 * D, 1};
    KvCache c = {(char *)cache, N, H, S, 2 * D, H * S * 2 * D * 2, S * 2 * D * 2, 2 * D * 2, 2};
    const int64_t runs[] = {2, 0, 16, 16, 0, 4, 0, 12, 3, 0, 32, 8};
    for (int ordered = 0; ordered < 2; ordered++) {
        const int64_t *r = ordered ? runs + 4 : runs; /* the first run out of token order, or skipped */
        kv_ssize nq = ordered ? 8 : 12;
        memset(cache, 0, sizeof cache);
        ScatterJob job = {&qr, &kr, &c, sc, SC_LAYER_HEAD, 1, c.base + D * 2, c.base, (size_t)kr.D};
        KvCrc crc = {lv->crc, ~0u};
        const char *why = kv_scatter_dequant(lv, &job, DT_F16, r, nq, H, lv->crc->level ? &crc : NULL);
        uint32_t want = ~kv_crc_bytes(kv_crc_bytes(~0u, kbytes, (size_t)(T * H * 2 * D)), q, sizeof q);
        printf("scatter %d %s cache=%08x crc=%08x\n", ordered, why ? why : "ok", hash(cache, sizeof cache),
               lv->crc->level ? ~crc.state : want);
    }
    q[17 * H * D + 5] = 0xFF;
    memset(cache, 0, sizeof cache);
    ScatterJob job = {&qr, NULL, &c, sc, SC_LAYER_HEAD, 1, c.base + D * 2, c.base, 0};
    const char *why = kv_scatter_dequant(lv, &job, DT_F16, runs, 12, H, NULL);
    printf("scatter nan %s cache=%08x\n", why ? why : "ok", hash(cache, sizeof cache));
}

/* K's byte planes (the lossless payload): 19 tokens (two 8-token runs and a tail) x 3 heads x 5, split
 * and merged back; the planes hashed, the round trip checked byte for byte. */
static void planes_check(void) {
    enum { T = 19, E = 15 };
    uint8_t k[2 * T * E], hi[T * E], lo[T * E], back[2 * T * E];
    for (size_t i = 0; i < sizeof k; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        k[i] = (uint8_t)(rng >> 56);
    }
    kv_planes_split(k, hi, lo, T, E);
    kv_planes_merge(hi, lo, back, T, E);
    printf("planes hi=%08x lo=%08x %s\n", hash(hi, sizeof hi), hash(lo, sizeof lo),
           memcmp(k, back, sizeof k) ? "MISMATCH" : "round trip");
}

int main(int argc, char **argv) {
    int simd = argc > 1 ? atoi(argv[1]) : 0, crc_level = argc > 2 ? atoi(argv[2]) : 0;
    kv_dispatch_init();
    enum { T = 70, H = 3, D = 128 };
    static uint8_t v[T * H * D * 4], q[T * H * D], k[T * H * D * 2], kout[T * H * D * 2], out[T * H * D * 4];
    static float scales[T * H];
    for (int i = 0; i < T * H * D * 2; i++) { next(); k[i] = (uint8_t)(rng >> 56); }
    for (int lvl = 0; lvl < 2; lvl++) {
        KvLevel lv = lvl ? kv_level_emulated(simd, crc_level, 1) : kv_level(simd, crc_level, 1);
        for (int vdt = 0; vdt < 3; vdt++) {
            int isz = vdt == DT_F32 ? 4 : 2;
            for (int i = 0; i < T * H * D; i++) {
                float x = next();
                if (vdt == DT_F16) ((uint16_t *)v)[i] = f32_to_f16(x);
                if (vdt == DT_BF16) ((uint16_t *)v)[i] = f32_to_bf16(x);
                if (vdt == DT_F32) ((float *)v)[i] = x;
            }
            KvRows vr = {(char *)v, T, H, D, H * D * isz, D * isz, isz};
            KvRows qr = {(char *)q, T, H, D, H * D, D, 1};
            for (int scope = 0; scope < 3; scope++) {
                kv_ssize page = scope == SC_PAGE_HEAD ? 16 : 1, ng = groups_of(T, H, scope, page);
                KvCopy copy = {kout, k, sizeof k};
                KvCrc crc = {lv.crc, ~0u};
                const char *why = kv_encode_v(&lv, &vr, &qr, vdt, scope, page, DT_F16, scales, ng, &copy,
                                              lv.crc->level ? &crc : NULL);
                uint32_t blob_crc = lv.crc->level ? ~crc.state : ~kv_crc_bytes(kv_crc_bytes(~0u, kout, sizeof kout), q, sizeof q);
                printf("encode v%d s%d %s q=%08x s=%08x crc=%08x\n", vdt, scope, why ? why : "ok", hash(q, sizeof q),
                       hash(scales, (size_t)ng * 4), blob_crc);
                for (int odt = 0; odt < 3; odt++) {
                    int osz = odt == DT_F32 ? 4 : 2;
                    KvRows o = {(char *)out, T, H, D, H * D * osz, D * osz, osz};
                    KvCopy none = {NULL, NULL, 0};
                    KvCrc c2 = {lv.crc, ~0u};
                    why = kv_dequantize(&lv, &qr, &o, odt, scope, page, scales, ng, &none, lv.crc->level ? &c2 : NULL);
                    printf("  decode o%d %s out=%08x\n", odt, why ? why : "ok", hash(out, (size_t)T * H * D * osz));
                }
            }
        }
        scatter_check(&lv, k);
        printf("crc32 %08x\n", kv_crc32(lv.crc, 0, k, sizeof k));
    }
    planes_check();
    return 0;
}
