/* attention.cu: the fused attention, forward and backward, one block of threads a query row
 * (forward, dq) or a key row (dk, dv), with that row's scores in shared memory: exact and
 * deterministic, written for correctness first (a tiled kernel is the next step). Masks,
 * window and GQA as ggtrain.h's attention. */
#include "common.cuh"
#include "kernels.h"

#define ATT_THREADS 128

struct att {
    gt_tensor q, k, v;
    const int32_t *m;          /* pos (Tq,) or seg (B, T), or NULL */
    int64_t B, Tq, Tk, H, Hkv, D, window;
    int mask;
    float scale;
};

/* Key j is seen by query row i of batch b. */
__device__ inline bool seen(const att &a, int64_t b, int64_t i, int64_t j) {
    int64_t hi = a.Tk - 1, lo = 0;
    if (a.mask == 3) {
        const int32_t *sg = a.m + b * a.Tk;
        if (j > i || sg[j] != sg[i]) return false;
        hi = i;
    } else if (a.mask == 1) {
        hi = i + (a.Tk - a.Tq);
    } else if (a.mask == 2) {
        hi = a.m[i];
    }
    if (a.window > 0) lo = hi - a.window + 1;
    return j <= hi && j >= lo;
}

__device__ inline const float *row(const gt_tensor &t, int64_t b, int64_t i, int64_t h) {
    return (const float *)t.data + b * t.strides[0] + i * t.strides[1] + h * t.strides[2];
}

__device__ inline float dot(const float *x, const float *y, int64_t D) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; d++) s += x[d] * y[d];
    return s;
}

/* p[j] = scale q_i . k_j of the keys row i sees, -inf elsewhere; returns their max. */
__device__ float scores(const att &a, int64_t b, int64_t i, int64_t h, float *p, float *sh) {
    const int64_t hk = h / (a.H / a.Hkv);
    const float *qi = row(a.q, b, i, h);
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < a.Tk; j += blockDim.x) {
        const float s = seen(a, b, i, j) ? a.scale * dot(qi, row(a.k, b, j, hk), a.D) : -INFINITY;
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    return gtc_block_max(mx, sh);
}

__global__ void att_fwd(att a, float *o, float *lse) {
    extern __shared__ float p[];
    __shared__ float sh[32];
    const int64_t r = blockIdx.x, i = r % a.Tq, h = (r / a.Tq) % a.H, b = r / (a.Tq * a.H);
    const int64_t hk = h / (a.H / a.Hkv);
    const float mx = scores(a, b, i, h, p, sh);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < a.Tk; j += blockDim.x) {
        const float e = mx == -INFINITY ? 0.0f : expf(p[j] - mx);
        p[j] = e;
        sum += e;
    }
    sum = gtc_block_sum(sum, sh);
    __syncthreads();
    float *oi = o + ((b * a.Tq + i) * a.H + h) * a.D;
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j < a.Tk; j++)
            if (p[j] != 0.0f) acc += p[j] * row(a.v, b, j, hk)[d];
        oi[d] = sum > 0.0f ? acc / sum : 0.0f;
    }
    if (threadIdx.x == 0) lse[(b * a.H + h) * a.Tq + i] = sum > 0.0f ? mx + logf(sum) : -INFINITY;
}

static int setup(const gt_node *node, att *a, int mask_src, const char *op) {
    const gt_tensor *q = &node->src[0], *k = &node->src[1], *v = &node->src[2];
    for (int s = 0; s < 3; s++) {
        GTC_F32(&node->src[s], op, "q, k, v");
        if (node->src[s].ndim != 4 || (node->src[s].strides[3] != 1 && node->src[s].shape[3] > 1))
            return GTC_FAIL(GT_ERR_SHAPE, "%s: q, k, v must be (B, T, H, D) with unit stride along D", op);
    }
    a->q = *q;
    a->k = *k;
    a->v = *v;
    a->B = q->shape[0];
    a->Tq = q->shape[1];
    a->H = q->shape[2];
    a->D = q->shape[3];
    a->Tk = k->shape[1];
    a->Hkv = k->shape[2];
    if (k->shape[0] != a->B || k->shape[3] != a->D || v->shape[0] != a->B || v->shape[1] != a->Tk ||
        v->shape[2] != a->Hkv || v->shape[3] != a->D || a->Hkv < 1 || a->H % a->Hkv)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: k and v must be (B, T_k, H_kv, D) with H_kv dividing H", op);
    a->mask = (int)node->ip[0];
    a->window = node->ip[1];
    a->scale = node->fp[0];
    if (a->mask < 0 || a->mask > 3) return GTC_FAIL(GT_ERR_INVALID, "%s: mask (ip[0]) must be 0..3", op);
    if (a->window < 0 || (a->window > 0 && a->mask == 0))
        return GTC_FAIL(GT_ERR_INVALID, "%s: window ip[1] >= 0, only with a mask", op);
    a->m = NULL;
    if (a->mask >= 2) {
        if (node->n_src <= mask_src) return GTC_FAIL(GT_ERR_INVALID, "%s: the mask needs its input", op);
        const gt_tensor *m = &node->src[mask_src];
        GTC_I32(m, op, a->mask == 2 ? "pos" : "seg");
        GTC_TRY(gtc_check_contig_(m, op, "mask input"));
        if (a->mask == 3 && (a->Tq != a->Tk || gtc_numel(*m) != a->B * a->Tk))
            return GTC_FAIL(GT_ERR_SHAPE, "%s: seg must be (B, T) with T_q == T_k", op);
        if (a->mask == 2 && gtc_numel(*m) != a->Tq) return GTC_FAIL(GT_ERR_SHAPE, "%s: pos must be (T_q,)", op);
        a->m = (const int32_t *)m->data;
    }
    return GT_OK;
}

