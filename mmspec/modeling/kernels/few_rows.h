/* What the few-row linear kernels (linear_fp32.c, linear_bf16.c, linear_int8.c) and the row helpers
 * (verify.c) share: the row-blocking template of the vector kernels, the packed kernels' groups and
 * passes, bf16 loads into 16 fp32 lanes, the AMX tile configuration. Internal to those files
 * (static inline: each file its own copy, the same instructions); the entry points they export are
 * declared in kernels.h. */
#ifndef MMSPEC_FEW_ROWS_H
#define MMSPEC_FEW_ROWS_H
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

/* whether the compiler has the AMX intrinsics (GCC 11 or later); without them the AMX entries say
 * so (few_rows_amx_init() returns -1) and the int8 kernel sums by VNNI instead of tiles */
#if defined(__clang__) || !defined(__GNUC__) || __GNUC__ < 11
#define MMSPEC_HAVE_AMX 0
#else
#define MMSPEC_HAVE_AMX 1
#endif

/* A block's share of a prefetch, spread over its k steps: bytes [0, pf_bytes) from pf, `per` bytes
 * (whole 64-byte lines, lines_a_step) a step, `ahead` counting from 0 what was asked for. Every
 * vector kernel's block function (the in-place ones below, the packed ones' pass, PK_SHAPE) calls
 * prefetch_lines once a step. */
static inline int64_t lines_a_step(int64_t pf_bytes, int64_t steps) {
    return steps ? (pf_bytes + steps * 64 - 1) / (steps * 64) * 64 : 0;
}
static inline __attribute__((always_inline)) void prefetch_lines(const char *pf, int64_t pf_bytes, int64_t per,
                                                                 int64_t *ahead) {
    for (int64_t q = 0; q < per && *ahead < pf_bytes; q += 64, *ahead += 64) _mm_prefetch(pf + *ahead, _MM_HINT_T0);
}

/* Every row of x against W rows [n0, n0 + nb) in ceil(M / MBV) passes over the block, which stays in
 * L1 meanwhile: EVEN 1, passes of as equal a size as can be (seven rows 4 + 3, five 3 + 2: a one-row
 * pass keeps only nb sums in flight, too few to hide the FMA's latency; the AVX2 kernel), EVEN 0, MBV
 * rows a pass and then the rest (the 16-lane kernels: their 4 + 1 was as fast as 3 + 2 from memory and
 * faster in cache). Each pass prefetches its share of a block further on: the next one where one
 * pass takes every row (memory-bound: farther slowed one-row steps), AHEAD_MANY blocks on where
 * several do, as a block's FMAs then take about as long as its weights take to arrive from DRAM (the
 * captioner's weights on a Zen 5 core, seven rows: AVX2 fp32 26.7 -> 18.8 ms with three weight rows
 * a block, bf16 11.8 -> 10.0 ms).
 * Up to BURST_ROWS rows (one pass) the prefetch is a burst, LEAD times the even share a step, so the
 * next block is asked for within the first eighth of this one: spread over the whole block, the
 * last lines of the next one were asked for just before they were needed (the captioner's linears,
 * one row, Zen 5: bf16 10.1 -> 8.2 ms, 16-lane fp32 20.6 -> 15.4 ms; BURST_ROWS is where it paid:
 * bf16 up to four rows, 16-lane fp32 up to two (three rows lost 22.5 -> 28.7 ms), the AVX2 kernel,
 * whose three-row blocks already end their prefetch early, one).
 * Each output is summed alike whatever its pass, so none of this changes a bit. Also the exported
 * entry point, OpenMP over blocks of NBV weight rows. One definition for each vector kernel of
 * linear_fp32.c and linear_bf16.c (its block function BLOCK: mb <= MBV rows, nb <= NBV outputs). */
