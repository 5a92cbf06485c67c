/* conv2d.cu: the direct convolution over NHWC with bias, relu and max-pool fused, and its two
 * gradients, as ggtrain.h's conv2d: one thread an output element, the sums in the CPU's
 * order (channel, kernel row, kernel column); the kernel's gradient, a sum over every output
 * position, in chunks of positions (one thread a chunk and output), then the chunks in order.
 * Both gradients first write the gradient of the convolution's outputs (before relu and pool)
 * densely into scratch (conv_dv), so the pool's codes and the relu are read once an output,
 * not once a product (they were read C*KH*KW times over, most of both gradients' time). */
#include "common.cuh"
#include "kernels.h"

struct geom {
    int64_t N, H, W, C, CO, KH, KW, S, P, OH, OW, pool, PH, PW;
    int relu, bias;
};

/* The geometry as the kernels index with it: I = int32_t when every flat index of the
 * launch fits (the usual case: a 64-bit division is dozens of instructions on the GPU and
 * the index arithmetic was most of the backward's time), else int64_t. */
template <typename I>
struct geomT {
    I N, H, W, C, CO, KH, KW, S, P, OH, OW, pool, PH, PW;
    int relu, bias;
};

template <typename I>
static geomT<I> narrow(const geom &g) {
    return geomT<I>{(I)g.N, (I)g.H, (I)g.W, (I)g.C, (I)g.CO, (I)g.KH, (I)g.KW, (I)g.S, (I)g.P,
                    (I)g.OH, (I)g.OW, (I)g.pool, (I)g.PH, (I)g.PW, g.relu, g.bias};
}

/* Whether every index of a launch over these geometries and `extra` items fits in int32. */
static bool fits32(const geom &g, int64_t extra) {
    const int64_t lim = (int64_t)1 << 30;
    const int64_t sizes[] = {g.N * g.H * g.W * g.C, 2 * g.N * g.OH * g.OW * g.CO, g.CO * g.C * g.KH * g.KW + g.CO,
                             g.H + 2 * g.P + g.KH, g.W + 2 * g.P + g.KW, extra};
    for (int64_t s : sizes)
        if (s >= lim) return false;
    return true;
}

static int geometry(const gt_node *node, const gt_tensor *x, const gt_tensor *k, geom *g, const char *op) {
    g->KH = node->ip[0];
    g->KW = node->ip[1];
    g->S = node->ip[2];
    g->P = node->ip[3];
    g->relu = (int)node->ip[4];
    g->pool = node->ip[5];
    if (g->KH < 1 || g->KW < 1 || g->S < 1 || g->P < 0 || (g->relu != 0 && g->relu != 1) || g->pool < 1)
        return GTC_FAIL(GT_ERR_INVALID, "%s: expected ip = {KH, KW, stride, pad, relu 0/1, pool >= 1}", op);
    if (x->ndim != 4 || k->ndim != 4 || k->shape[1] != x->shape[3] || k->shape[2] != g->KH || k->shape[3] != g->KW)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: expected x (N, H, W, C) and kernel (CO, C, KH, KW)", op);
    if (x->shape[1] + 2 * g->P < g->KH || x->shape[2] + 2 * g->P < g->KW)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: the kernel is larger than the padded image", op);
    g->N = x->shape[0];
    g->H = x->shape[1];
    g->W = x->shape[2];
    g->C = x->shape[3];
    g->CO = k->shape[0];
    g->OH = (g->H + 2 * g->P - g->KH) / g->S + 1;
    g->OW = (g->W + 2 * g->P - g->KW) / g->S + 1;
    g->PH = g->OH / g->pool;
    g->PW = g->OW / g->pool;
    if (g->pool > 1 && (g->PH < 1 || g->PW < 1))
        return GTC_FAIL(GT_ERR_SHAPE, "%s: the pool window %lld is larger than the output", op, (long long)g->pool);
    return GT_OK;
}

