/* conv1d.cu: the causal depthwise convolution over time (LFM2's short convolution) and its two
 * gradients, as native/cpu/conv1d.c computes them: one thread an output element, its terms
 * summed in the CPU's order (the forward from 0 in tap order, as llama.cpp's ssm_conv). */
#include "common.cuh"
#include "kernels.h"

/* Whether row s of sample b is in the window of row t: always without segments, else only
 * in t's segment. */
__device__ inline bool conv1d_sees(const int32_t *seg, int64_t T, int64_t b, int64_t s, int64_t t) {
    return seg == nullptr || seg[b * T + s] == seg[b * T + t];
}

/* y[b, t, c] = sum over k of w[c, k] x[b, t - L + 1 + k, c] (rows before 0 or of another
 * segment skipped); dx (transpose: w flipped, reading g ahead) when input_bwd. */
__global__ void causal_conv1d(float *d, const float *w, const float *x, const int32_t *seg, int64_t B, int64_t T,
                              int64_t C, int64_t L, bool input_bwd) {
    GTC_FOR(i, B * T * C) {
        const int64_t c = i % C, t = (i / C) % T, b = i / (C * T);
        float sum = 0.0f;
        for (int64_t k = 0; k < L; k++) {
            const int64_t s = input_bwd ? t + L - 1 - k : t - L + 1 + k;
            if (s < 0 || s >= T || !conv1d_sees(seg, T, b, input_bwd ? t : s, input_bwd ? s : t)) continue;
            sum += x[(b * T + s) * C + c] * w[c * L + k];
        }
        d[i] = sum;
    }
}

/* dw[c, k] = sum over (b, t) in order of g[b, t, c] x[b, t - L + 1 + k, c]; adjacent threads
 * take adjacent channels (coalesced reads). */
__global__ void causal_conv1d_weight_bwd(float *dw, const float *x, const float *g, const int32_t *seg, int64_t B,
                                         int64_t T, int64_t C, int64_t L) {
    GTC_FOR(i, C * L) {
        const int64_t c = i % C, k = i / C;
        float sum = 0.0f;
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                const int64_t s = t - L + 1 + k;
                if (s < 0 || !conv1d_sees(seg, T, b, s, t)) continue;
                sum += g[(b * T + t) * C + c] * x[(b * T + s) * C + c];
            }
        dw[c * L + k] = sum;
    }
}

static int conv1d_launch(const gt_node *node, int kind, const char *op) {
    int64_t n[4] = {0, 0, 0, 0};
    const gt_tensor *sg = nullptr;
    GTC_TRY(gt_causal_conv1d_check(node, kind, op, n, &sg));
    const int64_t B = n[0], T = n[1], C = n[2], L = n[3];
    const int32_t *seg = sg ? (const int32_t *)sg->data : nullptr;
    const float *s0 = (const float *)node->src[0].data, *s1 = (const float *)node->src[1].data;
    float *d = (float *)node->dst.data;
    if (kind == 2) {
        if (C * L == 0) return GT_OK;
        causal_conv1d_weight_bwd<<<gtc_blocks(C * L), GTC_THREADS, 0, gtc_stream_()>>>(d, s0, s1, seg, B, T, C, L);
    } else {
        if (B * T * C == 0) return GT_OK;
        const float *w = kind == 0 ? s1 : s0, *x = kind == 0 ? s0 : s1;
        causal_conv1d<<<gtc_blocks(B * T * C), GTC_THREADS, 0, gtc_stream_()>>>(d, w, x, seg, B, T, C, L, kind == 1);
    }
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(causal_conv1d_fwd_f32) {
    (void)ctx;
    if (node->ip[0])
        return GTC_FAIL(GT_ERR_INVALID, "causal_conv1d: llama.cpp's CPU numbers (ip[0] = 1) are the CPU kernel's");
    return conv1d_launch(node, 0, "causal_conv1d");
}

GTC_LAUNCHER(causal_conv1d_input_bwd_f32) {
    (void)ctx;
    return conv1d_launch(node, 1, "causal_conv1d_input_bwd");
}

GTC_LAUNCHER(causal_conv1d_weight_bwd_f32) {
    (void)ctx;
    return conv1d_launch(node, 2, "causal_conv1d_weight_bwd");
}