#define LEAD 8
#define ROWS_AND_ENTRY(NAME, T, BLOCK, MBV, NBV, AHEAD_MANY, EVEN, BURST_ROWS, TARGET)                                 \
    static inline TARGET __attribute__((always_inline)) void NAME##_rows(                                              \
        const T *x, const T *w, const T *b, T *y, int64_t M, int64_t n0, const int nb, int64_t N, int64_t K) {         \
        const int64_t passes = (M + MBV - 1) / MBV, span = (int64_t)nb * K, base = M / passes;                         \
        const int64_t extra = M % passes, next = (passes == 1 ? 1 : AHEAD_MANY) * span;                                \
        const int64_t lead = M <= BURST_ROWS ? LEAD : 1;                                                               \
        int64_t m = 0;                                                                                                 \
        for (int64_t pass = 0; pass < passes; pass++) {                                                                \
            const int64_t rows = EVEN ? base + (pass < extra) : M - m < MBV ? M - m : MBV;                             \
            const int64_t pf0 = span * pass / passes;                                                                  \
            const int64_t pf1 = span * (pass + 1) / passes;                                                            \
            switch (rows) {                                                                                            \
                case 4: BLOCK(x, w, b, y, m, 4, n0, nb, N, K, next, pf0, pf1, lead); break;                            \
                case 3: BLOCK(x, w, b, y, m, 3, n0, nb, N, K, next, pf0, pf1, lead); break;                            \
                case 2: BLOCK(x, w, b, y, m, 2, n0, nb, N, K, next, pf0, pf1, lead); break;                            \
                default: BLOCK(x, w, b, y, m, 1, n0, nb, N, K, next, pf0, pf1, lead); break;                           \
            }                                                                                                          \
            m += rows;                                                                                                 \
        }                                                                                                              \
    }                                                                                                                  \
    TARGET void NAME(const T *x, const T *w, const T *b, T *y, int64_t M, int64_t N, int64_t K, int threads) {         \
        const int64_t blocks = (N + NBV - 1) / NBV;                                                                    \
        _Static_assert(MBV <= 4, "a pass of more than four rows has no case below");                                   \
        if (M < 1)                                                                                                     \
            return;                                                                                                    \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                              \
        for (int64_t blk = 0; blk < blocks; blk++) {                                                                   \
            const int64_t n0 = blk * NBV;                                                                              \
            if (n0 + NBV <= N)                                                                                         \
                NAME##_rows(x, w, b, y, M, n0, NBV, N, K);                                                             \
            else                                                                                                       \
                for (int64_t n = n0; n < N; n++) NAME##_rows(x, w, b, y, M, n, 1, N, K);                               \
        }                                                                                                              \
    }

/* The packed kernels (outputs in the lanes: linear_bf16.c's vdpbf16ps one, linear_fp32.c's 16-lane
 * fp32 one) share their layout's grouping and their passes. W's blocks of 16 outputs go in groups of
 * PK_NB (the last maybe fewer); a group is one stream of steps, each step one 64-byte vector per
 * block (a pair of columns in bf16, one column in fp32). M rows go in passes of equal size, at most
 * PK_MB each (24 accumulators + 4 weights + 1 broadcast of the 32 zmm registers). One pass reads the
 * group's stream once: up to PK_LONE rows leaving the prefetch to the hardware (ours, PK_AHEAD
 * bytes ahead, cost one bf16 row of the captioner 7.3 -> 7.9 ms), more rows with it. Several
 * passes take the group in chunks of PK_CHUNK steps: every pass runs over a chunk (its sums kept
 * in memory between chunks) and together they prefetch the next chunk, so the weight streams from
 * DRAM without a pause while the later passes read the chunk from L1 (a second pass over a whole
 * group read it from L2 with no DRAM traffic meanwhile: the captioner's bf16 linears, 8 rows, 10.0
 * -> 8.1 ms). Rows past PK_SLAB go in slabs, each its own passes (the sums' scratch bounded).
 *
 * PACKED_ENTRY(NAME, T, STEP, STORE, STEPS, TARGET) defines the entry NAME(x, p, b, y, M, N, K,
 * threads) (OpenMP over the groups) and its pass shapes, apart (GCC keeps their registers so). A
 * shape's pass (PK_SHAPE) takes rows [m0, m0 + mb) against steps [s0, s1) of the group at src (nb
 * blocks, the first blk0): its sums from zero (the first chunk) or buf, STEP(acc, x, src, m0, mb,
 * nb, K, s) for each step s with its share of the prefetch (pf_bytes from pf), the steps between
 * STEP_enter() and STEP_exit(its value) (the thread's floating-point mode for them), then the sums back
 * to buf or, after the group's last chunk, STORE(acc, b, y, m0, mb, blk0, nb, N) (with the bias,
 * the lanes past N left out: pk_lanes). STEPS: the steps of a K. Each output's sum runs over the
 * steps in order whatever the passes, chunks or slabs: batch-invariant. */
