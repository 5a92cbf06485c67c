/* attention.c: fused scaled-dot-product attention, forward and backward, by blocks
 * (FlashAttention-2's scheme): no T_q x T_k matrix is ever stored.
 *
 * Forward, for one block of BR query rows of one head: walk the key blocks of BC keys
 * the rows can see; per block, S = Q K_j^T (block product), mask, then the online
 * softmax: m = running row max of scale * S, l = running sum of exp(scale * S - m),
 * O = running sum of exp(scale * S - m) V_j; when m grows, l and O are first multiplied
 * by exp(m_old - m_new). At the end O / l is the output and m + log(l), the row's
 * log-sum-exp, is all that is kept for the backward.
 * Backward, for one KV head (and its G query heads): Delta_i = dO_i . O_i - dLSE_i first
 * (every row, before the products); then per query head, query block i and key block j,
 * P is recomputed from the saved LSE, P = exp(scale * Q_i K_j^T - LSE), and
 *     dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = scale * P * (dP - Delta),
 *     dK_j += dS^T Q_i,  dQ_i += dS K_j.
 * The block products run on gt_gemm_small_ (matmul.c's register tiles). Blocks are held
 * transposed, keys by queries (S^T = K_j Q_i^T), so the softmax's per-query reductions
 * run along vectors. Q^T (and dO^T in the backward) is packed, Q multiplied by scale as
 * it is, so S comes out scaled (the same bits in both directions). Rows of K, V (and Q,
 * dO in the backward) that would crowd L1 (crowded(): a token's width apart, a multiple of
 * 1 KiB at 8 heads of 32 or 64, so a block's 64 rows share a few sets and evict each other
 * between register tiles) are copied into contiguous rows first: a head's whole V (the
 * forward, once per thread and head: units go head by head) or K and V (the backward, once
 * a unit), Q and dO a query block at a time. Measured, one thread, plans reused, alternating processes against the
 * build without: the backward 16% faster at 8 heads of 32 (ctx 2048), 9% at 8 of 64, 7-10%
 * at Gemma 3's 4 of 256, the forward 0-4%; SmolLM2's rows (768 bytes apart) are not
 * crowded and are read in place, as copying them cost it 2-6%. The copies change no bits
 * (each product's order per element does not depend on its operands' strides).
 *
 * Masks (one per call): a query row r sees the keys of an interval [lo_r, hi_r], all of
 * them, or (segment mask with a repeated segment value) only those of its segment. A
 * sliding window of w keys (Gemma's local layers) moves lo_r up to hi_r - w + 1: the
 * query's own key and the w - 1 before it, as llama.cpp's standard SWA masks. A
 * block of keys is skipped when no row sees any of it, taken whole when every row sees
 * all of it, and masked key by key otherwise.
 *
 * Determinism: work units are whole (batch, head, query block)s in the forward and
 * (batch, KV head, group of its query heads)s in the backward; each output element is
 * computed by the unit that owns it, in a fixed order (O: key blocks ascending; dQ: key
 * blocks ascending; dK, dV: query heads, then query blocks, ascending), so which thread
 * takes which unit (threads take the next unit from a shared counter, which balances
 * causal masks' unequal blocks) changes nothing in the results.
 * Backward groups: with fewer than BWD_UNITS (batch, KV head)s (one sequence of a model
 * with few KV heads: Gemma 3 270M has one KV head for its four query heads), the G query
 * heads of each are split into P groups of consecutive heads, one unit each. A group owns
 * its heads' dQ; its share of dK and dV goes to dst (group 0) or to node scratch, and the
 * shares are summed after a barrier in group order. P depends on the shapes alone, never
 * on the thread count, so the bits do not either: dQ's are those of P = 1, dK's and dV's
 * the same sums rounded in another order. (Splitting by key blocks instead cost more than
 * it saved: every part transposed every head's queries again, and dQ, the larger, was
 * the one to sum.)
 */
#include <math.h>
#include <stdatomic.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ggmlnum.h"
#include "internal.h"
#include "rowops.h"
#include "simd.h"

#define BR 64       /* query rows per block */
#define BC 64       /* keys per block */
#define BWD_UNITS 8 /* backward: fewer (batch, KV head)s than this split their query heads */
#define LANES GT_LANES
#define ALIGN 64

enum { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_POS = 2, MASK_SEG = 3, MASK_TREE = 4 };
/* rows.ex of a row that sees every key of its interval (no segment value is this) */
#define SEE_ALL INT32_MIN

/* Shapes and strides of one call. q (B, Tq, H, D), k and v (B, Tk, Hkv, D): strides of
 * b, t, h in elements (d has stride 1). */
typedef struct att {
    int64_t B, Tq, Tk, H, Hkv, G, D;
    const float *q, *k, *v;
    int64_t qs[3], ks[3], vs[3];
    int mode;
    int64_t window;                 /* > 0: a query sees at most this many keys back (sliding window) */
    int pack_q, pack_k, pack_v, pack_g;   /* copy blocks of these rows before their products (crowded) */
    float scale;
    const int32_t *pos, *seg;       /* mode MASK_POS: (Tq,); MASK_SEG, MASK_TREE: (B, Tk) */
    const int32_t *par;             /* mode MASK_TREE: (B, Tq), the segment each row sees besides its own */
} att;

static int64_t align_up(int64_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }
static int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---- arguments ------------------------------------------------------------------- */

/* q, k, v of src[0..2]; with data == 0 (sizing: no memory yet) their shapes alone. */
static int check_qkv(const gt_node *node, const char *op, int data, att *A) {
    const gt_tensor *q = &node->src[0], *k = &node->src[1], *v = &node->src[2];
    GT_TRY(gt_attention_qkv_check(node, op, data));
    A->B = q->shape[0];
    A->Tq = q->shape[1];
    A->H = q->shape[2];
    A->D = q->shape[3];
    A->Tk = k->shape[1];
    A->Hkv = k->shape[2];
    A->G = A->H / A->Hkv;
    A->q = q->data;
    A->k = k->data;
    A->v = v->data;
    for (int i = 0; i < 3; i++) {
        A->qs[i] = q->strides[i];
        A->ks[i] = k->strides[i];
        A->vs[i] = v->strides[i];
    }
    return GT_OK;
}

/* The mask: ip[0] (0 none, 1 causal, 2 by position, 3 by segment, 4 by segment and parent) and its
 * inputs src[im] (and src[im + 1]). */
static int check_mask(const gt_node *node, const char *op, int im, att *A) {
    GT_TRY(gt_attention_mask_check(node, op, im));
    A->mode = (int)node->ip[0];
    A->window = node->ip[1];
    A->scale = node->fp[0];
    A->pos = A->mode == MASK_POS ? node->src[im].data : NULL;
    A->seg = A->mode >= MASK_SEG ? node->src[im].data : NULL;
    A->par = A->mode == MASK_TREE ? node->src[im + 1].data : NULL;
    return GT_OK;
}

/* ---- which keys each query row sees -------------------------------------------------- */

/* Rows of the mask, (B, Tq) each: row r of batch b sees keys in [lo, hi] (none when
 * hi < lo); ex == SEE_ALL: every key of the interval, else (segment masks) only the keys
 * with seg[key] == seg[r] or seg[key] == ex[r]: ex[r] is the segment the row also sees (the
 * tree mask's parent: a shared prefix), or seg[r] itself. */
typedef struct rows {
    int32_t *lo, *hi, *ex;
} rows;

/* Fill the rows of batches [b0, b1). Segment mask: a row's interval starts at the
 * first key with its segment value; for packed samples (contiguous runs) that is its
 * run's start and the interval is exact. Tree mask: a row whose parent is another segment
 * starts at that segment's first key (at most its own row), and its keys are tested. */
