/* conv2d.c: direct 2-D convolution over NHWC with its bias, relu and max-pool
 * fused into the epilogue, and its two backward kernels (weight and bias
 * gradient; input gradient). No im2col buffer: each thread copies one image at
 * a time into a zero-padded buffer in its work memory (a few KB, in cache) and
 * reads the patches from there through a table of K offsets.
 *
 * Register tiles (AVX-512): MR pixels of one output row times up to 4 vectors
 * of 16 output channels; per k one vector of packed weights is loaded and each
 * pixel's input value is broadcast into an FMA. The weight gradient keeps a
 * chunk of k values times the channel vectors in registers and runs over the
 * pixels of an image: per pixel its gradient vector is loaded and each of its
 * chunk's input values broadcast into an FMA.
 * Other SIMD levels run plain C loops with fmaf in the same order, so every
 * level gives the same bits (GT_CLONES vectorizes them where it can).
 *
 * Numerics: every forward value is one FMA chain from 0 over k = ci*KH*KW +
 * kh*KW + kw in order, then + bias, then relu, then the pool: exactly the bits
 * of im2col, matmul (whose chains run the same way), add, relu and max_pool2d.
 * (NOTE: with pairs the chains also hold exact zero terms, fma(a, 0, acc) = acc,
 * which holds for finite inputs; an infinite input gives NaN there.)
 * The weight gradient of each element is one chain per block of WB_IMAGES
 * images (pixels in order; with pairs, see below, one for the even and one for
 * the odd pixel columns, then added), the blocks' partial sums then added in
 * block order through node scratch; the input gradient of each element is one
 * chain over (kh, kw, co). Work is split by images (blocks of images for the
 * weight gradient), so results do not depend on the thread count. */
#include <math.h>

#include "internal.h"
#include "simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define VL 16           /* floats per vector (channels are padded to a multiple of it) */
#define MR_MAX 14       /* pixels per forward register tile */
#define NV_MAX 4        /* channel vectors per pass (64 channels) */
#define KC_MAX 24       /* k values per weight-gradient pass (times vectors <= 24) */
#define WB_IMAGES 4     /* images per weight-gradient block (fixed: the summation order) */

typedef struct cgeom {
    int64_t N, H, W, C;     /* input image */
    int64_t CO, KH, KW, S, P, relu, pool;
    int64_t OH, OW;         /* convolution output */
    int64_t PH, PW;         /* after the pool (OH, OW when pool == 1) */
    int64_t K;              /* C * KH * KW */
    int64_t CV;             /* CO rounded up to VL */
    int64_t Hp, Wp;         /* zero-padded input */
    int pair;               /* CO <= 8, stride 1: pixel pairs share a vector (see "pairs") */
    int64_t T;              /* taps: K, or C * KH * (KW + 1) for pairs */
    int64_t tps, OWe;       /* pixel stride of conv rows and gradients (CV, or 8 for pairs); OW even */
} cgeom;

static int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* ip = {KH, KW, stride, pad, relu, pool}; the image (N, H, W, C) and CO come
 * from the caller's tensors. */
static int geom_init(cgeom *g, const gt_node *node, int64_t N, int64_t H, int64_t W, int64_t C, int64_t CO,
                     const char *op) {
    const int64_t *ip = node->ip;
    g->N = N, g->H = H, g->W = W, g->C = C, g->CO = CO;
    g->KH = ip[0], g->KW = ip[1], g->S = ip[2], g->P = ip[3], g->relu = ip[4], g->pool = ip[5];
    if (g->KH < 1 || g->KW < 1 || g->S < 1 || g->P < 0 || (g->relu != 0 && g->relu != 1) || g->pool < 1)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected ip = {KH >= 1, KW >= 1, stride >= 1, pad >= 0, relu 0/1, "
                       "pool >= 1}, got {%lld, %lld, %lld, %lld, %lld, %lld}", op, (long long)g->KH,
                       (long long)g->KW, (long long)g->S, (long long)g->P, (long long)g->relu, (long long)g->pool);
    if (N < 0 || H < 1 || W < 1 || C < 1 || CO < 1)
        return GT_FAIL(GT_ERR_SHAPE, "%s: empty image (%lld, %lld, %lld, %lld) or %lld output channels", op,
                       (long long)N, (long long)H, (long long)W, (long long)C, (long long)CO);
    if (H + 2 * g->P < g->KH || W + 2 * g->P < g->KW)
        return GT_FAIL(GT_ERR_SHAPE, "%s: kernel %lldx%lld larger than the padded image %lldx%lld (pad %lld)", op,
                       (long long)g->KH, (long long)g->KW, (long long)H, (long long)W, (long long)g->P);
    g->OH = (H + 2 * g->P - g->KH) / g->S + 1;
    g->OW = (W + 2 * g->P - g->KW) / g->S + 1;
    if (g->pool > g->OH || g->pool > g->OW)
        return GT_FAIL(GT_ERR_SHAPE, "%s: pool window %lld larger than the convolution output %lldx%lld", op,
                       (long long)g->pool, (long long)g->OH, (long long)g->OW);
    g->PH = g->OH / g->pool, g->PW = g->OW / g->pool;
    g->K = C * g->KH * g->KW;
    g->CV = round_up(CO, VL);
    g->Hp = H + 2 * g->P, g->Wp = W + 2 * g->P;
    g->pair = CO <= VL / 2 && g->S == 1;
    g->T = g->pair ? C * g->KH * (g->KW + 1) : g->K;
    g->tps = g->pair ? VL / 2 : g->CV;
    g->OWe = round_up(g->OW, 2);
    return GT_OK;
}

/* The forward's output and the upstream gradient, as checks.h checks them. */
static int check_out(const gt_tensor *t, const cgeom *g, const char *op, const char *what) {
    return gt_conv2d_out_check(t, g->N, g->OH, g->OW, g->CO, g->pool, op, what);
}

static int check_grad(const gt_tensor *t, const cgeom *g, const char *op) {
    return gt_conv2d_grad_check(t, g->N, g->OH, g->OW, g->CO, g->pool, op);
}

static int check_kernel(const gt_tensor *k, const cgeom *g, const char *op) {
    if (k->ndim == 4 && k->shape[0] == g->CO && k->shape[1] == g->C && k->shape[2] == g->KH && k->shape[3] == g->KW)
        return GT_OK;
    char a[128];
    return GT_FAIL(GT_ERR_SHAPE, "%s: expected kernel (CO, C, KH, KW) = (%lld, %lld, %lld, %lld), got %s", op,
                   (long long)g->CO, (long long)g->C, (long long)g->KH, (long long)g->KW,
                   gt_shape_str(k, a, sizeof a));
}

/* ---- work memory ------------------------------------------------------------------ */

/* Carves 64-byte aligned regions out of a thread's work memory. */
typedef struct carver {
    char *at;
    int64_t used;
} carver;

static void *carve(carver *c, int64_t bytes) {
    void *p = c->at ? c->at + c->used : NULL;
    c->used += round_up(bytes, 64);
    return p;
}

