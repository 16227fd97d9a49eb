/* One Llama decoder layer over a few rows, in one call (fp32 or bf16):
 *
 *   h = x + W_o Attn(RoPE(W_q N1(x)), RoPE(W_k N1(x)), W_v N1(x))      N(x) = w * (x / rms(x))
 *   x' = h + W_down (SiLU(W_gate N2(h)) * W_up N2(h))
 *
 * A decoding step of a small model (the embedded voices and text-to-image generator: width 256, six
 * layers) is not arithmetic but ~25 PyTorch calls per layer of 10-40 us each; here the layer's
 * norms, projections (the few-row kernels of linear_*.c), rotary embedding, KV-cache write,
 * attention (attention.c) and MLP run in C. Every step is row-wise or one of those batch-invariant
 * kernels, so the rows of a verification get bitwise what one-token steps get. Roundings follow
 * PyTorch's modules in the model's dtype: bf16 results after each product, sum and activation
 * (norm: fp32 statistics, the normalised row rounded, then times the weight; SiLU in fp32, rounded).
 */
#pragma GCC diagnostic ignored "-Wpsabi"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "vmath.h"

/* 8-lane vectors (one AVX2 register): the element-wise work of the layer; 16-lane ones (AVX-512) for
 * the SiLU where the CPU has them. Both widths get their helpers from one template: the same
 * operations per element, so either width gives bitwise the same results. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef uint32_t u8v __attribute__((vector_size(32)));
typedef uint16_t h8v __attribute__((vector_size(16)));
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));
#define WIDE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

/* element i of a model-dtype array, a value rounded to the model dtype, and stores */
static inline float get(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void put(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
}
static inline float round_to(float v, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

/* For vectors VT (ints IT, unsigned UT, bf16 halves HT) and a target attribute ATTR, the helpers
 * ld##W / st##W (model-dtype loads and stores), bf16_bits##W (the bf16 bit patterns, rounded to
 * nearest-even: float_to_bf16 without its NaN case), vround##W (a value rounded to the model
 * dtype) and vexp##W (e^x, x clamped to [-87.3, 88.3]: Cephes' expf, n = round(x / ln 2), a
 * degree-6 polynomial). */
#define VECTOR_HELPERS(W, VT, IT, UT, HT, ATTR)                                                              \
    static inline ATTR VT ld##W(const void *p, int64_t i, int bf16) {                                        \
        VT v;                                                                                                \
        if (bf16) {                                                                                          \
            HT h;                                                                                            \
            memcpy(&h, (const uint16_t *)p + i, sizeof h);                                                   \
            UT w = __builtin_convertvector(h, UT) << 16;                                                     \
            memcpy(&v, &w, sizeof v);                                                                        \
        } else {                                                                                             \
            memcpy(&v, (const float *)p + i, sizeof v);                                                      \
        }                                                                                                    \
        return v;                                                                                            \
    }                                                                                                        \
    static inline ATTR UT bf16_bits##W(VT v) {                                                               \
        UT u;                                                                                                \
        memcpy(&u, &v, sizeof u);                                                                            \
        return (u + 0x7fff + ((u >> 16) & 1)) >> 16;                                                         \
    }                                                                                                        \
    static inline ATTR VT vround##W(VT v, int bf16) {                                                        \
        if (!bf16) return v;                                                                                 \
        UT u = bf16_bits##W(v) << 16;                                                                        \
        memcpy(&v, &u, sizeof v);                                                                            \
        return v;                                                                                            \
    }                                                                                                        \
    static inline ATTR void st##W(void *p, int64_t i, VT v, int bf16) {                                      \
        if (bf16) {                                                                                          \
            HT h = __builtin_convertvector(bf16_bits##W(v), HT);                                             \
            memcpy((uint16_t *)p + i, &h, sizeof h);                                                         \
        } else {                                                                                             \
            memcpy((float *)p + i, &v, sizeof v);                                                            \
        }                                                                                                    \
    }                                                                                                        \
    static inline ATTR VT vexp##W(VT x) {                                                                    \
        const VT lo = (VT){0} - 87.3f, hi = (VT){0} + 88.3f;                                                 \
        IT below = x < lo, above = x > hi;                                                                   \
        IT xb, lb, hb;                                                                                       \
        memcpy(&xb, &x, sizeof xb), memcpy(&lb, &lo, sizeof lb), memcpy(&hb, &hi, sizeof hb);                \
        xb = (xb & ~below & ~above) | (lb & below) | (hb & above);                                           \
        memcpy(&x, &xb, sizeof x);                                                                           \
        VT fx = x * 1.44269504088896341f;                                                                    \
        IT negative = fx < 0;                                                                                \
        VT half = (VT){0} + 0.5f;                                                                            \
        IT hbits, nbits;                                                                                     \
        memcpy(&hbits, &half, sizeof hbits);                                                                 \
        nbits = hbits | (negative & (IT){0} + (int32_t)0x80000000); /* +-0.5 toward fx's sign */             \
        memcpy(&half, &nbits, sizeof half);                                                                  \
        IT n = __builtin_convertvector(fx + half, IT);                                                       \
        VT nf = __builtin_convertvector(n, VT);                                                              \
        VT y;                                                                                                \
        CEPHES_EXP(VT, IT, x, n, nf, y);                                                                     \
        return y;                                                                                            \
    }
VECTOR_HELPERS(8, v8, i8v, u8v, h8v, )
VECTOR_HELPERS(16, v16, i16v, u16v, h16v, WIDE_TARGET)

/* y [M, N] = x [M, K] W^T + b through the few-row kernel `kind` (an enum linear_kernel) */
static int linear_kind(int kind, const void *x, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K,
                       int threads) {
    switch (kind) {
    case LINEAR_AVX2: few_rows_linear(x, w, b, y, M, N, K, threads); return 0;
    case LINEAR_AVX512: few_rows_linear_avx512(x, w, b, y, M, N, K, threads); return 0;
    case LINEAR_AVX512BF16: few_rows_linear_bf16(x, w, b, y, M, N, K, threads); return 0;
    case LINEAR_AMX: return few_rows_linear_amx(x, w, b, y, M, N, K, threads);
    case LINEAR_AMX_PACKED: return few_rows_linear_amx_packed(x, w, b, y, M, N, K, threads); /* the weights packed */
    case LINEAR_AVX512BF16_PACKED: few_rows_linear_bf16_packed(x, w, b, y, M, N, K, threads); return 0;
    case LINEAR_AVX512_PACKED: few_rows_linear_avx512_packed(x, w, b, y, M, N, K, threads); return 0;
    /* int8 weights (drafters): LINEAR_I8 + 2 path + (fp32 rows), path an enum i8_path */
    default: return few_rows_linear_i8(x, w, b, y, M, N, K, (kind - LINEAR_I8) % 2 == 0, (kind - LINEAR_I8) / 2);
    }
}
static int linear(const LayerSpec *s, const void *x, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K,
                  int threads) {
    return linear_kind(s->linear, x, w, b, y, M, N, K, threads);
}

