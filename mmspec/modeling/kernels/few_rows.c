/* y[M, N] = x[M, K] W[N, K]^T (+ b[N]) for few rows M, fp32, AVX2 + FMA.
 *
 * MKL / oneDNN take a GEMV path for M = 1 and a GEMM path for M >= 2 whose cost on a CPU barely
 * depends on M up to ~8 but is ~2x the GEMV's: a verification forward over a few draft tokens
 * then costs ~1.6x a one-token step. Here each 2-row block of W is loaded once (from memory or
 * L3 into L1) and used for every row of x while it is in L1, and the next block is prefetched
 * while this one computes (a model's weights come from DRAM: without the prefetch, fewer loads are
 * in flight as M grows and M = 4 cost 1.7x M = 1). So a few rows cost about what streaming the
 * weight costs, until the FMAs take over (measured in docs/benchmarks.md).
 *
 * Every output is summed in the same order whatever M and the row's place (8-lane partial sums
 * over k in steps of 8, one horizontal sum, the scalar tail of K, then the bias): the result of a
 * row is bitwise the same alone or among others (batch invariance), so verifying n tokens gives
 * exactly the logits a one-token step would.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "bf16.h"
#include <stdint.h>

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

#define MB 4 /* rows of x per block */
#define AHEAD 1 /* the block prefetched: the next one */
#define NB 2 /* rows of W per block: MB * NB accumulators + NB weights + 1 input = 11 AVX2 registers */

/* rows [m0, m0 + mb) of x (mb <= MB) against W rows [n0, n0 + nb) (nb <= NB); inlined with
 * constant mb and nb, so the accumulators stay in registers. While it computes, it prefetches the
 * floats [pf0, pf1) of the following block (each pass over this block a share of it, so that
 * memory is busy during every pass, not only the first) */
