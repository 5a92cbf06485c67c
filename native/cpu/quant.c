/* quant.c: ggml block formats. Dequantize any of F32, F16, BF16, Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, MXFP4 to f32, and quantize f32 to F16, BF16, Q8_0,
 * Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 the way ggml's reference quantizer does (round to nearest, no
 * importance matrix), and to Q2_K..Q6_K by quant_k.c's writers. The per-block dequantizers are shared with the kernels that read
 * frozen weights (gt_dequantizer_). Which types each direction supports is in
 * the dtype table's flags (dtype.c); a test checks the two agree.
 *
 * Block layouts (little-endian, `half` is an IEEE f16, QK = elements per block):
 *   Q4_0 (32, 18 B):  half d; u8 qs[16]          x = d * (q - 8)
 *   Q4_1 (32, 20 B):  half d, m; u8 qs[16]       x = d * q + m
 *   Q5_0 (32, 22 B):  half d; u8 qh[4]; qs[16]   x = d * (q - 16), bit 4 of q in qh
 *   Q5_1 (32, 24 B):  half d, m; qh[4]; qs[16]   x = d * q + m
 *   Q8_0 (32, 34 B):  half d; i8 qs[32]          x = d * q
 *   In the 4/5-bit formats, byte j holds element j (low nibble) and j + 16 (high).
 *   Q2_K (256, 84 B):  u8 scales[16]; u8 qs[64]; half d, dmin
 *   Q3_K (256, 110 B): u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d
 *   Q4_K (256, 144 B): half d, dmin; u8 scales[12]; u8 qs[128]
 *   Q5_K (256, 176 B): half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]
 *   Q6_K (256, 210 B): u8 ql[128]; u8 qh[64]; i8 scales[16]; half d
 *   MXFP4 (32, 17 B): u8 e (E8M0); u8 qs[16]      x = value(q) * 2^(e - 128)  (native/mxfp4.h)
 *
 * The arithmetic is written in the same order as ggml's reference code (and
 * gguf-py's numpy port), one rounding per operation (C11 mode: no FMA
 * contraction), so the results are bit-identical to gguf.quants.
 */
#include <float.h>
#include <math.h>

#include "../mxfp4.h"
#include "quant_k.h"
#include "simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define QK 32

static inline uint32_t u32_at(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

GT_CLONES static void dequant_q4_0(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 18, y += QK) {
        const float d = gt_half_at_(b);
        const uint8_t *qs = b + 2;
        for (int j = 0; j < QK / 2; j++) {
            y[j] = (float)((qs[j] & 0x0f) - 8) * d;
            y[j + QK / 2] = (float)((qs[j] >> 4) - 8) * d;
        }
    }
}

GT_CLONES static void dequant_q4_1(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 20, y += QK) {
        const float d = gt_half_at_(b), m = gt_half_at_(b + 2);
        const uint8_t *qs = b + 4;
        for (int j = 0; j < QK / 2; j++) {
            y[j] = (float)(qs[j] & 0x0f) * d + m;
            y[j + QK / 2] = (float)(qs[j] >> 4) * d + m;
        }
    }
}

GT_CLONES static void dequant_q5_0(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 22, y += QK) {
        const float d = gt_half_at_(b);
        const uint32_t qh = u32_at(b + 2);
        const uint8_t *qs = b + 6;
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = (int)((qh >> j) & 1) << 4, h1 = (int)((qh >> (j + 16)) & 1) << 4;
            y[j] = (float)(((qs[j] & 0x0f) | h0) - 16) * d;
            y[j + QK / 2] = (float)(((qs[j] >> 4) | h1) - 16) * d;
        }
    }
}

GT_CLONES static void dequant_q5_1(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 24, y += QK) {
        const float d = gt_half_at_(b), m = gt_half_at_(b + 2);
        const uint32_t qh = u32_at(b + 4);
        const uint8_t *qs = b + 8;
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = (int)((qh >> j) & 1) << 4, h1 = (int)((qh >> (j + 16)) & 1) << 4;
            y[j] = (float)((qs[j] & 0x0f) | h0) * d + m;
            y[j + QK / 2] = (float)((qs[j] >> 4) | h1) * d + m;
        }
    }
}