/* out [M, D] = w * (x / sqrt(mean(x^2) + eps)): fp32 statistics (8 lanes, then the lanes in
 * order), the normalised row rounded to the model dtype, then the product with the weight rounded */
static void rms_norm(const void *x, const void *w, void *out, int64_t M, int64_t D, float eps, int bf16) {
    const int64_t D8 = D & ~(int64_t)7;
    for (int64_t m = 0; m < M; m++) {
        v8 acc = {0};
        for (int64_t i = 0; i < D8; i += 8) {
            const v8 v = ld8(x, m * D + i, bf16);
            acc = acc + v * v;
        }
        float sum = 0.0f;
        for (int l = 0; l < 8; l++) sum += acc[l];
        for (int64_t i = D8; i < D; i++) sum += get(x, m * D + i, bf16) * get(x, m * D + i, bf16);
        const float r = 1.0f / sqrtf(sum / (float)D + eps);
        for (int64_t i = 0; i < D8; i += 8)
            st8(out, m * D + i, ld8(w, i, bf16) * vround8(ld8(x, m * D + i, bf16) * r, bf16), bf16);
        for (int64_t i = D8; i < D; i++)
            put(out, m * D + i, get(w, i, bf16) * round_to(get(x, m * D + i, bf16) * r, bf16), bf16);
    }
}

/* y = x + y rounded, over `count` elements (the residual), into x */
static void add_into(void *x, const void *y, int64_t count, int bf16) {
    const int64_t c8 = count & ~(int64_t)7;
    for (int64_t e = 0; e < c8; e += 8) st8(x, e, ld8(x, e, bf16) + ld8(y, e, bf16), bf16);
    for (int64_t e = c8; e < count; e++) put(x, e, get(x, e, bf16) + get(y, e, bf16), bf16);
}

/* g = SiLU(g) rounded, times u, rounded: SiLU(a) = a / (1 + e^-a) in fp32 */
static void silu_times(void *g, const void *u, int64_t count, int bf16) {
    const int64_t c8 = count & ~(int64_t)7;
    for (int64_t e = 0; e < c8; e += 8) {
        const v8 a = ld8(g, e, bf16);
        const v8 act = vround8(a / (1.0f + vexp8(-a)), bf16);
        st8(g, e, act * ld8(u, e, bf16), bf16);
    }
    for (int64_t e = c8; e < count; e++) {
        const float a = get(g, e, bf16);
        v8 one = {0};
        one[0] = -a;
        const float act = round_to(a / (1.0f + vexp8(one)[0]), bf16);
        put(g, e, act * get(u, e, bf16), bf16);
    }
}

/* silu_times over 16 lanes (AVX-512; the caller checks the CPU has it): bitwise its results (the same
 * operations per element) at half the instructions; the SiLU's division and exponential are most
 * of a fused layer's element-wise time over a verification's rows. The tail takes silu_times. */
static WIDE_TARGET void silu_times_wide(void *g, const void *u, int64_t count, int bf16) {
    const int64_t c16 = count & ~(int64_t)15;
    for (int64_t e = 0; e < c16; e += 16) {
        const v16 a = ld16(g, e, bf16);
        const v16 act = vround16(a / (1.0f + vexp16(-a)), bf16);
        st16(g, e, act * ld16(u, e, bf16), bf16);
    }
    if (c16 < count) silu_times((char *)g + c16 * (bf16 ? 2 : 4), (const char *)u + c16 * (bf16 ? 2 : 4), count - c16, bf16);
}

/* rows [M = B n, heads hd] in place: the rotary embedding of each row's position */
static void rotate(const LayerSpec *s, void *t, int64_t B, int64_t n, int64_t heads, const void *cos, const void *sin,
                   int64_t rope_b) {
    const int64_t hd = s->hd, half = hd / 2;
    const int bf16 = s->bf16;
    float row[512];
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < heads; h++) {
                const int64_t base = ((b * n + i) * heads + h) * hd, hd8 = hd & ~(int64_t)7;
                for (int64_t e = 0; e < hd8; e += 8) {
                    const v8 v = ld8(t, base + e, bf16);
                    memcpy(row + e, &v, sizeof v);
                }
                for (int64_t e = hd8; e < hd; e++) row[e] = get(t, base + e, bf16);
                if (s->rope == 0) { /* x cos + rotate_half(x) sin, each product and the sum rounded */
                    const int64_t r = b * rope_b + i * hd;
                    if (half % 8 == 0) {
                        for (int64_t e = 0; e < hd; e += 8) {
                            v8 x, rot;
                            memcpy(&x, row + e, sizeof x);
                            memcpy(&rot, row + (e < half ? e + half : e - half), sizeof rot);
                            if (e < half) rot = -rot;
                            const v8 a = vround8(x * ld8(cos, r + e, bf16), bf16), c = vround8(rot * ld8(sin, r + e, bf16), bf16);
                            st8(t, base + e, a + c, bf16);
                        }
                    } else {
                        for (int64_t e = 0; e < hd; e++) {
                            const float rot = e < half ? -row[e + half] : row[e - half];
                            const float a = round_to(row[e] * get(cos, r + e, bf16), bf16);
                            const float c = round_to(rot * get(sin, r + e, bf16), bf16);
                            put(t, base + e, a + c, bf16);
                        }
                    }
                } else { /* pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s) in fp32, rounded once */
                    const float *table = (const float *)cos + b * rope_b + i * hd;
                    int64_t p = 0;
                    for (; 2 * p + 8 <= hd; p += 4) { /* four pairs at a time: the same products and sums */
                        v8 x, cs;
                        memcpy(&x, row + 2 * p, sizeof x);
                        memcpy(&cs, table + 2 * p, sizeof cs);
                        const i8v even = {0, 0, 2, 2, 4, 4, 6, 6}, odd = {1, 1, 3, 3, 5, 5, 7, 7};
                        const v8 x0 = __builtin_shuffle(x, even), x1 = __builtin_shuffle(x, odd);
                        const v8 c = __builtin_shuffle(cs, even), sn = __builtin_shuffle(cs, odd);
                        const v8 first = x0 * c - x1 * sn, second = x1 * c + x0 * sn;
                        st8(t, base + 2 * p, __builtin_shuffle(first, second, (i8v){0, 9, 2, 11, 4, 13, 6, 15}), bf16);
                    }
                    for (; p < half; p++) {
                        const float c = table[2 * p], sn = table[2 * p + 1], x0 = row[2 * p], x1 = row[2 * p + 1];
                        put(t, base + 2 * p, x0 * c - x1 * sn, bf16);
                        put(t, base + 2 * p + 1, x1 * c + x0 * sn, bf16);
                    }
                }
            }
}

