/* attention.cu: the fused attention, forward and backward (ggtrain.h's attention: masks,
 * window, GQA), as FlashAttention-2's tiled kernels; the first, naive kernels (one block a
 * query or key row, all of its scores in shared memory) remain for head sizes past the tiles'.
 *
 * Forward (att_fwd_tiled), one block per (tile of BR query rows, b, h): the Q tile stays in
 * shared memory while the key tiles of BC keys that some row of it sees pass through (K and
 * V tiles in shared memory); per key tile S = scale Q K^T, masked to -inf, then the online
 * softmax per row: m = running max, l = running sum of exp(S - m), O = running sum of
 * exp(S - m) V, l and O multiplied by exp(m_old - m_new) when m grows. At the end O / l is
 * the output and m + log l the row's LSE; a row that saw no key gets O = 0, LSE = -inf.
 * Backward, deterministic (every output element is summed by one thread in a fixed order,
 * no atomics): att_delta, Delta = rowsum(dO * O) - dLSE (B, H, Tq) into the scratch; then
 * with P = exp(scale Q K^T - LSE) recomputed and dS = P * (dO V^T - Delta),
 * att_dq_tiled, one block per (query tile, b, h): dQ = scale dS K over the key tiles it
 * sees; att_dkv_tiled, one block per (key tile, b, kv head): dV = P^T dO and
 * dK = scale dS^T Q over the query heads of its group and the query tiles that see it.
 *
 * Threads and tiles: 256 threads a block, as 16 x 16 (ty, tx). Thread (ty, tx) computes the
 * scores of tile rows ty * RM .. ty * RM + RM - 1 and tile columns tx, tx + 16, .. (CN of
 * them), and the output columns d = tx, tx + 16, .. (DN = DMAX / 16) of the same rows. So a
 * row's max and sum run over the 16 lanes of one half warp (shuffles), and its P row meets
 * its O row in the same thread. Tiles of Q, K, V, dO sit in shared memory as rows of DMAX + 4
 * floats (att_ld), zero past D and past the last row; P (forward) and dS (dq), P^T and dS^T
 * (dkv) pass through shared memory between the two products. The products read shared
 * memory as float4 along their sums and use fmaf (the build has -fmad=false), in the same
 * order wherever the same product recurs (S in the forward, dq and dkv: the same bits). DMAX
 * is 64, 128 or 256, D padded up to it; a larger D goes to the naive kernels.
 *
 * Skipping: a tile is visited only inside a cheap bound of the keys (queries) its rows
 * (keys) may see, from the causal or segment mask and the window, and then only if some
 * (row, key) pair of it is seen (a block vote, __syncthreads_or, over the exact mask):
 * causal attention does about half the work of none, packed segments skip the tiles
 * between samples. A pair that is not seen gets P = 0, so it adds exactly zero to O, dQ,
 * dK and dV. */
#include "common.cuh"
#include "kernels.h"

#define ATT_THREADS 128        /* the naive kernels */
#define ATT_TX 16              /* the tiled kernels' threads along a tile's columns */
#define ATT_TY 16              /* and along its rows */
#define ATT_TILE_THREADS (ATT_TX * ATT_TY)

struct att {
    gt_tensor q, k, v;
    const int32_t *m;          /* pos (Tq,) or seg (B, T), or NULL */
    const int32_t *par;        /* the tree mask's (mask 4) parent (B, T): a segment each row also sees */
    int64_t B, Tq, Tk, H, Hkv, D, window;
    int mask;
    float scale;
};

struct grads {
    const float *lse, *o;      /* the forward's LSE (B, H, Tq) and O (B, Tq, H, D) */
    gt_tensor g;               /* dO: q's shape, unit stride along D */
    const float *dlse;         /* (B, H, Tq) or NULL */
    float *delta;              /* scratch (B, H, Tq): Delta_i = dO_i . O_i - dLSE_i (att_delta), or
                                  sum_j p_ij dp_ij (att_dq_naive) */
};