static void fill_rows(const att *A, rows R, int64_t b0, int64_t b1) {
    const int64_t Tq = A->Tq, Tk = A->Tk;
    for (int64_t b = b0; b < b1; b++) {
        int32_t *lo = R.lo + b * Tq, *hi = R.hi + b * Tq, *ex = R.ex + b * Tq;
        if (A->mode >= MASK_SEG) {
            const int32_t *sg = A->seg + b * Tk, *par = A->par ? A->par + b * Tq : NULL;
            int32_t first = 0, exact = 1, pval = 0, pfirst = -1;
            for (int64_t r = 0; r < Tq; r++) {
                if (r == 0 || sg[r] != sg[r - 1]) {   /* a new run: is its value seen earlier? */
                    first = (int32_t)r;
                    exact = 1;
                    for (int64_t j = 0; j < r; j++)
                        if (sg[j] == sg[r]) {
                            first = (int32_t)j;
                            exact = 0;
                            break;
                        }
                }
                int32_t l = first, see = exact ? SEE_ALL : sg[r];
                if (par && par[r] != sg[r]) {
                    if (pfirst < 0 || par[r] != pval) {     /* the parent's first key (before r) */
                        pval = par[r];
                        pfirst = (int32_t)r;
                        for (int64_t j = 0; j < r; j++)
                            if (sg[j] == pval) {
                                pfirst = (int32_t)j;
                                break;
                            }
                    }
                    l = pfirst < l ? pfirst : l;
                    see = pval;
                }
                lo[r] = l;
                if (A->window > 0 && r - A->window + 1 > l) lo[r] = (int32_t)(r - A->window + 1);
                hi[r] = (int32_t)r;
                ex[r] = see;
            }
            continue;
        }
        for (int64_t r = 0; r < Tq; r++) {
            int64_t h = Tk - 1;
            if (A->mode == MASK_CAUSAL) h = r + (Tk - Tq);
            else if (A->mode == MASK_POS) h = A->pos[r];
            /* the window counts back from the query's own key (its position; causal: the
             * diagonal), before the clamp to the keys there are */
            const int64_t l = A->window > 0 && h - A->window + 1 > 0 ? h - A->window + 1 : 0;
            h = h < -1 ? -1 : h > Tk - 1 ? Tk - 1 : h;
            lo[r] = (int32_t)(l < Tk ? l : Tk);
            hi[r] = (int32_t)h;
            ex[r] = SEE_ALL;
        }
    }
}

/* How rows [r0, r0 + n) of batch b see keys [c0, c1]. */
enum { BLOCK_SKIP, BLOCK_FULL, BLOCK_PARTIAL };

static int classify(const int32_t *lo, const int32_t *hi, const int32_t *ex, int64_t n, int64_t c0, int64_t c1) {
    int any = 0, full = 1;
    for (int64_t r = 0; r < n; r++) {
        const int64_t l = lo[r], h = hi[r];
        if (h >= l && h >= c0 && l <= c1) any = 1;
        if (!(l <= c0 && h >= c1 && ex[r] == SEE_ALL)) full = 0;
    }
    return !any ? BLOCK_SKIP : full ? BLOCK_FULL : BLOCK_PARTIAL;
}

/* A block's quarters: when it is partial and both its query rows and its keys are more than
 * HALF, each is cut in two at HALF, and see[2 i + j] says whether some row of query half i
 * sees some key of key half j (classify; 1 for a block not cut, nr = nk = 1). The products skip
 * the quarters no row sees: a causal diagonal block's second half of keys for its first
 * half of rows, a quarter of its work (at ctx 256, 4 of a head's 10 blocks are diagonal).
 * What they leave out is what the masks make nothing of: S there is masked to -inf (P = 0),
 * dS is 0, and the sums of P V, P^T dO, dS^T Q and dS K would add only products with a
 * factor 0 to a running sum that starts at +0 (so is never -0): each sum keeps its bits. */
#define HALF 32
typedef struct quarters {
    int nr, nk;             /* halves of the rows and of the keys: 1 or 2 */
    int64_t r[3], k[3];     /* rows [r[i], r[i + 1]) of half i; keys [k[j], k[j + 1]) of half j */
    int see[4];             /* see[2 i + j] */
} quarters;

static void quarters_of(quarters *Q, int kind, const int32_t *lo, const int32_t *hi, const int32_t *ex, int64_t nq,
                        int64_t j0, int64_t nc) {
    const int cut = kind == BLOCK_PARTIAL && nq > HALF && nc > HALF;
    Q->nr = Q->nk = cut ? 2 : 1;
    Q->r[0] = Q->k[0] = 0;
    Q->r[1] = cut ? HALF : nq;
    Q->k[1] = cut ? HALF : nc;
    Q->r[2] = nq;
    Q->k[2] = nc;
    for (int i = 0; i < Q->nr; i++)
        for (int j = 0; j < Q->nk; j++)
            Q->see[2 * i + j] = !cut || classify(lo + Q->r[i], hi + Q->r[i], ex + Q->r[i], Q->r[i + 1] - Q->r[i],
                                            j0 + Q->k[j], j0 + Q->k[j + 1] - 1) != BLOCK_SKIP;
}

/* The bounds [*a, *b) of the halves whose flags (see[0], see[step], ... n of them) are set,
 * halves cut at bound[]; a == b when none. Of two halves those set are consecutive. */
static void seen_span(const int *see, int step, int n, const int64_t *bound, int64_t *a, int64_t *b) {
    int first = -1, last = -1;
    for (int i = 0; i < n; i++)
        if (see[i * step]) {
            if (first < 0) first = i;
            last = i;
        }
    *a = first < 0 ? 0 : bound[first];
    *b = first < 0 ? 0 : bound[last + 1];
}

/* The rows [*a, *b) that see key half j; the keys [*a, *b) that rows of half i see. */
static void rows_seeing(const quarters *Q, int j, int64_t *a, int64_t *b) {
    seen_span(Q->see + j, 2, Q->nr, Q->r, a, b);
}

static void keys_seen(const quarters *Q, int i, int64_t *a, int64_t *b) {
    seen_span(Q->see + 2 * i, 1, Q->nk, Q->k, a, b);
}

/* ---- vector helpers (contiguous rows, LANES at a time, fixed order) ------------------ */

/* NOTE: masks are combined with & and | (not && and ||): branches in a loop body stop
 * GCC from vectorizing it. */

/* The block helpers below run over a block's nc key rows of n query columns (row stride
 * ld), vectorized along the columns: the per-query values (maxima, sums, LSE, Delta, mask
 * intervals) are vectors, and each column is reduced over the keys in order. Key c's
 * segment value is sk[c]. */

/* cmax[r] = max over the keys of s[c, r], every row seeing every key. A vector of columns
 * at a time over all the keys (its maxima held in registers, not reloaded and stored per
 * key); each column still takes its keys in order. */
GT_CLONES static void block_max(float *restrict cmax, const float *restrict s, int64_t ld, int64_t nc, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        float acc[LANES];
        for (int k = 0; k < LANES; k++) acc[k] = cmax[i + k];
        for (int64_t c = 0; c < nc; c++)
            for (int k = 0; k < LANES; k++) acc[k] = s[c * ld + i + k] > acc[k] ? s[c * ld + i + k] : acc[k];
        for (int k = 0; k < LANES; k++) cmax[i + k] = acc[k];
    }
    for (; i < n; i++)
        for (int64_t c = 0; c < nc; c++) cmax[i] = s[c * ld + i] > cmax[i] ? s[c * ld + i] : cmax[i];
}

/* The same where rows see keys c0 + c only partly: s[c, r] = -inf where row r does not. */
GT_CLONES static void block_mask_max(float *restrict cmax, float *restrict s, int64_t ld, int64_t nc, int64_t n,
                                     int32_t c0, const int32_t *restrict sk, const int32_t *restrict lo,
                                     const int32_t *restrict hi, const int32_t *restrict ex,
                                     const int32_t *restrict sq) {
    for (int64_t c = 0; c < nc; c++) {
        float *restrict sc = s + c * ld;
        const int32_t key = c0 + (int32_t)c, segc = sk[c];
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int k = 0; k < LANES; k++) {
                const int vis = (key >= lo[i + k]) & (key <= hi[i + k]) &
                                ((ex[i + k] == SEE_ALL) | (segc == sq[i + k]) | (segc == ex[i + k]));
                const float x = vis ? sc[i + k] : -INFINITY;
                sc[i + k] = x;
                cmax[i + k] = x > cmax[i + k] ? x : cmax[i + k];
            }
        for (; i < n; i++) {
            const int vis = (key >= lo[i]) & (key <= hi[i]) & ((ex[i] == SEE_ALL) | (segc == sq[i]) | (segc == ex[i]));
            const float x = vis ? sc[i] : -INFINITY;
            sc[i] = x;
            cmax[i] = x > cmax[i] ? x : cmax[i];
        }
    }
}

/* The online softmax's step per row, after a block's row maxima bm: the new max
 * m' = max(m, bm), alpha = exp(m - m') (what l and O are multiplied by; 0 while m is
 * -inf: nothing summed yet) and msafe = m', or 0 while m' is -inf (so that
 * exp(s - msafe) of masked s = -inf is 0, never NaN). bm is then zeroed for the sums. */
GT_CLONES static void online_max(float *restrict m, float *restrict bm, float *restrict alpha,
                                 float *restrict msafe, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            const float mo = m[i + k], mn = bm[i + k] > mo ? bm[i + k] : mo;
            const float e = gt_expf_(mo - mn);
            alpha[i + k] = mo == -INFINITY ? 0.0f : e;
            msafe[i + k] = mn == -INFINITY ? 0.0f : mn;
            m[i + k] = mn;
            bm[i + k] = 0.0f;
        }
    for (; i < n; i++) {
        const float mo = m[i], mn = bm[i] > mo ? bm[i] : mo;
        const float e = gt_expf_(mo - mn);
        alpha[i] = mo == -INFINITY ? 0.0f : e;
        msafe[i] = mn == -INFINITY ? 0.0f : mn;
        m[i] = mn;
        bm[i] = 0.0f;
    }
}

