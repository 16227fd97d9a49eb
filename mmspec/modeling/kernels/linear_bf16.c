/* y[M, N] = x[M, K] W[N, K]^T (+ b[N]) for few rows M in bf16: AVX512-BF16 vectors, or AMX-BF16
 * tiles (the weight read in place or packed). The blocking and its batch invariance are the fp32
 * kernels' (linear_fp32.c); each kernel's own order of sums is told where it is defined. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16.h"
#include "few_rows.h"
#include "kernels.h"

/* ---- bf16: the same blocking on AVX512-BF16 (vdpbf16ps: pairs of bf16 products summed in fp32) ----
 *
 * x [M, K], w [N, K], b [N] or NULL, y [M, N]: contiguous bf16 (uint16_t bit patterns); sums in fp32
 * in one fixed order per output (32-lane pair sums over k in steps of 32, one horizontal sum, the
 * scalar tail of K, the bias), then rounded to nearest-even bf16: batch-invariant like the fp32
 * kernel. Compiled for AVX512-BF16 whatever the build machine; called only where the CPU has it.
 */
#define BF_MB 4
#define BF_NB 4 /* 16 accumulators + 4 weights + 1 input of the 32 zmm registers */
#define BF16_TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))


static inline BF16_TARGET __attribute__((always_inline)) void bf_block(
    const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t m0, const int mb, int64_t n0,
    const int nb, int64_t N, int64_t K, int64_t next_block, int64_t pf0, int64_t pf1, int64_t lead) {
    const int64_t k32 = K & ~(int64_t)31;
    const char *pf = (const char *)(w + n0 * K + next_block + pf0); /* the share of the block prefetched */
    __m512 acc[BF_MB][BF_NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t pf_bytes = (pf1 - pf0) * 2, per = lines_a_step(lead * pf_bytes, k32 / 32);
    int64_t ahead = 0;
    for (int64_t k = 0; k < k32; k += 32) { /* one 64-byte line of each row per step */
        prefetch_lines(pf, pf_bytes, per, &ahead);
        __m512bh wv[BF_NB];
        for (int j = 0; j < nb; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + (n0 + j) * K + k));
        for (int i = 0; i < mb; i++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + i) * K + k));
            for (int j = 0; j < nb; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
            float s = _mm512_reduce_add_ps(acc[i][j]);
            for (int64_t k = k32; k < K; k++) s += bf16_to_float(w[(n0 + j) * K + k]) * bf16_to_float(x[(m0 + i) * K + k]);
            if (b) s += bf16_to_float(b[n0 + j]);
            y[(m0 + i) * N + n0 + j] = float_to_bf16(s);
        }
}

/* The passes of two or three rows (and the outputs short of a block of four) through bf_block in
 * functions of their own: inlined into the entry with the rest, GCC's registers for them reloaded
 * the weights for every row (three rows cost more than four, seven more than eight: 38 / 28 us for
 * a 1536 x 576 weight in cache on a Zen 5 core); apart, 28 / 28 us. The passes of four rows and of
 * one stay inlined (apart, they measured 2-5 % slower from memory). The arithmetic is bf_block's
 * whatever the shape: the same bits. */
#define BF_SHAPE(MB, NB)                                                                                               \
    static BF16_TARGET __attribute__((noinline)) void bf_block_##MB##x##NB(                                            \
        const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t m0, int64_t n0, int64_t N,       \
        int64_t K, int64_t next_block, int64_t pf0, int64_t pf1, int64_t lead) {                                       \
        bf_block(x, w, b, y, m0, MB, n0, NB, N, K, next_block, pf0, pf1, lead);                                        \
    }
BF_SHAPE(2, 4) BF_SHAPE(3, 4) BF_SHAPE(1, 1) BF_SHAPE(2, 1) BF_SHAPE(3, 1) BF_SHAPE(4, 1)

static inline BF16_TARGET __attribute__((always_inline)) void bf_shaped(
    const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t m0, const int mb, int64_t n0,
    const int nb, int64_t N, int64_t K, int64_t next_block, int64_t pf0, int64_t pf1, int64_t lead) {
#define BF_CASE(MB, NB) if (mb == MB && nb == NB) { bf_block_##MB##x##NB(x, w, b, y, m0, n0, N, K, next_block, pf0, pf1, lead); return; }
    BF_CASE(3, 4) BF_CASE(2, 4) BF_CASE(4, 1) BF_CASE(3, 1) BF_CASE(2, 1) BF_CASE(1, 1)
#undef BF_CASE
    bf_block(x, w, b, y, m0, mb, n0, nb, N, K, next_block, pf0, pf1, lead); /* four rows or one, four outputs */
}

