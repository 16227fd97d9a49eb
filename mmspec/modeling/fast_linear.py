"""``mmspec.optimize(model)``: few-row linears, so that verifying a few draft tokens costs about
what one decoding step costs.

On a CPU, PyTorch's fp32 ``F.linear`` takes MKL's GEMV for one row and a GEMM path for 2+ rows that
costs ~2x as much up to ~8 rows (docs/benchmarks.md: a 1536 x 576 linear on AVX2, 2 threads,
M=1 92 us, M=2 166 us, M=8 228 us). A speculative step's forward over n tokens is made of such
linears, so its cost C(n) jumps at n = 2 and every speedup is capped by C(n) / C(1).

:func:`optimize` replaces each fp32 ``nn.Linear`` of a model by a :class:`FewRowLinear` sharing its
parameters (no copy; tied weights stay tied; the state dict is unchanged), the way quantisation
libraries replace modules: the model's own forward methods are untouched. A few-row input (at most
``max_rows`` rows, no gradient needed) then goes through one of:

- ``"c"``: a small C kernel (``kernels/linear_fp32.c``, AVX2 + FMA, or AVX-512 where the CPU has it;
  OpenMP over output blocks) that
  loads each block of W once, uses it for every row while it is in L1, and prefetches the next
  block meanwhile (a model's weights stream from DRAM: one 1536 x 576 fp32 linear, 1 thread,
  F.linear / kernel: M=1 315 / 136 us, M=4 384 / 161 us, M=8 450 / 298 us). It is compiled with the
  machine's C compiler on first use (``scripts/install.sh`` builds it at install) into
  ``$MMSPEC_CACHE`` (default ``~/.cache/mmspec``). Its sums run in one fixed order per output, so
  a row's result is bitwise the same alone or among others: verification gives exactly the logits
  of one-token steps.
- ``"transposed"``: ``(W x^T)^T`` through PyTorch (the GEMM with the weight as the left operand:
  MKL's fast path for few columns; 2-4 rows measured at 1.3-1.6x less than ``F.linear``).

On a CPU with AVX512-BF16 the C kernel also serves bf16 linears (``vdpbf16ps``, fp32 sums rounded
to bf16 once, batch-invariant too): oneDNN's bf16 path is flat in the row count but streams the
weights at about half the speed. On a CPU with AMX-BF16 (Intel Sapphire Rapids and later) bf16
linears take AMX tiles instead (``tdpbf16ps``: the weight as 16 x 32 tiles straight from its rows,
the input rows repacked into pairs): within 1.3x of one row up to 16 rows when the weight streams
from memory (one 1536 x 576 bf16 linear from DRAM, 1 thread, M = 1 / 8 / 16: 123 / 167 / 158 us,
against 117 / 221 / 351 us for ``vdpbf16ps`` and 264 / 281 / 271 us for ``F.linear``;
docs/results/few-rows-amx-bf16.json). Without AMX the bf16 weights are packed too (:func:`pack_bf16`,
stop 60): 16 outputs in the lanes of a vector, each pair of columns one 64-byte load, so no
output ends in a horizontal sum; on a Zen 5 core the embedded voice's projections (K = 256 and 768)
took 90 / 104 / 226 us for 1 / 4 / 11 rows against 169 / 260 / 623 us reading W in place.
Each bf16 kernel is batch-invariant on its own; their sums differ in order, so a process uses one
for every call: the first of :func:`bf16_variants`, or the one named by ``MMSPEC_BF16_KERNEL``
(amx | avx512bf16), and each weight is read packed always (:meth:`FewRowLinear.packed_weight`) or
never (``optimize(pack=False)``, or models beyond :data:`PACK_LIMIT_BYTES`). Packed, the captioner's
linears streamed from DRAM (a Zen 5 core, stop 65) took 7.5 / 8.1 / 8.6 ms for 1 / 8 / 10 rows
against 7.9 / 10.6 / 13.4 ms in place. Where the 16-lane kernel is fp32's (AVX-512), fp32 weights
are packed the same way (:func:`pack_fp32`, one column a step; its own sums again): the captioner's
fp32 linears 15.3 / 17.2 / 17.9 ms for 1 / 8 / 12 rows against 17.9 / 24.0 / 31.3 ms in place.
Rows past ``max_rows`` (a prompt) take
oneDNN's GEMM over a copy of the weight that oneDNN reordered once
(:meth:`FewRowLinear.many_rows_weight`, ``pack_many``: ``F.linear`` reorders the weight on every
call, which on a Zen 5 core held a 35 x 576 by 576 x 1536 fp32 product to ~94 GFLOP/s against
~240). Other inputs (training, fp16 weights, CUDA) take ``F.linear``. ``kernel="auto"`` takes
``"c"`` where it can be built and loaded (x86-64 with AVX2 and FMA, a C compiler), else
``"transposed"``, and :func:`optimize` returns which (:class:`OptimizeReport`; pipelines put it in
their stats).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..core.verify import BLOCK_KERNELS, ROW_ARGMAXES, SPECULATIVE_KERNELS
from ..cpu import cpu_flags, intel_cpu, machine_cpu_flags  # (re-exported: their home before mmspec.cpu)
from .kernel_ids import LinearKernel

KERNELS = ("auto", "c", "transposed")
#: the C sources of the kernel library, every ``.c`` file of ``kernels/`` and ``kernels/portable/``
#: (sorted: the build's digest and link order are the same on every machine): the few-row linears
#: (``linear_fp32.c``, ``linear_bf16.c``, ``linear_int8.c``), the rows' argmax and speculative rule
#: (``verify.c``), the batch-invariant attention (``attention.c``), fused layers (``layer.c``),
#: Griffin-Lim's phase update and overlap-add (``spectral.c``) and, in plain C, the integration that
#: starts it (``portable/pghi.c``, built alone where the rest cannot be: :func:`load_portable_kernel`)
SOURCES_DIR = Path(__file__).with_name("kernels")
PORTABLE_SOURCES = tuple(sorted((SOURCES_DIR / "portable").glob("*.c")))
SOURCES = tuple(sorted(SOURCES_DIR.glob("*.c"))) + PORTABLE_SOURCES
#: the headers they include (part of the build's digest): ``kernels.h`` declares every entry point,
#: the kernel ids and the fused layer's spec
HEADERS = tuple(sorted(SOURCES_DIR.glob("*.h")))
#: blocks of 16 outputs in a group of the packed vector kernels' layouts (:func:`pack_bf16`,
#: :func:`pack_fp32`): a fused projection's parts are found in its packed copy only where they start
#: at a group. The build passes it to the C kernels as PK_NB (few_rows.h), so the two cannot part.
PACKED_GROUP_BLOCKS = 4
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", f"-DPK_NB={PACKED_GROUP_BLOCKS}")
#: the flags of the portable library (any CPU)
PORTABLE_CFLAGS = ("-O2", "-ffp-contract=off", "-shared", "-fPIC")
_LIBRARY: ctypes.CDLL | None = None
_PORTABLE: ctypes.CDLL | None = None


_NOTED: set[str] = set()  # the reasons OptimizeReport.note warned about in this process


class KernelUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded on this machine (the message says why)."""