static inline __attribute__((always_inline)) void block(const float *x, const float *w, const float *b, float *y,
                                                        int64_t m0, const int mb, int64_t n0, const int nb,
                                                        int64_t N, int64_t K, int64_t pf0, int64_t pf1) {
    const int64_t k8 = K & ~(int64_t)7;
    const float *next = w + (n0 + AHEAD * nb) * K; /* the block AHEAD blocks on (W's rows are contiguous) */
    __m256 acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    /* the prefetch range spread evenly over the k steps: `per` floats (whole 64-byte lines) per step */
    const int64_t steps = k8 / 8, per = steps ? ((pf1 - pf0 + steps * 16 - 1) / (steps * 16)) * 16 : 0;
    int64_t p = pf0;
    for (int64_t k = 0; k < k8; k += 8) {
        for (int64_t q = 0; q < per && p < pf1; q += 16, p += 16) _mm_prefetch((const char *)(next + p), _MM_HINT_T0);
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

/* Every row of x against W rows [n0, n0 + nb): blocks of MBV rows, then the remaining 1-3, each
 * pass prefetching its share of the next weight block; and the exported entry point, OpenMP over
 * blocks of NBV weight rows. One definition for each kernel below (its block function BLOCK). */
#define ROWS_AND_ENTRY(NAME, T, BLOCK, MBV, NBV, TARGET)                                                       \
    static inline TARGET __attribute__((always_inline)) void NAME##_rows(                                      \
        const T *x, const T *w, const T *b, T *y, int64_t M, int64_t n0, const int nb, int64_t N, int64_t K) { \
        const int64_t passes = (M + MBV - 1) / MBV, ahead = (int64_t)nb * K;                                    \
        int64_t m = 0, pass = 0;                                                                                \
        for (; m + MBV <= M; m += MBV, pass++)                                                                  \
            BLOCK(x, w, b, y, m, MBV, n0, nb, N, K, ahead * pass / passes, ahead * (pass + 1) / passes);        \
        const int64_t pf0 = ahead * pass / passes, pf1 = ahead;                                                 \
        switch (M - m) {                                                                                        \
            case 3: BLOCK(x, w, b, y, m, 3, n0, nb, N, K, pf0, pf1); break;                                     \
            case 2: BLOCK(x, w, b, y, m, 2, n0, nb, N, K, pf0, pf1); break;                                     \
            case 1: BLOCK(x, w, b, y, m, 1, n0, nb, N, K, pf0, pf1); break;                                     \
            default: break;                                                                                     \
        }                                                                                                       \
    }                                                                                                           \
    TARGET void NAME(const T *x, const T *w, const T *b, T *y, int64_t M, int64_t N, int64_t K, int threads) {   \
        const int64_t blocks = (N + NBV - 1) / NBV;                                                             \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                       \
        for (int64_t blk = 0; blk < blocks; blk++) {                                                            \
            const int64_t n0 = blk * NBV;                                                                       \
            if (n0 + NBV <= N)                                                                                  \
                NAME##_rows(x, w, b, y, M, n0, NBV, N, K);                                                      \
            else                                                                                                \
                for (int64_t n = n0; n < N; n++) NAME##_rows(x, w, b, y, M, n, 1, N, K);                        \
        }                                                                                                       \
    }

/* x [M, K], w [N, K], b [N] or NULL, y [M, N]: all contiguous fp32. threads: OpenMP threads. */
ROWS_AND_ENTRY(few_rows_linear, float, block, MB, NB, )

/* ---- fp32 on AVX-512: the same blocking with 16-lane vectors ----
 *
 * The AVX2 kernel's FMAs bind from ~6 rows on (8 lanes, 16 registers); AVX-512 doubles the lanes and
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
    int64_t N, int64_t K, int64_t pf0, int64_t pf1) {
    const int64_t k16 = K & ~(int64_t)15;
    const float *next = w + (n0 + AHEAD * nb) * K;
    __m512 acc[ZF_MB][ZF_NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t steps = k16 / 16, per = steps ? ((pf1 - pf0 + steps * 16 - 1) / (steps * 16)) * 16 : 0;
    int64_t p = pf0;
    for (int64_t k = 0; k < k16; k += 16) { /* one 64-byte line of each weight row per step */
        for (int64_t q = 0; q < per && p < pf1; q += 16, p += 16) _mm_prefetch((const char *)(next + p), _MM_HINT_T0);
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

ROWS_AND_ENTRY(few_rows_linear_avx512, float, zf_block, ZF_MB, ZF_NB, AVX512_TARGET)

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
    const int nb, int64_t N, int64_t K, int64_t pf0, int64_t pf1) {
    const int64_t k32 = K & ~(int64_t)31;
    const uint16_t *next = w + (n0 + AHEAD * nb) * K;
    __m512 acc[BF_MB][BF_NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t steps = k32 / 32, per = steps ? ((pf1 - pf0 + steps * 32 - 1) / (steps * 32)) * 32 : 0;
    int64_t p = pf0;
    for (int64_t k = 0; k < k32; k += 32) { /* one 64-byte line of each row per step */
        for (int64_t q = 0; q < per && p < pf1; q += 32, p += 32) _mm_prefetch((const char *)(next + p), _MM_HINT_T0);
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

ROWS_AND_ENTRY(few_rows_linear_bf16, uint16_t, bf_block, BF_MB, BF_NB, BF16_TARGET)

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
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

/* 16 bf16 values at p as fp32 (AVX-512F; inlined into the AMX kernel and the row argmax) */
static inline __attribute__((target("avx512f"), always_inline)) __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#if defined(__clang__) || !defined(__GNUC__) || __GNUC__ < 11 /* no AMX intrinsics: the entry says so */
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

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

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

/* ---- argmax over rows: out[r] = the first index of the largest of x[r, 0 .. V) (fp32 or bf16) ----
 *
 * What torch.max(dim=-1).indices gives, at ~memory speed (PyTorch's bf16 reduction over a [15,
 * 49152] verification took ~0.55 ms on one core): 16 lanes keep their strictly-greater maxima
 * (the first of ties within a lane), then the largest lane value with the smallest index among the
 * lanes holding it. A row holding a NaN gives its first NaN (PyTorch's max propagates NaN). */
#define ARGMAX_TARGET __attribute__((target("avx512f,avx512bw")))
/* 16 elements (fp32 lanes), and one, of an fp32 or bf16 array (the row argmax, the int8 kernel) */
static inline ARGMAX_TARGET __m512 load16(const void *x, int64_t i, int bf16) {
    return bf16 ? load_bf16x16((const uint16_t *)x + i) : _mm512_loadu_ps((const float *)x + i);
}

static inline float value_at(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

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
static inline float residual_at(const float *pn, const float *qn, int64_t drafted, int64_t i) {
    const float d = pn[i] - (qn ? qn[i] : i == drafted ? 1.0f : 0.0f);
    return d > 0.0f ? d : 0.0f; /* max(0, p - q), as clamp_(min=0) */
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
        int empty = 1;
        for (int64_t i = 0; i < V && empty; i++) empty = !(residual_at(pn, qn, drafted, i) > 0.0f);
        double total = 0.0, cdf = 0.0;
        for (int64_t i = 0; i < V; i++) total += empty ? (double)pn[i] : (double)residual_at(pn, qn, drafted, i);
        const double threshold = (double)u[b] * total;
        int64_t at = V - 1;
        for (int64_t i = 0; i < V; i++) {
            cdf += empty ? (double)pn[i] : (double)residual_at(pn, qn, drafted, i);
            if (cdf > threshold) {
                at = i;
                break;
            }
        }
        accepted[b] = n;
        for (int64_t i = 0; i <= K; i++) out[b * (K + 1) + i] = i < n ? tokens[b * K + i] : i == n ? at : pad;
    }
    return 0;
}

/* y [M, N] = x [M, K] W^T (+ b) with W in int8, for drafters (a drafter may round as it likes: the
 * acceptance rule reads the distribution it drew from). w: the blob of mmspec.modeling.fused.pack_int8,
 * int8 q [N / 16, K / 4, 16, 4] (W[n, k] ~ scale[n] q[n, k], scale[n] = max_k |W[n, k]| / 127), then
 * float scale [N], then int32 rowsum [N] = sum_k q[n, k]. Each row of x (model dtype: bf16 if `bf16`,
 * else fp32) is quantised symmetrically, s = max_k |x_k| / 127 (1 for a zero row), a_k = round(x_k / s)
 * (nearest even) in [-127, 127], and summed in int32 exactly as u8 a_k + 128 against q (AVX512-VNNI
 * vpdpbusd, 16 outputs a register, each block of 16 outputs read once for all the rows), summed
 * the way `path` names (mmspec.modeling.fused.INT8_PATHS): 1 VNNI; 2 AMX-INT8 tiles for two rows
 * or more where K % 64 == 0, ~3x VNNI's speed at 8-16 rows; 3 AVX2's vpmaddwd over the weights
 * widened to int16, for CPUs without VNNI; 0 a scalar loop; the same integers every way:
 *     y[n] = (float)(sum_k (a_k + 128) q[n, k] - 128 rowsum[n]) * (s * scale[n]) + b[n]
 * in fp32, then rounded to the model dtype. Half the bytes of bf16 weights: a drafter's head fits the
 * L2 cache (the voice's EAGLE head: 1 MB). N % 16 == 0, K % 4 == 0. Returns 0, or -1 (no scratch). */
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
/* acc [M, N] = the int32 sums of the M quantised rows a [M, K] against q, block of 16 outputs by
 * block: a block (16 K bytes) stays in L1 while every row passes over it */
static VNNI_TARGET void i8_sums_vnni(const uint8_t *a, const int8_t *q, int64_t M, int64_t N, int64_t K, int32_t *acc) {
    const int64_t groups = K / 4;
    for (int64_t nb = 0; nb < N / 16; nb++) {
        const int8_t *block = q + nb * K * 16;
        for (int64_t m = 0; m < M; m++) {
            const uint8_t *row = a + m * K;
            __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0; /* four chains: vpdpbusd's latency */
            int64_t g = 0;
            for (; g + 4 <= groups; g += 4) {
                int32_t x0, x1, x2, x3;
                memcpy(&x0, row + 4 * g, 4), memcpy(&x1, row + 4 * g + 4, 4), memcpy(&x2, row + 4 * g + 8, 4);
                memcpy(&x3, row + 4 * g + 12, 4);
                s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(x0), _mm512_loadu_si512(block + g * 64));
                s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(x1), _mm512_loadu_si512(block + g * 64 + 64));
                s2 = _mm512_dpbusd_epi32(s2, _mm512_set1_epi32(x2), _mm512_loadu_si512(block + g * 64 + 128));
                s3 = _mm512_dpbusd_epi32(s3, _mm512_set1_epi32(x3), _mm512_loadu_si512(block + g * 64 + 192));
            }
            for (; g < groups; g++) {
                int32_t x0;
                memcpy(&x0, row + 4 * g, 4);
                s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(x0), _mm512_loadu_si512(block + g * 64));
            }
            _mm512_storeu_si512(acc + m * N + nb * 16, _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3)));
        }
    }
}
/* The same int32 sums on AVX2 (no VNNI): a block's int8 bytes widened once to int16 in `wide`
 * [K / 4][64] (the blob's order: 4 outputs x 4 k per 16 bytes), then per row and k-quad one vpmaddwd
 * per 4 outputs against the quad's 4 u8 codes widened and repeated, (a0, a1, a2, a3) per 64 bits: its
 * 32-bit lanes hold a0 q0 + a1 q1 and a2 q2 + a3 q3 of each output (at most 2 x 255 x 127, no
 * saturation), added over the quads and then pairwise: exact integers, bitwise i8_sums_vnni's. */