/* The layer from its attention input on: h [M = B n, Kin] the rows the q / k / v projections read
 * (N1(x) for a Llama layer: Kin = D; EAGLE-3's [N1(e); Nh(g)]: Kin = 2 D), x [M, D] the residual,
 * which becomes the layer's output in place. Other arguments as lean_layer's. */
static int layer_from(const LayerSpec *s, void *x, const void *h, int64_t Kin, int64_t B, int64_t n, const void *cos,
                      const void *sin, int64_t rope_b, void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h, int64_t ks_l,
                      int64_t cached, const uint8_t *mask, int64_t ms_b, int64_t ms_n, int threads) {
    const int64_t M = B * n, D = s->D, H = s->H, Hkv = s->Hkv, hd = s->hd, I = s->I, width = s->bf16 ? 2 : 4;
    const int bf16 = s->bf16;
    if (hd > 256) return -1; /* the attention's limit */
    char *scratch = malloc((size_t)(M * (2 * D + 2 * H * hd + 2 * Hkv * hd + 2 * I)) * width);
    if (!scratch) return -1;
    char *normed = scratch, *q = normed + M * D * width, *k = q + M * H * hd * width, *v = k + M * Hkv * hd * width;
    char *o = v + M * Hkv * hd * width, *g = o + M * H * hd * width, *u = g + M * I * width, *y = u + M * I * width;
    int status = 0;
    status |= linear(s, h, s->wq, s->bq, q, M, H * hd, Kin, threads);
    status |= linear(s, h, s->wk, s->bk, k, M, Hkv * hd, Kin, threads);
    status |= linear(s, h, s->wv, s->bv, v, M, Hkv * hd, Kin, threads);
    rotate(s, q, B, n, H, cos, sin, rope_b);
    rotate(s, k, B, n, Hkv, cos, sin, rope_b);
    for (int64_t b = 0; b < B; b++) /* the new keys and values into the cache buffers */
        for (int64_t i = 0; i < n; i++)
            for (int64_t g2 = 0; g2 < Hkv; g2++) {
                const int64_t dst = (b * ks_b + g2 * ks_h + (cached + i) * ks_l) * width, src = (((b * n + i) * Hkv) + g2) * hd * width;
                memcpy((char *)kbuf + dst, k + src, (size_t)(hd * width));
                memcpy((char *)vbuf + dst, v + src, (size_t)(hd * width));
            }
    const int64_t L = cached + n;
    if (!status)
        status = (s->wide ? few_rows_attention_avx512 : few_rows_attention)(
            q, kbuf, vbuf, mask, o, B, H, Hkv, n, L, hd, n * H * hd, hd, H * hd, ks_b, ks_h, ks_l, ms_b, ms_n, s->scale, bf16);
    status |= linear(s, o, s->wo, s->bo, y, M, D, H * hd, threads);
    add_into(x, y, M * D, bf16);
    rms_norm(x, s->norm2, normed, M, D, s->eps2, bf16);
    status |= linear(s, normed, s->wg, NULL, g, M, I, D, threads);
    status |= linear(s, normed, s->wu, NULL, u, M, I, D, threads);
    (s->wide ? silu_times_wide : silu_times)(g, u, M * I, bf16);
    status |= linear(s, g, s->wd, NULL, y, M, D, I, threads);
    add_into(x, y, M * D, bf16);
    free(scratch);
    return status ? -1 : 0;
}

/* x [B n, D] in place. cos / sin: the rotary inputs of the n rows (row stride rope_b between batch
 * entries, 0 to share); kbuf / vbuf: the layer's key / value buffers [B, Hkv, capacity, hd] (strides
 * ks_*), whose positions [cached, cached + n) this call writes; mask: NULL (a chain after the cache)
 * or bytes [B or 1, n, cached + n]. Returns 0, or -1 (scratch not allocated, or a kernel failed). */
int lean_layer(const LayerSpec *s, void *x, int64_t B, int64_t n, const void *cos, const void *sin, int64_t rope_b,
               void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, const uint8_t *mask,
               int64_t ms_b, int64_t ms_n, int threads) {
    char *h = malloc((size_t)(B * n * s->D * (s->bf16 ? 2 : 4)));
    if (!h) return -1;
    rms_norm(x, s->norm1, h, B * n, s->D, s->eps1, s->bf16);
    const int status = layer_from(s, x, h, s->D, B, n, cos, sin, rope_b, kbuf, vbuf, ks_b, ks_h, ks_l, cached, mask, ms_b,
                                  ms_n, threads);
    free(h);
    return status;
}

/* Layers specs[0 .. count) one after the other over x (lean_layer each; layer l writes kbufs[l] /
 * vbufs[l], buffers of one shape), then, where norm is not NULL, x = norm * (x / rms(x)) with
 * `eps` (the model's final norm). One call for a whole decoder stack: the caller's per-layer work
 * (a few Python calls of ~5-30 us each) is gone. Returns 0, or -1 as lean_layer. */
int lean_layers(const LayerSpec *specs, int64_t count, void *x, int64_t B, int64_t n, const void *cos, const void *sin,
                int64_t rope_b, void *const *kbufs, void *const *vbufs, int64_t ks_b, int64_t ks_h, int64_t ks_l,
                int64_t cached, const uint8_t *mask, int64_t ms_b, int64_t ms_n, const void *norm, float eps, int threads) {
    for (int64_t l = 0; l < count; l++)
        if (lean_layer(specs + l, x, B, n, cos, sin, rope_b, kbufs[l], vbufs[l], ks_b, ks_h, ks_l, cached, mask, ms_b, ms_n,
                       threads))
            return -1;
    if (norm && count) {
        const int64_t D = specs[0].D, width = specs[0].bf16 ? 2 : 4;
        void *normed = malloc((size_t)(B * n * D * width));
        if (!normed) return -1;
        rms_norm(x, norm, normed, B * n, D, eps, specs[0].bf16);
        memcpy(x, normed, (size_t)(B * n * D * width));
        free(normed);
    }
    return 0;
}

/* Tree verification's cache compaction for every layer at once: in each of `count` buffers [outer,
 * capacity, row] (row bytes a position; `stride` bytes from one outer index to the next), the rows
 * start + indices[i] move to start + i (i < m). indices increase strictly, so every row is read
 * before a later move writes over it. */
