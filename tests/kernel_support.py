"""Whether mmspec's C kernels build on this machine (tests that need them skip where they do not),
and the int8 kernel as a module."""

import pytest
import torch

from mmspec.modeling.fast_linear import KernelUnavailable, load_kernel

try:
    load_kernel()
    BUILT = True
except KernelUnavailable:
    BUILT = False
needs_kernel = pytest.mark.skipif(not BUILT, reason="the C kernels cannot be built here")


class Int8Linear(torch.nn.Module):
    """A linear through the int8 kernel (mmspec.modeling.fused.int8_linear): what the int8 chain
    reads, as a module the Python loop can run."""

    def __init__(self, linear):
        from mmspec.modeling.fused import pack_int8

        super().__init__()
        self.blob, self.bias, self.out_features = pack_int8(linear.weight), linear.bias, linear.out_features

    def forward(self, x):
        from mmspec.modeling.fused import int8_linear

        return int8_linear(x.reshape(-1, x.shape[-1]).contiguous(), self.blob, self.out_features, self.bias).view(*x.shape[:-1], -1)
