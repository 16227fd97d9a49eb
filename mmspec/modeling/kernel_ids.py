"""The ids by which Python names a C kernel to the kernel library, in one place.

A fused layer tells ``kernels/layer.c`` which few-row linear its projections take by an integer
(``LayerSpec.linear``, ``head_chain``'s ``fc_kind`` / ``out_kind``), and the int8 kernel is told how
to sum by another (its ``path``). The C side names them in ``enum linear_kernel`` and ``enum
i8_path`` of ``kernels/kernels.h``; these enums are their Python mirror (tests/test_fused.py checks
that the two agree name by name and value by value), and the variant names the rest of mmspec uses
("avx2", "amx", ...: :func:`mmspec.modeling.fast_linear.fp32_variants`, ``bf16_variants``,
:func:`mmspec.modeling.fused.int8_paths`) map onto them here and nowhere else.
"""

from __future__ import annotations

from enum import IntEnum


class LinearKernel(IntEnum):
    """``enum linear_kernel``: the few-row linear kernel a fused layer's projections take."""

    AVX2 = 0  #: fp32, 8 lanes (``few_rows_linear``)
    AVX512 = 1  #: fp32, 16 lanes (``few_rows_linear_avx512``)
    AVX512BF16 = 2  #: bf16, vdpbf16ps (``few_rows_linear_bf16``)
    AMX = 3  #: bf16, AMX tiles, the weight read in place (``few_rows_linear_amx``)
    AMX_PACKED = 4  #: bf16, AMX tiles, the weight packed (``few_rows_linear_amx_packed``)
    AVX512BF16_PACKED = 5  #: bf16, vdpbf16ps, the weight packed (``few_rows_linear_bf16_packed``)
    I8 = 6  #: the first int8 id: ``I8 + 2 path + 1`` for fp32 rows, ``+ 0`` for bf16 (:meth:`int8`)
    I8_LAST = 13  #: the last int8 id (``I8 + 2 Int8Path.AVX2 + 1``)
    AVX512_PACKED = 14  #: fp32, 16 lanes, the weight packed (``few_rows_linear_avx512_packed``)

    @classmethod
    def variant(cls, name: str) -> LinearKernel:
        """A variant's name as :func:`~mmspec.modeling.fast_linear.fp32_variants` / ``bf16_variants``
        give it ("avx2", "avx512", "avx512bf16", "amx"; "amx packed" / "avx512bf16 packed" / "avx512
        packed": those kernels on packed weights)
        -> its id."""
        return cls[name.upper().replace(" ", "_")]

    @property
    def entry(self) -> str:
        """The C function of the kernel library running this kernel."""
        return _ENTRIES[self]

    @classmethod
    def int8(cls, path: Int8Path, bf16_rows: bool) -> int:
        """The id of the int8 kernel summing the way ``path`` names, for rows of bf16 (else fp32)
        (``kernels/layer.c`` reads the path and the dtype back from it)."""
        return cls.I8 + 2 * Int8Path(path) + (not bf16_rows)


class Int8Path(IntEnum):
    """``enum i8_path``: how the int8 kernel (``few_rows_linear_i8``) sums; the same integers every way."""

    SCALAR = 0  #: a scalar loop
    VNNI = 1  #: AVX512-VNNI vpdpbusd
    AMX = 2  #: AMX-INT8 tiles for two rows or more where K % 64 == 0 (else VNNI)
    AVX2 = 3  #: AVX2 vpmaddwd over the weights widened to int16

    @property
    def label(self) -> str:
        """The path's name as :func:`mmspec.modeling.fused.int8_paths` gives it ("vnni", ...)."""
        return self.name.lower()


_ENTRIES = {LinearKernel.AVX2: "few_rows_linear", LinearKernel.AVX512: "few_rows_linear_avx512",
            LinearKernel.AVX512BF16: "few_rows_linear_bf16", LinearKernel.AMX: "few_rows_linear_amx",
            LinearKernel.AMX_PACKED: "few_rows_linear_amx_packed",
            LinearKernel.AVX512BF16_PACKED: "few_rows_linear_bf16_packed", LinearKernel.I8: "few_rows_linear_i8",
            LinearKernel.I8_LAST: "few_rows_linear_i8", LinearKernel.AVX512_PACKED: "few_rows_linear_avx512_packed"}