ROWS_AND_ENTRY(few_rows_linear_bf16, uint16_t, bf_shaped, BF_MB, BF_NB, 2, 0, 4, BF16_TARGET)

/* ---- bf16 on AVX512-BF16, the weight packed: outputs in the lanes ----
 *
 * The kernel above keeps k in the lanes: each output ends in a horizontal sum, and with the short K
 * of a small model (256 on the embedded voice: 8 steps of 32) those sums, not the products, bound
 * it. Here W is packed (:func:`mmspec.modeling.fast_linear.pack_bf16`) in groups of PK_NB blocks of
 * 16 outputs (the last group maybe fewer), K2 = ceil(K / 2) pairs of columns: group g's bytes are
 * [K2][nb][16][2], for each pair (2k, 2k + 1) one 64-byte vector per block holding the pair for its 16
 * outputs (zero-padded past N and K), the group's blocks side by side. A row's pair (x_2k, x_2k+1) is
 * broadcast to every lane and vdpbf16ps adds both products to the 16 outputs' fp32 sums: no
 * horizontal sum, and a group is one sequential stream (until stop 65 each block was a stream of
 * its own, four at once, which kept DRAM behind: the captioner's linears streamed from DRAM on a
 * Zen 5 core, one row 8.6 -> 7.5 ms, and the in-place kernel above 7.9 ms).
 *
 * Its passes over the rows and chunks of the stream: few_rows.h's PACKED_ENTRY. Each output's sum
 * runs over the pairs in order 0 .. K2 - 1, then the bias, rounded to nearest-even bf16 once: the
 * same bits for a row alone or among others (batch-invariant), but not the bits of the kernel
 * above, so a weight keeps to one of the two (its FewRowLinear packs it or not). On a Zen 5 core
 * the embedded voice's 42 projections took 90 / 104 / 226 us for 1 / 4 / 11 rows against 169 /
 * 260 / 623 us above (weights in L3); the captioner's linears from DRAM 7.5 / 8.1 ms for 1 / 8
 * rows against 7.9 / 10.6 ms. */

/* PACKED_ENTRY's step and store (few_rows.h): a step a pair of columns, each row's pair broadcast;
 * the sums rounded to bf16 */
static inline BF16_TARGET __attribute__((always_inline)) void pk_step(__m512 acc[PK_MB][PK_NB], const uint16_t *x,
                                                                      const uint16_t *src, int64_t m0, const int mb,
                                                                      const int nb, int64_t K, int64_t kp) {
    const uint16_t *pair_w = src + kp * nb * 32;
    __m512bh wv[PK_NB];
    for (int j = 0; j < nb; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(pair_w + j * 32));
    for (int i = 0; i < mb; i++) {
        const uint16_t *row = x + (m0 + i) * K + 2 * kp;
        int32_t pair = row[0]; /* K odd, the last pair: (x_K-1, 0) */
        if (kp < K / 2) memcpy(&pair, row, sizeof pair);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xb);
    }
}
static inline BF16_TARGET __attribute__((always_inline)) void pk_store(__m512 acc[PK_MB][PK_NB], const uint16_t *b,
                                                                       uint16_t *y, int64_t m0, const int mb,
                                                                       int64_t blk0, const int nb, int64_t N) {
    for (int j = 0; j < nb; j++) {
        const int64_t n0 = (blk0 + j) * 16;
        const __mmask16 keep = pk_lanes(N, n0);
        const __m512 bias = b ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, (const void *)(b + n0))), 16))
                              : _mm512_setzero_ps();
        for (int i = 0; i < mb; i++) {
            const __m512 s = b ? _mm512_add_ps(acc[i][j], bias) : acc[i][j];
            _mm256_mask_storeu_epi16((void *)(y + (m0 + i) * N + n0), keep, (__m256i)_mm512_cvtneps_pbh(s));
        }
    }
}

