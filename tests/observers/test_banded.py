"""Column sums exact per exponent band (`observers.banded`, the GPU statistics of ``--moe-calib
all``): the plain float64 sum wherever that one is exact, the same bits in any order and grouping
where it is not, within rounding of the exact sum; the Triton kernel (plain and fused with
``silu(gate) · up``) against the eager reference on a GPU."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch.nn import functional as F

from resserve_export.observers import banded

def _pathological(E=3, n=300, I=24, seed=0, dtype=torch.bfloat16, device="cpu"):
    """act·up with gates down to about -80: silu terms near 1e-33 beside terms near 100."""
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(E, n, I, generator=g) * 30).to(dtype)
    up = (torch.randn(E, n, I, generator=g) * 3).to(dtype)
    return gate.to(device), up.to(device), (F.silu(gate) * up).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_band_bound_holds_for_every_value(dtype):
    """Inside one band, every finite value of the dtype over the smallest unit of any value of the
    band stays below 2^(BAND + p - 1) (p: the dtype's significand bits), so MAX_ROWS of them sum
    exactly in float64."""
    every = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    v = every[torch.isfinite(every) & (every > 0)].double()
    bands = banded.bands_of(v.to(dtype))
    p = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    m, e = torch.frexp(v)  # v = m · 2^e, m in [0.5, 1)
    tiny = float(torch.finfo(dtype).smallest_normal) * 2.0 ** (1 - p)  # the subnormals' unit
    unit = torch.ldexp(torch.ones_like(v), e - p).clamp_min(tiny)  # the value's last significand bit
    for b in bands.unique():
        sel = bands == b
        ratio = float(v[sel].max() / unit[sel].min())
        assert ratio < 2.0 ** (banded.BAND + p - 1)
        assert banded.MAX_ROWS * ratio <= 2.0**53
    assert int(bands.max()) < banded.BANDS


def test_equals_the_plain_float64_sum_where_that_is_exact():
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(4, 513, 37, generator=g) * 3).bfloat16()
    plain = h.abs().double().sum(1)
    # the plain sum is exact here: every term is a multiple of the smallest unit and the total is < 2^53 of them
    assert float(h.abs()[h != 0].double().min()) * 2.0**53 > float(plain.max()) * 2**8
    assert torch.equal(banded.exact_abs_sums(h), plain)


def test_the_same_bits_in_any_order_and_grouping():
    _, _, h = _pathological()
    want = banded.exact_abs_sums(h)
    plain = [h.abs().double().sum(1)]
    for seed in range(4):
        perm = torch.randperm(h.shape[1], generator=torch.Generator().manual_seed(seed))
        assert torch.equal(banded.exact_abs_sums(h[:, perm]), want)
        plain.append(h[:, perm].abs().double().sum(1))
        # the bands of two halves added are the bands of the whole
        b = banded.band_sums(h[:, perm[:100]]) + banded.band_sums(h[:, perm[100:]])
        assert torch.equal(banded.collapse(b), want)
    # while the plain float64 sum of this data moves with the order
    assert any(not torch.equal(p, plain[0]) for p in plain[1:])


def test_within_rounding_of_the_exact_sum():
    _, _, h = _pathological(E=1, n=200, I=6)
    got = banded.exact_abs_sums(h)[0]
    for j in range(h.shape[2]):
        exact = sum(Fraction(float(v)) for v in h[0, :, j].abs().double())
        assert abs(Fraction(float(got[j])) - exact) <= Fraction(float(got[j])) * Fraction(banded.BANDS, 2**53)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 31, 300, 4099])
def test_kernel_equals_the_eager_bands(n, dtype):
    pytest.importorskip("triton")
    gate, up, h = _pathological(E=5, n=n, I=200, dtype=dtype, device="cuda")
    want = banded.exact_abs_sums(h.cpu())
    s = torch.full((5, 200), 0.5, dtype=torch.float64, device="cuda")
    m = torch.full((5,), 0.25, device="cuda")
    banded.abs_stats(h, s, m)
    assert torch.equal(s.cpu(), want + 0.5)
    assert torch.equal(m.cpu(), torch.maximum(h.abs().float().amax((1, 2)).cpu(), torch.tensor(0.25)))
    # fused: silu(gate)·up from the gate/up product, act·up never written
    prod = torch.cat([gate, up], -1)
    s2 = torch.zeros(5, 200, dtype=torch.float64, device="cuda")
    m2 = torch.zeros(5, device="cuda")
    assert banded.silu_stats(prod, s2, m2)
    assert torch.equal(s2.cpu(), want) and torch.equal(m2.cpu(), h.abs().float().amax((1, 2)).cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_keeps_non_finite_values():
    pytest.importorskip("triton")
    _, _, h = _pathological(E=2, n=64, I=130, device="cuda")
    h[1, 10, 7] = float("nan")
    s = torch.zeros(2, 130, dtype=torch.float64, device="cuda")
    m = torch.zeros(2, device="cuda")
    banded.abs_stats(h, s, m)
    assert torch.isnan(s[1, 7]) and m[1] == float("inf") and torch.isfinite(m[0]) and torch.isfinite(s[0]).all()
