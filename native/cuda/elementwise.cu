/* elementwise.cu: binary and unary elementwise kernels, their backward kernels, the fused
 * gates, dropout, copies with conversion and the optimizer steps. Semantics as ggtrain.h's. */
#include <cuda_fp16.h>

#include "common.cuh"
#include "kernels.h"

/* ---- binary, numpy broadcasting through zero strides ----------------------------------------- */

/* MA, MB: the readers' modes, at compile time for the common pairs (plain or a trailing
 * broadcast on either side), -1 for the rest. */
template <int OP, int MA, int MB>
__global__ void binary(float *d, GTC_PARAM gtc_reader a, GTC_PARAM gtc_reader b, GTC_PARAM gt_tensor like,
                       int64_t n) {
    const float *ad = (const float *)a.t.data, *bd = (const float *)b.t.data;
    GTC_FOR(i, n) {
        const float x = ad[gtc_at_m<MA>(a, like, i)], y = bd[gtc_at_m<MB>(b, like, i)];
        d[i] = OP == 0 ? x + y : OP == 1 ? x - y : OP == 2 ? x * y : x / y;
    }
}

template <int OP>
static int launch_binary(const gt_node *node, const char *op) {
    GTC_TRY(gtc_check_n_src_(node, 2, 2, op));
    const gt_tensor *d = &node->dst;
    GTC_F32(d, op, "dst");
    GTC_F32(&node->src[0], op, "src0");
    GTC_F32(&node->src[1], op, "src1");
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    GTC_TRY(gtc_check_broadcast_(&node->src[0], d, op, "src0"));
    GTC_TRY(gtc_check_broadcast_(&node->src[1], d, op, "src1"));
    const int64_t n = gtc_numel(*d);
    if (n == 0) return GT_OK;
    const gtc_reader a = gtc_reader_for(node->src[0], *d), b = gtc_reader_for(node->src[1], *d);
    const unsigned blocks = gtc_blocks(n);
    float *dd = (float *)d->data;
    cudaStream_t st = gtc_stream_();
    if (a.mode == 0 && b.mode == 0) binary<OP, 0, 0><<<blocks, GTC_THREADS, 0, st>>>(dd, a, b, *d, n);
    else if (a.mode == 0 && b.mode == 1) binary<OP, 0, 1><<<blocks, GTC_THREADS, 0, st>>>(dd, a, b, *d, n);
    else if (a.mode == 1 && b.mode == 0) binary<OP, 1, 0><<<blocks, GTC_THREADS, 0, st>>>(dd, a, b, *d, n);
    else binary<OP, -1, -1><<<blocks, GTC_THREADS, 0, st>>>(dd, a, b, *d, n);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(add_fwd_f32) { (void)ctx; return launch_binary<0>(node, "add"); }
GTC_LAUNCHER(sub_fwd_f32) { (void)ctx; return launch_binary<1>(node, "sub"); }
GTC_LAUNCHER(mul_fwd_f32) { (void)ctx; return launch_binary<2>(node, "mul"); }
GTC_LAUNCHER(div_fwd_f32) { (void)ctx; return launch_binary<3>(node, "div"); }

/* ---- unary, src any strides, dst contiguous -------------------------------------------------- */

enum { U_SCALE, U_FILL, U_RELU, U_SILU, U_TANH, U_SOFTPLUS, U_LOG1MEXP, U_EXP, U_LOG, U_SQRT, U_SQR };

/* silu, swiglu and geglu in the CPU kernels' expressions, with the shared exp (elementmath.h):
 * the same bits on both backends. */
__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + gt_expf_(-x)); }

template <int OP>
__device__ inline float unary_op(float x, float p) {
    switch (OP) {
    case U_SCALE: return p * x;
    case U_FILL: return p;
    case U_RELU: return x > 0.0f ? x : 0.0f;
    case U_SILU: return x / (1.0f + gt_expf_(-x));
    case U_TANH: return tanhf(x);
    case U_SOFTPLUS: return x > 0.0f ? x + log1pf(expf(-x)) : log1pf(expf(x));
    case U_LOG1MEXP: return x > -0.6931471805599453f ? logf(-expm1f(x)) : log1pf(-expf(x));
    case U_EXP: return expf(x);
    case U_LOG: return logf(x);
    case U_SQRT: return sqrtf(x);
    default: return x * x;
    }
}