GT_CLONES static void dequant_q8_0(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 34, y += QK) {
        const float d = gt_half_at_(b);
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) y[j] = (float)qs[j] * d;
    }
}

GT_CLONES static void dequant_q2_k(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 84) {
        const uint8_t *scales = b, *q = b + 16;
        const float d = gt_half_at_(b + 80), dmin = gt_half_at_(b + 82);
        int is = 0;
        for (int n = 0; n < QK_K; n += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int half = 0; half < 2; half++) {   /* 16 elements from q[0..15] or q[16..31] */
                    const uint8_t sc = scales[is++];
                    const float dl = d * (float)(sc & 0x0f), ml = dmin * (float)(sc >> 4);
                    for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l + 16 * half] >> shift) & 3) - ml;
                }
            }
        }
    }
}

/* Q3_K's sixteen 6-bit scales: low 4 bits in bytes 0..7 (both nibbles), high
 * 2 bits in bytes 8..11; scale i is stored plus 32. */
static inline int q3_k_scale(const uint8_t *s, int i) {
    const int lo = i < 8 ? (s[i] & 0x0f) : (s[i - 8] >> 4);
    const int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

GT_CLONES static void dequant_q3_k(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 110) {
        const uint8_t *hm = b, *q = b + 32, *scales = b + 96;
        const float d = gt_half_at_(b + 108);
        int is = 0;
        uint8_t m = 1;
        for (int n = 0; n < QK_K; n += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
                for (int half = 0; half < 2; half++) {
                    const float dl = d * (float)q3_k_scale(scales, is++);
                    for (int l = 16 * half; l < 16 * half + 16; l++) {
                        const int v = ((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4);
                        *y++ = dl * (float)v;
                    }
                }
            }
        }
    }
}


GT_CLONES static void dequant_q4_k(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 144) {
        const float d = gt_half_at_(b), dmin = gt_half_at_(b + 2);
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int j = 0, is = 0; j < QK_K; j += 64, q += 32, is += 2) {
            int sc, mn;
            gt_k4_scale_min_(scales, is, &sc, &mn);
            const float d1 = d * (float)sc, m1 = dmin * (float)mn;
            gt_k4_scale_min_(scales, is + 1, &sc, &mn);
            const float d2 = d * (float)sc, m2 = dmin * (float)mn;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0x0f) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

GT_CLONES static void dequant_q5_k(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 176) {
        const float d = gt_half_at_(b), dmin = gt_half_at_(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0, is = 0; j < QK_K; j += 64, ql += 32, is += 2, u1 <<= 2, u2 <<= 2) {
            int sc, mn;
            gt_k4_scale_min_(scales, is, &sc, &mn);
            const float d1 = d * (float)sc, m1 = dmin * (float)mn;
            gt_k4_scale_min_(scales, is + 1, &sc, &mn);
            const float d2 = d * (float)sc, m2 = dmin * (float)mn;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)((ql[l] & 0x0f) + ((qh[l] & u1) ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
        }
    }
}

GT_CLONES static void dequant_q6_k(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = gt_half_at_(b + 208);
        for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
    }
}

/* ggml's dequantize_row_mxfp4: the doubled E2M1 value times the halved scale (exact). */
GT_CLONES static void dequant_mxfp4(float *y, const uint8_t *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += GT_MXFP4_BLOCK_BYTES, y += GT_MXFP4_BLOCK) {
        const float d = gt_e8m0_half(b[0]);
        const uint8_t *qs = b + 1;
        for (int j = 0; j < GT_MXFP4_BLOCK / 2; j++) {
            y[j] = (float)gt_mxfp4_value(qs[j] & 0x0f) * d;
            y[j + GT_MXFP4_BLOCK / 2] = (float)gt_mxfp4_value(qs[j] >> 4) * d;
        }
    }
}

static void dequant_f32(float *y, const uint8_t *b, int64_t n) { memcpy(y, b, (size_t)n * sizeof(float)); }

static void dequant_f16(float *y, const uint8_t *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = gt_f16_to_f32_1((uint16_t)(b[2 * i] | (b[2 * i + 1] << 8)));
}