void compact_rows(void *const *buffers, int64_t count, int64_t outer, int64_t stride, int64_t row, int64_t start,
                  const int64_t *indices, int64_t m) {
    for (int64_t c = 0; c < count; c++)
        for (int64_t o = 0; o < outer; o++) {
            char *base = (char *)buffers[c] + o * stride + start * row;
            for (int64_t i = 0; i < m; i++)
                if (indices[i] != i) memcpy(base + i * row, base + indices[i] * row, (size_t)row);
        }
}

/* A one-layer feature head's draft chain in one call (EAGLE on a single-stream codec LM:
 * mmspec.drafters.steps.CodecEagleDrafter), what its Python loop does with ~40 tensor calls a code:
 *
 *   feed the n0 pairs [e(c_j); f_j]:  f = N(Layer(W_fc [e(c_j); f_j] + b_fc)),  f^ = its last row
 *   for i < k:  logits = W_out f^ + b_out [C];  x_i ~ softmax(logits / T) (T <= 0: the first argmax)
 *               if i + 1 < k:  f^ = N(Layer(W_fc [e(x_i); f^] + b_fc))  at the next position
 *
 * with e(c) = table[c] + align[min(align_start + j, align_rows - 1)] for the j-th position fed (rounded
 * as one tensor addition; table[c] alone where align is NULL), and e(x_i) read at table row ids[x_i]
 * where ids is not NULL (a draft vocabulary's token ids: the pairs' codes are table rows already). s: the head layer's spec; norm / eps: its final norm; fc_* / out_*:
 * weight, bias (or NULL) and the few-row kernel code of each projection (LayerSpec.linear's codes; 4
 * reads a packed weight); C: the output's width; codes [n0] (< C) and features [n0, D]: the pairs to
 * feed; table [C, D]; align [align_rows, D] or NULL; cos / sin [n0 + k - 1, hd]: the rotary rows of
 * the positions fed (the pairs', then the drafted codes'); kbuf / vbuf: the head's cache buffers (room
 * for n0 + k - 1 positions after `cached`, which this call writes and the caller keeps or drops). The
 * draws' distributions go to probs [k, probs_stride] (columns < C; the fp32 softmax of logits / T),
 * the codes to tokens [k]: the first index whose cumulative probability (double, in order) exceeds
 * uniforms[i] x the total, as mmspec.core.sampling.sample_from_probs draws. stop_below > 0 ends the
 * chain early, after the first draw i where the product of the draws' confidences so far (q of each
 * code drawn; greedy: softmax(logits) of the maximum) is below it (chain_stops): the codes after it
 * are not drawn, their positions not fed. Returns the codes drawn (1..k), or -1 (no scratch, or a
 * kernel failed). */
static inline const char *align_row(const void *align, int64_t row, int64_t rows, int64_t row_bytes) {
    return (const char *)align + (row < rows ? row : rows - 1) * row_bytes;
}

/* The pairs [e(c_j); f_j] (j < n0) through fc, the head layer and its norm: h [n0, D] <- the head's
 * outputs (x: scratch [n0, 2 D]), the layer's keys and values at positions cached .. cached + n0 - 1. */
static int feed_pairs(const LayerSpec *s, const void *norm, float eps, const void *fc_w, const void *fc_b, int fc_kind,
                      const int64_t *codes, const void *features, int64_t n0, const void *table, const void *align,
                      int64_t align_start, int64_t align_rows, const void *cos, const void *sin, void *kbuf, void *vbuf,
                      int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, char *x, char *h, int threads) {
    const int64_t D = s->D, row_bytes = D * (s->bf16 ? 2 : 4);
    void *kbufs[1] = {kbuf}, *vbufs[1] = {vbuf};
    for (int64_t j = 0; j < n0; j++) {
        memcpy(x + 2 * j * row_bytes, (const char *)table + codes[j] * row_bytes, (size_t)row_bytes);
        if (align) add_into(x + 2 * j * row_bytes, align_row(align, align_start + j, align_rows, row_bytes), D, s->bf16);
        memcpy(x + (2 * j + 1) * row_bytes, (const char *)features + j * row_bytes, (size_t)row_bytes);
    }
    int status = linear_kind(fc_kind, x, fc_w, fc_b, h, n0, D, 2 * D, threads);
    if (!status)
        status = lean_layers(s, 1, h, 1, n0, cos, sin, 0, kbufs, vbufs, ks_b, ks_h, ks_l, cached, NULL, 0, 0, norm, eps, threads);
    return status;
}

/* Draw i of a chain from logits [C] (model dtype): temperature <= 0: the first maximum; else
 * q = probs + i probs_stride [C] <- the fp32 softmax of logits / T and the first index whose
 * cumulative probability (double, in order) exceeds uniforms[i] x the total, as
 * mmspec.core.sampling.sample_from_probs draws. row: fp32 scratch [C]. conf (or NULL): the draft's
 * confidence in the index drawn, q of it (greedy: softmax(logits) of the maximum, 1 / sum exp(l - top)). */
static int64_t draw_code(const void *logits, int64_t C, int bf16, float temperature, const float *uniforms, float *probs,
                         int64_t probs_stride, int64_t i, float *row, float *conf) {
    int64_t best = 0;
    if (temperature <= 0.0f) {
        float top = get(logits, 0, bf16);
        for (int64_t c = 1; c < C; c++)
            if (get(logits, c, bf16) > top) top = get(logits, c, bf16), best = c;
        if (conf) {
            float total = 0.0f;
            for (int64_t c = 0; c < C; c++) total += expf(get(logits, c, bf16) - top);
            *conf = 1.0f / total;
        }
        return best;
    }
    float top = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < C; c++) row[c] = get(logits, c, bf16) / temperature, top = row[c] > top ? row[c] : top;
    for (int64_t c = 0; c < C; c++) row[c] = expf(row[c] - top), total += row[c];
    float *q = probs + i * probs_stride;
    double cdf = 0.0, sum = 0.0;
    for (int64_t c = 0; c < C; c++) q[c] = row[c] / total, sum += (double)q[c];
    const double threshold = (double)uniforms[i] * sum;
    for (best = 0; best < C - 1; best++) {
        cdf += (double)q[best];
        if (cdf > threshold) break;
    }
    if (conf) *conf = q[best];
    return best;
}

/* Whether a chain stops after its draw of confidence conf: the running product *p of its draws'
 * confidences (the chance, as the draft sees it, that every draw so far is accepted) fell below
 * stop_below (0: never). */
static int chain_stops(float stop_below, float conf, float *p) {
    if (stop_below <= 0.0f) return 0;
    *p *= conf;
    return *p < stop_below;
}

