"""K-Ext extended weight and activation (docs/formats.md, "Channel selection and masks" and "The extended weight (K-Ext)")."""

from __future__ import annotations

import pytest
import torch

from resserve_export.algorithms.kext import ext_width, extend_weight, extended_activation, extended_width, full_residue, residue
from resserve_export.algorithms.selection import mask_to_indices, select_mask
from resserve_export.formats import ops as formats
from resserve_export.formats.nvfp4 import global_scale
from resserve_export.formats.qtensor import FP4Tensor

from tests.fixtures.tensors import bits

FORMATS = ("nvfp4", "mxfp4")
PARTIAL = (0.125, 0.25, 0.5)


@pytest.mark.parametrize(
    "K, ratio, fmt, width",
    [
        (2560, 0.125, "nvfp4", 2880),  # 2880 = 45 · 64: no padding
        (2560, 0.125, "mxfp4", 2944),  # 2880 padded to 23 · 128
        (576, 0.25, "nvfp4", 768),  # 720 -> 768
        (576, 0.25, "mxfp4", 768),
        (1536, 0.5, "nvfp4", 2304),
        (1536, 0.5, "mxfp4", 2304),
        (4096, 0.125, "nvfp4", 4608),
        (4096, 0.0, "nvfp4", 4096),  # plain: no extension
        (4096, 1.0, "mxfp4", 4096),  # full: M-Ext, no extension
    ],
)
def test_extended_width(K, ratio, fmt, width):
    assert extended_width(K, ratio, fmt) == width
    assert ext_width(K, ratio, fmt) == width - K


def _setup(fmt, ratio, g, K=256, N=24, M=12):
    w = torch.randn(N, K, generator=g).bfloat16()
    x = (torch.randn(M, K, generator=g) * torch.rand(K, generator=g) * 3).bfloat16()
    mask = select_mask(x.float().abs().mean(0), ratio)
    return w, x, mask


@pytest.mark.parametrize("backend", ("reference", "compiled"))
@pytest.mark.parametrize("ratio", PARTIAL)
@pytest.mark.parametrize("fmt", FORMATS)
def test_first_K_columns_of_full_extended_quantization_are_the_plain_one(fmt, ratio, backend, gen):
    w, _, mask = _setup(fmt, ratio, gen, K=512, N=64)
    K = w.shape[1]
    S = mask_to_indices(mask)
    K_E = ext_width(K, ratio, fmt)
    full = torch.zeros(w.shape[0], K + K_E, dtype=w.dtype)
    full[:, :K] = w
    full[:, K : K + S.numel()] = w[:, S]
    q_full = formats.quantize(full, fmt, backend=backend)  # α from the full tensor's amax
    q_plain = formats.quantize(w, fmt, backend=backend)
    ext = extend_weight(w, mask, ratio, fmt, backend=backend)
    assert ext.shape == (w.shape[0], K_E)
    head = q_full.narrow(0, K)
    tail = q_full.narrow(K, K_E)
    assert torch.equal(head.codes, q_plain.codes)
    assert torch.equal(bits(head.scales), bits(q_plain.scales))
    assert torch.equal(tail.codes, ext.codes)
    assert torch.equal(bits(tail.scales), bits(ext.scales))
    if fmt == "nvfp4":
        assert bits(q_full.global_scale) == bits(q_plain.global_scale) == bits(ext.global_scale)


