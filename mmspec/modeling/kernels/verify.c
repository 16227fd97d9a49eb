/* The acceptance rules' helpers over rows of logits and probabilities (registered by
 * mmspec.modeling.fast_linear with mmspec.core.verify, which falls back to PyTorch elsewhere): the
 * row argmax of greedy verification, and speculative sampling's accept-or-resample walk. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "few_rows.h"
#include "kernels.h"

/* ---- argmax over rows: out[r] = the first index of the largest of x[r, 0 .. V) (fp32 or bf16) ----
 *
 * What torch.max(dim=-1).indices gives, at ~memory speed (PyTorch's bf16 reduction over a [15,
 * 49152] verification took ~0.55 ms on one core): 16 lanes keep their strictly-greater maxima
 * (the first of ties within a lane), then the largest lane value with the smallest index among the
 * lanes holding it. A row holding a NaN gives its first NaN (PyTorch's max propagates NaN). */
ARGMAX_TARGET void rows_argmax(const void *x, int64_t rows, int64_t V, int bf16, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const void *row = bf16 ? (const void *)((const uint16_t *)x + r * V) : (const void *)((const float *)x + r * V);
        const int64_t V16 = V & ~(int64_t)15;
        __m512 best = _mm512_set1_ps(-__builtin_inff());
        __m512i where = _mm512_set1_epi32(-1), index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i sixteen = _mm512_set1_epi32(16);
        __mmask16 nan = 0;
        for (int64_t i = 0; i < V16; i += 16) {
            const __m512 v = load16(row, i, bf16);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, greater, v);
            where = _mm512_mask_mov_epi32(where, greater, index);
            index = _mm512_add_epi32(index, sixteen);
        }
        float lane_best[16];
        int32_t lane_where[16];
        _mm512_storeu_ps(lane_best, best);
        _mm512_storeu_si512(lane_where, where);
        float top = -__builtin_inff();
        int64_t at = 0;
        for (int l = 0; l < 16; l++) /* the largest lane maximum, the first index holding it */
            if (lane_where[l] >= 0 && (lane_best[l] > top || (lane_best[l] == top && lane_where[l] < at)))
                top = lane_best[l], at = lane_where[l];
        for (int64_t i = V16; i < V; i++) {
            const float v = value_at(row, i, bf16);
            if (v != v) nan = 1;
            else if (v > top) top = v, at = i;
        }
        if (nan) /* the first NaN */
            for (int64_t i = 0; i < V; i++) {
                const float v = value_at(row, i, bf16);
                if (v != v) {
                    at = i;
                    break;
                }
            }
        out[r] = at;
    }
}

/* ---- speculative sampling's rule over B rows (mmspec.core.verify.speculative_verify, bitwise) ----
 *
 * p [B, K + 1, V], q [B, K, V] (NULL: deterministic drafts, q = one-hot), tokens [B, K], r [B, K],
 * u [B] (fp32): accept x_i while r_i q_i(x_i) < p_i(x_i) (the product rounded to fp32); at the
 * first rejection n (or n = K) draw the next token from max(0, p_n - q_n) (p_n where that is all
 * zero; q_K = 0): the first index whose cumulative sum, in double and in order, exceeds u times the
 * total (the last index if none). The same floats in the same order as the PyTorch path, in one
 * call instead of ~30 tensor operations. Writes accepted [B] (n) and out [B, K + 1] (the accepted
 * drafts, the drawn token at n, `pad` after it). Returns 0, or -1 for a draft token outside [0, V). */
static inline float weighted_residual(float w, const float *pn, const float *qn, int64_t drafted, int64_t i) {
    const float d = w * pn[i] - (qn ? qn[i] : i == drafted ? 1.0f : 0.0f);
    return d > 0.0f ? d : 0.0f; /* max(0, w p - q), as clamp_(min=0); w = 1: max(0, p - q) exactly */
}

/* The next token from max(0, w pn - qn) (qn NULL: one-hot at `drafted`, or nothing where drafted < 0,
 * which leaves pn), or from pn where that is all zero: the first index whose cumulative sum, in double
 * and in order, exceeds u times the total (the last index if none), as sample_from_probs draws. */
static int64_t draw_token(const float *pn, const float *qn, int64_t drafted, float w, float u, int64_t V) {
    int empty = 1;
    for (int64_t i = 0; i < V && empty; i++) empty = !(weighted_residual(w, pn, qn, drafted, i) > 0.0f);
    double total = 0.0, cdf = 0.0;
    for (int64_t i = 0; i < V; i++) total += empty ? (double)pn[i] : (double)weighted_residual(w, pn, qn, drafted, i);
    const double threshold = (double)u * total;
    for (int64_t i = 0; i < V; i++) {
        cdf += empty ? (double)pn[i] : (double)weighted_residual(w, pn, qn, drafted, i);
        if (cdf > threshold) return i;
    }
    return V - 1;
}