#define PK_MB 6
#ifndef PK_NB /* blocks a group: set by the build from fast_linear.PACKED_GROUP_BLOCKS */
#error "build with -DPK_NB=N (mmspec.modeling.fast_linear.CFLAGS)"
#endif
#define PK_CHUNK 48 /* steps a chunk (12 KB of four blocks: it and the next stay in L1 with the rows) */
#define PK_AHEAD 4096
#define PK_LONE 2
#define PK_SLAB (16 * PK_MB)
/* A pass's sums from zero (first) or from buf, and back to buf where the chunk is not the group's
 * last; the lanes of the block of outputs from n0 that N keeps (STORE's mask) */
static inline __attribute__((target("avx512f"), always_inline)) void pk_sums_in(__m512 acc[PK_MB][PK_NB], const int mb,
                                                                               const int nb, int first, const float *buf) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(buf + (i * PK_NB + j) * 16);
}
static inline __attribute__((target("avx512f"), always_inline)) void pk_sums_out(__m512 acc[PK_MB][PK_NB], const int mb,
                                                                                const int nb, float *buf) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) _mm512_store_ps(buf + (i * PK_NB + j) * 16, acc[i][j]);
}
/* STEP_enter / STEP_exit of steps that run in the caller's floating-point mode */
static inline unsigned int pk_mode_kept(void) { return 0; }
static inline void pk_mode_back(unsigned int mode) { (void)mode; }
static inline __mmask16 pk_lanes(int64_t N, int64_t n0) {
    return (__mmask16)((1u << (N - n0 < 16 ? N - n0 : 16)) - 1);
}
#define PK_SHAPE(NAME, T, STEP, STORE, TARGET, MB, NB)                                                                \
    static TARGET __attribute__((noinline)) void NAME##_##MB##x##NB(                                                  \
        const T *x, const T *src, const T *b, T *y, int64_t m0, int64_t blk0, int64_t N, int64_t K, int64_t s0,       \
        int64_t s1, float *buf, const char *pf, int64_t pf_bytes, int first, int last) {                              \
        __m512 acc[PK_MB][PK_NB];                                                                                     \
        pk_sums_in(acc, MB, NB, first, buf);                                                                          \
        const int64_t per = lines_a_step(pf_bytes, s1 - s0);                                                          \
        int64_t ahead = 0;                                                                                            \
        const unsigned int mode = STEP##_enter();                                                                     \
        for (int64_t s = s0; s < s1; s++) {                                                                           \
            prefetch_lines(pf, pf_bytes, per, &ahead);                                                                \
            STEP(acc, x, src, m0, MB, NB, K, s);                                                                      \
        }                                                                                                             \
        STEP##_exit(mode);                                                                                            \
        if (!last)                                                                                                    \
            pk_sums_out(acc, MB, NB, buf);                                                                            \
        else                                                                                                          \
            STORE(acc, b, y, m0, MB, blk0, NB, N);                                                                    \
    }
#define PK_ROWS(NAME, T, STEP, STORE, TARGET, NB)                                                                     \
    PK_SHAPE(NAME, T, STEP, STORE, TARGET, 1, NB) PK_SHAPE(NAME, T, STEP, STORE, TARGET, 2, NB)                       \
    PK_SHAPE(NAME, T, STEP, STORE, TARGET, 3, NB) PK_SHAPE(NAME, T, STEP, STORE, TARGET, 4, NB)                       \
    PK_SHAPE(NAME, T, STEP, STORE, TARGET, 5, NB) PK_SHAPE(NAME, T, STEP, STORE, TARGET, 6, NB)
