"""GPTQ for the FP4 formats (``calibrate --weight-algo gptq`` and ``awq+gptq``).

GPTQ (Frantar et al., 2023) quantizes a linear's weight ``W`` ``[N, K]`` one input column at a
time and spreads each column's rounding error over the columns not yet quantized, weighted by the
inverse of the input Hessian ``H = Σ xᵀx`` of the calibration tokens, so that the output error
``‖X Wᵀ − X Qᵀ‖`` stays small rather than the weight error. The blocks are the format's (16 for
NVFP4, 32 for MXFP4, along K) and every column is rounded exactly as the format quantizes (E2M1 of
``w / (float(s) · α)``, round to nearest even, saturating at 6); its error, divided by the
diagonal of the Cholesky factor of ``H⁻¹``, is subtracted from the later columns. Two column
orders (`ORDERS`, ``calibrate --gptq-order``):

- ``activation`` (the default): every block's scale is chosen first, from the weights as they
  are, by the format's own rule (`registry.Format.quantize_blocks`: NVFP4's E4M3 min-max scale
  with the fused group's tensor scale α, MXFP4's E8M0 exponent with the chosen ``--mx-scale``
  rounding): the scales round to nearest would write. The columns are then taken by decreasing
  Hessian diagonal (stable sort), so the input channels that carry the most energy are rounded
  first and the others absorb their error. llm-compressor's GPTQ does the same by default
  (``actorder="static"``). On the default model, served W4A4 by vLLM, it lowered held-out
  perplexity from 98.6 (``block``) to 94.9 (bench/results/accuracy.md).
- ``block``: the columns in order; at the first column of a block the block's scale of every row
  is chosen by the same rule from the block's values as the earlier blocks' error feedback left
  them.

Either way the result is an ordinary tensor of the format (codes, block scales, the group's α): a
stock loader reads it as any other, and with a diagonal ``H`` (no correlation between input
channels) it is the round-to-nearest quantization bit for bit. ``H`` gets ``DAMP`` × its mean
diagonal added (dampening); an input channel that no token reached (a zero diagonal) gets a unit
diagonal, so its column is rounded to nearest without feeding error into the others.

The Hessians are those of the (AWQ-smoothed) model in full precision, for every quantized linear
at once when they fit `HESSIAN_BYTES`, else in as many forward passes as it takes, each holding
at most that much; an expert's Hessian is over the calibration tokens routed to it. An expert no
token was routed to has no Hessian and is rounded to nearest, as calibration.json records.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from resserve_export.core.errors import UserError
from resserve_export.formats import registry
from resserve_export.formats.fp4 import decode_e2m1, encode_e2m1, pack_fp4
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.ops import quantize
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.modeling.experts import checkpoint_parameters, unfused
from resserve_export.modeling.forward import forward_kwargs, input_device
from resserve_export.observers.hessian import HessianCollector

DAMP = 0.01  # H += DAMP · mean(diag H) · I
# The order GPTQ takes the columns in (``calibrate --gptq-order``): "activation" fixes the block
# scales from the weights first and takes the input channels by decreasing Hessian diagonal;
# "block" goes through the blocks in order, each block's scales chosen at its first column.
ORDERS = ("activation", "block")
ORDER = "activation"
UPDATE_COLUMNS = 128  # columns whose error feedback is applied to the rest of W at once (a multiple of 32)
HESSIAN_BYTES = 1 << 30  # float32 Hessians held in one calibration pass
FILE = "gptq.safetensors"
RTN_NO_TOKENS = "no calibration token was routed to this expert: rounded to nearest"


class SingularHessian(ValueError):
    """The dampened Hessian is not positive definite (non-finite inputs, or too little damping)."""


def _unit(f: registry.Format, scales: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    """What code 1.0 of each row's block decodes to (``float(s) · α``, or ``2^e``): the format's
    own dequantization of a block of 1.0 codes (0x22 packs two of them), so exactly its arithmetic."""
    n = scales.shape[0]
    ones = torch.full((n, 1, f.block // 2), 0x22, dtype=torch.uint8, device=scales.device)
    return f.dequantize_blocks(ones, scales.reshape(n, 1), alpha)[:, 0, 0]


def inverse_factor(h: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp · mean(diag H) · I)⁻¹`` (float32), a dead input
    channel's diagonal set to 1 first; `SingularHessian` when it does not exist."""
    H = h.detach().float().clone()
    if not bool(torch.isfinite(H).all()):
        raise SingularHessian("the Hessian holds NaN or Inf values")
    diag = H.diagonal()
    diag[diag == 0] = 1.0
    diag.add_(damp * diag.mean())
    L, info = torch.linalg.cholesky_ex(H)
    if int(info):
        raise SingularHessian(f"it is not positive definite even with damping {damp:g}")
    U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if int(info) or not bool(torch.isfinite(U).all()):
        raise SingularHessian(f"its inverse is not positive definite even with damping {damp:g}")
    return U