/* A grid-stride loop in the geometry's index type. */
#define CONV_FOR(i, n) for (I i = (I)(blockIdx.x * blockDim.x + threadIdx.x); i < (I)(n); \
                            i += (I)(gridDim.x * blockDim.x))

/* relu?(conv + bias) at (n, oh, ow, co). */
template <typename I>
__device__ inline float conv_at(const geomT<I> &g, const float *x, const float *k, const float *b, I n, I oh, I ow,
                                I co) {
    float acc = 0.0f;
    for (I c = 0; c < g.C; c++)
        for (I kh = 0; kh < g.KH; kh++) {
            const I h = oh * g.S - g.P + kh;
            for (I kw = 0; kw < g.KW; kw++) {
                const I w = ow * g.S - g.P + kw;
                const float xv = h >= 0 && h < g.H && w >= 0 && w < g.W ? x[((n * g.H + h) * g.W + w) * g.C + c] : 0.0f;
                acc = fmaf(xv, k[((co * g.C + c) * g.KH + kh) * g.KW + kw], acc);
            }
        }
    if (b) acc += b[co];
    return g.relu ? (acc > 0.0f ? acc : 0.0f) : acc;
}

template <typename I>
__global__ void conv_fwd(geomT<I> g, float *d, const float *x, const float *k, const float *b) {
    if (g.pool == 1) {
        CONV_FOR(i, g.N * g.OH * g.OW * g.CO) {
            const I co = i % g.CO, ow = (i / g.CO) % g.OW, oh = (i / (g.CO * g.OW)) % g.OH,
                          n = i / (g.CO * g.OW * g.OH);
            d[i] = conv_at(g, x, k, b, n, oh, ow, co);
        }
        return;
    }
    const I plane = g.N * g.PH * g.PW * g.CO;
    CONV_FOR(i, plane) {
        const I co = i % g.CO, pc = (i / g.CO) % g.PW, pr = (i / (g.CO * g.PW)) % g.PH,
                      n = i / (g.CO * g.PW * g.PH);
        float m = 0.0f, code = 0.0f;
        for (I a = 0; a < g.pool; a++)
            for (I c = 0; c < g.pool; c++) {
                const float v = conv_at(g, x, k, b, n, pr * g.pool + a, pc * g.pool + c, co);
                if ((a == 0 && c == 0) || v > m) {
                    m = v;
                    code = (float)(a * g.pool + c);
                }
            }
        d[i] = m;
        d[plane + i] = g.relu && !(m > 0.0f) ? -1.0f : code;
    }
}

/* The gradient of the convolution's output (before relu and pool) at (n, oh, ow, co), from the
 * forward's dst y and the gradient g of its values. */
template <typename I>
__device__ inline float dv_at(const geomT<I> &g, const float *y, const float *gr, I n, I oh, I ow, I co) {
    if (g.pool == 1) {
        const I at = ((n * g.OH + oh) * g.OW + ow) * g.CO + co;
        return g.relu && !(y[at] > 0.0f) ? 0.0f : gr[at];
    }
    const I pr = oh / g.pool, pc = ow / g.pool;
    if (pr >= g.PH || pc >= g.PW) return 0.0f;
    const I plane = g.N * g.PH * g.PW * g.CO, at = ((n * g.PH + pr) * g.PW + pc) * g.CO + co;
    const float code = (float)((oh - pr * g.pool) * g.pool + (ow - pc * g.pool));
    return y[plane + at] == code ? gr[at] : 0.0f;
}

/* dv[(n, oh, ow, co)] = dv_at(...): the gradient of every output of the convolution. */
template <typename I>
__global__ void conv_dv(geomT<I> g, float *dv, const float *y, const float *gr) {
    CONV_FOR(i, g.N * g.OH * g.OW * g.CO) {
        const I co = i % g.CO, ow = (i / g.CO) % g.OW, oh = (i / (g.CO * g.OW)) % g.OH, n = i / (g.CO * g.OW * g.OH);
        dv[i] = dv_at(g, y, gr, n, oh, ow, co);
    }
}

