"""GPTQ in the FP4 formats (`algorithms.gptq.solve`): round to nearest when the inputs are
uncorrelated, a lower W4A4 output error than round to nearest when they are not, an ordinary
tensor of the format (ModelOpt and compressed-tensors decode it to our values), and a singular
Hessian refused."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from modelopt.torch.quantization.qtensor import NVFP4QTensor

from resserve_export.algorithms import gptq
from resserve_export.formats import ops as formats
from resserve_export.formats import registry

from tests.fixtures.tensors import bits

# (format, MXFP4 scale rounding)
FORMATS = [("nvfp4", "ceil"), ("mxfp4", "ceil"), ("mxfp4", "even"), ("mxfp4", "floor")]


def _weight(g: torch.Generator, n: int = 48, k: int = 256) -> torch.Tensor:
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 17] = 0.9  # an outlier block
    w[5, 32:64] = 0.0  # zero blocks, with -0 too
    w[6, 64:96] = -0.0
    return w.to(torch.bfloat16)


def _inputs(g: torch.Generator, t: int = 4096, k: int = 256) -> torch.Tensor:
    """Correlated activations with a few large channels, as decoder linears see them."""
    mix = torch.eye(k) + 0.4 * torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(t, k, generator=g) @ mix
    x[:, ::29] *= 8.0
    return x


@pytest.mark.parametrize("order", gptq.ORDERS)
@pytest.mark.parametrize("fmt,rounding", FORMATS)
def test_diagonal_hessian_is_round_to_nearest(fmt, rounding, order, gen):
    """Without correlation between input channels no error is fed forward: GPTQ is the format's
    round-to-nearest quantization bit for bit (codes, block scales, tensor scale)."""
    w = _weight(gen)
    h = torch.diag(torch.rand(w.shape[1], generator=gen) + 0.01)
    h[7, 7] = 0.0  # a dead channel
    q = gptq.solve(w, h, fmt, rounding=rounding, order=order)
    ref = formats.quantize(w, fmt, rounding=rounding, backend="reference")
    assert torch.equal(q.codes, ref.codes)
    assert torch.equal(bits(q.scales), bits(ref.scales))
    if ref.global_scale is not None:
        assert bits(q.global_scale).item() == bits(ref.global_scale).item()


def _w4a4_nmse(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, fmt: str, rounding: str) -> float:
    f = registry.get(fmt)
    alpha = f.input_alpha(x.abs().max())  # the static activation scale of the calibration amax
    xq = formats.qdq(x, fmt, alpha=alpha, rounding=rounding, backend="reference")
    y = x @ w.float().t()
    return float(((xq @ wq.t() - y) ** 2).sum() / (y**2).sum())


@pytest.mark.parametrize("order", gptq.ORDERS)
@pytest.mark.parametrize("fmt,rounding", FORMATS[:2])
def test_gptq_lowers_the_w4a4_output_error(fmt, rounding, order, gen):
    """On the calibration inputs, with the activations quantized as the server quantizes them, the
    output error of GPTQ's weights is below round to nearest's (measured here, activation / block
    order: NVFP4 0.882x / 0.904x, MXFP4 0.939x / 0.959x; the activations' own error, which no
    weight choice removes, is most of what is left), and the weight part of it (activations in
    full precision) clearly so (0.766x / 0.806x, 0.750x / 0.836x)."""
    w, x = _weight(gen), _inputs(gen)
    q = gptq.solve(w, x.t() @ x, fmt, rounding=rounding, order=order)
    rtn = formats.quantize(w, fmt, rounding=rounding, backend="reference")
    e_gptq = _w4a4_nmse(x, w, q.dequantize(), fmt, rounding)
    e_rtn = _w4a4_nmse(x, w, rtn.dequantize(), fmt, rounding)
    assert e_gptq < 0.97 * e_rtn, (e_gptq, e_rtn)
    y = x @ w.float().t()
    w4a16 = lambda wq: float(((x @ wq.t() - y) ** 2).sum())  # noqa: E731
    assert w4a16(q.dequantize()) < 0.87 * w4a16(rtn.dequantize())
    # ... and its weight error is larger: it trades weight error for output error
    assert float((q.dequantize() - w.float()).square().sum()) > float((rtn.dequantize() - w.float()).square().sum())


@pytest.mark.parametrize("fmt,rounding", FORMATS)
def test_activation_order_keeps_round_to_nearests_block_scales(fmt, rounding, gen):
    """In activation order the block scales are fixed before any error feedback: they are the ones
    round to nearest writes, bit for bit, and only the codes differ (columns taken by decreasing
    Hessian diagonal). The other order chooses some scales from updated weights."""
    w, x = _weight(gen), _inputs(gen)
    ref = formats.quantize(w, fmt, rounding=rounding, backend="reference")
    act = gptq.solve(w, x.t() @ x, fmt, rounding=rounding, order="activation")
    block = gptq.solve(w, x.t() @ x, fmt, rounding=rounding, order="block")
    assert torch.equal(bits(act.scales), bits(ref.scales))
    assert not torch.equal(act.codes, ref.codes)
    assert not torch.equal(bits(block.scales), bits(ref.scales))


def test_an_unknown_order_is_refused(gen):
    with pytest.raises(ValueError, match="unknown GPTQ order 'random'"):
        gptq.solve(_weight(gen), torch.eye(256), "nvfp4", order="random")


def test_gptq_keeps_the_groups_tensor_scale(gen):
    """A fused member is quantized with its group's α (vLLM serves one weight_scale_2 per group)."""
    w, x = _weight(gen), _inputs(gen)
    alpha = registry.get("nvfp4").weight_alpha([w, w * 3])
    q = gptq.solve(w, x.t() @ x, "nvfp4", alpha=alpha)
    assert bits(q.global_scale).item() == bits(alpha).item()
    assert q.global_scale.item() != registry.get("nvfp4").tensor_alpha(w).item()


def test_modelopt_decodes_gptq_nvfp4(gen):
    w, x = _weight(gen), _inputs(gen)
    q = gptq.solve(w, x.t() @ x, "nvfp4")
    theirs = NVFP4QTensor(torch.Size(q.shape), torch.float32, q.codes).dequantize(
        dtype=torch.float32, scale=q.scales, double_scale=q.global_scale, block_sizes={-1: 16}
    )
    assert torch.equal(theirs, q.dequantize())


@pytest.mark.parametrize("rounding", ["ceil", "even"])
def test_compressed_tensors_decodes_gptq_mxfp4(rounding, gen):
    w, x = _weight(gen), _inputs(gen)
    q = gptq.solve(w, x.t() @ x, "mxfp4", rounding=rounding)
    scheme = preset_name_to_scheme("MXFP4", ["Linear"])
    dec = MXFP4PackedCompressor.decompress({"weight_packed": q.codes, "weight_scale": q.scales}, scheme)
    assert torch.equal(dec["weight"].float(), q.dequantize())


@pytest.mark.parametrize("bad", ["nan", "negative"])
def test_a_singular_hessian_is_refused(bad, gen):
    w = _weight(gen)
    h = -torch.eye(w.shape[1]) * 5 if bad == "negative" else torch.eye(w.shape[1])
    if bad == "nan":
        h[3, 4] = float("nan")
    with pytest.raises(gptq.SingularHessian):
        gptq.solve(w, h, "nvfp4")


def test_a_mismatched_hessian_is_refused(gen):
    with pytest.raises(ValueError, match="do not fit nvfp4 blocks of 16"):
        gptq.solve(_weight(gen), torch.eye(128), "nvfp4")