static void *align64(void *p) { return (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* ---- shared pieces ------------------------------------------------------------------ */

/* Zeros after a padded image: a pair's second pixel past the row's end (odd OW)
 * reads up to KW + 1 pixels beyond it. */
#define XP_SLACK(g) (((g)->KW + 2) * (g)->C)

/* Image n of x (H, W, C) into xp (Hp, Wp, C), zeros in the border. */
static void pad_image(float *restrict xp, const float *restrict x, const cgeom *g) {
    const int64_t C = g->C, P = g->P, WC = g->W * C, WpC = g->Wp * C;
    if (P) memset(xp, 0, (size_t)(P * WpC) * sizeof(float));
    for (int64_t h = 0; h < g->H; h++) {
        float *row = xp + (h + P) * WpC;
        if (P) memset(row, 0, (size_t)(P * C) * sizeof(float));
        memcpy(row + P * C, x + h * WC, (size_t)WC * sizeof(float));
        if (P) memset(row + P * C + WC, 0, (size_t)(P * C) * sizeof(float));
    }
    if (P) memset(xp + (g->H + P) * WpC, 0, (size_t)(P * WpC) * sizeof(float));
    memset(xp + g->Hp * WpC, 0, (size_t)(XP_SLACK(g)) * sizeof(float));
}

/* Pairs. With at most 8 output channels a vector would be half empty, so two
 * neighbouring pixels of a row share one: lanes 0-7 pixel p, lanes 8-15 pixel
 * p + 1, whose window starts one pixel (C floats) further. Tap d of a row of
 * the window (d = 0..KW) is the input value at column d from p's origin: it
 * meets kernel column d in pixel p (d < KW) and column d - 1 in pixel p + 1
 * (d >= 1), so the packed weight row holds both and the missing one is 0. Each
 * pixel still sees its taps in order, plus exact zero terms (fma(a, 0, acc) =
 * acc for finite a): the same chains, KH * (KW + 1) FMAs per pair for 2 * KH * KW
 * half-empty ones. */

/* Taps of conv2d's patches: off[t] = where tap t of a pixel sits in xp from the
 * pixel's window origin; wp[t*CV + c] its weights. Without pairs t = k =
 * ci*KH*KW + kh*KW + kw and wp[k*CV + co] = kernel[co, k]; with pairs t =
 * (ci*KH + kh)*(KW + 1) + d, lanes 0-7 kernel[:, ci, kh, d], lanes 8-15
 * kernel[:, ci, kh, d - 1]. Channels past CO are 0. */
static void tap_offsets(int32_t *off, const cgeom *g) {
    const int64_t KWt = g->pair ? g->KW + 1 : g->KW;
    for (int64_t ci = 0; ci < g->C; ci++)
        for (int64_t kh = 0; kh < g->KH; kh++)
            for (int64_t d = 0; d < KWt; d++) *off++ = (int32_t)((kh * g->Wp + d) * g->C + ci);
}

static void pack_taps(int32_t *off, float *restrict wp, const float *restrict kern, const cgeom *g) {
    const int64_t C = g->C, KH = g->KH, KW = g->KW, CO = g->CO, CV = g->CV, K = g->K, h = VL / 2;
    const int64_t KWt = g->pair ? KW + 1 : KW;
    tap_offsets(off, g);
    for (int64_t ci = 0; ci < C; ci++)
        for (int64_t kh = 0; kh < KH; kh++)
            for (int64_t d = 0; d < KWt; d++) {
                const int64_t t = (ci * KH + kh) * KWt + d;
                float *row = wp + t * CV;
                for (int64_t c = 0; c < CV; c++) row[c] = 0.0f;
                const int64_t k = (ci * KH + kh) * KW + d;   /* kernel column d, and d - 1 */
                for (int64_t co = 0; co < CO; co++) {
                    if (d < KW) row[co] = kern[co * K + k];
                    if (g->pair && d >= 1) row[h + co] = kern[co * K + k - 1];
                }
            }
}

/* The gradient at row oh of image n's convolution output (before relu and the
 * pool): OWe (pairs) or OW pixels, tps floats apart, channels past CO and pixels
 * past OW zero. g routed to the window element the forward's code names (pool >
 * 1; codes are -1 where relu cut the output), or g where the output is positive
 * (relu, pool == 1), or g. */
GT_CLONES static void grad_row_plain(float *restrict row, int64_t n, int64_t oh, const float *restrict gd,
                                     const float *restrict out, const cgeom *g) {
    const int64_t CO = g->CO, ps = g->tps, OW = g->OW, k = g->pool;
    memset(row, 0, (size_t)((g->pair ? g->OWe : OW) * ps) * sizeof(float));
    if (k == 1) {
        const float *gr = gd + (n * g->OH + oh) * OW * CO, *yr = out + (n * g->OH + oh) * OW * CO;
        for (int64_t ow = 0; ow < OW; ow++) {
            float *o = row + ow * ps;
            const float *gp = gr + ow * CO, *yp = yr + ow * CO;
            if (g->relu)
                for (int64_t co = 0; co < CO; co++) o[co] = yp[co] > 0.0f ? gp[co] : 0.0f;
            else
                for (int64_t co = 0; co < CO; co++) o[co] = gp[co];
        }
        return;
    }
    const int64_t pr = oh / k;
    if (pr >= g->PH) return;   /* rows past the last full window */
    const int64_t i = oh - pr * k, plane = g->N * g->PH * g->PW * CO;
    const float *gr = gd + (n * g->PH + pr) * g->PW * CO, *cr = out + plane + (n * g->PH + pr) * g->PW * CO;
    for (int64_t pc = 0; pc < g->PW; pc++)
        for (int64_t j = 0; j < k; j++) {
            const float code = (float)(i * k + j);
            const float *gp = gr + pc * CO, *cp = cr + pc * CO;
            float *o = row + (pc * k + j) * ps;
            for (int64_t co = 0; co < CO; co++) o[co] = cp[co] == code ? gp[co] : 0.0f;
        }
}

/* The forward's epilogue for one row of windows: tile holds the pool rows of
 * the convolution (pixels tps floats apart, rows trs apart); vals[pc*CO
 * + co] = the max over window pc of relu?(tile + bias), codes[...] = the index
 * of its first maximum (or -1 where relu made it 0); codes unused when pk == 1. */
GT_CLONES static void epilogue_plain(float *restrict vals, float *restrict codes, const float *restrict tile,
                                     const float *restrict bias, int64_t trs, int64_t tps, int64_t CO, int64_t PW,
                                     int64_t pk, int relu) {
    const int hb = bias != NULL;
    for (int64_t pc = 0; pc < PW; pc++) {
        float *m = vals + pc * CO, *cd = codes + pc * CO;
        for (int64_t i = 0; i < pk; i++)
            for (int64_t j = 0; j < pk; j++) {
                const float *t = tile + i * trs + (pc * pk + j) * tps;
                const float idx = (float)(i * pk + j);
                if (i == 0 && j == 0) {
                    for (int64_t co = 0; co < CO; co++) {
                        float v = hb ? t[co] + bias[co] : t[co];
                        m[co] = relu ? (v > 0.0f ? v : 0.0f) : v;
                    }
                    if (pk > 1)
                        for (int64_t co = 0; co < CO; co++) cd[co] = 0.0f;
                    continue;
                }
                for (int64_t co = 0; co < CO; co++) {
                    float v = hb ? t[co] + bias[co] : t[co];
                    v = relu ? (v > 0.0f ? v : 0.0f) : v;
                    const int gt = v > m[co];
                    m[co] = gt ? v : m[co];
                    cd[co] = gt ? idx : cd[co];
                }
            }
        if (pk > 1 && relu)
            for (int64_t co = 0; co < CO; co++) cd[co] = m[co] > 0.0f ? cd[co] : -1.0f;
    }
}

#if defined(__x86_64__)
static inline __attribute__((always_inline, target("avx512f"))) __mmask16 lanes(int64_t n) {
    return n >= VL ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

/* grad_row_plain with vectors (the same values: only selections, no arithmetic) */
__attribute__((target("avx512f"))) static void grad_row512(float *restrict row, int64_t n, int64_t oh,
                                                           const float *restrict gd, const float *restrict out,
                                                           const cgeom *g) {
    const int64_t CO = g->CO, ps = g->tps, k = g->pool, npix = g->pair ? g->OWe : g->OW;
    if (k == 1 || oh / k >= g->PH) {
        grad_row_plain(row, n, oh, gd, out, g);
        return;
    }
    const int64_t pr = oh / k, i = oh - pr * k, plane = g->N * g->PH * g->PW * CO;
    const float *gr = gd + (n * g->PH + pr) * g->PW * CO, *cr = out + plane + (n * g->PH + pr) * g->PW * CO;
    int64_t pc = 0;
    if (ps == 8 && CO == 8 && k == 2) {
        /* two windows at a time: g and codes of windows pc, pc + 1 are one vector, and
         * each window's two pixels of this row are one vector of the row */
        const __m512 want = _mm512_set_ps(2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1,
                                          2 * i + 1, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i);
        for (; pc + 2 <= g->PW; pc += 2) {
            const __m512 gv = _mm512_loadu_ps(gr + pc * 8), cv = _mm512_loadu_ps(cr + pc * 8);
            const __m512 g0 = _mm512_shuffle_f32x4(gv, gv, 0x44), c0 = _mm512_shuffle_f32x4(cv, cv, 0x44);
            const __m512 g1 = _mm512_shuffle_f32x4(gv, gv, 0xEE), c1 = _mm512_shuffle_f32x4(cv, cv, 0xEE);
            _mm512_storeu_ps(row + pc * 16, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(c0, want, _CMP_EQ_OQ), g0));
            _mm512_storeu_ps(row + pc * 16 + 16, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(c1, want, _CMP_EQ_OQ), g1));
        }
    }
    for (; pc < g->PW; pc++)
        for (int64_t c0 = 0; c0 < ps; c0 += VL) {
            const __mmask16 lm = lanes(CO - c0 > 0 ? CO - c0 : 0), wm = lanes(ps - c0);
            const __m512 gv = _mm512_maskz_loadu_ps(lm, gr + pc * CO + c0);
            const __m512 cv = _mm512_maskz_loadu_ps(lm, cr + pc * CO + c0);
            for (int64_t j = 0; j < k; j++) {
                const __mmask16 eq = _mm512_mask_cmp_ps_mask(lm, cv, _mm512_set1_ps((float)(i * k + j)), _CMP_EQ_OQ);
                _mm512_mask_storeu_ps(row + (pc * k + j) * ps + c0, wm, _mm512_maskz_mov_ps(eq, gv));
            }
        }
    if (g->PW * k < npix) memset(row + g->PW * k * ps, 0, (size_t)((npix - g->PW * k) * ps) * sizeof(float));
}

/* epilogue_plain with vectors: the same operations lane by lane (max_ps(v, 0)
 * is v > 0 ? v : 0, NaN included) */
__attribute__((target("avx512f"))) static void epilogue512(float *restrict vals, float *restrict codes,
                                                          const float *restrict tile, const float *restrict bias,
                                                          int64_t trs, int64_t tps, int64_t CO, int64_t PW,
                                                          int64_t pk, int relu) {
    const __m512 zero = _mm512_setzero_ps(), minus1 = _mm512_set1_ps(-1.0f);
    int64_t pc0 = 0;
    if (tps == 8 && CO == 8 && pk == 2) {
        /* pairs: a window's two pixels of a tile row are one vector; two windows at a
         * time, their first and second columns gathered into full vectors */
        const __m512 b = bias ? _mm512_shuffle_f32x4(_mm512_castps256_ps512(_mm256_loadu_ps(bias)),
                                                     _mm512_castps256_ps512(_mm256_loadu_ps(bias)), 0x44)
                              : zero;
        const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f), three = _mm512_set1_ps(3.0f);
        const int hb = bias != NULL;
#define ACT(v) (relu ? _mm512_max_ps(hb ? _mm512_add_ps((v), b) : (v), zero) : hb ? _mm512_add_ps((v), b) : (v))
#define STEP(v, idx)                                                 \
    do {                                                             \
        const __m512 v_ = ACT(v);                                    \
        const __mmask16 gt_ = _mm512_cmp_ps_mask(v_, m, _CMP_GT_OQ); \
        m = _mm512_mask_blend_ps(gt_, m, v_);                        \
        cd = _mm512_mask_blend_ps(gt_, cd, (idx));                   \
    } while (0)
        for (; pc0 + 2 <= PW; pc0 += 2) {
            const float *t0 = tile + pc0 * 16, *t1 = tile + trs + pc0 * 16;
            const __m512 u0 = _mm512_loadu_ps(t0), w0 = _mm512_loadu_ps(t0 + 16);
            const __m512 u1 = _mm512_loadu_ps(t1), w1 = _mm512_loadu_ps(t1 + 16);
            __m512 m = ACT(_mm512_shuffle_f32x4(u0, w0, 0x44)), cd = zero;   /* window element (0, 0) */
            STEP(_mm512_shuffle_f32x4(u0, w0, 0xEE), one);                   /* (0, 1) */
            STEP(_mm512_shuffle_f32x4(u1, w1, 0x44), two);                   /* (1, 0) */
            STEP(_mm512_shuffle_f32x4(u1, w1, 0xEE), three);                 /* (1, 1) */
            _mm512_storeu_ps(vals + pc0 * 8, m);
            if (relu) cd = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, zero, _CMP_GT_OQ), minus1, cd);
            _mm512_storeu_ps(codes + pc0 * 8, cd);
        }