/* Dynamic shared memory for per_key floats of each of Tk keys; past what a block may hold,
 * UNSUPPORTED naming the limit (the tiled kernel that has none is still to be written). */
static int shared_bytes(int64_t Tk, int per_key, int *bytes, const char *op) {
    const int64_t limit = 200 * 1024 / ((int64_t)sizeof(float) * per_key);
    if (Tk > limit)
        return GTC_FAIL(GT_ERR_UNSUPPORTED, "%s: %lld keys, more than this kernel holds in shared memory (%lld)", op,
                        (long long)Tk, (long long)limit);
    *bytes = (int)(Tk * per_key * (int64_t)sizeof(float));
    return GT_OK;
}

GTC_SIZES(attention_fwd_f32) {
    (void)node;
    *scratch = 0;
    *work = 0;
    return GT_OK;
}

template <typename K>
static int allow_shared(K kernel, int bytes, const char *op) {
    if (bytes > 48 * 1024)
        return GTC_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), op);
    return GT_OK;
}

GTC_LAUNCHER(attention_fwd_f32) {
    (void)ctx;
    const char *op = "attention";
    att a;
    GTC_TRY(gtc_check_n_src_(node, 3, 4, op));
    GTC_TRY(setup(node, &a, 3, op));
    const gt_tensor *d = &node->dst;
    GTC_F32(d, op, "dst");
    const int64_t n_o = a.B * a.Tq * a.H * a.D;
    if (gtc_numel(*d) != n_o + a.B * a.H * a.Tq) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst must hold O and LSE", op);
    const int64_t rows = a.B * a.H * a.Tq;
    if (rows == 0) return GT_OK;
    int sb = 0;
    GTC_TRY(shared_bytes(a.Tk, 1, &sb, op));
    GTC_TRY(allow_shared(att_fwd, sb, op));
    att_fwd<<<(unsigned)rows, ATT_THREADS, sb, gtc_stream_()>>>(a, (float *)d->data, (float *)d->data + n_o);
    return GTC_LAUNCHED(op);
}

/* ---- backward ---------------------------------------------------------------------------------- */

struct grads {
    const float *lse, *o;      /* the forward's LSE (B, H, Tq) and O (B, Tq, H, D) */
    gt_tensor g;               /* dO: q's shape, unit stride along D */
    const float *dlse;         /* (B, H, Tq) or NULL */
    float *delta;              /* (B, H, Tq): sum_j p_ij dp_ij, made by att_dq */
};

__device__ inline const float *g_row(const grads &G, int64_t b, int64_t i, int64_t h) {
    return (const float *)G.g.data + b * G.g.strides[0] + i * G.g.strides[1] + h * G.g.strides[2];
}

/* One query row: p_j, dp_j = dO_i . v_j, Delta_i, then dq_i = scale sum_j ds_j k_j. */
__global__ void att_dq(att a, grads G, float *dq) {
    extern __shared__ float p[];
    float *ds = p + a.Tk;
    __shared__ float sh[32];
    const int64_t r = blockIdx.x, i = r % a.Tq, h = (r / a.Tq) % a.H, b = r / (a.Tq * a.H);
    const int64_t hk = h / (a.H / a.Hkv), li = (b * a.H + h) * a.Tq + i;
    const float lse = G.lse[li];
    const float *gi = g_row(G, b, i, h), *qi = row(a.q, b, i, h);
    float delta = 0.0f;
    for (int64_t j = threadIdx.x; j < a.Tk; j += blockDim.x) {
        float pj = 0.0f, dpj = 0.0f;
        if (lse != -INFINITY && seen(a, b, i, j)) {
            pj = expf(a.scale * dot(qi, row(a.k, b, j, hk), a.D) - lse);
            dpj = dot(gi, row(a.v, b, j, hk), a.D);
        }
        p[j] = pj;
        ds[j] = dpj;
        delta += pj * dpj;
    }
    delta = gtc_block_sum(delta, sh);
    const float dl = G.dlse ? G.dlse[li] : 0.0f;
    for (int64_t j = threadIdx.x; j < a.Tk; j += blockDim.x) ds[j] = p[j] * (ds[j] - delta + dl);
    if (threadIdx.x == 0) G.delta[li] = delta;
    __syncthreads();
    float *dqi = dq + ((b * a.Tq + i) * a.H + h) * a.D;
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j < a.Tk; j++)
            if (ds[j] != 0.0f) acc += ds[j] * row(a.k, b, j, hk)[d];
        dqi[d] = a.scale * acc;
    }
}

