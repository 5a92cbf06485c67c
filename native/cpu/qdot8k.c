/* qdot8k.c: the 8-bit-activation products (qdot8.c) of the K-quant weights Q4_K and Q6_K, with
 * the activations in super-blocks of 256 (gt_act8k: llama.cpp's Q8_K). Integer products exact;
 * the float order, per row, as llama.cpp's AVX2 build computes it:
 *   Q4_K (llama.cpp repacks it when W's rows are a multiple of 8; its GEMV): per super-block,
 *     I = sum over the 8 sub-blocks s of scale_s * (sum of its 32 q4 * q8),
 *     Im = sum over s of min_s * (bsums[2s] + bsums[2s+1]),
 *     acc = fma((float)I, f16(w.d) * x.d, acc), accm = fma((float)Im, f16(w.dmin) * x.d, accm);
 *   then y = acc - accm: llama.cpp's GEMV, for the last M % 4 rows of an M-row product. The
 *   first M - M % 4 rows take its GEMM (ggml_gemm_q4_K_8x8_q8_K), whose float order is finer:
 *   per pair of sub-blocks c (64 elements), I_c = scale_2c * dot_2c + scale_2c+1 * dot_2c+1 and
 *   Im_c = min_2c * bsum_2c + min_2c+1 * bsum_2c+1, each fma'd into acc and accm as above.
 *   (Rows of W not a multiple of 8 take llama.cpp's vec_dot there, whose float order is neither:
 *   the same integers, other roundings.)
 *   Products of 8 or more rows whose weights llama.cpp does not repack (Q6_K; Q4_K with rows
 *   not a multiple of 8) take its tiled K-quant GEMM (ggml-cpu/tiled): per super-block the
 *   exact integers I (and Im), r = (float)I * f16(w.d) (Q4_K: r = fma(-f16(w.dmin), (float)Im,
 *   r)), then acc = fma(r, x.d, acc) (its AVX2 kernel, which llama-cpp-python's build runs
 *   here; its AVX512-VNNI one, where built, rounds r * x.d before the sum); y = acc.
 *   Q6_K (ggml_vec_dot_q6_K_q8_K): per super-block, eight int32 lanes,
 *     lane l = sum over j < 2, v < 4, k < 4 of scale[e / 16] * q6[e] * q8[e] at
 *       e = 128 j + 32 v + 4 l + k (q6 unsigned, 0..63)
 *       - 32 * (bsums[2l] * scale[2l] + bsums[2l+1] * scale[2l+1]),
 *     acc[l] = fma(x.d * f16(w.d), (float)lane l, acc[l]);
 *   then y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)).
 * The plain C path and the AVX2 one give the same bits.
 */
#include <math.h>
#include <string.h>

#include "act8.h"

/* ---- activations ------------------------------------------------------------------------ */

static void quantize_superblock(gt_act8k *y, const float *x) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; j++) {
        const float a = fabsf(x[j]);
        if (a > amax) {
            amax = a;
            max = x[j];
        }
    }
    if (amax == 0.0f) {
        memset(y, 0, sizeof *y);
        return;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; j++) {
        const int v = (int)nearbyintf(iscale * x[j]);    /* nearest even, as ggml's nearest_int */
        y->q[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += y->q[16 * g + j];
        y->bsums[g] = (int16_t)s;
    }
    y->d = 1.0f / iscale;
}

void gt_act8k_quantize_(gt_act8k *y, const float *x, int64_t K) {
    for (int64_t b = 0; b < K / 256; b++) quantize_superblock(y + b, x + 256 * b);
}

/* ---- plain C ------------------------------------------------------------------------------ */

/* Q4_K super-block (144 B: d, dmin, scales[12], qs[128]): I and Im above over sub-blocks s0..s1-1 */
static void q4k_ints(const uint8_t *b, const gt_act8k *x, int s0, int s1, int32_t *I, int32_t *Im) {
    int32_t i_sum = 0, m_sum = 0;
    for (int s = s0; s < s1; s++) {
        int sc, mn;
        gt_k4_scale_min_(b + 4, s, &sc, &mn);
        const uint8_t *q = b + 16 + 32 * (s / 2);
        int32_t dot = 0;
        for (int l = 0; l < 32; l++) dot += (s % 2 ? q[l] >> 4 : q[l] & 15) * x->q[32 * s + l];
        i_sum += sc * dot;
        m_sum += mn * (x->bsums[2 * s] + x->bsums[2 * s + 1]);
    }
    *I = i_sum;
    *Im = m_sum;
}

/* Q6_K super-block (210 B: ql[128], qh[64], scales[16], d): element e's unsigned 6-bit value */
static inline int q6k_at(const uint8_t *b, int e) {
    const int h = e / 128, r = e % 128, l = r % 32, part = r / 32;
    const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
    const int lo = part == 0 ? ql[l] & 15 : part == 1 ? ql[l + 32] & 15 : part == 2 ? ql[l] >> 4 : ql[l + 32] >> 4;
    return lo | ((qh[l] >> (2 * part)) & 3) << 4;
}

