/* The one place a level is chosen: the CPU's features read once at import, every tier's table filled
 * once (each tier over the one below: it replaces what it does differently), never changed after.
 * KVCODEC_CPU_LEVEL (scalar|avx2|avx512, or 0|1|2) caps the rows and the CRC folding at a level (the
 * CPU's best when unset, or when it names more than the CPU has). A build without the x86 tiers
 * (KV_PORTABLE_ONLY, or another architecture) has level 0 only. */
#include <stdlib.h>
#include <strings.h>

#include "kv.h"

static KvRowOps rows_tier[3];
static KvCrcOps crc_tier[3];
static KvFoldOps fold_ops;
static KvRowOps rows_emulated[3]; /* each tier with fold_emul.c's tables */
static KvFoldOps fold_emulated;
static int best_simd, best_crc;

#if KV_X86
#include <cpuid.h>

/* The CPU's features from CPUID (leaves 1 and 7), and whether the OS saves the registers they use
 * (XCR0: ymm state for AVX, the opmask and zmm state for AVX-512), as zlib-ng's x86_features.c reads
 * them: one way for GCC and clang alike. */
typedef struct {
    int avx2, avx512, pclmul, vpclmul;
} X86Features;

static X86Features x86_features(void) {
    X86Features f = {0, 0, 0, 0};
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    int sse41 = c >> 19 & 1, fma = c >> 12 & 1, osxsave = c >> 27 & 1, avx = c >> 28 & 1, f16c = c >> 29 & 1;
    f.pclmul = (c >> 1 & 1) && sse41;
    uint32_t lo = 0, hi = 0;
    if (osxsave) __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    int ymm = (lo & 0x6u) == 0x6u, zmm = (lo & 0xE6u) == 0xE6u;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
    f.avx2 = avx && ymm && fma && f16c && (b >> 5 & 1);
    int f512 = b >> 16 & 1, dq = b >> 17 & 1, bw = b >> 30 & 1, vl = b >> 31 & 1;
    f.avx512 = f.avx2 && zmm && f512 && dq && bw && vl;
    f.vpclmul = f.pclmul && f.avx512 && (c >> 10 & 1);
    return f;
}
#endif

/* The best row level the CPU runs: 0 portable, 1 AVX2 + F16C + FMA, 2 AVX-512 (F, VL, BW, DQ). */
static int cpu_simd_level(void) {
#if KV_X86
    X86Features f = x86_features();
    return f.avx512 ? 2 : f.avx2 ? 1 : 0;
#else
    return 0;
#endif
}

/* The best CRC folding the CPU runs: 0 none, 1 PCLMULQDQ on 128-bit lanes, 2 VPCLMULQDQ on 512-bit
 * registers (with AVX-512F/BW/VL/DQ). */
static int cpu_crc_level(void) {
#if KV_X86
    X86Features f = x86_features();
    return f.vpclmul ? 2 : f.pclmul ? 1 : 0;
#else
    return 0;
#endif
}

/* KVCODEC_CPU_LEVEL as a level, -1 when unset or unknown (then the CPU's best). */
int kv_forced_level(void) {
    const char *s = getenv("KVCODEC_CPU_LEVEL");
    if (!s || !*s) return -1;
    static const char *names[] = {"scalar", "avx2", "avx512"};
    for (int i = 0; i < 3; i++)
        if (!strcasecmp(s, names[i]) || (s[0] == '0' + i && !s[1])) return i;
    return -1;
}

void kv_dispatch_init(void) {
    best_simd = cpu_simd_level();
    best_crc = cpu_crc_level();
    int forced = kv_forced_level();
    if (forced >= 0) {
        best_simd = forced < best_simd ? forced : best_simd;
        best_crc = forced < best_crc ? forced : best_crc;
    }
    kv_crc_init();
    kv_rows_scalar(&rows_tier[0]);
    crc_tier[0] = (KvCrcOps){.level = 0};
#if KV_X86
    rows_tier[1] = rows_tier[0];
    if (best_simd >= 1) kv_rows_avx2(&rows_tier[1]);
    rows_tier[2] = rows_tier[1];
    if (best_simd >= 2) kv_rows_avx512(&rows_tier[2]);
    crc_tier[1] = crc_tier[0];
    if (best_crc >= 1) kv_crc_clmul(&crc_tier[1]);
    crc_tier[2] = crc_tier[1];
    if (best_crc >= 2) kv_crc_vclmul(&crc_tier[2]);
    if (best_simd >= 2 && best_crc >= 2) kv_fold_avx512(&fold_ops);
#endif
    for (int i = 0; i < 3; i++) {
        rows_emulated[i] = rows_tier[i > best_simd ? best_simd : i];
        kv_emulate_fold(&rows_emulated[i], &fold_emulated);
    }
}

int kv_best_simd(void) { return best_simd; }

int kv_best_crc(void) { return best_crc; }

/* The level for rows `simd`, CRC folding `crc` (each capped at the best) and the page-by-page encode. */
KvLevel kv_level(int simd, int crc, int paged) {
    simd = simd < 0 ? 0 : simd > best_simd ? best_simd : simd;
    crc = crc < 0 ? 0 : crc > best_crc ? best_crc : crc;
    KvLevel lv = {.rows = &rows_tier[simd], .crc = &crc_tier[crc], .fold = NULL, .paged = paged != 0};
    if (simd >= 2 && crc >= 2) lv.fold = &fold_ops;
    return lv;
}

/* kv_level with every tier's folds and tables emulated in portable C (fold_emul.c): for tests of the
 * drivers' paths that only AVX-512 takes otherwise. The rows fold wherever a CRC runs (crc >= 1). */
KvLevel kv_level_emulated(int simd, int crc, int paged) {
    KvLevel lv = kv_level(simd, crc, paged);
    lv.rows = &rows_emulated[lv.rows->level];
    lv.fold = lv.crc->level >= 1 ? &fold_emulated : NULL;
    return lv;
}