#undef STEP
#undef ACT
    }
    for (int64_t c0 = 0; c0 < CO; c0 += VL) {
        const __mmask16 lm = lanes(CO - c0);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(lm, bias + c0) : zero;
        for (int64_t pc = pc0; pc < PW; pc++) {
            __m512 m = zero, cd = zero;
            for (int64_t i = 0; i < pk; i++)
                for (int64_t j = 0; j < pk; j++) {
                    __m512 v = _mm512_maskz_loadu_ps(lm, tile + i * trs + (pc * pk + j) * tps + c0);
                    if (bias) v = _mm512_add_ps(v, b);
                    if (relu) v = _mm512_max_ps(v, zero);
                    if (i == 0 && j == 0) {
                        m = v;
                        continue;
                    }
                    const __mmask16 gt = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
                    m = _mm512_mask_blend_ps(gt, m, v);
                    cd = _mm512_mask_blend_ps(gt, cd, _mm512_set1_ps((float)(i * pk + j)));
                }
            _mm512_mask_storeu_ps(vals + pc * CO + c0, lm, m);
            if (pk > 1) {
                if (relu) cd = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, zero, _CMP_GT_OQ), minus1, cd);
                _mm512_mask_storeu_ps(codes + pc * CO + c0, lm, cd);
            }
        }
    }
}
#endif

