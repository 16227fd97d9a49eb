/* bf16 <-> fp32 for the kernels of this directory: a bf16 is the high half of an fp32; rounding to
 * nearest-even, NaN kept a NaN (as PyTorch rounds) */
#ifndef MMSPEC_BF16_H
#define MMSPEC_BF16_H
#include <stdint.h>

static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffff) > 0x7f800000) return (uint16_t)((c.u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((c.u + 0x7fff + ((c.u >> 16) & 1)) >> 16);
}
#endif