static void i8_sums_avx2(const uint8_t *a, const int8_t *q, int64_t M, int64_t N, int64_t K, int32_t *acc, int16_t *wide) {
    const int64_t groups = K / 4;
    for (int64_t nb = 0; nb < N / 16; nb++) {
        const int8_t *block = q + nb * K * 16;
        for (int64_t i = 0; i < groups * 4; i++)
            _mm256_storeu_si256((__m256i *)(wide + 16 * i), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 16 * i))));
        for (int64_t m = 0; m < M; m++) {
            const uint8_t *row = a + m * K;
            __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0; /* outputs 0-3, 4-7, 8-11, 12-15 */
            for (int64_t g = 0; g < groups; g++) {
                int32_t codes;
                memcpy(&codes, row + 4 * g, 4);
                const __m256i x = _mm256_broadcastq_epi64(_mm_cvtepu8_epi16(_mm_cvtsi32_si128(codes)));
                const int16_t *w = wide + 64 * g;
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(x, _mm256_loadu_si256((const __m256i *)w)));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(x, _mm256_loadu_si256((const __m256i *)(w + 16))));
                s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(x, _mm256_loadu_si256((const __m256i *)(w + 32))));
                s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(x, _mm256_loadu_si256((const __m256i *)(w + 48))));
            }
            /* hadd per 128-bit lane: (o0, o1, o4, o5 | o2, o3, o6, o7); the 64-bit quarters reordered */
            _mm256_storeu_si256((__m256i *)(acc + m * N + nb * 16), _mm256_permute4x64_epi64(_mm256_hadd_epi32(s0, s1), 0xD8));
            _mm256_storeu_si256((__m256i *)(acc + m * N + nb * 16 + 8), _mm256_permute4x64_epi64(_mm256_hadd_epi32(s2, s3), 0xD8));
        }
    }
}
static void i8_sums_scalar(const uint8_t *a, const int8_t *q, int64_t M, int64_t N, int64_t K, int32_t *acc) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            const int8_t *block = q + (n / 16) * K * 16 + (n % 16) * 4;
            int32_t sum = 0;
            for (int64_t k = 0; k < K; k++) sum += (int32_t)a[m * K + k] * block[(k / 4) * 64 + k % 4];
            acc[m * N + n] = sum;
        }
}
/* The same int32 sums by AMX-INT8 tiles (exact integers: bitwise i8_sums_vnni's): the blob's
 * [K / 4, 16, 4] block of 16 outputs is, 16 k-quads at a time, a B tile as it lies (16 rows of 16
 * outputs x 4 bytes, 1 KB contiguous); the rows' u8 bytes are A tiles read in place (up to 16 rows x
 * 64 k, row stride K); C (rows x 16 outputs, int32) is stored straight into acc. Two blocks at a time
 * share each A tile. K % 64 == 0 (the caller checks). Needs the tile state (few_rows_amx_init). */