static void grad_row(float *row, int64_t n, int64_t oh, const float *gd, const float *out, const cgeom *g, int simd) {
#if defined(__x86_64__)
    if (simd) {
        grad_row512(row, n, oh, gd, out, g);
        return;
    }
#endif
    (void)simd;
    grad_row_plain(row, n, oh, gd, out, g);
}

static void epilogue(float *vals, float *codes, const float *tile, const float *bias, int64_t trs, int64_t tps,
                     int64_t CO, int64_t PW, int64_t pk, int relu, int simd) {
#if defined(__x86_64__)
    if (simd) {
        epilogue512(vals, codes, tile, bias, trs, tps, CO, PW, pk, relu);
        return;
    }
#endif
    (void)simd;
    epilogue_plain(vals, codes, tile, bias, trs, tps, CO, PW, pk, relu);
}

/* ---- the register tiles ----------------------------------------------------------------- */

/* out[r*ldo + c] = sum over k of src[r*ps + off[k]] * wp[k*CV + c] for r < mr and
 * c < nv*VL, each one fmaf chain from 0 over k in order. */
GT_CLONES static void tile_plain(float *restrict out, int64_t ldo, const float *restrict src, int64_t ps,
                                 const int32_t *restrict off, const float *restrict wp, int64_t K, int64_t CV,
                                 int mr, int nv) {
    for (int r = 0; r < mr; r++) {
        float acc[NV_MAX * VL];
        for (int c = 0; c < nv * VL; c++) acc[c] = 0.0f;
        const float *s = src + r * ps;
        for (int64_t k = 0; k < K; k++) {
            const float a = s[off[k]];
            const float *w = wp + k * CV;
            for (int c = 0; c < nv * VL; c++) acc[c] = fmaf(a, w[c], acc[c]);
        }
        for (int c = 0; c < nv * VL; c++) out[r * ldo + c] = acc[c];
    }
}

/* acc[j*ldc + c] (+)= sum over pixels p < np of src[base(p) + off[k0 + j]] * gc[p*CV + c]
 * for j < kc, c < nv*VL, base(p) = (p / ow) * rs + (p % ow) * ps: each element
 * one fmaf chain over p in order, from 0 when `first`, else from acc. With
 * bacc, also bacc[c] (+)= gc[p*CV + c] over p in order (the bias gradient). */
GT_CLONES static void wgrad_plain(float *restrict acc, int64_t ldc, const float *restrict src, int64_t rs,
                                  int64_t ps, int64_t ow, int64_t np, const int32_t *restrict off,
                                  const float *restrict gc, int64_t CV, int kc, int nv, int first,
                                  float *restrict bacc) {
    for (int j = 0; j < kc; j++)
        for (int c = 0; c < nv * VL; c++) {
            float a = first ? 0.0f : acc[j * ldc + c];
            for (int64_t p = 0; p < np; p++)
                a = fmaf(src[(p / ow) * rs + (p % ow) * ps + off[j]], gc[p * CV + c], a);
            acc[j * ldc + c] = a;
        }
    if (bacc)
        for (int c = 0; c < nv * VL; c++) {
            float a = first ? 0.0f : bacc[c];
            for (int64_t p = 0; p < np; p++) a += gc[p * CV + c];
            bacc[c] = a;
        }
}

#if defined(__x86_64__)
static inline __attribute__((always_inline, target("avx512f"))) void
tile512_body(float *out, int64_t ldo, const float *src, int64_t ps, int64_t rs, const int32_t *off, const float *wp,
             int64_t K, int64_t CV, const int MR, const int MRH, const int NV) {
    __m512 acc[MR_MAX][NV_MAX];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *s = src + off[k];
        const float *w = wp + k * CV;
        __m512 wv[NV_MAX];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_ps(w + v * VL);
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            /* the first MRH pixels from src's row, the rest from the row rs further */
            const __m512 a = _mm512_set1_ps(r < MRH ? s[r * ps] : s[rs + (r - MRH) * ps]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(a, wv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(out + r * ldo + v * VL, acc[r][v]);
}

static inline __attribute__((always_inline, target("avx512f"))) void
wgrad512_body(float *acc_io, int64_t ldc, const float *src, int64_t rs, int64_t ps, int64_t ow, int64_t np,
              const int32_t *off, const float *gc, int64_t CV, int first, float *bacc, const int KCN,
              const int NV) {
    __m512 acc[KC_MAX][NV_MAX], bsum[NV_MAX];
    const int hb = bacc != NULL;
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
        bsum[v] = first || !hb ? _mm512_setzero_ps() : _mm512_loadu_ps(bacc + v * VL);
    int32_t o[KC_MAX];
#pragma GCC unroll 24
    for (int j = 0; j < KCN; j++) {
        o[j] = off[j];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            acc[j][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_io + j * ldc + v * VL);
    }
    int64_t p = 0;
    for (int64_t y = 0; p < np; y++) {
        const float *srow = src + y * rs;
        for (int64_t x = 0; x < ow && p < np; x++, p++) {
            const float *s = srow + x * ps;
            __m512 gv[NV_MAX];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) gv[v] = _mm512_loadu_ps(gc + p * CV + v * VL);
            if (hb)
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) bsum[v] = _mm512_add_ps(bsum[v], gv[v]);
#pragma GCC unroll 24
            for (int j = 0; j < KCN; j++) {
                const __m512 a = _mm512_set1_ps(s[o[j]]);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) acc[j][v] = _mm512_fmadd_ps(a, gv[v], acc[j][v]);
            }
        }
    }
#pragma GCC unroll 24
    for (int j = 0; j < KCN; j++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(acc_io + j * ldc + v * VL, acc[j][v]);
    if (hb)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(bacc + v * VL, bsum[v]);
}

typedef void (*tile_fn)(float *, int64_t, const float *, int64_t, const int32_t *, const float *, int64_t, int64_t);
typedef void (*wgrad_fn)(float *, int64_t, const float *, int64_t, int64_t, int64_t, int64_t, const int32_t *,
                         const float *, int64_t, int, float *);

#define TILE_FN(MR, NV)                                                                                   \
    __attribute__((target("avx512f"))) static void tile512_##MR##_##NV(                                  \
        float *o, int64_t ldo, const float *s, int64_t ps, const int32_t *off, const float *wp, int64_t K, \
        int64_t CV) {                                                                                     \
        tile512_body(o, ldo, s, ps, 0, off, wp, K, CV, MR, MR, NV);                                       \
    }
