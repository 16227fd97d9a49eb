/* The kernel library's shared declarations: every entry point exported by a file of this directory
 * (each file includes this header, so the compiler checks each definition against its prototype,
 * and a file calling another's kernel sees the one declaration), the ids of the few-row linear
 * kernels, and the fused layer's spec.
 *
 * Python mirrors the enums in mmspec.modeling.kernel_ids (tests/test_fused.py checks that the two
 * agree) and LayerSpec in mmspec.modeling.fused.LayerSpec (ctypes); the entry points' argument
 * types are set in mmspec.modeling.fast_linear.load_kernel and mmspec.modeling.fused.
 */
#ifndef MMSPEC_KERNELS_H
#define MMSPEC_KERNELS_H
#include <stdint.h>

/* The few-row linear kernel a fused layer's projections take (LayerSpec.linear, head_chain's fc_kind
 * and out_kind). The int8 kernel (few_rows_linear_i8: a drafter's head) takes the ids from
 * LINEAR_I8 to LINEAR_I8_LAST: LINEAR_I8 + 2 path + 1 for fp32 rows (0 for bf16), path an enum
 * i8_path; later kernels take the ids after them. */
enum linear_kernel {
    LINEAR_AVX2 = 0,       /* fp32, 8 lanes: few_rows_linear */
    LINEAR_AVX512 = 1,     /* fp32, 16 lanes: few_rows_linear_avx512 */
    LINEAR_AVX512BF16 = 2, /* bf16, vdpbf16ps: few_rows_linear_bf16 */
    LINEAR_AMX = 3,        /* bf16, AMX tiles, the weight read in place: few_rows_linear_amx */
    LINEAR_AMX_PACKED = 4, /* bf16, AMX tiles, the weight packed: few_rows_linear_amx_packed */
    LINEAR_AVX512BF16_PACKED = 5, /* bf16, vdpbf16ps, the weight packed: few_rows_linear_bf16_packed */
    LINEAR_I8 = 6,         /* the first int8 id (scalar path, bf16 rows) */
    LINEAR_I8_LAST = 13,   /* the last int8 id (AVX2 path, fp32 rows) */
    LINEAR_AVX512_PACKED = 14, /* fp32, 16 lanes, the weight packed: few_rows_linear_avx512_packed */
};

/* How the int8 kernel sums (its `path` argument): the same integers every way */
enum i8_path {
    I8_PATH_SCALAR = 0, /* a scalar loop */
    I8_PATH_VNNI = 1,   /* AVX512-VNNI vpdpbusd */
    I8_PATH_AMX = 2,    /* AMX-INT8 tiles for two rows or more where K % 64 == 0, else VNNI */
    I8_PATH_AVX2 = 3,   /* AVX2 vpmaddwd over the weights widened to int16 */
};

/* What does not change from call to call (built once per layer by mmspec.modeling.fused) */
typedef struct {
    const void *norm1, *norm2;                 /* [D] */
    const void *wq, *wk, *wv, *wo;             /* [H hd, D], [Hkv hd, D], [Hkv hd, D], [D, H hd] */
    const void *bq, *bk, *bv, *bo;             /* biases or NULL */
    const void *wg, *wu, *wd;                  /* [I, D], [I, D], [D, I] */
    int64_t D, H, Hkv, hd, I;
    float eps1, eps2, scale;
    int rope;      /* 0: rotate-half with cos / sin [., n, hd] in the model dtype (transformers' Llama);
                      1: consecutive pairs with an fp32 table [., n, hd / 2, 2] (LlamaGen) */
    int bf16;      /* the model dtype: 1 bf16, 0 fp32 */
    int linear;    /* the few-row kernel: an enum linear_kernel */
    int wide;      /* the attention build and the SiLU's lanes: 1 AVX-512 (16 lanes) */
} LayerSpec;

/* ---- few-row linears: y [M, N] = x [M, K] w [N, K]^T (+ b [N] or NULL), all contiguous; threads:
 * OpenMP threads. linear_fp32.c (fp32), linear_bf16.c (bf16 as uint16_t bit patterns), linear_int8.c */
void few_rows_linear(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K, int threads);
void few_rows_linear_avx512(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                            int threads);
void few_rows_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                          int64_t K, int threads);
/* w: the weight packed by mmspec.modeling.fast_linear.pack_bf16, [ceil(N / 16)][ceil(K / 2)][16][2] */
void few_rows_linear_bf16_packed(const uint16_t *x, const uint16_t *p, const uint16_t *b, uint16_t *y, int64_t M,
                                 int64_t N, int64_t K, int threads);
/* few_rows_linear_bf16_packed's sums through vfmadd231ps (1) or vdpbf16ps (0, the default): the same bits */
void few_rows_bf16_fma(int on);
void few_rows_linear_avx512_packed(const float *x, const float *p, const float *b, float *y, int64_t M, int64_t N,
                                   int64_t K, int threads);
int few_rows_amx_init(void);
int few_rows_linear_amx(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                        int64_t K, int threads);
int few_rows_linear_amx_packed(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M,
                               int64_t N, int64_t K, int threads);
int few_rows_linear_i8(const void *x, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K, int bf16,
                       int path);