#if defined(__x86_64__)
/* The same with F16C, 8 at a time: the conversion is exact, so the values are
 * dequant_f16's (a signalling NaN comes out quiet: NaN weights have no meaning).
 * The packed GEMM dequantizes every f16 weight value once per panel; the scalar
 * conversion above held it to 0.75x the f32 product. */
__attribute__((target("f16c"))) static void dequant_f16_f16c(float *y, const uint8_t *b, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 2 * i))));
    for (; i < n; i++) y[i] = gt_f16_to_f32_1((uint16_t)(b[2 * i] | (b[2 * i + 1] << 8)));
}
#endif

/* bf16 is the high half of an f32: a shift (written inline, so it vectorizes). */
GT_CLONES static void dequant_bf16(float *y, const uint8_t *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t bits = (uint32_t)(b[2 * i] | (b[2 * i + 1] << 8)) << 16;
        memcpy(y + i, &bits, sizeof bits);
    }
}

gt_dequant_fn gt_dequantizer_(int32_t dtype) {
    switch (dtype) {
    case GT_F32: return dequant_f32;
    case GT_F16:
#if defined(__x86_64__)
        if (__builtin_cpu_supports("f16c")) return dequant_f16_f16c;
#endif
        return dequant_f16;
    case GT_BF16: return dequant_bf16;
    case GT_Q4_0: return dequant_q4_0;
    case GT_Q4_1: return dequant_q4_1;
    case GT_Q5_0: return dequant_q5_0;
    case GT_Q5_1: return dequant_q5_1;
    case GT_Q8_0: return dequant_q8_0;
    case GT_Q2_K: return dequant_q2_k;
    case GT_Q3_K: return dequant_q3_k;
    case GT_Q4_K: return dequant_q4_k;
    case GT_Q5_K: return dequant_q5_k;
    case GT_Q6_K: return dequant_q6_k;
    case GT_MXFP4: return dequant_mxfp4;
    default: return NULL;
    }
}

/* n elements: a whole number of blocks of a known type (GT_ERR_SHAPE otherwise). */
static int check_blocks(const gt_dtype_traits *t, int64_t n, const char *what) {
    if (n < 0) return GT_FAIL(GT_ERR_INVALID, "%s: negative element count %lld", what, (long long)n);
    if (n % t->block)
        return GT_FAIL(GT_ERR_SHAPE, "%s %s: %lld elements are not a whole number of %d-element blocks",
                       what, t->name, (long long)n, (int)t->block);
    return GT_OK;
}

int gt_dequantize_row(float *dst, const void *src, int32_t dtype, int64_t n) {
    const gt_dtype_traits *t = gt_dtype_find_(dtype);
    const gt_dequant_fn fn = gt_dequantizer_(dtype);
    if (!t) return GT_FAIL(GT_ERR_UNSUPPORTED, "dequantize: unknown ggml type %d", (int)dtype);
    if (!fn || !(t->flags & GT_DTYPE_DEQUANTIZE))
        return GT_FAIL(GT_ERR_UNSUPPORTED, "dequantize: %s has no dequantize kernel", t->name);
    GT_TRY(check_blocks(t, n, "dequantize"));
    if (n == 0) return GT_OK;
    if (!dst || !src) return GT_FAIL(GT_ERR_INVALID, "dequantize: null pointer");
    fn(dst, src, n / t->block);
    return GT_OK;
}

/* ggml's quantize_row_q8_0_ref: d = max|x| / 127, q = round(x / d) (half away
 * from zero). A NaN maps to 0 instead of being undefined behaviour. */
static void quant_q8_0(uint8_t *b, const float *src, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 34, src += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            const float a = fabsf(src[j]);
            if (a > amax) amax = a;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        gt_put_half_(b, d);
        int8_t *qs = (int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) {
            const float r = roundf(src[j] * id);
            qs[j] = (int8_t)(r > 127.0f ? 127 : r < -128.0f ? -128 : r == r ? (int)r : 0);
        }
    }
}

/* ggml's quantize_row_q4_0_ref: d = m / -8 where m is the element of largest
 * magnitude (the first such), q = min(15, trunc(x / d + 8.5)). */