#define TILE2_FN(MRH)                                                                                     \
    __attribute__((target("avx512f"))) static void tile512x2_##MRH(                                      \
        float *o, int64_t ldo, const float *s, int64_t ps, int64_t rs, const int32_t *off, const float *wp, \
        int64_t K, int64_t CV) {                                                                          \
        tile512_body(o, ldo, s, ps, rs, off, wp, K, CV, 2 * MRH, MRH, 1);                                 \
    }
#define WGRAD_FN(KCN, NV)                                                                                 \
    __attribute__((target("avx512f"))) static void wgrad512_##KCN##_##NV(                                \
        float *a, int64_t ldc, const float *s, int64_t rs, int64_t ps, int64_t ow, int64_t np,           \
        const int32_t *off, const float *gc, int64_t CV, int first, float *bacc) {                        \
        wgrad512_body(a, ldc, s, rs, ps, ow, np, off, gc, CV, first, bacc, KCN, NV);                      \
    }

/* forward tiles: MR pixels x NV vectors; NV = 1 any MR <= 14, more vectors fewer rows */
#define ROWS_1(X, NV) X(1, NV) X(2, NV) X(3, NV) X(4, NV) X(5, NV) X(6, NV) X(7, NV)
#define ROWS_2(X, NV) X(8, NV) X(9, NV) X(10, NV) X(11, NV) X(12, NV) X(13, NV) X(14, NV)
ROWS_1(TILE_FN, 1) ROWS_2(TILE_FN, 1)
ROWS_1(TILE_FN, 2)
TILE_FN(1, 3) TILE_FN(2, 3) TILE_FN(3, 3) TILE_FN(4, 3) TILE_FN(5, 3) TILE_FN(6, 3)
TILE_FN(1, 4) TILE_FN(2, 4) TILE_FN(3, 4) TILE_FN(4, 4) TILE_FN(5, 4)

#define REF_T(MR, NV) tile512_##MR##_##NV,
static const tile_fn tiles1[] = {NULL, ROWS_1(REF_T, 1) ROWS_2(REF_T, 1)};
static const tile_fn tiles2[] = {NULL, ROWS_1(REF_T, 2)};
static const tile_fn tiles3[] = {NULL, REF_T(1, 3) REF_T(2, 3) REF_T(3, 3) REF_T(4, 3) REF_T(5, 3) REF_T(6, 3)};
static const tile_fn tiles4[] = {NULL, REF_T(1, 4) REF_T(2, 4) REF_T(3, 4) REF_T(4, 4) REF_T(5, 4)};
static const tile_fn *const tiles[NV_MAX + 1] = {NULL, tiles1, tiles2, tiles3, tiles4};
static const int tile_rows[NV_MAX + 1] = {0, 14, 7, 6, 5};

/* two rows of up to 7 pixels in one tile (one channel vector): 14 chains in flight */
typedef void (*tile2_fn)(float *, int64_t, const float *, int64_t, int64_t, const int32_t *, const float *, int64_t,
                         int64_t);
TILE2_FN(1) TILE2_FN(2) TILE2_FN(3) TILE2_FN(4) TILE2_FN(5) TILE2_FN(6) TILE2_FN(7)
static const tile2_fn tiles_x2[] = {NULL, tile512x2_1, tile512x2_2, tile512x2_3, tile512x2_4, tile512x2_5,
                                    tile512x2_6, tile512x2_7};

/* weight-gradient chunks: KCN k values x NV vectors, KCN * NV <= 24 */
#define KS_1(X, NV) X(1, NV) X(2, NV) X(3, NV) X(4, NV) X(5, NV) X(6, NV)
#define KS_2(X, NV) X(7, NV) X(8, NV) X(9, NV) X(10, NV) X(11, NV) X(12, NV)
#define KS_3(X, NV) X(13, NV) X(14, NV) X(15, NV) X(16, NV) X(17, NV) X(18, NV)
#define KS_4(X, NV) X(19, NV) X(20, NV) X(21, NV) X(22, NV) X(23, NV) X(24, NV)
KS_1(WGRAD_FN, 1) KS_2(WGRAD_FN, 1) KS_3(WGRAD_FN, 1) KS_4(WGRAD_FN, 1)
KS_1(WGRAD_FN, 2) KS_2(WGRAD_FN, 2)
WGRAD_FN(1, 3) WGRAD_FN(2, 3) WGRAD_FN(3, 3) WGRAD_FN(4, 3) WGRAD_FN(5, 3) WGRAD_FN(6, 3)
WGRAD_FN(7, 3) WGRAD_FN(8, 3)
KS_1(WGRAD_FN, 4)

#define REF_W(KCN, NV) wgrad512_##KCN##_##NV,
static const wgrad_fn wg1[] = {NULL, KS_1(REF_W, 1) KS_2(REF_W, 1) KS_3(REF_W, 1) KS_4(REF_W, 1)};
static const wgrad_fn wg2[] = {NULL, KS_1(REF_W, 2) KS_2(REF_W, 2)};
static const wgrad_fn wg3[] = {NULL, REF_W(1, 3) REF_W(2, 3) REF_W(3, 3) REF_W(4, 3) REF_W(5, 3) REF_W(6, 3)
                                   REF_W(7, 3) REF_W(8, 3)};
static const wgrad_fn wg4[] = {NULL, KS_1(REF_W, 4)};
static const wgrad_fn *const wgrads[NV_MAX + 1] = {NULL, wg1, wg2, wg3, wg4};
#endif

static const int wgrad_ks[NV_MAX + 1] = {0, 24, 12, 8, 6};

/* One output row of n pixels: out[p*ldo + c] = conv chains of pixel p (at
 * src + p*ps) for channels c < CV, in channel groups of up to NV_MAX vectors. */
static void conv_row(float *out, int64_t ldo, const float *src, int64_t ps, int64_t n, const int32_t *off,
                     const float *wp, int64_t K, int64_t CV, int simd) {
    for (int64_t c0 = 0; c0 < CV; c0 += NV_MAX * VL) {
        const int nv = (int)((CV - c0) / VL < NV_MAX ? (CV - c0) / VL : NV_MAX);
#if defined(__x86_64__)
        if (simd) {
            const int mr = tile_rows[nv];
            for (int64_t p = 0; p < n; p += mr) {
                const int m = (int)(n - p < mr ? n - p : mr);
                tiles[nv][m](out + p * ldo + c0, ldo, src + p * ps, ps, off, wp + c0, K, CV);
            }
            continue;
        }
#endif
        (void)simd;
        tile_plain(out + c0, ldo, src, ps, off, wp + c0, K, CV, (int)n, nv);
    }
}

/* Two rows of n pixels (the second's at src + rs), written one after the other
 * into out: conv_row twice, in one register tile when the rows are short. */
static void conv_rows2(float *out, int64_t ldo, const float *src, int64_t ps, int64_t rs, int64_t n,
                       const int32_t *off, const float *wp, int64_t K, int64_t CV, int simd) {
#if defined(__x86_64__)
    if (simd && CV == VL && 2 * n <= MR_MAX) {
        tiles_x2[n](out, ldo, src, ps, rs, off, wp, K, CV);
        return;
    }
#endif
    conv_row(out, ldo, src, ps, n, off, wp, K, CV, simd);
    conv_row(out + n * ldo, ldo, src + rs, ps, n, off, wp, K, CV, simd);
}