def solve(
    w: torch.Tensor, h: torch.Tensor, fmt: str, alpha: torch.Tensor | None = None, rounding: ScaleRounding | str = ScaleRounding.CEIL,
    damp: float = DAMP, order: str = ORDER,
) -> FP4Tensor:
    """GPTQ of one weight `w` ``[N, K]`` with input Hessian `h` ``[K, K]`` (module docstring), in
    format `fmt` with tensor scale `alpha` (NVFP4: the fused group's; None derives it from `w`)."""
    f = registry.get(fmt)
    rounding = ScaleRounding(rounding)
    W = w.detach().float().clone()
    N, K = W.shape
    b = f.block
    if K % b or tuple(h.shape) != (K, K):
        raise ValueError(f"weight {tuple(w.shape)} and Hessian {tuple(h.shape)} do not fit {f.name} blocks of {b}")
    if f.has_tensor_scale:
        alpha = f.tensor_alpha(w) if alpha is None else alpha
        alpha = torch.as_tensor(alpha, dtype=torch.float32).to(W.device).reshape(())
    else:
        alpha = None
    if order not in ORDERS:
        raise ValueError(f"unknown GPTQ order {order!r}: one of {', '.join(ORDERS)}")
    if order == "activation":
        return _solve_activation_order(f, W, h, alpha, rounding, damp)
    U = inverse_factor(h.to(W.device), damp)
    scales: list[torch.Tensor] = []
    unit = None

    def unit_at(col: int, W1: torch.Tensor, j: int) -> torch.Tensor:
        nonlocal unit
        if col % b == 0:  # a block's first column: its scales from the values as they are now
            _, s = f.quantize_blocks(W1[:, j : j + b], alpha, rounding)
            scales.append(s)
            unit = _unit(f, s, alpha)
        return unit

    codes = _feedback(W, U, unit_at)
    return FP4Tensor(f.name, pack_fp4(codes), torch.stack(scales, dim=1), alpha)