#define pk_step_enter pk_mode_kept
#define pk_step_exit pk_mode_back
PACKED_ENTRY(bf16_packed_vdp, uint16_t, pk_step, pk_store, (K + 1) / 2, BF16_TARGET)

/* ---- the same sums through fused multiply-adds (Intel cores without AMX tiles) ----
 *
 * vdpbf16ps adds its two products to a lane's sum as two fp32 fused multiply-adds, the odd element's
 * first, with denormal inputs read as zero, denormal results flushed to zero and round-to-nearest-even
 * (Intel SDM, VDPBF16PS: "FP32 FMA with daz in, ftz out and RNE rounding"; a bf16 product is exact in
 * fp32). Here the same two FMAs per pair run as vfmadd231ps on the pair's two halves widened to fp32
 * (a shift and a mask), with MXCSR's DAZ and FTZ set around the steps: the same bits as the vdpbf16ps
 * kernel. An Intel core retires vdpbf16ps (32 products) about as often as one vfmadd231ps (16): an
 * AMX Xeon run without its tiles, 1.9 G/s against 7.1 G/s, so there the embedded voice's 42
 * projections took 320 / 358 / 395 / 500 us for 1 / 5 / 6 / 8 rows against 316 / 454 / 544 / 758 us
 * (weights in L3). The rows are widened to fp32 once per call ([M][2 ceil(K / 2)], the last pair
 * (x_K-1, 0)). Each pass sets DAZ / FTZ in its thread's MXCSR for its steps and puts the mode back
 * before the bias and the rounding (PK_SHAPE's STEP_enter / STEP_exit). Used (in slabs of PK_SLAB rows) where
 * few_rows_bf16_fma(1) was asked for (mmspec.modeling.fast_linear.load_kernel: on Intel CPUs). */
#define FMA_TARGET __attribute__((target("avx512f")))
#define CSR_DAZ_FTZ 0x8040u
static int bf16_fma = 0;
void few_rows_bf16_fma(int on) { bf16_fma = on; }

static inline FMA_TARGET __attribute__((always_inline)) void pk_step_fma(__m512 acc[PK_MB][PK_NB], const uint16_t *x,
                                                                         const uint16_t *src, int64_t m0, const int mb,
                                                                         const int nb, int64_t K, int64_t kp) {
    const uint16_t *pair_w = src + kp * nb * 32;
    const float *rows = (const float *)(const void *)x; /* the widened rows (the entry below) */
    const int64_t stride = 2 * ((K + 1) / 2);
    for (int j = 0; j < nb; j++) {
        const __m512i w = _mm512_loadu_si512((const void *)(pair_w + j * 32));
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
        for (int i = 0; i < mb; i++) {
            const float *pair = rows + (m0 + i) * stride + 2 * kp;
            acc[i][j] = _mm512_fmadd_ps(odd, _mm512_set1_ps(pair[1]), acc[i][j]);
            acc[i][j] = _mm512_fmadd_ps(even, _mm512_set1_ps(pair[0]), acc[i][j]);
        }
    }
}
/* the steps under DAZ and FTZ, in each thread's own MXCSR (the bias and the rounding after them in
 * the caller's mode, as in the vdpbf16ps kernel) */
static inline unsigned int pk_step_fma_enter(void) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | CSR_DAZ_FTZ);
    return csr;
}
static inline void pk_step_fma_exit(unsigned int csr) { _mm_setcsr(csr); }
PACKED_ENTRY(bf16_packed_fma, uint16_t, pk_step_fma, pk_store, (K + 1) / 2, BF16_TARGET)

BF16_TARGET void few_rows_linear_bf16_packed(const uint16_t *x, const uint16_t *p, const uint16_t *b, uint16_t *y,
                                             int64_t M, int64_t N, int64_t K, int threads) {
    if (bf16_fma && M > PK_SLAB) { /* slabs of PK_SLAB rows, each widened alone (as bf16_packed_vdp's slabs) */
        for (int64_t r = 0; r < M; r += PK_SLAB)
            few_rows_linear_bf16_packed(x + r * K, p, b, y + r * N, M - r < PK_SLAB ? M - r : PK_SLAB, N, K, threads);
        return;
    }
    const int64_t stride = 2 * ((K + 1) / 2);
    float *rows = (bf16_fma && M > 0) ? malloc(M * stride * sizeof(float)) : NULL;
    if (rows == NULL) {
        bf16_packed_vdp(x, p, b, y, M, N, K, threads);
        return;
    }
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) rows[m * stride + k] = bf16_to_float(x[m * K + k]);
        if (K < stride) rows[m * stride + K] = 0.0f;
    }
    bf16_packed_fma((const uint16_t *)(const void *)rows, p, b, y, M, N, K, threads);
    free(rows);
}

