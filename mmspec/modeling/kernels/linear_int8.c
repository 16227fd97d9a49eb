/* y [M, N] = x [M, K] W^T (+ b) with W in int8, for drafters (a drafter may round as it likes: the
 * acceptance rule reads the distribution it drew from). w: the blob of mmspec.modeling.fused.pack_int8,
 * int8 q [N / 16, K / 4, 16, 4] (W[n, k] ~ scale[n] q[n, k], scale[n] = max_k |W[n, k]| / 127), then
 * float scale [N], then int32 rowsum [N] = sum_k q[n, k]. Each row of x (model dtype: bf16 if `bf16`,
 * else fp32) is quantised symmetrically, s = max_k |x_k| / 127 (1 for a zero row), a_k = round(x_k / s)
 * (nearest even) in [-127, 127], and summed in int32 exactly as u8 a_k + 128 against q (AVX512-VNNI
 * vpdpbusd, 16 outputs a register, each block of 16 outputs read once for all the rows), summed
 * the way `path` names (enum i8_path; mmspec.modeling.kernel_ids.Int8Path): 1 VNNI; 2 AMX-INT8 tiles for two rows
 * or more where K % 64 == 0, ~3x VNNI's speed at 8-16 rows; 3 AVX2's vpmaddwd over the weights
 * widened to int16, for CPUs without VNNI; 0 a scalar loop; the same integers every way:
 *     y[n] = (float)(sum_k (a_k + 128) q[n, k] - 128 rowsum[n]) * (s * scale[n]) + b[n]
 * in fp32, then rounded to the model dtype. Half the bytes of bf16 weights: a drafter's head fits the
 * L2 cache (the voice's EAGLE head: 1 MB). N % 16 == 0, K % 4 == 0. Returns 0, or -1 (no scratch). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "few_rows.h"
#include "kernels.h"

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
#if MMSPEC_HAVE_AMX
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
#if MMSPEC_HAVE_AMX
    if (path == I8_PATH_AMX && K % 64 == 0 && M > 1) {
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
    char *scratch = malloc((size_t)(M * K + 4 * M * N + 4 * M + (path == I8_PATH_AVX2 ? 32 * K : 0)));
    if (!scratch) return -1;
    uint8_t *a = (uint8_t *)scratch;
    int32_t *acc = (int32_t *)(scratch + M * K);
    float *steps = (float *)(acc + M * N);
    if (path == I8_PATH_VNNI || path == I8_PATH_AMX) { /* the AVX-512 forms of the two loops below: the same operations per element */
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
    if (path == I8_PATH_AVX2)
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