static int64_t dv_numel(const geom &g) { return g.N * g.OH * g.OW * g.CO; }

/* Output positions (n, oh, ow) one partial sum of the kernel's gradient covers. */
#define CONV_CHUNK 512

static int64_t weight_chunks(const geom &g) {
    const int64_t p = g.N * g.OH * g.OW;
    return p > 0 ? (p + CONV_CHUNK - 1) / CONV_CHUNK : 1;
}

/* part[chunk][r * CO + co]: the gradient of kernel row r (c, kh, kw; r = C*KH*KW: the bias) of
 * output channel co, summed over the chunk's positions in order. */
template <typename I>
__global__ void conv_weight_partial(geomT<I> g, float *part, const float *x, const float *dv, I chunks) {
    const I rows = g.C * g.KH * g.KW, outs = (rows + 1) * g.CO, P = g.N * g.OH * g.OW;
    CONV_FOR(i, chunks * outs) {
        const I o = i % outs, chunk = i / outs, co = o % g.CO, r = o / g.CO;
        const I c = r / (g.KH * g.KW), kh = (r / g.KW) % g.KH, kw = r % g.KW;
        const I p0 = chunk * CONV_CHUNK, p1 = p0 + CONV_CHUNK < P ? p0 + CONV_CHUNK : P;
        I ow = p0 % g.OW, oh = (p0 / g.OW) % g.OH, n = p0 / (g.OW * g.OH);
        const bool bias = r == rows;
        float acc = 0.0f;
        /* (each position's loads do not wait on the sum, so unrolled they are in flight together:
         * one at a time, each waited its full latency) */
#pragma unroll 4
        for (I p = p0; p < p1; p++) {
            const float d = dv[p * g.CO + co];
            const I h = oh * g.S - g.P + kh, w = ow * g.S - g.P + kw;
            const bool in = !bias && h >= 0 && h < g.H && w >= 0 && w < g.W;
            const float xv = in ? x[((n * g.H + h) * g.W + w) * g.C + c] : 0.0f;
            if (d != 0.0f && (bias || in)) acc += bias ? d : d * xv;
            if (++ow == g.OW) {
                ow = 0;
                if (++oh == g.OH) {
                    oh = 0;
                    n++;
                }
            }
        }
        part[i] = acc;
    }
}

template <typename I>
__global__ void conv_weight_total(float *d, const float *part, I outs, I chunks) {
    CONV_FOR(o, outs) {
        float acc = 0.0f;
        for (I k = 0; k < chunks; k++) acc += part[k * outs + o];
        d[o] = acc;
    }
}

/* UNIT: stride 1, where an output position is the input's shifted by the kernel offset (no
 * division by the stride: a 32-bit division is about 20 instructions, and there are two per
 * product). */
template <typename I, bool UNIT>
__global__ void conv_input_bwd(geomT<I> g, float *d, const float *k, const float *dv) {
    CONV_FOR(i, g.N * g.H * g.W * g.C) {
        const I c = i % g.C, w = (i / g.C) % g.W, h = (i / (g.C * g.W)) % g.H, n = i / (g.C * g.W * g.H);
        float acc = 0.0f;
        for (I co = 0; co < g.CO; co++)
            for (I kh = 0; kh < g.KH; kh++) {
                const I hs = h + g.P - kh;
                if (hs < 0 || (!UNIT && hs % g.S)) continue;
                const I oh = UNIT ? hs : hs / g.S;
                if (oh >= g.OH) continue;
                for (I kw = 0; kw < g.KW; kw++) {
                    const I ws = w + g.P - kw;
                    if (ws < 0 || (!UNIT && ws % g.S)) continue;
                    const I ow = UNIT ? ws : ws / g.S;
                    if (ow >= g.OW) continue;
                    acc += dv[((n * g.OH + oh) * g.OW + ow) * g.CO + co] * k[((co * g.C + c) * g.KH + kh) * g.KW + kw];
                }
            }
        d[i] = acc;
    }
}