#if !(defined(__clang__) || !defined(__GNUC__) || __GNUC__ < 11)
#define AMX_I8_TARGET __attribute__((target("amx-tile,amx-int8")))
static AMX_I8_TARGET void i8_sums_amx(const uint8_t *a, const int8_t *q, int64_t M, int64_t N, int64_t K, int32_t *acc) {
    const int64_t chunks = K / 64, blocks = N / 16;
    int configured = -1;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int mc = (int)(M - m0 < 16 ? M - m0 : 16);
        if (mc != configured) {
            tile_config cfg = {0};
            cfg.palette = 1;
            cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = (uint8_t)mc; /* C of two blocks, A */
            cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[2] = 64;
            cfg.rows[3] = cfg.rows[4] = 16, cfg.colsb[3] = cfg.colsb[4] = 64; /* B of the two blocks */
            _tile_loadconfig(&cfg);
            configured = mc;
        }
        for (int64_t nb = 0; nb < blocks; nb += 2) {
            const int pair = nb + 1 < blocks;
            const int8_t *b0 = q + nb * K * 16, *b1 = b0 + K * 16;
            _tile_zero(0);
            if (pair) _tile_zero(1);
            for (int64_t c = 0; c < chunks; c++) {
                _tile_loadd(2, a + m0 * K + c * 64, K);
                _tile_loadd(3, b0 + c * 1024, 64);
                _tile_dpbusd(0, 2, 3);
                if (pair) {
                    _tile_loadd(4, b1 + c * 1024, 64);
                    _tile_dpbusd(1, 2, 4);
                }
            }
            _tile_stored(0, acc + m0 * N + nb * 16, N * 4);
            if (pair) _tile_stored(1, acc + m0 * N + nb * 16 + 16, N * 4);
        }
    }
    if (configured >= 0) _tile_release();
}
#endif