int head_chain(const LayerSpec *s, const void *norm, float eps, const void *fc_w, const void *fc_b, int fc_kind,
               const void *out_w, const void *out_b, int out_kind, int64_t C, const int64_t *codes, const void *features,
               int64_t n0, const void *table, const void *align, int64_t align_start, int64_t align_rows, const void *cos,
               const void *sin, void *kbuf, void *vbuf,
               int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, int64_t k, float temperature, const float *uniforms,
               const int64_t *ids, int64_t *tokens, float *probs, int64_t probs_stride, float stop_below, int threads) {
    const int64_t D = s->D, hd = s->hd, width = s->bf16 ? 2 : 4, row_bytes = D * width;
    const int bf16 = s->bf16;
    if (n0 < 1 || k < 1) return -1;
    char *scratch = malloc((size_t)((3 * n0 * D + C) * width) + (size_t)C * sizeof(float));
    if (!scratch) return -1;
    char *x = scratch, *h = x + 2 * n0 * row_bytes, *logits = h + n0 * row_bytes;
    float *row = (float *)(logits + C * width);
    void *kbufs[1] = {kbuf}, *vbufs[1] = {vbuf};
    int status = feed_pairs(s, norm, eps, fc_w, fc_b, fc_kind, codes, features, n0, table, align, align_start, align_rows, cos,
                            sin, kbuf, vbuf, ks_b, ks_h, ks_l, cached, x, h, threads);
    char *feature = h + (n0 - 1) * row_bytes; /* f^: the last row fed */
    int64_t drawn = 0;
    float conf = 1.0f, p = 1.0f;
    for (int64_t i = 0; i < k && !status; i++) {
        status = linear_kind(out_kind, feature, out_w, out_b, logits, 1, C, D, threads);
        const int64_t best = draw_code(logits, C, bf16, temperature, uniforms, probs, probs_stride, i, row,
                                       stop_below > 0.0f ? &conf : NULL);
        tokens[i] = best, drawn = i + 1;
        if (i + 1 == k || status || chain_stops(stop_below, conf, &p)) break;
        const int64_t at = n0 + i, rope_row = at * hd * (s->rope ? 4 : width); /* this pair's position; its rotary row */
        memcpy(x, (const char *)table + (ids ? ids[best] : best) * row_bytes, (size_t)row_bytes);
        if (align) add_into(x, align_row(align, align_start + at, align_rows, row_bytes), D, bf16);
        memcpy(x + row_bytes, feature, (size_t)row_bytes);
        status = linear_kind(fc_kind, x, fc_w, fc_b, h, 1, D, 2 * D, threads);
        if (!status)
            status = lean_layers(s, 1, h, 1, 1, (const char *)cos + rope_row, sin ? (const char *)sin + rope_row : NULL, 0,
                                 kbufs, vbufs, ks_b, ks_h, ks_l, cached + at, NULL, 0, 0, norm, eps, threads);
        feature = h;
    }
    free(scratch);
    return status ? -1 : (int)drawn;
}

/* The k most probable outputs of logits [C] (model dtype): their indices, most probable first (ties:
 * the lower index), and log q of each, q = softmax(logits) in fp32 (floored at 1e-30 as the Python
 * tree does before its log). k <= C. */
static void top_log_probs(const void *logits, int64_t C, int bf16, int64_t k, int64_t *index, float *logq) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < C; c++) top = fmaxf(top, get(logits, c, bf16));
    for (int64_t c = 0; c < C; c++) total += expf(get(logits, c, bf16) - top);
    int64_t have = 0;
    for (int64_t c = 0; c < C; c++) { /* insertion into the sorted first `have` (strictly greater moves up) */
        const float v = get(logits, c, bf16);
        if (have == k && !(v > get(logits, index[k - 1], bf16))) continue;
        int64_t at = have < k ? have++ : k - 1;
        while (at > 0 && v > get(logits, index[at - 1], bf16)) index[at] = index[at - 1], at--;
        index[at] = c;
    }
    for (int64_t j = 0; j < k; j++) logq[j] = logf(fmaxf(expf(get(logits, index[j], bf16) - top) / total, 1e-30f));
}

/* A one-layer head as a tree grows it (grow_tree): `layer` feeds n nodes, e [n, D] their tokens'
 * embeddings and g [n, D] their parents' features, at positions cached .. cached + n - 1 (rotary rows
 * cos / sin [n, .], mask bytes [n, ms_n]) and leaves their features in g; `logits` maps features
 * g [n, D] to draft logits [n, C]. The rest: the head's weights, which the two read. */
typedef struct TreeHead TreeHead;
struct TreeHead {
    int (*layer)(const TreeHead *t, const char *e, char *g, int64_t n, const void *cos, const void *sin, int64_t cached,
                 const uint8_t *mask, int64_t ms_n, int threads);
    int (*logits)(const TreeHead *t, const char *g, int64_t n, char *logits, int threads);
    const LayerSpec *s;
    const void *norm, *fc_w, *fc_b, *out_w, *out_b, *hidden_norm;
    float eps;
    int fc_kind, out_kind, norm_before_residual;
    int64_t C;
    void *kbuf, *vbuf;
    int64_t ks_b, ks_h, ks_l;
};

/* EAGLE's node: f = N(Layer(W_fc [e; g] + b_fc)); its logits W_out f + b_out. */
static int eagle_tree_layer(const TreeHead *t, const char *e, char *g, int64_t n, const void *cos, const void *sin,
                            int64_t cached, const uint8_t *mask, int64_t ms_n, int threads) {
    const LayerSpec *s = t->s;
    const int64_t D = s->D, row_bytes = D * (s->bf16 ? 2 : 4);
    void *kbufs[1] = {t->kbuf}, *vbufs[1] = {t->vbuf};
    char *x = malloc((size_t)(2 * n * row_bytes));
    if (!x) return -1;
    for (int64_t i = 0; i < n; i++) {
        memcpy(x + 2 * i * row_bytes, e + i * row_bytes, (size_t)row_bytes);
        memcpy(x + (2 * i + 1) * row_bytes, g + i * row_bytes, (size_t)row_bytes);
    }
    int status = linear_kind(t->fc_kind, x, t->fc_w, t->fc_b, g, n, D, 2 * D, threads);
    if (!status)
        status = lean_layers(s, 1, g, 1, n, cos, sin, 0, kbufs, vbufs, t->ks_b, t->ks_h, t->ks_l, cached, mask, 0, ms_n, t->norm,
                             t->eps, threads);
    free(x);
    return status;
}
static int eagle_tree_logits(const TreeHead *t, const char *g, int64_t n, char *logits, int threads) {
    return linear_kind(t->out_kind, g, t->out_w, t->out_b, logits, n, t->C, t->s->D, threads);
}