def cache_dir() -> Path:
    return Path(os.environ.get("MMSPEC_CACHE", Path.home() / ".cache" / "mmspec")) / "kernels"


def load_kernel() -> ctypes.CDLL:
    """The compiled few-row kernel (built once per source and flags, then cached).

    Raises:
        KernelUnavailable: not x86-64 with AVX2 + FMA, no C compiler, or the build failed.
    """
    global _LIBRARY
    if _LIBRARY is not None:
        return _LIBRARY
    if not SOURCES:
        raise KernelUnavailable(f"the C kernels' sources are missing from this install ({SOURCES_DIR}/*.c); "
                                "reinstall mmspec from a clone (`bash scripts/install.sh`)")
    if not {"avx2", "fma"} <= cpu_flags():
        named = " (MMSPEC_CPU_FLAGS leaves them out)" if os.environ.get("MMSPEC_CPU_FLAGS", "").strip() else ""
        raise KernelUnavailable(f"the few-row C kernel needs an x86-64 CPU with AVX2 and FMA{named}")
    library = _open_library("few_rows", SOURCES, CFLAGS)
    for function in (library.few_rows_linear, library.few_rows_linear_avx512, library.few_rows_linear_avx512_packed,
                     library.few_rows_linear_bf16, library.few_rows_linear_bf16_packed, library.few_rows_linear_amx,
                     library.few_rows_linear_amx_packed):
        function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        function.restype = ctypes.c_int if function in (library.few_rows_linear_amx, library.few_rows_linear_amx_packed) else None
    library.few_rows_linear_i8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    library.few_rows_linear_i8.restype = ctypes.c_int
    library.few_rows_amx_init.argtypes, library.few_rows_amx_init.restype = [], ctypes.c_int
    library.few_rows_bf16_fma.argtypes, library.few_rows_bf16_fma.restype = [ctypes.c_int], None
    library.few_rows_bf16_fma(int(bf16_fma_sums()))  # (vfmadd231ps for vdpbf16ps on Intel cores: the same bits, faster)
    library.rows_argmax.argtypes, library.rows_argmax.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p], None
    for function in (library.speculative_rows, library.block_rows):
        function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2
        function.restype = ctypes.c_int
    library.coupled_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    library.coupled_rows.restype = ctypes.c_int
    for function in (library.few_rows_attention, library.few_rows_attention_avx512):
        function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 14 + [ctypes.c_float, ctypes.c_int]
        function.restype = ctypes.c_int
    library.griffin_lim_update.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_float]
    library.griffin_lim_update.restype = None
    library.overlap_add.argtypes, library.overlap_add.restype = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5, None
    library.stft_frames.argtypes, library.stft_frames.restype = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5, None
    _declare_portable(library)
    _LIBRARY = library
    return library


def kernel_library() -> ctypes.CDLL | None:
    """:func:`load_kernel`'s library, or None where it cannot be built or loaded (the callers'
    PyTorch paths run instead)."""
    try:
        return load_kernel()
    except KernelUnavailable:
        return None


def load_portable_kernel() -> ctypes.CDLL:
    """The plain-C kernels of ``kernels/portable/`` alone, for a CPU where :func:`load_kernel`'s
    library cannot be (no AVX2, not x86): built once per source, then cached.

    Raises:
        KernelUnavailable: no C compiler, or the build failed.
    """
    global _PORTABLE
    if _PORTABLE is None:
        if not PORTABLE_SOURCES:
            raise KernelUnavailable(f"the portable C kernels' sources are missing from this install "
                                    f"({SOURCES_DIR}/portable/*.c); reinstall mmspec from a clone (`bash scripts/install.sh`)")
        _PORTABLE = _declare_portable(_open_library("portable", PORTABLE_SOURCES, PORTABLE_CFLAGS))
    return _PORTABLE


def _declare_portable(library: ctypes.CDLL) -> ctypes.CDLL:
    """The argument types of the ``kernels/portable/`` entry points, in either library."""
    library.pghi_integrate.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    library.pghi_integrate.restype = ctypes.c_int
    return library