def _solve_activation_order(f: registry.Format, W: torch.Tensor, h: torch.Tensor, alpha, rounding, damp: float) -> FP4Tensor:
    """GPTQ in ``activation`` order (module docstring): the block scales of `W` fixed first, then
    the columns by decreasing diagonal of `h`, each rounded with its own block's scale."""
    N, K = W.shape
    b = f.block
    _, scales = f.quantize_blocks(W.reshape(-1, b), alpha, rounding)
    units = _unit(f, scales.reshape(-1), alpha).reshape(N, K // b)
    perm = torch.argsort(h.diagonal().float(), descending=True, stable=True).to(W.device)
    U = inverse_factor(h.to(W.device)[perm][:, perm], damp)
    unit_p = units[:, perm // b]
    codes_p = _feedback(W[:, perm], U, lambda col, W1, j: unit_p[:, col])
    codes = torch.empty_like(codes_p)
    codes[:, perm] = codes_p
    return FP4Tensor(f.name, pack_fp4(codes), scales.reshape(N, K // b), alpha)


def _feedback(W: torch.Tensor, U: torch.Tensor, unit_of) -> torch.Tensor:
    """GPTQ's column loop over `W` ``[N, K]`` (changed in place) with `U`, the upper Cholesky
    factor of the dampened ``H⁻¹`` in the same column order: each column rounded to E2M1 codes
    with the per-row unit that ``unit_of(column, W1, j)`` returns (what code 1.0 decodes to; `W1` is
    the current update window, the column its `j`-th), its error fed into the later columns,
    `UPDATE_COLUMNS` at a time. The codes ``[N, K]`` (uint8, unpacked)."""
    N, K = W.shape
    codes = torch.empty((N, K), dtype=torch.uint8, device=W.device)
    for i1 in range(0, K, UPDATE_COLUMNS):
        i2 = min(i1 + UPDATE_COLUMNS, K)
        W1 = W[:, i1:i2]
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for j in range(i2 - i1):
            unit = unit_of(i1 + j, W1, j)
            x = W1[:, j]
            c = encode_e2m1(x / unit)
            codes[:, i1 + j] = c
            err = (x - decode_e2m1(c) * unit) / U1[j, j]
            W1[:, j + 1 :] -= err.unsqueeze(1) * U1[j, j + 1 :].unsqueeze(0)
            E1[:, j] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return codes


# ----------------------------------------------------------------------------- a whole model


def _chunks(groups, budget: int) -> list[list]:
    """`groups` in model order, cut where their float32 Hessians would pass `budget` bytes."""
    out, cur, used = [], [], 0
    for g in groups:
        need = 4 * g.in_features * g.in_features
        if cur and used + need > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(g)
        used += need
    if cur:
        out.append(cur)
    return out


def _hessians(model, batches, chunk, blocks):
    """One forward pass over `batches` collecting the Hessians of `chunk`'s groups (experts as
    per-expert linears that padding rows are routed nowhere)."""
    dev = input_device(model)
    kw = forward_kwargs(model)
    with unfused(model, list(blocks)) if blocks else nullcontext() as experts, HessianCollector(model, [g.modules[0] for g in chunk]) as col:
        with torch.inference_mode():
            for bt in batches:
                for o in (col, experts) if experts is not None else (col,):
                    o.set_mask(bt["attention_mask"])
                model(input_ids=bt["input_ids"].to(dev), attention_mask=bt["attention_mask"].to(dev), **kw)
                for o in (col, experts) if experts is not None else (col,):
                    o.end_batch()
        return {g.modules[0]: col.take(g.modules[0]) for g in chunk}


def quantize_model(
    model, batches: list[dict], groups, fmt: str, rounding, *, blocks=(), progress=None, damp: float = DAMP, budget: int = HESSIAN_BYTES,
    order: str = ORDER,
) -> tuple[dict[str, FP4Tensor], dict]:
    """GPTQ of every quantized linear of `model` (not changed here) on the calibration `batches`:
    ``{module: FP4Tensor}`` (CPU) and calibration.json's record. `blocks`: a mixture-of-experts
    model's expert blocks (experts are quantized one linear each, on their routed tokens).
    `progress()` is called once per group."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UserError(
            "--weight-algo gptq needs the whole model in memory, but it was offloaded to disk: pass --device cpu, a GPU that holds it, "
            "or --pipeline sequential"
        )
    params = checkpoint_parameters(model, list(blocks))
    out: dict[str, FP4Tensor] = {}
    fallback: dict[str, str] = {}
    for chunk in _chunks(groups, budget):
        hs = _hessians(model, batches, chunk, blocks)
        for g in chunk:
            h, rows = hs.pop(g.modules[0])
            quantize_group(g, [params[f"{m}.weight"] for m in g.modules], h, rows, fmt, rounding, out, fallback, damp, order)
            del h
            if progress is not None:
                progress()
    return out, record(fmt, rounding, out, fallback, damp, order)


def quantize_group(
    g, ws: list[torch.Tensor], h: torch.Tensor | None, rows: int, fmt: str, rounding, out: dict, fallback: dict, damp: float = DAMP,
    order: str = ORDER,
) -> None:
    """GPTQ of one decision group `g` (member weights `ws`, their input's Hessian `h` over `rows`
    tokens) into `out` (``{module: FP4Tensor}``, CPU); without a Hessian (no token reached it)
    round to nearest, recorded in `fallback`."""
    f = registry.get(fmt)
    alpha = f.weight_alpha(ws)
    if h is None:
        for m, w in zip(g.modules, ws):
            out[m] = _to_cpu(quantize(w, f, alpha=alpha, rounding=rounding, backend="reference"))
            fallback[m] = RTN_NO_TOKENS
        return
    try:
        with torch.no_grad():
            # Rows are independent given H: the members (one input, one α) in one pass.
            q = solve(torch.cat([w.detach() for w in ws]), h, fmt, alpha, rounding, damp, order)
    except SingularHessian as e:
        raise UserError(
            f"GPTQ cannot quantize {g.name}: the Hessian of its {rows} calibration tokens is singular ({e}); "
            "calibrate with more samples, or --weight-algo rtn / awq"
        ) from None
    start = 0
    for m, w in zip(g.modules, ws):
        n = w.shape[0]
        out[m] = _to_cpu(FP4Tensor(q.fmt, q.codes[start : start + n], q.scales[start : start + n], q.global_scale))
        start += n


def record(fmt: str, rounding, out: dict, fallback: dict, damp: float = DAMP, order: str = ORDER) -> dict:
    """calibration.json's record of a GPTQ run that quantized `out`."""
    f = registry.get(fmt)
    how = {
        "activation": f"block scales fixed first from the weights (blocks of {f.block}), then input columns by decreasing Hessian diagonal",
        "block": f"input columns in order, block scales chosen at each block's first column (blocks of {f.block})",
    }[order]
    return {
        "name": "gptq",
        "gptq_file": FILE,
        "format": f.name,
        "mx_scale_rounding": ScaleRounding(rounding).value if f.has_rounding else None,
        "damp": damp,
        "gptq_order": order,
        "order": how,
        "hessian": "sum of x^T x over the valid calibration tokens at each group's input, the model in full precision",
        "quantized": len(out),
        "rounded_to_nearest": fallback,
    }


def _to_cpu(q: FP4Tensor) -> FP4Tensor:
    """`q` in CPU memory of its own (a member's rows are a view of its group's result)."""
    g = None if q.global_scale is None else q.global_scale.to("cpu", copy=True)
    return FP4Tensor(q.fmt, q.codes.to("cpu", copy=True), q.scales.to("cpu", copy=True), g)


# ----------------------------------------------------------------------------- the stored result

_CODES, _SCALES, _ALPHA = "gptq_codes", "gptq_scales", "gptq_alpha"


def save(weights: dict[str, FP4Tensor], path) -> None:
    """Write GPTQ's quantized tensors (codes, block scales and NVFP4's α per linear)."""
    tensors = {}
    for m, q in weights.items():
        # copies: a fused group's members share one α tensor, which safetensors refuses to store twice
        tensors[f"{m}.{_CODES}"] = q.codes.contiguous().clone()
        tensors[f"{m}.{_SCALES}"] = q.scales.contiguous().clone()
        if q.global_scale is not None:
            tensors[f"{m}.{_ALPHA}"] = q.global_scale.reshape(()).float().clone()
    fmt = next(iter(weights.values())).fmt if weights else ""
    save_file(tensors, str(path), metadata={"resserve_gptq": "1", "format": fmt})


class Stored:
    """A calibration's GPTQ tensors, read one linear at a time (`get`)."""

    def __init__(self, path: Path, fmt: str):
        self.path, self.fmt = Path(path), fmt
        try:
            self._file = safe_open(str(self.path), framework="pt")
            self._names = set(self._file.keys())
        except (SafetensorError, OSError) as e:
            raise UserError(f"{self.path} is not a readable safetensors file ({e}): re-run calibrate") from None
        self.modules = sorted(n[: -len(_CODES) - 1] for n in self._names if n.endswith(f".{_CODES}"))

    def __contains__(self, module: str) -> bool:
        return f"{module}.{_CODES}" in self._names

    def get(self, module: str, shape: tuple[int, int] | None = None) -> FP4Tensor | None:
        """The GPTQ tensor of `module` (None when the calibration has none), checked against the
        linear's weight `shape` ``(N, K)`` when given."""
        if module not in self:
            return None
        f = registry.get(self.fmt)
        try:
            codes = self._file.get_tensor(f"{module}.{_CODES}")
            scales = self._file.get_tensor(f"{module}.{_SCALES}")
            alpha = self._file.get_tensor(f"{module}.{_ALPHA}") if f.has_tensor_scale else None
        except (SafetensorError, OSError) as e:
            raise UserError(f"{self.path.name}: cannot read the GPTQ tensors of {module} ({e}): re-run calibrate") from None
        if shape is not None:
            N, K = shape
            if tuple(codes.shape) != (N, K // 2) or tuple(scales.shape) != (N, K // f.block) or scales.dtype != f.scale_torch_dtype:
                raise UserError(
                    f"{self.path.name}: the GPTQ tensors of {module} do not fit its weight {tuple(shape)} in {f.name}: "
                    "pack the model the calibration was made from, in the format it was calibrated for"
                )
        return FP4Tensor(f.name, codes, scales, alpha)


def from_calibration(calib, record: dict) -> Stored | None:
    """The GPTQ tensors a calibration directory recorded (None without GPTQ)."""
    algo = record.get("weight_algo") or {"name": "rtn"}
    if "gptq" not in str(algo.get("name", "rtn")).split("+"):
        return None
    path = Path(calib) / (algo.get("gptq_file") or FILE)
    if not path.is_file():
        raise UserError(f"{calib} records GPTQ weights but has no {path.name}: re-run calibrate")
    return Stored(path, algo.get("format") or "")


__all__ = [
    "DAMP", "FILE", "HESSIAN_BYTES", "ORDER", "ORDERS", "SingularHessian", "Stored", "from_calibration", "inverse_factor", "quantize_group",
    "quantize_model", "record", "save", "solve",
]