/* the fast paths' sums: AMX-INT8 tiles (path 2, K % 64 == 0, two rows or more: for one row the tile
 * set-up costs ~0.5 us more than VNNI's loop) or VNNI */
static void i8_sums_wide(const uint8_t *a, const int8_t *q, int64_t M, int64_t N, int64_t K, int32_t *acc, int path) {
#if !(defined(__clang__) || !defined(__GNUC__) || __GNUC__ < 11)
    if (path == 2 && K % 64 == 0 && M > 1) {
        i8_sums_amx(a, q, M, N, K, acc);
        return;
    }
#endif
    (void)path;
    i8_sums_vnni(a, q, M, N, K, acc);
}

/* max(top, |x[m, k]|) over k in [k0, K) */
static float i8_top(const void *x, int bf16, int64_t m, int64_t K, int64_t k0, float top) {
    for (int64_t k = k0; k < K; k++) {
        const float v = value_at(x, m * K + k, bf16);
        top = fabsf(v) > top ? fabsf(v) : top;
    }
    return top;
}

/* a row's step: max |x| / 127, 1 for a zero row */
static inline float i8_step(float top) { return top > 0.0f ? top / 127.0f : 1.0f; }

/* a[m, k] = round(x[m, k] / s) (nearest even) clamped to [-127, 127], + 128, for k in [k0, K) */
static void i8_codes(const void *x, int bf16, int64_t m, int64_t K, int64_t k0, float s, uint8_t *a) {
    for (int64_t k = k0; k < K; k++) {
        float r = nearbyintf(value_at(x, m * K + k, bf16) / s);
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        a[m * K + k] = (uint8_t)((int32_t)r + 128);
    }
}

/* each row of x [M, K]: steps[m] = i8_step(max |x|), a = i8_codes; 16 lanes, the tail of K as the
 * scalar loop */