/* l = l * alpha + bsum */
GT_CLONES static void online_sum(float *restrict l, const float *restrict alpha, const float *restrict bsum,
                                 int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) l[i + k] = l[i + k] * alpha[i + k] + bsum[i + k];
    for (; i < n; i++) l[i] = l[i] * alpha[i] + bsum[i];
}

/* s[c, r] = exp(s[c, r] - m[r]); csum[r] += s[c, r], keys in order (a vector of columns at
 * a time over all the keys, as block_max). With AVX-512, block_exp_sum_512: the same with
 * gt_expf16_ (simd.h: the same bits in fewer instructions; the exps were 16% of the forward
 * at head size 32). */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static void block_exp_sum_512(float *restrict s, int64_t ld, int64_t nc,
                                                                 int64_t n, float *restrict csum,
                                                                 const float *restrict m) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        __m512 acc = _mm512_loadu_ps(csum + i);
        const __m512 mi = _mm512_loadu_ps(m + i);
        for (int64_t c = 0; c < nc; c++) {
            const __m512 e = gt_expf16_(_mm512_sub_ps(_mm512_loadu_ps(s + c * ld + i), mi));
            _mm512_storeu_ps(s + c * ld + i, e);
            acc = _mm512_add_ps(acc, e);
        }
        _mm512_storeu_ps(csum + i, acc);
    }
    for (; i < n; i++)
        for (int64_t c = 0; c < nc; c++) {
            const float e = gt_expf_(s[c * ld + i] - m[i]);
            s[c * ld + i] = e;
            csum[i] += e;
        }
}
#define HAVE_EXP_512 1
#else
#define HAVE_EXP_512 0          /* (the plain functions stand in; never called) */
#define block_exp_sum_512 block_exp_sum
#define block_probs_grad_512 block_probs_grad
#endif

GT_CLONES static void block_exp_sum(float *restrict s, int64_t ld, int64_t nc, int64_t n, float *restrict csum,
                                    const float *restrict m) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        float acc[LANES], mi[LANES];
        for (int k = 0; k < LANES; k++) {
            acc[k] = csum[i + k];
            mi[k] = m[i + k];
        }
        for (int64_t c = 0; c < nc; c++)
            for (int k = 0; k < LANES; k++) {
                const float e = gt_expf_(s[c * ld + i + k] - mi[k]);
                s[c * ld + i + k] = e;
                acc[k] += e;
            }
        for (int k = 0; k < LANES; k++) csum[i + k] = acc[k];
    }
    for (; i < n; i++)
        for (int64_t c = 0; c < nc; c++) {
            const float e = gt_expf_(s[c * ld + i] - m[i]);
            s[c * ld + i] = e;
            csum[i] += e;
        }
}

/* One element of block_probs_grad (key `key` of segment segc, query row i): the rows past
 * the last whole vector of either version */
static inline __attribute__((always_inline)) void
probs_grad_1(float *restrict sc, float *restrict dc, int64_t i, float scale, int32_t key, int32_t segc,
             const float *restrict lse, const float *restrict delta, const int32_t *restrict lo,
             const int32_t *restrict hi, const int32_t *restrict ex, const int32_t *restrict sq, int partial) {
    const float e = gt_expf_(sc[i] - lse[i]);
    float p = e;
    if (partial) {
        const int vis = (key >= lo[i]) & (key <= hi[i]) & ((ex[i] == SEE_ALL) | (segc == sq[i]) | (segc == ex[i]));
        p = vis ? e : 0.0f;
    }
    sc[i] = p;
    dc[i] = scale * p * (dc[i] - delta[i]);
}

/* Backward (s: the scaled logits of keys c0 + c): p = exp(s - lse) where seen (every key
 * unless partial), else 0; s = p, dp = scale * p * (dp - delta). PARTIAL is a constant
 * after inlining: a whole block (most of them) computes no visibility. */
static inline __attribute__((always_inline)) void
probs_grad_body(float *restrict s, float *restrict dp, int64_t ld, int64_t nc, int64_t n, float scale,
                int32_t c0, const int32_t *restrict sk, const float *restrict lse, const float *restrict delta,
                const int32_t *restrict lo, const int32_t *restrict hi, const int32_t *restrict ex,
                const int32_t *restrict sq, const int PARTIAL) {
    for (int64_t c = 0; c < nc; c++) {
        float *restrict sc = s + c * ld, *restrict dc = dp + c * ld;
        const int32_t key = c0 + (int32_t)c, segc = sk[c];
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int k = 0; k < LANES; k++) {
                const float e = gt_expf_(sc[i + k] - lse[i + k]);
                float p = e;
                if (PARTIAL) {
                    const int vis = (key >= lo[i + k]) & (key <= hi[i + k]) &
                                    ((ex[i + k] == SEE_ALL) | (segc == sq[i + k]) | (segc == ex[i + k]));
                    p = vis ? e : 0.0f;
                }
                sc[i + k] = p;
                dc[i + k] = scale * p * (dc[i + k] - delta[i + k]);
            }
        for (; i < n; i++) probs_grad_1(sc, dc, i, scale, key, segc, lse, delta, lo, hi, ex, sq, PARTIAL);
    }
}

#if HAVE_EXP_512
/* block_probs_grad with gt_expf16_ (as block_exp_sum_512): the same bits, sixteen rows at a
 * time; a partial block's visibility as a mask of the same tests */
__attribute__((target("avx512f"))) static void
block_probs_grad_512(float *restrict s, float *restrict dp, int64_t ld, int64_t nc, int64_t n, float scale,
                     int partial, int32_t c0, const int32_t *restrict sk, const float *restrict lse,
                     const float *restrict delta, const int32_t *restrict lo, const int32_t *restrict hi,
                     const int32_t *restrict ex, const int32_t *restrict sq) {
    const int64_t nv = n / LANES * LANES;
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < nc; c++) {
        float *restrict sc = s + c * ld, *restrict dc = dp + c * ld;
        const int32_t key = c0 + (int32_t)c, segc = sk[c];
        const __m512i vkey = _mm512_set1_epi32(key), vseg = _mm512_set1_epi32(segc);
        for (int64_t i = 0; i < nv; i += LANES) {
            __m512 p = gt_expf16_(_mm512_sub_ps(_mm512_loadu_ps(sc + i), _mm512_loadu_ps(lse + i)));
            if (partial) {
                const __mmask16 vis =
                    _mm512_cmpge_epi32_mask(vkey, _mm512_loadu_si512(lo + i)) &
                    _mm512_cmple_epi32_mask(vkey, _mm512_loadu_si512(hi + i)) &
                    (_mm512_cmpeq_epi32_mask(_mm512_loadu_si512(ex + i), _mm512_set1_epi32(SEE_ALL)) |
                     _mm512_cmpeq_epi32_mask(vseg, _mm512_loadu_si512(sq + i)) |
                     _mm512_cmpeq_epi32_mask(vseg, _mm512_loadu_si512(ex + i)));
                p = _mm512_maskz_mov_ps(vis, p);
            }
            _mm512_storeu_ps(sc + i, p);
            _mm512_storeu_ps(dc + i, _mm512_mul_ps(_mm512_mul_ps(vs, p),
                                                   _mm512_sub_ps(_mm512_loadu_ps(dc + i), _mm512_loadu_ps(delta + i))));
        }
        for (int64_t i = nv; i < n; i++) probs_grad_1(sc, dc, i, scale, key, segc, lse, delta, lo, hi, ex, sq, partial);
    }
}
#endif

GT_CLONES static void block_probs_grad(float *restrict s, float *restrict dp, int64_t ld, int64_t nc, int64_t n,
                                       float scale, int partial, int32_t c0, const int32_t *restrict sk,
                                       const float *restrict lse, const float *restrict delta,
                                       const int32_t *restrict lo, const int32_t *restrict hi,
                                       const int32_t *restrict ex, const int32_t *restrict sq) {
    if (partial) probs_grad_body(s, dp, ld, nc, n, scale, c0, sk, lse, delta, lo, hi, ex, sq, 1);
    else probs_grad_body(s, dp, ld, nc, n, scale, c0, sk, lse, delta, lo, hi, ex, sq, 0);
}

/* dst (D x n, row stride ld) = c * the n rows of src (row stride rs, D contiguous floats
 * each), transposed: 16 rows at a time, so each d writes a line of dst (row by row, each
 * element went to its own line: a head's Q^T at ctx 2048 is 8 KiB a row) */