template <int OP>
__global__ void unary(float *d, GTC_PARAM gtc_reader s, GTC_PARAM gt_tensor like, int64_t n, float p) {
    const float *sd = (const float *)s.t.data;
    GTC_FOR(i, n) d[i] = unary_op<OP>(OP == U_FILL ? 0.0f : sd[gtc_at(s, like, i)], p);
}

template <int OP>
static int launch_unary(const gt_node *node, const char *op) {
    const gt_tensor *d = &node->dst;
    GTC_F32(d, op, "dst");
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    gt_tensor s = *d;
    if (OP != U_FILL) {
        /* (more inputs than src0 are order-only: with_grad lowers to a scale of its src0) */
        GTC_TRY(gtc_check_n_src_(node, 1, 6, op));
        GTC_F32(&node->src[0], op, "src");
        GTC_TRY(gtc_check_same_shape_(&node->src[0], d, op, "src", "dst"));
        s = node->src[0];
    }
    const int64_t n = gtc_numel(*d);
    if (n == 0) return GT_OK;
    unary<OP><<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, gtc_reader_for(s, *d), *d, n,
                                                                 node->fp[0]);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(scale_fwd_f32) { (void)ctx; return launch_unary<U_SCALE>(node, "scale"); }
GTC_LAUNCHER(fill_fwd_f32) { (void)ctx; return launch_unary<U_FILL>(node, "fill"); }
GTC_LAUNCHER(relu_fwd_f32) { (void)ctx; return launch_unary<U_RELU>(node, "relu"); }
GTC_LAUNCHER(silu_fwd_f32) { (void)ctx; return launch_unary<U_SILU>(node, "silu"); }
GTC_LAUNCHER(tanh_fwd_f32) { (void)ctx; return launch_unary<U_TANH>(node, "tanh"); }
GTC_LAUNCHER(softplus_fwd_f32) { (void)ctx; return launch_unary<U_SOFTPLUS>(node, "softplus"); }
GTC_LAUNCHER(log1mexp_fwd_f32) { (void)ctx; return launch_unary<U_LOG1MEXP>(node, "log1mexp"); }
GTC_LAUNCHER(exp_fwd_f32) { (void)ctx; return launch_unary<U_EXP>(node, "exp"); }
GTC_LAUNCHER(log_fwd_f32) { (void)ctx; return launch_unary<U_LOG>(node, "log"); }
GTC_LAUNCHER(sqrt_fwd_f32) { (void)ctx; return launch_unary<U_SQRT>(node, "sqrt"); }
GTC_LAUNCHER(sqr_fwd_f32) { (void)ctx; return launch_unary<U_SQR>(node, "sqr"); }

/* ---- backward of relu and silu: src0 x, src1 g ----------------------------------------------- */

template <int OP>
__global__ void unary_bwd(float *d, GTC_PARAM gtc_reader x, GTC_PARAM gtc_reader g, GTC_PARAM gt_tensor like,
                          int64_t n) {
    const float *xd = (const float *)x.t.data, *gd = (const float *)g.t.data;
    GTC_FOR(i, n) {
        const float xi = xd[gtc_at(x, like, i)], gi = gd[gtc_at(g, like, i)];
        if (OP == U_RELU) {
            d[i] = xi > 0.0f ? gi : 0.0f;
        } else {
            const float s = sigmoid(xi);
            d[i] = gi * s * (1.0f + xi * (1.0f - s));
        }
    }
}

template <int OP>
static int launch_unary_bwd(const gt_node *node, const char *op) {
    GTC_TRY(gtc_check_n_src_(node, 2, 2, op));
    const gt_tensor *d = &node->dst;
    GTC_F32(d, op, "dst");
    GTC_F32(&node->src[0], op, "x");
    GTC_F32(&node->src[1], op, "g");
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    GTC_TRY(gtc_check_same_shape_(&node->src[0], d, op, "x", "dst"));
    GTC_TRY(gtc_check_same_shape_(&node->src[1], d, op, "g", "dst"));
    const int64_t n = gtc_numel(*d);
    if (n == 0) return GT_OK;
    unary_bwd<OP><<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data,
                                                                     gtc_reader_for(node->src[0], *d),
                                                                     gtc_reader_for(node->src[1], *d), *d, n);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(relu_bwd_f32) { (void)ctx; return launch_unary_bwd<U_RELU>(node, "relu_bwd"); }
GTC_LAUNCHER(silu_bwd_f32) { (void)ctx; return launch_unary_bwd<U_SILU>(node, "silu_bwd"); }

/* ---- the FFN gates: swiglu (silu(g) * u) and geglu (gelu_tanh(g) * u) ------------------------ */