#define PK_TABLE_ROW(NAME, NB) {NAME##_1x##NB, NAME##_2x##NB, NAME##_3x##NB, NAME##_4x##NB, NAME##_5x##NB, NAME##_6x##NB}
#define PACKED_ENTRY(NAME, T, STEP, STORE, STEPS, TARGET)                                                             \
    PK_ROWS(NAME, T, STEP, STORE, TARGET, 1) PK_ROWS(NAME, T, STEP, STORE, TARGET, 2)                                 \
    PK_ROWS(NAME, T, STEP, STORE, TARGET, 3) PK_ROWS(NAME, T, STEP, STORE, TARGET, 4)                                 \
    typedef void (*NAME##_pass)(const T *, const T *, const T *, T *, int64_t, int64_t, int64_t, int64_t, int64_t,    \
                                int64_t, float *, const char *, int64_t, int, int);                                   \
    static const NAME##_pass NAME##_PASSES[PK_NB][PK_MB] = {PK_TABLE_ROW(NAME, 1), PK_TABLE_ROW(NAME, 2),             \
                                                            PK_TABLE_ROW(NAME, 3), PK_TABLE_ROW(NAME, 4)};            \
    TARGET void NAME(const T *x, const T *p, const T *b, T *y, int64_t M, int64_t N, int64_t K, int threads) {        \
        _Static_assert(PK_MB == 6 && PK_NB == 4, "the pass table above has 6 x 4 shapes");                            \
        if (M <= 0)                                                                                                   \
            return;                                                                                                   \
        if (M > PK_SLAB) {                                                                                            \
            for (int64_t r = 0; r < M; r += PK_SLAB)                                                                  \
                NAME(x + r * K, p, b, y + r * N, M - r < PK_SLAB ? M - r : PK_SLAB, N, K, threads);                   \
            return;                                                                                                   \
        }                                                                                                             \
        const int64_t blocks = (N + 15) / 16, groups = (blocks + PK_NB - 1) / PK_NB, steps = (STEPS);                 \
        const int64_t passes = (M + PK_MB - 1) / PK_MB, per = (M + passes - 1) / passes; /* 8 rows: 4 + 4 */          \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                             \
        for (int64_t g = 0; g < groups; g++) {                                                                        \
            const int64_t blk0 = g * PK_NB, nb = blocks - blk0 < PK_NB ? blocks - blk0 : PK_NB;                       \
            const T *src = (const T *)((const char *)p + blk0 * steps * 64);                                          \
            if (passes == 1) { /* the group's stream once */                                                          \
                NAME##_PASSES[nb - 1][M - 1](x, src, b, y, 0, blk0, N, K, 0, steps, NULL,                             \
                                             (const char *)src + PK_AHEAD, M <= PK_LONE ? 0 : nb * steps * 64, 1, 1); \
                continue;                                                                                             \
            }                                                                                                         \
            float sums[passes][PK_MB * PK_NB * 16] __attribute__((aligned(64)));                                      \
            for (int64_t s0 = 0; s0 < steps; s0 += PK_CHUNK) {                                                        \
                const int64_t s1 = s0 + PK_CHUNK < steps ? s0 + PK_CHUNK : steps, bytes = PK_CHUNK * nb * 64;         \
                const char *next = (const char *)src + s1 * nb * 64; /* the stream past this chunk */                 \
                for (int64_t pass = 0, m = 0; m < M; pass++, m += per) {                                              \
                    const int64_t rows = M - m < per ? M - m : per, pf0 = bytes * pass / passes;                      \
                    NAME##_PASSES[nb - 1][rows - 1](x, src, b, y, m, blk0, N, K, s0, s1, sums[pass], next + pf0,      \
                                                    bytes * (pass + 1) / passes - pf0, s0 == 0, s1 == steps);         \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
    }

/* 16 bf16 values at p as fp32 (AVX-512F; inlined into the AMX kernel, the row argmax, the int8 kernel) */
static inline __attribute__((target("avx512f"), always_inline)) __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#define ARGMAX_TARGET __attribute__((target("avx512f,avx512bw")))
/* 16 elements (fp32 lanes), and one, of an fp32 or bf16 array (the row argmax, the int8 kernel) */
static inline ARGMAX_TARGET __m512 load16(const void *x, int64_t i, int bf16) {
    return bf16 ? load_bf16x16((const uint16_t *)x + i) : _mm512_loadu_ps((const float *)x + i);
}

static inline float value_at(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* AMX's tile configuration (ldtilecfg's 64-byte operand, palette 1) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
#endif