def _open_library(name: str, sources: tuple[Path, ...], flags: tuple[str, ...]) -> ctypes.CDLL:
    """``sources`` compiled with ``flags`` into the cache as NAME-DIGEST.so (the digest of the
    sources, the headers and the flags), built where absent or unloadable (once), then opened."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("gcc") or shutil.which("cc") or ""]
    if not compiler[0]:
        raise KernelUnavailable("the C kernels need a C compiler: install gcc (apt-get install gcc)")
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sources + HEADERS) + " ".join(flags).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{digest}.so"
    for attempt in range(2):
        if not path.exists():
            _build(compiler, path, sources, flags)
        try:
            if not _whole_elf(path):  # (dlopen of a truncated library is a SIGBUS, not an OSError)
                raise OSError("the file is cut short")
            return ctypes.CDLL(str(path))
        except OSError as error:  # a truncated or foreign file where the library should be: built again, once
            unloadable = KernelUnavailable(f"the C kernels' library {path} does not load ({error}); delete it")
            if attempt:
                raise unloadable from error
            try:
                path.unlink(missing_ok=True)
            except OSError:  # (a read-only cache)
                raise unloadable from error
    raise AssertionError("unreachable")


def _whole_elf(path: Path) -> bool:
    """Whether ``path`` holds a whole 64-bit ELF file: its section header table (at the file's end,
    where the linker writes it) inside the file. A library cut short by an interrupted copy of the
    cache crashed ``dlopen`` with a bus error, ending the process without a word."""
    import struct

    with open(path, "rb") as file:
        header = file.read(64)
        size = file.seek(0, os.SEEK_END)
    if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
        return False
    section_offset, = struct.unpack_from("<Q", header, 0x28)
    entry_size, count = struct.unpack_from("<HH", header, 0x3A)
    return section_offset + entry_size * count <= size


def _build(compiler: list[str], path: Path, sources: tuple[Path, ...], flags: tuple[str, ...]) -> None:
    """Compile ``sources`` with ``flags`` into ``path`` (built in a folder beside it, then moved:
    atomic when several processes build at once), saying so on stderr (it takes ~20 s, once per source)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.TemporaryDirectory(dir=path.parent)
    except OSError as error:  # a read-only or missing HOME: the PyTorch forms run instead
        raise KernelUnavailable(f"the C kernels' cache {path.parent} cannot be written ({error.strerror or error}); "
                                "set MMSPEC_CACHE to a writable directory to use them") from error
    for stale in path.parent.glob("tmp*"):  # a build killed midway leaves its folder: cleared after an hour
        if stale.is_dir() and time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    print(f"mmspec: building the C kernels into {path.parent} (once, ~20 s)", file=sys.stderr, flush=True)
    with probe as tmp:
        built = Path(tmp) / path.name
        try:
            result = subprocess.run([*compiler, *flags, *map(str, sources), "-o", str(built)], capture_output=True,
                                    text=True)
        except OSError as error:
            raise KernelUnavailable(f"the C compiler {' '.join(compiler)!r} cannot be run ({error.strerror or error}); "
                                    "install gcc or point CC at a compiler") from error
        if result.returncode != 0:
            said = result.stderr.strip()[:300] or f"{compiler[0]} exited with status {result.returncode}"
            raise KernelUnavailable(f"building the C kernels ({path.name}) failed: {said}")
        built.replace(path)


def bf16_fma_sums() -> bool:
    """Whether the packed AVX512-BF16 kernel sums its products through two ``vfmadd231ps`` per pair
    (``vdpbf16ps``'s bits, with its DAZ / FTZ) rather than ``vdpbf16ps``: on Intel cores
    (:func:`~mmspec.cpu.intel_cpu`), which retire the latter at half the rate. Its rows then cost
    about as float32's on the 16-lane kernel (:attr:`OptimizesOnLoad.verification_width` "medium")."""
    return intel_cpu()


def bf16_kernel_available() -> bool:
    """Whether the CPU runs a bf16 kernel (AVX512-BF16; AMX-BF16 CPUs have it too)."""
    return "avx512_bf16" in cpu_flags()


@functools.cache
def bf16_variants() -> tuple[str, ...]:
    """The bf16 kernels this process runs, the default first: "amx" (where the CPU has AMX-BF16
    and Linux grants the process the tile state), "avx512bf16"; () without AVX512-BF16.
    ``MMSPEC_BF16_KERNEL`` (amx | avx512bf16) puts that one first.

    Raises:
        ValueError: ``MMSPEC_BF16_KERNEL`` names a kernel this machine does not run.
    """
    wanted = os.environ.get("MMSPEC_BF16_KERNEL", "")
    if wanted and wanted not in ("amx", "avx512bf16"):  # (named before anything is built or read)
        raise ValueError(f"MMSPEC_BF16_KERNEL={wanted!r}: name amx or avx512bf16, or unset it")
    if not bf16_kernel_available():
        if wanted:
            raise ValueError(f"MMSPEC_BF16_KERNEL={wanted!r}: this CPU has no bf16 kernel (no AVX512-BF16); unset it")
        return ()
    variants = ("avx512bf16",)
    if {"amx_bf16", "amx_tile"} <= cpu_flags() and load_kernel().few_rows_amx_init() == 0:
        variants = ("amx", *variants)
    if wanted:
        if wanted not in variants:
            raise ValueError(f"MMSPEC_BF16_KERNEL={wanted!r}: this machine runs the bf16 kernels {variants}; "
                             "name one of them or unset it")
        variants = (wanted, *(v for v in variants if v != wanted))
    return variants


