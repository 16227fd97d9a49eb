/* Cephes' expf on GCC vectors, for the kernels of this directory:
 * out = 2^n p(r) with r = x - n ln 2 (ln 2 in two parts), n the lanes' nearest integers to x / ln 2
 * (`n`: an integer vector, `nf`: the same as floats), p the degree-6 polynomial. x within
 * [-87.3, 88.3] (the callers clamp). */
#ifndef MMSPEC_VMATH_H
#define MMSPEC_VMATH_H
#include <string.h>

#define CEPHES_EXP(VT, IT, x, n, nf, out)                                                                    \
    do {                                                                                                     \
        VT r_ = (x) - (nf) * 0.693359375f;                                                                   \
        r_ = r_ - (nf) * -2.12194440e-4f;                                                                    \
        VT p_ = (VT){0} + 1.9875691500e-4f;                                                                  \
        p_ = p_ * r_ + 1.3981999507e-3f;                                                                     \
        p_ = p_ * r_ + 8.3334519073e-3f;                                                                     \
        p_ = p_ * r_ + 4.1665795894e-2f;                                                                     \
        p_ = p_ * r_ + 1.6666665459e-1f;                                                                     \
        p_ = p_ * r_ + 5.0000001201e-1f;                                                                     \
        const VT y_ = p_ * (r_ * r_) + r_ + 1.0f;                                                            \
        const IT bits_ = ((n) + 127) << 23;                                                                  \
        VT scale_;                                                                                           \
        memcpy(&scale_, &bits_, sizeof scale_);                                                              \
        (out) = y_ * scale_;                                                                                 \
    } while (0)
#endif
