/* Batch-invariant attention for the few-query steps of speculative decoding (fp32 or bf16).
 *
 * out[b, i, h] = sum_j softmax_j(scale q[b, h, i] . k[b, g(h), j]) v[b, g(h), j] over the keys j
 * query i may see (g(h) = h / (H / Hkv): grouped-query attention).
 *
 * Why not SDPA: a verification forward must give each query row exactly what a one-token step
 * gives it, or greedy speculative decoding stops being plain decoding. PyTorch's CPU attention
 * blocks its work by the number of queries, so in bf16 a chain of n tokens gets logits up to 0.75
 * away from n one-token steps (the embedded captioner). Here every query row is computed alone,
 * by the same operations in the same order whatever the other rows, the mask layout or the number
 * of threads:
 *   1. the keys it may see, in increasing cache order (a tree node: the prefix, then its
 *      ancestors; a one-token step: every cached key) are listed: its "compact" keys 0 .. m-1;
 *   2. score_c = scale * (q . k_c): 16-lane products summed over d in chunks of 16, then the 16
 *      lanes halved four times (the same network for every key);
 *   3. e_c = exp(score_c - max) (a vector polynomial, the same result in every lane), summed in 16
 *      lanes by compact index, the lanes halved as in 2;
 *   4. out = (sum_c e_c v_c, in compact order) / sum, rounded once to the output dtype.
 * A tree node whose ancestors sit at other cache slots than the same tokens would in a chain gets
 * the same compact list, hence bitwise the same output. Written once (attention_group.h) over two kits
 * of GCC vector operations with the same fused multiply-adds: 16 lanes in one AVX-512 register, or in
 * two AVX2 ones (GCC 12 kept a 64-byte vector in memory on AVX2: that build took 3-10x the AVX-512
 * one's time), so the AVX-512 and AVX2 builds compute the same values.
 */
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC optimize("fp-contract=fast") /* a * b + c fused: the same in the AVX-512 and AVX2 (FMA) builds */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "vmath.h"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint32_t u16x32 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint32_t u8x32 __attribute__((vector_size(32)));
typedef uint16_t u8x16 __attribute__((vector_size(16)));
typedef float v4 __attribute__((vector_size(16)));

/* The lanes' order in lane_sums: a[k] holds key PERM[k] (PERM is its own inverse). Each key's lanes
 * are added by the same four halvings as lane_sum, in the same order, so a key's sum does not depend
 * on its slot. */
static const int PERM[16] = {0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15};

/* 16 mask bytes: 1 when all are set, -1 when none of the first `keys` is, else 0 */
static inline __attribute__((always_inline)) int mask_block(const uint8_t *m, int64_t keys) {
    if (keys == 16) {
        uint64_t lo, hi;
        memcpy(&lo, m, 8), memcpy(&hi, m + 8, 8);
        if (lo == 0x0101010101010101ull && hi == 0x0101010101010101ull) return 1;
        return lo == 0 && hi == 0 ? -1 : 0;
    }
    for (int64_t j = 0; j < keys; j++)
        if (m[j]) return 0;
    return -1;
}

/* e^x for x <= 0 (lanes below -87.3 give 0) over vectors VT (ints IT): Cephes' expf, n = round(x /
 * ln 2), r = x - n ln 2, a degree-6 polynomial; the same operations in every lane and at either width */
#define NEGATIVE_EXP(NAME, VT, IT)                                                                         \
    static inline __attribute__((always_inline)) VT NAME(VT x) {                                           \
        const IT under = x < -87.3f; /* lanes of -1 where x < -87.3 */                                     \
        IT xb;                                                                                             \
        memcpy(&xb, &x, sizeof xb);                                                                        \
        const VT floor_value = (VT){0} - 87.3f;                                                            \
        IT fb;                                                                                             \
        memcpy(&fb, &floor_value, sizeof fb);                                                              \
        xb = (xb & ~under) | (fb & under);                                                                 \
        VT xc;                                                                                             \
        memcpy(&xc, &xb, sizeof xc);                                                                       \
        VT fx = xc * 1.44269504088896341f - 0.5f; /* x <= 0: round to nearest = truncate(x / ln2 - 0.5) */ \
        IT n = __builtin_convertvector(fx, IT);                                                            \
        VT nf = __builtin_convertvector(n, VT);                                                            \
        VT y;                                                                                              \
        CEPHES_EXP(VT, IT, xc, n, nf, y);                                                                  \
        IT yb;                                                                                             \
        memcpy(&yb, &y, sizeof yb);                                                                        \
        yb = yb & ~under;                                                                                  \
        memcpy(&y, &yb, sizeof y);                                                                         \
        return y;                                                                                          \
    }