/* acc (K + 1 rows of CV) (+)= the weight-gradient chains over np pixels; row K
 * the bias gradient's. */
static void wgrad_pixels(float *acc, const float *src, int64_t rs, int64_t ps, int64_t ow, int64_t np,
                         const int32_t *off, const float *gc, int64_t K, int64_t CV, int first, int simd) {
    for (int64_t c0 = 0; c0 < CV; c0 += NV_MAX * VL) {
        const int nv = (int)((CV - c0) / VL < NV_MAX ? (CV - c0) / VL : NV_MAX);
        const int ks = wgrad_ks[nv];
        for (int64_t k0 = 0; k0 < K; k0 += ks) {
            const int kc = (int)(K - k0 < ks ? K - k0 : ks);
            float *bacc = k0 == 0 ? acc + K * CV + c0 : NULL;
#if defined(__x86_64__)
            if (simd) {
                wgrads[nv][kc](acc + k0 * CV + c0, CV, src, rs, ps, ow, np, off + k0, gc + c0, CV, first, bacc);
                continue;
            }
#endif
            wgrad_plain(acc + k0 * CV + c0, CV, src, rs, ps, ow, np, off + k0, gc + c0, CV, kc, nv, first, bacc);
        }
    }
}

static int use_simd(void) { return gt_simd_level_() >= 2; }

/* ---- forward -------------------------------------------------------------------------- */

/* A padded image, the taps, and `pool` rows of convolution output (OWe pixels). */
static int64_t fwd_work(const cgeom *g, carver *c, float **xp, int32_t **off, float **wp, float **tile) {
    *xp = carve(c, (g->Hp * g->Wp * g->C + XP_SLACK(g)) * (int64_t)sizeof(float));
    *off = carve(c, g->T * (int64_t)sizeof(int32_t));
    *wp = carve(c, g->T * g->CV * (int64_t)sizeof(float));
    *tile = carve(c, g->pool * g->OWe * g->CV * (int64_t)sizeof(float));
    return c->used + 64;
}

/* Convolution output of n pixels from src (pixel origins ps floats apart) into
 * out (pixels tps floats apart), through the taps. */
static void conv_pixels(float *out, const float *src, int64_t ps, int64_t n, const int32_t *off, const float *wp,
                        const cgeom *g, int simd) {
    if (g->pair) conv_row(out, VL, src, 2 * ps, (n + 1) / 2, off, wp, g->T, VL, simd);
    else conv_row(out, g->CV, src, ps, n, off, wp, g->T, g->CV, simd);
}

static int fwd_geom(const gt_node *node, cgeom *g, const char *op) {
    const gt_tensor *x = &node->src[0], *k = &node->src[1];
    char a[128];
    if (x->ndim != 4)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected x (N, H, W, C), got %s", op, gt_shape_str(x, a, sizeof a));
    if (k->ndim != 4)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected kernel (CO, C, KH, KW), got %s", op, gt_shape_str(k, a, sizeof a));
    GT_TRY(geom_init(g, node, x->shape[0], x->shape[1], x->shape[2], x->shape[3], k->shape[0], op));
    return check_kernel(k, g, op);
}

int gt_conv2d_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    cgeom g;
    GT_TRY(fwd_geom(node, &g, "conv2d"));
    carver c = {NULL, 0};
    float *a, *b, *t;
    int32_t *o;
    *scratch = 0;
    *work = fwd_work(&g, &c, &a, &o, &b, &t);
    return GT_OK;
}

/* conv2d: src0 x (N, H, W, C), src1 kernel (CO, C, KH, KW), src2 bias (CO,)
 * (optional), all f32 contiguous; ip = {KH, KW, stride, pad, relu, pool}.
 * v = bias + the convolution (zero padding), relu'd when relu, then max over
 * pool x pool windows (stride pool, floor). dst: (N, OH, OW, CO) when pool == 1,
 * else (2, N, OH/pool, OW/pool, CO): [0] the pooled values, [1] for each the
 * window index i*pool + j of the first element holding the max, as f32, or -1
 * where relu made the output 0 (what the backward kernels route g by).
 * Threads own whole images. */
int gt_conv2d_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "conv2d";
    const gt_tensor *d = &node->dst, *x = &node->src[0], *k = &node->src[1];
    cgeom g;
    if (node->n_src != 2 && node->n_src != 3)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected 2 or 3 inputs (x, kernel, bias), got %d", op, node->n_src);
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, "x");
    GT_CHECK_F32(k, op, "kernel");
    GT_TRY(fwd_geom(node, &g, op));
    GT_TRY(check_out(d, &g, op, "dst"));
    GT_TRY(gt_check_contig(x, op, "x"));
    GT_TRY(gt_check_contig(k, op, "kernel"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    const float *bias = NULL;
    if (node->n_src == 3) {
        const gt_tensor *b = &node->src[2];
        GT_CHECK_F32(b, op, "bias");
        if (gt_numel(b) != g.CO || !gt_is_contiguous(b)) {
            char a[128];
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected a contiguous bias of %lld values, got %s", op,
                           (long long)g.CO, gt_shape_str(b, a, sizeof a));
        }
        bias = b->data;
    }
    carver c = {align64(ctx->wdata), 0};
    float *xp, *wp, *tile;
    int32_t *off;
    if (fwd_work(&g, &c, &xp, &off, &wp, &tile) > ctx->wsize)
        return GT_FAIL(GT_ERR_INVALID, "%s: work memory %lld bytes, need %lld", op, (long long)ctx->wsize,
                       (long long)c.used + 64);
    pack_taps(off, wp, k->data, &g);
    const int simd = use_simd();
    const int64_t CO = g.CO, trs = g.OWe * g.tps, OW = g.OW, pk = g.pool, S = g.S, C = g.C;
    const int64_t rowlen = g.Wp * C, plane = g.N * g.PH * g.PW * CO;
    const int64_t ncols = pk == 1 ? OW : g.PW * pk;   /* columns a window uses */
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(g.N, ctx, &lo, &hi);
    for (int64_t n = lo; n < hi; n++) {
        pad_image(xp, (const float *)x->data + n * g.H * g.W * C, &g);
        for (int64_t pr = 0; pr < g.PH; pr++) {
            for (int64_t i = 0; i < pk; i++) {
                const int64_t oh = pr * pk + i;
                conv_pixels(tile + i * trs, xp + oh * S * rowlen, S * C, ncols, off, wp, &g, simd);
            }
            float *vals = dd + (n * g.PH + pr) * g.PW * CO;
            epilogue(vals, vals + plane, tile, bias, trs, g.tps, CO, g.PW, pk, (int)g.relu, simd);
        }
    }
    return GT_OK;
}

/* ---- weight and bias gradient ------------------------------------------------------------ */

static int bwd_geom(const gt_node *node, cgeom *g, const gt_tensor *img, int64_t CO, const char *op) {
    char a[128];
    if (img->ndim != 4)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected an image (N, H, W, C), got %s", op,
                       gt_shape_str(img, a, sizeof a));
    return geom_init(g, node, img->shape[0], img->shape[1], img->shape[2], img->shape[3], CO, op);
}