static void q6k_lanes(const uint8_t *b, const gt_act8k *x, int32_t lane[8]) {
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int j = 0; j < 2; j++)
            for (int v = 0; v < 4; v++)
                for (int k = 0; k < 4; k++) {
                    const int e = 128 * j + 32 * v + 4 * l + k;
                    s += sc[e / 16] * q6k_at(b, e) * x->q[e];
                }
        lane[l] = s - 32 * (x->bsums[2 * l] * sc[2 * l] + x->bsums[2 * l + 1] * sc[2 * l + 1]);
    }
}

/* Which of llama.cpp's float orders (above) row `row` of an M-row product with W of N rows takes */
enum { ORDER_ONE, ORDER_PAIRS, ORDER_TILED };

static int row_order(int32_t dtype, int64_t N, int64_t M, int64_t row) {
    if (dtype == GT_Q4_K && N % 8 == 0) return row < M - M % 4 ? ORDER_PAIRS : ORDER_ONE;
    return M >= 8 ? ORDER_TILED : ORDER_ONE;
}

static void rows_plain(float *y, int64_t ldy, const gt_act8k *x, int64_t ldx, int m, int64_t M, int64_t m0,
                       const uint8_t *w, int64_t row_bytes, int32_t dtype, int64_t N, int64_t nb, int64_t n0,
                       int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int r = 0; r < m; r++) {
            const gt_act8k *xr = x + r * ldx;
            const int order = row_order(dtype, N, M, m0 + r);
            float acc[8] = {0}, a = 0.0f, am = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + n * row_bytes + b * (dtype == GT_Q4_K ? 144 : 210);
                if (order == ORDER_TILED) {
                    int32_t I = 0, Im = 0;
                    float rr;
                    if (dtype == GT_Q4_K) {
                        q4k_ints(wb, xr + b, 0, 8, &I, &Im);
                        rr = fmaf(-gt_half_at_(wb + 2), (float)Im, (float)I * gt_half_at_(wb));
                    } else {
                        int32_t lane[8];
                        q6k_lanes(wb, xr + b, lane);
                        for (int l = 0; l < 8; l++) I += lane[l];
                        rr = (float)I * gt_half_at_(wb + 208);
                    }
                    a = fmaf(rr, xr[b].d, a);
                } else if (dtype == GT_Q4_K) {
                    const int step = order == ORDER_PAIRS ? 2 : 8;   /* GEMM: a pair of sub-blocks; GEMV: all 8 */
                    for (int s0 = 0; s0 < 8; s0 += step) {
                        int32_t I, Im;
                        q4k_ints(wb, xr + b, s0, s0 + step, &I, &Im);
                        a = fmaf((float)I, gt_half_at_(wb) * xr[b].d, a);
                        am = fmaf((float)Im, gt_half_at_(wb + 2) * xr[b].d, am);
                    }
                } else {
                    int32_t lane[8];
                    q6k_lanes(wb, xr + b, lane);
                    const float d = xr[b].d * gt_half_at_(wb + 208);
                    for (int l = 0; l < 8; l++) acc[l] = fmaf(d, (float)lane[l], acc[l]);
                }
            }
            y[r * ldy + n] = order == ORDER_TILED ? a : dtype == GT_Q4_K ? a - am : gt_hsum8_(acc);
        }
}

/* ---- AVX2 --------------------------------------------------------------------------------- */

#if defined(__x86_64__)
#define TK "avx2,fma,f16c"

/* Q4_K: the integer sums by maddubs (pairs of q4 * q8, at most 2 * 15 * 127) and madd with the
 * sub-block's scale, one int32 vector a super-block, summed at its end */