@pytest.mark.parametrize("ratio", PARTIAL)
@pytest.mark.parametrize("fmt", FORMATS)
def test_extended_product_is_base_plus_selected_residue(fmt, ratio, gen):
    """dequant([X̂|R̂_S|0]) · dequant([W|W_S|0])ᵀ = X̂Ŵᵀ + R̂_S Ŵ_Sᵀ, to FP32 summation error."""
    w, x, mask = _setup(fmt, ratio, gen)
    K = w.shape[1]
    K_E = ext_width(K, ratio, fmt)
    S = mask_to_indices(mask)
    alpha_x = global_scale(x.float().abs().amax() * 0.9) if fmt == "nvfp4" else None

    x_ext = extended_activation(x, mask, ratio, fmt, alpha=alpha_x)
    w_ext = FP4Tensor.cat([formats.quantize(w, fmt), extend_weight(w, mask, ratio, fmt)])
    assert x_ext.shape == (x.shape[0], K + K_E) and w_ext.shape == (w.shape[0], K + K_E)
    lhs = x_ext.dequantize() @ w_ext.dequantize().T

    # The right-hand side built independently, from docs/formats.md ("Channel selection and masks", "The extended weight (K-Ext)") as written.
    x_hat = formats.qdq(x, fmt, alpha=alpha_x)
    w_hat = formats.qdq(w, fmt)
    r = x.float() - x_hat
    pad = lambda t: torch.nn.functional.pad(t, (0, K_E - t.shape[1]))  # noqa: E731
    r_s_hat = formats.qdq(pad(r[:, S]), fmt, alpha=alpha_x)[:, : S.numel()]
    w_alpha = global_scale(w.float().abs().amax()) if fmt == "nvfp4" else None
    w_s_hat = formats.qdq(pad(w[:, S].float()), fmt, alpha=w_alpha)[:, : S.numel()]
    base = x_hat @ w_hat.T
    comp = r_s_hat @ w_s_hat.T
    rhs = base + comp

    abs_sum = x_hat.abs() @ w_hat.abs().T + r_s_hat.abs() @ w_s_hat.abs().T
    bound = (K + K_E) * 2.0**-24 * abs_sum
    assert ((lhs - rhs).abs() <= bound).all()
    # the residue term is far above that bound, so a wrong mask or order would be caught
    assert (comp.abs() > 100 * bound).float().mean() > 0.5
    # and compensation brings the product closer to the exact one
    exact = x.double() @ w_hat.double().T
    assert ((rhs - exact) ** 2).sum() < ((base - exact) ** 2).sum()


@pytest.mark.parametrize("ratio", PARTIAL)
@pytest.mark.parametrize("fmt", FORMATS)
def test_extended_activation_layout(fmt, ratio, gen):
    _, x, mask = _setup(fmt, ratio, gen)
    x = x.reshape(3, 4, -1)  # batched leading dims
    K = x.shape[-1]
    K_E = ext_width(K, ratio, fmt)
    alpha_x = global_scale(torch.tensor(5.0)) if fmt == "nvfp4" else None
    ext = extended_activation(x, mask, ratio, fmt, alpha=alpha_x)
    base = formats.quantize(x, fmt, alpha=alpha_x)
    assert ext.shape == (3, 4, K + K_E)
    head = ext.narrow(0, K)
    assert torch.equal(head.codes, base.codes) and torch.equal(bits(head.scales), bits(base.scales))
    if fmt == "nvfp4":
        assert bits(ext.global_scale) == bits(alpha_x)  # residues share the base α
    # the residue part is the compacted residue of the selected channels, then zeros
    S = mask_to_indices(mask)
    r = residue(x, base)
    tail = ext.narrow(K, K_E).dequantize()
    want = formats.qdq(torch.nn.functional.pad(r[..., S], (0, K_E - S.numel())), fmt, alpha=alpha_x)
    assert torch.equal(tail, want)
    assert (tail[..., S.numel() :] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_plain_and_full_have_no_extension(fmt, gen):
    w, x, _ = _setup(fmt, 0.25, gen)
    for ratio, mask in ((0.0, select_mask(torch.ones(256), 0.0)), (1.0, select_mask(torch.ones(256), 1.0))):
        assert extend_weight(w, mask, ratio, fmt) is None
        e = extended_activation(x, mask, ratio, fmt)
        assert torch.equal(e.codes, formats.quantize(x, fmt).codes)


def test_residue_uses_base_scales(gen):
    x = torch.randn(8, 64, generator=gen)
    alpha = global_scale(torch.tensor(2.0))
    q = formats.quantize(x, "nvfp4", alpha=alpha)
    r = residue(x, q)
    assert torch.equal(r, x - formats.dequantize(q))
    base, res = full_residue(x, "nvfp4", alpha=alpha)
    assert bits(res.global_scale) == bits(alpha)
    assert torch.equal(res.codes, formats.quantize(r, "nvfp4", alpha=alpha).codes)


def test_fused_group_alpha_is_respected(gen):
    """Members of a fused group pass the group's α; the extension must use it, not its own amax."""
    w = torch.randn(16, 128, generator=gen)
    mask = select_mask(torch.rand(128, generator=gen), 0.25)
    alpha = global_scale(w.abs().amax() * 4)
    ext = extend_weight(w, mask, 0.25, "nvfp4", alpha=alpha)
    assert bits(ext.global_scale) == bits(alpha)
    own = extend_weight(w, mask, 0.25, "nvfp4")
    assert not torch.equal(bits(own.scales), bits(ext.scales))
