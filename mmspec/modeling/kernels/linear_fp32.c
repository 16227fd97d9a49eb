/* y[M, N] = x[M, K] W[N, K]^T (+ b[N]) for few rows M, fp32, AVX2 + FMA (and its 16-lane AVX-512
 * form further below).
 *
 * MKL / oneDNN take a GEMV path for M = 1 and a GEMM path for M >= 2 whose cost on a CPU barely
 * depends on M up to ~8 but is ~2x the GEMV's: a verification forward over a few draft tokens
 * then costs ~1.6x a one-token step. Here each 3-row block of W is loaded once (from memory or
 * L3 into L1) and used for every row of x while it is in L1, and a later block is prefetched
 * while this one computes (a model's weights come from DRAM: without the prefetch, fewer loads are
 * in flight as M grows and M = 4 cost 1.7x M = 1; few_rows.h). So a few rows cost about what
 * streaming the weight costs, until the FMAs take over (measured in docs/benchmarks.md): with 2-row
 * blocks (8 sums in flight, as many as two FMA units of latency 4 need) the captioner's 30 layers
 * and head took 17.1 / 26.7 ms for 1 / 7 rows on a Zen 5 core restricted to AVX2, with 3-row blocks
 * (12 sums) and the farther prefetch 15.2 / 18.8 ms.
 *
 * Every output is summed in the same order whatever M and the row's place (8-lane partial sums
 * over k in steps of 8, one horizontal sum, the scalar tail of K, then the bias): the result of a
 * row is bitwise the same alone or among others (batch invariance), so verifying n tokens gives
 * exactly the logits a one-token step would.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "few_rows.h"
#include "kernels.h"

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the scalar tail k in [k8, K) of one dot product, added after the vector part */
static inline float tail(const float *w, const float *x, int64_t k8, int64_t K, float sum) {
    for (int64_t k = k8; k < K; k++) sum += w[k] * x[k];
    return sum;
}

#define MB 4 /* rows of x per pass */
#define NB 3 /* rows of W per block: MB * NB accumulators + NB weights + 1 input = 16 AVX2 registers */

/* rows [m0, m0 + mb) of x (mb <= MB) against W rows [n0, n0 + nb) (nb <= NB); inlined with
 * constant mb and nb, so the accumulators stay in registers. While it computes, it prefetches the
 * floats [pf0, pf1) of the block that starts next_block floats after this one (each pass over this
 * block a share of it, so that memory is busy during every pass, not only the first) */