/* ---- bf16 on AMX: W's 16-output blocks as tiles against the rows of x ----
 *
 * On a CPU with AMX-BF16 one tile instruction (tdpbf16ps) multiplies a 16 x 32 bf16 tile by a
 * 32 x 16 one into 16 x 16 fp32 sums. Reading W in place (few_rows_linear_amx; packed weights take
 * the kernel further below, with the operands' roles swapped), the weight is the left operand, loaded straight from its
 * rows (tile A: 16 outputs x 32 k, stride K), and x the right one (tile B: 16 k-pairs x M rows, x
 * repacked once per call into that pair layout), so C = W_blk x^T holds 16 outputs for up to 16
 * rows and the weight is read once for all of them: up to 16 rows cost what one costs while the
 * weight streams from memory, and the arithmetic of 18-36 rows of a cache-resident model is ~16x
 * the vector kernel's. Each output is summed in one fixed order whatever M (k in chunks of 32 in
 * the tile unit, then the scalar tail of K, then the bias), then rounded to nearest-even bf16: a
 * row's result is bitwise the same alone or among others. The order differs from the AVX512-BF16
 * kernel's, so a machine uses one of the two for every call. Rows go in passes of 32 (two tiles of
 * 16); rows beyond 32 take another pass over the same weight block (then in L2). A block of fewer
 * than 16 outputs at the end of W takes the AVX512-BF16 block (fixed per output too). Linux grants a process the tile state on request
 * (arch_prctl ARCH_REQ_XCOMP_PERM): few_rows_amx_init() asks and returns 0 where granted.
 */
#if !MMSPEC_HAVE_AMX /* no AMX intrinsics: the entry says so */
int few_rows_amx_init(void) { return -1; }
int few_rows_linear_amx(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                        int64_t K, int threads) {
    (void)x, (void)w, (void)b, (void)y, (void)M, (void)N, (void)K, (void)threads;
    return -2; /* never called: few_rows_amx_init() said no */
}
int few_rows_linear_amx_packed(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                               int64_t K, int threads) {
    return few_rows_linear_amx(x, w, b, y, M, N, K, threads);
}
#else
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw,avx512vl")))
#define PACKED_AHEAD 4096 /* bytes: 2, 4 and 8 KB measured alike */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int few_rows_amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

/* Rows go in passes of up to 32, two groups of up to 16 (g = 0, 1). tmm0 + g, tmm2 + g: C of group g
 * for the even and the odd k chunks (16 outputs x mc_g rows, fp32); tmm4, tmm5: A of the even and
 * odd chunk (16 outputs x 32 k); tmm6 + g: B of group g (16 k-pairs x mc_g rows). Each output of
 * every row: (even-chunk sum + odd-chunk sum), whatever the group and the pass: batch-invariant. */
static AMX_TARGET void amx_configure(int mc0, int mc1) {
    tile_config cfg = {0};
    cfg.palette = 1;
    const int mc[2] = {mc0, mc1};
    for (int g = 0; g < 2; g++)
        if (mc[g]) {
            cfg.rows[g] = cfg.rows[2 + g] = cfg.rows[6 + g] = 16;
            cfg.colsb[g] = cfg.colsb[2 + g] = cfg.colsb[6 + g] = (uint16_t)(mc[g] * 4);
        }
    cfg.rows[4] = cfg.rows[5] = 16, cfg.colsb[4] = cfg.colsb[5] = 64;
    _tile_loadconfig(&cfg);
}

/* C of one group (even + odd sums, the scalar tail of K, the bias) -> y rows [m0, m0 + mc), outputs
 * [n0, n0 + 16): column m of the stored tiles is row m's 16 outputs, gathered and rounded at once */