static int64_t wbwd_nblocks(const cgeom *g) { return (g->N + WB_IMAGES - 1) / WB_IMAGES; }

/* A padded image, the tap offsets, and the image's gradient rows (OWe pixels). */
static int64_t wbwd_work(const cgeom *g, carver *c, float **xp, int32_t **off, float **gc) {
    *xp = carve(c, (g->Hp * g->Wp * g->C + XP_SLACK(g)) * (int64_t)sizeof(float));
    *off = carve(c, g->T * (int64_t)sizeof(int32_t));
    *gc = carve(c, g->OH * g->OWe * g->CV * (int64_t)sizeof(float));
    return c->used + 64;
}

static int wbwd_geom(const gt_node *node, cgeom *g, const char *op) {
    const gt_tensor *d = &node->dst;
    char a[128];
    if (d->ndim != 2 || d->shape[1] < 1)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst (C*KH*KW + 1, CO), got %s", op, gt_shape_str(d, a, sizeof a));
    GT_TRY(bwd_geom(node, g, &node->src[0], d->shape[1], op));
    if (d->shape[0] != g->K + 1)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst (C*KH*KW + 1, CO) = (%lld, %lld), got %s", op,
                       (long long)(g->K + 1), (long long)g->CO, gt_shape_str(d, a, sizeof a));
    return GT_OK;
}

int gt_conv2d_weight_bwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    cgeom g;
    GT_TRY(wbwd_geom(node, &g, "conv2d_weight_bwd"));
    carver c = {NULL, 0};
    float *a, *b;
    int32_t *o;
    *work = wbwd_work(&g, &c, &a, &o, &b);
    *scratch = wbwd_nblocks(&g) * (g.T + 1) * g.CV * (int64_t)sizeof(float) + 64;
    return GT_OK;
}

/* conv2d_weight_bwd: src0 x (N, H, W, C), src1 the forward's output (its codes,
 * or its values for relu without pool), src2 g (N, OH/pool, OW/pool, CO), all
 * f32 contiguous; ip as in conv2d. dst (C*KH*KW + 1, CO): row k = ci*KH*KW +
 * kh*KW + kw holds d kernel[:, ci, kh, kw], the last row d bias.
 * Phase 1: each block of WB_IMAGES images accumulates its partial sums in node
 * scratch, one row per tap and one for the bias (threads own blocks); phase 2
 * (after a barrier): dst = the partials added in block order (threads own
 * elements); with pairs a block's partial is its even pixels' chain (lanes 0-7
 * of tap kw) plus its odd pixels' (lanes 8-15 of tap kw + 1). */
