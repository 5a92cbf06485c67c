/* rope.c: rotary position embedding, llama.cpp/ggml rope modes 0 (NORMAL:
 * adjacent pairs) and 2 (NEOX: pairs half the rotated dims apart), with
 * optional per-pair frequency factors (llama 3's rope_freqs, phi3's long/short
 * factors) and a linear frequency scale, and its backward (the inverse rotation). Rows (b, t) are
 * split across threads in t-major order (b-major with per-row positions), and
 * a thread computes the cos/sin of a position once and reuses them while the
 * position repeats (over the batch, and always over the heads). */
#include <math.h>

#include "internal.h"
#include "simd.h"

#define PAIRS 8     /* block of pairs per vector step */
#define CHUNK 256   /* pairs whose cos/sin are cached on the stack */

/* d[2i], d[2i+1] = (x0 c - x1 s, x0 s + x1 c) for i < n, with (x0, x1) = x[2i], x[2i+1] */
GT_CLONES static void rotate_pairs(float *restrict d, const float *restrict x, const float *restrict c,
                                   const float *restrict s, int64_t n) {
    int64_t i = 0;
    for (; i + PAIRS <= n; i += PAIRS)
        for (int k = 0; k < PAIRS; k++) {
            const float x0 = x[2 * (i + k)], x1 = x[2 * (i + k) + 1];
            d[2 * (i + k)] = x0 * c[i + k] - x1 * s[i + k];
            d[2 * (i + k) + 1] = x0 * s[i + k] + x1 * c[i + k];
        }
    for (; i < n; i++) {
        const float x0 = x[2 * i], x1 = x[2 * i + 1];
        d[2 * i] = x0 * c[i] - x1 * s[i];
        d[2 * i + 1] = x0 * s[i] + x1 * c[i];
    }
}

/* llama.cpp's CPU rotation (its build contracts both into one fma each):
 * (fma(x0, c, -(x1 s)), fma(x0, s, x1 c)); pairs `step` apart (1: adjacent, else half) */
static void rotate_ggml(float *restrict d, const float *restrict x, const float *restrict c, const float *restrict s,
                        int64_t n, int64_t step) {
    const int64_t stride = step == 1 ? 2 : 1;
    for (int64_t i = 0; i < n; i++) {
        const float x0 = x[stride * i], x1 = x[stride * i + step];
        d[stride * i] = fmaf(x0, c[i], -(x1 * s[i]));
        d[stride * i + step] = fmaf(x0, s[i], x1 * c[i]);
    }
}

/* the NEOX pairing: d[i], d[i + half] from x[i], x[i + half], for i < n (x, d offset to the chunk) */
GT_CLONES static void rotate_halves(float *restrict d, const float *restrict x, const float *restrict c,
                                    const float *restrict s, int64_t n, int64_t half) {
    for (int64_t i = 0; i < n; i++) {
        const float x0 = x[i], x1 = x[i + half];
        d[i] = x0 * c[i] - x1 * s[i];
        d[i + half] = x0 * s[i] + x1 * c[i];
    }
}

/* YaRN's ramp of pair i between the correction dims (ggml's rope_yarn_ramp, in f32): 1 below
 * low (the pair keeps its frequency), 0 above high (divided by the scaling factor) */
static float yarn_ramp(float low, float high, int64_t i) {
    const float y = ((float)i - low) / fmaxf(0.001f, high - low);
    return 1.0f - fminf(1.0f, fmaxf(0.0f, y));
}