static inline AMX_TARGET __attribute__((always_inline)) void amx_store(
    float c[2][16][16], const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t m0, int mc,
    int64_t n0, int64_t N, int64_t K) {
    const int64_t k32 = K / 32 * 32;
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    __m512 bias = _mm512_setzero_ps();
    if (b) bias = load_bf16x16(b + n0);
    for (int m = 0; m < mc; m++) {
        __m512 s = _mm512_add_ps(_mm512_i32gather_ps(column, &c[0][0][m], 4), _mm512_i32gather_ps(column, &c[1][0][m], 4));
        if (k32 < K) {
            float t[16];
            _mm512_storeu_ps(t, s);
            for (int i = 0; i < 16; i++)
                for (int64_t k = k32; k < K; k++) t[i] += bf16_to_float(w[(n0 + i) * K + k]) * bf16_to_float(x[(m0 + m) * K + k]);
            s = _mm512_loadu_ps(t);
        }
        if (b) s = _mm512_add_ps(s, bias);
        _mm256_storeu_si256((__m256i *)(y + (m0 + m) * N + n0), (__m256i)_mm512_cvtneps_pbh(s));
    }
}

/* amx_store for a group of at least AMX_TRANSPOSE_ROWS rows and a K of whole 32-chunks (no scalar
 * tail): the even and odd sums added as the stored tiles lie (16 outputs x 16 columns), that block
 * transposed in registers (unpack, then 128-bit lane shuffles: 64 shuffles for the 16 x 16 block,
 * where gathers take 2 x 16 loads per row), then per row the bias and the rounding. The same two
 * additions per output in the same order: bitwise amx_store's. Fewer rows keep the gathers, which
 * then cost less than the whole block's transpose. */
#define AMX_TRANSPOSE_ROWS 8
static inline AMX_TARGET __attribute__((always_inline)) void amx_store_whole(
    float c[2][16][16], const uint16_t *b, uint16_t *y, int64_t m0, int mc, int64_t n0, int64_t N) {
    __m512 r[16], a[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_add_ps(_mm512_load_ps(c[0][i]), _mm512_load_ps(c[1][i]));
    for (int i = 0; i < 16; i += 2) /* a[i]: per 128-bit lane l, rows i, i+1 at columns 4l, 4l+1; a[i+1]: 4l+2, 4l+3 */
        a[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), a[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int g = 0; g < 16; g += 4) { /* r[g + j]: per lane l, rows g .. g+3 at column 4l + j */
        const __m512d e0 = _mm512_castps_pd(a[g]), e1 = _mm512_castps_pd(a[g + 1]);
        const __m512d e2 = _mm512_castps_pd(a[g + 2]), e3 = _mm512_castps_pd(a[g + 3]);
        r[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(e0, e2)), r[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(e0, e2));
        r[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(e1, e3)), r[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(e1, e3));
    }
    __m512 bias = _mm512_setzero_ps();
    if (b) bias = load_bf16x16(b + n0);
    for (int j = 0; j < 4; j++) { /* the 4 x 4 transpose of 128-bit lanes among r[j], r[4+j], r[8+j], r[12+j]: columns 4l + j */
        const __m512 c0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44), c1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
        const __m512 c2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44), c3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
        const __m512 t[4] = {_mm512_shuffle_f32x4(c0, c2, 0x88), _mm512_shuffle_f32x4(c0, c2, 0xDD),
                             _mm512_shuffle_f32x4(c1, c3, 0x88), _mm512_shuffle_f32x4(c1, c3, 0xDD)};
        for (int l = 0; l < 4; l++) {
            const int m = 4 * l + j;
            if (m < mc)
                _mm256_storeu_si256((__m256i *)(y + (m0 + m) * N + n0),
                                    (__m256i)_mm512_cvtneps_pbh(b ? _mm512_add_ps(t[l], bias) : t[l]));
        }
    }
}

/* C of group 0 (tmm0, tmm2: the even and odd chunks' sums) and, for two groups, of group 1 (tmm1, tmm3)
 * set to zero: the same tiles in both kernels */
static inline AMX_TARGET __attribute__((always_inline)) void amx_zero_sums(int two_groups) {
    _tile_zero(0);
    _tile_zero(2);
    if (two_groups) {
        _tile_zero(1);
        _tile_zero(3);
    }
}

/* one k chunk of group G with A in tile TA: B of the chunk into TB, then the product into TC (tile
 * numbers are literals: the intrinsics name the registers) */
