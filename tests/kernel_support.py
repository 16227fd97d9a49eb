"""Whether mmspec's C kernels build on this machine: tests that need them skip where they do not."""

import pytest

from mmspec.modeling.fast_linear import KernelUnavailable, load_kernel

try:
    load_kernel()
    BUILT = True
except KernelUnavailable:
    BUILT = False
needs_kernel = pytest.mark.skipif(not BUILT, reason="the C kernels cannot be built here")
