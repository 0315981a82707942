"""The PyTorch reference gives the same bits on CUDA tensors as on the CPU.

CUDA computes ``tensor / python_scalar`` as a multiplication by the rounded reciprocal; the
reference must divide by a tensor so that α and the MXFP4 ceil exponent do not move by one ulp.
"""

from __future__ import annotations

import pytest
import torch

from resserve_export.formats import ops as formats
from resserve_export.formats import mxfp4
from resserve_export.formats import nvfp4

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _reciprocal_differs(divisor: float, n: int = 4096) -> torch.Tensor:
    """FP32 values v for which v * (1/divisor) != v / divisor (computed on the CPU)."""
    g = torch.Generator().manual_seed(0)
    v = torch.rand(n * 64, generator=g) * 100
    d = torch.tensor(divisor)
    bad = v[(v * (1 / d)) != (v / d)]
    assert bad.numel() > 0
    return bad[:n]


@pytest.mark.gpu
@cuda
def test_nvfp4_global_scale_on_cuda_matches_cpu():
    amax = _reciprocal_differs(2688.0)
    cpu = nvfp4.global_scale(amax)
    gpu = nvfp4.global_scale(amax.cuda()).cpu()
    assert torch.equal(cpu.view(torch.int32), gpu.view(torch.int32))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rounding", list(mxfp4.ScaleRounding))
def test_mxfp4_exponents_on_cuda_match_cpu(rounding):
    amax = _reciprocal_differs(6.0)
    assert torch.equal(mxfp4.scale_exponent(amax, rounding), mxfp4.scale_exponent(amax.cuda(), rounding).cpu())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantize_on_cuda_matches_cpu(fmt):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(256, 1024, generator=g) * torch.rand(256, 1, generator=g) * 50).bfloat16()
    a = formats.quantize(x, fmt, backend="reference")
    b = formats.quantize(x.cuda(), fmt, backend="reference")
    assert torch.equal(a.codes, b.codes.cpu())
    assert torch.equal(a.scales.view(torch.uint8), b.scales.cpu().view(torch.uint8))
    if fmt == "nvfp4":
        assert torch.equal(a.global_scale.view(torch.int32), b.global_scale.cpu().view(torch.int32))


def test_divisors_have_inexact_reciprocals():
    # The GPU tests above only mean something if such values exist (checked on any machine).
    assert _reciprocal_differs(2688.0).numel() > 100
    assert _reciprocal_differs(6.0).numel() > 100