/* ---- rows of logits and probabilities (verify.c) */
void rows_argmax(const void *x, int64_t rows, int64_t V, int bf16, int64_t *out);
int speculative_rows(const float *p, const float *q, const int64_t *tokens, const float *r, const float *u, int64_t B,
                     int64_t K, int64_t V, int64_t pad, int64_t *accepted, int64_t *out);
int block_rows(const float *p, const float *q, const int64_t *tokens, const float *r, const float *u, int64_t B, int64_t K,
               int64_t V, int64_t pad, int64_t *accepted, int64_t *out);
int coupled_rows(const float *p, const float *q, const int64_t *old, const float *u, int64_t m, int64_t kept, int64_t V,
                 int64_t *out);

/* ---- Griffin-Lim's phase update over n complex values (interleaved re, im) and its overlap-add
 * (spectral.c), and the phase gradient heuristic integration that starts it (portable/pghi.c) */
void griffin_lim_update(float *update, const float *rebuilt, const float *previous, const float *target, int64_t n,
                        float keep);
void overlap_add(float *audio, const float *frames, const float *window, const float *inverse_envelope, int64_t count,
                 int64_t n_fft, int64_t hop, int64_t pad, int64_t length);
void stft_frames(float *frames, const float *audio, const float *window, int64_t count, int64_t n_fft, int64_t hop,
                 int64_t pad, int64_t length);
int pghi_integrate(double *phase, const int32_t *level, const float *step_t, const float *step_f, int64_t bins,
                   int64_t frames, int64_t bands);

/* ---- batch-invariant attention (attention.c) */
int few_rows_attention(const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t B, int64_t H,
                       int64_t Hkv, int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h, int64_t qs_n, int64_t ks_b,
                       int64_t ks_h, int64_t ks_l, int64_t ms_b, int64_t ms_n, float scale, int bf16);
int few_rows_attention_avx512(const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t B,
                              int64_t H, int64_t Hkv, int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h,
                              int64_t qs_n, int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t ms_b, int64_t ms_n, float scale,
                              int bf16);

/* ---- fused decoder layers and drafter heads (layer.c) */
typedef int (*expand_rule)(float best_log_value);
int lean_layer(const LayerSpec *s, void *x, int64_t B, int64_t n, const void *cos, const void *sin, int64_t rope_b,
               void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, const uint8_t *mask,
               int64_t ms_b, int64_t ms_n, int threads);
int lean_layers(const LayerSpec *specs, int64_t count, void *x, int64_t B, int64_t n, const void *cos, const void *sin,
                int64_t rope_b, void *const *kbufs, void *const *vbufs, int64_t ks_b, int64_t ks_h, int64_t ks_l,
                int64_t cached, const uint8_t *mask, int64_t ms_b, int64_t ms_n, const void *norm, float eps, int threads);
void compact_rows(void *const *buffers, int64_t count, int64_t outer, int64_t stride, int64_t row, int64_t start,
                  const int64_t *indices, int64_t m);
int head_chain(const LayerSpec *s, const void *norm, float eps, const void *fc_w, const void *fc_b, int fc_kind,
               const void *out_w, const void *out_b, int out_kind, int64_t C, const int64_t *codes, const void *features,
               int64_t n0, const void *table, const void *align, int64_t align_start, int64_t align_rows, const void *cos,
               const void *sin, void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, int64_t k,
               float temperature, const float *uniforms, const int64_t *ids, int64_t *tokens, float *probs,
               int64_t probs_stride, float stop_below, int threads);
int head_tree(const LayerSpec *s, const void *norm, float eps, const void *fc_w, const void *fc_b, int fc_kind,
              const void *out_w, const void *out_b, int out_kind, int64_t C, const int64_t *codes, const void *features,
              int64_t n0, const void *table, const int64_t *ids, const void *cos, const void *sin, void *kbuf, void *vbuf,
              int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, int64_t depth, int64_t top_k, expand_rule expand,
              int64_t *tokens, int64_t *parents, float *scores, int64_t *count, int64_t *layers, int threads);
int eagle3_chain(const LayerSpec *s, const void *hidden_norm, int norm_before_residual, const void *norm, float eps,
                 const void *fc_w, int fc_kind, int64_t F, const void *out_w, int out_kind, int64_t C, const int64_t *codes,
                 const void *features, int64_t n0, const void *table, const int64_t *ids, const void *cos, const void *sin,
                 void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, int64_t k, float temperature,
                 const float *uniforms, int64_t *tokens, float *probs, int64_t probs_stride, float stop_below, int threads);
int eagle3_tree(const LayerSpec *s, const void *hidden_norm, int norm_before_residual, const void *norm, float eps,
                const void *fc_w, int fc_kind, int64_t F, const void *out_w, int out_kind, int64_t C, const int64_t *codes,
                const void *features, int64_t n0, const void *table, const int64_t *ids, const void *cos, const void *sin,
                void *kbuf, void *vbuf, int64_t ks_b, int64_t ks_h, int64_t ks_l, int64_t cached, int64_t depth, int64_t top_k,
                expand_rule expand, int64_t *tokens, int64_t *parents, float *scores, int64_t *count, int64_t *layers,
                int threads);
#endif