static void transpose_rows(float *restrict dst, int64_t ld, const float *restrict src, int64_t rs, int64_t n,
                           int64_t D, float c) {
    for (int64_t r0 = 0; r0 < n; r0 += 16) {
        const int64_t r1 = n - r0 < 16 ? n : r0 + 16;
        for (int64_t d = 0; d < D; d++)
            for (int64_t r = r0; r < r1; r++) dst[d * ld + r] = c * src[r * rs + d];
    }
}

/* dst (n x D, contiguous) = the n rows of src, rs apart. Kept a loop: GCC makes the copy
 * of a row a memcpy call, whose cost for rows of 128 bytes was 1.6% of a ctx-2048 llama
 * step (perf), more than the copy's. */
GT_CLONES __attribute__((optimize("no-tree-loop-distribute-patterns"))) static void
copy_rows(float *restrict dst, const float *restrict src, int64_t rs, int64_t n, int64_t D) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D; d++) dst[r * D + d] = src[r * rs + d];
}

/* dst (n rows, ld apart) = src (n x D, contiguous): copy_rows the other way. */
GT_CLONES __attribute__((optimize("no-tree-loop-distribute-patterns"))) static void
copy_rows_to(float *restrict dst, int64_t ld, const float *restrict src, int64_t n, int64_t D) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D; d++) dst[r * ld + d] = src[r * D + d];
}

/* Whether a block of rows of D floats, rs apart, crowds L1: more than L1_LINES_PER_SET of
 * its 64-byte lines fall into one set of a 64-set L1 (48 KiB, 12 ways), so the rows evict
 * each other while a product reads them (rows a multiple of 1 KiB apart: 8 heads of 32 or
 * of 64, or Gemma's 4 query heads of 256). Rows 768 bytes apart (SmolLM2's K and V) spread
 * over every set, and copying them cost 2-6% of its attention. */
#define L1_SETS 64
#define L1_LINES_PER_SET 8
#define LINE_BYTES 64
static int crowded(int64_t rs, int64_t D) {
    if (rs == D) return 0;
    const int64_t F = (int64_t)sizeof(float);
    int count[L1_SETS] = {0};
    for (int64_t r = 0; r < BC; r++)
        for (int64_t l = r * rs * F / LINE_BYTES; l <= (r * rs * F + D * F - 1) / LINE_BYTES; l++)
            if (++count[l % L1_SETS] > L1_LINES_PER_SET) return 1;
    return 0;
}

/* Whether copies of crowded rows would be read more than once: a block of K or V rows is
 * read once per register tile of query rows (at most 12 rows a tile), so with 12 queries or
 * fewer (decoding a token) a copy would only add a pass over the cache; likewise Q and dO
 * with 12 keys or fewer. */
static int reused(const att *A) { return A->Tq > 12 && A->Tk > 12; }

/* The n rows of src (rs apart) as rows D floats apart: their copy in buf when pack, else
 * src itself (pack is 0 for rows already contiguous). */
static const float *packed_rows(float *buf, const float *src, int64_t rs, int64_t n, int64_t D, int pack) {
    if (!pack) return src;
    copy_rows(buf, src, rs, n, D);
    return buf;
}

/* ---- forward ------------------------------------------------------------------------ */

/* Per-thread work of the forward, in floats from a 64-byte aligned base: QT (D x BR),
 * ST (BC x BR), O (BR x D), then per-row vectors m, l, cmax, msafe, alpha, a head's V
 * copied (Tk x D where fwd_copies_v, else none), and int32 lo, hi, ex, sq (BR each), and the
 * keys' segments sk (BC). */
typedef struct fwd_work {
    float *qt, *st, *o, *m, *l, *cmax, *msafe, *alpha, *vb;
    int32_t *lo, *hi, *ex, *sq, *sk;
} fwd_work;

/* Whether the forward copies a head's V (crowded rows read more than once): its work then
 * holds Tk x D floats for the copy, else none. */
static int fwd_copies_v(const att *A) { return reused(A) && crowded(A->vs[1], A->D); }

static int64_t fwd_work_layout(const att *A, char *base, fwd_work *w) {
    const int64_t D = A->D;
    int64_t off = 0;
    float **f[9];
    int64_t n[9] = {D * BR, (int64_t)BC * BR, BR * D, BR, BR, BR, BR, BR, fwd_copies_v(A) ? A->Tk * D : 0};
    if (w) {
        f[0] = &w->qt; f[1] = &w->st; f[2] = &w->o; f[3] = &w->m;
        f[4] = &w->l; f[5] = &w->cmax; f[6] = &w->msafe; f[7] = &w->alpha; f[8] = &w->vb;
    }
    for (int i = 0; i < 9; i++) {
        if (w) *f[i] = (float *)(base + off);
        off += align_up(n[i] * (int64_t)sizeof(float));
    }
    int32_t **g[5];
    if (w) { g[0] = &w->lo; g[1] = &w->hi; g[2] = &w->ex; g[3] = &w->sq; g[4] = &w->sk; }
    for (int i = 0; i < 5; i++) {
        if (w) *g[i] = (int32_t *)(base + off);
        off += align_up((i < 4 ? BR : BC) * (int64_t)sizeof(int32_t));
    }
    return off + ALIGN;   /* room to align the base */
}

/* Groups of query heads of each (batch, KV head) in the backward (see the top of the
 * file): enough for BWD_UNITS units, at most one per query head. */
static int64_t bwd_groups(const att *A) {
    const int64_t units = A->B * A->Hkv;
    if (units >= BWD_UNITS) return 1;
    const int64_t p = div_up(BWD_UNITS, units);
    return p < A->G ? p : A->G;
}

/* Node scratch of either direction: a unit counter, the mask rows (3 x B x Tq int32),
 * then (backward) Delta (B x H x Tq floats) and the dK, dV shares of groups 1 .. P - 1
 * (2 x B x Tk x Hkv x D floats each, laid out as dst's dK and dV). */
typedef struct scratch {
    _Atomic int64_t *next;
    rows R;
    float *delta, *dkv_shares;
} scratch;

static int64_t kv_share_floats(const att *A) {
    return align_up(2 * A->B * A->Tk * A->Hkv * A->D * (int64_t)sizeof(float)) / (int64_t)sizeof(float);
}

static int64_t scratch_layout(const att *A, int with_delta, char *base, scratch *s) {
    int64_t off = ALIGN;
    const int64_t nr = align_up(A->B * A->Tq * (int64_t)sizeof(int32_t));
    if (s) {
        s->next = (_Atomic int64_t *)base;
        s->R.lo = (int32_t *)(base + off);
        s->R.hi = (int32_t *)(base + off + nr);
        s->R.ex = (int32_t *)(base + off + 2 * nr);
    }
    off += 3 * nr;
    if (with_delta) {
        if (s) s->delta = (float *)(base + off);
        off += align_up(A->B * A->H * A->Tq * (int64_t)sizeof(float));
        if (s) s->dkv_shares = (float *)(base + off);
        off += (bwd_groups(A) - 1) * kv_share_floats(A) * (int64_t)sizeof(float);
    }
    return off;
}

static int check_scratch(const gt_node *node, const char *op, int64_t need) {
    if (!node->scratch || node->scratch_size < need)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected %lld bytes of node scratch, got %lld", op, (long long)need,
                       (long long)(node->scratch ? node->scratch_size : 0));
    if ((uintptr_t)node->scratch % ALIGN)
        return GT_FAIL(GT_ERR_INVALID, "%s: node scratch must be %d-byte aligned", op, ALIGN);
    return GT_OK;
}

static int check_work(const gt_ctx *ctx, const char *op, int64_t need) {
    if (!ctx->wdata || ctx->wsize < need)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected %lld bytes of per-thread work, got %lld", op, (long long)need,
                       (long long)(ctx->wdata ? ctx->wsize : 0));
    return GT_OK;
}

static char *aligned_work(const gt_ctx *ctx) {
    return (char *)(((uintptr_t)ctx->wdata + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1));
}

/* This row's mask inputs into the per-row vectors of a block: rows [i0, i0 + n) of batch
 * b; rows past Tq see nothing. */
static void block_rows(const att *A, rows R, int64_t b, int64_t i0, int64_t n, int32_t *lo, int32_t *hi,
                       int32_t *ex, int32_t *sq) {
    const int64_t base = b * A->Tq + i0;
    for (int64_t r = 0; r < n; r++) {
        lo[r] = R.lo[base + r];
        hi[r] = R.hi[base + r];
        ex[r] = R.ex[base + r];
        sq[r] = A->seg ? A->seg[b * A->Tk + i0 + r] : 0;
    }
}

/* The rows of a (batch, KV head)'s V a thread's forward work holds copied: rows [0, rows)
 * of V for key = b * Hkv + kvh (-1: none yet). */
typedef struct vcopy {
    int64_t key, rows;
} vcopy;

