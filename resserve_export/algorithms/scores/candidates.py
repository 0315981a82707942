"""A group's quantized candidates: the emulated FP4 weights of its members at every candidate
ratio, and the products of an input with them.

`Candidates` owns what one decision group needs to be scored: the group's shared α (input α
from the calibrated amax, the one fused-group weight α), the selection mask per ratio, the base
quantization of each member (shared by every ratio) and the K-Ext extensions, all built once,
as `emulate.QuantizedWeight` builds them. On top of that it gives

- the FP32 products of `emulate.quantized_matmul`, bit for bit (`outputs`, `prepare` +
  `member_outputs`), which the KL scores and the fp32 grad path use;
- the bf16 path's operands and per-member squared sums (`prepare_fast`, `member_sums_fast`),
  the layouts and backends of which are described in `bf16`;
- the model surgery that runs a model with the group at one ratio (`installed`, through
  `emulate.swapped`; `quantized` for a whole plan).

Everything format-specific is asked of the format's `registry.Format`. `build_candidates` builds
them for every group at once; `pool.CandidatePool` builds them on demand under a memory budget.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from resserve_export.algorithms import kernel
from resserve_export.algorithms.emulate import (
    QuantizedWeight,
    exact_operand,
    quantized_matmul,
    quantized_residue_operand,
    residue_weight,
    swapped,
)
from resserve_export.algorithms.kext import ext_width, residue
from resserve_export.algorithms.scores import fused
from resserve_export.algorithms.scores.bf16 import (
    PREPARE_ROWS,
    base_operand,
    checked_group_sums,
    compiled_prepare,
    mm_f32,
    prepare_backend,
    split_base,
    grad_sq_sums,
    grad_sq_sums_split,
    native_group_sums,
)
from resserve_export.algorithms.selection import (
    check_ratio,
    mask_to_indices,
    mode_of,
    select_masks,
)
from resserve_export.formats import registry
from resserve_export.formats.constants import RATIOS
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.ops import dequantize, quantize
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.modeling.groups import Group


class Candidates:
    """Emulated FP4 weights of one group's members for each candidate ratio.

    Fused members share the group's weight α (max amax over the members, docs/formats.md) and the input α
    from the calibrated amax. The base quantization is computed once per member and shared by
    every ratio (plain and full use it alone; partial ratios add their K-Ext extension), exactly
    as `QuantizedWeight` builds it (tests check the two bit for bit). `base_weights`: ``{module:
    FP4Tensor}`` of members whose base quantization is given (GPTQ's); their extensions are built
    from its dequantized weights, as `pack` builds them.
    """

    def __init__(
        self, model: nn.Module, group: Group, stats: dict, ratios, fmt: str | registry.Format, rounding: ScaleRounding,
        base_weights: dict | None = None,
    ):
        self.format = registry.get(fmt)
        self.group, self.fmt, self.rounding = group, self.format.name, ScaleRounding(rounding)
        self.ratios = sorted({check_ratio(r) for r in ratios})
        self.linears = [model.get_submodule(m) for m in group.modules]
        st = stats[group.modules[0]]
        mean_abs = torch.as_tensor(st["mean_abs"], dtype=torch.float32)
        amax = torch.as_tensor(st["amax"], dtype=torch.float32)
        self.input_alpha = self.format.input_alpha(amax)  # None without a tensor scale
        self.masks = select_masks(mean_abs, self.ratios)
        given = {m: (base_weights or {}).get(m) for m in group.modules}
        # Member k's rows [rows[k], rows[k + 1]) of the group's stacked outputs.
        self.rows = [0]
        for lin in self.linears:
            self.rows.append(self.rows[-1] + lin.out_features)
        self._stacked = None  # (base FP4, all extensions in one FP4, {ρ: (column, width) in it}), when built so
        if any(g is not None for g in given.values()):
            weight_alpha = self.format.weight_alpha(lin.weight.detach() for lin in self.linears)
            base = [
                QuantizedWeight(lin.weight.detach(), self.format, ratio=0.0, weight_alpha=weight_alpha, rounding=self.rounding)
                if given[m] is None
                else _stored(given[m], self.rounding, lin.weight.device)
                for m, lin in zip(group.modules, self.linears)
            ]
            # qw[r][i]: member i at ratio r.
            self.qw: dict[float, list[QuantizedWeight]] = {}
            for r in self.ratios:
                if mode_of(r) == "k_ext":
                    self.qw[r] = [
                        _extended(b, lin.weight.detach() if given[m] is None else b.w, r, self.masks[r])
                        for m, b, lin in zip(group.modules, base, self.linears)
                    ]
                else:
                    self.qw[r] = base
            # The extensions of given bases were built from their FP32 values: not kept (made again
            # on first use, as for every other member).
            for qs in self.qw.values():
                for m, q in zip(group.modules, qs):
                    if given[m] is not None:
                        q.w = None
        else:
            self.qw = self._quantize_stacked()
        device = self.linears[0].weight.device
        if device.type == "cuda":
            self._kernel_args(device)
        self.backend = "auto"
        self.biases = [None if lin.bias is None else lin.bias.detach().float() for lin in self.linears]

    def _quantize_stacked(self) -> dict[float, list[QuantizedWeight]]:
        """Every member quantized as one stacked weight ``[ΣN, K]``: one quantization for the base
        and one per extension instead of one per member (rows are quantized independently, with
        the group's one α, so each member's rows are the bits of quantizing it alone). Members get
        row views of the stacked codes and scales."""
        ws = [lin.weight.detach() for lin in self.linears]
        w = ws[0] if len(ws) == 1 else torch.cat(ws)
        # The group's α from the stacked weight: the max of the members' amax, one read-back.
        weight_alpha = self.format.weight_alpha([w])
        stacked = QuantizedWeight(w, self.format, ratio=0.0, weight_alpha=weight_alpha, rounding=self.rounding)
        # Every K-Ext extension in one quantization; each ratio's is a column block of it.
        partial = [r for r in self.ratios if mode_of(r) == "k_ext"]
        every, offsets = kernel.extend_weights(w, [self.masks[r] for r in partial], partial, self.fmt, self.rounding, alpha=stacked.base.global_scale)
        spans = {r: (o, ext_width(w.shape[-1], r, self.fmt)) for r, o in zip(partial, offsets)}
        exts = {r: self._cols_of(every, o, n) for r, (o, n) in spans.items()}
        self._stacked = (stacked.base, every, spans)
        base = [QuantizedWeight.from_stored(self.fmt, 0.0, self.rounding, None, self._rows_of(stacked.base, k), None) for k in range(len(ws))]
        qw = {}
        for r in self.ratios:
            if r in exts:
                qw[r] = []
                for k, b in enumerate(base):
                    q = copy.copy(b)
                    q.ratio, q.mask, q.w_ext = r, self.masks[r], None
                    q.ext = None if exts[r] is None else self._rows_of(exts[r], k)
                    qw[r].append(q)
            else:
                qw[r] = base
        return qw

    def _cols_of(self, q: FP4Tensor, start: int, width: int) -> FP4Tensor:
        """Columns ``[start, start + width)`` of an FP4 tensor (block-aligned; views)."""
        b = self.format.block
        return FP4Tensor(q.fmt, q.codes[:, start // 2 : (start + width) // 2], q.scales[:, start // b : (start + width) // b], q.global_scale)

    def _rows_of(self, q: FP4Tensor, k: int) -> FP4Tensor:
        """Member k's rows of a stacked FP4 tensor (views)."""
        a, b = self.rows[k], self.rows[k + 1]
        return FP4Tensor(q.fmt, q.codes[a:b], q.scales[a:b], q.global_scale)

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
    # Every candidate product as a bf16 GEMM on the exact FP4 operands, with FP32 accumulation,
    # in the fused layout (one GEMM of width 3K) or the split one (two FP32-output GEMMs, CUDA):
    # see the `bf16` module for the layouts, the reductions and the preparation backends.

    def build_fast_weights(self, split: bool) -> None:
        """Make the bf16 path's weight operands now (else on first use): part of the one-off cost."""
        self._fast_weights(0, split)

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
        """The group's bf16 weight operands stacked over its members (`_fast_group`), and each
        member's row views of them (`_fast_weights`)."""
        comp = [r for r in self.ratios if mode_of(r) != "plain"]
        if self._stacked is not None:
            base, every, spans = self._stacked
            we = self._exact(base)
            # The extensions' operands in one pass; each ratio's is a column block of it.
            whole = self._exact(every) if spans else None
            ext = {r: whole[:, o : o + n] for r, (o, n) in spans.items()}
        else:  # members quantized one by one (given bases): their operands stacked
            we = torch.cat([self._exact(q.base) for q in self.qw[self.ratios[0]]])
            ext = {r: torch.cat([self._exact(q.ext) for q in self.qw[r]]) for r in comp if mode_of(r) == "k_ext"}
        K = we.shape[1]
        if split:
            b0 = we
        else:
            ws = [lin.weight.detach() for lin in self.linears]
            w = (ws[0] if len(ws) == 1 else torch.cat(ws)).float() / self._c()
            hi = w.to(torch.bfloat16)
            lo = (w - hi.float()).to(torch.bfloat16)
            b0 = torch.cat([we, -hi] + ([-lo] if bool(lo.any()) else []), dim=1)
            del w, hi, lo
        # Full compensation multiplies Ŵ' itself: a view into b0, not a second copy.
        res = {r: b0[:, :K] if mode_of(r) == "full" else ext[r] for r in comp}
        self.__dict__.setdefault("_fast_group", {})[split] = (b0, res)
        cache = []
        for k, lin in enumerate(self.linears):
            a, b = self.rows[k], self.rows[k + 1]
            mine = {r: t[a:b] for r, t in res.items()}
            cache.append(((b0[a:b], lin.weight.detach()) if split else b0[a:b], mine))
        return cache

    def _c(self) -> torch.Tensor:
        """c = α_x · α_w in FP32 (1 for MXFP4)."""
        if self.input_alpha is None:
            return torch.ones((), dtype=torch.float32)
        return (self.input_alpha.float() * self.qw[self.ratios[0]][0].base.global_scale.float()).reshape(())

    def _c_on(self, device: torch.device) -> torch.Tensor:
        """c as an FP32 tensor on `device`, made once per device (no host sync: the split layout
        reads it on the device)."""
        per = self.__dict__.setdefault("_c_cache", {})
        if device not in per:
            per[device] = self._c().to(device)
        return per[device]

    def _c2(self) -> float:
        """c² as a Python float, read once (the fused layout scales its sums by it; a read per
        member and batch would be a host sync each time)."""
        c2 = self.__dict__.get("_c2_cache")
        if c2 is None:
            c2 = self._c2_cache = float(self._c()) ** 2
        return c2

    def _fast_spec(self):
        """(compensated ratios, their modes, index tensors and residue widths) for `prepare_fast`."""
        spec = self.__dict__.get("_fast_spec_cache")
        if spec is None:
            comp = [r for r in self.ratios if mode_of(r) != "plain"]
            modes = tuple(mode_of(r) for r in comp)
            idx = [mask_to_indices(self.masks[r]) if m == "k_ext" else None for r, m in zip(comp, modes)]
            # Widths from the codes: `residue_weight` would dequantize the FP32 weights.
            widths = tuple((self.qw[r][0].base if m == "full" else self.qw[r][0].ext).shape[-1] for r, m in zip(comp, modes))
            spec = self._fast_spec_cache = (comp, modes, idx, widths)
        return spec

    def prepare_fast(self, x: torch.Tensor, backend: str | None = None, split: bool | None = None):
        """`prepare` for the bf16 path: the base operand(s) and the residue operands R̂'_ρ in bf16
        (the quantizations of `prepare` with α factored out). The base is ``[X̂' | X | X]``
        (``[X̂' | X]`` without L) in the fused layout, the pair ``(X̂', X)`` in the split one
        (`split` None: `split_base` decides; see the layouts above).

        backend ``compiled`` (auto on CPU for inputs ≥ 2^16 elements) runs the whole preparation as
        one `torch.compile` graph of the same format-core functions (bit-identical, tested);
        ``kernel`` (auto for bf16/fp16 CUDA inputs) the fused CUDA kernel (bit-identical, tested);
        ``reference`` composes the eager calls (`formats.quantize`, `emulate.quantized_residue_operand`).
        """
        comp, modes, idx, widths = self._fast_spec()
        split = split_base(x, self.linears) if split is None else split
        twice = not split and self._fast_weights(0)[0].shape[1] > 2 * x.shape[-1]
        backend = backend or self.backend
        if backend == "auto":
            backend = prepare_backend(x)
        if backend == "kernel":
            xhat, extra = self._prepare_with_kernel(x, comp, modes, widths)
            return base_operand(xhat, x, split, twice), extra
        if backend == "compiled":
            fn = compiled_prepare(self.fmt, self.rounding, modes, widths, twice)
            alpha = (self.input_alpha if self.input_alpha is not None else torch.ones(())).float().reshape(())
            idx = [i for i in idx if i is not None]
            # Fixed-size row chunks (the last one zero-padded): one compiled graph serves every M.
            M, K = x.shape
            a0 = x.new_empty((M, (3 if twice else 2) * K), dtype=torch.bfloat16)
            ops = [x.new_empty((M, w), dtype=torch.bfloat16) for w in widths]
            for start in range(0, M, PREPARE_ROWS):
                chunk = x[start : start + PREPARE_ROWS]
                rows = chunk.shape[0]
                if rows < PREPARE_ROWS:
                    chunk = torch.cat([chunk, chunk.new_zeros((PREPARE_ROWS - rows, K))])
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
        return base_operand(exact_operand(xq), x, split, twice), extra

    def _prepare_with_kernel(self, x, comp, modes, widths):
        """(X̂', {ρ: R̂'_ρ}) through the fused CUDA kernel (bit-identical to the reference: it is
        checked against `kext.extended_activation` / `kext.full_residue` bit for bit): one launch
        per compensated ratio gives X̂ and that ratio's residue operand (bf16 through `_exact`)."""

        K = x.shape[-1]
        b = self.format.block
        alpha, masks = self._kernel_args(x.device)
        if comp and fused.extension_operands(x.device):  # every launch in one C++ call, the same bits
            ops = kernel.prepare_operands(
                x, [masks[r] if m == "k_ext" else None for r, m in zip(comp, modes)], comp, list(widths), self.fmt,
                alpha, self.rounding, fused.scale_factors(self.format, x.device),
            )
            return ops[0], dict(zip(comp, ops[1:]))
        xhat, extra = None, {}
        for r, mode, width in zip(comp, modes, widths):
            if mode == "full":
                base, rq = kernel.quantize_full(x, self.fmt, alpha=alpha, rounding=self.rounding, backend="cuda")
                if xhat is None:
                    xhat = self._exact(base)
                extra[r] = self._exact(rq)
                continue
            q = kernel.quantize_extend(
                x, masks[r], r, self.fmt, alpha=alpha, rounding=self.rounding, backend="cuda", check_mask=False
            )
            assert q.shape[-1] == K + width
            if xhat is None:  # [X̂' | R̂'] in one pass; both operands are column views of it
                both = self._exact(q)
                xhat, extra[r] = both[:, :K], both[:, K:]
            else:
                extra[r] = self._exact(FP4Tensor(q.fmt, q.codes[:, K // 2 :], q.scales[:, K // b :], q.global_scale))
        if xhat is None:
            xhat = self._exact(quantize(x, self.fmt, alpha=alpha, rounding=self.rounding, backend="reference"))
        return xhat, extra

    def _kernel_args(self, device: torch.device) -> tuple:
        """(the input α, {ρ: mask}) on `device`, copied once: made with the candidates where their
        weights are on a GPU, since a copy from host memory waits for the device's queue, and in
        the first batch's backward pass that would stall it once per group."""
        dev = self.__dict__.setdefault("_kernel_args_cache", {})
        if device not in dev:
            alpha = None if self.input_alpha is None else self.input_alpha.to(device)
            dev[device] = (alpha, {r: m.reshape(-1).to(device).contiguous() for r, m in self.masks.items()})
        return dev[device]

    def _exact(self, q: FP4Tensor) -> torch.Tensor:
        """`emulate.exact_operand(q)`, in one launch where `fused.exact_bf16` runs (the CUDA
        extension or the Triton kernel: bit for bit the same values)."""
        return fused.exact_bf16(q, self.format) if fused.available(q.codes.device) else exact_operand(q)

    def member_sums_fast(self, prepared, i: int, grad: torch.Tensor) -> torch.Tensor:
        """[Σ (∂L/∂Y ⊙ (Y_q(ρ) − Y))² for ρ in `ratios`] of member i, float64 on grad's device, for a
        `prepare_fast` and ∂L/∂Y ``[M, N]``. No host sync: the caller accumulates these on the
        device and reads them once (a sync per linear in the backward pass stalls the GPU)."""
        return self.group_sums_fast(prepared, [i], [grad])

    def group_sums_fast(self, prepared, members: list[int], grads: list[torch.Tensor], stacked: bool | None = None,
                        native: bool | None = None) -> torch.Tensor:
        """`member_sums_fast` summed over `members` (their gradients ``[M, N_i]`` in order).
        `stacked` (with every member): each candidate product is one GEMM over the group's stacked
        weights (`_fast_group`) and the reductions read each member's column block in place;
        otherwise the products run over each member's rows. None: stacked where the Triton
        reduction reads the blocks (`fused.available`); the compiled CPU reduction is slower on
        strided blocks than the per-member products are. `native` (stacked, split layout): the
        whole group in one call of the CUDA extension (`bf16.checked_group_sums`); None: where
        `bf16.native_group_sums`."""
        base, extra = prepared
        split = isinstance(base, tuple)
        self._fast_weights(members[0], split)  # built once per layout
        if stacked is None:
            stacked = fused.available(grads[0].device)
        stacked = stacked and list(members) == list(range(len(self.linears)))
        if native is None:
            native = stacked and split and native_group_sums(grads[0].device)
        if native:
            total = checked_group_sums(self._native_args(prepared, grads), lambda: self._group_totals(prepared, members, grads, stacked))
        else:
            total = self._group_totals(prepared, members, grads, stacked)
        # total: [plain, then the compensated ratios in order]; `ratios` is sorted, so it is the
        # whole vector when it holds ratio 0 and the tail otherwise.
        first = 0 if mode_of(self.ratios[0]) == "plain" else 1
        return total[first : first + len(self.ratios)]

    def _native_args(self, prepared, grads: list[torch.Tensor]) -> tuple:
        """`kernel.group_sums_split`'s arguments for the whole group (stacked, split layout)."""
        (xhat, x), extra = prepared
        comp = self._fast_spec()[0]
        b0, wres = self._fast_group[True]
        return (
            xhat, x, [extra[r] for r in comp], b0, [wres[r] for r in comp], [lin.weight.detach() for lin in self.linears],
            [g.reshape(-1, g.shape[-1]) for g in grads], self.rows, self._c_on(grads[0].device),
        )

    def _group_totals(self, prepared, members: list[int], grads: list[torch.Tensor], stacked: bool) -> torch.Tensor:
        """float64 ``[plain, each compensated ratio]`` over `members`, through `grad_sq_sums_split`
        / `grad_sq_sums` (see `group_sums_fast`)."""
        base, extra = prepared
        comp = self._fast_spec()[0]
        split = isinstance(base, tuple)
        if stacked:
            b0, wres = self._fast_group[split]
            es = [extra[r] @ wres[r].T for r in comp]
            # Split: P = X̂'Ŵ'ᵀ in FP32; fused: D_0 / c directly (see `bf16`).
            first_product = mm_f32(base[0], b0) if split else base @ b0.T
        c = self._c_on(grads[0].device) if split else None
        c2 = None if split else self._c2()
        total = None
        for k, g in zip(members, grads):
            if stacked:
                a, b = self.rows[k], self.rows[k + 1]
                es_k, prod_k = [e[:, a:b] for e in es], first_product[:, a:b]
            else:
                b0_k, wres_k = self._fast_cache[split][k]
                es_k = [extra[r] @ wres_k[r].T for r in comp]
                prod_k = mm_f32(base[0], b0_k[0]) if split else base @ b0_k.T
            if split:  # the members' sums added into one total, in member order
                y = mm_f32(base[1], self.linears[k].weight.detach())
                total = grad_sq_sums_split(g, prod_k, y, c, *es_k, out=total)
            else:
                s = grad_sq_sums(g, prod_k, *es_k).double() * c2
                total = s if total is None else total + s
        return total

    def member_scores_fast(self, prepared, i: int, grad: torch.Tensor) -> dict[float, float]:
        """{ρ: Σ (∂L/∂Y ⊙ (Y_q(ρ) − Y))²} of member i (`member_sums_fast` read back)."""
        return dict(zip(self.ratios, self.member_sums_fast(prepared, i, grad).tolist()))

    @contextmanager
    def installed(self, model: nn.Module, r: float):
        """Swap the group's linears for their emulated FP4 version at ratio r (restored on exit)."""
        cand = self

        class _Emulated(nn.Module):
            def __init__(self, i: int, lin: nn.Linear):
                super().__init__()
                self.i, self.out_features = i, lin.out_features

            def forward(self, x):
                shape = x.shape
                y = cand.outputs(x.reshape(-1, shape[-1]), r, self.i)
                return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

        with swapped(model, {name: _Emulated(i, lin) for i, (name, lin) in enumerate(zip(self.group.modules, self.linears))}):
            yield


def _stored(q: FP4Tensor, rounding: ScaleRounding, device: torch.device) -> QuantizedWeight:
    """A member whose base quantization is given (GPTQ's), on `device`."""
    g = None if q.global_scale is None else q.global_scale.to(device)
    q = FP4Tensor(q.fmt, q.codes.to(device), q.scales.to(device), g)
    return QuantizedWeight.from_stored(q.fmt, 0.0, rounding, None, q, None)  # FP32 values on first use


def _extended(base: QuantizedWeight, weight: torch.Tensor, ratio: float, mask: torch.Tensor) -> QuantizedWeight:
    """`base` plus the K-Ext extension for a partial ratio: what ``QuantizedWeight(weight, ...,
    ratio=ratio, mask=mask)`` builds, without quantizing the base again."""
    q = copy.copy(base)
    q.ratio, q.mask = ratio, mask
    q.ext = kernel.extend_weight(weight, mask, ratio, base.fmt, base.rounding, alpha=base.base.global_scale)
    q.w_ext = None  # dequantized on first use (`QuantizedWeight.w_ext`)
    return q



def build_candidates(
    model: nn.Module, groups: list[Group], stats: dict, ratios=RATIOS, fmt: str = "nvfp4", rounding="ceil", progress=None,
    base_weights: dict | None = None,
) -> dict[tuple[str, ...], Candidates]:
    """{group modules: Candidates}: every group's quantized weights, built once (the costly part)."""
    out = {}
    for k, g in enumerate(groups):
        out[g.modules] = Candidates(model, g, stats, ratios, fmt, ScaleRounding(rounding), base_weights)
        if progress is not None:
            progress(k + 1, len(groups))
    return out



@contextmanager
def quantized(model: nn.Module, cands: dict, ratios: dict[tuple[str, ...], float]):
    """Install several groups at their ratios at once (e.g. a whole plan) and restore on exit."""
    with ExitStack() as stack:
        for key, r in ratios.items():
            stack.enter_context(cands[key].installed(model, r))
        yield

