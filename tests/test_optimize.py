"""mmspec.optimize: few-row linears give the untransformed model's outputs (every supported family),
the C kernel is exact to fp32 rounding and batch-invariant, and the transform is explicit."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tiny_models import FAMILIES, make_tiny

import mmspec
from mmspec.adapters.hf import TransformersTarget
from mmspec.cpu import cpu_flags, intel_cpu
from mmspec.modeling import fast_linear
from mmspec.modeling.fast_linear import (FewRowLinear, KernelUnavailable, bf16_variants, default_max_rows, few_rows_linear,
                                         fp32_variants, load_kernel, many_rows_dtypes, optimize, pack_amx, packable)

try:
    load_kernel()
    KERNELS = ["c", "transposed"]
except KernelUnavailable as why:  # a machine without AVX2 / a C compiler: the torch form only
    KERNELS = [pytest.param("c", marks=pytest.mark.skip(reason=str(why))), "transposed"]
needs_kernel = pytest.mark.skipif(KERNELS[0] != "c", reason="the C kernel cannot be built here")


@needs_kernel
@pytest.mark.parametrize("variant", ["avx2", "avx512"])
@pytest.mark.parametrize("n,k,bias", [(13, 37, True), (64, 64, False), (1537, 576, True), (5, 3, True), (9, 1000, True)])
def test_the_kernel_is_a_linear_and_batch_invariant(n, k, bias, variant):
    if variant not in fp32_variants():
        pytest.skip(f"this CPU runs the fp32 kernels {fp32_variants()}")
    gen = torch.Generator().manual_seed(n)
    weight, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if bias else None
    x = torch.randn(16, k, generator=gen)
    out = few_rows_linear(x, weight, b, variant=variant)
    reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), reference, atol=1e-4 * k ** 0.5, rtol=1e-5)
    for rows in (1, 2, 3, 5, 6, 7, 9, 13, 16):  # a row's result does not depend on its neighbours (nor on the passes: 3 + 3, 4 + 3 + 3 + 3, ...)
        assert torch.equal(few_rows_linear(x[:rows], weight, b, variant=variant), out[:rows])
    assert torch.equal(few_rows_linear(x[9:10], weight, b, variant=variant), out[9:10])
    assert not torch.equal(out, F.linear(x, weight.roll(1, 0), b))  # negative control: a wrong weight differs


def test_default_max_rows_follow_the_kernel(monkeypatch):
    """The AVX2 fp32 kernel takes up to 48 rows (a prompt of the captioner's 35), the AMX one and
    packed weights 64, the 16-lane vector kernels reading weights in place and the PyTorch form 24."""
    monkeypatch.setattr(fast_linear, "fp32_variants", lambda: ("avx2",))
    monkeypatch.setattr(fast_linear, "bf16_variants", lambda: ())
    assert default_max_rows("c", torch.float32) == 48 and default_max_rows("transposed", torch.float32) == 24
    monkeypatch.setattr(fast_linear, "fp32_variants", lambda: ("avx512", "avx2"))
    assert default_max_rows("c", torch.float32) == 24
    monkeypatch.setattr(fast_linear, "bf16_variants", lambda: ("amx", "avx512bf16"))
    assert default_max_rows("c", torch.bfloat16) == 64 and default_max_rows("c", torch.float32) == 24
    monkeypatch.setattr(fast_linear, "bf16_variants", lambda: ("avx512bf16",))
    assert default_max_rows("c", torch.bfloat16) == 24 and default_max_rows("c", torch.bfloat16, packed=True) == 64
    assert default_max_rows("c", torch.float32, packed=True) == 64 and default_max_rows("transposed", torch.bfloat16, True) == 24


@needs_kernel
def test_the_default_fp32_kernel_is_the_widest_the_cpu_runs():
    x, weight = torch.randn(3, 40), torch.randn(17, 40)
    assert torch.equal(few_rows_linear(x, weight), few_rows_linear(x, weight, variant=fp32_variants()[0]))
    with pytest.raises(KernelUnavailable, match="does not run here"):
        few_rows_linear(x, weight, variant="sse")


@needs_kernel
@pytest.mark.parametrize("variant", ["amx", "avx512bf16"])
@pytest.mark.parametrize("n,k,bias", [(13, 38, True), (64, 64, False), (1537, 576, True), (40, 70, True), (9, 1001, True)])
def test_the_bf16_kernels_are_a_linear_and_batch_invariant(n, k, bias, variant):
    """bf16 weights and rows: fp32 sums rounded to bf16 once (within one bf16 rounding of the exact
    product), and a row's result the same alone or among up to 33 others (AMX: two 16-row passes
    and a 1-row one; 16-output tiles and the outputs short of one; K off the 32-wide chunks; odd K)."""
    if variant not in bf16_variants():
        pytest.skip(f"this machine runs the bf16 kernels {bf16_variants()}")
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(33, k, generator=gen).bfloat16()
    out = few_rows_linear(x, weight, b, variant=variant)
    assert out.dtype == torch.bfloat16 and out.shape == (33, n)
    reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), reference, atol=1e-4 * k ** 0.5, rtol=2 ** -8)
    for rows in (1, 2, 5, 15, 16, 17, 32):
        assert torch.equal(few_rows_linear(x[:rows], weight, b, variant=variant), out[:rows])
    assert torch.equal(few_rows_linear(x[20:21], weight, b, variant=variant), out[20:21])
    assert not torch.equal(out, few_rows_linear(x, weight.roll(1, 0), b, variant=variant))  # negative control


@needs_kernel
@pytest.mark.parametrize("n,k,bias", [(16, 32, False), (48, 96, True), (1536, 576, True), (576, 1536, False)])
def test_the_packed_amx_kernel_gives_the_strided_kernels_results(n, k, bias):
    """Packed (pack_amx: W as the tiles' right operand, the rows read in place as the left), the AMX
    kernel gives bitwise what it gives reading W in place (W the left operand, the rows repacked),
    for every row count: one group, two, a pass of 32 and the rows after it."""
    if bf16_variants()[:1] != ("amx",):
        pytest.skip("packed weights are read by the AMX kernel only")
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(70, k, generator=gen).bfloat16()
    packed = pack_amx(weight)
    assert packed.shape == (n // 16, k // 32, 16, 16, 2) and not torch.equal(packed.flatten(), weight.flatten())
    for rows in (1, 2, 7, 16, 17, 31, 32, 33, 48, 70):
        assert torch.equal(few_rows_linear(x[:rows], weight, b, packed=packed), few_rows_linear(x[:rows], weight, b, variant="amx"))
    assert not torch.equal(few_rows_linear(x, weight, b, packed=pack_amx(weight.roll(1, 1))), few_rows_linear(x, weight, b))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n,k,bias", [(16, 32, False), (48, 96, True), (257, 256, True), (20, 33, True), (768, 256, False),
                                      (256, 768, True)])
def test_the_packed_vector_kernels(n, k, bias, dtype, monkeypatch):
    """pack_bf16 / pack_fp32 (the outputs in the lanes, any shape: zero-padded to 16 outputs, bf16
    to an even K): close to F.linear in float64, and batch-invariant: every row count (a pass of 6
    rows, parts of one, several passes over chunks, slabs of them) gives each row bitwise what it
    gets alone; FewRowLinear reads its packed copy."""
    import mmspec.modeling.fast_linear as fast_linear

    bf16 = dtype == torch.bfloat16
    kernel, variants = ("avx512bf16", "bf16_variants") if bf16 else ("avx512", "fp32_variants")
    if kernel not in getattr(fast_linear, variants)():
        pytest.skip(f"the packed {kernel} kernel does not run here")
    pack = fast_linear.pack_bf16 if bf16 else fast_linear.pack_fp32
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    x = torch.randn(25, k, generator=gen).to(dtype)
    packed = pack(weight)
    assert packed.shape == (((n + 15) // 16, (k + 1) // 2, 16, 2) if bf16 else ((n + 15) // 16, k, 16))
    monkeypatch.setattr(fast_linear, variants, lambda: (kernel,))  # (the default here: on an AMX machine too)
    out = few_rows_linear(x, weight, b, packed=packed)
    reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), reference, **(dict(atol=1e-4 * k ** 0.5, rtol=2 ** -8) if bf16
                                                          else dict(atol=1e-5 * k ** 0.5, rtol=1e-5)))
    alone = torch.cat([few_rows_linear(x[i : i + 1], weight, b, packed=packed) for i in range(25)])
    assert torch.equal(out, alone)
    for rows in (2, 5, 6, 7, 12, 13):
        assert torch.equal(few_rows_linear(x[3 : 3 + rows], weight, b, packed=packed), out[3 : 3 + rows])
    many = torch.cat([x] * 5)  # 125 rows: past a slab of 96, in two (the passes' scratch is bounded)
    assert torch.equal(few_rows_linear(many, weight, b, packed=packed), torch.cat([out] * 5))
    assert not torch.equal(few_rows_linear(x, weight, b, packed=pack(weight.roll(1, 1))), out)
    linear = nn.Linear(k, n, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias:
            linear.bias.copy_(b)
    module = FewRowLinear(linear, "c", 24, pack=True)
    with torch.no_grad():
        assert module.packed_weight().shape == packed.shape and torch.equal(module(x[:7]), out[:7])


@needs_kernel
def test_the_packed_bf16_kernel_sums_alike_through_fmas(monkeypatch):
    """On Intel cores the packed AVX512-BF16 kernel adds each pair's two products with vfmadd231ps
    instead of vdpbf16ps (DAZ / FTZ set, the odd element first, as the SDM defines vdpbf16ps): the
    same bits for every shape and row count (past PK_SLAB's 96 rows too: slabs), normal values,
    products below fp32's normal range and denormal inputs, one thread or two; without DAZ / FTZ a
    third of these cases differed."""
    import mmspec.modeling.fast_linear as fast_linear

    if "avx512bf16" not in fast_linear.bf16_variants():
        pytest.skip("the AVX512-BF16 kernel does not run here")
    monkeypatch.setattr(fast_linear, "bf16_variants", lambda: ("avx512bf16",))
    library, gen, threads_before = fast_linear.load_kernel(), torch.Generator().manual_seed(0), torch.get_num_threads()
    try:
        for n, k in ((16, 2), (17, 3), (257, 256), (256, 768), (33, 97)):
            for scale in (1.0, 1e-19, "denormal"):
                weight, x, b = torch.randn(n, k, generator=gen), torch.randn(101, k, generator=gen), torch.randn(n, generator=gen)
                if scale == "denormal":
                    weight[torch.rand(n, k, generator=gen) < 0.2] *= 1e-39
                    x[:, ::3] *= 1e-40
                else:
                    weight, x, b = weight * scale, x * scale, b * scale * scale
                weight, x, b = weight.bfloat16(), x.bfloat16(), b.bfloat16()
                packed = fast_linear.pack_bf16(weight)
                for rows, threads in ((1, 1), (2, 2), (6, 1), (7, 2), (13, 1), (101, 2)):  # (each thread sets its own MXCSR)
                    outs = []
                    torch.set_num_threads(threads)
                    for fma in (0, 1):
                        library.few_rows_bf16_fma(fma)
                        outs.append(few_rows_linear(x[:rows], weight, b if rows % 2 else None, packed=packed))
                    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), (n, k, scale, rows)
    finally:
        library.few_rows_bf16_fma(int(intel_cpu()))
        torch.set_num_threads(threads_before)


@needs_kernel
def test_packed_weights_are_read_by_the_kernel_they_are_packed_for(monkeypatch):
    """few_rows_linear(packed=...) reads a weight packed for this machine's default bf16 kernel:
    AMX tiles where the process runs another (a tile instruction without the tile state would
    fault), AVX512-BF16's layout where AMX runs, the 16-lane fp32 layout where the AVX2 kernel is
    fp32's, are refused in one line."""
    import mmspec.modeling.fast_linear as fast_linear

    weight, x = torch.randn(16, 32).bfloat16(), torch.randn(2, 32).bfloat16()
    for default, other in ((("avx512bf16",), fast_linear.pack_amx), (("amx", "avx512bf16"), fast_linear.pack_bf16)):
        monkeypatch.setattr(fast_linear, "bf16_variants", lambda default=default: default)
        with pytest.raises(KernelUnavailable, match=f"this machine's default bf16 kernel is {default[0]}"):
            fast_linear.few_rows_linear(x, weight, packed=other(weight))
    monkeypatch.setattr(fast_linear, "fp32_variants", lambda: ("avx2",))
    with pytest.raises(KernelUnavailable, match="this machine's default fp32 kernel is avx2"):
        fast_linear.few_rows_linear(x.float(), weight.float(), packed=fast_linear.pack_fp32(weight.float()))
    assert not fast_linear.packable(weight.float())


@needs_kernel
def test_the_bf16_kernel_is_chosen_once_per_process(monkeypatch):
    """The default bf16 kernel is the first of bf16_variants(); MMSPEC_BF16_KERNEL puts another
    first, and a kernel the machine does not run is refused in one line."""
    if not bf16_variants():
        pytest.skip("no AVX512-BF16 here")
    x, weight = torch.randn(3, 64).bfloat16(), torch.randn(20, 64).bfloat16()
    assert torch.equal(few_rows_linear(x, weight), few_rows_linear(x, weight, variant=bf16_variants()[0]))
    model = nn.Sequential(nn.Linear(64, 20)).to(torch.bfloat16)
    report = optimize(model, kernel="c")
    variant = bf16_variants()[0] + (" packed" if packable(model[0].weight) else "")  # (AMX packs whole tiles only)
    prompts = " + onednn prompts" if torch.bfloat16 in many_rows_dtypes() else ""
    assert report.variants == f"bf16 {variant}" and report.label == f"c (bf16 {variant}){prompts}" and report.prompts == bool(prompts)
    assert model[0].max_rows == 64  # AMX and the packed vector kernel stay ahead of oneDNN to 64 rows
    unpacked = nn.Sequential(nn.Linear(64, 20)).to(torch.bfloat16)
    optimize(unpacked, kernel="c", pack=False)
    assert unpacked[0].max_rows == (64 if bf16_variants()[0] == "amx" else 24)
    fp32 = nn.Sequential(nn.Linear(64, 20))
    packs = fp32_variants()[0] == "avx512"  # (the 16-lane fp32 kernel reads packed weights; the AVX2 one in place)
    assert optimize(fp32, kernel="c").variants == f"fp32 {fp32_variants()[0]}" + (" packed" if packs else "")
    assert fp32[0].max_rows == (64 if packs else 48 if fp32_variants()[0] == "avx2" else 24)
    try:
        for wanted in bf16_variants():
            monkeypatch.setenv("MMSPEC_BF16_KERNEL", wanted)
            bf16_variants.cache_clear()
            assert bf16_variants()[0] == wanted
        monkeypatch.setenv("MMSPEC_BF16_KERNEL", "sse")
        bf16_variants.cache_clear()
        with pytest.raises(ValueError, match="MMSPEC_BF16_KERNEL='sse': name amx or avx512bf16, or unset it"):
            bf16_variants()
        monkeypatch.setenv("MMSPEC_BF16_KERNEL", "amx")  # on a CPU run as one without bf16 (was silently unused)
        monkeypatch.setenv("MMSPEC_CPU_FLAGS", "avx2,fma")
        cpu_flags.cache_clear()
        bf16_variants.cache_clear()
        with pytest.raises(ValueError, match="MMSPEC_BF16_KERNEL='amx': this CPU has no bf16 kernel"):
            bf16_variants()
    finally:
        monkeypatch.delenv("MMSPEC_BF16_KERNEL")
        monkeypatch.delenv("MMSPEC_CPU_FLAGS", raising=False)
        cpu_flags.cache_clear()
        bf16_variants.cache_clear()


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_few_row_linear_keeps_parameters_and_leaves_the_rest_to_f_linear(kernel):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))
    model[2].weight = nn.Parameter(torch.randn(8, 40))
    reference = copy.deepcopy(model)
    keys, weight = set(model.state_dict()), model[0].weight
    report = optimize(model, kernel=kernel, max_rows=4)
    assert (report.kernel, report.replaced, report.skipped) == (kernel, 2, 0)
    assert isinstance(model[0], FewRowLinear) and model[0].weight is weight and set(model.state_dict()) == keys
    assert optimize(model, kernel=kernel).replaced == 0  # idempotent
    evaluated = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 8)).eval()
    evaluated[1].train()
    optimize(evaluated, kernel=kernel)  # each replacement keeps its linear's training flag
    assert [m.training for m in evaluated] == [False, True] and isinstance(evaluated[0], FewRowLinear)
    with torch.no_grad():
        for rows in (1, 3, 4, 5, 9):  # 5, 9: more than max_rows take F.linear
            x = torch.randn(1, rows, 24)
            torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)
    x = torch.randn(3, 24, requires_grad=True)  # gradients: F.linear, so training works
    model(x).sum().backward()
    assert x.grad is not None and model[0].weight.grad is not None