/* One forward unit: query rows [i0, i0 + nq) of head h, batch b. o: dst's O, lse: its LSE. */
static void fwd_unit(const att *A, rows R, fwd_work *w, int64_t b, int64_t h, int64_t i0, float *o, float *lse,
                     vcopy *vc) {
    const int64_t D = A->D, Tk = A->Tk, kvh = h / A->G;
    const int64_t nq = A->Tq - i0 < BR ? A->Tq - i0 : BR;
    const float *q = A->q + b * A->qs[0] + i0 * A->qs[1] + h * A->qs[2];
    const float *k = A->k + b * A->ks[0] + kvh * A->ks[2];
    const float *v = A->v + b * A->vs[0] + kvh * A->vs[2];
    block_rows(A, R, b, i0, nq, w->lo, w->hi, w->ex, w->sq);
    int64_t klo = Tk, khi = -1;
    for (int64_t r = 0; r < nq; r++) {
        if (w->hi[r] < w->lo[r]) continue;
        klo = w->lo[r] < klo ? w->lo[r] : klo;
        khi = w->hi[r] > khi ? w->hi[r] : khi;
    }
    transpose_rows(w->qt, BR, q, A->qs[1], nq, D, A->scale);   /* S comes out scaled */
    if (A->pack_v) {    /* this head's V, copied when crowded (see the top), up to the last block seen */
        const int64_t need = khi < 0 ? 0 : (khi / BC + 1) * BC < Tk ? (khi / BC + 1) * BC : Tk;
        if (vc->key != b * A->Hkv + kvh) vc->key = b * A->Hkv + kvh, vc->rows = 0;
        if (need > vc->rows) {
            copy_rows(w->vb + vc->rows * D, v + vc->rows * A->vs[1], A->vs[1], need - vc->rows, D);
            vc->rows = need;
        }
    }
    const float *vr = A->pack_v ? w->vb : v;
    const int64_t vrs = A->pack_v ? D : A->vs[1];
    for (int64_t r = 0; r < nq; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    int first = 1;
    for (int64_t j0 = klo >= 0 && klo < Tk ? klo / BC * BC : Tk; j0 <= khi; j0 += BC) {
        const int64_t nc = Tk - j0 < BC ? Tk - j0 : BC;
        const int kind = classify(w->lo, w->hi, w->ex, nq, j0, j0 + nc - 1);
        if (kind == BLOCK_SKIP) continue;
        quarters Q;
        quarters_of(&Q, kind, w->lo, w->hi, w->ex, nq, j0, nc);
        /* ST (nc x nq) = K_j Q_i^T, the quarters seen */
        for (int j = 0; j < Q.nk; j++) {
            int64_t a, e;
            rows_seeing(&Q, j, &a, &e);
            if (a < e)
                gt_gemm_small_(w->st + Q.k[j] * BR + a, BR, k + (j0 + Q.k[j]) * A->ks[1], A->ks[1], 1, w->qt + a, BR,
                               Q.k[j + 1] - Q.k[j], e - a, D, 0);
        }
        for (int64_t r = 0; r < nq; r++) w->cmax[r] = -INFINITY;
        if (kind == BLOCK_FULL) {
            block_max(w->cmax, w->st, BR, nc, nq);
        } else {
            for (int64_t c = 0; c < nc; c++) w->sk[c] = A->seg ? A->seg[b * Tk + j0 + c] : 0;
            block_mask_max(w->cmax, w->st, BR, nc, nq, (int32_t)j0, w->sk, w->lo, w->hi, w->ex, w->sq);
        }
        online_max(w->m, w->cmax, w->alpha, w->msafe, nq);
        if (HAVE_EXP_512 && gt_simd_level_() >= 2) block_exp_sum_512(w->st, BR, nc, nq, w->cmax, w->msafe);
        else block_exp_sum(w->st, BR, nc, nq, w->cmax, w->msafe);
        online_sum(w->l, w->alpha, w->cmax, nq);
        if (!first)
            for (int64_t r = 0; r < nq; r++) mul_row(w->o + r * D, w->alpha[r], D);
        /* O (nq x D) (+)= P V_j, P[r, c] = ST[c, r], over the keys each half of the rows sees */
        for (int i = 0; i < Q.nr; i++) {
            int64_t a, e;
            keys_seen(&Q, i, &a, &e);
            gt_gemm_small_(w->o + Q.r[i] * D, D, w->st + a * BR + Q.r[i], 1, BR, vr + (j0 + a) * vrs, vrs,
                           Q.r[i + 1] - Q.r[i], D, e - a, !first);
        }
        first = 0;
    }
    for (int64_t r = 0; r < nq; r++) {
        float *orow = o + ((b * A->Tq + i0 + r) * A->H + h) * D;
        const float l = w->l[r];
        if (first || !(l > 0.0f)) {   /* sees no key */
            memset(orow, 0, (size_t)D * sizeof(float));
            lse[(b * A->H + h) * A->Tq + i0 + r] = -INFINITY;
            continue;
        }
        scale_row(orow, w->o + r * D, 1.0f / l, D);
        lse[(b * A->H + h) * A->Tq + i0 + r] = w->m[r] + logf(l);
    }
}

/* ---- llama.cpp's CPU attention, bit for bit (inference; ip[2] = 1) ------------------ */

/* llama.cpp (without flash attention, F32 KV cache) computes S = K Q^T (ggml_vec_dot_f32 per
 * key), scales S (or q before it: ip[3]), softmaxes each row over every cache slot (masked
 * ones -inf) and multiplies by V^T (per dimension, over the slots: ggml_vec_dot_f32 for one
 * query, its tinyBLAS GEMM for more, 16 lanes then reduce16). Its float order, as an
 * AVX-512 build runs it:
 *   dot(x, y, n): gt_ggml_dot (ggmlnum.h, which says the order of each of its dots);
 *   softmax: e = its vector exp (gt_ggml_expf_, internal.h) of s - max, summed in double 16 slots at a
 *     time (each 16 by gt_ggml_reduce16), then e * (float)(1 / sum).
 * Slots are cache rows (position = row), so a masked slot is a zero lane: the padding
 * llama.cpp adds to its cache (to 256 rows) changes nothing. Other builds (AVX2) order their
 * sums otherwise; this is the AVX-512 one on every CPU. With ip[4] its F16 KV cache (its
 * default): q, K, V and P rounded to f16 where they meet the cache, and S of 2 or more queries
 * by tinyBLAS's 16 lanes (its f16 operands are contiguous). With ip[5] a sink logit a head
 * (gpt-oss's attn_sinks, the input after the mask's) joins each softmax as its soft_max adds
 * it: the max is max(max, sink), the double sum gains libm's expf(sink - max), adding no value;
 * LSE is then the log of the whole denominator. */

/* lanes (nl x D, lane-major) to out (D): 64 lanes as gt_ggml_dot folds them, then reduce16, every
 * d at once (the lanes are rewritten) */
static inline __attribute__((always_inline)) void fold_lanes(float *restrict out, float *restrict a, int64_t nl,
                                                             int64_t D) {
    if (nl == 64)
        for (int l = 0; l < 16; l++)
            for (int64_t d = 0; d < D; d++)
                a[l * D + d] = (a[l * D + d] + a[(l + 32) * D + d]) + (a[(l + 16) * D + d] + a[(l + 48) * D + d]);
    for (int i = 0; i < 8; i++)
        for (int64_t d = 0; d < D; d++) a[i * D + d] = a[(8 + i) * D + d] + a[i * D + d];
    for (int i = 0; i < 4; i++)
        for (int64_t d = 0; d < D; d++) a[i * D + d] = a[(4 + i) * D + d] + a[i * D + d];
    for (int64_t d = 0; d < D; d++) out[d] = (a[d] + a[2 * D + d]) + (a[D + d] + a[3 * D + d]);
}

/* per thread: the scaled query (D), a row's scores and their exps (Tk each, padded to 16) and
 * the lanes of P V (64 D); with an F16 cache then K and V rounded to f16 (B Tk Hkv D each) */
static int64_t ggml_row_bytes(int64_t D, int64_t Tk) {
    return align_up(D * (int64_t)sizeof(float)) + 2 * align_up((Tk + 16) * (int64_t)sizeof(float)) +
           align_up(64 * D * (int64_t)sizeof(float));
}

static int64_t ggml_work_layout(const att *A, int kv16) {
    const int64_t kv = kv16 ? 2 * align_up(A->B * A->Tk * A->Hkv * A->D * (int64_t)sizeof(float)) : 0;
    return ggml_row_bytes(A->D, A->Tk) + kv + ALIGN;
}

GT_CLONES static void ggml_row(const att *A, rows R, int scale_q, int kv16, const float *sinks, char *work,
                               int64_t b, int64_t h, int64_t r, float *o, float *lse) {
    const int64_t D = A->D, Tk = A->Tk;
    float *qs = (float *)work, *s = (float *)(work + align_up(D * (int64_t)sizeof(float)));
    float *e = (float *)((char *)s + align_up((Tk + 16) * (int64_t)sizeof(float)));
    float *acc = (float *)((char *)e + align_up((Tk + 16) * (int64_t)sizeof(float)));
    float *orow = o + ((b * A->Tq + r) * A->H + h) * D;
    const int64_t lo = R.lo[b * A->Tq + r], hi = R.hi[b * A->Tq + r];
    if (hi < lo) {      /* (with a sink: its weight 1, the keys' 0) */
        memset(orow, 0, (size_t)D * sizeof(float));
        lse[(b * A->H + h) * A->Tq + r] = sinks ? sinks[h] : -INFINITY;
        return;
    }
    const float *q = A->q + b * A->qs[0] + r * A->qs[1] + h * A->qs[2];
    const float *k = A->k + b * A->ks[0] + (h / A->G) * A->ks[2];
    const float *v = A->v + b * A->vs[0] + (h / A->G) * A->vs[2];
    for (int64_t d = 0; d < D; d++) qs[d] = scale_q ? q[d] * A->scale : q[d];
    if (kv16) gt_round_f16_(qs, qs, D);         /* an F16 cache (K and V came rounded): q meets it in f16 */
    float mx = -INFINITY;
    for (int64_t j = lo; j <= hi; j++) {
        const float *kj = k + j * A->ks[1];
        /* f16 operands of 2 or more rows go to tinyBLAS (16 lanes) when D is a multiple of 16,
         * f32 ones never (q is strided) */
        s[j] = !kv16 ? gt_ggml_dot(kj, qs, D) : A->Tq >= 2 && D % 16 == 0 ? gt_ggml_dot16(kj, qs, D)
                                                                   : gt_ggml_dot_f16(kj, qs, D);
        if (!scale_q) s[j] *= A->scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    if (sinks) mx = mx > sinks[h] ? mx : sinks[h];
    /* e = exp(s - max) over the row's slots, 0 in the 16-slot chunks' other slots */
    const int64_t c0 = lo / 16 * 16, c1 = (hi / 16 + 1) * 16;
    for (int64_t j = lo; j <= hi; j++) s[j] -= mx;
    for (int64_t j = c0; j < lo; j++) e[j] = 0.0f;
    for (int64_t j = lo; j <= hi; j++) e[j] = gt_ggml_expf_fast_(s[j]);
    for (int64_t j = lo; j <= hi; j++)
        if (!(s[j] > -87.0f)) e[j] = gt_ggml_expf_(s[j]);     /* the far end, exactly */
    for (int64_t j = hi + 1; j < c1; j++) e[j] = 0.0f;
    double sum = 0.0;
    for (int64_t c = c0; c < c1; c += 16) sum += (double)gt_ggml_reduce16(e + c);
    if (sinks) sum += (double)expf(sinks[h] - mx);
    const float inv = (float)(1.0 / sum);
    /* P V: one query (llama.cpp's ggml_vec_dot_f32) in 64 lanes, more (its tinyBLAS, which
     * serves a contiguous right operand of 2 or more rows) in 16, each lane an fma chain
     * over the slots j with j % lanes its own, then folded as each does */
    const int64_t nl = A->Tq >= 2 ? 16 : 64;
    memset(acc, 0, (size_t)(nl * D) * sizeof(float));
    for (int64_t j = lo; j <= hi; j++) e[j] *= inv;
    if (kv16) gt_round_f16_(e + lo, e + lo, hi - lo + 1);     /* P meets the F16 cache in f16 */
    for (int64_t j = lo; j <= hi; j++) {
        const float p = e[j];
        float *restrict a = acc + j % nl * D;
        const float *restrict vj = v + j * A->vs[1];
        for (int64_t d = 0; d < D; d++) a[d] = fmaf(vj[d], p, a[d]);
    }
    fold_lanes(orow, acc, nl, D);
    lse[(b * A->H + h) * A->Tq + r] = mx + (float)log(sum);
}

/* attention (see ggtrain.h): dst = [O (B, Tq, H, D) | LSE (B, H, Tq)]. */
int gt_attention_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    att A;
    GT_TRY(check_qkv(node, "attention", 0, &A));
    *scratch = scratch_layout(&A, 0, NULL, NULL);
    *work = node->ip[2] ? ggml_work_layout(&A, (int)node->ip[4]) : fwd_work_layout(&A, NULL, NULL);
    return GT_OK;
}

int gt_attention_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "attention";
    att A;
    GT_TRY(check_qkv(node, op, 1, &A));
    GT_TRY(check_mask(node, op, 3, &A));
    A.pack_v = fwd_copies_v(&A);
    const gt_tensor *d = &node->dst;
    GT_CHECK_F32(d, op, "dst");
    GT_TRY(gt_check_contig(d, op, "dst"));
    const int64_t no = A.B * A.Tq * A.H * A.D, nl = A.B * A.H * A.Tq;
    if (gt_numel(d) != no + nl) {
        char a[128];
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst of %lld elements (O and LSE), got %s", op,
                       (long long)(no + nl), gt_shape_str(d, a, sizeof a));
    }
    GT_TRY(gt_attention_ggml_check(node, op, 1));
    if (node->ip[2] && A.mode >= MASK_SEG)
        return GT_FAIL(GT_ERR_INVALID, "%s: llama.cpp's order (ip[2]) takes no segment mask", op);
    const float *sinks = NULL;      /* ip[5]: (H,) f32 after the mask's input */
    if (node->ip[5]) {
        const int is = 3 + (A.mode == MASK_POS);
        GT_TRY(gt_check_n_src(node, is + 1, op));
        const gt_tensor *sk = &node->src[is];
        GT_CHECK_F32(sk, op, "sinks");
        GT_TRY(gt_check_contig(sk, op, "sinks"));
        if (sk->ndim != 1 || sk->shape[0] != A.H) {
            char a[128];
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected sinks (%lld,) (one a head), got %s", op, (long long)A.H,
                           gt_shape_str(sk, a, sizeof a));
        }
        sinks = sk->data;
    }
    GT_TRY(check_scratch(node, op, scratch_layout(&A, 0, NULL, NULL)));
    GT_TRY(check_work(ctx, op,
                      node->ip[2] ? ggml_work_layout(&A, (int)node->ip[4]) : fwd_work_layout(&A, NULL, NULL)));
    scratch S;
    scratch_layout(&A, 0, node->scratch, &S);

    int64_t lo, hi;
    gt_split(A.B, ctx, &lo, &hi);
    fill_rows(&A, S.R, lo, hi);
    if (ctx->ith == 0) atomic_store_explicit(S.next, 0, memory_order_relaxed);
    gt_barrier(ctx);

    float *o = d->data, *lse = o + no;
    if (node->ip[2]) {      /* a (b, h, query) row a unit */
        char *work = aligned_work(ctx);
        const int kv16 = (int)node->ip[4];
        att R16 = A;        /* with an F16 cache: K and V rounded once, into this thread's work */
        if (kv16) {
            const int64_t rows = A.Tk * A.Hkv, D = A.D;
            float *kc = (float *)(work + ggml_row_bytes(D, A.Tk));
            float *vc = (float *)((char *)kc + align_up(A.B * rows * D * (int64_t)sizeof(float)));
            const int packed = A.ks[2] == D && A.ks[1] == A.Hkv * D && A.vs[2] == D && A.vs[1] == A.Hkv * D;
            /* only the keys some row sees, 0 .. the last one (a decoder's plan spans its whole
             * cache, and each token sees the rows filled so far) */
            int64_t seen = 0;
            for (int64_t i = 0; i < A.B * A.Tq; i++)
                if (S.R.hi[i] >= S.R.lo[i] && S.R.hi[i] + 1 > seen) seen = S.R.hi[i] + 1;
            for (int64_t b = 0; b < A.B; b++) {
                if (packed) {   /* (a KV cache's rows: one run a batch row, not one call a (row, head)) */
                    gt_round_f16_(kc + b * rows * D, A.k + b * A.ks[0], seen * A.Hkv * D);
                    gt_round_f16_(vc + b * rows * D, A.v + b * A.vs[0], seen * A.Hkv * D);
                    continue;
                }
                for (int64_t t = 0; t < seen; t++)
                    for (int64_t g = 0; g < A.Hkv; g++) {
                        const int64_t at = ((b * A.Tk + t) * A.Hkv + g) * D;
                        gt_round_f16_(kc + at, A.k + b * A.ks[0] + t * A.ks[1] + g * A.ks[2], D);
                        gt_round_f16_(vc + at, A.v + b * A.vs[0] + t * A.vs[1] + g * A.vs[2], D);
                    }
            }
            R16.k = kc;
            R16.v = vc;
            R16.ks[0] = R16.vs[0] = rows * D;
            R16.ks[1] = R16.vs[1] = A.Hkv * D;
            R16.ks[2] = R16.vs[2] = D;
        }
        const int64_t units = A.B * A.H * A.Tq;
        for (;;) {
            const int64_t u = atomic_fetch_add_explicit(S.next, 1, memory_order_relaxed);
            if (u >= units) break;
            ggml_row(&R16, S.R, (int)node->ip[3], kv16, sinks, work, u / (A.H * A.Tq), u / A.Tq % A.H, u % A.Tq, o, lse);
        }
        return GT_OK;
    }
    fwd_work w;
    fwd_work_layout(&A, aligned_work(ctx), &w);
    const int64_t nqb = div_up(A.Tq, BR), units = nqb * A.B * A.H;
    vcopy vc = {-1, 0};
    for (;;) {
        const int64_t u = atomic_fetch_add_explicit(S.next, 1, memory_order_relaxed);
        if (u >= units) break;
        /* head by head (so a thread's V copy serves its next units), each head's last query
         * blocks (most keys under a causal mask) first */
        const int64_t ib = nqb - 1 - u % nqb, b = u / nqb / A.H, h = u / nqb % A.H;
        fwd_unit(&A, S.R, &w, b, h, ib * BR, o, lse, &vc);
    }
    return GT_OK;
}