static VNNI_TARGET void i8_quantise_wide(const void *x, int bf16, int64_t M, int64_t K, uint8_t *a, float *steps) {
    const int64_t K16 = K & ~(int64_t)15;
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t m = 0; m < M; m++) {
        __m512 top16 = _mm512_setzero_ps();
        for (int64_t k = 0; k < K16; k += 16) top16 = _mm512_max_ps(top16, _mm512_abs_ps(load16(x, m * K + k, bf16)));
        const float s = steps[m] = i8_step(i8_top(x, bf16, m, K, K16, _mm512_reduce_max_ps(top16)));
        const __m512 step = _mm512_set1_ps(s);
        for (int64_t k = 0; k < K16; k += 16) {
            __m512 r = _mm512_roundscale_ps(_mm512_div_ps(load16(x, m * K + k, bf16), step), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
            const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(r), _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i *)(a + m * K + k), _mm512_cvtepi32_epi8(u));
        }
        i8_codes(x, bf16, m, K, K16, s, a);
    }
}

/* y = (float)(acc - 128 rowsum) * (steps[m] * scale[n]) + b in fp32, rounded to the model dtype
 * (bf16: nearest even, a NaN kept a NaN, as float_to_bf16); N % 16 == 0 */
static VNNI_TARGET void i8_output_wide(const int32_t *acc, const int32_t *rowsum, const float *steps, const float *scale,
                                       const void *b, void *y, int64_t M, int64_t N, int bf16) {
    for (int64_t m = 0; m < M; m++) {
        const __m512 step = _mm512_set1_ps(steps[m]);
        for (int64_t n = 0; n < N; n += 16) {
            const __m512i sums = _mm512_sub_epi32(_mm512_loadu_si512(acc + m * N + n),
                                                  _mm512_slli_epi32(_mm512_loadu_si512(rowsum + n), 7));
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(step, _mm512_loadu_ps(scale + n)));
            if (b) v = _mm512_add_ps(v, load16(b, n, bf16));
            if (!bf16) {
                _mm512_storeu_ps((float *)y + m * N + n, v);
                continue;
            }
            const __m512i u = _mm512_castps_si512(v);
            const __m512i rounded = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
            const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
            const __m512i out = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + m * N + n), _mm512_cvtepi32_epi16(out));
        }
    }
}

int few_rows_linear_i8(const void *x, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K, int bf16,
                       int path) {
    const int8_t *q = w;
    const float *scale = (const float *)(q + N * K);
    const int32_t *rowsum = (const int32_t *)(scale + N);
    char *scratch = malloc((size_t)(M * K + 4 * M * N + 4 * M + (path == 3 ? 32 * K : 0)));
    if (!scratch) return -1;
    uint8_t *a = (uint8_t *)scratch;
    int32_t *acc = (int32_t *)(scratch + M * K);
    float *steps = (float *)(acc + M * N);
    if (path == 1 || path == 2) { /* the AVX-512 forms of the two loops below: the same operations per element */
        i8_quantise_wide(x, bf16, M, K, a, steps);
        i8_sums_wide(a, q, M, N, K, acc, path);
        i8_output_wide(acc, rowsum, steps, scale, b, y, M, N, bf16);
        free(scratch);
        return 0;
    }
    for (int64_t m = 0; m < M; m++) { /* every row quantised first, so that each weight block is read once */
        steps[m] = i8_step(i8_top(x, bf16, m, K, 0, 0.0f));
        i8_codes(x, bf16, m, K, 0, steps[m], a);
    }
    if (path == 3)
        i8_sums_avx2(a, q, M, N, K, acc, (int16_t *)(steps + M));
    else
        i8_sums_scalar(a, q, M, N, K, acc);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float v = (float)(acc[m * N + n] - 128 * rowsum[n]) * (steps[m] * scale[n]);
            if (b) v += value_at(b, n, bf16);
            if (bf16) ((uint16_t *)y)[m * N + n] = float_to_bf16(v);
            else ((float *)y)[m * N + n] = v;
        }
    free(scratch);
    return 0;
}
