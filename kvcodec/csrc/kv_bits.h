/* Bit helpers every tier inlines: fp16 / bf16 / fp32 conversions and the e4m3 code of an fp32, on raw
 * bits, exact. */
#ifndef KV_BITS_H
#define KV_BITS_H

#include "kv.h"

static inline uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static inline float bits_f32(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline int finite_f32(float x) { return (f32_bits(x) & 0x7FFFFFFFu) < 0x7F800000u; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* fp32 -> bf16, round to nearest even (finite inputs only: NaN never reaches it). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t b = f32_bits(f);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* fp16 -> fp32, exact, in integer operations the compiler vectorises. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t em = (uint32_t)(h & 0x7FFFu) << 13;
    uint32_t exp = em & 0x0F800000u;
    uint32_t normal = em + (112u << 23);                            /* rebias 15 -> 127 */
    uint32_t special = em + (224u << 23);                           /* Inf / NaN keep all-ones exponent */
    float sub = bits_f32(em + (113u << 23)) - bits_f32(113u << 23); /* subnormal: exact */
    uint32_t o = exp == 0x0F800000u ? special : (exp == 0 ? f32_bits(sub) : normal);
    return bits_f32(o | ((uint32_t)(h & 0x8000u) << 16));
}

/* fp32 -> fp16, round to nearest even, overflow to Inf, NaN to 0x7E00 (as torch). */
static inline uint16_t f32_to_f16(float x) {
    uint32_t f = f32_bits(x);
    uint32_t sign = (f >> 16) & 0x8000u;
    f &= 0x7FFFFFFFu;
    uint32_t big = f > 0x7F800000u ? 0x7E00u : 0x7C00u;                         /* >= 65536, Inf, NaN */
    uint32_t sub = f32_bits(bits_f32(f) + bits_f32(126u << 23)) - (126u << 23); /* < 2^-14 */
    uint32_t norm = (f + 0xC8000FFFu + ((f >> 13) & 1u)) >> 13;                  /* rebias, RNE */
    uint32_t o = f >= 0x47800000u ? big : (f < (113u << 23) ? sub : norm);
    return (uint16_t)(o | sign);
}


/* e4m3fn code of a non-NaN fp32 y, rounded to nearest even, saturated at 448.
 * The fp32 adder rounds: |y| (clamped) lies in a binade [2^E, 2^(E+1)), with
 * E at least -6 (below that, e4m3's subnormal step 2^-9 applies); adding
 * M = 2^(E+20) leaves |y| + M in M's binade, whose step is |y|'s e4m3 step
 * 2^(E-3), so the addition rounds |y| exactly as the cast must, and
 * bits(|y| + M) - bits(M) counts steps above M: 8 to 16 for a normal |y|
 * (its code within the binade, plus 8), 0 to 8 below 2^-6 (the code itself).
 * Adding 8 per binade above 2^-6 gives the code. */
#define E4M3_MIN_EXP (121u << 23) /* 2^-6: the smallest normal e4m3 magnitude */
#define E4M3_MAX_BITS 0x43E00000u /* 448 */

static inline uint8_t e4m3_code(float y) {
    uint32_t b = f32_bits(y);
    uint32_t a = b & 0x7FFFFFFFu;
    a = a > E4M3_MAX_BITS ? E4M3_MAX_BITS : a;
    uint32_t e = a & 0x7F800000u;
    e = e > E4M3_MIN_EXP ? e : E4M3_MIN_EXP;
    uint32_t m = e + (20u << 23);
    uint32_t code = f32_bits(bits_f32(a) + bits_f32(m)) - m + ((e - E4M3_MIN_EXP) >> 20);
    return (uint8_t)(code | ((b >> 24) & 0x80u));
}



/* float(q) exactly for an e4m3fn code that is not NaN: normals rebias the
 * exponent (7 -> 127), subnormals are m * 2^-9. */
static inline float e4m3_value(uint8_t c) {
    uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
    uint32_t normal = ((e + 120u) << 23) | (m << 20);
    uint32_t mag = e ? normal : f32_bits((float)m * 0.001953125f);
    return bits_f32(mag | ((uint32_t)(c & 0x80u) << 24));
}

#endif