/* ---- backward ------------------------------------------------------------------------ */

/* Per-thread work of the backward: QT and dOT (one head's queries and output gradients,
 * transposed, a D x BR block per query block), ST and dPT (BC x BR), per-row vectors lse,
 * delta (BR each), Q_i and dO_i copied (BR x D each), the KV head's K and V copied (Tk x D
 * each), the unit's dQ_i (BR x D), dK and dV (Tk x D each) summed here and copied out to
 * dst once, then lo, hi, ex, sq (int32, BR each) and the keys' segments sk (BC).
 * NOTE: every block a product reads or adds to many times is contiguous: Q^T as one D x Tq
 * matrix was read D rows Tq floats apart (8 KiB at ctx 2048), and dQ, dK, dV summed in dst
 * rows H * D floats apart (1 KiB at 8 heads of 32): such rows share a few L1 sets and evict
 * each other between register tiles (see crowded()). Measured, 2 threads, builds alternating:
 * the backward alone of 8 heads of 32 at ctx 2048 40.0-40.6 -> 31.2-32.1 ms, of llama config
 * b's (4 x 256, 8 heads of 64) 7.6 -> 5.7 ms; inside a training step less, by how busy the
 * shared machine is (llama-c's 4 backwards 142-144 -> 126 ms in one sitting, 128-135 -> 124-132
 * in another).
 * Same products in the same order: same bits. */