static void quant_q4_0(uint8_t *b, const float *src, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 18, src += QK) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; j++) {
            if (amax < fabsf(src[j])) {
                amax = fabsf(src[j]);
                max = src[j];
            }
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        gt_put_half_(b, d);
        uint8_t *qs = b + 2;
        for (int j = 0; j < QK / 2; j++) {
            const float t0 = src[j] * id + 8.5f, t1 = src[j + QK / 2] * id + 8.5f;
            const int q0 = t0 >= 15.0f ? 15 : t0 > 0.0f ? (int)t0 : 0;
            const int q1 = t1 >= 15.0f ? 15 : t1 > 0.0f ? (int)t1 : 0;
            qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* ggml's quantize_row_q4_1_ref: the block's minimum m and d = (max - m) / 15, both
 * stored as half; q = min(15, trunc((x - m) / d + 0.5)) (x - m >= 0). A NaN maps to 0. */
static void quant_q4_1(uint8_t *b, const float *src, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 20, src += QK) {
        float lo = FLT_MAX, hi = -FLT_MAX;
        for (int j = 0; j < QK; j++) {
            if (src[j] < lo) lo = src[j];
            if (src[j] > hi) hi = src[j];
        }
        const float d = (hi - lo) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        gt_put_half_(b, d);
        gt_put_half_(b + 2, lo);
        uint8_t *qs = b + 4;
        for (int j = 0; j < QK / 2; j++) {
            const float t0 = (src[j] - lo) * id + 0.5f, t1 = (src[j + QK / 2] - lo) * id + 0.5f;
            const int q0 = t0 >= 15.0f ? 15 : t0 > 0.0f ? (int)t0 : 0;
            const int q1 = t1 >= 15.0f ? 15 : t1 > 0.0f ? (int)t1 : 0;
            qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* The fifth bits of a 32-value block's levels q (0..31): bit j of the u32 is q[j] >> 4, in
 * Q5_0/Q5_1's qh (little-endian); the low nibbles go to qs as in Q4_0. */
void gt_pack_5bit_(uint8_t *qh, uint8_t *qs, const int *q) {
    uint32_t h = 0;
    for (int j = 0; j < QK / 2; j++) {
        qs[j] = (uint8_t)((q[j] & 0x0f) | ((q[j + QK / 2] & 0x0f) << 4));
        h |= (uint32_t)((q[j] >> 4) & 1) << j;
        h |= (uint32_t)((q[j + QK / 2] >> 4) & 1) << (j + QK / 2);
    }
    for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(h >> (8 * k));
}

/* ggml's quantize_row_q5_0_ref: d = m / -16 where m is the element of largest magnitude
 * (the first such), q = min(31, trunc(x / d + 16.5)). A NaN maps to 0. */
static void quant_q5_0(uint8_t *b, const float *src, int64_t nb) {
    int q[QK];
    for (int64_t i = 0; i < nb; i++, b += 22, src += QK) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; j++) {
            if (amax < fabsf(src[j])) {
                amax = fabsf(src[j]);
                max = src[j];
            }
        }
        const float d = max / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        gt_put_half_(b, d);
        for (int j = 0; j < QK; j++) {
            const float t = src[j] * id + 16.5f;
            q[j] = t >= 31.0f ? 31 : t > 0.0f ? (int)t : 0;
        }
        gt_pack_5bit_(b + 2, b + 6, q);
    }
}

/* ggml's quantize_row_q5_1_ref: the block's minimum m and d = (max - m) / 31, both stored as
 * half; q = trunc((x - m) / d + 0.5) (x - m >= 0, at most 31). A NaN maps to 0. */
static void quant_q5_1(uint8_t *b, const float *src, int64_t nb) {
    int q[QK];
    for (int64_t i = 0; i < nb; i++, b += 24, src += QK) {
        float lo = FLT_MAX, hi = -FLT_MAX;
        for (int j = 0; j < QK; j++) {
            if (src[j] < lo) lo = src[j];
            if (src[j] > hi) hi = src[j];
        }
        const float d = (hi - lo) / 31.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        gt_put_half_(b, d);
        gt_put_half_(b + 2, lo);
        for (int j = 0; j < QK; j++) {
            /* NOTE: ggml keeps trunc(t) in a uint8 unclamped; t < 32 here, as d >= (hi - lo) / 31 */
            const float t = (src[j] - lo) * id + 0.5f;
            q[j] = t > 0.0f && t < 256.0f ? (uint8_t)(int)t : 0;
        }
        gt_pack_5bit_(b + 4, b + 8, q);
    }
}

/* ggml's quantize_row_mxfp4_ref: amax = max |x|, e = floor(log2(amax)) - 2 + 127 (0 for an all-zero
 * block: the largest magnitude, 6 = 12 / 2, then covers amax), and each element the first code of
 * least |value * d - x| (d = 2^(e - 128)). NOTE: ggml casts a negative or over-255 exponent (amax
 * below 2^-125 or at least 2^129) to uint8 undefined; here through int, as x86 does; a NaN x
 * gets code 0. */
static void quant_mxfp4(uint8_t *b, const float *src, int64_t nb) {
    static const int8_t values[16] = GT_MXFP4_VALUES;
    for (int64_t i = 0; i < nb; i++, b += GT_MXFP4_BLOCK_BYTES, src += GT_MXFP4_BLOCK) {
        float amax = 0.0f;
        for (int j = 0; j < GT_MXFP4_BLOCK; j++)
            if (amax < fabsf(src[j])) amax = fabsf(src[j]);
        const uint8_t e = amax > 0.0f ? (uint8_t)(int)(floorf(log2f(amax)) - 2 + 127) : 0;
        const float d = gt_e8m0_half(e);
        b[0] = e;
        for (int j = 0; j < GT_MXFP4_BLOCK / 2; j++) {
            int q[2];
            for (int h = 0; h < 2; h++) {
                const float x = src[j + h * GT_MXFP4_BLOCK / 2];
                float best = fabsf((float)values[0] * d - x);
                q[h] = 0;
                for (int c = 1; c < 16; c++) {
                    const float err = fabsf((float)values[c] * d - x);
                    if (err < best) {
                        best = err;
                        q[h] = c;
                    }
                }
            }
            b[1 + j] = (uint8_t)(q[0] | (q[1] << 4));
        }
    }
}

static void quant_f32(uint8_t *b, const float *src, int64_t n) { memcpy(b, src, (size_t)n * sizeof(float)); }

static void quant_f16(uint8_t *b, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) gt_put_half_(b + 2 * i, src[i]);
}

static void quant_bf16(uint8_t *b, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint16_t h = gt_f32_to_bf16_1(src[i]);
        b[2 * i] = (uint8_t)(h & 0xff);
        b[2 * i + 1] = (uint8_t)(h >> 8);
    }
}