int speculative_rows(const float *p, const float *q, const int64_t *tokens, const float *r, const float *u, int64_t B,
                     int64_t K, int64_t V, int64_t pad, int64_t *accepted, int64_t *out) {
    for (int64_t b = 0; b < B; b++) {
        int64_t n = 0;
        for (; n < K; n++) {
            const int64_t x = tokens[b * K + n];
            if (x < 0 || x >= V) return -1;
            const float qx = q ? q[(b * K + n) * V + x] : 1.0f, product = r[b * K + n] * qx;
            if (!(product < p[(b * (K + 1) + n) * V + x])) break;
        }
        const float *pn = p + (b * (K + 1) + n) * V, *qn = n < K && q ? q + (b * K + n) * V : NULL;
        const int64_t drafted = n < K && !q ? tokens[b * K + n] : -1; /* the one-hot draft's token */
        const int64_t at = draw_token(pn, qn, drafted, 1.0f, u[b], V);
        accepted[b] = n;
        for (int64_t i = 0; i <= K; i++) out[b * (K + 1) + i] = i < n ? tokens[b * K + i] : i == n ? at : pad;
    }
    return 0;
}

/* ---- coupled SJD's redraft over m rows (mmspec.drafters.jacobi.coupled_redraft, bitwise) ----
 *
 * p [m, V] the new distributions, q [kept, V] the old ones, old [kept] the codes drawn from them,
 * u [m, 2] (fp32). Row j < kept keeps old[j] when u[j, 0] q_j(x) < p_j(x) (the product rounded to
 * fp32), else draws from max(0, p_j - q_j) (p_j where that is all zero) with u[j, 1], as
 * speculative_rows draws; a row j >= kept (a position the window had not reached) draws from p_j
 * with u[j, 1]. The same floats in the same order as the PyTorch path (~20 tensor operations).
 * Writes out [m]. Returns 0, or -1 for an old code outside [0, V). */
int coupled_rows(const float *p, const float *q, const int64_t *old, const float *u, int64_t m, int64_t kept, int64_t V,
                 int64_t *out) {
    for (int64_t j = 0; j < m; j++) {
        const float *pj = p + j * V;
        if (j < kept) {
            const int64_t x = old[j];
            if (x < 0 || x >= V) return -1;
            const float product = u[2 * j] * q[j * V + x];
            if (product < pj[x]) {
                out[j] = x;
                continue;
            }
        }
        out[j] = draw_token(pj, j < kept ? q + j * V : NULL, -1, 1.0f, u[2 * j + 1], V);
    }
    return 0;
}

/* ---- block verification over B rows (mmspec.core.verify.block_verify, bitwise) ----
 *
 * Arguments as speculative_rows'. Per row: w_0 = 1, w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)) in
 * fp32; S_i = the sum, in double and in order, of max(0, w_i p_{i+1}(x) - q_{i+1}(x)) (fp32 terms);
 * h_i = S_i / ((S_i + 1) - w_i) (1 where that is not positive), h_K = w_K; tau = the largest i with
 * r_i < h_i (r_1 .. r_K), else 0. The next token: drawn as in speculative_rows from p_{K+1} when
 * tau = K, else from max(0, w_tau p_{tau+1} - q_{tau+1}) (p_{tau+1} where that is all zero).
 * Returns 0, or -1 for a draft token outside [0, V). */
int block_rows(const float *p, const float *q, const int64_t *tokens, const float *r, const float *u, int64_t B, int64_t K,
               int64_t V, int64_t pad, int64_t *accepted, int64_t *out) {
    float w[K + 1];
    for (int64_t b = 0; b < B; b++) {
        w[0] = 1.0f;
        for (int64_t i = 0; i < K; i++) {
            const int64_t x = tokens[b * K + i];
            if (x < 0 || x >= V) return -1;
            const float qx = q ? q[(b * K + i) * V + x] : 1.0f, ratio = p[(b * (K + 1) + i) * V + x] / qx, next = w[i] * ratio;
            w[i + 1] = next > 1.0f ? 1.0f : next; /* as clamp(max=1): a NaN stays NaN */
        }
        int64_t n = K > 0 && (double)r[b * K + K - 1] < (double)w[K] ? K : 0; /* (K = 0: plain decoding) */
        for (int64_t i = K - 1; i >= 1 && n == 0; i--) { /* h_i for i < K, from the end */
            const float *pn = p + (b * (K + 1) + i) * V, *qn = q ? q + (b * K + i) * V : NULL;
            const int64_t drafted = q ? -1 : tokens[b * K + i];
            double mass = 0.0;
            for (int64_t v = 0; v < V; v++) mass += (double)weighted_residual(w[i], pn, qn, drafted, v);
            const double denominator = (mass + 1.0) - (double)w[i];
            const double keep = denominator > 0 ? mass / (denominator > 1e-300 ? denominator : 1e-300) : 1.0;
            if ((double)r[b * K + i - 1] < keep) n = i;
        }
        const float *pn = p + (b * (K + 1) + n) * V, *qn = n < K && q ? q + (b * K + n) * V : NULL;
        const int64_t drafted = n < K && !q ? tokens[b * K + n] : -1;
        const int64_t at = draw_token(pn, qn, drafted, n < K ? w[n] : 1.0f, u[b], V);
        accepted[b] = n;
        for (int64_t i = 0; i <= K; i++) out[b * (K + 1) + i] = i < n ? tokens[b * K + i] : i == n ? at : pad;
    }
    return 0;
}
