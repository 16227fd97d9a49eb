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
 * the same compact list, hence bitwise the same output. Written with GCC vector extensions and no
 * fused multiply-adds (-ffp-contract=off), so the AVX-512 and AVX2 builds compute the same values.
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

/* 16 floats from p (the first `count` of them; the rest 0) */
static inline __attribute__((always_inline)) v16 load_f32(const float *p, int64_t count) {
    v16 v = {0};
    if (count >= 16) memcpy(&v, p, sizeof v);
    else for (int64_t l = 0; l < count; l++) v[l] = p[l];
    return v;
}

static inline __attribute__((always_inline)) v16 load_bf16(const uint16_t *p, int64_t count) {
    u16x16 h = {0};
    if (count >= 16) memcpy(&h, p, sizeof h);
    else for (int64_t l = 0; l < count; l++) h[l] = p[l];
    u16x32 w = __builtin_convertvector(h, u16x32) << 16;
    v16 v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) v16 load_row(const void *p, int64_t offset, int64_t count, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)p + offset, count) : load_f32((const float *)p + offset, count);
}

/* the 16 lanes summed: halves added four times (one network for every caller) */
static inline __attribute__((always_inline)) float lane_sum(v16 v) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    v8 a, b;
    memcpy(&a, &v, 32), memcpy(&b, (char *)&v + 32, 32);
    v8 s8 = a + b;
    v4 c, d;
    memcpy(&c, &s8, 16), memcpy(&d, (char *)&s8 + 16, 16);
    v4 s4 = c + d;
    float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
    return s2a + s2b;
}

/* lane_sum of 16 vectors at once: out[l] = lane_sum(a[l]) for a given in the slot order PERM
 * (a[k] holds key PERM[k]; PERM is its own inverse). Each key's lanes are added by the same four
 * halvings as lane_sum, in the same order, so a key's sum does not depend on its slot. */
static const int PERM[16] = {0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15};