template <bool GELU>
__global__ void gate_fwd(float *d, const float *g, const float *u, int64_t n) {
    GTC_FOR(i, n) {
        const float x = g[i];
        d[i] = GELU ? 0.5f * x * (1.0f + gt_gelu_tanh_t_(x)) * u[i] : x / (1.0f + gt_expf_(-x)) * u[i];
    }
}

/* dst = [dg | du] */
template <bool GELU>
__global__ void gate_bwd(float *d, const float *g, const float *u, const float *dy, int64_t n) {
    GTC_FOR(i, n) {
        const float x = g[i];
        if (GELU) {
            const float t = gt_gelu_tanh_t_(x), dz = GT_GELU_K * (1.0f + 3.0f * GT_GELU_A * x * x);
            d[n + i] = dy[i] * (0.5f * x * (1.0f + t));
            d[i] = dy[i] * u[i] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dz);
        } else {
            const float e = gt_expf_(-x);
            const float s = 1.0f / (1.0f + e), gs = dy[i] * u[i];
            d[n + i] = dy[i] * (x / (1.0f + e));
            d[i] = gs * s * (1.0f + x * (1.0f - s));
        }
    }
}

template <bool GELU>
static int launch_gate(const gt_node *node, bool backward, const char *op) {
    GTC_TRY(gtc_check_n_src_(node, backward ? 3 : 2, backward ? 3 : 2, op));
    const gt_tensor *d = &node->dst;
    GTC_F32(d, op, "dst");
    for (int i = 0; i < node->n_src; i++) {
        GTC_F32(&node->src[i], op, "input");
        GTC_TRY(gtc_check_contig_(&node->src[i], op, "input"));
        GTC_TRY(gtc_check_same_shape_(&node->src[i], &node->src[0], op, "input", "src0"));
    }
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    const int64_t n = gtc_numel(node->src[0]);
    if (gtc_numel(*d) != (backward ? 2 * n : n)) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst has the wrong size", op);
    const float *g = (const float *)node->src[0].data, *u = (const float *)node->src[1].data;
    if (backward)
        gate_bwd<GELU><<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, g, u,
                                                                          (const float *)node->src[2].data, n);
    else
        gate_fwd<GELU><<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, g, u, n);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(swiglu_fwd_f32) { (void)ctx; return launch_gate<false>(node, false, "swiglu"); }
GTC_LAUNCHER(swiglu_bwd_f32) { (void)ctx; return launch_gate<false>(node, true, "swiglu_bwd"); }
GTC_LAUNCHER(geglu_fwd_f32) { (void)ctx; return launch_gate<true>(node, false, "geglu"); }
GTC_LAUNCHER(geglu_bwd_f32) { (void)ctx; return launch_gate<true>(node, true, "geglu_bwd"); }

/* swiglu_oai (gpt-oss's clamped gate), the CPU kernel's expressions; fp[0] alpha, fp[1] limit;
 * the backward's dst = [dg | du] */
__global__ void swiglu_oai(float *d, const float *g, const float *u, const float *dy, int64_t n, float alpha,
                           float limit) {
    GTC_FOR(i, n) {
        const float x = g[i] < limit ? g[i] : limit;
        const float y = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
        const float s = 1.0f / (1.0f + gt_expf_(-alpha * x)), glu = x * s;
        if (!dy) {
            d[i] = glu * (y + 1.0f);
            continue;
        }
        d[i] = g[i] < limit ? dy[i] * (y + 1.0f) * (s + alpha * glu * (1.0f - s)) : 0.0f;
        d[n + i] = u[i] >= -limit && u[i] <= limit ? dy[i] * glu : 0.0f;
    }
}