/* One key row of one KV head: dv_j = sum p_ij dO_i, dk_j = scale sum ds_ij q_i over the rows
 * i (of every query head reading this KV head) that see it, in a fixed order. */
__global__ void att_dkv(att a, grads G, float *dk, float *dv) {
    __shared__ float sh[32];
    __shared__ float pij, dsij;
    const int64_t r = blockIdx.x, j = r % a.Tk, hk = (r / a.Tk) % a.Hkv, b = r / (a.Tk * a.Hkv);
    const int64_t group = a.H / a.Hkv;
    const float *kj = row(a.k, b, j, hk), *vj = row(a.v, b, j, hk);
    float *dkj = dk + ((b * a.Tk + j) * a.Hkv + hk) * a.D, *dvj = dv + ((b * a.Tk + j) * a.Hkv + hk) * a.D;
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) dkj[d] = dvj[d] = 0.0f;
    for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
        for (int64_t i = 0; i < a.Tq; i++) {
            const int64_t li = (b * a.H + h) * a.Tq + i;
            if (G.lse[li] == -INFINITY || !seen(a, b, i, j)) continue;
            const float *qi = row(a.q, b, i, h), *gi = g_row(G, b, i, h);
            float s = 0.0f, dp = 0.0f;
            for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
                s += qi[d] * kj[d];
                dp += gi[d] * vj[d];
            }
            s = gtc_block_sum(s, sh);
            dp = gtc_block_sum(dp, sh);
            if (threadIdx.x == 0) {
                pij = expf(a.scale * s - G.lse[li]);
                dsij = pij * (dp - G.delta[li] + (G.dlse ? G.dlse[li] : 0.0f));
            }
            __syncthreads();
            for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
                dvj[d] += pij * gi[d];
                dkj[d] += a.scale * dsij * qi[d];
            }
            __syncthreads();
        }
    }
}

GTC_SIZES(attention_bwd_f32) {
    *work = 0;
    *scratch = node->src[0].shape[0] * node->src[0].shape[2] * node->src[0].shape[1] * (int64_t)sizeof(float);
    return GT_OK;
}

GTC_LAUNCHER(attention_bwd_f32) {
    (void)ctx;
    const char *op = "attention_bwd";
    att a;
    GTC_TRY(gtc_check_n_src_(node, 5, 6, op));
    GTC_TRY(setup(node, &a, 5, op));
    const gt_tensor *d = &node->dst, *y = &node->src[3], *g = &node->src[4];
    GTC_F32(d, op, "dst");
    GTC_F32(y, op, "y");
    GTC_F32(g, op, "g");
    GTC_TRY(gtc_check_contig_(y, op, "y"));
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    const int64_t n_o = a.B * a.Tq * a.H * a.D, n_lse = a.B * a.H * a.Tq, n_kv = a.B * a.Tk * a.Hkv * a.D;
    if (gtc_numel(*y) != n_o + n_lse) return GTC_FAIL(GT_ERR_SHAPE, "%s: y must be the forward's dst", op);
    if (gtc_numel(*d) != n_o + 2 * n_kv) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst must hold dq, dk and dv", op);
    if (node->scratch_size < n_lse * (int64_t)sizeof(float))
        return GTC_FAIL(GT_ERR_INVALID, "%s: scratch must hold B*H*T_q floats", op);
    grads G;
    G.o = (const float *)y->data;
    G.lse = G.o + n_o;
    G.delta = (float *)node->scratch;
    if (gtc_numel(*g) == n_o + n_lse && gtc_contiguous(*g)) {   /* dO then dLSE, contiguous */
        G.g = a.q;
        G.g.data = g->data;
        G.g.strides[3] = 1;
        G.g.strides[2] = a.D;
        G.g.strides[1] = a.H * a.D;
        G.g.strides[0] = a.Tq * a.H * a.D;
        G.dlse = (const float *)g->data + n_o;
    } else {
        if (g->ndim != 4 || g->shape[0] != a.B || g->shape[1] != a.Tq || g->shape[2] != a.H || g->shape[3] != a.D ||
            g->strides[3] != 1)
            return GTC_FAIL(GT_ERR_SHAPE, "%s: g must be dO (q's shape) or contiguous of y's size", op);
        G.g = *g;
        G.dlse = NULL;
    }
    float *dq = (float *)d->data, *dk = dq + n_o, *dv = dk + n_kv;
    const int64_t rows = a.B * a.H * a.Tq, keys = a.B * a.Hkv * a.Tk;
    if (rows == 0) return GT_OK;
    int sb = 0;
    GTC_TRY(shared_bytes(a.Tk, 2, &sb, op));
    GTC_TRY(allow_shared(att_dq, sb, op));
    att_dq<<<(unsigned)rows, ATT_THREADS, sb, gtc_stream_()>>>(a, G, dq);
    GTC_TRY(GTC_LAUNCHED(op));
    if (keys == 0) return GT_OK;
    att_dkv<<<(unsigned)keys, 64, 0, gtc_stream_()>>>(a, G, dk, dv);
    return GTC_LAUNCHED(op);
}