typedef struct bwd_work {
    float *qt, *dot, *st, *dpt, *lse, *delta, *qb, *gb, *kb, *vb, *dqi, *dki, *dvi;
    int32_t *lo, *hi, *ex, *sq, *sk;
} bwd_work;

static int64_t bwd_work_layout(int64_t D, int64_t Tq, int64_t Tk, char *base, bwd_work *w) {
    int64_t off = 0;
    float **f[13];
    const int64_t qtn = D * div_up(Tq, BR) * BR;   /* Q^T, dO^T: a D x BR block per query block */
    const int64_t n[13] = {qtn, qtn, (int64_t)BC * BR, (int64_t)BC * BR, BR, BR, BR * D, BR * D, Tk * D, Tk * D,
                           BR * D, Tk * D, Tk * D};
    if (w) {
        f[0] = &w->qt; f[1] = &w->dot; f[2] = &w->st; f[3] = &w->dpt; f[4] = &w->lse; f[5] = &w->delta;
        f[6] = &w->qb; f[7] = &w->gb; f[8] = &w->kb; f[9] = &w->vb; f[10] = &w->dqi;
        f[11] = &w->dki; f[12] = &w->dvi;
    }
    for (int i = 0; i < 13; i++) {
        if (w) *f[i] = (float *)(base + off);
        off += align_up(n[i] * (int64_t)sizeof(float));
    }
    int32_t **g[5];
    if (w) { g[0] = &w->lo; g[1] = &w->hi; g[2] = &w->ex; g[3] = &w->sq; g[4] = &w->sk; }
    for (int i = 0; i < 5; i++) {
        if (w) *g[i] = (int32_t *)(base + off);
        off += align_up((i < 4 ? BR : BC) * (int64_t)sizeof(int32_t));
    }
    return off + ALIGN;
}

/* One backward unit: KV head kvh of batch b and its query heads g0 <= g < g1. dq: dst's
 * dQ; dk, dv: where this unit's share of dK and dV goes (dst's, or scratch's). */
static void bwd_unit(const att *A, rows R, const float *delta, const float *lse_all, const float *go,
                     const int64_t *gs, bwd_work *w, int64_t b, int64_t kvh, int64_t g0, int64_t g1, float *dq,
                     float *dk, float *dv) {
    const int64_t D = A->D, Tq = A->Tq, Tk = A->Tk, H = A->H, Hkv = A->Hkv;
    const int64_t ldq = H * D, ldk = Hkv * D;   /* dst row strides */
    float *dkb = dk + (b * Tk * Hkv + kvh) * D, *dvb = dv + (b * Tk * Hkv + kvh) * D;
    const float *k = A->k + b * A->ks[0] + kvh * A->ks[2];
    const float *v = A->v + b * A->vs[0] + kvh * A->vs[2];
    memset(w->dki, 0, (size_t)(Tk * D) * sizeof(float));
    memset(w->dvi, 0, (size_t)(Tk * D) * sizeof(float));
    /* this KV head's K and V, copied when crowded (see the top) */
    const float *kr = packed_rows(w->kb, k, A->ks[1], Tk, D, A->pack_k);
    const float *vr = packed_rows(w->vb, v, A->vs[1], Tk, D, A->pack_v);
    const int64_t krs = A->pack_k ? D : A->ks[1], vrs = A->pack_v ? D : A->vs[1];
    for (int64_t g = g0; g < g1; g++) {
        const int64_t h = kvh * A->G + g;
        const float *q = A->q + b * A->qs[0] + h * A->qs[2];
        const float *gq = go + b * gs[0] + h * gs[2];
        float *dqb = dq + (b * Tq * H + h) * D;
        for (int64_t i0 = 0; i0 < Tq; i0 += BR) {   /* block by block, as in the forward */
            const int64_t nq = Tq - i0 < BR ? Tq - i0 : BR;
            transpose_rows(w->qt + i0 * D, BR, q + i0 * A->qs[1], A->qs[1], nq, D, A->scale);
            transpose_rows(w->dot + i0 * D, BR, gq + i0 * gs[1], gs[1], nq, D, 1.0f);
        }
        for (int64_t i0 = 0; i0 < Tq; i0 += BR) {
            const int64_t nq = Tq - i0 < BR ? Tq - i0 : BR;
            block_rows(A, R, b, i0, nq, w->lo, w->hi, w->ex, w->sq);
            int64_t klo = Tk, khi = -1;
            for (int64_t r = 0; r < nq; r++) {
                w->lse[r] = lse_all[(b * H + h) * Tq + i0 + r];
                w->delta[r] = delta[(b * H + h) * Tq + i0 + r];
                if (w->hi[r] < w->lo[r]) continue;
                klo = w->lo[r] < klo ? w->lo[r] : klo;
                khi = w->hi[r] > khi ? w->hi[r] : khi;
            }
            const float *qi = packed_rows(w->qb, q + i0 * A->qs[1], A->qs[1], nq, D, A->pack_q);  /* Q_i, dO_i too */
            const float *gi = packed_rows(w->gb, gq + i0 * gs[1], gs[1], nq, D, A->pack_g);
            const int64_t qrs = A->pack_q ? D : A->qs[1], grs = A->pack_g ? D : gs[1];
            memset(w->dqi, 0, (size_t)(nq * D) * sizeof(float));
            for (int64_t j0 = klo < Tk ? klo / BC * BC : Tk; j0 <= khi; j0 += BC) {
                const int64_t nc = Tk - j0 < BC ? Tk - j0 : BC;
                const int kind = classify(w->lo, w->hi, w->ex, nq, j0, j0 + nc - 1);
                if (kind == BLOCK_SKIP) continue;
                const float *kj = kr + j0 * krs, *vj = vr + j0 * vrs;
                quarters Q;
                quarters_of(&Q, kind, w->lo, w->hi, w->ex, nq, j0, nc);
                /* ST = K_j Q_i^T, dPT = V_j dO_i^T (nc x nq), the quarters seen; dPT of the others 0
                 * (their P is 0, and so dS: dPT must hold a number there, not what was left) */
                for (int j = 0; j < Q.nk; j++) {
                    const int64_t c0 = Q.k[j], n = Q.k[j + 1] - c0;
                    int64_t a, e;
                    rows_seeing(&Q, j, &a, &e);
                    if (a < e) {
                        gt_gemm_small_(w->st + c0 * BR + a, BR, kj + c0 * krs, krs, 1, w->qt + i0 * D + a, BR, n, e - a,
                                       D, 0);
                        gt_gemm_small_(w->dpt + c0 * BR + a, BR, vj + c0 * vrs, vrs, 1, w->dot + i0 * D + a, BR, n,
                                       e - a, D, 0);
                    }
                    for (int i = 0; i < Q.nr; i++)
                        if (!Q.see[2 * i + j])
                            for (int64_t c = c0; c < c0 + n; c++)
                                memset(w->dpt + c * BR + Q.r[i], 0, (size_t)(Q.r[i + 1] - Q.r[i]) * sizeof(float));
                }
                for (int64_t c = 0; c < nc; c++) w->sk[c] = A->seg ? A->seg[b * Tk + j0 + c] : 0;
                const int part = kind == BLOCK_PARTIAL;
                if (HAVE_EXP_512 && gt_simd_level_() >= 2)
                    block_probs_grad_512(w->st, w->dpt, BR, nc, nq, A->scale, part, (int32_t)j0, w->sk, w->lse,
                                         w->delta, w->lo, w->hi, w->ex, w->sq);
                else
                    block_probs_grad(w->st, w->dpt, BR, nc, nq, A->scale, part, (int32_t)j0, w->sk, w->lse, w->delta,
                                     w->lo, w->hi, w->ex, w->sq);
                /* dV_j += P^T dO_i, dK_j += dS^T Q_i (nc x D), dQ_i += dS K_j (nq x D) */
                for (int j = 0; j < Q.nk; j++) {     /* over the rows that see each half of the keys */
                    const int64_t c0 = Q.k[j], n = Q.k[j + 1] - c0;
                    int64_t a, e;
                    rows_seeing(&Q, j, &a, &e);
                    gt_gemm_small_(w->dvi + (j0 + c0) * D, D, w->st + c0 * BR + a, BR, 1, gi + a * grs, grs, n, D,
                                   e - a, 1);
                    gt_gemm_small_(w->dki + (j0 + c0) * D, D, w->dpt + c0 * BR + a, BR, 1, qi + a * qrs, qrs, n, D,
                                   e - a, 1);
                }
                for (int i = 0; i < Q.nr; i++) {     /* over the keys each half of the rows sees */
                    int64_t a, e;
                    keys_seen(&Q, i, &a, &e);
                    gt_gemm_small_(w->dqi + Q.r[i] * D, D, w->dpt + a * BR + Q.r[i], 1, BR, kj + a * krs, krs,
                                   Q.r[i + 1] - Q.r[i], D, e - a, 1);
                }
            }
            copy_rows_to(dqb + i0 * ldq, ldq, w->dqi, nq, D);
        }
    }
    copy_rows_to(dkb, ldk, w->dki, Tk, D);
    copy_rows_to(dvb, ldk, w->dvi, Tk, D);
}

