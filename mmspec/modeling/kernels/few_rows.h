/* What the few-row linear kernels (linear_fp32.c, linear_bf16.c, linear_int8.c) and the row helpers
 * (verify.c) share: the row-blocking template of the vector kernels, bf16 loads into 16 fp32 lanes,
 * the AMX tile configuration. Internal to those files (static inline: each file its own copy, the
 * same instructions); the entry points they export are declared in kernels.h. */
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