#define AMX_CHUNK(G, TB, TA, TC, kc)                                   \
    do {                                                               \
        _tile_loadd(TB, xp[G] + (kc) * 16 * mc[G] * 2, mc[G] * 4);     \
        _tile_dpbf16ps(TC, TA, TB);                                    \
    } while (0)

/* one pass's rows (group 0: mc[0] <= 16 rows at xp[0], group 1: mc[1] <= 16 at xp[1], maybe 0)
 * against outputs [n0, n0 + 16). While it computes, it prefetches the next block's weight (one line
 * of each of its 16 rows per chunk). */
static inline AMX_TARGET __attribute__((always_inline)) void amx_block(
    const uint16_t *x, const uint16_t *const xp[2], const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t m0,
    const int mc[2], int64_t n0, int64_t N, int64_t K, int prefetch) {
    const int64_t chunks = K / 32;
    /* the block's chunk kc: rows n0 .. n0 + 15 at columns kc * 32 .. (stride K) */
    const uint16_t *blk = w + n0 * K, *next = w + (n0 + 16) * K;
    float c[2][2][16][16] __attribute__((aligned(64)));
    amx_zero_sums(mc[1] > 0);
    for (int64_t kc = 0; kc < chunks; kc += 2) {
        const int odd = kc + 1 < chunks;
        if (prefetch)
            for (int i = 0; i < 16; i++) {
                _mm_prefetch((const char *)(next + i * K + kc * 32), _MM_HINT_T0);
                if (odd) _mm_prefetch((const char *)(next + i * K + kc * 32 + 32), _MM_HINT_T0);
            }
        _tile_loadd(4, blk + kc * 32, K * 2);
        if (odd) _tile_loadd(5, blk + kc * 32 + 32, K * 2);
        AMX_CHUNK(0, 6, 4, 0, kc);
        if (mc[1]) AMX_CHUNK(1, 7, 4, 1, kc);
        if (odd) {
            AMX_CHUNK(0, 6, 5, 2, kc + 1);
            if (mc[1]) AMX_CHUNK(1, 7, 5, 3, kc + 1);
        }
    }
    const int whole = K % 32 == 0;
    _tile_stored(0, c[0][0], 64);
    _tile_stored(2, c[0][1], 64);
    if (whole && mc[0] >= AMX_TRANSPOSE_ROWS) amx_store_whole(c[0], b, y, m0, mc[0], n0, N);
    else amx_store(c[0], x, w, b, y, m0, mc[0], n0, N, K);
    if (mc[1]) {
        _tile_stored(1, c[1][0], 64);
        _tile_stored(3, c[1][1], 64);
        if (whole && mc[1] >= AMX_TRANSPOSE_ROWS) amx_store_whole(c[1], b, y, m0 + 16, mc[1], n0, N);
        else amx_store(c[1], x, w, b, y, m0 + 16, mc[1], n0, N, K);
    }
}

/* The calling thread's scratch for the repacked rows, grown as needed and kept (no allocation per
 * call); NULL where it cannot grow. */
static uint16_t *amx_scratch(size_t count) {
    static __thread uint16_t *buffer = NULL;
    static __thread size_t capacity = 0;
    if (count > capacity) {
        uint16_t *grown = realloc(buffer, count * sizeof(uint16_t));
        if (!grown) return NULL;
        buffer = grown, capacity = count;
    }
    return buffer;
}