static int rope(const gt_node *node, const gt_ctx *ctx, const char *op, double sign) {
    const gt_tensor *d = &node->dst, *x = &node->src[0], *p = &node->src[1];
    int per_row = 0;
    GT_TRY(gt_rope_check(node, op, sign < 0, &per_row));
    const int64_t D = x->shape[x->ndim - 1], H = x->shape[x->ndim - 2], T = x->shape[x->ndim - 3];
    const int64_t B = gt_numel(x) / (T * H * D > 0 ? T * H * D : 1);
    const int64_t n_dims = node->ip[0], mode = node->ip[1], ggml = node->ip[2];
    const float base = node->fp[0], fscale = node->fp[1], ext = node->fp[3], low = node->fp[4], high = node->fp[5];
    /* YaRN (ext > 0): ggml's rope_yarn, its magnitude correction in f32 as ggml computes it */
    const float mscale = ext != 0.0f ? node->fp[2] * (1.0f + 0.1f * logf(1.0f / fscale)) : node->fp[2];
    const gt_tensor *ff = node->n_src == 3 ? &node->src[2] : NULL;
    if (gt_numel(x) == 0) return GT_OK;

    const int64_t half = n_dims / 2;
    const int32_t *pos = p->data;
    const int64_t ps = p->strides[0];
    float *dd = d->data;
    const float *xd = x->data;
    double freq[CHUNK];
    float cs[CHUNK], sn[CHUNK];
    int64_t lo, hi;
    /* unit u: shared positions t-major (t = u / B, b = u % B), so consecutive units
     * share a position; per-row positions b-major (b = u / T, t = u % T) */
    gt_split(T * B, ctx, &lo, &hi);
    if (ggml) {    /* llama.cpp's angles: theta *= powf(base, -2 / n_dims) pair after pair, in f32 */
        const float ts = powf(base, -2.0f / (float)n_dims);
        const float *fac = ff ? (const float *)ff->data : NULL;
        const int64_t fs = ff ? ff->strides[0] : 0;
        for (int64_t u = lo; u < hi; u++) {
            const int64_t t = per_row ? u % T : u / B, b = per_row ? u / T : u % B;
            const int64_t row = (b * T + t) * H * D;
            float th = (float)(per_row ? pos[b * T + t] : pos[t * ps]);
            for (int64_t i0 = 0; i0 < half; i0 += CHUNK) {
                const int64_t ni = half - i0 < CHUNK ? half - i0 : CHUNK;
                for (int64_t i = 0; i < ni; i++) {
                    const float te = fac ? th / fac[(i0 + i) * fs] : th;
                    float ti = fscale * te;
                    if (ext != 0.0f) {
                        const float mix = yarn_ramp(low, high, i0 + i) * ext;
                        ti = ti * (1 - mix) + te * mix;
                    }
                    cs[i] = cosf(ti) * mscale;
                    sn[i] = sinf(ti) * mscale;
                    th *= ts;
                }
                for (int64_t h = 0; h < H; h++) {
                    const int64_t off = row + h * D + (mode == 2 ? i0 : 2 * i0);
                    rotate_ggml(dd + off, xd + off, cs, sn, ni, mode == 2 ? half : 1);
                }
            }
            if (n_dims < D)
                for (int64_t h = 0; h < H; h++)
                    memcpy(dd + row + h * D + n_dims, xd + row + h * D + n_dims, (size_t)(D - n_dims) * sizeof(float));
        }
        return GT_OK;
    }
    for (int64_t i0 = 0; i0 < half; i0 += CHUNK) {
        const int64_t ni = half - i0 < CHUNK ? half - i0 : CHUNK;
        for (int64_t i = 0; i < ni; i++) {
            /* the pair's share of freq_scale: all of it without YaRN, else mixed with 1 by the ramp */
            const double mix = ext != 0.0f ? (double)yarn_ramp(low, high, i0 + i) * ext : 0.0;
            freq[i] = ((double)fscale * (1.0 - mix) + mix) * pow((double)base, -2.0 * (double)(i0 + i) / (double)n_dims);
            if (ff) freq[i] /= (double)((const float *)ff->data)[(i0 + i) * ff->strides[0]];
        }
        int have = 0;
        int32_t p_cached = 0;
        for (int64_t u = lo; u < hi; u++) {
            const int64_t t = per_row ? u % T : u / B, b = per_row ? u / T : u % B;
            const int32_t pu = per_row ? pos[b * T + t] : pos[t * ps];
            if (!have || pu != p_cached) {   /* cos/sin depend on the position alone */
                const double pt = (double)pu;
                for (int64_t i = 0; i < ni; i++) {
                    const double th = pt * freq[i];
                    cs[i] = (float)(mscale * cos(th));
                    sn[i] = (float)(mscale * sign * sin(th));
                }
                p_cached = pu;
                have = 1;
            }
            const int64_t row = (b * T + t) * H * D;
            for (int64_t h = 0; h < H; h++) {
                const int64_t off = row + h * D;
                if (mode == 2)
                    rotate_halves(dd + off + i0, xd + off + i0, cs, sn, ni, half);
                else
                    rotate_pairs(dd + off + 2 * i0, xd + off + 2 * i0, cs, sn, ni);
                if (i0 == 0 && n_dims < D)
                    memcpy(dd + off + n_dims, xd + off + n_dims, (size_t)(D - n_dims) * sizeof(float));
            }
        }
    }
    return GT_OK;
}

/* rope: x (..., T, H, D) f32 contiguous, positions (T,) i32 (any stride) shared
 * by every row, or x's leading dims (..., T) i32 contiguous (each row its own
 * positions: packed samples restart at 0), dst same shape as x, contiguous.
 * ip[0] = n_dims (even, 2..D), ip[1] = mode (0 normal, 2 neox, ggml's numbers),
 * fp[0] = freq_base, fp[1] = freq_scale (> 0; 1: none, linear rope scaling 1/factor),
 * fp[2] = attn_factor (> 0; 1: none): the rotated pairs are also scaled by it (llama.cpp's
 * mscale: phi3's longrope attention factor); the backward is the same scale times R(-theta);
 * src2 (optional): factors (n_dims/2,) f32 (any stride) dividing each pair's frequency.
 * For i < n_dims/2: theta = freq_scale * pos[t] * freq_base^(-2i/n_dims) / factors[i]
 * rotates the pair (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), the pair being
 * (x[2i], x[2i+1]) in mode 0 and (x[i], x[i + n_dims/2]) in mode 2;
 * dims n_dims..D-1 pass through unchanged.
 * NOTE: theta, cos and sin are computed in double (pow, cos, sin of libm), then
 * rounded to float. ggml computes theta in float (theta *= powf(base, -2/n_dims)
 * per pair), whose angle error grows with the position (about 1e-4 rad at
 * position 2048); this kernel matches a float64 reference to float rounding
 * at any position. YaRN (fp[3] = ext_factor > 0, fp[4], fp[5] = its correction dims low,
 * high): pair i's freq_scale becomes freq_scale (1 - m) + m, m = ext_factor * ramp(i) (1
 * below low, 0 above high, linear between), and attn_factor is multiplied by
 * 1 + 0.1 ln(1 / freq_scale) (ggml's rope_yarn). ip[2] = 1 (forward only): llama.cpp's CPU numbers instead, bit for
 * bit: its f32 angles (with libm's powf, cosf, sinf) and its fma'd rotation (inference in
 * llama.cpp's numerics: the decoder's act8 mode). */
int gt_rope_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return rope(node, ctx, "rope", 1.0); }

/* rope_bwd: dx = rotation of g by -theta (the transpose of the forward);
 * src0 g, src1 positions, src2 factors (optional), params as in rope. */
int gt_rope_bwd_f32(const gt_node *node, const gt_ctx *ctx) { return rope(node, ctx, "rope_bwd", -1.0); }