def test_only_fp32_cpu_linears_of_exactly_that_class_are_replaced():
    class Quantised(nn.Linear):
        pass

    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4).to(torch.bfloat16), "c": Quantised(4, 4)})
    report = optimize(model, kernel="transposed")
    assert (report.replaced, report.skipped) == (1, 2)
    assert type(model["b"]) is nn.Linear and type(model["c"]) is Quantised
    assert f"1 replaced (transposed{' + onednn prompts' if report.prompts else ''}), 2 left" in report.summary()
    assert optimize(nn.Sequential(nn.ReLU())).kernel == "none"


@pytest.mark.parametrize("kwargs,match", [({"kernel": "cuda"}, "unknown kernel 'cuda'"), ({"max_rows": 0}, "max_rows must be"),
                                          ({"max_rows": True}, "max_rows must be")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimize(nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_verifies_as_before(family, kernel):
    """Prefill (many rows: F.linear), then a verification forward over 6 tokens (few rows: the
    kernel): the logits match the untransformed model's, and greedy speculative decoding still
    gives plain decoding's tokens."""
    case = make_tiny(family)
    plain = case.model
    fast = copy.deepcopy(plain)
    report = optimize(fast, kernel=kernel)
    assert report.replaced > 0
    tokens = torch.randint(3, 400, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        outputs = []
        for model in (plain, fast):
            target = TransformersTarget(model)
            state, first = target.prefill(case.inputs)
            outputs.append((first.logits, target.forward(state, tokens).logits))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], atol=1e-4, rtol=1e-4)
    ar = mmspec.generate(plain, max_new_tokens=12, **case.inputs)
    spec = mmspec.generate(fast, drafter="prompt-lookup", max_new_tokens=12, **case.inputs)
    assert torch.equal(spec.sequences, ar.sequences)


@needs_kernel
def test_a_packed_linear_is_bitwise_the_strided_one_and_follows_its_weight():
    """FewRowLinear with pack=True reads its weight in the AMX tile order: bitwise the in-place
    kernel's outputs at 1-40 rows; a weight whose shape cannot be packed (N % 16, K % 32) keeps the
    in-place kernel; an in-place update of the weight is repacked before the next forward."""
    if bf16_variants()[:1] != ("amx",):
        pytest.skip("packed weights are read by the AMX kernel only")
    torch.manual_seed(0)
    for out_features, in_features, packs in [(96, 64, True), (100, 64, False), (96, 48, False)]:
        linear = nn.Linear(in_features, out_features).to(torch.bfloat16)
        packed, strided = FewRowLinear(linear, "c", 64, pack=True), FewRowLinear(linear, "c", 64, pack=False)
        assert (packed.packed_weight() is not None) == packs
        with torch.inference_mode():
            for rows in (1, 7, 16, 40):
                x = torch.randn(rows, in_features).bfloat16()
                assert torch.equal(packed(x), strided(x))
            with torch.no_grad():
                linear.weight.mul_(-2)
            x = torch.randn(5, in_features).bfloat16()
            assert torch.equal(packed(x), strided(x))


def test_an_unwritable_kernel_cache_means_the_pytorch_forms_with_a_note(tmp_path, monkeypatch):
    """A read-only or missing HOME (here: a cache path under a plain file, which even root cannot
    create) makes the kernels unavailable with a note naming MMSPEC_CACHE, not an OSError that ends
    every command."""
    import mmspec.modeling.fast_linear as fast_linear

    if not {"avx2", "fma"} <= fast_linear.cpu_flags():
        pytest.skip("no AVX2 + FMA: the kernels are unavailable before the cache is reached")
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(fast_linear, "_LIBRARY", None)
    with pytest.raises(KernelUnavailable, match="cannot be written .*set MMSPEC_CACHE to a writable directory"):
        load_kernel()
    kernel, reason = fast_linear.choose_kernel("auto")
    assert kernel == "transposed" and "MMSPEC_CACHE" in reason


def test_a_compiler_that_cannot_run_and_a_corrupt_library_are_named(tmp_path, monkeypatch):
    """A bad CC was reported as an unwritable cache (and CC="gcc -O2" was one program's name); a
    truncated cached library ended every command with ctypes' "file too short": built again once."""
    import shutil

    import mmspec.modeling.fast_linear as fast_linear

    if not {"avx2", "fma"} <= fast_linear.cpu_flags():
        pytest.skip("no AVX2 + FMA: the kernels are unavailable before the compiler is reached")
    built = Path(load_kernel()._name)  # (this process' library: copied in place of a build)
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(fast_linear, "_LIBRARY", None)
    for cc, said in (("/nonexistent/gcc -O2", "the C compiler '/nonexistent/gcc -O2' cannot be run"),
                     ("false", r"building the C kernels \(few_rows-\w+\.so\) failed: false exited with status 1")):
        monkeypatch.setenv("CC", cc)
        with pytest.raises(KernelUnavailable, match=said):
            load_kernel()
    monkeypatch.delenv("CC")
    target = tmp_path / "kernels" / built.name
    target.write_bytes(b"")  # truncated
    builds = []
    monkeypatch.setattr(fast_linear, "_build", lambda compiler, path, *how: builds.append(shutil.copy(built, path)))
    assert Path(load_kernel()._name) == target and len(builds) == 1
    # cut short past its header (an interrupted copy of the cache): dlopen of it was a bus error, the process gone
    # (another cache folder: this process has the first one's file mapped)
    assert fast_linear._whole_elf(built)
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "copied"))
    target = tmp_path / "copied" / "kernels" / built.name
    target.parent.mkdir(parents=True)
    target.write_bytes(built.read_bytes()[:20000])
    monkeypatch.setattr(fast_linear, "_LIBRARY", None)
    assert not fast_linear._whole_elf(target)
    assert Path(load_kernel()._name) == target and len(builds) == 2 and fast_linear._whole_elf(target)