static inline __attribute__((always_inline)) void block(const float *x, const float *w, const float *b, float *y,
                                                        int64_t m0, const int mb, int64_t n0, const int nb,
                                                        int64_t N, int64_t K, int64_t next_block, int64_t pf0, int64_t pf1, int64_t lead) {
    const int64_t k8 = K & ~(int64_t)7;
    const char *pf = (const char *)(w + n0 * K + next_block + pf0); /* its share (W's rows are contiguous) */
    __m256 acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    const int64_t pf_bytes = (pf1 - pf0) * 4, per = lines_a_step(lead * pf_bytes, k8 / 8);
    int64_t ahead = 0;
    for (int64_t k = 0; k < k8; k += 8) {
        prefetch_lines(pf, pf_bytes, per, &ahead);
        __m256 wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm256_loadu_ps(w + (n0 + j) * K + k);
        for (int i = 0; i < mb; i++) {
            __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
            float s = tail(w + (n0 + j) * K, x + (m0 + i) * K, k8, K, hsum(acc[i][j]));
            y[(m0 + i) * N + n0 + j] = b ? s + b[n0 + j] : s;
        }
}

/* x [M, K], w [N, K], b [N] or NULL, y [M, N]: all contiguous fp32. threads: OpenMP threads. */
ROWS_AND_ENTRY(few_rows_linear, float, block, MB, NB, 2, 1, 1, )

/* ---- fp32 on AVX-512: the same blocking with 16-lane vectors ----
 *
 * The AVX2 kernel's FMAs bind from ~5 rows on (8 lanes, 16 registers); AVX-512 doubles the lanes and
 * the registers (4 x 4 accumulators). Each output is summed in one fixed order too (16-lane partial
 * sums over k in steps of 16, one horizontal sum, the scalar tail, the bias): batch-invariant. Its
 * sums differ in order from the AVX2 kernel's, so a machine uses one of the two for every call.
 * Compiled for AVX-512F whatever the build machine; called only where the CPU has it.
 */
#define ZF_MB 4
#define ZF_NB 4 /* 16 accumulators + 4 weights + 1 input of the 32 zmm registers */
#define AVX512_TARGET __attribute__((target("avx512f")))

static inline AVX512_TARGET __attribute__((always_inline)) void zf_block(
    const float *x, const float *w, const float *b, float *y, int64_t m0, const int mb, int64_t n0, const int nb,
    int64_t N, int64_t K, int64_t next_block, int64_t pf0, int64_t pf1, int64_t lead) {
    const int64_t k16 = K & ~(int64_t)15;
    const char *pf = (const char *)(w + n0 * K + next_block + pf0);
    __m512 acc[ZF_MB][ZF_NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t pf_bytes = (pf1 - pf0) * 4, per = lines_a_step(lead * pf_bytes, k16 / 16);
    int64_t ahead = 0;
    for (int64_t k = 0; k < k16; k += 16) { /* one 64-byte line of each weight row per step */
        prefetch_lines(pf, pf_bytes, per, &ahead);
        __m512 wv[ZF_NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm512_loadu_ps(w + (n0 + j) * K + k);
        for (int i = 0; i < mb; i++) {
            __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
            float s = tail(w + (n0 + j) * K, x + (m0 + i) * K, k16, K, _mm512_reduce_add_ps(acc[i][j]));
            y[(m0 + i) * N + n0 + j] = b ? s + b[n0 + j] : s;
        }
}

ROWS_AND_ENTRY(few_rows_linear_avx512, float, zf_block, ZF_MB, ZF_NB, 1, 0, 2, AVX512_TARGET)

/* ---- fp32 on AVX-512, the weight packed: outputs in the lanes ----
 *
 * The bf16 packed kernel's layout (linear_bf16.c) with one column a step: W packed
 * (:func:`mmspec.modeling.fast_linear.pack_fp32`) in groups of PK_NB blocks of 16 outputs, group
 * floats [K][nb][16] (zero-padded past N). A row's x_k is broadcast to every lane and one FMA adds
 * x_k w_k to the 16 outputs' sums: no horizontal sum, each group one stream, the passes over rows
 * and chunks few_rows.h's PACKED_ENTRY. Each output's sum is one FMA chain over k = 0 .. K - 1, then
 * the bias: batch-invariant, and other sums than the in-place kernels', so a weight keeps to one. */
static inline AVX512_TARGET __attribute__((always_inline)) void zp_step(__m512 acc[PK_MB][PK_NB], const float *x,
                                                                        const float *src, int64_t m0, const int mb,
                                                                        const int nb, int64_t K, int64_t k) {
    const float *column = src + k * nb * 16;
    __m512 wv[PK_NB];
    for (int j = 0; j < nb; j++) wv[j] = _mm512_loadu_ps(column + j * 16);
    for (int i = 0; i < mb; i++) {
        const __m512 xb = _mm512_set1_ps(x[(m0 + i) * K + k]);
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_fmadd_ps(wv[j], xb, acc[i][j]);
    }
}
static inline AVX512_TARGET __attribute__((always_inline)) void zp_store(__m512 acc[PK_MB][PK_NB], const float *b,
                                                                         float *y, int64_t m0, const int mb,
                                                                         int64_t blk0, const int nb, int64_t N) {
    for (int j = 0; j < nb; j++) {
        const int64_t n0 = (blk0 + j) * 16;
        const __mmask16 keep = pk_lanes(N, n0);
        const __m512 bias = b ? _mm512_maskz_loadu_ps(keep, b + n0) : _mm512_setzero_ps();
        for (int i = 0; i < mb; i++)
            _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, keep, b ? _mm512_add_ps(acc[i][j], bias) : acc[i][j]);
    }
}

#define zp_step_enter pk_mode_kept
#define zp_step_exit pk_mode_back
PACKED_ENTRY(few_rows_linear_avx512_packed, float, zp_step, zp_store, K, AVX512_TARGET)
