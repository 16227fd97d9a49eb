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

from .cache import StaticKVCache

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


def check_buckets(buckets: tuple[int, ...]) -> None:
    """Raise ValueError unless ``buckets`` are increasing positive sizes."""
    if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"buckets must be increasing positive sizes, got {buckets}")


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
        check_buckets(buckets)
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


class StaticForward:
    """A forward over a :class:`~mmspec.core.cache.StaticKVCache`, padded to a bucket and run by a
    :class:`GraphRunner`: what a captured target's verification and a captured drafter head share.

    Each call pads its n inputs into the bucket's buffers (a [b] buffer along its only dim, an
    [R, b, ...] buffer along dim 1), writes them at cache slots cached .. cached + b - 1 under a
    full-capacity mask (:func:`fill_static_mask`: the cache and a chain's or tree's block), runs the
    bucket and advances the cache's length by n.

    Args:
        forward: ``forward(mask=..., **inputs)`` -> a tuple of outputs [R, b, ...]; it reads the
            cache (``cache.slots`` is set to the bucket's slots before it runs).
        make_inputs: bucket size b -> {name: zero buffer} of the forward's padded inputs.
        cache: the static KV cache; its last ``buckets[-1]`` slots are never part of a sequence
            (padded inputs write there while graphs are captured).
        buckets, device: as :class:`GraphRunner`'s.
    """

    def __init__(self, forward: Callable[..., tuple[torch.Tensor, ...]], make_inputs: Callable[[int], dict[str, torch.Tensor]],
                 cache: StaticKVCache, buckets: tuple[int, ...], device: torch.device) -> None:
        capacity, scratch = cache.capacity, cache.capacity - buckets[-1]

        def buffers(b: int) -> dict[str, torch.Tensor]:
            mask = torch.zeros(1, 1, b, capacity, dtype=torch.bool, device=device)
            mask[..., 0] = True  # every query sees a slot: no all-masked row, no NaN in any buffer
            return {**make_inputs(b), "mask": mask, "slots": torch.arange(scratch, scratch + b, device=device)}

        def run(mask, slots, **inputs):
            cache.slots = slots
            return forward(mask=mask, **inputs)

        self.cache = cache
        self.runner = GraphRunner(run, buffers, buckets, device)

    def __call__(self, n: int, block: torch.Tensor | None = None, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """n inputs (each [n] or [R, n, ...], named as ``make_inputs``'s buffers) attending to the
        cache and, among themselves, to ``block`` [n, n] (None: a chain) -> the outputs [R, n, ...]
        (copies: the buffers are reused by the next call)."""
        cached = self.cache.length
        b = self.runner.bucket(n)
        buffers = self.runner.buffers[b]
        for name, value in inputs.items():
            buffer = buffers[name]
            buffer.zero_()
            buffer.narrow(0 if buffer.dim() == 1 else 1, 0, n).copy_(value)
        torch.arange(cached, cached + b, out=buffers["slots"])
        if block is None:
            block = torch.ones(n, n, dtype=torch.bool, device=buffers["mask"].device).tril()
        fill_static_mask(buffers["mask"], cached, block)
        outputs = self.runner.run(b)
        self.cache.length = cached + n
        return tuple(output[:, :n].clone() for output in outputs)