static inline __attribute__((always_inline)) v16 lane_sums(const v16 *a) {
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

/* e^x for x <= 0 (lanes below -87.3 give 0): Cephes' expf, n = round(x / ln 2), r = x - n ln 2,
 * a degree-6 polynomial; the same operations in every lane */
static inline __attribute__((always_inline)) v16 vexp(v16 x) {
    const i16 under = x < -87.3f; /* lanes of -1 where x < -87.3 */
    i16 xb;
    memcpy(&xb, &x, sizeof xb);
    const v16 floor_value = (v16){0} - 87.3f;
    i16 fb;
    memcpy(&fb, &floor_value, sizeof fb);
    xb = (xb & ~under) | (fb & under);
    v16 xc;
    memcpy(&xc, &xb, sizeof xc);
    v16 fx = xc * 1.44269504088896341f - 0.5f; /* x <= 0: round to nearest = truncate(x / ln2 - 0.5) */
    i16 n = __builtin_convertvector(fx, i16);
    v16 nf = __builtin_convertvector(n, v16);
    v16 y;
    CEPHES_EXP(v16, i16, xc, n, nf, y);
    i16 yb;
    memcpy(&yb, &y, sizeof yb);
    yb = yb & ~under;
    memcpy(&y, &yb, sizeof y);
    return y;
}


/* lanes of `a` where `take` is set replaced by those of `b` (bitwise: no arithmetic) */
static inline __attribute__((always_inline)) v16 select16(i16 take, v16 a, v16 b) {
    i16 ab, bb;
    memcpy(&ab, &a, sizeof ab), memcpy(&bb, &b, sizeof bb);
    ab = (ab & ~take) | (bb & take);
    memcpy(&a, &ab, sizeof a);
    return a;
}

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

/* The rows of one batch entry b and one key-value head g: the `group` query heads that share it
 * times the n queries, R rows (r = head_in_group * n + i). Keys and values are converted 16 at a
 * time and used by every row that may see them, in increasing key order, so each row's arithmetic
 * is the one-row arithmetic of the module comment. A row that sees a whole block of 16 keys (a
 * chain's cached keys, a tree node's prefix) stores its 16 scores at once; the others place them
 * one by one. Values: each row adds e_j v_j for j up to the last key it sees (exact zeros for the
 * keys it does not see in between), its accumulator held in registers over a block.
 * Scratch: scores [R, L + 16], top / total [R], count / prefix / last [R], q / acc / top [R, .] vectors. */
static inline __attribute__((always_inline)) void attend_group(
    const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t b, int64_t g, int64_t group,
    int64_t H, int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h, int64_t qs_n, int64_t ks_b, int64_t ks_h,
    int64_t ks_l, int64_t ms_b, int64_t ms_n, float scale, int bf16, float *scores, float *top, float *total,
    int64_t *count, int64_t *prefix, int64_t *last_key, v16 *qv, v16 *acc, v16 *topv) {
    const int64_t R = group * n, chunks = (d + 15) / 16, stride = L + 16, width = bf16 ? 2 : 4;
    const char *kb = (const char *)k + (b * ks_b + g * ks_h) * width, *vb = (const char *)v + (b * ks_b + g * ks_h) * width;
    for (int64_t r = 0; r < R; r++) {
        const int64_t h = g * group + r / n, i = r % n;
        const char *qr = (const char *)q + (b * qs_b + h * qs_h + i * qs_n) * width;
        for (int64_t t = 0; t < chunks; t++) qv[r * chunks + t] = load_row(qr, t * 16, d - t * 16, bf16);
        top[r] = -3.0e38f, count[r] = 0, prefix[r] = 0, last_key[r] = -1;
        topv[r] = (v16){0} - 3.0e38f;
    }
    const uint8_t *mrow = mask ? mask + b * ms_b : NULL;
    v16 block[16 * 16]; /* d <= 256; 16 keys' (then values') chunks */
    for (int64_t j0 = 0; j0 < L; j0 += 16) { /* scores of 16 keys at a time, compact per row */
        const int64_t keys = L - j0 < 16 ? L - j0 : 16;
        for (int64_t slot = 0; slot < 16; slot++)
            for (int64_t t = 0; t < chunks; t++)
                block[slot * chunks + t] = PERM[slot] < keys
                    ? load_row(kb + (j0 + PERM[slot]) * ks_l * width, t * 16, d - t * 16, bf16) : (v16){0};
        for (int64_t r = 0; r < R; r++) {
            const int64_t i = r % n, last = mrow ? L : L - n + i; /* chain: keys beyond `last` are masked */
            const uint8_t *seen = mrow ? mrow + i * ms_n : NULL;
            int whole;
            if (seen) {
                whole = mask_block(seen + j0, keys);
                if (whole < 0) continue;
            } else {
                if (j0 > last) continue;
                whole = keys == 16 && j0 + 15 <= last;
            }
            const v16 *qr = qv + r * chunks;
            v16 dots[16];
            for (int64_t slot = 0; slot < 16; slot++) {
                const v16 *kr = block + slot * chunks;
                v16 s = qr[0] * kr[0];
                for (int64_t t = 1; t < chunks; t++) s = s + qr[t] * kr[t];
                dots[slot] = s;
            }
            const v16 sums = lane_sums(dots) * scale;
            float *row = scores + r * stride;
            int64_t c = count[r];
            if (whole > 0) {
                memcpy(row + c, &sums, sizeof sums);
                topv[r] = select16(sums > topv[r], topv[r], sums);
                if (c == j0) prefix[r] = j0 + 16; /* compact index = key index so far */
                count[r] = c + 16, last_key[r] = j0 + 15;
                continue;
            }
            float best = top[r];
            for (int64_t jj = 0; jj < keys; jj++) {
                const int64_t j = j0 + jj;
                if (seen ? !seen[j] : j > last) continue;
                const float score = sums[jj];
                row[c++] = score;
                best = score > best ? score : best;
                last_key[r] = j;
            }
            count[r] = c, top[r] = best;
        }
    }
    for (int64_t r = 0; r < R; r++) { /* e = exp(score - top), summed in 16 lanes by compact index */
        float *row = scores + r * stride, best = top[r];
        for (int l = 0; l < 16; l++) best = topv[r][l] > best ? topv[r][l] : best;
        const int64_t m = count[r], padded = (m + 15) & ~(int64_t)15, i = r % n;
        for (int64_t c = m; c < padded; c++) row[c] = -1.0e30f;
        v16 sum = {0};
        for (int64_t c = 0; c < padded; c += 16) {
            v16 e = vexp(load_f32(row + c, 16) - best);
            sum = sum + e;
            memcpy(row + c, &e, sizeof e);
        }
        total[r] = lane_sum(sum);
        if (mrow) /* back to key order in place after the prefix (compact index <= key index): 0 where unseen */
            for (int64_t j = last_key[r], c = m - 1; j >= prefix[r]; j--)
                row[j] = mrow[i * ms_n + j] ? row[c--] : 0.0f;
        for (int64_t t = 0; t < chunks; t++) acc[r * chunks + t] = (v16){0};
    }
    for (int64_t j0 = 0; j0 < L; j0 += 16) { /* sum_j e_j v_j in key order, 16 values at a time */
        const int64_t keys = L - j0 < 16 ? L - j0 : 16;
        int64_t needed = 0; /* values of the block some row sees */
        for (int64_t r = 0; r < R; r++) {
            const int64_t end = last_key[r] - j0 + 1;
            needed = end > needed ? end : needed;
        }
        if (needed <= 0) continue;
        needed = needed < keys ? needed : keys;
        for (int64_t jj = 0; jj < needed; jj++)
            for (int64_t t = 0; t < chunks; t++) block[jj * chunks + t] = load_row(vb + (j0 + jj) * ks_l * width, t * 16, d - t * 16, bf16);
        for (int64_t r = 0; r < R; r++) {
            const int64_t end = last_key[r] - j0 + 1 < needed ? last_key[r] - j0 + 1 : needed;
            if (end <= 0) continue;
            const float *e = scores + r * stride + j0;
            v16 a[16];
            for (int64_t t = 0; t < chunks; t++) a[t] = acc[r * chunks + t];
            for (int64_t jj = 0; jj < end; jj++)
                for (int64_t t = 0; t < chunks; t++) a[t] = a[t] + e[jj] * block[jj * chunks + t];
            for (int64_t t = 0; t < chunks; t++) acc[r * chunks + t] = a[t];
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t h = g * group + r / n, i = r % n;
        char *o = (char *)out + (((b * n + i) * H + h) * d) * width;
        for (int64_t t = 0; t < chunks; t++) {
            const v16 value = count[r] ? acc[r * chunks + t] / total[r] : (v16){0}; /* no key: zeros (SDPA: NaN) */
            const int64_t lanes = d - t * 16 < 16 ? d - t * 16 : 16;
            if (bf16)
                for (int64_t l = 0; l < lanes; l++) ((uint16_t *)o)[t * 16 + l] = float_to_bf16(value[l]);
            else
                for (int64_t l = 0; l < lanes; l++) ((float *)o)[t * 16 + l] = value[l];
        }
    }
}

/* q [B, H, n, d], k / v [B, Hkv, L, d] (element strides given; the last dimension contiguous),
 * mask [B or 1, n, L] bytes (1: attend; stride ms_b = 0 broadcasts) or NULL: query i sees keys
 * j <= L - n + i (a chain after the cache); out [B, n, H, d] contiguous. fp32 or bf16 (`bf16`).
 * One thread: the rows are few. Returns 0, -1 where d > 256 or the scratch cannot be allocated. */
static inline __attribute__((always_inline)) int attention_body(
    const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t B, int64_t H, int64_t Hkv,
    int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h, int64_t qs_n, int64_t ks_b, int64_t ks_h, int64_t ks_l,
    int64_t ms_b, int64_t ms_n, float scale, int bf16) {
    if (d > 256 || d < 1 || Hkv < 1 || H % Hkv) return -1;
    const int64_t group = H / Hkv, R = group * n, chunks = (d + 15) / 16;
    float *scores = malloc((size_t)(R * (L + 16) + 2 * R) * sizeof(float));
    int64_t *count = malloc((size_t)(3 * R) * sizeof(int64_t));
    v16 *vectors = aligned_alloc(64, (size_t)(2 * R * chunks + R) * sizeof(v16));
    if (!scores || !count || !vectors) {
        free(scores), free(count), free(vectors);
        return -1;
    }
    /* the common head sizes compiled with d constant (unrolled, the key in registers); the same arithmetic */
#define GROUPS(D, BF16)                                                                                                \
    for (int64_t b = 0; b < B; b++)                                                                                    \
        for (int64_t g = 0; g < Hkv; g++)                                                                              \
            attend_group(q, k, v, mask, out, b, g, group, H, n, L, D, qs_b, qs_h, qs_n, ks_b, ks_h, ks_l, ms_b, ms_n,   \
                         scale, BF16, scores, scores + R * (L + 16), scores + R * (L + 16) + R, count, count + R,         \
                         count + 2 * R, vectors, vectors + R * chunks, vectors + 2 * R * chunks)
    if (d == 64 && bf16) GROUPS(64, 1);
    else if (d == 64) GROUPS(64, 0);
    else if (d == 128 && bf16) GROUPS(128, 1);
    else if (d == 128) GROUPS(128, 0);
    else GROUPS(d, bf16);
#undef GROUPS
    free(scores), free(count), free(vectors);
    return 0;
}

__attribute__((target("avx512f"))) int few_rows_attention_avx512(
    const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t B, int64_t H, int64_t Hkv,
    int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h, int64_t qs_n, int64_t ks_b, int64_t ks_h, int64_t ks_l,
    int64_t ms_b, int64_t ms_n, float scale, int bf16) {
    return attention_body(q, k, v, mask, out, B, H, Hkv, n, L, d, qs_b, qs_h, qs_n, ks_b, ks_h, ks_l, ms_b, ms_n, scale,
                          bf16);
}

int few_rows_attention(const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t B, int64_t H,
                       int64_t Hkv, int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h, int64_t qs_n, int64_t ks_b,
                       int64_t ks_h, int64_t ks_l, int64_t ms_b, int64_t ms_n, float scale, int bf16) {
    return attention_body(q, k, v, mask, out, B, H, Hkv, n, L, d, qs_b, qs_h, qs_n, ks_b, ks_h, ks_l, ms_b, ms_n, scale,
                          bf16);
}
