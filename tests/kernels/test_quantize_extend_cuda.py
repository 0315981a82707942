"""The fused quantize-and-extend CUDA kernel against the PyTorch reference (docs/formats.md, "The fused quantize-and-extend kernel"): the kernel
is built and compared bit for bit (codes and scale bytes, rtol=0) with the reference on poisoned
outputs. Needs a CUDA GPU (sm_90 or newer) and nvcc; skipped elsewhere."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from resserve_export.algorithms import kernel
from resserve_export.algorithms import kext
from resserve_export.formats import registry
from resserve_export.formats.nvfp4 import global_scale

from tests.fixtures.kernel_inputs import adversarial, random_mask

GPU = pytest.mark.skipif(
    not kernel.KERNEL_AVAILABLE, reason=f"needs a CUDA GPU (sm_90 Hopper or newer) and nvcc: {kernel.KERNEL_UNAVAILABLE_REASON}"
)
RATIOS = (0.0, 0.125, 0.25, 0.5, 1.0)
FMT_ROUNDING = (("nvfp4", "ceil"), ("mxfp4", "ceil"), ("mxfp4", "floor"), ("mxfp4", "even"))
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


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("fmt,rounding", FMT_ROUNDING, ids=lambda v: v)
def test_weight_quantization_through_the_kernel_is_the_cpu_reference(fmt, rounding, dtype):
    """`kernel.quantize` / `kernel.extend_weight` (what the scores' candidates and `verify` build
    weights with on a GPU) give the CPU reference's codes and scale bytes: a fused group's shared α
    and the tensor's own, every partial ratio's extension, a 3-D stack of experts."""
    from resserve_export.formats.ops import quantize as reference

    gen = torch.Generator().manual_seed(zlib.crc32(f"w{fmt}{rounding}{dtype}".encode()))
    w = adversarial(3 * 96, 2560, dtype, gen).reshape(3, 96, 2560)
    f = registry.get(fmt)
    shared = f.weight_alpha([w[0], w[1]])
    for x, alpha in ((w[0], shared), (w[1], None), (w, None)):
        got = kernel.quantize(x.cuda(), fmt, alpha=None if alpha is None else alpha.cuda(), rounding=rounding)
        want = reference(x, fmt, alpha=alpha, rounding=rounding)
        assert got.shape == want.shape
        assert torch.equal(got.codes.cpu(), want.codes), _first_mismatch(got.codes.cpu(), want.codes)
        assert torch.equal(got.scales.view(torch.uint8).cpu(), want.scales.view(torch.uint8))
        if f.has_tensor_scale:
            assert torch.equal(got.global_scale.cpu(), want.global_scale)
    masks = []
    for ratio, k in ((0.125, 1), (0.25, 2), (0.5, 4)):
        mask = random_mask(2560, k, gen)
        alpha = None if shared is None else shared.cuda()
        got = kernel.extend_weight(w[0].cuda(), mask, ratio, fmt, rounding, alpha=alpha)
        want = kext.extend_weight(w[0], mask, ratio, fmt, rounding, alpha=shared)
        assert got.shape == want.shape == (96, kext.ext_width(2560, ratio, fmt))
        assert torch.equal(got.codes.cpu(), want.codes), _first_mismatch(got.codes.cpu(), want.codes)
        assert torch.equal(got.scales.view(torch.uint8).cpu(), want.scales.view(torch.uint8))
        masks.append(mask)
    # Every ratio's extension in one quantization (the candidates' build): each column block is
    # that ratio's own codes and scale bytes.
    ratios = [0.125, 0.25, 0.5]
    every, offsets = kernel.extend_weights(w[0].cuda(), masks, ratios, fmt, rounding, alpha=None if shared is None else shared.cuda())
    for ratio, mask, o in zip(ratios, masks, offsets):
        want = kext.extend_weight(w[0], mask, ratio, fmt, rounding, alpha=shared)
        n = kext.ext_width(2560, ratio, fmt)
        codes, scales = every.codes[:, o // 2 : (o + n) // 2].cpu(), every.scales.view(torch.uint8)[:, o // f.block : (o + n) // f.block].cpu()
        assert torch.equal(codes, want.codes), _first_mismatch(codes, want.codes)
        assert torch.equal(scales, want.scales.view(torch.uint8))