static int launch_swiglu_oai(const gt_node *node, bool backward, const char *op) {
    GTC_TRY(gtc_check_n_src_(node, backward ? 3 : 2, backward ? 3 : 2, op));
    const gt_tensor *d = &node->dst;
    GTC_F32(d, op, "dst");
    for (int i = 0; i < node->n_src; i++) {
        GTC_F32(&node->src[i], op, "input");
        GTC_TRY(gtc_check_contig_(&node->src[i], op, "input"));
        GTC_TRY(gtc_check_same_shape_(&node->src[i], &node->src[0], op, "input", "src0"));
    }
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    const int64_t n = gtc_numel(node->src[0]);
    if (gtc_numel(*d) != (backward ? 2 * n : n)) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst has the wrong size", op);
    if (n == 0) return GT_OK;
    swiglu_oai<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(
        (float *)d->data, (const float *)node->src[0].data, (const float *)node->src[1].data,
        backward ? (const float *)node->src[2].data : NULL, n, node->fp[0], node->fp[1]);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(swiglu_oai_fwd_f32) { (void)ctx; return launch_swiglu_oai(node, false, "swiglu_oai"); }
GTC_LAUNCHER(swiglu_oai_bwd_f32) { (void)ctx; return launch_swiglu_oai(node, true, "swiglu_oai_bwd"); }

/* ---- dropout: the CPU's hash (native/elementmath.h), bit for bit ------------------------------ */

__global__ void dropout(float *d, const float *x, const int32_t *seed, uint32_t salt, uint32_t thr, float s,
                        int64_t n) {
    const uint32_t h1 = gt_murmur3_block((uint32_t)*seed, salt);
    GTC_FOR(i, n) d[i] = gt_dropout_hash(h1, (uint32_t)i, (uint32_t)((uint64_t)i >> 32)) >= thr ? x[i] * s : 0.0f;
}

GTC_LAUNCHER(dropout_fwd_f32) {
    (void)ctx;
    const char *op = "dropout";
    GTC_TRY(gtc_check_n_src_(node, 2, 2, op));
    const gt_tensor *d = &node->dst, *x = &node->src[0];
    GTC_F32(d, op, "dst");
    GTC_F32(x, op, "x");
    GTC_I32(&node->src[1], op, "seed");
    GTC_TRY(gtc_check_same_shape_(x, d, op, "x", "dst"));
    GTC_TRY(gtc_check_contig_(x, op, "x"));
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    if (gtc_numel(node->src[1]) != 1) return GTC_FAIL(GT_ERR_SHAPE, "%s: expected seed of one element", op);
    const float p = node->fp[0];
    if (!(p >= 0.0f && p < 1.0f)) return GTC_FAIL(GT_ERR_INVALID, "%s: expected p (fp[0]) in [0, 1), got %g", op, p);
    if (node->ip[0] < 0 || node->ip[0] > (int64_t)UINT32_MAX)
        return GTC_FAIL(GT_ERR_INVALID, "%s: expected salt (ip[0]) in [0, 2^32)", op);
    const uint32_t thr = (uint32_t)((double)p * 4294967296.0);
    const float s = (float)(1.0 / (1.0 - (double)p));
    const int64_t n = gtc_numel(*d);
    dropout<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, (const float *)x->data,
                                                               (const int32_t *)node->src[1].data,
                                                               (uint32_t)node->ip[0], thr, s, n);
    return GTC_LAUNCHED(op);
}

/* ---- copies with conversion (also `cont`): src f32/f16/bf16 any strides, dst contiguous ----- */

__device__ inline uint16_t to_f16(float f) { return __half_as_ushort(__float2half_rn(f)); }

template <int DST>
__global__ void copy(void *d, GTC_PARAM gt_tensor s, GTC_PARAM gt_tensor like, int64_t n, bool plain) {
    GTC_FOR(i, n) {
        const int64_t o = plain ? i : gtc_offset(s, like, i);
        float v;
        if (s.dtype == GT_F32) v = ((const float *)s.data)[o];
        else if (s.dtype == GT_F16) v = gtc_f16(((const uint16_t *)s.data)[o]);
        else v = gtc_bf16(((const uint16_t *)s.data)[o]);
        if (DST == GT_F32) {
            ((float *)d)[i] = v;
        } else if (DST == GT_F16) {
            ((uint16_t *)d)[i] = s.dtype == GT_F16 ? ((const uint16_t *)s.data)[o] : to_f16(v);
        } else {
            ((uint16_t *)d)[i] = s.dtype == GT_BF16 ? ((const uint16_t *)s.data)[o] : gtc_to_bf16(v);
        }
    }
}