@functools.cache
def fp32_variants() -> tuple[str, ...]:
    """The fp32 kernels this CPU runs, the default first: "avx512" (16 lanes, where the CPU has
    AVX-512F), "avx2"."""
    return ("avx512", "avx2") if "avx512f" in cpu_flags() else ("avx2",)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    variant: str | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] (fp32, or bf16 on an AVX512-BF16 CPU; CPU tensors) ->
    x W^T + b [..., N] in their dtype through the C kernel (rows summed in one fixed order:
    batch-invariant, see the module doc; bf16: fp32 sums rounded to bf16 once, as F.linear does).
    ``variant``: the kernel for the weight's dtype, one of :func:`fp32_variants` or
    :func:`bf16_variants` (default: its first; the kernels of a dtype sum in different orders, so
    one machine keeps to one). ``packed``: the weight as :func:`pack_weight` lays it out for this
    machine's kernel for its dtype, read instead of ``weight``: by the AMX kernel (:func:`pack_amx`:
    bitwise its in-place results), the AVX512-BF16 one (:func:`pack_bf16`) or the 16-lane fp32 one
    (:func:`pack_fp32`; these two their own order of sums, so a weight is read packed always or never)."""
    shape = weight.shape
    if packed is None:
        function = _kernel_function(weight.dtype, variant)
    else:
        # (AMX: the tile state is asked for there; without it a tile instruction faults)
        kind, default = ("fp32", fp32_variants()[:1]) if weight.dtype == torch.float32 else ("bf16", bf16_variants()[:1])
        layout = {5: "amx", 4: "avx512bf16", 3: "avx512"}.get(packed.dim())  # pack_amx 5-D, pack_bf16 4-D, pack_fp32 3-D
        if default != (layout,) or variant not in (None, layout) or packed.dtype != weight.dtype:
            raise KernelUnavailable(f"these weights are packed for the {layout or 'unknown'} kernel; this machine's default "
                                    f"{kind} kernel is {default[0] if default else 'none'} (pack them with pack_weight)")
        function = getattr(load_kernel(), LinearKernel.variant(f"{layout} packed").entry)
        weight = packed  # (only its address is read: the shape is W's)
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != weight.dtype or not rows.is_contiguous():
        rows = rows.to(weight.dtype).contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()):
        bias = bias.to(weight.dtype).contiguous()
    out = torch.empty(rows.shape[0], shape[0], dtype=weight.dtype)
    status = function(rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                      rows.shape[0], shape[0], shape[1], torch.get_num_threads())
    if status:  # (the AMX kernel's scratch for the repacked rows)
        raise MemoryError(f"the few-row kernel could not allocate {rows.numel() * 2} bytes of scratch")
    return out.view(*x.shape[:-1], shape[0])


_FUNCTIONS: dict[tuple[torch.dtype, str | None], object] = {}


def _kernel_function(dtype: torch.dtype, variant: str | None):
    """The C entry point for weights of ``dtype`` and ``variant`` (resolved once per pair)."""
    if variant is None:  # the default: the first of the dtype's variants (cached per process)
        variants = bf16_variants() if dtype == torch.bfloat16 else fp32_variants() if dtype == torch.float32 else ()
        variant = variants[0] if variants else None
    function = _FUNCTIONS.get((dtype, variant))
    if function is not None:
        return function
    library = load_kernel()
    if dtype == torch.bfloat16:
        variants, kind = bf16_variants(), "bf16"
        if not variants:
            raise KernelUnavailable("the bf16 few-row kernel needs a CPU with AVX512-BF16")
    elif dtype == torch.float32:
        variants, kind = fp32_variants(), "fp32"
    else:
        raise ValueError(f"the few-row kernel takes float32 or bfloat16 weights, got {dtype}")
    if variant not in (None, *variants):
        raise KernelUnavailable(f"the {kind} few-row kernel {variant!r} does not run here; this machine runs {variants}")
    function = _FUNCTIONS[dtype, variant] = getattr(library, LinearKernel.variant(variant).entry)
    return function


#: the packed weights (:func:`pack_weight`) are a second copy of each linear's weight: :func:`optimize`
#: packs a model's linears only while their packable bytes stay within this limit (the embedded
#: models: 0.5-540 MB), larger ones keep the kernel that reads the weight where it is.
#: (Until stop 65 the AVX512-BF16 layout was packed only up to 64 MB: its four streams a group
#: lost to the in-place kernel from DRAM; one stream a group, it gains there too.)
PACK_LIMIT_BYTES = 2 << 30


#: :func:`optimize` gives linears a oneDNN-packed copy for inputs past ``max_rows`` (a prompt's
#: rows) only while the replaced weights total at most this (the copy doubles them)
MANY_ROWS_PACK_LIMIT_BYTES = 2 << 30


@functools.cache
def many_rows_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes whose many-row inputs can take oneDNN's packed linear
    (``torch.ops.mkldnn._linear_pointwise`` over a weight reordered once by
    ``_reorder_linear_weight``): fp32 where PyTorch has oneDNN, bf16 too where oneDNN runs bf16
    natively; () without oneDNN."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


#: the row count oneDNN is told to expect when it reorders a weight for many rows: a prompt's
MANY_ROWS_HINT = 64


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (N % 16 == 0, K % 4 == 0) -> the int8 kernel's blob, uint8 [N K + 8 N]: the rows
    quantised symmetrically per output, q[n] = round(W[n] / scale[n]) with scale[n] = max_k |W[n, k]|
    / 127 (1 for a zero row), laid out [N / 16, K / 4, 16, 4] (16 outputs x 4 inputs: one
    vpdpbusd operand); then scale (float32 [N]) and sum_k q[n, k] (int32 [N])."""
    n, k = weight.shape
    w = weight.detach().float().cpu()
    top = w.abs().amax(1)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    blocks = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    parts = (blocks.view(-1).view(torch.uint8), scale.view(torch.uint8), q.sum(1, dtype=torch.int32).view(torch.uint8))
    return torch.cat(parts)


class PreparedWeights:
    """An owner's weights prepared once for the kernels, by name: the C kernel's packed copy
    (:meth:`packed`: what :class:`FewRowLinear` reads, and :meth:`linear` over many rows) or
    oneDNN's reordered one (:meth:`reordered`), each made at its first use and again whenever its
    weight changed (another tensor, dtype, device, shape or place, or an in-place update: the
    version counter)."""

    def __init__(self) -> None:
        self._copies: dict[tuple[str, str], tuple[tuple, torch.Tensor | None]] = {}

    def __len__(self) -> int:
        """The copies kept."""
        return len(self._copies)

    def _copy(self, kind: str, name: str, weight: torch.Tensor, make) -> torch.Tensor | None:
        key = (weight.data_ptr(), weight.dtype, weight.device, weight.shape, weight.stride(), weight_version(weight))
        entry = self._copies.get((kind, name))
        if entry is None or entry[0] != key:
            entry = self._copies[kind, name] = (key, make(weight.detach().contiguous()))
        return entry[1]

    def reordered(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] reordered by oneDNN for many rows (a view, such as one codebook's rows
        of a stacked head, copied as it is laid out)."""
        return self._copy("onednn", name, weight, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, MANY_ROWS_HINT))

    def packed(self, name: str, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` [N, K] in this machine's C kernel's packed layout (:func:`pack_weight`), or
        None where :func:`packable` refuses it."""
        return self._copy("c", name, weight, lambda w: pack_weight(w) if packable(w) else None)

    def int8(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] as the int8 kernel's blob (:func:`pack_int8`)."""
        return self._copy("int8", name, weight, pack_int8)

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] W^T + b [..., N], then the exact GELU (``activation="gelu"``) or ``+ residual``
        [..., N], for x a CPU tensor in W's dtype with no gradient wanted:

        * through the C kernel over W's packed copy where :func:`many_rows_kernel` takes W (the AMX
          bf16 kernel, the 16-lane fp32 one): it builds nothing per row count, where oneDNN makes a
          primitive for every new one (~1 ms each: the embedded voice's NAR stage over a sentence
          of a new length, 125 frames, one AMX core, bf16: 7.7 ms against oneDNN's 20, and for a
          length seen before 6.8 against 8.0; fp32 on AVX-512 18 against 22 and 17). Its rows are
          summed alone (batch-invariant), as the few-row linears' are;
        * else in one oneDNN call over W's reordered copy with the op fused in, where oneDNN runs
          x's dtype (:func:`many_rows_dtypes`);
        * else, and under autograd, ``F.linear`` and PyTorch's op.
        """
        if activation not in ("none", "gelu") or activation == "gelu" and residual is not None:
            raise ValueError(f"activation must be 'none' or 'gelu' (without a residual), got {activation!r}")
        usable = (x.device.type == "cpu" and x.dtype == weight.dtype
                  and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
        if usable and many_rows_kernel(weight):
            out = few_rows_linear(x, weight, bias, packed=self.packed(name, weight))
        elif usable and x.dtype in many_rows_dtypes():
            copy = self.reordered(name, weight)
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), copy, bias, "add")
            return torch.ops.mkldnn._linear_pointwise(x, copy, bias, activation, [], "none" if activation == "gelu" else "")
        else:
            out = F.linear(x, weight, bias)
        return F.gelu(out) if activation == "gelu" else out if residual is None else out + residual


def many_rows_kernel(weight: torch.Tensor) -> bool:
    """Whether :meth:`PreparedWeights.linear` takes the C kernel for ``weight``: packable
    (:func:`packable`) for the AMX bf16 kernel or the 16-lane fp32 one, which keep up with oneDNN
    over a hundred rows and more (bf16, 150 rows of a 512 x 256 weight: 41 against 40 us), or for
    the AVX512-BF16 vector kernel where it sums through FMAs (:func:`bf16_fma_sums`: an AMX core run
    as a CPU without AMX, 110 rows of 1024 x 256, 465 us against oneDNN's vdpbf16ps 535 us; the voice's
    NAR stage 17.4 against 18.6 ms a sentence, stop 87); not that kernel's vdpbf16ps sums (2-3x
    oneDNN's time there), and where the kernels build."""
    if not packable(weight):
        return False
    if weight.dtype == torch.bfloat16 and bf16_variants()[:1] != ("amx",) and not bf16_fma_sums():
        return False
    return kernel_library() is not None