def test_the_pytorch_forms_say_why_once_and_the_stats_keep_it(monkeypatch):
    import warnings

    import mmspec.modeling.fast_linear as fast_linear

    monkeypatch.setattr(fast_linear, "_NOTED", set())
    report = fast_linear.OptimizeReport("transposed", 2, 1, "no C compiler here")
    with pytest.warns(UserWarning, match=r"PyTorch's forms run instead of the C kernels, slower: no C compiler here"):
        report.note()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report.note()  # (once per process and reason)
    assert report.label == "transposed; C kernels not used: no C compiler here"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_take_a_weight_reordered_once(dtype, monkeypatch):
    """Inputs past max_rows (a prompt) take oneDNN's GEMM over a copy of the weight it reordered
    once: a linear's outputs, made again after the weight changes in place; with gradients, or
    with pack_many off or the model past the byte limit, F.linear; rows within max_rows keep the
    few-row path."""

    if dtype not in many_rows_dtypes():
        pytest.skip(f"oneDNN runs no {dtype} GEMM here")
    kernel = "transposed" if dtype == torch.float32 else "c"  # (bf16 linears are replaced for the C kernel only)
    if dtype == torch.bfloat16 and (KERNELS[0] != "c" or not bf16_variants()):
        pytest.skip("no bf16 few-row kernel here")
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(96, 40)).to(dtype)
    model, off = copy.deepcopy(reference), copy.deepcopy(reference)
    optimize(model, kernel=kernel, max_rows=4)
    optimize(off, kernel=kernel, max_rows=4, pack_many=False)
    linear = model[0]
    held, held_off = len(linear._copies), len(off[0]._copies)  # (the packed copy, where the kernel packs)
    assert linear.pack_many and not off[0].pack_many
    x = torch.randn(2, 9, 96, dtype=dtype)
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        out = model(x)
        assert len(linear._copies) == held + 1 and out.shape == (2, 9, 40)  # oneDNN's copy, made now
        torch.testing.assert_close(out.float(), reference(x).float(), **tolerance)
        assert torch.equal(off(x), F.linear(x, off[0].weight, off[0].bias)) and len(off[0]._copies) == held_off
        few = torch.randn(3, 96, dtype=dtype)
        assert torch.equal(model(few), off(few))  # within max_rows: the few-row path, as before
    with torch.no_grad():
        linear.weight.mul_(2)  # an in-place update: the reordered copy is made again
    with torch.inference_mode():
        torch.testing.assert_close(model(x).float(), F.linear(x, linear.weight, linear.bias).float(), **tolerance)
    trained = x.clone().requires_grad_()
    linear.weight.requires_grad_(True)
    assert torch.equal(model(trained), F.linear(trained, linear.weight, linear.bias))  # training keeps F.linear
    from mmspec.api import optimize_components

    both = optimize_components(copy.deepcopy(reference), nn.Sequential(nn.Linear(4, 4, dtype=dtype)), kernel=kernel)
    assert both.prompts and both.label.endswith(" + onednn prompts")  # (a pipeline's stats name it)
    monkeypatch.setattr(fast_linear, "MANY_ROWS_PACK_LIMIT_BYTES", 1000)
    large = copy.deepcopy(reference)
    report = optimize(large, kernel=kernel, max_rows=4)
    assert not large[0].pack_many and not report.prompts and "onednn" not in report.label


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["c", "onednn"])
def test_many_row_weights_give_the_linear_then_the_gelu_or_the_residual(dtype, path, monkeypatch):
    """PreparedWeights.linear: x W^T + b, then the exact GELU or + a residual, through the C kernel
    over a packed copy (where many_rows_kernel takes the weight) or one oneDNN call over a
    reordered copy with the op fused, each copy made once per name (a view's rows as laid out;
    made again after an in-place update); with gradients wanted, F.linear and PyTorch's ops; a bad
    activation refused."""
    if path == "onednn":
        monkeypatch.setattr(fast_linear, "many_rows_kernel", lambda weight: False)
    if path == "onednn" and dtype not in many_rows_dtypes():
        pytest.skip(f"oneDNN runs no {dtype} GEMM here")
    torch.manual_seed(0)
    stacked = torch.randn(3 * 32, 64, dtype=dtype)  # three heads' rows, as a NAR stage stacks them (whole AMX tiles)
    weight, bias = stacked[32:64], torch.randn(32, dtype=dtype)
    x, residual = torch.randn(2, 70, 64, dtype=dtype), torch.randn(2, 70, 32, dtype=dtype)
    if path == "c" and not fast_linear.many_rows_kernel(weight):
        pytest.skip(f"the C kernel does not take {dtype} weights of this shape for many rows here")
    tolerance = dict(rtol=2e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    copies = fast_linear.PreparedWeights()
    plain = F.linear(x.float(), weight.float(), bias.float())
    with torch.inference_mode():
        torch.testing.assert_close(copies.linear("w", x, weight, bias).float(), plain, **tolerance)
        torch.testing.assert_close(copies.linear("w", x, weight, bias, activation="gelu").float(), F.gelu(plain), **tolerance)
        torch.testing.assert_close(copies.linear("w", x, weight, bias, residual=residual).float(), plain + residual.float(),
                                   **tolerance)
        assert len(copies) == 1  # one copy for the three calls
        stacked[32:64].mul_(-1)  # an in-place update of the rows: made again
        torch.testing.assert_close(copies.linear("w", x, weight, bias).float(), F.linear(x.float(), weight.float(), bias.float()),
                                   **tolerance)
    trained = x.float().requires_grad_()
    out = copies.linear("t", trained, weight.float(), None, activation="gelu")
    assert out.requires_grad and torch.equal(out, F.gelu(F.linear(trained, weight.float()))) and len(copies) == 1
    with pytest.raises(ValueError, match="activation must be"):
        copies.linear("w", x, weight, activation="relu")