template <int DST>
static int launch_copy(const gt_node *node, const char *op) {
    GTC_TRY(gtc_check_n_src_(node, 1, 1, op));
    const gt_tensor *d = &node->dst, *s = &node->src[0];
    GTC_TRY(gtc_check_dtype_(d, DST, op, "dst"));
    if (s->dtype != GT_F32 && s->dtype != GT_F16 && s->dtype != GT_BF16)
        return GTC_FAIL(GT_ERR_DTYPE, "%s: src must be f32, f16 or bf16", op);
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    if (gtc_numel(*s) != gtc_numel(*d)) return GTC_FAIL(GT_ERR_SHAPE, "%s: src and dst differ in size", op);
    const int64_t n = gtc_numel(*d);
    copy<DST><<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(d->data, *s, *s, n, gtc_contiguous(*s));
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(copy_fwd_f32) { (void)ctx; return launch_copy<GT_F32>(node, "copy_f32"); }
GTC_LAUNCHER(copy_fwd_f16) { (void)ctx; return launch_copy<GT_F16>(node, "copy_f16"); }
GTC_LAUNCHER(copy_fwd_bf16) { (void)ctx; return launch_copy<GT_BF16>(node, "copy_bf16"); }

/* ---- optimizer steps, in place (enum gt_hyper) ----------------------------------------------- */

__device__ inline float clip_scale(const float *h, const float *norm) {
    const float max_norm = h[GT_HYPER_MAX_NORM];
    return max_norm > 0.0f && *norm > max_norm ? max_norm / (*norm + 1e-6f) : 1.0f;
}

__global__ void adamw(float *p, const float *g, const float *h, const float *norm, float *m, float *v, float wd_on,
                      int64_t n, GTC_ERR_ARGS) {
    const float scale = clip_scale(h, norm);
    const float lr = h[GT_HYPER_LR], b1 = h[GT_HYPER_BETA1], b2 = h[GT_HYPER_BETA2], eps = h[GT_HYPER_EPS];
    const float decay = lr * h[GT_HYPER_WD] * wd_on, bc1 = h[GT_HYPER_BC1], bc2 = h[GT_HYPER_BC2];
    if (!(bc1 > 0.0f) || !(bc2 > 0.0f)) {
        GTC_RAISE(GTC_DEV_BIAS_CORRECTION, 0, 0, 0);
        return;
    }
    GTC_FOR(i, n) gt_adamw_1(&p[i], g[i] * scale, &m[i], &v[i], lr, b1, b2, eps, decay, bc1, bc2);
}

__global__ void sgd(float *p, const float *g, const float *h, const float *norm, float *buf, float wd_on, int64_t n) {
    const float scale = clip_scale(h, norm);
    const float lr = h[GT_HYPER_LR], wd = h[GT_HYPER_WD] * wd_on, mu = h[GT_HYPER_MOMENTUM];
    GTC_FOR(i, n) {
        float gi = g[i] * scale + wd * p[i];
        if (mu != 0.0f) {
            gi = mu * buf[i] + gi;
            buf[i] = gi;
        }
        p[i] -= lr * gi;
    }
}

static int check_step(const gt_node *node, int n_src, const char *op) {
    GTC_TRY(gtc_check_n_src_(node, n_src, n_src, op));
    const int64_t n = gtc_numel(node->src[0]);
    for (int i = 0; i < n_src; i++) {
        const gt_tensor *t = &node->src[i];
        GTC_F32(t, op, "input");
        GTC_TRY(gtc_check_contig_(t, op, "input"));
        if (i == 2 && gtc_numel(*t) < GT_HYPER_COUNT) return GTC_FAIL(GT_ERR_SHAPE, "%s: hyper vector too short", op);
        if (i == 3 && gtc_numel(*t) != 1) return GTC_FAIL(GT_ERR_SHAPE, "%s: grad norm must be a scalar", op);
        if (i != 2 && i != 3 && gtc_numel(*t) != n)
            return GTC_FAIL(GT_ERR_SHAPE, "%s: input %d has %lld elements, param has %lld", op, i,
                            (long long)gtc_numel(*t), (long long)n);
    }
    if (node->dst.data != node->src[0].data)
        return GTC_FAIL(GT_ERR_INVALID, "%s: dst must alias the parameter (in-place step)", op);
    return GT_OK;
}

GTC_LAUNCHER(adamw_step_fwd_f32) {
    (void)ctx;
    GTC_TRY(check_step(node, 6, "adamw_step"));
    const int64_t n = gtc_numel(node->src[0]);
    adamw<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(
        (float *)node->src[0].data, (const float *)node->src[1].data, (const float *)node->src[2].data,
        (const float *)node->src[3].data, (float *)node->src[4].data, (float *)node->src[5].data, node->fp[0], n,
        GTC_ERR_PASS);
    return GTC_LAUNCHED("adamw_step");
}

GTC_LAUNCHER(sgd_step_fwd_f32) {
    (void)ctx;
    GTC_TRY(check_step(node, 5, "sgd_step"));
    const int64_t n = gtc_numel(node->src[0]);
    sgd<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(
        (float *)node->src[0].data, (const float *)node->src[1].data, (const float *)node->src[2].data,
        (const float *)node->src[3].data, (float *)node->src[4].data, node->fp[0], n);
    return GTC_LAUNCHED("sgd_step");
}
