"""The fused quantize-and-extend kernel against the PyTorch reference (SPEC §11).

CPU tests cover the wrapper's reference path, its argument checks, and the kernel's two E2M1
rounding rules (re-stated in Python) against `fp4.encode_e2m1`: the exact path's integer rule
and the fast path's one-binade magic-number rule. GPU tests build the kernel
and compare it bit for bit (codes and scale bytes, rtol=0) with the reference on poisoned outputs.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from resserve_export.algorithms import kernel
from resserve_export.algorithms import kext
from resserve_export.formats import registry
from resserve_export.formats.fp4 import encode_e2m1
from resserve_export.formats.nvfp4 import global_scale
from resserve_export.algorithms.selection import bool_to_mask

torch.set_num_threads(2)

GPU = pytest.mark.skipif(
    not kernel.KERNEL_AVAILABLE, reason=f"needs a CUDA GPU (sm_90 Hopper or newer) and nvcc: {kernel.KERNEL_UNAVAILABLE_REASON}"
)
RATIOS = (0.0, 0.125, 0.25, 0.5, 1.0)
FMT_ROUNDING = (("nvfp4", "ceil"), ("mxfp4", "ceil"), ("mxfp4", "floor"), ("mxfp4", "even"))


def random_mask(K: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [K/8] selecting exactly k random channels in every group of 8."""
    order = torch.rand(K // 8, 8, generator=gen).argsort(dim=-1)[:, :k]
    sel = torch.zeros(K // 8, 8, dtype=torch.bool)
    sel.scatter_(1, order, True)
    return bool_to_mask(sel.reshape(-1))


def adversarial(M: int, K: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Normal rows of varied scale, with outliers, all-zero blocks, tiny values and -0 (on the
    generator's device)."""
    dev = gen.device
    x = torch.randn(M, K, generator=gen, device=dev) * torch.exp(torch.randn(M, 1, generator=gen, device=dev))
    u = torch.rand(M, K, generator=gen, device=dev)
    x = torch.where(u < 0.002, x * 80.0, x)  # outliers
    x = torch.where((u > 0.5) & (u < 0.51), x * 1e-5, x)  # tiny values
    x = torch.where((u > 0.6) & (u < 0.602), torch.full_like(x, -0.0), x)
    x = torch.where((u > 0.7) & (u < 0.701), x * 1e-38, x)  # bf16 subnormals: the kernel's IEEE division path
    blocks = x.view(M, K // 32, 32)
    zero = torch.rand(M, K // 32, 1, generator=gen, device=dev) < 0.05
    x = torch.where(zero, torch.zeros_like(blocks), blocks).view(M, K)
    return x.to(dtype)


# ----------------------------------------------------------------------------- CPU


def kernel_e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """The kernel's integer rounding rule (quantize_extend.cu, e2m1_magnitude), in torch."""
    a = a.float()
    low = torch.round(a * 2.0).to(torch.int64)  # round() is half-to-even, like cvt.rni
    u = a.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = ((u + 0x1FFFFF + ((u >> 22) & 1)) >> 22) - 252
    return torch.where(a >= 1.0, high.clamp(max=7), low)


def test_kernel_e2m1_rule_matches_reference_on_every_tie_and_a_dense_sweep():
    ties = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, float("inf")])
    # tie to even: 0.25->0, 0.75->1 (code 2), 1.25->1 (2), 1.75->2 (4), 2.5->2 (4), 3.5->4 (6), 5->4 (6)
    assert kernel_e2m1_magnitude(ties).tolist() == [0, 0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7]
    sweep = torch.cat([torch.linspace(0, 8, 200_001), torch.rand(100_000) * 1e-3, torch.rand(100_000) * 100])
    # every neighbour of every tie, one FP32 ulp either side
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0, 0.5, 6.0])
    near = torch.cat([torch.nextafter(t, torch.zeros_like(t)), torch.nextafter(t, torch.full_like(t, 9.0)), t])
    a = torch.cat([sweep, near])
    assert torch.equal(kernel_e2m1_magnitude(a), encode_e2m1(a).to(torch.int64))


def kernel_e2m1_fast(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path's rule (quantize_extend.cu, e2m1_sum, e2m1_nibble, e2m1_value), in torch:
    a = min(|q|, 6), p = the power of two of max(a, 1), g = a + (1.5*2^22 + 1)*p in FP32 (one
    rounding: the product is exact); nibble = (mulhi(bits(g), 2^32 - 3*2^10) & 7) | sign of q in
    bit 3; v = g - float(bits(g) & 0xFF800000) * (1.5 + 2^-22). Returns (nibble, v)."""
    q = q.float() + 0.0  # the kernel's quotients are never -0 (its division maps x = -0 to +0)
    a = torch.clamp(q.abs(), max=6.0)
    p = (torch.clamp(a, min=1.0).view(torch.int32) & 0x7F800000).view(torch.float32)
    g = a + p * 6291457.0
    gb = g.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    code = ((gb * 0xFFFFF400) >> 32) & 7
    qs = (q.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) >> 28
    h = (g.view(torch.int32) & 0xFF800000).view(torch.float32)
    v = g - h * (1.5 + 2.0**-22)
    assert torch.equal(v, g - p * 6291457.0)  # the full-compensation path's form, same values
    return code | (qs & 8), v


def test_kernel_fast_e2m1_rule_matches_reference_on_every_tie_and_a_dense_sweep():
    ties = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, float("inf"), 1e-45, 2.0**-126])
    code, v = kernel_e2m1_fast(ties)
    assert code.tolist() == [0, 0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7, 0, 0]
    assert v.tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, 0.0, 0.0]
    sweep = torch.cat([torch.linspace(0, 8, 400_001), torch.rand(100_000) * 1e-3, torch.rand(100_000) * 100])
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0, 0.5, 2.0, 4.0, 6.0])
    near = torch.cat([torch.nextafter(t, torch.zeros_like(t)), torch.nextafter(t, torch.full_like(t, 9.0)), t])
    a = torch.cat([sweep, near, -sweep])
    code, v = kernel_e2m1_fast(a)
    want = encode_e2m1(a).to(torch.int64)  # with the sign: -0 only for negative quotients
    assert torch.equal(code, want)
    assert torch.equal(v, torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[want & 7])


def test_reference_backend_is_extended_activation():
    gen = torch.Generator().manual_seed(0)
    x = adversarial(6, 256, torch.bfloat16, gen).reshape(2, 3, 256)
    mask = random_mask(256, 2, gen)
    alpha = global_scale(torch.tensor(3.0))
    got = kernel.quantize_extend(x, mask, 0.25, "nvfp4", alpha=alpha, backend="reference")
    want = kext.extended_activation(x, mask, 0.25, "nvfp4", alpha=alpha)
    assert got.shape == (2, 3, 256 + kext.ext_width(256, 0.25, "nvfp4")) == (2, 3, 320)
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    base, res = kernel.quantize_full(x, "mxfp4", rounding="floor", backend="reference")
    wb, wr = kext.full_residue(x, "mxfp4", rounding="floor")
    assert torch.equal(base.codes, wb.codes) and torch.equal(res.scales, wr.scales)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reference_backend_on_large_cpu_tensors_takes_the_compiled_path_bit_exactly(fmt):
    gen = torch.Generator().manual_seed(5)
    x = adversarial(520, 1024, torch.bfloat16, gen)  # over formats' compiled-path threshold
    mask = random_mask(1024, 4, gen)
    got = kernel.quantize_extend(x, mask, 0.5, fmt, backend="reference")
    want = kext.extended_activation(x, mask, 0.5, fmt, alpha=kernel._alpha(x, None) if fmt == "nvfp4" else None)
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    b, r = kernel.quantize_full(x, fmt, backend="reference")
    wb, wr = kext.full_residue(x, fmt, alpha=want.global_scale)
    assert torch.equal(r.codes, wr.codes) and torch.equal(r.scales.view(torch.uint8), wr.scales.view(torch.uint8))


def test_auto_uses_the_reference_for_cpu_tensors():
    assert kernel.backend_for(torch.zeros(4, 32, dtype=torch.bfloat16)) == "reference"


@pytest.mark.skipif(kernel.KERNEL_AVAILABLE, reason="the kernel can run here")
def test_cuda_backend_without_gpu_says_what_is_needed():
    with pytest.raises(kernel.KernelUnavailable, match="CUDA"):
        kernel.quantize_extend(torch.zeros(2, 32, dtype=torch.bfloat16), None, 0.0, "nvfp4", backend="cuda")


def test_kernel_sources_are_found():
    d = kernel.kernels_dir()
    assert d is not None and (d / "quantize_extend.cu").is_file()


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="available"):
        kernel.quantize_extend(torch.zeros(2, 32), None, 0.0, "nvfp4", backend="triton")


# ----------------------------------------------------------------------------- GPU

SHAPES_M = (1, 7, 64, 1000, 4096)
SHAPES_K = (2560, 4096, 9728, 12288, 16384)


def _reference(x, mask, ratio, fmt, alpha, rounding):
    """(codes, scale bytes[, residue codes, residue scale bytes]) of the reference.

    The GPU run of the reference is used where it is bit-identical to the CPU one. MXFP4 'ceil'
    divides the block amax by the Python scalar 6, which PyTorch's CUDA division turns into a
    multiplication by the reciprocal, so that case is computed on the CPU.
    """
    dev = x.device if not (fmt == "mxfp4" and rounding == "ceil") else torch.device("cpu")
    xs, a = x.to(dev), (alpha.to(dev) if alpha is not None else None)
    if ratio == 1.0:
        b, r = kext.full_residue(xs, fmt, alpha=a, rounding=rounding)
        return [t.to(x.device) for t in (b.codes, b.scales.view(torch.uint8), r.codes, r.scales.view(torch.uint8))]
    q = kext.extended_activation(xs, mask, ratio, fmt, alpha=a, rounding=rounding)
    return [t.to(x.device) for t in (q.codes, q.scales.view(torch.uint8))]


def _first_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want).nonzero()
    if bad.numel() == 0:
        return "shapes differ"
    idx = tuple(bad[0].tolist())
    return f"{bad.shape[0]} bytes differ, first at {idx}: got {got[idx].item():#04x}, want {want[idx].item():#04x}"


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("fmt,rounding", FMT_ROUNDING, ids=lambda v: v)
def test_kernel_bit_exact(fmt, rounding, dtype, ratio):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{fmt}{rounding}{dtype}{ratio}".encode()))
    cpu_gen = torch.Generator().manual_seed(1)
    dev = torch.device("cuda")
    b = registry.get(fmt).block
    shapes = list(itertools.product(SHAPES_M, SHAPES_K))
    if fmt == "mxfp4" and rounding == "ceil":
        # reference on the CPU (see _reference): the largest row count at one K only
        shapes = [(M, K) for M, K in shapes if M < 4096] + [(4096, 4096)]
    for n, (M, K) in enumerate(shapes):
        x = adversarial(M, K, dtype, gen)
        rows = (1, 2, 4)[n % 3]  # every rows-per-thread variant of the kernel
        max_ctas = (0, 37, 2112)[(n // 3) % 3]  # one CTA per row block, or CTAs looping over rows
        K_E = kext.ext_width(K, ratio, fmt)
        ksel = 8 if ratio == 1.0 else (int(ratio * 8) if K_E else 0)
        mask = random_mask(K, ksel, cpu_gen).to(dev) if 0 < ksel < 8 else None
        # a calibrated amax below the true one: some block scales clamp at 448 and codes saturate
        alpha = global_scale(x.float().abs().amax().cpu() * 0.7).to(dev) if fmt == "nvfp4" else None
        out = [
            torch.full((M, (K + K_E) // 2), 0xFF, dtype=torch.uint8, device=dev),
            torch.full((M, (K + K_E) // b), 0xFF, dtype=torch.uint8, device=dev),
            torch.full((M, K // 2) if ksel == 8 else (0, 0), 0xFF, dtype=torch.uint8, device=dev),
            torch.full((M, K // b) if ksel == 8 else (0, 0), 0xFF, dtype=torch.uint8, device=dev),
        ]
        kernel.quantize_extend_raw(x, mask, ksel, fmt, alpha, rounding, K_E, out, rows=rows, max_ctas=max_ctas)
        want = _reference(x, mask, ratio, fmt, alpha, rounding)
        names = ("codes", "scales", "residue codes", "residue scales")
        for name, g, w in zip(names, out, want):
            assert g.shape == w.shape and torch.equal(g, w), f"M={M} K={K} rows={rows} max_ctas={max_ctas} {name}: {_first_mismatch(g, w)}"


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("fmt,rounding", FMT_ROUNDING, ids=lambda v: v)
def test_kernel_bit_exact_where_rows_take_the_exact_path(fmt, rounding, ratio):
    """Inputs outside the fast path's guarantees go through the exact path, row by row (a warp
    whose row fails a check) or for the whole tensor (NVFP4 alpha outside [2^-87, 36]), and stay
    bit-exact: NVFP4 with a tiny alpha and rows of 1e12 (block amax above 448*alpha*2^100), NVFP4
    with alpha > 36, MXFP4 rows whose block exponent exceeds 14."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"exact{fmt}{rounding}{ratio}".encode()))
    cpu_gen = torch.Generator().manual_seed(3)
    dev = torch.device("cuda")
    b = registry.get(fmt).block
    M, K = 96, 4096
    K_E = kext.ext_width(K, ratio, fmt)
    ksel = 8 if ratio == 1.0 else (int(ratio * 8) if K_E else 0)
    mask = random_mask(K, ksel, cpu_gen).to(dev) if 0 < ksel < 8 else None
    base = adversarial(M, K, torch.float32, gen)
    big = torch.rand(M, 1, generator=gen, device=dev) < 0.3  # rows that take the exact path
    if fmt == "nvfp4":
        cases = [
            ((base * 1e-20).where(~big, base * 1e12), global_scale(torch.tensor(1e-20))),  # per row
            (base * 1e6, global_scale(torch.tensor(1e6))),  # alpha = 372 > 36: whole tensor
        ]
    else:
        cases = [(base.where(~big, base * 1e6), None)]
    for n, (x, alpha) in enumerate(cases):
        x = x.to(torch.bfloat16)
        alpha = alpha.to(dev) if alpha is not None else None
        out = [
            torch.full((M, (K + K_E) // 2), 0xFF, dtype=torch.uint8, device=dev),
            torch.full((M, (K + K_E) // b), 0xFF, dtype=torch.uint8, device=dev),
            torch.full((M, K // 2) if ksel == 8 else (0, 0), 0xFF, dtype=torch.uint8, device=dev),
            torch.full((M, K // b) if ksel == 8 else (0, 0), 0xFF, dtype=torch.uint8, device=dev),
        ]
        kernel.quantize_extend_raw(x, mask, ksel, fmt, alpha, rounding, K_E, out, rows=(1, 2, 4)[n % 3])
        want = _reference(x, mask, ratio, fmt, alpha, rounding)
        for name, g, w in zip(("codes", "scales", "residue codes", "residue scales"), out, want):
            assert torch.equal(g, w), f"case {n} {name}: {_first_mismatch(g, w)}"


@GPU
@pytest.mark.gpu
def test_wrapper_matches_reference_with_leading_dims_and_derived_alpha():
    gen = torch.Generator().manual_seed(7)
    x = adversarial(12, 2560, torch.bfloat16, gen).reshape(3, 4, 2560).cuda()
    mask = random_mask(2560, 1, gen)
    got = kernel.quantize_extend(x, mask, 0.125, "nvfp4", backend="cuda")
    want = kext.extended_activation(x.cpu(), mask, 0.125, "nvfp4")
    assert got.shape == (3, 4, 2880)
    assert torch.equal(got.global_scale.cpu(), want.global_scale)
    assert torch.equal(got.codes.cpu(), want.codes)
    assert torch.equal(got.scales.view(torch.uint8).cpu(), want.scales.view(torch.uint8))
    base, res = kernel.quantize_full(x, "mxfp4", backend="cuda")
    wb, wr = kext.full_residue(x.cpu(), "mxfp4")
    assert torch.equal(base.codes.cpu(), wb.codes) and torch.equal(res.codes.cpu(), wr.codes)
    assert torch.equal(res.scales.cpu(), wr.scales)


@GPU
@pytest.mark.gpu
def test_wrapper_rejects_a_mask_with_the_wrong_count():
    mask = torch.full((32,), 0b11, dtype=torch.uint8)  # two channels per group, ratio asks for one
    with pytest.raises(ValueError, match="exactly 1"):
        kernel.quantize_extend(torch.ones(2, 256, dtype=torch.bfloat16, device="cuda"), mask, 0.125, "nvfp4")


def test_mask_check_counts_bits_only_when_asked():
    """`quantize_extend(check_mask=False)` (the grad scores' masks, checked when built) skips the
    bit count, a GPU sync per launch; the shape and dtype checks stay."""
    wrong = torch.full((32,), 0b11, dtype=torch.uint8)  # two channels per group
    with pytest.raises(ValueError, match="exactly 1"):
        kernel._check_mask(wrong, 256, 1, torch.device("cpu"))
    assert torch.equal(kernel._check_mask(wrong, 256, 1, torch.device("cpu"), count=False), wrong)
    assert torch.equal(kernel._check_mask(wrong.reshape(4, 8), 256, 2, torch.device("cpu")), wrong)
    with pytest.raises(ValueError, match="uint8"):
        kernel._check_mask(wrong[:31], 256, 2, torch.device("cpu"), count=False)