static int check_all(const gt_node *node, int lo, int hi, const char *op) {
    GTC_TRY(gtc_check_n_src_(node, lo, hi, op));
    GTC_F32(&node->dst, op, "dst");
    GTC_TRY(gtc_check_contig_(&node->dst, op, "dst"));
    for (int i = 0; i < node->n_src; i++) {
        GTC_F32(&node->src[i], op, "input");
        GTC_TRY(gtc_check_contig_(&node->src[i], op, "input"));
    }
    return GT_OK;
}

static int64_t out_numel(const geom &g) {
    return g.pool == 1 ? g.N * g.OH * g.OW * g.CO : 2 * g.N * g.PH * g.PW * g.CO;
}

GTC_LAUNCHER(conv2d_fwd_f32) {
    (void)ctx;
    const char *op = "conv2d";
    GTC_TRY(check_all(node, 2, 3, op));
    geom g;
    GTC_TRY(geometry(node, &node->src[0], &node->src[1], &g, op));
    g.bias = node->n_src == 3;
    if (g.bias && gtc_numel(node->src[2]) != g.CO) return GTC_FAIL(GT_ERR_SHAPE, "%s: bias must be (CO,)", op);
    GTC_TRY(gt_conv2d_out_check(&node->dst, g.N, g.OH, g.OW, g.CO, g.pool, op, "dst"));
    const int64_t n = g.pool == 1 ? out_numel(g) : out_numel(g) / 2;
    if (n == 0) return GT_OK;
    float *d = (float *)node->dst.data;
    const float *x = (const float *)node->src[0].data, *k = (const float *)node->src[1].data,
                *b = g.bias ? (const float *)node->src[2].data : NULL;
    if (fits32(g, n))
        conv_fwd<int32_t><<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(narrow<int32_t>(g), d, x, k, b);
    else
        conv_fwd<int64_t><<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(narrow<int64_t>(g), d, x, k, b);
    return GTC_LAUNCHED(op);
}

/* The kernel gradient's geometry: the kernel's shape from dst (C*KH*KW + 1, CO) and ip. */
static int weight_geometry(const gt_node *node, geom *g, const char *op) {
    const gt_tensor *x = &node->src[0], *d = &node->dst;
    if (node->n_src < 1 || d->ndim != 2 || x->ndim != 4)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: expected x (N, H, W, C) and dst (C*KH*KW + 1, CO)", op);
    gt_tensor k = *x;
    k.shape[0] = d->shape[1];
    k.shape[1] = x->shape[3];
    k.shape[2] = node->ip[0];
    k.shape[3] = node->ip[1];
    GTC_TRY(geometry(node, x, &k, g, op));
    if (d->shape[0] != g->C * g->KH * g->KW + 1)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: dst must be (C*KH*KW + 1, CO)", op);
    return GT_OK;
}

/* Scratch: the chunks' partial sums, then the dense dv. */
GTC_SIZES(conv2d_weight_bwd_f32) {
    geom g{};
    GTC_TRY(weight_geometry(node, &g, "conv2d_weight_bwd"));
    *scratch = (weight_chunks(g) * gtc_numel(node->dst) + dv_numel(g)) * (int64_t)sizeof(float);
    *work = 0;
    return GT_OK;
}

/* The dense dv of the node's (out, grad) into dv. */
template <typename I>
static void launch_dv(const geom &g, float *dv, const gt_node *node) {
    conv_dv<I><<<gtc_blocks(dv_numel(g)), GTC_THREADS, 0, gtc_stream_()>>>(
        narrow<I>(g), dv, (const float *)node->src[1].data, (const float *)node->src[2].data);
}