def packable(weight: torch.Tensor) -> bool:
    """Whether this machine's default kernel for ``weight``'s dtype can read it [N, K] packed: a CPU
    weight in bf16 (for AMX N a multiple of 16 and K of 32, whole tiles; AVX512-BF16 takes any
    shape, its packing pads) or in fp32 where the default fp32 kernel is the 16-lane one (any shape)."""
    if weight.dim() != 2 or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return fp32_variants()[:1] == ("avx512",)
    if weight.dtype != torch.bfloat16:
        return False
    default = bf16_variants()[:1]
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 if default == ("amx",) else default == ("avx512bf16",)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> the layout this machine's default kernel for its dtype reads packed
    (:func:`pack_fp32`, :func:`pack_amx` or :func:`pack_bf16`); :func:`packable` says where it applies."""
    if weight.dtype == torch.float32:
        return pack_fp32(weight)
    return pack_amx(weight) if bf16_variants()[:1] == ("amx",) else pack_bf16(weight)


def _pack_groups(blocks: torch.Tensor) -> torch.Tensor:
    """[blocks, 16, steps, e] (a weight's blocks of 16 outputs, its steps of e columns) -> the
    packed kernels' order (few_rows.h): groups of :data:`PACKED_GROUP_BLOCKS` blocks (the last maybe
    fewer), each [steps][blocks][16][e], flat."""
    return torch.cat([group.permute(2, 0, 1, 3).reshape(-1) for group in blocks.split(PACKED_GROUP_BLOCKS)])


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> the AVX512-BF16 packed kernel's layout (``kernels/linear_bf16.c``), a contiguous
    [ceil(N / 16), ceil(K / 2), 16, 2] tensor (zero-padded) whose blocks of 16 outputs go in groups
    of :data:`PACKED_GROUP_BLOCKS` (the last maybe fewer), each group's blocks side by side pair by
    pair: group bytes [ceil(K / 2)][blocks][16][2], the order in which the kernel streams them."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, k % 2, 0, -n % 16))
    blocks, pairs = padded.shape[0] // 16, padded.shape[1] // 2
    return _pack_groups(padded.view(blocks, 16, pairs, 2)).view(blocks, pairs, 16, 2)


def pack_fp32(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] fp32 -> the 16-lane packed fp32 kernel's layout (``kernels/linear_fp32.c``), a
    contiguous [ceil(N / 16), K, 16] tensor (zero-padded outputs) whose blocks go in groups as
    :func:`pack_bf16`'s, one column a step: group floats [K][blocks][16]."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -n % 16))
    blocks = padded.shape[0] // 16
    return _pack_groups(padded.view(blocks, 16, k, 1)).view(blocks, k, 16)


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> the AMX kernel's packed layout [N / 16, K / 32, 16, 16, 2] (contiguous): each
    32-column chunk of each 16-row block is the 1 KB tile the kernel loads as the right operand
    of its tile product (row r: for each of the 16 outputs the pair of columns 2r, 2r + 1), in the
    order it loads them, so the weight streams from memory as one sequence and the rows of x are
    read in place as the left operand (``kernels/linear_bf16.c``)."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def weight_version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place modification counter (None for an inference tensor, which has none)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


@functools.cache
def _argmax_library() -> ctypes.CDLL | None:
    """The kernel library where :func:`rows_argmax` runs (AVX-512, the kernels built), else None."""
    return kernel_library() if {"avx512f", "avx512bw"} <= cpu_flags() else None


def rows_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """``logits.max(dim=-1).indices`` through the C kernel for a contiguous fp32 / bf16 CPU tensor
    on an AVX-512 CPU where the kernels built (the first of tied maxima; a row's first NaN where it
    has one); None elsewhere. Registered with :data:`mmspec.core.verify.ROW_ARGMAXES`."""
    if (logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16) or not logits.is_contiguous()
            or logits.dim() == 0 or logits.numel() == 0):
        return None
    library = _argmax_library()
    if library is None:
        return None
    out = torch.empty(logits.shape[:-1], dtype=torch.long)
    library.rows_argmax(logits.data_ptr(), out.numel(), logits.shape[-1], int(logits.dtype == torch.bfloat16), out.data_ptr())
    return out


ROW_ARGMAXES.append(rows_argmax)


def _verify_library(longs: tuple[torch.Tensor, ...], floats: tuple[torch.Tensor, ...]) -> ctypes.CDLL | None:
    """The kernel library for a ``kernels/verify.c`` call over ``longs`` (LongTensors) and ``floats``
    (fp32 tensors), all contiguous on the CPU; None where one is not, or the kernels did not build."""
    if (any(t.device.type != "cpu" or t.dtype != torch.long or not t.is_contiguous() for t in longs)
            or any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in floats)):
        return None
    return kernel_library()


def _verification_rows(function: str, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, accept_uniforms: torch.Tensor, sample_uniforms: torch.Tensor, pad: int
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One verification rule's C kernel of ``kernels/verify.c`` (``function``: ``speculative_rows``
    or ``block_rows``) over contiguous fp32 CPU tensors where the kernels built -> (num_accepted
    [B], tokens [B, K + 1]); None elsewhere (or for a draft token outside the vocabulary: the
    PyTorch path reports it)."""
    tensors = (target_probs, accept_uniforms, sample_uniforms) + (() if draft_probs is None else (draft_probs,))
    library = _verify_library((draft_tokens,), tensors) if isinstance(pad, int) else None
    if library is None:
        return None
    batch, k = draft_tokens.shape
    accepted, tokens = torch.empty(batch, dtype=torch.long), torch.empty(batch, k + 1, dtype=torch.long)
    status = getattr(library, function)(target_probs.data_ptr(), None if draft_probs is None else draft_probs.data_ptr(),
                                        draft_tokens.data_ptr(), accept_uniforms.data_ptr(), sample_uniforms.data_ptr(), batch,
                                        k, target_probs.shape[-1], pad, accepted.data_ptr(), tokens.data_ptr())
    return None if status else (accepted, tokens)