/* EAGLE-2's top-k dynamic draft tree (mmspec.core.tree.dynamic_tree) grown by a one-layer head
 * from its root: what the Python tree does with ~60 tensor calls a layer.
 *
 *   layer 1: the k = min(top_k, C) most probable codes of softmax(logits(root)), log V = log q;
 *   layer d = 2 .. depth: while expand(max log V of the frontier) (NULL: always), feed the frontier
 *   (the k best of layer d - 1 by log V, ties to the earlier candidate; nodes in creation order):
 *   node u's input (e(x_u), feature of its parent: the root's for layer 1's nodes) at position
 *   cached + n0 + d - 2 (its rotary row n0 + d - 2), seeing the committed positions, the fed nodes
 *   that are its ancestors and itself; each fed node contributes its k most probable codes c as
 *   candidates with log V = log V(u) + log q_u(c).
 *
 * root [D]: the head's feature after the n0 committed pairs fed. e(x) = table[ids[x]] (table[x]
 * where ids is NULL). Candidates are written in creation order to tokens (codes < C), parents (-1:
 * the root) and scores (log V) [top_k + (depth - 1) top_k^2 at most]; *count gets their number,
 * *layers the layers grown. The fed nodes' keys and values sit after position cached + n0 of the
 * head's buffers (room for (depth - 1) top_k positions more), which the caller drops. cos / sin:
 * rotary rows [n0 + depth - 1, .] of the positions cached .. cached + n0 + depth - 2. Returns 0, or
 * -1 (no scratch, or a kernel failed). */
static int grow_tree(const TreeHead *t, const char *root, const void *table, const int64_t *ids, const void *cos,
                     const void *sin, int64_t n0, int64_t cached, int64_t depth, int64_t top_k, expand_rule expand,
                     int64_t *tokens, int64_t *parents, float *scores, int64_t *count, int64_t *layers, int threads) {
    const LayerSpec *s = t->s;
    const int64_t D = s->D, hd = s->hd, C = t->C, width = s->bf16 ? 2 : 4, row_bytes = D * width;
    const int64_t rope_bytes = hd * (s->rope ? 4 : width), k = top_k < C ? top_k : C, fed_max = (depth - 1) * k;
    const int bf16 = s->bf16;
    if (depth < 1 || k < 1) return -1;
    const int64_t mask_cols = cached + n0 + fed_max;
    /* e, g [k, D] | fed features [fed_max + 1, D] (row 0: the root) | logits [k, C] | rotary [2, k, .]
     * | mask [k, mask_cols] | fed slot of each candidate, frontier, scratch indices | log q [k] */
    const size_t bytes = (size_t)((2 * k + fed_max + 1) * row_bytes + k * C * width + 2 * k * rope_bytes + k * mask_cols)
                         + (size_t)(top_k + fed_max * k + 3 * k) * sizeof(int64_t) + (size_t)k * sizeof(float);
    char *scratch = malloc(bytes);
    if (!scratch) return -1;
    char *e = scratch, *g = e + k * row_bytes, *feats = g + k * row_bytes, *logits = feats + (fed_max + 1) * row_bytes;
    char *rot_c = logits + k * C * width, *rot_s = rot_c + k * rope_bytes;
    uint8_t *mask = (uint8_t *)(rot_s + k * rope_bytes);
    int64_t *slot = (int64_t *)(mask + k * mask_cols), *frontier = slot + top_k + fed_max * k, *index = frontier + k;
    float *logq = (float *)(index + 2 * k);
    memcpy(feats, root, (size_t)row_bytes);
    int status = t->logits(t, feats, 1, logits, threads);
    int64_t total = 0, fed = 0, grown = 0, width_now = 0;
    if (!status) {
        top_log_probs(logits, C, bf16, k, index, logq);
        for (int64_t j = 0; j < k; j++) tokens[j] = index[j], parents[j] = -1, scores[j] = logq[j], slot[j] = -1, frontier[j] = j;
        total = width_now = k, grown = 1;
    }
    for (int64_t d = 2; d <= depth && !status; d++) {
        float best = -INFINITY;
        for (int64_t i = 0; i < width_now; i++) best = fmaxf(best, scores[frontier[i]]);
        if (expand && !expand(best)) break;
        const int64_t n = width_now, seen = cached + n0 + fed, cols = seen + n;
        memset(mask, 0, (size_t)(n * cols));
        for (int64_t i = 0; i < n; i++) {
            const int64_t u = frontier[i], parent = parents[u];
            memcpy(e + i * row_bytes, (const char *)table + (ids ? ids[tokens[u]] : tokens[u]) * row_bytes, (size_t)row_bytes);
            memcpy(g + i * row_bytes, feats + (parent < 0 ? 0 : 1 + slot[parent]) * row_bytes, (size_t)row_bytes);
            memcpy(rot_c + i * rope_bytes, (const char *)cos + (n0 + d - 2) * rope_bytes, (size_t)rope_bytes);
            if (sin) memcpy(rot_s + i * rope_bytes, (const char *)sin + (n0 + d - 2) * rope_bytes, (size_t)rope_bytes);
            uint8_t *m = mask + i * cols;
            memset(m, 1, (size_t)(cached + n0));
            for (int64_t a = parent; a >= 0; a = parents[a]) m[cached + n0 + slot[a]] = 1;
            m[seen + i] = 1;
        }
        status = t->layer(t, e, g, n, rot_c, sin ? rot_s : NULL, seen, mask, cols, threads);
        if (!status) status = t->logits(t, g, n, logits, threads);
        if (status) break;
        const int64_t first = total;
        for (int64_t i = 0; i < n; i++) {
            const int64_t u = frontier[i];
            slot[u] = fed + i;
            memcpy(feats + (1 + fed + i) * row_bytes, g + i * row_bytes, (size_t)row_bytes);
            top_log_probs(logits + i * C * width, C, bf16, k, index, logq);
            for (int64_t j = 0; j < k; j++, total++)
                tokens[total] = index[j], parents[total] = u, scores[total] = scores[u] + logq[j], slot[total] = -1;
        }
        fed += n, grown = d;
        /* the next frontier: the k best of this layer's candidates (ties: the earlier), in creation order */
        width_now = total - first < k ? total - first : k;
        for (int64_t i = 0; i < width_now; i++) {
            int64_t pick = -1;
            for (int64_t c = first; c < total; c++) {
                int taken = 0;
                for (int64_t j = 0; j < i; j++) taken |= frontier[j] == c;
                if (!taken && (pick < 0 || scores[c] > scores[pick])) pick = c;
            }
            int64_t at = i;
            while (at > 0 && frontier[at - 1] > pick) frontier[at] = frontier[at - 1], at--;
            frontier[at] = pick;
        }
    }
    *count = total, *layers = grown;
    free(scratch);
    return status ? -1 : 0;
}