int gt_attention_bwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    att A;
    GT_TRY(check_qkv(node, "attention_bwd", 0, &A));
    *scratch = scratch_layout(&A, 1, NULL, NULL);
    *work = bwd_work_layout(A.D, A.Tq, A.Tk, NULL, NULL);
    return GT_OK;
}

/* attention_bwd (see ggtrain.h): dst = [dQ | dK | dV]. */
int gt_attention_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "attention_bwd";
    att A;
    char a[128];
    GT_TRY(gt_check_n_src(node, 5, op));
    GT_TRY(check_qkv(node, op, 1, &A));
    GT_TRY(check_mask(node, op, 5, &A));
    GT_TRY(gt_attention_ggml_check(node, op, 0));
    const gt_tensor *d = &node->dst, *y = &node->src[3], *g = &node->src[4];
    const int64_t no = A.B * A.Tq * A.H * A.D, nl = A.B * A.H * A.Tq, nk = A.B * A.Tk * A.Hkv * A.D;
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(y, op, "y");
    GT_CHECK_F32(g, op, "g");
    GT_TRY(gt_check_contig(d, op, "dst"));
    GT_TRY(gt_check_contig(y, op, "y"));
    if (gt_numel(d) != no + 2 * nk)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst of %lld elements (dq, dk, dv), got %s", op,
                       (long long)(no + 2 * nk), gt_shape_str(d, a, sizeof a));
    if (gt_numel(y) != no + nl)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected y (the forward's O and LSE) of %lld elements, got %s", op,
                       (long long)(no + nl), gt_shape_str(y, a, sizeof a));
    /* g: dO (B, Tq, H, D) with unit stride along D, or the gradient of all of y (dO and dLSE) */
    const gt_tensor *q = &node->src[0];
    int64_t gs[3];
    const float *dlse = NULL;
    if (gt_same_shape(g, q)) {
        if (A.D > 1 && g->strides[3] != 1)
            return GT_FAIL(GT_ERR_INVALID, "%s: expected g with unit stride along D, got stride %lld", op,
                           (long long)g->strides[3]);
        for (int i = 0; i < 3; i++) gs[i] = g->strides[i];
    } else if (gt_numel(g) == no + nl && gt_is_contiguous(g)) {
        gs[0] = A.Tq * A.H * A.D;
        gs[1] = A.H * A.D;
        gs[2] = A.D;
        dlse = (const float *)g->data + no;
    } else {
        char b[128];
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected g of q's shape %s (dO), or contiguous of y's %lld elements, "
                       "got %s", op, gt_shape_str(q, b, sizeof b), (long long)(no + nl),
                       gt_shape_str(g, a, sizeof a));
    }
    A.pack_q = reused(&A) && crowded(A.qs[1], A.D);
    A.pack_k = reused(&A) && crowded(A.ks[1], A.D);
    A.pack_v = reused(&A) && crowded(A.vs[1], A.D);
    A.pack_g = reused(&A) && crowded(gs[1], A.D);
    GT_TRY(check_scratch(node, op, scratch_layout(&A, 1, NULL, NULL)));
    GT_TRY(check_work(ctx, op, bwd_work_layout(A.D, A.Tq, A.Tk, NULL, NULL)));
    scratch S;
    scratch_layout(&A, 1, node->scratch, &S);
    bwd_work w;
    bwd_work_layout(A.D, A.Tq, A.Tk, aligned_work(ctx), &w);
    const float *o = y->data, *lse = o + no, *go = g->data;

    /* phase 1: the mask rows and Delta = rowsum(dO * O) - dLSE */
    int64_t lo, hi;
    gt_split(A.B, ctx, &lo, &hi);
    fill_rows(&A, S.R, lo, hi);
    gt_split(A.B * A.Tq, ctx, &lo, &hi);
    for (int64_t bt = lo; bt < hi; bt++) {
        const int64_t b = bt / A.Tq, t = bt % A.Tq;
        for (int64_t h = 0; h < A.H; h++) {
            const int64_t i = (b * A.H + h) * A.Tq + t;
            const float dd = dot_row(go + b * gs[0] + t * gs[1] + h * gs[2], o + (bt * A.H + h) * A.D, A.D);
            S.delta[i] = dlse ? dd - dlse[i] : dd;
        }
    }
    if (ctx->ith == 0) atomic_store_explicit(S.next, 0, memory_order_relaxed);
    gt_barrier(ctx);

    /* phase 2: one group of query heads of one (batch, KV head) per unit */
    float *dq = d->data, *dk = dq + no;   /* dV follows dK */
    const int64_t P = bwd_groups(&A), units = A.B * A.Hkv * P, share = kv_share_floats(&A);
    for (;;) {
        const int64_t u = atomic_fetch_add_explicit(S.next, 1, memory_order_relaxed);
        if (u >= units) break;
        const int64_t bk = u / P, p = u % P;
        float *to = p ? S.dkv_shares + (p - 1) * share : dk;   /* [dK | dV] of this group */
        bwd_unit(&A, S.R, S.delta, lse, go, gs, &w, bk / A.Hkv, bk % A.Hkv, p * A.G / P, (p + 1) * A.G / P,
                 dq, to, to + nk);
    }
    if (P == 1) return GT_OK;
    /* phase 3: dK, dV (contiguous in dst) = group 0's + group 1's + ... in group order */
    gt_barrier(ctx);
    gt_split(2 * nk, ctx, &lo, &hi);
    for (int64_t p = 1; p < P; p++) {
        const float *src = S.dkv_shares + (p - 1) * share;
        for (int64_t i = lo; i < hi; i++) dk[i] = dk[i] + src[i];
    }
    return GT_OK;
}