/* Key j is seen by query row i of batch b. */
__device__ inline bool seen(const att &a, int64_t b, int64_t i, int64_t j) {
    int64_t hi = a.Tk - 1, lo = 0;
    if (a.mask >= 3) {
        const int32_t *sg = a.m + b * a.Tk;
        if (j > i || (sg[j] != sg[i] && !(a.mask == 4 && sg[j] == a.par[b * a.Tq + i]))) return false;
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

__device__ inline const float *g_row(const grads &G, int64_t b, int64_t i, int64_t h) {
    return (const float *)G.g.data + b * G.g.strides[0] + i * G.g.strides[1] + h * G.g.strides[2];
}

/* ---- the tiled kernels -------------------------------------------------------------------------- */

/* What query row i of batch b sees, as seen() says it: the keys j of [lo, hi] with
 * seg[b, j] == sg or == sp, its parent (sg, sp and every key's segment are 0 but under the
 * segment masks; sp == sg except under the tree mask); none when hi < lo, as for rows past Tq. */
struct att_span {
    int32_t lo, hi, sg, sp;
};

__device__ inline att_span att_row_span(const att &a, int64_t b, int64_t i) {
    att_span s = {0, -1, 0, 0};
    if (i >= a.Tq) return s;
    int64_t hi = a.Tk - 1;
    if (a.mask == 1) {
        hi = i + (a.Tk - a.Tq);
    } else if (a.mask == 2) {
        hi = a.m[i];
    } else if (a.mask >= 3) {
        hi = i;
        s.sg = a.m[b * a.Tk + i];
        s.sp = a.mask == 4 ? a.par[b * a.Tq + i] : s.sg;
    }
    /* the window counts back from the unclamped hi (a position past the keys sees fewer) */
    const int64_t lo = a.window > 0 && a.window <= hi ? hi - a.window + 1 : 0;
    s.lo = (int32_t)(lo < a.Tk ? lo : a.Tk);
    s.hi = (int32_t)(hi < -1 ? -1 : hi < a.Tk - 1 ? hi : a.Tk - 1);
    return s;
}

/* Key j's segment for att_span's test: seg[b, j] under the segment mask, else 0. */
__device__ inline int32_t att_key_seg(const att &a, int64_t b, int64_t j) {
    return a.mask >= 3 && j < a.Tk ? a.m[b * a.Tk + j] : 0;
}

__device__ inline bool att_sees(const att_span &s, int64_t j, int32_t sg) {
    return j >= s.lo && j <= s.hi && (sg == s.sg || sg == s.sp);
}

/* The keys [*lo, *hi] that query rows i0..i1 may see: a bound (causal and segment masks and
 * the window), exact or wider; each tile in it still votes on the exact mask. */
__device__ inline void att_key_range(const att &a, int64_t i0, int64_t i1, int64_t *lo, int64_t *hi) {
    int64_t l = 0, h = a.Tk - 1;
    if (a.mask == 1 || a.mask >= 3) {
        const int64_t own = a.mask == 1 ? a.Tk - a.Tq : 0;   /* row i's own key is i + own */
        h = i1 + own;
        if (a.window > 0 && a.window < a.Tk) l = i0 + own - a.window + 1;
    }
    *lo = l > 0 ? l : 0;
    *hi = h < a.Tk - 1 ? h : a.Tk - 1;
}

/* The query rows [*lo, *hi] that may see a key of j0..j1, as att_key_range. */
__device__ inline void att_query_range(const att &a, int64_t j0, int64_t j1, int64_t *lo, int64_t *hi) {
    int64_t l = 0, h = a.Tq - 1;
    if (a.mask == 1 || a.mask >= 3) {
        const int64_t own = a.mask == 1 ? a.Tk - a.Tq : 0;
        l = j0 - own;
        if (a.window > 0 && a.window < a.Tk) h = j1 - own + a.window - 1;
    }
    *lo = l > 0 ? l : 0;
    *hi = h < a.Tq - 1 ? h : a.Tq - 1;
}

/* Max and sum over the 16 lanes of a half warp (one tile row's threads), every lane
 * getting the same bits (each step adds the same two values in both lanes). */
__device__ inline float att_row_max(float v) {
    for (int o = ATT_TX / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ inline float att_row_sum(float v) {
    for (int o = ATT_TX / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* The tiles' row strides in floats: D columns padded to DMAX, + 4 so that rows start 16-byte
 * aligned (float4 reads) and the 8 rows a quarter warp reads as float4 fall in 32 different
 * banks; a P (or dS) tile's rows likewise. */
__host__ __device__ constexpr int att_ld(int n) { return n + 4; }

/* Shared floats of each kernel's tiles. */
__host__ __device__ constexpr int att_fwd_floats(int dmax, int br, int bc) {
    return (br + 2 * bc) * att_ld(dmax) + br * att_ld(bc);            /* Q, K, V, P */
}
__host__ __device__ constexpr int att_dq_floats(int dmax, int br, int bc) {
    return (2 * br + 2 * bc) * att_ld(dmax) + br * att_ld(bc);        /* Q, dO, K, V, dS */
}
__host__ __device__ constexpr int att_dkv_floats(int dmax, int br, int bc) {
    return (2 * br + 2 * bc) * att_ld(dmax) + bc * att_ld(br);        /* K, V, Q, dO, P^T or dS^T */
}

/* dst (ROWS, att_ld(DMAX)) = rows r0.. of head h, batch b of t (n rows in all), D columns,
 * zeros past them and past row n. */
template <int ROWS, int DMAX>
__device__ inline void att_load(float *dst, const gt_tensor &t, int64_t b, int64_t h, int64_t r0, int64_t n,
                                int64_t D) {
    const float *base = (const float *)t.data + b * t.strides[0] + h * t.strides[2];
    for (int x = threadIdx.x; x < ROWS * DMAX; x += ATT_TILE_THREADS) {
        const int r = x / DMAX, d = x % DMAX;
        dst[r * att_ld(DMAX) + d] = r0 + r < n && d < D ? base[(r0 + r) * t.strides[1] + d] : 0.0f;
    }
}

__device__ inline float att_lane(const float4 &v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

/* s[r][c] = a_r . b_c over the first n columns (a multiple of 4) of the thread's RM rows
 * a_r = a + r LDA and its CN rows b_c = b + 16 c LDB, in column order (the same bits
 * wherever the same two rows meet). */
template <int RM, int CN, int LDA, int LDB>
__device__ inline void att_dots(float (&s)[RM][CN], const float *a, const float *b, int n) {
#pragma unroll
    for (int r = 0; r < RM; r++)
#pragma unroll
        for (int c = 0; c < CN; c++) s[r][c] = 0.0f;
    for (int d = 0; d < n; d += 4) {
        float4 av[RM], bv[CN];
#pragma unroll
        for (int r = 0; r < RM; r++) av[r] = *(const float4 *)(a + r * LDA + d);
#pragma unroll
        for (int c = 0; c < CN; c++) bv[c] = *(const float4 *)(b + c * ATT_TX * LDB + d);
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int r = 0; r < RM; r++)
#pragma unroll
                for (int c = 0; c < CN; c++) s[r][c] = fmaf(att_lane(av[r], k), att_lane(bv[c], k), s[r][c]);
    }
}

/* acc[r][e] += sum over k < N of p[r LDP + k] x[k LDX + 16 e]: the thread's RM rows of a
 * P-like tile (N columns) times the columns 16 e of its rows x_k, k in order. */
template <int RM, int DN, int N, int LDP, int LDX>
__device__ inline void att_update(float (&acc)[RM][DN], const float *p, const float *x) {
    for (int k0 = 0; k0 < N; k0 += 4) {
        float4 pv[RM];
#pragma unroll
        for (int r = 0; r < RM; r++) pv[r] = *(const float4 *)(p + r * LDP + k0);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float xv[DN];
#pragma unroll
            for (int e = 0; e < DN; e++) xv[e] = x[(k0 + k) * LDX + e * ATT_TX];
#pragma unroll
            for (int r = 0; r < RM; r++)
#pragma unroll
                for (int e = 0; e < DN; e++) acc[r][e] = fmaf(att_lane(pv[r], k), xv[e], acc[r][e]);
        }
    }
}

extern __shared__ float4 att_smem4[];   /* (float4: 16-byte aligned) */

/* Forward: O (B, Tq, H, D) and LSE (B, H, Tq) of the query tile of block u (the last tiles,
 * which see the most keys under a causal mask, first), as the file's comment says. */
template <int DMAX, int BR, int BC>
__global__ void __launch_bounds__(ATT_TILE_THREADS, DMAX <= 128 ? 2 : 1) att_fwd_tiled(att a, float *o, float *lse) {
    constexpr int LD = att_ld(DMAX), LP = att_ld(BC), RM = BR / ATT_TY, CN = BC / ATT_TX, DN = DMAX / ATT_TX;
    static_assert(BR % ATT_TY == 0 && BC % ATT_TX == 0 && DMAX % ATT_TX == 0 && RM * CN <= 32, "tile sizes");
    float *qs = (float *)att_smem4, *ks = qs + BR * LD, *vs = ks + BC * LD, *ps = vs + BC * LD;
    const int tx = threadIdx.x % ATT_TX, ty = threadIdx.x / ATT_TX;
    const int64_t nbh = a.B * a.H, u = blockIdx.x, nqt = (a.Tq + BR - 1) / BR;
    const int64_t i0 = (nqt - 1 - u / nbh) * BR, b = u % nbh / a.H, h = u % a.H, hk = h / (a.H / a.Hkv);
    const int Dp = (int)(a.D + 3) / 4 * 4;   /* D, padded for the float4 reads */

    att_span rs[RM];
    float m[RM], l[RM], acc[RM][DN];
#pragma unroll
    for (int r = 0; r < RM; r++) {
        rs[r] = att_row_span(a, b, i0 + ty * RM + r);
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < DN; e++) acc[r][e] = 0.0f;
    }
    att_load<BR, DMAX>(qs, a.q, b, h, i0, a.Tq, a.D);   /* read after the first tile's barriers */

    int64_t klo, khi;
    att_key_range(a, i0, (i0 + BR < a.Tq ? i0 + BR : a.Tq) - 1, &klo, &khi);
    if (klo > khi) khi = -1;
    for (int64_t j0 = klo / BC * BC; j0 <= khi; j0 += BC) {
        unsigned vis = 0;   /* bit r * CN + c: row r sees key c */
#pragma unroll
        for (int c = 0; c < CN; c++) {
            const int64_t j = j0 + tx + c * ATT_TX;
            const int32_t sg = att_key_seg(a, b, j);
#pragma unroll
            for (int r = 0; r < RM; r++)
                if (att_sees(rs[r], j, sg)) vis |= 1u << (r * CN + c);
        }
        /* (also the barrier after the last tile's reads of K, V and P) */
        if (!__syncthreads_or(vis != 0)) continue;
        att_load<BC, DMAX>(ks, a.k, b, hk, j0, a.Tk, a.D);
        att_load<BC, DMAX>(vs, a.v, b, hk, j0, a.Tk, a.D);
        __syncthreads();

        float s[RM][CN];
        att_dots<RM, CN, LD, LD>(s, qs + ty * RM * LD, ks + tx * LD, Dp);
        /* online softmax. NOTE: alpha is 0 while m is -inf (nothing summed yet: l and O are 0),
         * and a max still -inf subtracts 0, so exp(-inf - -inf) never makes a NaN. */
#pragma unroll
        for (int r = 0; r < RM; r++) {
            float mt = -INFINITY;
#pragma unroll
            for (int c = 0; c < CN; c++) {
                s[r][c] = vis >> (r * CN + c) & 1 ? a.scale * s[r][c] : -INFINITY;
                mt = fmaxf(mt, s[r][c]);
            }
            const float mn = fmaxf(m[r], att_row_max(mt));
            const float alpha = m[r] == -INFINITY ? 0.0f : gt_expf_(m[r] - mn), msafe = mn == -INFINITY ? 0.0f : mn;
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < CN; c++) {
                const float p = gt_expf_(s[r][c] - msafe);
                ps[(ty * RM + r) * LP + tx + c * ATT_TX] = p;
                sum += p;
            }
            l[r] = l[r] * alpha + att_row_sum(sum);
            m[r] = mn;
#pragma unroll
            for (int e = 0; e < DN; e++) acc[r][e] *= alpha;
        }
        __syncthreads();
        att_update<RM, DN, BC, LP, LD>(acc, ps + ty * RM * LP, vs + tx);
    }

#pragma unroll
    for (int r = 0; r < RM; r++) {
        const int64_t i = i0 + ty * RM + r;
        if (i >= a.Tq) continue;
        const bool any = l[r] > 0.0f;   /* else the row saw no key */
        float *oi = o + ((b * a.Tq + i) * a.H + h) * a.D;
#pragma unroll
        for (int e = 0; e < DN; e++) {
            const int d = tx + e * ATT_TX;
            if (d < a.D) oi[d] = any ? acc[r][e] / l[r] : 0.0f;
        }
        if (tx == 0) lse[(b * a.H + h) * a.Tq + i] = any ? m[r] + logf(l[r]) : -INFINITY;
    }
}

/* Delta (B, H, Tq) = rowsum(dO * O) - dLSE into G.delta: a warp a row (b, i, h). */
__global__ void att_delta(att a, grads G) {
    const int lane = threadIdx.x % 32;
    const int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= a.B * a.Tq * a.H) return;   /* a whole warp */
    const int64_t h = r % a.H, i = r / a.H % a.Tq, b = r / (a.H * a.Tq);
    const float *gi = g_row(G, b, i, h), *oi = G.o + r * a.D;
    float s = 0.0f;
    for (int64_t d = lane; d < a.D; d += 32) s = fmaf(gi[d], oi[d], s);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const int64_t li = (b * a.H + h) * a.Tq + i;
    if (lane == 0) G.delta[li] = G.dlse ? s - G.dlse[li] : s;
}

/* dQ (B, Tq, H, D) = scale dS K of the query tile of block u (ordered as the forward's). */
template <int DMAX, int BR, int BC>
__global__ void __launch_bounds__(ATT_TILE_THREADS, DMAX <= 128 ? 2 : 1) att_dq_tiled(att a, grads G, float *dq) {
    constexpr int LD = att_ld(DMAX), LP = att_ld(BC), RM = BR / ATT_TY, CN = BC / ATT_TX, DN = DMAX / ATT_TX;
    static_assert(BR % ATT_TY == 0 && BC % ATT_TX == 0 && DMAX % ATT_TX == 0 && RM * CN <= 32, "tile sizes");
    float *qs = (float *)att_smem4, *gs = qs + BR * LD, *ks = gs + BR * LD, *vs = ks + BC * LD, *ss = vs + BC * LD;
    const int tx = threadIdx.x % ATT_TX, ty = threadIdx.x / ATT_TX;
    const int64_t nbh = a.B * a.H, u = blockIdx.x, nqt = (a.Tq + BR - 1) / BR;
    const int64_t i0 = (nqt - 1 - u / nbh) * BR, b = u % nbh / a.H, h = u % a.H, hk = h / (a.H / a.Hkv);
    const int Dp = (int)(a.D + 3) / 4 * 4;

    att_span rs[RM];
    float lse[RM], delta[RM], acc[RM][DN];
#pragma unroll
    for (int r = 0; r < RM; r++) {
        const int64_t i = i0 + ty * RM + r, li = (b * a.H + h) * a.Tq + i;
        rs[r] = att_row_span(a, b, i);
        lse[r] = i < a.Tq ? G.lse[li] : 0.0f;
        delta[r] = i < a.Tq ? G.delta[li] : 0.0f;
        if (lse[r] == -INFINITY) rs[r].hi = -1;   /* the forward saw nothing: P = 0 */
#pragma unroll
        for (int e = 0; e < DN; e++) acc[r][e] = 0.0f;
    }
    att_load<BR, DMAX>(qs, a.q, b, h, i0, a.Tq, a.D);
    att_load<BR, DMAX>(gs, G.g, b, h, i0, a.Tq, a.D);

    int64_t klo, khi;
    att_key_range(a, i0, (i0 + BR < a.Tq ? i0 + BR : a.Tq) - 1, &klo, &khi);
    if (klo > khi) khi = -1;
    for (int64_t j0 = klo / BC * BC; j0 <= khi; j0 += BC) {
        unsigned vis = 0;   /* bit r * CN + c: row r sees key c */
#pragma unroll
        for (int c = 0; c < CN; c++) {
            const int64_t j = j0 + tx + c * ATT_TX;
            const int32_t sg = att_key_seg(a, b, j);
#pragma unroll
            for (int r = 0; r < RM; r++)
                if (att_sees(rs[r], j, sg)) vis |= 1u << (r * CN + c);
        }
        if (!__syncthreads_or(vis != 0)) continue;   /* (and the barrier after the last tile's reads) */
        att_load<BC, DMAX>(ks, a.k, b, hk, j0, a.Tk, a.D);
        att_load<BC, DMAX>(vs, a.v, b, hk, j0, a.Tk, a.D);
        __syncthreads();

        /* P, then dS = P (dP - Delta) in its place (P waits there, not in registers) */
        float s[RM][CN];
        att_dots<RM, CN, LD, LD>(s, qs + ty * RM * LD, ks + tx * LD, Dp);
#pragma unroll
        for (int r = 0; r < RM; r++)
#pragma unroll
            for (int c = 0; c < CN; c++)
                ss[(ty * RM + r) * LP + tx + c * ATT_TX] =
                    vis >> (r * CN + c) & 1 ? gt_expf_(a.scale * s[r][c] - lse[r]) : 0.0f;
        att_dots<RM, CN, LD, LD>(s, gs + ty * RM * LD, vs + tx * LD, Dp);
#pragma unroll
        for (int r = 0; r < RM; r++)
#pragma unroll
            for (int c = 0; c < CN; c++) {
                float *p = ss + (ty * RM + r) * LP + tx + c * ATT_TX;
                *p = *p * (s[r][c] - delta[r]);
            }
        __syncthreads();
        att_update<RM, DN, BC, LP, LD>(acc, ss + ty * RM * LP, ks + tx);
    }

#pragma unroll
    for (int r = 0; r < RM; r++) {
        const int64_t i = i0 + ty * RM + r;
        if (i >= a.Tq) continue;
        float *dqi = dq + ((b * a.Tq + i) * a.H + h) * a.D;
#pragma unroll
        for (int e = 0; e < DN; e++) {
            const int d = tx + e * ATT_TX;
            if (d < a.D) dqi[d] = a.scale * acc[r][e];
        }
    }
}

/* dK, dV (B, Tk, Hkv, D) of the key tile of block u (tile 0, seen by every row under a
 * causal mask, first): the thread's tile rows are keys, its score columns queries, and it
 * sums over the group's query heads, then query tiles, then rows, in that order. */
template <int DMAX, int BR, int BC>
__global__ void __launch_bounds__(ATT_TILE_THREADS, DMAX <= 128 ? 2 : 1) att_dkv_tiled(att a, grads G, float *dk, float *dv) {
    constexpr int LD = att_ld(DMAX), LP = att_ld(BR), RM = BC / ATT_TY, CN = BR / ATT_TX, DN = DMAX / ATT_TX;
    static_assert(BR % ATT_TX == 0 && BC % ATT_TY == 0 && DMAX % ATT_TX == 0 && RM * CN <= 32, "tile sizes");
    float *ks = (float *)att_smem4, *vs = ks + BC * LD, *qs = vs + BC * LD, *gs = qs + BR * LD, *pt = gs + BR * LD;
    const int tx = threadIdx.x % ATT_TX, ty = threadIdx.x / ATT_TX;
    const int64_t nbh = a.B * a.Hkv, u = blockIdx.x, group = a.H / a.Hkv;
    const int64_t j0 = u / nbh * BC, b = u % nbh / a.Hkv, hk = u % a.Hkv;
    const int Dp = (int)(a.D + 3) / 4 * 4;

    int32_t ksg[RM];
    float dka[RM][DN], dva[RM][DN];
#pragma unroll
    for (int r = 0; r < RM; r++) {
        ksg[r] = att_key_seg(a, b, j0 + ty * RM + r);
#pragma unroll
        for (int e = 0; e < DN; e++) dka[r][e] = dva[r][e] = 0.0f;
    }
    att_load<BC, DMAX>(ks, a.k, b, hk, j0, a.Tk, a.D);   /* read after the first tile's barriers */
    att_load<BC, DMAX>(vs, a.v, b, hk, j0, a.Tk, a.D);

    int64_t ilo, ihi;
    att_query_range(a, j0, (j0 + BC < a.Tk ? j0 + BC : a.Tk) - 1, &ilo, &ihi);
    if (ilo > ihi) ihi = -1;
    for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
        for (int64_t i0 = ilo / BR * BR; i0 <= ihi; i0 += BR) {
            att_span qsp[CN];
            float lse[CN], delta[CN];
#pragma unroll
            for (int c = 0; c < CN; c++) {
                const int64_t i = i0 + tx + c * ATT_TX, li = (b * a.H + h) * a.Tq + i;
                qsp[c] = att_row_span(a, b, i);
                lse[c] = i < a.Tq ? G.lse[li] : 0.0f;
                delta[c] = i < a.Tq ? G.delta[li] : 0.0f;
                if (lse[c] == -INFINITY) qsp[c].hi = -1;   /* the forward saw nothing: P = 0 */
            }
            unsigned vis = 0;   /* bit r * CN + c: query c sees key r */
#pragma unroll
            for (int r = 0; r < RM; r++)
#pragma unroll
                for (int c = 0; c < CN; c++)
                    if (att_sees(qsp[c], j0 + ty * RM + r, ksg[r])) vis |= 1u << (r * CN + c);
            if (!__syncthreads_or(vis != 0)) continue;   /* (and the barrier after the last tile's reads) */
            att_load<BR, DMAX>(qs, a.q, b, h, i0, a.Tq, a.D);
            att_load<BR, DMAX>(gs, G.g, b, h, i0, a.Tq, a.D);
            __syncthreads();

            /* P^T into shared memory, dV += P^T dO; then dS^T = P^T (dP^T - Delta) in its place
             * (one tile for both: two more barriers, less shared memory), dK += dS^T Q */
            float s[RM][CN];
            att_dots<RM, CN, LD, LD>(s, ks + ty * RM * LD, qs + tx * LD, Dp);
#pragma unroll
            for (int r = 0; r < RM; r++)
#pragma unroll
                for (int c = 0; c < CN; c++)
                    pt[(ty * RM + r) * LP + tx + c * ATT_TX] =
                        vis >> (r * CN + c) & 1 ? gt_expf_(a.scale * s[r][c] - lse[c]) : 0.0f;
            att_dots<RM, CN, LD, LD>(s, vs + ty * RM * LD, gs + tx * LD, Dp);
            __syncthreads();
            att_update<RM, DN, BR, LP, LD>(dva, pt + ty * RM * LP, gs + tx);
            __syncthreads();
#pragma unroll
            for (int r = 0; r < RM; r++)
#pragma unroll
                for (int c = 0; c < CN; c++) {
                    float *p = pt + (ty * RM + r) * LP + tx + c * ATT_TX;
                    *p = *p * (s[r][c] - delta[c]);
                }
            __syncthreads();
            att_update<RM, DN, BR, LP, LD>(dka, pt + ty * RM * LP, qs + tx);
        }
    }

#pragma unroll
    for (int r = 0; r < RM; r++) {
        const int64_t j = j0 + ty * RM + r;
        if (j >= a.Tk) continue;
        float *dkj = dk + ((b * a.Tk + j) * a.Hkv + hk) * a.D, *dvj = dv + ((b * a.Tk + j) * a.Hkv + hk) * a.D;
#pragma unroll
        for (int e = 0; e < DN; e++) {
            const int d = tx + e * ATT_TX;
            if (d < a.D) {
                dkj[d] = a.scale * dka[r][e];
                dvj[d] = dva[r][e];
            }
        }
    }
}

/* ---- the naive kernels (D > 256) ---------------------------------------------------------------- */

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

/* One block a query row, its Tk scores in shared memory. */
__global__ void att_fwd_naive(att a, float *o, float *lse) {
    extern __shared__ float p[];
    __shared__ float sh[32];
    const int64_t r = blockIdx.x, i = r % a.Tq, h = (r / a.Tq) % a.H, b = r / (a.Tq * a.H);
    const int64_t hk = h / (a.H / a.Hkv);
    const float mx = scores(a, b, i, h, p, sh);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < a.Tk; j += blockDim.x) {
        const float e = mx == -INFINITY ? 0.0f : gt_expf_(p[j] - mx);
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

/* One query row: p_j, dp_j = dO_i . v_j, Delta_i, then dq_i = scale sum_j ds_j k_j. */
__global__ void att_dq_naive(att a, grads G, float *dq) {
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
            pj = gt_expf_(a.scale * dot(qi, row(a.k, b, j, hk), a.D) - lse);
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
__global__ void att_dkv_naive(att a, grads G, float *dk, float *dv) {
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
                pij = gt_expf_(a.scale * s - G.lse[li]);
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

/* ---- launchers ---------------------------------------------------------------------------------- */

/* The node's q, k, v and mask (checks.h's checks, the CPU kernel's words), into a. */
static int setup(const gt_node *node, att *a, int mask_src, const char *op) {
    GTC_TRY(gt_attention_qkv_check(node, op, 1));
    GTC_TRY(gt_attention_mask_check(node, op, mask_src));
    GTC_TRY(gt_attention_ggml_check(node, op, 0));
    const gt_tensor *q = &node->src[0], *k = &node->src[1], *v = &node->src[2];
    a->q = *q;
    a->k = *k;
    a->v = *v;
    a->B = q->shape[0];
    a->Tq = q->shape[1];
    a->H = q->shape[2];
    a->D = q->shape[3];
    a->Tk = k->shape[1];
    a->Hkv = k->shape[2];
    a->mask = (int)node->ip[0];
    a->window = node->ip[1];
    a->scale = node->fp[0];
    a->m = a->mask >= 2 ? (const int32_t *)node->src[mask_src].data : NULL;
    a->par = a->mask == 4 ? (const int32_t *)node->src[mask_src + 1].data : NULL;
    return GT_OK;
}

/* The tiled kernels' D bound: D padded to 64, 128 or 256 columns; 0 for D past 256 (or
 * lengths past int32, which their masks count in), where the naive kernels take it (a
 * dispatch on shape alone: both compute ggtrain.h's attention). */
static int tile_dmax(const att &a) {
    if (a.Tq >= INT32_MAX || a.Tk >= INT32_MAX) return 0;
    return a.D <= 64 ? 64 : a.D <= 128 ? 128 : a.D <= 256 ? 256 : 0;
}

/* Dynamic shared memory for per_key floats of each of Tk keys (the naive kernels); past
 * what a block may hold, UNSUPPORTED naming the limit. */
static int shared_bytes(int64_t Tk, int per_key, int *bytes, const char *op) {
    const int64_t limit = 200 * 1024 / ((int64_t)sizeof(float) * per_key);
    if (Tk > limit)
        return GTC_FAIL(GT_ERR_UNSUPPORTED, "%s: %lld keys, more than this kernel holds in shared memory (%lld)", op,
                        (long long)Tk, (long long)limit);
    *bytes = (int)(Tk * per_key * (int64_t)sizeof(float));
    return GT_OK;
}

template <typename K>
static int allow_shared(K kernel, int bytes, const char *op) {
    if (bytes > 48 * 1024)
        return GTC_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), op);
    return GT_OK;
}

/* Launches of the tiled kernels for D up to DMAX, tiles of BR query rows and BC keys (the
 * launchers pick them): shared memory for DMAX 64, 128, 256 of 68, 75, 102 KiB (forward),
 * 85, 108, 134.5 KiB (dq) and 85, 108, 100 KiB (dkv); two blocks an SM up to DMAX 128
 * (registers capped at 128 a thread), one at 256. */
template <int DMAX, int BR, int BC>
static int launch_fwd(const att &a, float *o, float *lse, const char *op) {
    const int bytes = att_fwd_floats(DMAX, BR, BC) * (int)sizeof(float);
    GTC_TRY(allow_shared(att_fwd_tiled<DMAX, BR, BC>, bytes, op));
    const int64_t blocks = (a.Tq + BR - 1) / BR * a.B * a.H;
    att_fwd_tiled<DMAX, BR, BC><<<(unsigned)blocks, ATT_TILE_THREADS, bytes, gtc_stream_()>>>(a, o, lse);
    return GTC_LAUNCHED(op);
}

template <int DMAX, int BR, int BC>
static int launch_dq(const att &a, const grads &G, float *dq, const char *op) {
    const int bytes = att_dq_floats(DMAX, BR, BC) * (int)sizeof(float);
    GTC_TRY(allow_shared(att_dq_tiled<DMAX, BR, BC>, bytes, op));
    const int64_t blocks = (a.Tq + BR - 1) / BR * a.B * a.H;
    att_dq_tiled<DMAX, BR, BC><<<(unsigned)blocks, ATT_TILE_THREADS, bytes, gtc_stream_()>>>(a, G, dq);
    return GTC_LAUNCHED(op);
}

template <int DMAX, int BR, int BC>
static int launch_dkv(const att &a, const grads &G, float *dk, float *dv, const char *op) {
    const int bytes = att_dkv_floats(DMAX, BR, BC) * (int)sizeof(float);
    GTC_TRY(allow_shared(att_dkv_tiled<DMAX, BR, BC>, bytes, op));
    const int64_t blocks = (a.Tk + BC - 1) / BC * a.B * a.Hkv;
    att_dkv_tiled<DMAX, BR, BC><<<(unsigned)blocks, ATT_TILE_THREADS, bytes, gtc_stream_()>>>(a, G, dk, dv);
    return GTC_LAUNCHED(op);
}

GTC_SIZES(attention_fwd_f32) {
    (void)node;
    *scratch = 0;
    *work = 0;
    return GT_OK;
}

GTC_LAUNCHER(attention_fwd_f32) {
    (void)ctx;
    const char *op = "attention";
    att a;
    GTC_TRY(gtc_check_n_src_(node, 3, 4, op));
    GTC_TRY(setup(node, &a, 3, op));
    const gt_tensor *d = &node->dst;
    char sa[128];
    GTC_F32(d, op, "dst");
    GTC_TRY(gt_check_contig(d, op, "dst"));
    const int64_t n_o = a.B * a.Tq * a.H * a.D;
    if (gtc_numel(*d) != n_o + a.B * a.H * a.Tq)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: expected dst of %lld elements (O and LSE), got %s", op,
                        (long long)(n_o + a.B * a.H * a.Tq), gt_shape_str(d, sa, sizeof sa));
    const int64_t rows = a.B * a.H * a.Tq;
    if (rows == 0) return GT_OK;
    float *o = (float *)d->data, *lse = o + n_o;
    switch (tile_dmax(a)) {
    case 64: return launch_fwd<64, 64, 64>(a, o, lse, op);
    case 128: return launch_fwd<128, 64, 32>(a, o, lse, op);
    case 256: return launch_fwd<256, 32, 32>(a, o, lse, op);
    default: break;
    }
    int sb = 0;
    GTC_TRY(shared_bytes(a.Tk, 1, &sb, op));
    GTC_TRY(allow_shared(att_fwd_naive, sb, op));
    att_fwd_naive<<<(unsigned)rows, ATT_THREADS, sb, gtc_stream_()>>>(a, o, lse);
    return GTC_LAUNCHED(op);
}

/* ---- backward ---------------------------------------------------------------------------------- */

GTC_SIZES(attention_bwd_f32) {
    *work = 0;
    *scratch = node->src[0].shape[0] * node->src[0].shape[2] * node->src[0].shape[1] * (int64_t)sizeof(float);
    return GT_OK;
}

/* Tiled: att_delta, att_dq_tiled, att_dkv_tiled; naive: att_dq_naive (which makes Delta),
 * att_dkv_naive. dK and dV are written (zeros) also when there is no query row. */
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
    char sa[128], sb[128];
    if (gtc_numel(*d) != n_o + 2 * n_kv)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: expected dst of %lld elements (dq, dk, dv), got %s", op,
                        (long long)(n_o + 2 * n_kv), gt_shape_str(d, sa, sizeof sa));
    if (gtc_numel(*y) != n_o + n_lse)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: expected y (the forward's O and LSE) of %lld elements, got %s", op,
                        (long long)(n_o + n_lse), gt_shape_str(y, sa, sizeof sa));
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
            return GTC_FAIL(GT_ERR_SHAPE, "%s: expected g of q's shape %s (dO), or contiguous of y's %lld elements, "
                            "got %s", op, gt_shape_str(&node->src[0], sb, sizeof sb), (long long)(n_o + n_lse),
                            gt_shape_str(g, sa, sizeof sa));
        G.g = *g;
        G.dlse = NULL;
    }
    float *dq = (float *)d->data, *dk = dq + n_o, *dv = dk + n_kv;
    const int64_t rows = a.B * a.H * a.Tq, keys = a.B * a.Hkv * a.Tk;
    const int dmax = tile_dmax(a);
    if (dmax) {
        if (rows > 0) {
            const int per_block = ATT_TILE_THREADS / 32;
            att_delta<<<(unsigned)((rows + per_block - 1) / per_block), ATT_TILE_THREADS, 0, gtc_stream_()>>>(a, G);
            GTC_TRY(GTC_LAUNCHED(op));
            int rc;
            switch (dmax) {
            case 64: rc = launch_dq<64, 64, 64>(a, G, dq, op); break;
            case 128: rc = launch_dq<128, 64, 32>(a, G, dq, op); break;
            default: rc = launch_dq<256, 32, 32>(a, G, dq, op); break;
            }
            GTC_TRY(rc);
        }
        if (keys == 0) return GT_OK;
        switch (dmax) {
        case 64: return launch_dkv<64, 64, 64>(a, G, dk, dv, op);
        case 128: return launch_dkv<128, 32, 64>(a, G, dk, dv, op);
        default: return launch_dkv<256, 16, 32>(a, G, dk, dv, op);
        }
    }
    if (rows > 0) {
        int sb = 0;
        GTC_TRY(shared_bytes(a.Tk, 2, &sb, op));
        GTC_TRY(allow_shared(att_dq_naive, sb, op));
        att_dq_naive<<<(unsigned)rows, ATT_THREADS, sb, gtc_stream_()>>>(a, G, dq);
        GTC_TRY(GTC_LAUNCHED(op));
    }
    if (keys == 0) return GT_OK;
    att_dkv_naive<<<(unsigned)keys, 64, 0, gtc_stream_()>>>(a, G, dk, dv);
    return GTC_LAUNCHED(op);
}