int gt_conv2d_weight_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "conv2d_weight_bwd";
    const gt_tensor *d = &node->dst, *x = &node->src[0], *out = &node->src[1], *gt = &node->src[2];
    cgeom g;
    GT_TRY(gt_check_n_src(node, 3, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, "x");
    GT_CHECK_F32(out, op, "out");
    GT_CHECK_F32(gt, op, "g");
    GT_TRY(wbwd_geom(node, &g, op));
    GT_TRY(check_out(out, &g, op, "out"));
    GT_TRY(check_grad(gt, &g, op));
    GT_TRY(gt_check_contig(x, op, "x"));
    GT_TRY(gt_check_contig(out, op, "out"));
    GT_TRY(gt_check_contig(gt, op, "g"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    const int64_t nb = wbwd_nblocks(&g), rows = g.T + 1, CV = g.CV, CO = g.CO, h = VL / 2;
    if (!node->scratch || node->scratch_size < nb * rows * CV * (int64_t)sizeof(float) + 64)
        return GT_FAIL(GT_ERR_INVALID, "%s: node scratch %lld bytes, need %lld", op, (long long)node->scratch_size,
                       (long long)(nb * rows * CV * (int64_t)sizeof(float) + 64));
    carver c = {align64(ctx->wdata), 0};
    float *xp, *gc;
    int32_t *off;
    if (wbwd_work(&g, &c, &xp, &off, &gc) > ctx->wsize)
        return GT_FAIL(GT_ERR_INVALID, "%s: work memory %lld bytes, need %lld", op, (long long)ctx->wsize,
                       (long long)c.used + 64);
    tap_offsets(off, &g);
    float *partial = align64(node->scratch);
    const int simd = use_simd();
    const int64_t rs = g.S * g.Wp * g.C, ps = g.S * g.C, grs = (g.pair ? g.OWe : g.OW) * g.tps;
    int64_t lo, hi;
    gt_split(nb, ctx, &lo, &hi);
    for (int64_t b = lo; b < hi; b++) {
        float *acc = partial + b * rows * CV;
        const int64_t n1 = (b + 1) * WB_IMAGES < g.N ? (b + 1) * WB_IMAGES : g.N;
        for (int64_t n = b * WB_IMAGES; n < n1; n++) {
            const int first = n == b * WB_IMAGES;
            pad_image(xp, (const float *)x->data + n * g.H * g.W * g.C, &g);
            for (int64_t oh = 0; oh < g.OH; oh++) grad_row(gc + oh * grs, n, oh, gt->data, out->data, &g, simd);
            if (g.pair) wgrad_pixels(acc, xp, rs, 2 * ps, g.OWe / 2, g.OH * g.OWe / 2, off, gc, g.T, CV, first, simd);
            else wgrad_pixels(acc, xp, rs, ps, g.OW, g.OH * g.OW, off, gc, g.T, CV, first, simd);
        }
    }
    gt_barrier(ctx);
    float *dd = d->data;
    gt_split((g.K + 1) * CO, ctx, &lo, &hi);
    for (int64_t e = lo; e < hi; e++) {
        const int64_t r = e / CO, co = e - r * CO;
        float s = 0.0f;
        if (g.pair) {
            /* tap of kernel column kw for even pixels, kw + 1 for odd ones; the bias row alike */
            const int64_t t = r == g.K ? g.T : r / g.KW * (g.KW + 1) + r % g.KW, t2 = r == g.K ? g.T : t + 1;
            for (int64_t b = 0; b < nb; b++) {
                const float *pb = partial + b * rows * CV;
                const float v = pb[t * CV + co] + pb[t2 * CV + h + co];
                s = b ? s + v : v;
            }
        } else {
            s = nb ? partial[r * CV + co] : 0.0f;   /* no images: zero gradients */
            for (int64_t b = 1; b < nb; b++) s += partial[(b * rows + r) * CV + co];
        }
        dd[e] = s;
    }
    return GT_OK;
}

/* ---- input gradient ------------------------------------------------------------------------ */

/* The input gradient is a stride-1 convolution of the upstream gradient gq
 * (the convolution output's gradient placed at (oh*S - P + KH-1, ow*S - P +
 * KW-1) in a zero (H + KH-1, W + KW-1, CO) image) with the kernel flipped:
 * dx[ih, iw, ci] = sum over kh', kw', co of gq[ih + kh', iw + kw', co] *
 * kernel[co, ci, KH-1-kh', KW-1-kw'], one chain over (kh', kw', co) in order. */
typedef struct igeom {
    int64_t Hq, Wq;     /* the gq image */
    int pair;           /* C <= 8: pixel pairs (the gq correlation has stride 1) */
    int64_t KWt, K2;    /* taps per kernel row (KW, or KW + 1 with pairs), taps KH*KWt*CO */
    int64_t CV2, tps;   /* C rounded up to VL; dx pixel stride in the tile (CV2, or 8) */
} igeom;

static void igeom_init(igeom *q, const cgeom *g) {
    q->Hq = g->H + g->KH - 1, q->Wq = g->W + g->KW - 1;
    q->pair = g->C <= VL / 2;
    q->KWt = q->pair ? g->KW + 1 : g->KW;
    q->K2 = g->KH * q->KWt * g->CO;
    q->CV2 = round_up(g->C, VL);
    q->tps = q->pair ? VL / 2 : q->CV2;
}

static int64_t ibwd_work(const cgeom *g, const igeom *q, carver *c, float **gq, int32_t **off, float **wp,
                         float **grow, float **tile) {
    *gq = carve(c, (q->Hq * q->Wq + g->KW + 2) * g->CO * (int64_t)sizeof(float));
    *off = carve(c, q->K2 * (int64_t)sizeof(int32_t));
    *wp = carve(c, q->K2 * q->CV2 * (int64_t)sizeof(float));
    *grow = carve(c, g->OWe * g->CV * (int64_t)sizeof(float));
    *tile = carve(c, 2 * round_up(g->W, 2) * q->CV2 * (int64_t)sizeof(float));
    return c->used + 64;
}

int gt_conv2d_input_bwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    cgeom g;
    igeom q;
    GT_TRY(bwd_geom(node, &g, &node->dst, node->src[0].ndim == 4 ? node->src[0].shape[0] : 1, "conv2d_input_bwd"));
    igeom_init(&q, &g);
    carver c = {NULL, 0};
    float *a, *b, *e, *f;
    int32_t *o;
    *scratch = 0;
    *work = ibwd_work(&g, &q, &c, &a, &o, &b, &e, &f);
    return GT_OK;
}

/* conv2d_input_bwd: src0 kernel (CO, C, KH, KW), src1 the forward's output, src2
 * g (N, OH/pool, OW/pool, CO), all f32 contiguous; ip as in conv2d; dst dx
 * (N, H, W, C) (its shape gives the image). Threads own whole images. */
int gt_conv2d_input_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "conv2d_input_bwd";
    const gt_tensor *d = &node->dst, *k = &node->src[0], *out = &node->src[1], *gt = &node->src[2];
    cgeom g;
    igeom q;
    char a[128];
    GT_TRY(gt_check_n_src(node, 3, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(k, op, "kernel");
    GT_CHECK_F32(out, op, "out");
    GT_CHECK_F32(gt, op, "g");
    if (k->ndim != 4)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected kernel (CO, C, KH, KW), got %s", op, gt_shape_str(k, a, sizeof a));
    GT_TRY(bwd_geom(node, &g, d, k->shape[0], op));
    GT_TRY(check_kernel(k, &g, op));
    GT_TRY(check_out(out, &g, op, "out"));
    GT_TRY(check_grad(gt, &g, op));
    GT_TRY(gt_check_contig(k, op, "kernel"));
    GT_TRY(gt_check_contig(out, op, "out"));
    GT_TRY(gt_check_contig(gt, op, "g"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    igeom_init(&q, &g);
    carver c = {align64(ctx->wdata), 0};
    float *gq, *wp, *grow, *tile;
    int32_t *off;
    if (ibwd_work(&g, &q, &c, &gq, &off, &wp, &grow, &tile) > ctx->wsize)
        return GT_FAIL(GT_ERR_INVALID, "%s: work memory %lld bytes, need %lld", op, (long long)ctx->wsize,
                       (long long)c.used + 64);
    const int64_t CO = g.CO, C = g.C, KH = g.KH, KW = g.KW, CV2 = q.CV2, h = VL / 2;
    /* tap (kh'*KWt + d)*CO + co of gq, and the flipped kernel: column d (lanes 0-7
     * with pairs), column d - 1 for the pair's second pixel (lanes 8-15) */
    const float *kd = k->data;
    for (int64_t kh = 0; kh < KH; kh++)
        for (int64_t d = 0; d < q.KWt; d++)
            for (int64_t co = 0; co < CO; co++) {
                const int64_t t = (kh * q.KWt + d) * CO + co;
                const float *kr = kd + ((co * C) * KH + (KH - 1 - kh)) * KW;   /* kernel[co, 0, KH-1-kh', :] */
                off[t] = (int32_t)((kh * q.Wq + d) * CO + co);
                float *row = wp + t * CV2;
                for (int64_t c2 = 0; c2 < CV2; c2++) row[c2] = 0.0f;
                for (int64_t ci = 0; ci < C; ci++) {
                    if (d < KW) row[ci] = kr[ci * KH * KW + (KW - 1 - d)];
                    if (q.pair && d >= 1) row[h + ci] = kr[ci * KH * KW + (KW - d)];
                }
            }
    const int simd = use_simd();
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(g.N, ctx, &lo, &hi);
    for (int64_t n = lo; n < hi; n++) {
        memset(gq, 0, (size_t)((q.Hq * q.Wq + KW + 2) * CO) * sizeof(float));
        for (int64_t oh = 0; oh < g.OH; oh++) {
            const int64_t y = oh * g.S - g.P + KH - 1;
            if (y < 0 || y >= q.Hq) continue;   /* a window wholly in the padding */
            grad_row(grow, n, oh, gt->data, out->data, &g, simd);
            for (int64_t ow = 0; ow < g.OW; ow++) {
                const int64_t xq = ow * g.S - g.P + KW - 1;
                if (xq < 0 || xq >= q.Wq) continue;
                float *dst = gq + (y * q.Wq + xq) * CO;
                const float *src = grow + ow * g.tps;
                for (int64_t co = 0; co < CO; co++) dst[co] = src[co];
            }
        }
        /* rows of dx two at a time; with pairs a row is (W + 1) / 2 tile pixels */
        const int64_t rs = q.Wq * CO, tn = q.pair ? (g.W + 1) / 2 : g.W, tld = q.pair ? VL : CV2;
        const int64_t tps2 = q.pair ? 2 * CO : CO, trow = q.pair ? 2 * tn * (VL / 2) : g.W * CV2;
        for (int64_t ih = 0; ih < g.H; ih += 2) {
            const float *src = gq + ih * rs;
            const int64_t rows = g.H - ih < 2 ? 1 : 2;
            if (rows == 2) conv_rows2(tile, tld, src, tps2, rs, tn, off, wp, q.K2, tld, simd);
            else conv_row(tile, tld, src, tps2, tn, off, wp, q.K2, tld, simd);
            for (int64_t j = 0; j < rows; j++) {
                float *o = dd + (n * g.H + ih + j) * g.W * C;
                const float *t = tile + j * trow;
                for (int64_t iw = 0; iw < g.W; iw++)
                    for (int64_t ci = 0; ci < C; ci++) o[iw * C + ci] = t[iw * q.tps + ci];
            }
        }
    }
    return GT_OK;
}