def speculative_rows(*args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`mmspec.core.verify.speculative_verify` in one C call (``speculative_rows``: the same
    fp32 products and comparisons, the same double cumulative sums), registered with
    :data:`mmspec.core.verify.SPECULATIVE_KERNELS`; arguments and results as :func:`_verification_rows`'."""
    return _verification_rows("speculative_rows", *args)


def block_rows(*args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`mmspec.core.verify.block_verify` in one C call (``block_rows``: the same fp32 weights and
    residuals, the same double sums in order), registered with :data:`mmspec.core.verify.BLOCK_KERNELS`."""
    return _verification_rows("block_rows", *args)


def coupled_rows(new_probs: torch.Tensor, old_probs: torch.Tensor, old_tokens: torch.Tensor, uniforms: torch.Tensor
                 ) -> torch.Tensor | None:
    """Coupled SJD's redraft (:func:`mmspec.drafters.jacobi.coupled_redraft` over the first
    ``len(old_tokens)`` rows, a plain draw from the rest) in one C call (``kernels/verify.c``: the
    same fp32 products and comparisons, the same double sums in order, so the same codes), over
    contiguous fp32 CPU tensors where the kernels built; None elsewhere (or for an old code outside
    the vocabulary: the PyTorch path reports it).

    Args: new_probs [m, V], old_probs [kept, V], old_tokens LongTensor [kept] (kept <= m),
        uniforms [m, 2] (keep test, draw).
    Returns: LongTensor [m]."""
    library = _verify_library((old_tokens,), (new_probs, old_probs, uniforms))
    if library is None:
        return None
    m, vocab = new_probs.shape
    out = torch.empty(m, dtype=torch.long)
    status = library.coupled_rows(new_probs.data_ptr(), old_probs.data_ptr(), old_tokens.data_ptr(), uniforms.data_ptr(), m,
                                  old_tokens.shape[0], vocab, out.data_ptr())
    return None if status else out


SPECULATIVE_KERNELS.append(speculative_rows)
BLOCK_KERNELS.append(block_rows)


def kernel_dtypes(kernel: str) -> tuple[torch.dtype, ...]:
    """The weight dtypes ``kernel`` serves on this machine."""
    if kernel == "c" and bf16_kernel_available():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


class FewRowLinear(nn.Linear):
    """An ``nn.Linear`` whose forward over at most ``max_rows`` rows (in a dtype of
    :func:`kernel_dtypes`, CPU, no gradient needed) takes a few-row path (module doc); more rows
    take oneDNN's reordered weight where ``pack_many`` is on; anything else is ``F.linear``.

    Attributes:
        kernel: "c" or "transposed".
        max_rows: the largest row count (tokens x batch) sent to the few-row path.
        pack: keep the weight packed for the AMX kernel too (:meth:`packed_weight`).
        pack_many: send rows past ``max_rows`` through oneDNN's GEMM over a reordered copy of the
            weight (:meth:`many_rows_weight`) instead of ``F.linear``.
    """

    def __init__(self, linear: nn.Linear, kernel: str, max_rows: int, pack: bool = False, pack_many: bool = False) -> None:
        nn.Module.__init__(self)
        self.train(linear.training)  # (a module starts in training mode; an eval model stays in eval)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: ties and state dict kept
        self.kernel, self.max_rows = kernel, max_rows
        self.dtypes = kernel_dtypes(kernel)
        self.pack = pack and kernel == "c"
        self.pack_many = pack_many
        self._copies = PreparedWeights()  # the packed copy, and oneDNN's many-row one
        self.packed_weight()

    def packed_weight(self) -> torch.Tensor | None:
        """The weight in this machine's bf16 kernel's packed layout (:func:`pack_weight`), or None
        (``pack`` off, or a weight :func:`packable` refuses). Packed once and again whenever the
        weight changed: another tensor, dtype or device, or an in-place update (its version counter)."""
        return self._copies.packed("weight", self.weight) if self.pack else None

    def many_rows_weight(self) -> torch.Tensor:
        """The weight reordered by oneDNN for inputs of many rows (made at the first such input,
        again whenever the weight changed, as :meth:`packed_weight`)."""
        return self._copies.reordered("weight", self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        rows = x.numel() // max(1, x.shape[-1])
        usable = (x.dtype == weight.dtype and x.device.type == "cpu"
                  and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
        few = usable and 1 <= rows <= self.max_rows and x.dtype in self.dtypes
        if not few:
            if usable and self.pack_many and rows > self.max_rows and x.dtype in many_rows_dtypes():
                # a prompt's rows: oneDNN's GEMM over a weight it reordered once (the fp32 prompt of the
                # embedded captioner 136 -> 69 ms a caption on a Zen 5 core; F.linear reorders on every call)
                return torch.ops.mkldnn._linear_pointwise(x, self.many_rows_weight(), bias, "none", [], "")
            return F.linear(x, weight, bias)
        if self.kernel == "c":
            return few_rows_linear(x, weight, bias, packed=self.packed_weight())
        flat = x.reshape(-1, x.shape[-1])
        out = torch.mm(weight, flat.T).T
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, kernel={self.kernel}, max_rows={self.max_rows}" + (", packed" if self.pack else "")
                + (", onednn past max_rows" if self.pack_many else ""))


@dataclass(frozen=True)
class OptimizeReport:
    """What :func:`optimize` did: ``kernel`` ("c", "transposed" or "none": nothing to replace),
    ``replaced`` linears, ``skipped`` linears (not fp32 or not on the CPU, or a subclass of
    ``nn.Linear`` such as a quantised or LoRA layer), why ``kernel="auto"`` did not take the C
    kernel (``reason``), and whether prompts' rows take oneDNN's reordered weights (``prompts``)."""

    kernel: str
    replaced: int
    skipped: int
    reason: str = ""
    variants: str = ""  # the C kernel's variant per dtype replaced, e.g. "bf16 amx"
    prompts: bool = False

    @property
    def label(self) -> str:
        """The kernel and its variants, as stats record it: "c (bf16 amx)", "transposed", "none";
        "+ onednn prompts" where prompts take oneDNN's reordered weights; why the C kernels were not
        used, where they were not."""
        label = (f"{self.kernel} ({self.variants})" if self.variants else self.kernel) + (" + onednn prompts" if self.prompts else "")
        return label + (f"; C kernels not used: {self.reason}" if self.reason else "")

    def note(self) -> None:
        """Warn, once per process and reason, that the C kernels were not used and why (the PyTorch
        forms run instead, slower; a bf16 model's linears stay as loaded)."""
        if self.reason and self.reason not in _NOTED:
            _NOTED.add(self.reason)
            warnings.warn(f"PyTorch's forms run instead of the C kernels, slower: {self.reason}", UserWarning,
                          stacklevel=3)

    def summary(self) -> str:
        return f"few-row linears: {self.replaced} replaced ({self.label}), {self.skipped} left as they were"


def choose_kernel(kernel: str) -> tuple[str, str]:
    """``kernel`` ("auto" | "c" | "transposed") -> (the kernel, why "auto" did not take "c")."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; use one of {', '.join(KERNELS)}")
    if kernel != "auto":
        if kernel == "c":
            load_kernel()  # raises with the reason
        return kernel, ""
    try:
        load_kernel()
        return "c", ""
    except KernelUnavailable as error:
        return "transposed", str(error)


def default_max_rows(kernel: str, dtype: torch.dtype, packed: bool = False) -> int:
    """Rows up to which a linear of ``dtype`` takes ``kernel``'s few-row path by default: 64 for the
    AMX kernel (faster than ``F.linear`` at every count up to 64 measured, from DRAM and from
    cache: docs/benchmarks.md) and for ``packed`` weights (:func:`packable`: the packed vector
    kernels as fast as oneDNN's GEMM over a reordered weight at 64 rows in cache, faster from DRAM:
    the captioner's 35-row prompt takes them, through the fused layers, 47 -> 36 ms a prefill in
    bf16 and 73 -> 58 ms in fp32 on a Zen 5 core, stop 65), 48 for the AVX2 fp32 kernel (faster
    than oneDNN's GEMM over a reordered weight up to 48 rows, alike at 64: 30 of each of the
    captioner's linears streamed on a Zen 5 core restricted to AVX2, stop 64; so the captioner's
    35-row prompt takes it: 113 -> 105 ms a prefill), else 24 (the 16-lane vector kernels reading
    the weight in place measured faster up to 24 rows with weights streamed from memory, slower at 32)."""
    if kernel != "c":
        return 24
    amx = dtype == torch.bfloat16 and bf16_variants()[:1] == ("amx",)
    avx2 = dtype == torch.float32 and fp32_variants()[:1] == ("avx2",)
    return 64 if amx or packed else 48 if avx2 else 24


def optimize(model: nn.Module, kernel: str = "auto", max_rows: int | None = None, pack: bool | None = None,
             pack_many: bool | None = None) -> OptimizeReport:
    """Replace ``model``'s CPU ``nn.Linear`` modules (exactly that class) whose dtype the kernel
    serves (:func:`kernel_dtypes`: fp32; bf16 too with the C kernel on an AVX512-BF16 CPU) by
    :class:`FewRowLinear` in place (module doc). Idempotent: a FewRowLinear is left as it is.

    Args:
        model: any module (a transformers model, a drafter head, an mmspec model).
        kernel: "auto" | "c" | "transposed".
        max_rows: rows up to which the few-row path is taken (a verification's tokens, times 2
            under classifier-free guidance, or a tree's nodes); more go to ``F.linear``. None:
            :func:`default_max_rows` per linear (24; 48 for fp32 linears on the AVX2 kernel, 64 for bf16
            linears on the AMX kernel or packed). On the
            embedded text-to-image model, SJD's 18-row verification took 0.93 s per image through
            the fp32 kernel against 1.13 s with F.linear. (A fused decoder layer of AMX linears
            takes up to 128 rows under the default limit: :data:`mmspec.modeling.fused.AMX_FUSED_ROWS`.)
        pack: keep the weights packed as this machine's kernel for their dtype reads them too
            (:func:`pack_weight`, at the cost of a second copy; :func:`packable`): on AMX
            (:func:`pack_amx`) the same results, weights streamed ~10 % faster from memory and up
            to 1.5x from cache; on AVX512-BF16 (:func:`pack_bf16`) the packed kernel's own sums,
            1.8-2.8x faster for 1-16 rows of the embedded voice's projections, and from DRAM 1.05x
            for one row, 1.3x for eight (the captioner); fp32 on AVX-512 (:func:`pack_fp32`) its
            own sums too, from DRAM 1.17x for one row, 1.4x for eight. None: where the C kernel
            runs and the replaced packable weights total at most :data:`PACK_LIMIT_BYTES`.
        pack_many: inputs past ``max_rows`` (a prompt) take oneDNN's GEMM over a copy of the weight
            it reorders once (:meth:`FewRowLinear.many_rows_weight`) instead of ``F.linear``, which
            reorders it on every call: on a Zen 5 core the embedded captioner's prefill (image
            encoder and 35-row prompt) 136 -> 69 ms in fp32 and 54 -> 48 ms in bf16, and 137 -> 111 ms as an AVX2-only CPU
            (docs/benchmarks.md, stop 63). Other sums than ``F.linear``'s, for the prompt's rows
            only; every method of a call shares its prefill. None: where :func:`many_rows_dtypes`
            has the weights' dtype and the replaced weights total at most
            :data:`MANY_ROWS_PACK_LIMIT_BYTES`.
    Returns:
        :class:`OptimizeReport`.
    Raises:
        ValueError: an unknown kernel or a max_rows < 1.
        KernelUnavailable: ``kernel="c"`` on a machine that cannot build or load it.
    """
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"max_rows must be a positive integer, got {max_rows!r}")
    chosen, reason = choose_kernel(kernel)
    dtypes = kernel_dtypes(chosen)
    candidates, skipped = [], 0
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child.weight.dtype in dtypes and child.weight.device.type == "cpu":
                candidates.append((parent, name, child))
            elif isinstance(child, nn.Linear) and not isinstance(child, FewRowLinear):
                skipped += 1
    if not candidates:
        return OptimizeReport("none", 0, skipped, reason)
    if pack is None:
        packed_bytes = sum(child.weight.nbytes for _, _, child in candidates if packable(child.weight))
        pack = chosen == "c" and 0 < packed_bytes <= PACK_LIMIT_BYTES
    if pack_many is None:
        many_bytes = sum(child.weight.nbytes for _, _, child in candidates if child.weight.dtype in many_rows_dtypes())
        pack_many = 0 < many_bytes <= MANY_ROWS_PACK_LIMIT_BYTES
    many = [pack_many and child.weight.dtype in many_rows_dtypes() for _, _, child in candidates]
    for (parent, name, child), child_many in zip(candidates, many):
        rows = max_rows or default_max_rows(chosen, child.weight.dtype, pack and packable(child.weight))
        setattr(parent, name, FewRowLinear(child, chosen, rows, pack, child_many))
    variants = ""
    if chosen == "c":
        replaced = {child.weight.dtype for _, _, child in candidates}
        packs = {child.weight.dtype for _, _, child in candidates if pack and packable(child.weight)}
        variants = ", ".join(f"{kind} {pick()[0]}" + (" packed" if dtype in packs else "") for dtype, kind, pick in
                             ((torch.float32, "fp32", fp32_variants), (torch.bfloat16, "bf16", bf16_variants)) if dtype in replaced)
    return OptimizeReport(chosen, len(candidates), skipped, reason, variants, any(many))


class OptimizesOnLoad:
    """For objects that load networks as they are needed (a pipeline's components): with
    ``optimize`` true, :meth:`prepare` applies :func:`optimize` to each, and ``linears`` keeps the
    kernel that ran ("as loaded" while none did), for the stats; with it and their ``device`` and
    ``dtype``, :attr:`verification_width` says how wide a verification their windowed methods draft."""

    optimize: bool = False
    linears: str = "as loaded"

    @property
    def verification_width(self) -> str:
        """How many rows a verification can take for about the price of a decoding step, by the
        kernel the linears run (windowed methods draft by it: the voice's
        :meth:`~mmspec.pipelines.text_to_speech.methods.TTSMethod.draft_length`, SJD's window in
        :class:`~mmspec.pipelines.text_to_image.methods.JacobiMethod`):

        * "wide": a GPU, or a CPU whose bf16 few-row linears run on AMX tiles (within 1.3x of one
          row up to 16 rows): the voice's windows of 12-32 codes;
        * "medium": float32 on the 16-lane AVX-512 kernel, and bf16 on the packed AVX512-BF16 kernel
          where it sums through FMAs (Intel cores, :func:`bf16_fma_sums`). Their rows are dearer
          than AMX's, but in the 8-16 rows a coupled SJD window needs they cost less beside the
          weights' streaming than on the narrow kernels. On the voice, one AMX core run as each CPU,
          temperature 1: float32 8-16 codes measured best; bf16 through the FMAs, coupled SJD at 5 / 8 /
          10 / 12 codes 1.63x / 1.74x / 1.65x / 1.69x (two runs each, stop 87, oneDNN left its AMX
          tiles), 5 / 8 codes 1.54-1.56x / 1.60x with oneDNN held to AVX512_CORE_BF16; `sjd`, `eagle`
          and `sjd-topk` at their narrow and medium windows within 0.04x of each other;
        * "narrow": elsewhere (the AVX-512-BF16 kernel's `vdpbf16ps` sums, AVX2, PyTorch's own
          linears: 2-3x one row at 12-16 rows): the voice's windows of 3-10 codes, SJD's of 2 image tokens.
        """
        if self.device.type != "cpu" or "amx" in self.linears:
            return "wide"
        if self.dtype == torch.float32 and "fp32 avx512" in self.linears:
            return "medium"
        return "medium" if self.dtype == torch.bfloat16 and "bf16 avx512bf16 packed" in self.linears and bf16_fma_sums() else "narrow"

    @property
    def wide_verification(self) -> bool:
        """Whether :attr:`verification_width` is "wide" (a GPU, AMX tiles)."""
        return self.verification_width == "wide"

    def prepare(self, network: nn.Module) -> None:
        """:func:`optimize` ``network`` (with ``optimize``); ``linears`` gathers each distinct label."""
        if self.optimize:
            report = optimize(network)
            report.note()
            if report.kernel != "none":
                labels = [] if self.linears == "as loaded" else self.linears.split(" | ")
                self.linears = " | ".join(dict.fromkeys([*labels, report.label]))


def build() -> None:
    """Build the C kernels now and say where they are, or why not (scripts/install.sh calls this)."""
    try:
        print(f"C kernels (few-row linears, attention, fused layers, Griffin-Lim): {load_kernel()._name}")
    except KernelUnavailable as error:
        print(f"few-row kernel not built ({error}); mmspec.optimize will use the transposed form", file=sys.stderr)
        try:
            print(f"portable C kernels (the codec's phase integration): {load_portable_kernel()._name}")
        except KernelUnavailable as error:
            print(f"portable kernels not built ({error}); the codec's phase integration runs in Python", file=sys.stderr)
