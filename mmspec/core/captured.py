"""Captured forwards: one CUDA graph per padded input size, replayed with no per-kernel launch cost.

On a GPU a small model's forward is bound by kernel launches and Python, not by arithmetic: a
verification forward over 16 inputs costs what one over a single input costs, and both cost far
more than the arithmetic. A CUDA graph records the forward's kernels once, over tensors that never
move (static input and output buffers, a :class:`~mmspec.core.cache.StaticKVCache`), and replays
them with one launch. Shapes must be static too, so the inputs are padded to a bucket (1, 2, 4, ...
inputs) and there is one graph per bucket, all sharing one memory pool.

:class:`GraphRunner` knows no model: its caller gives a function of the static buffers and fills
them before each run. On a CPU the same buffers are run eagerly (no capture), so the static path is
testable anywhere.
"""

from __future__ import annotations

from typing import Callable

import torch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def fill_static_mask(mask: torch.Tensor, cached: int, block: torch.Tensor) -> None:
    """A full-capacity boolean mask buffer [1, 1, b, capacity] (True = attend) <- the first n
    queries see the ``cached`` positions and ``block`` [n, n] among themselves (a chain: its lower
    triangle; a tree: its ancestor mask); the b - n padded queries see slot 0 only (no all-masked
    row, so no NaN anywhere in the buffers)."""
    n = block.shape[0]
    mask.zero_()
    mask[..., :n, :cached] = True
    mask[0, 0, :n, cached : cached + n] = block
    mask[..., n:, 0] = True


class GraphRunner:
    """Runs ``forward(**buffers) -> tuple of tensors`` over static buffers, one graph per bucket.

    Args:
        forward: the function to capture; it must read only the buffers it is given (and tensors
            that never move, such as weights and a static KV cache) and make no host sync.
        make_buffers: bucket size b -> {name: tensor}, the static inputs for b inputs (their
            initial contents must be safe to run: capture runs the forward for real to warm up).
        buckets: the padded sizes, increasing; a forward of n inputs runs the smallest bucket >= n.
        device: CUDA: capture graphs (all at construction); CPU: run eagerly.
        warmup: eager runs before each capture (on a side stream, as CUDA graphs need).
    """

    def __init__(self, forward: Callable[..., tuple[torch.Tensor, ...]], make_buffers: Callable[[int], dict[str, torch.Tensor]],
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, device: torch.device | str = "cpu", warmup: int = 2) -> None:
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be increasing positive sizes, got {buckets}")
        self.forward, self.buckets = forward, tuple(buckets)
        self.device = torch.device(device)
        self.buffers = {b: make_buffers(b) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        if self.device.type == "cuda":
            self._capture_all(warmup)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _capture_all(self, warmup: int) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for b in self.buckets:
                for _ in range(warmup):
                    self.forward(**self.buffers[b])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for b in self.buckets:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                self.outputs[b] = self.forward(**self.buffers[b])
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds n inputs."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"a forward over {n} inputs exceeds the largest captured size {self.buckets[-1]}; "
                         "pass larger buckets or decode without capture")

    @torch.no_grad()
    def run(self, b: int) -> tuple[torch.Tensor, ...]:
        """Run bucket b over its buffers (filled by the caller): its outputs, valid until the next run."""
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b]
        return self.forward(**self.buffers[b])