GTC_LAUNCHER(conv2d_weight_bwd_f32) {
    (void)ctx;
    const char *op = "conv2d_weight_bwd";
    GTC_TRY(check_all(node, 3, 3, op));
    geom g;
    const gt_tensor *x = &node->src[0], *d = &node->dst;
    GTC_TRY(weight_geometry(node, &g, op));
    GTC_TRY(gt_conv2d_out_check(&node->src[1], g.N, g.OH, g.OW, g.CO, g.pool, op, "out"));
    GTC_TRY(gt_conv2d_grad_check(&node->src[2], g.N, g.OH, g.OW, g.CO, g.pool, op));
    const int64_t outs = gtc_numel(*d), chunks = weight_chunks(g);
    if (node->scratch_size < (chunks * outs + dv_numel(g)) * (int64_t)sizeof(float))
        return GTC_FAIL(GT_ERR_INVALID, "%s: scratch must hold %lld floats", op,
                        (long long)(chunks * outs + dv_numel(g)));
    float *part = (float *)node->scratch, *dv = part + chunks * outs;
    const float *xd = (const float *)x->data;
    const unsigned parts = gtc_blocks(chunks * outs), totals = gtc_blocks(outs);
    if (fits32(g, chunks * outs)) {
        launch_dv<int32_t>(g, dv, node);
        conv_weight_partial<int32_t><<<parts, GTC_THREADS, 0, gtc_stream_()>>>(narrow<int32_t>(g), part, xd, dv,
                                                                                (int32_t)chunks);
        conv_weight_total<int32_t><<<totals, GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, part,
                                                                               (int32_t)outs, (int32_t)chunks);
    } else {
        launch_dv<int64_t>(g, dv, node);
        conv_weight_partial<int64_t><<<parts, GTC_THREADS, 0, gtc_stream_()>>>(narrow<int64_t>(g), part, xd, dv,
                                                                                chunks);
        conv_weight_total<int64_t><<<totals, GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, part, outs, chunks);
    }
    return GTC_LAUNCHED(op);
}

/* Scratch: the dense dv. */
GTC_SIZES(conv2d_input_bwd_f32) {
    geom g{};
    GTC_TRY(geometry(node, &node->dst, &node->src[0], &g, "conv2d_input_bwd"));
    *scratch = dv_numel(g) * (int64_t)sizeof(float);
    *work = 0;
    return GT_OK;
}

GTC_LAUNCHER(conv2d_input_bwd_f32) {
    (void)ctx;
    const char *op = "conv2d_input_bwd";
    GTC_TRY(check_all(node, 3, 3, op));
    geom g;
    const gt_tensor *d = &node->dst;
    GTC_TRY(geometry(node, d, &node->src[0], &g, op));
    GTC_TRY(gt_conv2d_out_check(&node->src[1], g.N, g.OH, g.OW, g.CO, g.pool, op, "out"));
    GTC_TRY(gt_conv2d_grad_check(&node->src[2], g.N, g.OH, g.OW, g.CO, g.pool, op));
    const int64_t n = gtc_numel(*d);
    if (n == 0) return GT_OK;
    if (node->scratch_size < dv_numel(g) * (int64_t)sizeof(float))
        return GTC_FAIL(GT_ERR_INVALID, "%s: scratch must hold %lld floats", op, (long long)dv_numel(g));
    float *dd = (float *)d->data, *dv = (float *)node->scratch;
    const float *k = (const float *)node->src[0].data;
    const unsigned blocks = gtc_blocks(n);
    if (fits32(g, n)) {
        launch_dv<int32_t>(g, dv, node);
        if (g.S == 1)
            conv_input_bwd<int32_t, true><<<blocks, GTC_THREADS, 0, gtc_stream_()>>>(narrow<int32_t>(g), dd, k, dv);
        else
            conv_input_bwd<int32_t, false><<<blocks, GTC_THREADS, 0, gtc_stream_()>>>(narrow<int32_t>(g), dd, k, dv);
    } else {
        launch_dv<int64_t>(g, dv, node);
        conv_input_bwd<int64_t, false><<<blocks, GTC_THREADS, 0, gtc_stream_()>>>(narrow<int64_t>(g), dd, k, dv);
    }
    return GTC_LAUNCHED(op);
}