NEGATIVE_EXP(exp16, v16, i16)
NEGATIVE_EXP(exp8, v8, i8)

/* lanes of `a` where `take` is set replaced by those of `b` (bitwise: no arithmetic) */
#define SELECT(NAME, VT, IT)                                                                               \
    static inline __attribute__((always_inline)) VT NAME(IT take, VT a, VT b) {                            \
        IT ab, bb;                                                                                         \
        memcpy(&ab, &a, sizeof ab), memcpy(&bb, &b, sizeof bb);                                            \
        ab = (ab & ~take) | (bb & take);                                                                   \
        memcpy(&a, &ab, sizeof a);                                                                         \
        return a;                                                                                          \
    }
SELECT(select16, v16, i16)
SELECT(select8, v8, i8)

/* the 8 lanes of a v8 summed: halves added three times (lane_sum's last steps) */
static inline __attribute__((always_inline)) float lane_sum8(v8 s8) {
    v4 c, d;
    memcpy(&c, &s8, 16), memcpy(&d, (char *)&s8 + 16, 16);
    v4 s4 = c + d;
    float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
    return s2a + s2b;
}

/* ---- the wide kit: a 16-lane vector in one AVX-512 register (w_*, inlined into the AVX-512 entry) */

/* 16 floats from p + offset (the first `count` of them; the rest 0), model dtype bf16 or fp32 */
static inline __attribute__((always_inline)) v16 w_load(const void *p, int64_t offset, int64_t count, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)p + offset;
        u16x16 h = {0};
        if (count >= 16) memcpy(&h, s, sizeof h);
        else for (int64_t l = 0; l < count; l++) h[l] = s[l];
        u16x32 w = __builtin_convertvector(h, u16x32) << 16;
        v16 v;
        memcpy(&v, &w, sizeof v);
        return v;
    }
    const float *s = (const float *)p + offset;
    v16 v = {0};
    if (count >= 16) memcpy(&v, s, sizeof v);
    else for (int64_t l = 0; l < count; l++) v[l] = s[l];
    return v;
}
static inline __attribute__((always_inline)) v16 w_zero(void) { return (v16){0}; }
static inline __attribute__((always_inline)) v16 w_splat(float x) {
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
static inline __attribute__((always_inline)) v16 w_add(v16 a, v16 b) { return a + b; }
static inline __attribute__((always_inline)) v16 w_mul(v16 a, v16 b) { return a * b; }
static inline __attribute__((always_inline)) v16 w_fma(v16 s, v16 a, v16 b) { return s + a * b; }
static inline __attribute__((always_inline)) v16 w_fmas(v16 s, float a, v16 b) { return s + a * b; }
static inline __attribute__((always_inline)) v16 w_muls(v16 a, float s) { return a * s; }
static inline __attribute__((always_inline)) v16 w_subs(v16 a, float s) { return a - s; }
static inline __attribute__((always_inline)) v16 w_divs(v16 a, float s) { return a / s; }
static inline __attribute__((always_inline)) v16 w_exp(v16 x) { return exp16(x); }
static inline __attribute__((always_inline)) v16 w_max_into(v16 top, v16 x) { return select16(x > top, top, x); }
static inline __attribute__((always_inline)) void w_store(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline __attribute__((always_inline)) float w_get(v16 v, int64_t l) { return v[l]; }

/* the 16 lanes summed: halves added four times (one network for every caller) */
static inline __attribute__((always_inline)) float w_lane_sum(v16 v) {
    v8 a, b;
    memcpy(&a, &v, 32), memcpy(&b, (char *)&v + 32, 32);
    return lane_sum8(a + b);
}

/* w_lane_sum of 16 vectors at once: out[l] = w_lane_sum(a[l]) for a given in the slot order PERM */
static inline __attribute__((always_inline)) v16 w_lane_sums(const v16 *a) {
    const i16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16 lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i16 hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i16 lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i16 hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i16 even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const i16 odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 b[8], c[4], d[2];
    for (int p = 0; p < 8; p++) b[p] = __builtin_shuffle(a[2 * p], a[2 * p + 1], lo8) + __builtin_shuffle(a[2 * p], a[2 * p + 1], hi8);
    for (int p = 0; p < 4; p++) c[p] = __builtin_shuffle(b[2 * p], b[2 * p + 1], lo4) + __builtin_shuffle(b[2 * p], b[2 * p + 1], hi4);
    for (int p = 0; p < 2; p++) d[p] = __builtin_shuffle(c[2 * p], c[2 * p + 1], lo2) + __builtin_shuffle(c[2 * p], c[2 * p + 1], hi2);
    return __builtin_shuffle(d[0], d[1], even) + __builtin_shuffle(d[0], d[1], odd);
}

/* ---- the narrow kit: a 16-lane vector as two AVX2 registers, lanes 0-7 and 8-15 (n_*): the wide
 * kit's operations lane by lane, its shuffles as the same additions within and across the halves */
typedef struct {
    v8 lo, hi;
} n16;

static inline __attribute__((always_inline)) n16 n_load(const void *p, int64_t offset, int64_t count, int bf16) {
    n16 v;
    if (count >= 16) {
        if (bf16) {
            const uint16_t *s = (const uint16_t *)p + offset;
            u8x16 a, b;
            memcpy(&a, s, sizeof a), memcpy(&b, s + 8, sizeof b);
            const u8x32 wa = __builtin_convertvector(a, u8x32) << 16, wb = __builtin_convertvector(b, u8x32) << 16;
            memcpy(&v.lo, &wa, sizeof v.lo), memcpy(&v.hi, &wb, sizeof v.hi);
        } else {
            memcpy(&v.lo, (const float *)p + offset, sizeof v.lo), memcpy(&v.hi, (const float *)p + offset + 8, sizeof v.hi);
        }
        return v;
    }
    float lanes[16] = {0};
    for (int64_t l = 0; l < count; l++)
        lanes[l] = bf16 ? bf16_to_float(((const uint16_t *)p)[offset + l]) : ((const float *)p)[offset + l];
    memcpy(&v.lo, lanes, sizeof v.lo), memcpy(&v.hi, lanes + 8, sizeof v.hi);
    return v;
}
static inline __attribute__((always_inline)) n16 n_zero(void) { return (n16){{0}, {0}}; }
static inline __attribute__((always_inline)) n16 n_splat(float x) {
    const v8 h = {x, x, x, x, x, x, x, x};
    return (n16){h, h};
}
static inline __attribute__((always_inline)) n16 n_add(n16 a, n16 b) { return (n16){a.lo + b.lo, a.hi + b.hi}; }
static inline __attribute__((always_inline)) n16 n_mul(n16 a, n16 b) { return (n16){a.lo * b.lo, a.hi * b.hi}; }
static inline __attribute__((always_inline)) n16 n_fma(n16 s, n16 a, n16 b) {
    return (n16){s.lo + a.lo * b.lo, s.hi + a.hi * b.hi};
}
static inline __attribute__((always_inline)) n16 n_fmas(n16 s, float a, n16 b) {
    return (n16){s.lo + a * b.lo, s.hi + a * b.hi};
}
static inline __attribute__((always_inline)) n16 n_muls(n16 a, float s) { return (n16){a.lo * s, a.hi * s}; }
static inline __attribute__((always_inline)) n16 n_subs(n16 a, float s) { return (n16){a.lo - s, a.hi - s}; }
static inline __attribute__((always_inline)) n16 n_divs(n16 a, float s) { return (n16){a.lo / s, a.hi / s}; }
static inline __attribute__((always_inline)) n16 n_exp(n16 x) { return (n16){exp8(x.lo), exp8(x.hi)}; }
static inline __attribute__((always_inline)) n16 n_max_into(n16 top, n16 x) {
    return (n16){select8(x.lo > top.lo, top.lo, x.lo), select8(x.hi > top.hi, top.hi, x.hi)};
}
static inline __attribute__((always_inline)) void n_store(float *p, n16 v) {
    memcpy(p, &v.lo, sizeof v.lo), memcpy(p + 8, &v.hi, sizeof v.hi);
}
static inline __attribute__((always_inline)) float n_get(n16 v, int64_t l) { return l < 8 ? v.lo[l] : v.hi[l - 8]; }
static inline __attribute__((always_inline)) float n_lane_sum(n16 v) { return lane_sum8(v.lo + v.hi); }

/* w_lane_sums on halves: level 1 adds a vector's halves (lo8 / hi8 pick them whole), levels 2-3 the
 * same 128- and 64-bit pieces within each half, level 4 the even and odd lanes of one vector */
static inline __attribute__((always_inline)) n16 n_lane_sums(const n16 *a) {
    const i8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    const i8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const i8 even = {0, 2, 4, 6, 8, 10, 12, 14}, odd = {1, 3, 5, 7, 9, 11, 13, 15};
    n16 b[8], c[4], d[2];
    for (int p = 0; p < 8; p++) b[p] = (n16){a[2 * p].lo + a[2 * p].hi, a[2 * p + 1].lo + a[2 * p + 1].hi};
    for (int p = 0; p < 4; p++)
        c[p] = (n16){__builtin_shuffle(b[2 * p].lo, b[2 * p + 1].lo, lo4) + __builtin_shuffle(b[2 * p].lo, b[2 * p + 1].lo, hi4),
                     __builtin_shuffle(b[2 * p].hi, b[2 * p + 1].hi, lo4) + __builtin_shuffle(b[2 * p].hi, b[2 * p + 1].hi, hi4)};
    for (int p = 0; p < 2; p++)
        d[p] = (n16){__builtin_shuffle(c[2 * p].lo, c[2 * p + 1].lo, lo2) + __builtin_shuffle(c[2 * p].lo, c[2 * p + 1].lo, hi2),
                     __builtin_shuffle(c[2 * p].hi, c[2 * p + 1].hi, lo2) + __builtin_shuffle(c[2 * p].hi, c[2 * p + 1].hi, hi2)};
    return (n16){__builtin_shuffle(d[0].lo, d[0].hi, even) + __builtin_shuffle(d[0].lo, d[0].hi, odd),
                 __builtin_shuffle(d[1].lo, d[1].hi, even) + __builtin_shuffle(d[1].lo, d[1].hi, odd)};
}

#define VT v16
#define OP(name) w_##name
#define ENTRY(name) name##_wide
#include "attention_group.h"
#undef VT
#undef OP
#undef ENTRY
#define VT n16
#define OP(name) n_##name
#define ENTRY(name) name##_narrow
#include "attention_group.h"
#undef VT
#undef OP
#undef ENTRY

#define ATTENTION_ARGS                                                                                               \
    q, k, v, mask, out, B, H, Hkv, n, L, d, qs_b, qs_h, qs_n, ks_b, ks_h, ks_l, ms_b, ms_n, scale, bf16

__attribute__((target("avx512f"))) int few_rows_attention_avx512(
    const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t B, int64_t H, int64_t Hkv,
    int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h, int64_t qs_n, int64_t ks_b, int64_t ks_h, int64_t ks_l,
    int64_t ms_b, int64_t ms_n, float scale, int bf16) {
    return attention_body_wide(ATTENTION_ARGS);
}

int few_rows_attention(const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t B, int64_t H,
                       int64_t Hkv, int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h, int64_t qs_n, int64_t ks_b,
                       int64_t ks_h, int64_t ks_l, int64_t ms_b, int64_t ms_n, float scale, int bf16) {
    return attention_body_narrow(ATTENTION_ARGS);
}