__attribute__((target(TK))) static void rows_q4k(float *y, int64_t ldy, const gt_act8k *x, int64_t ldx, int m,
                                                 int64_t M, int64_t m0, const uint8_t *w, int64_t row_bytes,
                                                 int64_t N, int64_t nb, int64_t n0, int64_t n1) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t n = n0; n < n1; n++)
        for (int r = 0; r < m; r++) {
            const gt_act8k *xr = x + r * ldx;
            float a = 0.0f, am = 0.0f;
            const int order = row_order(GT_Q4_K, N, M, m0 + r);
            const int per_pair = order == ORDER_PAIRS;  /* GEMM order: fma each pair of sub-blocks */
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + n * row_bytes + b * 144;
                _mm_prefetch((const char *)(wb + GT_QDOT_PREFETCH_ROWS * row_bytes), _MM_HINT_T0);
                _mm_prefetch((const char *)(wb + GT_QDOT_PREFETCH_ROWS * row_bytes + 64), _MM_HINT_T0);
                _mm_prefetch((const char *)(wb + GT_QDOT_PREFETCH_ROWS * row_bytes + 128), _MM_HINT_T0);
                const float dx = gt_half_at_f16c_(wb) * xr[b].d, mx = gt_half_at_f16c_(wb + 2) * xr[b].d;
                __m256i iacc = _mm256_setzero_si256();
                int32_t Im = 0;
                for (int c = 0; c < 4; c++) {
                    int sc0, mn0, sc1, mn1;
                    gt_k4_scale_min_(wb + 4, 2 * c, &sc0, &mn0);
                    gt_k4_scale_min_(wb + 4, 2 * c + 1, &sc1, &mn1);
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(wb + 16 + 32 * c));
                    const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xr[b].q + 64 * c));
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xr[b].q + 64 * c + 32));
                    iacc = _mm256_add_epi32(iacc, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0),
                                                                    _mm256_set1_epi16((short)sc0)));
                    iacc = _mm256_add_epi32(iacc, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1),
                                                                    _mm256_set1_epi16((short)sc1)));
                    Im += mn0 * (xr[b].bsums[4 * c] + xr[b].bsums[4 * c + 1]) +
                          mn1 * (xr[b].bsums[4 * c + 2] + xr[b].bsums[4 * c + 3]);
                    if (per_pair) {
                        a = fmaf((float)gt_hsum_i32_(iacc), dx, a);
                        am = fmaf((float)Im, mx, am);
                        iacc = _mm256_setzero_si256();
                        Im = 0;
                    }
                }
                if (order == ORDER_TILED) {
                    const float rr = fmaf(-gt_half_at_f16c_(wb + 2), (float)Im,
                                          (float)gt_hsum_i32_(iacc) * gt_half_at_f16c_(wb));
                    a = fmaf(rr, xr[b].d, a);
                } else if (!per_pair) {
                    a = fmaf((float)gt_hsum_i32_(iacc), dx, a);
                    am = fmaf((float)Im, mx, am);
                }
            }
            y[r * ldy + n] = order == ORDER_TILED ? a : a - am;
        }
}

/* Q6_K: each 32-byte vector of q6 values (two sub-blocks of 16) by maddubs (at most 2 * 63 * 127)
 * and madd with its two scales; the 32-times-bsums term by madd of the bsums and the scales */
__attribute__((target(TK))) static void rows_q6k(float *y, int64_t ldy, const gt_act8k *x, int64_t ldx, int m,
                                                 int64_t M, const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                 int64_t n0, int64_t n1) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    const int tiled = M >= 8;
    for (int64_t n = n0; n < n1; n++)
        for (int r = 0; r < m; r++) {
            const gt_act8k *xr = x + r * ldx;
            __m256 acc = _mm256_setzero_ps();
            float a = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + n * row_bytes + b * 210;
                for (int o = 0; o < 256; o += 64)
                    _mm_prefetch((const char *)(wb + GT_QDOT_PREFETCH_ROWS * row_bytes + o), _MM_HINT_T0);
                const int8_t *sc = (const int8_t *)(wb + 192);
                __m256i sumi = _mm256_setzero_si256();
                for (int j = 0; j < 2; j++) {
                    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(wb + 64 * j));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32));
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(wb + 128 + 32 * j));
                    __m256i q[4];
                    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
                    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m15),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
                    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
                    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
                    for (int v = 0; v < 4; v++) {
                        const int s = 8 * j + 2 * v;      /* the sub-blocks of bytes 0..15 and 16..31 */
                        const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xr[b].q + 128 * j + 32 * v));
                        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q[v], xv), scales));
                    }
                }
                const __m256i bs = _mm256_loadu_si256((const __m256i *)xr[b].bsums);
                const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
                sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
                if (tiled) {
                    a = fmaf((float)gt_hsum_i32_(sumi) * gt_half_at_f16c_(wb + 208), xr[b].d, a);
                    continue;
                }
                const float d = xr[b].d * gt_half_at_f16c_(wb + 208);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            }
            y[r * ldy + n] = tiled ? a : gt_hsum8_256_(acc);
        }
}
#endif /* __x86_64__ */

void gt_qdot8k_rows_(float *y, int64_t ldy, const gt_act8k *x, int64_t ldx, int m, int64_t M, int64_t m0,
                     const uint8_t *w, int64_t row_bytes, int32_t dtype, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const int64_t nb = K / 256;
#if defined(__x86_64__)
    if (gt_simd_level_() >= 1 && __builtin_cpu_supports("f16c")) {
        if (dtype == GT_Q4_K) rows_q4k(y, ldy, x, ldx, m, M, m0, w, row_bytes, N, nb, n0, n1);
        else rows_q6k(y, ldy, x, ldx, m, M, w, row_bytes, nb, n0, n1);
        return;
    }
#endif
    rows_plain(y, ldy, x, ldx, m, M, m0, w, row_bytes, dtype, N, nb, n0, n1);
}