/* EAGLE-2's tree from a one-layer feature head (EAGLE) in one call: the n0 pairs fed as head_chain
 * feeds them, f^ = the last row the root, then grow_tree with the node f = N(Layer(W_fc [e(x_u);
 * f^(parent u)] + b_fc)) and logits W_out f + b_out:
 *
 *   V(child c of u) = V(u) q_u(c),  q_u = softmax(W_out N(Layer(W_fc [e(x_u); f^(parent u)])))
 *
 * Arguments as head_chain's (no align) and grow_tree's (the cache buffers kbuf / vbuf: room for
 * n0 + (depth - 1) top_k positions after `cached`). Returns 0, or -1. */
int head_tree(const LayerSpec *s, const void *norm, float eps, const void *fc_w, const void *fc_b, int fc_kind,
              const void *out_w, const void *out_b, int out_kind, int64_t C, const int64_t *codes, const void *features,
              int64_t n0, const void *table, const int64_t *ids, const void *cos, const void *sin, void *kbuf, void *vbuf,
              int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, int64_t depth, int64_t top_k, expand_rule expand,
              int64_t *tokens, int64_t *parents, float *scores, int64_t *count, int64_t *layers, int threads) {
    const int64_t D = s->D, row_bytes = D * (s->bf16 ? 2 : 4);
    if (n0 < 1) return -1;
    char *scratch = malloc((size_t)(3 * n0 * row_bytes));
    if (!scratch) return -1;
    char *x = scratch, *h = x + 2 * n0 * row_bytes;
    const TreeHead t = {.layer = eagle_tree_layer, .logits = eagle_tree_logits, .s = s, .norm = norm, .fc_w = fc_w,
                        .fc_b = fc_b, .out_w = out_w, .out_b = out_b, .eps = eps, .fc_kind = fc_kind, .out_kind = out_kind,
                        .C = C, .kbuf = kbuf, .vbuf = vbuf, .ks_b = ks_b, .ks_h = ks_h, .ks_l = ks_l};
    int status = feed_pairs(s, norm, eps, fc_w, fc_b, fc_kind, codes, features, n0, table, NULL, 0, 0, cos, sin, kbuf, vbuf,
                            ks_b, ks_h, ks_l, cached, x, h, threads);
    if (!status)
        status = grow_tree(&t, h + (n0 - 1) * row_bytes, table, ids, cos, sin, n0, cached, depth, top_k, expand, tokens, parents,
                           scores, count, layers, threads);
    free(scratch);
    return status ? -1 : 0;
}

/* EAGLE-3's head layer over n rows (positions cached .. cached + n - 1, rotary rows cos / sin [n, hd];
 * mask: NULL (a chain after the cache) or bytes [n, ms_n], row i the positions it sees): e [n, D] the
 * tokens' embeddings, x [n, D] in: g, the fused target states or the head's own last outputs; out: s,
 * the layer's outputs:
 *
 *   u = [N1(e); Nh(g)] [n, 2 D],  r = (Nh(g) if norm_before_residual else g) + W_o Attn(W_q u, W_k u, W_v u)
 *   s = r + W_down (SiLU(W_gate N2(r)) * W_up N2(r))
 *
 * (s: the layer's spec with q / k / v over 2 D inputs; hidden_norm: Nh's weight [D], eps s->eps1.) */
static int eagle3_layer(const LayerSpec *s, const void *hidden_norm, int norm_before_residual, const void *e, void *x, int64_t n,
                        const void *cos, const void *sin, void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h, int64_t ks_l,
                        int64_t cached, const uint8_t *mask, int64_t ms_n, int threads) {
    const int64_t D = s->D, row_bytes = D * (s->bf16 ? 2 : 4);
    char *u = malloc((size_t)(2 * n * row_bytes));
    if (!u) return -1;
    for (int64_t m = 0; m < n; m++) {
        rms_norm((const char *)e + m * row_bytes, s->norm1, u + 2 * m * row_bytes, 1, D, s->eps1, s->bf16);
        rms_norm((char *)x + m * row_bytes, hidden_norm, u + (2 * m + 1) * row_bytes, 1, D, s->eps1, s->bf16);
        if (norm_before_residual) memcpy((char *)x + m * row_bytes, u + (2 * m + 1) * row_bytes, (size_t)row_bytes);
    }
    const int status = layer_from(s, x, u, 2 * D, 1, n, cos, sin, 0, kbuf, vbuf, ks_b, ks_h, ks_l, cached, mask, 0, ms_n, threads);
    free(u);
    return status;
}

/* The pairs (e(c_j), W_fc F_j) (j < n0) through EAGLE-3's head layer: e [n0, D] <- the target's
 * embeddings of codes, x [n0, D] <- the layer's outputs s; the layer's keys and values at positions
 * cached .. cached + n0 - 1. (features [n0, F], fc_w [D, F] without bias; rotary rows cos / sin
 * [n0, hd] from the first.) */
static int eagle3_feed_pairs(const LayerSpec *s, const void *hidden_norm, int norm_before_residual, const void *fc_w, int fc_kind,
                             int64_t F, const int64_t *codes, const void *features, int64_t n0, const void *table,
                             const void *cos, const void *sin, void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h,
                             int64_t ks_l, int64_t cached, char *e, char *x, int threads) {
    const int64_t D = s->D, row_bytes = D * (s->bf16 ? 2 : 4);
    for (int64_t j = 0; j < n0; j++) memcpy(e + j * row_bytes, (const char *)table + codes[j] * row_bytes, (size_t)row_bytes);
    const int status = linear_kind(fc_kind, features, fc_w, NULL, x, n0, D, F, threads);
    return status ? status
                  : eagle3_layer(s, hidden_norm, norm_before_residual, e, x, n0, cos, sin, kbuf, vbuf, ks_b, ks_h, ks_l, cached,
                                 NULL, 0, threads);
}

/* An EAGLE-3 head's draft chain in one call (mmspec.drafters.eagle3.Eagle3Drafter), what its Python
 * loop does with ~30 tensor calls a token:
 *
 *   feed the n0 pairs (e(c_j), W_fc F_j):  s = Layer3(e(c_j), W_fc F_j),  s^ = its last row
 *   for i < k:  logits = W_out Nf(s^) [C];  x_i ~ softmax(logits / T) (T <= 0: the first argmax)
 *               if i + 1 < k:  s^ = Layer3(e(ids[x_i]), s^)  at the next position
 *
 * with Layer3 as eagle3_layer and e(t) = table[t] (the target's embedding). codes [n0]: the pairs'
 * target ids; features [n0, F]: the pairs' concatenated target states, fused by fc_w [D, F] (no
 * bias); norm / eps: Nf, the head's final norm; out_w [C, D] (no bias): the draft LM head; ids [C]:
 * each draft index's target id. Other arguments as head_chain's (cos / sin [n0 + k - 1, hd]; the
 * keys and values of the positions after cached + n0 are the caller's to drop; stop_below as
 * head_chain's). Returns the indices drawn (1..k), or -1. */