int gt_quantize_row(void *dst, const float *src, int32_t dtype, int64_t n) {
    const gt_dtype_traits *t = gt_dtype_find_(dtype);
    void (*fn)(uint8_t *, const float *, int64_t) = NULL;
    switch (dtype) {
    case GT_F32: fn = quant_f32; break;
    case GT_F16: fn = quant_f16; break;
    case GT_BF16: fn = quant_bf16; break;
    case GT_Q8_0: fn = quant_q8_0; break;
    case GT_Q4_0: fn = quant_q4_0; break;
    case GT_Q4_1: fn = quant_q4_1; break;
    case GT_Q5_0: fn = quant_q5_0; break;
    case GT_Q5_1: fn = quant_q5_1; break;
    case GT_Q2_K: fn = gt_quant_q2_k_; break;
    case GT_Q3_K: fn = gt_quant_q3_k_; break;
    case GT_Q4_K: fn = gt_quant_q4_k_; break;
    case GT_Q5_K: fn = gt_quant_q5_k_; break;
    case GT_Q6_K: fn = gt_quant_q6_k_; break;
    case GT_MXFP4: fn = quant_mxfp4; break;
    default: break;
    }
    if (!t) return GT_FAIL(GT_ERR_UNSUPPORTED, "quantize: unknown ggml type %d", (int)dtype);
    if (!fn || !(t->flags & GT_DTYPE_QUANTIZE))
        return GT_FAIL(GT_ERR_UNSUPPORTED, "quantize: ggtrain cannot write %s", t->name);
    GT_TRY(check_blocks(t, n, "quantize"));
    if (n == 0) return GT_OK;
    if (!dst || !src) return GT_FAIL(GT_ERR_INVALID, "quantize: null pointer");
    fn(dst, src, n / t->block);
    return GT_OK;
}