/* ---- the same products from W packed for the tiles, the rows of x the tile rows ----
 *
 * Packed (mmspec.modeling.fast_linear.pack_amx), W is laid out as the right operand of the tile
 * product: wp[N / 16][K / 32][16][16][2], the chunk kc of the 16-output block n0 one contiguous
 * 1 KB tile whose row r holds, for each output n, the pair W[n0 + n, kc * 32 + 2r .. 2r + 1]. The
 * rows of x are then the left operand, read in place (16 rows x 32 k, stride K): C = x_grp W_blk^T
 * holds each row's 16 outputs as y lays them out, so there is no repacking of x and no transpose
 * of C, and a product over mc rows costs the tile unit mc tile rows (one row: a sixteenth of the
 * unpacked kernel's, whose left operand is always 16 outputs). The weight is one sequential
 * stream, prefetched PACKED_AHEAD bytes ahead. Each output is summed as the unpacked kernel sums
 * it (the even chunks' sum plus the odd chunks' sum, then the bias; a tile product adds each pair
 * x_2k w_2k + x_2k+1 w_2k+1 in the order of k whichever operand is which), so the results are
 * bitwise the unpacked kernel's (tests/test_fused.py), whatever M. Measured (docs/benchmarks.md):
 * a 1536 x 576 weight from memory, one core, 1 / 16 / 32 / 34 rows 213 / 216 / 269 / 318 us
 * unpacked-style, 147 / 169 / 221 / 256 us here.
 *
 * Tiles: tmm0 + g, tmm2 + g: C of group g (up to 16 rows) for the even and the odd chunks; tmm4 +
 * g: the group's rows of the chunk (A); tmm6, tmm7: W's even and odd chunk (B). */
static AMX_TARGET void amx_configure_rows(int mc0, int mc1) {
    tile_config cfg = {0};
    cfg.palette = 1;
    const int mc[2] = {mc0, mc1};
    for (int g = 0; g < 2; g++)
        if (mc[g]) {
            cfg.rows[g] = cfg.rows[2 + g] = cfg.rows[4 + g] = (uint8_t)mc[g];
            cfg.colsb[g] = cfg.colsb[2 + g] = cfg.colsb[4 + g] = 64;
        }
    cfg.rows[6] = cfg.rows[7] = 16, cfg.colsb[6] = cfg.colsb[7] = 64;
    _tile_loadconfig(&cfg);
}

/* a group's stored C (even, odd: [mc][16] fp32) -> y rows [m0, m0 + mc), outputs [n0, n0 + 16) */
static inline AMX_TARGET __attribute__((always_inline)) void amx_store_rows(
    const float *even, const float *odd, const uint16_t *b, uint16_t *y, int64_t m0, int mc, int64_t n0, int64_t N) {
    const __m512 bias = b ? load_bf16x16(b + n0) : _mm512_setzero_ps();
    for (int m = 0; m < mc; m++) {
        __m512 s = _mm512_add_ps(_mm512_load_ps(even + 16 * m), _mm512_load_ps(odd + 16 * m));
        if (b) s = _mm512_add_ps(s, bias);
        _mm256_storeu_si256((__m256i *)(y + (m0 + m) * N + n0), (__m256i)_mm512_cvtneps_pbh(s));
    }
}

/* rows [m0, m0 + mc[0] + mc[1]) (two groups, the second maybe empty) against the packed block at
 * wb (outputs [n0, n0 + 16)); the weight prefetched on the first pass over it */