int eagle3_chain(const LayerSpec *s, const void *hidden_norm, int norm_before_residual, const void *norm, float eps,
                 const void *fc_w, int fc_kind, int64_t F, const void *out_w, int out_kind, int64_t C, const int64_t *codes,
                 const void *features, int64_t n0, const void *table, const int64_t *ids, const void *cos, const void *sin,
                 void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, int64_t k, float temperature,
                 const float *uniforms, int64_t *tokens, float *probs, int64_t probs_stride, float stop_below, int threads) {
    const int64_t D = s->D, width = s->bf16 ? 2 : 4, row_bytes = D * width, rope_bytes = s->hd * width;
    const int bf16 = s->bf16;
    if (n0 < 1 || k < 1 || s->rope) return -1;
    char *scratch = malloc((size_t)((2 * n0 + 1) * row_bytes + C * width) + (size_t)C * sizeof(float));
    if (!scratch) return -1;
    char *e = scratch, *x = e + n0 * row_bytes, *normed = x + n0 * row_bytes, *logits = normed + row_bytes;
    float *row = (float *)(logits + C * width);
    int status = eagle3_feed_pairs(s, hidden_norm, norm_before_residual, fc_w, fc_kind, F, codes, features, n0, table, cos, sin,
                                   kbuf, vbuf, ks_b, ks_h, ks_l, cached, e, x, threads);
    char *feature = x + (n0 - 1) * row_bytes; /* s^: the last row fed */
    int64_t drawn = 0;
    float conf = 1.0f, p = 1.0f;
    for (int64_t i = 0; i < k && !status; i++) {
        rms_norm(feature, norm, normed, 1, D, eps, bf16);
        status = linear_kind(out_kind, normed, out_w, NULL, logits, 1, C, D, threads);
        const int64_t best = draw_code(logits, C, bf16, temperature, uniforms, probs, probs_stride, i, row,
                                       stop_below > 0.0f ? &conf : NULL);
        tokens[i] = best, drawn = i + 1;
        if (i + 1 == k || status || chain_stops(stop_below, conf, &p)) break;
        const int64_t at = n0 + i; /* this pair's position after the cache, its rotary row */
        memcpy(e, (const char *)table + ids[best] * row_bytes, (size_t)row_bytes);
        if (feature != x) memcpy(x, feature, (size_t)row_bytes);
        status = eagle3_layer(s, hidden_norm, norm_before_residual, e, x, 1, (const char *)cos + at * rope_bytes,
                              (const char *)sin + at * rope_bytes, kbuf, vbuf, ks_b, ks_h, ks_l, cached + at, NULL, 0, threads);
        feature = x;
    }
    free(scratch);
    return status ? -1 : (int)drawn;
}

/* EAGLE-3's node (eagle3_layer): s = Layer3(e(x_u), s(parent u)); its logits W_out Nf(s). */
static int eagle3_tree_layer(const TreeHead *t, const char *e, char *g, int64_t n, const void *cos, const void *sin,
                             int64_t cached, const uint8_t *mask, int64_t ms_n, int threads) {
    return eagle3_layer(t->s, t->hidden_norm, t->norm_before_residual, e, g, n, cos, sin, t->kbuf, t->vbuf, t->ks_b, t->ks_h,
                        t->ks_l, cached, mask, ms_n, threads);
}
static int eagle3_tree_logits(const TreeHead *t, const char *g, int64_t n, char *logits, int threads) {
    const int64_t D = t->s->D;
    char *normed = malloc((size_t)(n * D * (t->s->bf16 ? 2 : 4)));
    if (!normed) return -1;
    rms_norm(g, t->norm, normed, n, D, t->eps, t->s->bf16);
    const int status = linear_kind(t->out_kind, normed, t->out_w, NULL, logits, n, t->C, D, threads);
    free(normed);
    return status;
}

/* EAGLE-2's tree from an EAGLE-3 head (mmspec.drafters.eagle3.Eagle3TreeDrafter) in one call: the n0
 * pairs fed as eagle3_chain feeds them, s^ = the last row the root, then grow_tree with the node
 * s = Layer3(e(ids[x_u]), s(parent u)) and logits W_out Nf(s):
 *
 *   V(child c of u) = V(u) q_u(c),  q_u = softmax(W_out Nf(Layer3(e(ids[x_u]), s(parent u))))
 *
 * Arguments as eagle3_chain's and grow_tree's (cos / sin [n0 + depth - 1, hd]; the cache buffers:
 * room for n0 + (depth - 1) top_k positions after `cached`). Returns 0, or -1. */
int eagle3_tree(const LayerSpec *s, const void *hidden_norm, int norm_before_residual, const void *norm, float eps,
                const void *fc_w, int fc_kind, int64_t F, const void *out_w, int out_kind, int64_t C, const int64_t *codes,
                const void *features, int64_t n0, const void *table, const int64_t *ids, const void *cos, const void *sin,
                void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, int64_t depth, int64_t top_k,
                expand_rule expand, int64_t *tokens, int64_t *parents, float *scores, int64_t *count, int64_t *layers,
                int threads) {
    const int64_t D = s->D, row_bytes = D * (s->bf16 ? 2 : 4);
    if (n0 < 1 || s->rope) return -1;
    char *scratch = malloc((size_t)(2 * n0 * row_bytes));
    if (!scratch) return -1;
    char *e = scratch, *x = e + n0 * row_bytes;
    const TreeHead t = {.layer = eagle3_tree_layer, .logits = eagle3_tree_logits, .s = s, .norm = norm, .out_w = out_w,
                        .hidden_norm = hidden_norm, .eps = eps, .out_kind = out_kind, .norm_before_residual = norm_before_residual,
                        .C = C, .kbuf = kbuf, .vbuf = vbuf, .ks_b = ks_b, .ks_h = ks_h, .ks_l = ks_l};
    int status = eagle3_feed_pairs(s, hidden_norm, norm_before_residual, fc_w, fc_kind, F, codes, features, n0, table, cos, sin,
                                   kbuf, vbuf, ks_b, ks_h, ks_l, cached, e, x, threads);
    if (!status)
        status = grow_tree(&t, x + (n0 - 1) * row_bytes, table, ids, cos, sin, n0, cached, depth, top_k, expand, tokens, parents,
                           scores, count, layers, threads);
    free(scratch);
    return status ? -1 : 0;
}
