/* Phase gradient heuristic integration (mmspec.modeling.spectrogram.pghi_phase): plain C, so that
 * it builds on any CPU with a C compiler. It is part of the kernel library where that builds (x86-64
 * with AVX2 + FMA) and is built alone elsewhere (mmspec.modeling.fast_linear.load_portable_kernel):
 * without it pghi_phase runs its Python twin, ~15x slower. */
#include <stdint.h>
#include <stdlib.h>

#include "../kernels.h"

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