static inline AMX_TARGET __attribute__((always_inline)) void amx_block_packed(
    const uint16_t *x, const uint16_t *wb, const uint16_t *b, uint16_t *y, int64_t m0, const int mc[2], int64_t n0,
    int64_t N, int64_t K, int prefetch) {
    const int64_t chunks = K / 32, stride = K * 2;
    const uint16_t *x0 = x + m0 * K, *x1 = x + (m0 + 16) * K;
    float c[4][16][16] __attribute__((aligned(64)));
    amx_zero_sums(mc[1] > 0);
    for (int64_t kc = 0; kc < chunks; kc += 2) {
        const int odd = kc + 1 < chunks;
        if (prefetch) /* 2 KB (two chunks) PACKED_AHEAD bytes on; never faults */
            for (int i = 0; i < 32; i++) _mm_prefetch((const char *)(wb + kc * 512) + PACKED_AHEAD + 64 * i, _MM_HINT_T0);
        _tile_loadd(6, wb + kc * 512, 64);
        if (odd) _tile_loadd(7, wb + kc * 512 + 512, 64);
        _tile_loadd(4, x0 + kc * 32, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (mc[1]) {
            _tile_loadd(5, x1 + kc * 32, stride);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (odd) {
            _tile_loadd(4, x0 + kc * 32 + 32, stride);
            _tile_dpbf16ps(2, 4, 7);
            if (mc[1]) {
                _tile_loadd(5, x1 + kc * 32 + 32, stride);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    amx_store_rows(c[0][0], c[2][0], b, y, m0, mc[0], n0, N);
    if (mc[1]) {
        _tile_stored(1, c[1], 64);
        _tile_stored(3, c[3], 64);
        amx_store_rows(c[1][0], c[3][0], b, y, m0 + 16, mc[1], n0, N);
    }
}

/* rows [m0, m0 + 32) of M as the two groups of a pass (up to 16 rows each, the second maybe empty) */
static inline void amx_pass_rows(int64_t M, int64_t m0, int mc[2]) {
    mc[0] = (int)(M - m0 < 16 ? M - m0 : 16);
    mc[1] = (int)(M - m0 <= 16 ? 0 : M - m0 < 32 ? M - m0 - 16 : 16);
}

/* every 16-output block of W against every pass of 32 rows, the blocks shared out among the
 * threads: packed (the kernel above), or in place with the rows repacked into xp */
static inline AMX_TARGET __attribute__((always_inline)) void amx_blocks(
    const uint16_t *x, const uint16_t *xp, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
    int64_t K, int threads, const int packed) {
    const int64_t blocks = N / 16, passes = (M + 31) / 32;
#pragma omp parallel num_threads(threads)
    {
        int configured[2] = {-1, -1};
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++)
            for (int64_t pass = 0; pass < passes; pass++) {
                const int64_t m0 = pass * 32;
                int mc[2];
                amx_pass_rows(M, m0, mc);
                if (mc[0] != configured[0] || mc[1] != configured[1]) {
                    if (packed) amx_configure_rows(mc[0], mc[1]);
                    else amx_configure(mc[0], mc[1]);
                    configured[0] = mc[0], configured[1] = mc[1];
                }
                if (packed) {
                    amx_block_packed(x, w + blk * 16 * K, b, y, m0, mc, blk * 16, N, K, pass == 0);
                } else {
                    const uint16_t *const groups_xp[2] = {xp + m0 * K, xp + (m0 + 16) * K};
                    amx_block(x, groups_xp, w, b, y, m0, mc, blk * 16, N, K, pass == 0 && blk + 1 < blocks);
                }
            }
        if (configured[0] >= 0) _tile_release();
    }
}

/* Needs N % 16 == 0 and K % 32 == 0 (returns -3 otherwise). */
AMX_TARGET int few_rows_linear_amx_packed(const uint16_t *x, const uint16_t *wp, const uint16_t *b, uint16_t *y, int64_t M,
                                          int64_t N, int64_t K, int threads) {
    if (N % 16 || K % 32) return -3;
    amx_blocks(x, NULL, wp, b, y, M, N, K, threads, 1);
    return 0;
}

/* x [M, K], w [N, K], b [N] or NULL, y [M, N]: contiguous bf16.
 * Returns 0, or -1 where the scratch cannot be allocated (nothing computed). */
AMX_TARGET int few_rows_linear_amx(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M,
                                   int64_t N, int64_t K, int threads) {
    if (K & 1) { /* x's pairs are read as 32-bit words: an odd K takes the AVX512-BF16 kernel (fixed per shape) */
        few_rows_linear_bf16(x, w, b, y, M, N, K, threads);
        return 0;
    }
    uint16_t *xp = amx_scratch((size_t)(M * K));
    if (!xp) return -1;
    const int64_t chunks = K / 32, blocks = N / 16, groups = (M + 15) / 16;
    /* xp[group][kc][r][m][t] = x[group * 16 + m, kc * 32 + 2 r + t]: tile B of chunk kc for a group's rows */
    for (int64_t g = 0; g < groups; g++) {
        const int64_t m0 = g * 16, mc = M - m0 < 16 ? M - m0 : 16;
        uint32_t *dst = (uint32_t *)(xp + m0 * K);
        for (int64_t m = 0; m < mc; m++) {
            const uint32_t *src = (const uint32_t *)(x + (m0 + m) * K); /* K even: a row's pairs */
            for (int64_t kc = 0; kc < chunks; kc++)
                for (int r = 0; r < 16; r++) dst[(kc * 16 + r) * mc + m] = src[kc * 16 + r];
        }
    }
    amx_blocks(x, xp, w, b, y, M, N, K, threads, 0);
    for (int64_t n = blocks * 16; n < N; n++) /* the last outputs short of a 16-block */
        few_rows_linear_bf16_rows(x, w, b, y, M, n, 1, N, K);
    return 0;
}
#endif
