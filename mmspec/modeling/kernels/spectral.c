/* Griffin-Lim's inner loops and its start (mmspec.modeling.spectrogram.griffin_lim and pghi_phase,
 * which run PyTorch's operators or Python where this library does not build). The phase update is
 * one pass over the spectrum where PyTorch took seven over strided real and imaginary planes (0.89
 * -> 0.21 ms for a 4.8-second utterance on one core, its whole iteration 1.55 -> 0.90 ms). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* For i < n complex values (interleaved re, im):
 *     t = rebuilt[i] - keep * previous[i],   update[i] = t * target[i] / (|t| + 1e-16)
 * (fast Griffin-Lim's momentum step and the projection onto the target magnitude). AVX2 + FMA:
 * four complex values a vector, |t|^2 summed within each pair of lanes. */
void griffin_lim_update(float *update, const float *rebuilt, const float *previous, const float *target, int64_t n,
                        float keep) {
    const __m256 k = _mm256_set1_ps(keep), tiny = _mm256_set1_ps(1e-16f);
    const __m256i twice = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m256 t = _mm256_sub_ps(_mm256_loadu_ps(rebuilt + 2 * i), _mm256_mul_ps(k, _mm256_loadu_ps(previous + 2 * i)));
        const __m256 squared = _mm256_mul_ps(t, t);
        const __m256 norm = _mm256_add_ps(_mm256_sqrt_ps(_mm256_add_ps(squared, _mm256_permute_ps(squared, 0xB1))), tiny);
        const __m256 goal = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(target + i)), twice);
        _mm256_storeu_ps(update + 2 * i, _mm256_mul_ps(t, _mm256_div_ps(goal, norm)));
    }
    for (; i < n; i++) {
        const float re = rebuilt[2 * i] - keep * previous[2 * i], im = rebuilt[2 * i + 1] - keep * previous[2 * i + 1];
        const float scale = target[i] / (sqrtf(re * re + im * im) + 1e-16f);
        update[2 * i] = re * scale;
        update[2 * i + 1] = im * scale;
    }
}

/* The inverse STFT's overlap-add for Griffin-Lim: `count` frames [count, n_fft] of irfft output,
 * each windowed and added at its hop, divided by the window's squared envelope, samples
 * [pad, pad + length) of the sum (torch.istft(center=True) drops n_fft / 2 at each end):
 *
 *     audio[l] = inverse_envelope[l] * sum_t window[l + pad - t hop] frames[t, l + pad - t hop]
 *
 * one pass over the frames where PyTorch took two (the window's product, then n_fft / hop shifted
 * additions). */
void overlap_add(float *audio, const float *frames, const float *window, const float *inverse_envelope, int64_t count,
                 int64_t n_fft, int64_t hop, int64_t pad, int64_t length) {
    for (int64_t l = 0; l < length; l++)
        audio[l] = 0.0f;
    for (int64_t t = 0; t < count; t++) {
        const int64_t shift = t * hop - pad; /* frame t's sample k lands on audio[shift + k] */
        const int64_t first = shift < 0 ? -shift : 0, last = length - shift < n_fft ? length - shift : n_fft;
        const float *frame = frames + t * n_fft;
        for (int64_t k = first; k < last; k++)
            audio[shift + k] += frame[k] * window[k];
    }
    for (int64_t l = 0; l < length; l++)
        audio[l] *= inverse_envelope[l];
}

/* Phase Gradient Heuristic Integration (Prusa, Balazs and Sondergaard 2017), the integration over
 * an STFT's grid of `bins` x `frames` coefficients (row-major, index i = m frames + n) that
 * mmspec.modeling.spectrogram.pghi_phase prepares and checks (its Python loop is this one, step by
 * step, in the same arithmetic: float steps, their sums in double):
 *
 *   level[i]  the coefficient's magnitude band, 0 the loudest (-1: below the tolerance, phase 0)
 *   step_t[i] the phase's change over one frame at i, step_f[i] over one bin
 *
 * Coefficients are seeded loudest first (phase 0); from each seed the island above the tolerance
 * grows loudest-first (a bucket queue over the bands, last in first out within one), each new
 * neighbour's phase the trapezoid rule from the one it is reached from:
 *
 *   phi(m, n +- 1) = phi(m, n) +- (step_t(m, n) + step_t(m, n +- 1)) / 2   (and so across bins).
 *
 * Returns 0, or -1 where its working memory cannot be had. */
int pghi_integrate(double *phase, const int32_t *level, const float *step_t, const float *step_f, int64_t bins,
                   int64_t frames, int64_t bands) {
    const int64_t n = bins * frames;
    int32_t *seed_next = malloc(n * sizeof(int32_t)), *next = malloc(n * sizeof(int32_t));
    int32_t *seed_head = malloc(bands * sizeof(int32_t)), *head = malloc(bands * sizeof(int32_t));
    uint8_t *done = malloc(n);
    int status = -1;
    if (!seed_next || !next || !seed_head || !head || !done)
        goto out;
    for (int64_t b = 0; b < bands; b++)
        seed_head[b] = head[b] = -1;
    for (int64_t i = n - 1; i >= 0; i--) { /* each band's seeds in index order */
        phase[i] = 0.0;
        done[i] = level[i] < 0;
        if (level[i] >= 0) {
            seed_next[i] = seed_head[level[i]];
            seed_head[level[i]] = (int32_t)i;
        }
    }
    for (int64_t band = 0; band < bands; band++)
        for (int32_t seed = seed_head[band]; seed >= 0; seed = seed_next[seed]) {
            if (done[seed])
                continue;
            done[seed] = 1;
            int64_t current = level[seed], size = 1;
            next[seed] = head[current];
            head[current] = seed;
            while (size) {
                while (head[current] < 0)
                    current++;
                const int64_t i = head[current];
                head[current] = next[i];
                size--;
                const int64_t m = i / frames, t = i % frames;
                const double p = phase[i];
                int64_t neighbour[4];
                double value[4];
                int count = 0;
                if (t + 1 < frames)
                    neighbour[count] = i + 1, value[count++] = p + ((double)step_t[i] + step_t[i + 1]) / 2;
                if (t > 0)
                    neighbour[count] = i - 1, value[count++] = p - ((double)step_t[i] + step_t[i - 1]) / 2;
                if (m + 1 < bins)
                    neighbour[count] = i + frames, value[count++] = p + ((double)step_f[i] + step_f[i + frames]) / 2;
                if (m > 0)
                    neighbour[count] = i - frames, value[count++] = p - ((double)step_f[i] + step_f[i - frames]) / 2;
                for (int k = 0; k < count; k++) {
                    const int64_t j = neighbour[k];
                    if (done[j])
                        continue;
                    phase[j] = value[k];
                    done[j] = 1;
                    next[j] = head[level[j]];
                    head[level[j]] = (int32_t)j;
                    size++;
                    if (level[j] < current)
                        current = level[j];
                }
            }
        }
    status = 0;
out:
    free(seed_next), free(next), free(seed_head), free(head), free(done);
    return status;
}
