"""Sensitivity scores for the ratio planner (SPEC §10): s(l, ρ) = damage when only group l is
quantized (weights and activations FP4, calibrated α, residue compensation at ratio ρ on the
channels `selection.select_mask(mean_abs, ρ)` picks) and the rest of the model is unquantized.

Two methods, both through the one emulated FP4 linear of `resserve_export.emulate`:

- ``kl``: mean over valid tokens of KL(p_ref ‖ p_q) between next-token distributions, one forward
  per (group, ρ). The model runs once per batch to capture the hidden state entering every decoder
  layer; a (group, ρ) then reruns only from the group's layer to the logits. If the model's logits
  are not `lm_head(norm(h))` of its last layer (checked on the first batch), every (group, ρ) runs
  the whole model instead.
- ``grad``: Σ over valid tokens of Σ_j (∂L/∂Y ⊙ (Y_q − Y))² per group (Fisher-diagonal, as in
  BRECQ), L the summed next-token cross-entropy. One forward + backward per batch; backward hooks
  on each quantized linear's output receive ∂L/∂Y and score every candidate ratio of the group
  right there from the captured input (all candidates from one pass). Weight gradients are never
  computed. Reported per valid token. The candidate products run in FP32 (the emulated linear's
  own arithmetic) or, by default for bf16 models on GPUs and on CPUs with fast bf16 GEMMs, as
  bf16 GEMMs on the same FP4 operands, exact in bf16 (`Candidates.prepare_fast`).

Padding never counts: KL is averaged over positions with attention_mask = 1, and the loss of the
grad method ignores padded targets (so their ∂L/∂Y is zero).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
import copy
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterable

import torch
from torch import nn

from .compiling import compile_or_eager
from .constants import RATIOS
from .emulate import QuantizedWeight, exact_operand, quantized_matmul, quantized_residue_operand, residue_weight
from .formats import dequantize, quantize
from .kext import extend_weight, residue
from .groups import Group
from . import mxfp4, nvfp4
from .constants import BLOCK
from .mxfp4 import ScaleRounding
from .nvfp4 import global_scale
from .qtensor import FP4Tensor
from .selection import check_ratio, mask_to_indices, mode_of, select_mask

METHODS = ("kl", "grad")
DEFAULT_RATIOS = RATIOS


def ratio_key(ratio: float) -> str:
    return f"{float(ratio):g}"


# ---------------------------------------------------------------------------------------------
# Quantized candidates of one group


class Candidates:
    """Emulated FP4 weights of one group's members for each candidate ratio.

    Fused members share the group's weight α (max amax over the members, SPEC §3) and the input α
    from the calibrated amax. The base quantization is computed once per member and shared by
    every ratio (plain and full use it alone; partial ratios add their K-Ext extension), exactly
    as `QuantizedWeight` builds it (tests check the two bit for bit).
    """

    def __init__(self, model: nn.Module, group: Group, stats: dict, ratios, fmt: str, rounding: ScaleRounding):
        self.group, self.fmt, self.rounding = group, fmt, ScaleRounding(rounding)
        self.ratios = sorted({check_ratio(r) for r in ratios})
        self.linears = [model.get_submodule(m) for m in group.modules]
        st = stats[group.modules[0]]
        mean_abs = torch.as_tensor(st["mean_abs"], dtype=torch.float32)
        amax = torch.as_tensor(st["amax"], dtype=torch.float32)
        self.input_alpha = global_scale(amax) if fmt == "nvfp4" else None
        weight_alpha = None
        if fmt == "nvfp4":
            weight_alpha = global_scale(torch.stack([lin.weight.detach().abs().amax().float() for lin in self.linears]).amax())
        self.masks = {r: select_mask(mean_abs, r) for r in self.ratios}
        base = [
            QuantizedWeight(lin.weight.detach(), fmt, ratio=0.0, weight_alpha=weight_alpha, rounding=self.rounding)
            for lin in self.linears
        ]
        # qw[r][i]: member i at ratio r.
        self.qw: dict[float, list[QuantizedWeight]] = {}
        for r in self.ratios:
            if mode_of(r) == "k_ext":
                self.qw[r] = [_extended(b, lin.weight.detach(), r, self.masks[r]) for b, lin in zip(base, self.linears)]
            else:
                self.qw[r] = base
        self.backend = "auto"
        self.biases = [None if lin.bias is None else lin.bias.detach().float() for lin in self.linears]

    def outputs(self, x: torch.Tensor, r: float, i: int) -> torch.Tensor:
        """Emulated FP4 output of member i at ratio r for x ``[M, K]`` (FP32, bias added)."""
        y = quantized_matmul(x, self.qw[r][i], input_alpha=self.input_alpha, mode=mode_of(r))
        return y if self.biases[i] is None else y + self.biases[i]

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[float, torch.Tensor]]:
        """Per-input work shared by every member and ratio: X̂ (dequantized) and, per compensated
        ratio, the quantized-dequantized residue (all of it for full, the compacted selection for
        partial ratios).

        Large inputs go through the compiled quantizer (`formats.quantize(backend="auto")`, bit-identical
        to the reference that `quantized_matmul` calls; ``RESSERVE_BACKEND=reference`` forces it)."""
        xq = quantize(x, self.fmt, alpha=self.input_alpha, rounding=self.rounding, backend=self.backend)
        xd = dequantize(xq)
        res = residue(x, xq)
        extra: dict[float, torch.Tensor] = {}
        for r in self.ratios:
            mode = mode_of(r)
            if mode != "plain":
                width = residue_weight(self.qw[r][0], mode).shape[-1]
                extra[r] = dequantize(
                    quantized_residue_operand(res, xq, mode, mask=self.masks[r], width=width, rounding=self.rounding, backend=self.backend)
                )
        return xd, extra

    def member_outputs(self, prepared, i: int):
        """Yield ``(ratio, output)`` of member i for every candidate ratio, bit for bit equal to
        `outputs`: the operations of `emulate.quantized_matmul` in the same order, with X̂Ŵᵀ
        computed once for all ratios."""
        xd, extra = prepared
        w = self.qw[self.ratios[0]][i].w
        base = xd @ w.T
        for r in self.ratios:
            mode = mode_of(r)
            y = base if mode == "plain" else base + extra[r] @ residue_weight(self.qw[r][i], mode).T
            yield r, (y if self.biases[i] is None else y + self.biases[i])

    # -- bf16 fast path of the grad scores ---------------------------------------------------
    #
    # The FP4 operands are exact in bfloat16 once the NVFP4 tensor scales are factored out
    # (`emulate.exact_operand`), so every candidate product runs as a bf16 GEMM with FP32
    # accumulation. With c = α_x·α_w (1 for MXFP4), D_ρ = Y_q(ρ) − Y = D_0 + E_ρ where
    #   E_ρ = c · (R̂'_ρ @ Ŵ'_ρᵀ)   the residue products (bf16 outputs: they are differences)
    # and D_0 = Y_q(plain) − Y, the plain error, comes in one of two layouts:
    # - fused (any device): D_0 = c · ([X̂' | X | X] @ [Ŵ' | −H | −L]ᵀ), one GEMM of inner width
    #   3K whose bf16 output rounds the small difference, not the outputs; H + L = W/c to ~2⁻¹⁷
    #   (H = bf16(W/c), L = bf16(W/c − H); L is dropped when it is zero, e.g. MXFP4 on a bf16
    #   model). X must be exact in bf16 (a bf16 model).
    # - split (CUDA, where a bf16 GEMM can write FP32: `_mm_f32`): P = X̂'Ŵ'ᵀ and Y = X Wᵀ with
    #   the module's own weight, both with FP32 outputs, and D_0 = c·P − Y formed in FP32 inside
    #   the reduction (`_sq_sums_split`): two width-K products instead of one of width 3K, no
    #   [X̂' | X | X] copy, no H/L weights (≈ 4 bytes per weight less), and D_0 rounded at 2⁻²⁴
    #   of Y instead of 2⁻⁹ of D_0. X only has to be exact in the module's dtype (bf16 or fp16).
    # Either way Y is X Wᵀ with FP32 accumulation: more accurate than the module's bf16 output,
    # which the FP32 path subtracts. All paths are checked against a float64 oracle in
    # tests/test_scores.py.

    def _fast_weights(self, i: int, split: bool = False):
        """Member i's bf16 weight operands, built once for the group per layout: fused
        ``([Ŵ' | −H | −L], {ρ: residue weight'})`` (L kept for every member when any member needs
        it) or split ``((Ŵ', W), {ρ: residue weight'})`` with W the module's weight itself."""
        caches = self.__dict__.setdefault("_fast_cache", {})
        cache = caches.get(split)
        if cache is None:
            cache = caches[split] = self._build_fast_weights(split)
        return cache[i]

    def _build_fast_weights(self, split: bool) -> list:
        built, need_lo = [], False
        for k, lin in enumerate(self.linears):
            w_exact = exact_operand(self.qw[self.ratios[0]][k].base)
            res = {}
            for r in self.ratios:
                mode = mode_of(r)
                if mode == "full":
                    res[r] = w_exact
                elif mode == "k_ext":
                    res[r] = exact_operand(self.qw[r][k].ext)
            if split:
                built.append(((w_exact, lin.weight.detach()), res))
                continue
            w = lin.weight.detach().float() / self._c()
            hi = w.to(torch.bfloat16)
            lo = (w - hi.float()).to(torch.bfloat16)
            need_lo = need_lo or bool(lo.any())
            built.append((w_exact, hi, lo, res))
        if split:
            return built
        cache = []
        for we, hi, lo, res in built:
            b0 = torch.cat([we, -hi] + ([-lo] if need_lo else []), dim=1)
            # Full compensation multiplies Ŵ' itself: a view into b0, not a second copy.
            cache.append((b0, {r: b0[:, : we.shape[1]] if w is we else w for r, w in res.items()}))
        return cache

    def _c(self) -> torch.Tensor:
        """c = α_x · α_w in FP32 (1 for MXFP4)."""
        if self.input_alpha is None:
            return torch.ones((), dtype=torch.float32)
        return (self.input_alpha.float() * self.qw[self.ratios[0]][0].base.global_scale.float()).reshape(())

    def _c_on(self, device: torch.device) -> tuple[torch.Tensor, float]:
        """(c as an FP32 tensor on `device`, c² as a Python float), computed once per device: read
        per member and batch, they would otherwise cost a host sync each time."""
        per = self.__dict__.setdefault("_c_cache", {})
        if device not in per:
            c = self._c()
            per[device] = (c.to(device), float(c) ** 2)
        return per[device]

    def _fast_spec(self):
        """(compensated ratios, their modes, index tensors and residue widths) for `prepare_fast`."""
        spec = self.__dict__.get("_fast_spec_cache")
        if spec is None:
            comp = [r for r in self.ratios if mode_of(r) != "plain"]
            modes = tuple(mode_of(r) for r in comp)
            idx = [mask_to_indices(self.masks[r]) if m == "k_ext" else None for r, m in zip(comp, modes)]
            widths = tuple(residue_weight(self.qw[r][0], m).shape[-1] for r, m in zip(comp, modes))
            spec = self._fast_spec_cache = (comp, modes, idx, widths)
        return spec

    def prepare_fast(self, x: torch.Tensor, backend: str | None = None, split: bool | None = None):
        """`prepare` for the bf16 path: the base operand(s) and the residue operands R̂'_ρ in bf16
        (the quantizations of `prepare` with α factored out). The base is ``[X̂' | X | X]``
        (``[X̂' | X]`` without L) in the fused layout, the pair ``(X̂', X)`` in the split one
        (`split` None: `_split_base` decides; see the layouts above).

        backend ``compiled`` (auto on CPU for inputs ≥ 2^16 elements) runs the whole preparation as
        one `torch.compile` graph of the same format-core functions (bit-identical, tested);
        ``kernel`` (auto for bf16/fp16 CUDA inputs) the fused CUDA kernel (bit-identical, tested);
        ``reference`` composes the eager calls (`formats.quantize`, `emulate.quantized_residue_operand`).
        """
        comp, modes, idx, widths = self._fast_spec()
        split = _split_base(x, self.linears) if split is None else split
        twice = not split and self._fast_weights(0)[0].shape[1] > 2 * x.shape[-1]
        backend = backend or self.backend
        if backend == "auto":
            backend = _prepare_backend(x)
        if backend == "kernel":
            xhat, extra = self._prepare_with_kernel(x, comp, modes, widths)
            return _base_operand(xhat, x, split, twice), extra
        if backend == "compiled":
            fn = _compiled_prepare(self.fmt, self.rounding, modes, widths, twice)
            alpha = (self.input_alpha if self.input_alpha is not None else torch.ones(())).float().reshape(())
            idx = [i for i in idx if i is not None]
            # Fixed-size row chunks (the last one zero-padded): one compiled graph serves every M.
            M, K = x.shape
            a0 = x.new_empty((M, (3 if twice else 2) * K), dtype=torch.bfloat16)
            ops = [x.new_empty((M, w), dtype=torch.bfloat16) for w in widths]
            for start in range(0, M, _PREPARE_ROWS):
                chunk = x[start : start + _PREPARE_ROWS]
                rows = chunk.shape[0]
                if rows < _PREPARE_ROWS:
                    chunk = torch.cat([chunk, chunk.new_zeros((_PREPARE_ROWS - rows, K))])
                a, o = fn(chunk, alpha, idx)
                a0[start : start + rows] = a[:rows]
                for dst, src in zip(ops, o):
                    dst[start : start + rows] = src[:rows]
            return ((a0[:, :K], x) if split else a0), dict(zip(comp, ops))
        xq = quantize(x, self.fmt, alpha=self.input_alpha, rounding=self.rounding, backend=backend)
        res = residue(x, xq)
        extra: dict[float, torch.Tensor] = {}
        for r, mode, width in zip(comp, modes, widths):
            rq = quantized_residue_operand(
                res, xq, mode, mask=self.masks[r], width=width, rounding=self.rounding, backend=backend
            )
            extra[r] = exact_operand(rq)
        return _base_operand(exact_operand(xq), x, split, twice), extra

    def _prepare_with_kernel(self, x, comp, modes, widths):
        """(X̂', {ρ: R̂'_ρ}) through the fused CUDA kernel (bit-identical to the reference: it is
        checked against `kext.extended_activation` / `kext.full_residue` bit for bit): one launch
        per compensated ratio gives X̂ and that ratio's residue operand (bf16 through
        `emulate.exact_operand`)."""
        from . import kernel

        K = x.shape[-1]
        b = BLOCK[self.fmt]
        dev = self.__dict__.setdefault("_kernel_args", {})
        if x.device not in dev:  # α and the masks on the GPU once, not per call
            alpha = None if self.input_alpha is None else self.input_alpha.to(x.device)
            dev[x.device] = (alpha, {r: m.to(x.device) for r, m in self.masks.items()})
        alpha, masks = dev[x.device]
        xq, extra = None, {}
        for r, mode, width in zip(comp, modes, widths):
            if mode == "full":
                base, rq = kernel.quantize_full(x, self.fmt, alpha=alpha, rounding=self.rounding, backend="cuda")
            else:
                q = kernel.quantize_extend(
                    x, masks[r], r, self.fmt, alpha=alpha, rounding=self.rounding, backend="cuda", check_mask=False
                )
                base = FP4Tensor(q.fmt, q.codes[:, : K // 2], q.scales[:, : K // b], q.global_scale)
                rq = FP4Tensor(q.fmt, q.codes[:, K // 2 :], q.scales[:, K // b :], q.global_scale)
                assert rq.shape[-1] == width
            xq = base if xq is None else xq
            extra[r] = exact_operand(rq)
        if xq is None:
            xq = quantize(x, self.fmt, alpha=alpha, rounding=self.rounding, backend="reference")
        return exact_operand(xq), extra

    def member_sums_fast(self, prepared, i: int, grad: torch.Tensor) -> torch.Tensor:
        """[Σ (∂L/∂Y ⊙ (Y_q(ρ) − Y))² for ρ in `ratios`] of member i, float64 on grad's device, for a
        `prepare_fast` and ∂L/∂Y ``[M, N]``. No host sync: the caller accumulates these on the
        device and reads them once (a sync per linear in the backward pass stalls the GPU)."""
        base, extra = prepared
        comp = self._fast_spec()[0]
        split = isinstance(base, tuple)
        b0, wres = self._fast_weights(i, split)
        es = [(extra[r] @ wres[r].T).reshape(-1) for r in comp]
        c, c2 = self._c_on(grad.device)
        if split:
            p = _mm_f32(base[0], b0[0])
            y = _mm_f32(base[1], b0[1])
            sums = _sq_sums_split(grad.reshape(-1), p.reshape(-1), y.reshape(-1), c, *es).double()
        else:
            d0 = base @ b0.T
            sums = _sq_sums(grad.reshape(-1), d0.reshape(-1), *es).double() * c2
        # sums: [plain, then the compensated ratios in order]; `ratios` is sorted, so it is the
        # whole vector when it holds ratio 0 and the tail otherwise.
        first = 0 if mode_of(self.ratios[0]) == "plain" else 1
        return sums[first : first + len(self.ratios)]

    def member_scores_fast(self, prepared, i: int, grad: torch.Tensor) -> dict[float, float]:
        """{ρ: Σ (∂L/∂Y ⊙ (Y_q(ρ) − Y))²} of member i (`member_sums_fast` read back)."""
        return dict(zip(self.ratios, self.member_sums_fast(prepared, i, grad).tolist()))

    @contextmanager
    def installed(self, model: nn.Module, r: float):
        """Swap the group's linears for their emulated FP4 version at ratio r (restored on exit)."""
        cand = self
        swaps = []

        class _Emulated(nn.Module):
            def __init__(self, i: int, lin: nn.Linear):
                super().__init__()
                self.i, self.out_features = i, lin.out_features

            def forward(self, x):
                shape = x.shape
                y = cand.outputs(x.reshape(-1, shape[-1]), r, self.i)
                return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

        for i, (name, lin) in enumerate(zip(self.group.modules, self.linears)):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            swaps.append((parent, leaf, lin))
            setattr(parent, leaf, _Emulated(i, lin))
        try:
            yield
        finally:
            for parent, leaf, lin in swaps:
                setattr(parent, leaf, lin)


def _extended(base: QuantizedWeight, weight: torch.Tensor, ratio: float, mask: torch.Tensor) -> QuantizedWeight:
    """`base` plus the K-Ext extension for a partial ratio: what ``QuantizedWeight(weight, ...,
    ratio=ratio, mask=mask)`` builds, without quantizing the base again."""
    q = copy.copy(base)
    q.ratio, q.mask = ratio, mask
    q.ext = extend_weight(weight, mask, ratio, base.fmt, base.rounding, alpha=base.base.global_scale)
    q.w_ext = dequantize(q.ext)
    return q


def _prepare_body(x, alpha, idxs, *, fmt: str, rounding: ScaleRounding, modes: tuple, widths: tuple, twice: bool):
    """The bf16 operands of `Candidates.prepare_fast` from the format core's block functions (the
    quantizer's own bodies), as one graph for `torch.compile`."""
    b = BLOCK[fmt]
    M, K = x.shape

    def quant(t):
        blocks = t.reshape(-1, b)
        if fmt == "nvfp4":
            return nvfp4.quantize_blocks(blocks, alpha)
        return mxfp4.quantize_blocks(blocks, rounding)

    def deq(codes, scales, a):
        if fmt == "nvfp4":
            return nvfp4.dequantize_blocks(codes, scales, a)
        return mxfp4.dequantize_blocks(codes, scales)

    one = torch.ones_like(alpha)
    codes, scales = quant(x)
    res = x.float() - deq(codes, scales, alpha).reshape(M, K)
    xb = x.to(torch.bfloat16)
    a0 = torch.cat([deq(codes, scales, one).reshape(M, K).to(torch.bfloat16), xb] + ([xb] if twice else []), dim=1)
    ops = []
    it = iter(idxs)
    for mode, width in zip(modes, widths):
        if mode == "full":
            src = res
        else:
            sel = res.index_select(1, next(it))
            src = torch.cat([sel, sel.new_zeros((M, width - sel.shape[1]))], dim=1)
        c, s = quant(src)
        ops.append(deq(c, s, one).reshape(M, width).to(torch.bfloat16))
    return a0, ops


def _prepare_backend(x: torch.Tensor) -> str:
    """`prepare_fast`'s ``auto``: the compiled graph on CPU for inputs of ≥ 2^16 elements, the fused
    CUDA kernel for bf16/fp16 CUDA inputs when it can run, else the eager reference;
    ``RESSERVE_BACKEND=reference`` forces the reference."""
    if os.environ.get("RESSERVE_BACKEND", "") == "reference":
        return "reference"
    if x.device.type == "cpu":
        return "compiled" if x.numel() >= (1 << 16) else "reference"
    if x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous():
        from . import kernel

        if kernel.KERNEL_AVAILABLE:
            return "kernel"
    return "reference"


# Rows per compiled `prepare_fast` call (static shapes vectorise ~2.5x better than dynamic ones).
_PREPARE_ROWS = 128


@functools.lru_cache(maxsize=None)
def _compiled_prepare(fmt: str, rounding: ScaleRounding, modes: tuple, widths: tuple, twice: bool):
    body = functools.partial(_prepare_body, fmt=fmt, rounding=rounding, modes=modes, widths=widths, twice=twice)
    return compile_or_eager(body, dynamic=False, fullgraph=True)


def _sq_sums_eager(g: torch.Tensor, d0: torch.Tensor, *es: torch.Tensor) -> torch.Tensor:
    """[Σ (g·d0)², Σ (g·(d0 + e))² for each e] in FP32, one pass over flat inputs."""
    g = g.float()
    gd = g * d0.float()
    out = [torch.sum(gd * gd)]
    for e in es:
        t = gd + g * e.float()
        out.append(torch.sum(t * t))
    return torch.stack(out)


def _sq_sums_split_eager(g: torch.Tensor, p: torch.Tensor, y: torch.Tensor, c: torch.Tensor, *es: torch.Tensor) -> torch.Tensor:
    """`_sq_sums_eager` for the split layout: d0 = c·p − y and each e scaled by c, all in FP32
    (p, y: the FP32 products X̂'Ŵ'ᵀ and X Wᵀ; c: α_x·α_w as a 0-d FP32 tensor)."""
    g = g.float()
    gd = g * (c * p - y)
    out = [torch.sum(gd * gd)]
    for e in es:
        t = gd + g * (c * e.float())
        out.append(torch.sum(t * t))
    return torch.stack(out)


def _fused(fn, device: torch.device):
    """`fn` fused by `torch.compile` on CPU (one read of each operand instead of a pass per
    elementwise op), eager elsewhere or with ``RESSERVE_BACKEND=reference``. Not on CUDA: there
    the compiled reduction (a Triton kernel summing ``[M, N]`` to a few scalars) took 1.5 ms a call,
    57% of the GPU time of a scoring batch on the H200, and eager was faster overall
    (bench/results/plan.md). A compiler failure falls back to eager (`compiling.compile_or_eager`)."""
    if device.type != "cpu" or os.environ.get("RESSERVE_BACKEND", "") == "reference":
        return fn
    return _compiled_reduction(fn, device.type)


@functools.lru_cache(maxsize=None)
def _compiled_reduction(fn, device_type: str):
    return compile_or_eager(fn, dynamic=True, fullgraph=True)


def _sq_sums(g: torch.Tensor, d0: torch.Tensor, *es: torch.Tensor) -> torch.Tensor:
    """`_sq_sums_eager`, compiled on CPU and CUDA (see `_fused`)."""
    return _fused(_sq_sums_eager, g.device)(g, d0, *es)


def _sq_sums_split(g, p, y, c, *es) -> torch.Tensor:
    """`_sq_sums_split_eager`, compiled on CPU and CUDA (see `_fused`)."""
    return _fused(_sq_sums_split_eager, g.device)(g, p, y, c, *es)


@functools.lru_cache(maxsize=None)
def _mm_f32_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for `dtype` operands on `device`:
    a bf16/fp16 GEMM (FP32 accumulation) that writes its FP32 sums instead of rounding them, on
    CUDA with torch ≥ 2.8. Probed once per (device, dtype) on a tiny product."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        a = torch.full((2, 16), 1.5, dtype=dtype, device=device)
        out = torch.mm(a, a.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return out.dtype == torch.float32 and bool((out == 36.0).all())


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ bᵀ with FP32 sums and an FP32 output. bf16/fp16 operands: one native GEMM writing FP32
    where `_mm_f32_native`, else the same products (exact in FP32) in an FP32 GEMM (slow; only the
    split layout's tests take it on a CPU)."""
    if a.dtype == b.dtype and _mm_f32_native(a.device, a.dtype):
        return torch.mm(a, b.T, out_dtype=torch.float32)
    return a.float() @ b.float().T


def _split_base(x: torch.Tensor, linears) -> bool:
    """Whether `prepare_fast` takes the split layout for input x of these linears: on CUDA, for
    bf16/fp16 inputs of linears of the same dtype, where the GEMMs can write FP32 (`_mm_f32_native`).
    Elsewhere the fused layout: one GEMM of width 3K with a bf16 output (on CPUs an FP32 output
    would have to come from an FP32 GEMM, ~4x a bf16 one)."""
    return (
        x.device.type == "cuda"
        and all(lin.weight.dtype == x.dtype for lin in linears)
        and _mm_f32_native(x.device, x.dtype)
    )


def _base_operand(xhat: torch.Tensor, x: torch.Tensor, split: bool, twice: bool):
    """The base operand of `prepare_fast`: ``(X̂', X)`` (split) or ``[X̂' | X | X]`` / ``[X̂' | X]``."""
    if split:
        return xhat, x
    xb = x.to(torch.bfloat16)
    return torch.cat([xhat, xb] + ([xb] if twice else []), dim=1)


PRECISIONS = ("auto", "fp32", "bf16")


def _fast_bf16(device: torch.device) -> bool:
    """Whether bf16 GEMMs are fast on this device: any CUDA GPU (the bf16 path is ~2.6x faster
    than the FP32 emulation on an H200, bench/results/plan.md), or a CPU with AVX512-BF16 or AMX,
    where a bf16 GEMM is ~4x an FP32 one."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_precision(precision: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """``fp32`` or ``bf16`` for the grad scores' candidate products. ``auto`` is bf16 where bf16
    GEMMs are fast (`_fast_bf16`: CUDA GPUs, CPUs with AVX512-BF16/AMX) for a model whose
    activations are exact operands of its products there: a bf16 model, or on a GPU an fp16 model
    when the split layout runs (its X Wᵀ keeps X in fp16; the fused layout would round X to bf16).
    Else fp32 (e.g. an FP32 model: its activations are not exact in bf16)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown score precision {precision!r}, available: {list(PRECISIONS)}")
    if precision == "auto":
        device = torch.device(device)
        if not _fast_bf16(device):
            return "fp32"
        exact = dtype == torch.bfloat16 or (dtype == torch.float16 and _mm_f32_native(device, dtype))
        return "bf16" if exact else "fp32"
    return precision


def build_candidates(
    model: nn.Module, groups: list[Group], stats: dict, ratios=DEFAULT_RATIOS, fmt: str = "nvfp4", rounding="ceil", progress=None
) -> dict[tuple[str, ...], Candidates]:
    """{group modules: Candidates}: every group's quantized weights, built once (the costly part)."""
    out = {}
    for k, g in enumerate(groups):
        out[g.modules] = Candidates(model, g, stats, ratios, fmt, ScaleRounding(rounding))
        if progress is not None:
            progress(k + 1, len(groups))
    return out


# Bytes the candidates of one weight element take: FP32 dequantized base and extensions (≈ 4 + 3.5)
# plus the FP4 tensors; the bf16 path adds its bf16 operands: ≈ 8 more in the fused layout
# ([Ŵ' | −H | −L] and the extensions), ≈ 4 in the split one (Ŵ' and the extensions; W is the
# module's own). Checked against the tensors' sizes in tests/test_scores.py.
_BYTES_PER_WEIGHT = {"fp32": 8.5, "bf16": 16.5, "bf16-split": 12.5}


def _bytes_per_weight(method: str, precision: str, device: torch.device, dtype: torch.dtype) -> float:
    """`_BYTES_PER_WEIGHT` of the layout the scores will build on `device` for a `dtype` model."""
    if method != "grad" or precision != "bf16":
        return _BYTES_PER_WEIGHT["fp32"]
    split = device.type == "cuda" and _mm_f32_native(device, dtype)
    return _BYTES_PER_WEIGHT["bf16-split" if split else "bf16"]


def default_budget(device: torch.device) -> int:
    """Bytes the scores may spend on kept candidates: half the memory free on `device` now
    (``RESSERVE_SCORE_MEMORY_GB`` overrides)."""
    env = os.environ.get("RESSERVE_SCORE_MEMORY_GB")
    if env:
        return int(float(env) * 2**30)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * 0.5)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.5)
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


class CandidatePool:
    """Candidates built on demand, memory-bounded: groups are kept (in the order first asked
    for) while their estimated size fits `budget` bytes; any other group is built when asked for
    and dropped by the caller after use, so a model whose candidates do not fit is scored with
    one extra group at a time, at the price of quantizing those groups' weights once per batch.
    Built candidates are the same either way (deterministic), so the scores are too."""

    def __init__(self, model, groups, stats, ratios, fmt, rounding, budget: int, bytes_per_weight: float):
        self.model, self.stats, self.ratios, self.fmt, self.rounding = model, stats, ratios, fmt, ScaleRounding(rounding)
        self.groups = {g.modules: g for g in groups}
        self.budget, self.bytes_per_weight = budget, bytes_per_weight
        self.kept: dict[tuple[str, ...], Candidates] = {}
        self.used, self.builds = 0, 0

    def __getitem__(self, key: tuple[str, ...]) -> Candidates:
        if key in self.kept:
            return self.kept[key]
        g = self.groups[key]
        cand = Candidates(self.model, g, self.stats, self.ratios, self.fmt, self.rounding)
        self.builds += 1
        size = g.weight_count * self.bytes_per_weight
        if self.used + size <= self.budget:
            self.kept[key] = cand
            self.used += size
        return cand

    def prebuild(self, order, progress=None) -> None:
        """Build (and keep) the groups that fit, in `order`, reporting ``progress(done, total)``."""
        order = list(order)
        for k, key in enumerate(order):
            if key not in self.kept and self.used + self.groups[key].weight_count * self.bytes_per_weight <= self.budget:
                self[key]
            if progress is not None:
                progress(k + 1, len(order))


@contextmanager
def quantized(model: nn.Module, cands: dict, ratios: dict[tuple[str, ...], float]):
    """Install several groups at their ratios at once (e.g. a whole plan) and restore on exit."""
    with ExitStack() as stack:
        for key, r in ratios.items():
            stack.enter_context(cands[key].installed(model, r))
        yield


# ---------------------------------------------------------------------------------------------
# Model structure for the KL fast path


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList, nn.Module, nn.Module] | None:
    """(prefix, layers, final norm, lm_head) of a standard decoder-only causal LM, else None."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(layers, nn.ModuleList) or norm is None or head is None:
        return None
    prefix = next((n for n, m in model.named_modules() if m is layers), None)
    if prefix is None:
        return None
    return prefix, layers, norm, head


def _layer_of(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _valid(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    return (mask if mask is not None else torch.ones_like(ids)).bool()


def _kl_sum(ref_logp: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> float:
    """Σ over valid positions of KL(p_ref ‖ p_q); ref_logp is already restricted to valid rows."""
    logq = torch.log_softmax(logits[valid].float(), dim=-1)
    return float(torch.sum(ref_logp.exp() * (ref_logp - logq)))


def _kl_scores(model, batches, groups, cands, ratios, step) -> dict:
    structure = _decoder_layers(model)
    sums = {g.modules: {r: 0.0 for r in ratios} for g in groups}
    tokens = 0
    for batch in batches:
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        valid = _valid(mask, ids)
        tokens += int(valid.sum())
        captured: dict[int, tuple[torch.Tensor, dict]] = {}
        final: list[torch.Tensor] = []
        hooks = []
        fast = structure is not None
        if fast:
            prefix, layers, norm, head = structure
            for j, layer in enumerate(layers):

                def pre(mod, args, kwargs, j=j):
                    h = args[0] if args else kwargs["hidden_states"]
                    kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                    captured[j] = (h.detach(), kw, args[1:])

                hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(norm.register_forward_pre_hook(lambda mod, args: final.append(args[0].detach())))
        try:
            with torch.no_grad():
                ref_logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        finally:
            for h in hooks:
                h.remove()
        ref_logp = torch.log_softmax(ref_logits[valid].float(), dim=-1)
        if fast:
            with torch.no_grad():
                again = head(norm(final[-1]))
            fast = len(final) == 1 and torch.allclose(again.float(), ref_logits.float(), rtol=1e-3, atol=1e-3)
        del ref_logits

        def tail(start: int):
            h = captured[start][0]
            for j in range(start, len(layers)):
                # Each layer gets the arguments it was called with (masks may differ per layer type).
                _, kw, extra = captured[j]
                h = _first(layers[j](h, *extra, **kw))
            return head(norm(h))

        for g in groups:
            layer = _layer_of(g.modules[0], prefix) if fast else None
            cand = cands[g.modules]
            for r in ratios:
                with torch.no_grad(), cand.installed(model, r):
                    if layer is not None:
                        logits = tail(layer)
                    else:
                        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                sums[g.modules][r] += _kl_sum(ref_logp, logits, valid)
                del logits
                step()
            del cand
    return {k: {r: s / max(tokens, 1) for r, s in v.items()} for k, v in sums.items()}


# ---------------------------------------------------------------------------------------------
# Gradient-weighted output error


def _grad_scores(model, batches, groups, cands, ratios, step, precision: str = "fp32") -> dict:
    fast = precision == "bf16"
    # Per group, the per-ratio sums as one float64 vector on the device of its gradients, read
    # back once at the end: the same additions in the same order as Python floats, without a host
    # sync per linear inside the backward pass.
    acc: dict[tuple[str, ...], torch.Tensor] = {}

    def add(key, v: torch.Tensor) -> None:
        acc[key] = (acc[key] if key in acc else torch.zeros_like(v)) + v

    tokens = 0
    params = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in params:
        p.requires_grad_(False)
    embed = model.get_input_embeddings()
    try:
        for batch in batches:
            ids, mask = batch["input_ids"], batch.get("attention_mask")
            valid = _valid(mask, ids)
            # Next-token targets: position t predicts t+1 when both are valid tokens.
            target_ok = valid[:, 1:] & valid[:, :-1]
            tokens += int(target_ok.sum())
            hooks = []

            for g in groups:
                # Fused members read the same input: prepare it once, at the first member's gradient.
                # The group's candidates are looked up there too and released after its last
                # member (a memory-bounded pool may have built them for this batch only).
                shared = {"prepared": None, "left": 0, "cand": None}
                for i, m in enumerate(g.modules):
                    lin = model.get_submodule(m)

                    def fwd(mod, args, out, i=i, key=g.modules, shared=shared):
                        if not out.requires_grad:
                            return
                        x = args[0].detach()
                        y = None if fast else out.detach()
                        shared["left"] += 1

                        def on_grad(grad):
                            x2 = x.reshape(-1, x.shape[-1])
                            if shared["cand"] is None:
                                shared["cand"] = cands[key]
                                if list(shared["cand"].ratios) != list(ratios):
                                    raise ValueError(f"candidates of {key} are for ratios {shared['cand'].ratios}, not {list(ratios)}")
                            cand = shared["cand"]
                            if fast:
                                if shared["prepared"] is None:
                                    shared["prepared"] = cand.prepare_fast(x2)
                                g2 = grad.reshape(-1, grad.shape[-1])
                                add(key, cand.member_sums_fast(shared["prepared"], i, g2))
                            else:
                                if shared["prepared"] is None:
                                    shared["prepared"] = cand.prepare(x2)
                                y2 = y.reshape(-1, y.shape[-1]).float()
                                g2 = grad.reshape(-1, grad.shape[-1]).float()
                                sq = []
                                for _, yq in cand.member_outputs(shared["prepared"], i):
                                    d = (yq - y2) * g2
                                    sq.append(torch.sum(d * d))
                                add(key, torch.stack(sq).double())
                            shared["left"] -= 1
                            if shared["left"] == 0:
                                shared["prepared"] = shared["cand"] = None

                        out.register_hook(on_grad)

                    hooks.append(lin.register_forward_hook(fwd))
            try:
                emb = embed(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=emb, attention_mask=mask, use_cache=False).logits
                lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
                loss = torch.sum(nll[target_ok])
                loss.backward()
            finally:
                for h in hooks:
                    h.remove()
            del logits, lp, nll, loss, emb
            step(len(groups) * len(ratios))
    finally:
        for p, flag in params:
            p.requires_grad_(flag)
    sums = {g.modules: acc[g.modules].tolist() if g.modules in acc else [0.0] * len(ratios) for g in groups}
    return {k: {r: s / max(tokens, 1) for r, s in zip(ratios, v)} for k, v in sums.items()}


# ---------------------------------------------------------------------------------------------


def compute_scores(
    model: nn.Module,
    batches: list[dict],
    stats: dict,
    groups: list[Group],
    method: str,
    ratios: Iterable[float] = DEFAULT_RATIOS,
    fmt: str = "nvfp4",
    num_samples: int | None = None,
    rounding: ScaleRounding | str = "ceil",
    progress: Callable[[int, int], None] | None = None,
    show_progress: bool = True,
    candidates: dict | None = None,
    memory_budget: int | None = None,
    precision: str = "auto",
) -> dict:
    """The content of ``scores.json`` (see the module docstring and the calibration contract).

    stats: ``{module: {"mean_abs": float32 [K], "amax": float32 0-d}}`` for every group member.
    batches: ``{"input_ids", "attention_mask"}`` dicts (moved to the embedding's device here).
    num_samples: score on the first `num_samples` sequences of `batches` only (None: all).
    progress: called as ``progress(done, total)`` in (batch, group, ratio) units; without it a
    rich progress bar is shown when `show_progress`.
    candidates: prebuilt `build_candidates(...)` for these groups and ratios (reused across calls);
    without it a memory-bounded `CandidatePool` keeps the groups that fit `memory_budget` bytes
    (default: `default_budget`, half the free memory) and rebuilds the others per batch.
    precision: arithmetic of the grad method's candidate products: ``fp32`` (the emulated linear's
    own FP32 products, bit for bit, minus the module's output), ``bf16`` (the exact FP4 operands
    in bf16 GEMMs with FP32 accumulation, see `Candidates.prepare_fast`: within ~2e-4 of a float64
    oracle on SmolLM2, where the fp32 path's bf16 reference output puts it within ~1e-2) or
    ``auto`` (bf16 on CUDA GPUs and on CPUs with AVX512-BF16/AMX for bf16 models, and on GPUs
    for fp16 models where a bf16/fp16 GEMM can write FP32; else fp32: see `resolve_precision`).
    The bf16 path keeps bf16 copies of the candidate weights (≈ 4 bytes per weight on such GPUs,
    ≈ 8 elsewhere). The result records the precision used. KL scores always use the FP32 path.
    """
    if method not in METHODS:
        raise ValueError(f"unknown score method {method!r}, available: {list(METHODS)}")
    ratios = sorted({check_ratio(r) for r in ratios})
    rounding = ScaleRounding(rounding)
    dtypes = {model.get_submodule(m).weight.dtype for g in groups for m in g.modules}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    precision = resolve_precision(precision, _device_of(model), dtype)
    missing = [m for g in groups for m in g.modules if m not in stats]
    if missing:
        raise ValueError(f"no calibration stats for {missing[0]} ({len(missing)} modules)")
    batches = _take(batches, num_samples, _device_of(model))
    num_samples = sum(int(b["input_ids"].shape[0]) for b in batches)
    if num_samples == 0:
        raise ValueError("no samples to score")
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    total = len(batches) * len(groups) * len(ratios)
    done = [0]

    def step(n: int = 1) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    shown = None
    if progress is None and show_progress:
        from .ui import phases

        shown = phases()
        tick = shown.__enter__()
        reached: dict[str, int] = {}

        def absolute(desc: str) -> Callable[[int, int], None]:
            def update(d: int, t: int) -> None:
                tick(desc, d - reached.get(desc, 0), t)
                reached[desc] = d

            return update

        wprog = absolute(f"quantizing weights ({len(groups)} groups × {len(ratios)} ratios)")
        progress = absolute(f"scoring ({method}, {num_samples} samples, batch × group × ratio)")
    else:
        wprog = None
    try:
        if candidates is None:
            budget = default_budget(_device_of(model)) if memory_budget is None else int(memory_budget)
            bpw = _bytes_per_weight(method, precision, _device_of(model), dtype)
            candidates = CandidatePool(model, groups, stats, ratios, fmt, rounding, budget, bpw)
            # The grad hooks visit the groups last layer first: keep those that fit from there.
            candidates.prebuild([g.modules for g in (reversed(groups) if method == "grad" else groups)], wprog)
        if method == "kl":
            sums = _kl_scores(model, batches, groups, candidates, ratios, step)
        else:
            sums = _grad_scores(model, batches, groups, candidates, ratios, step, precision)
    except BaseException:
        if shown is not None:
            shown.__exit__(*sys.exc_info())
        raise
    finally:
        model.train(was_training)
    if shown is not None:
        shown.__exit__(None, None, None)
    out_groups = []
    for g in groups:
        s = sums[g.modules]
        out_groups.append(
            {
                "modules": list(g.modules),
                "weight_count": g.weight_count,
                "scores": {ratio_key(r): _finite(s[r], g) for r in ratios},
            }
        )
    return {
        "method": method,
        "samples": int(num_samples),
        "tokens_normalised": True,
        "ratios": ratios,
        "format": fmt,
        "rounding": rounding.value,
        **({"precision": precision} if method == "grad" else {}),
        "wall_time_s": round(time.perf_counter() - t0, 3),
        "groups": out_groups,
    }


def evaluate_kl(model: nn.Module, batches: list[dict], candidates: dict, ratios: dict[tuple[str, ...], float]) -> float:
    """Mean KL(p_ref ‖ p_q) per valid token when every group in `ratios` is quantized at its ratio
    at once (e.g. a whole plan): the end-to-end check a plan is judged by."""
    return evaluate_kls(model, batches, candidates, [ratios])[0]


def evaluate_kls(model: nn.Module, batches: list[dict], candidates: dict, plans: list[dict[tuple[str, ...], float]]) -> list[float]:
    """`evaluate_kl` for several plans, sharing the unquantized reference pass."""
    batches = _take(batches, None, _device_of(model))
    totals, tokens = [0.0] * len(plans), 0
    with torch.no_grad():
        for b in batches:
            ids, mask = b["input_ids"], b.get("attention_mask")
            valid = _valid(mask, ids)
            ref = torch.log_softmax(model(input_ids=ids, attention_mask=mask, use_cache=False).logits[valid].float(), dim=-1)
            for k, ratios in enumerate(plans):
                with quantized(model, candidates, ratios):
                    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                totals[k] += _kl_sum(ref, logits, valid)
                del logits
            tokens += int(valid.sum())
    return [t / max(tokens, 1) for t in totals]


def _device_of(model: nn.Module) -> torch.device:
    emb = model.get_input_embeddings()
    dev = emb.weight.device if emb is not None else next(model.parameters()).device
    return torch.device("cpu") if dev.type == "meta" else dev


def _take(batches: list[dict], n: int | None, device: torch.device) -> list[dict]:
    """The first n sequences of `batches` (all when n is None), on `device`."""
    out, left = [], n
    for b in batches:
        if left is not None and left <= 0:
            break
        rows = b["input_ids"].shape[0] if left is None else min(left, b["input_ids"].shape[0])
        nb = {k: v[:rows].to(device) for k, v in b.items() if k in ("input_ids", "attention_mask")}
        if "attention_mask" in nb:
            # Drop columns that are padding in every kept row.
            width = int(nb["attention_mask"].sum(dim=1).max())
            if int(nb["attention_mask"][:, width:].sum()) == 0:  # right padding
                nb = {k: v[:, :width] for k, v in nb.items()}
        out.append(nb)
        if left is not None:
            left -= rows
    return out


def _finite(v: float, g: Group) -> float:
    if not math.isfinite(v):
        raise ValueError(f"score of {g.name} is not finite ({v}): check the calibration stats and the model dtype")
    return float(v)


__all__ = ["METHODS", "PRECISIONS", "DEFAULT_RATIOS", "CandidatePool", "Candidates", "default_budget", "build_candidates", "compute_scores", "evaluate_kl", "evaluate_kls", "quantized", "ratio_key", "resolve_precision"]
