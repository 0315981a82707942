"""Per-expert activation statistics of mixture-of-experts layers, taken inside a grouped forward."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from resserve_export.core.errors import UserError
from resserve_export.modeling.experts import MOE_CALIB, ExpertBlock, biases, fused_modules, gated
from resserve_export.modeling.hooks import Observer
from resserve_export.observers import banded, segment_stats
from resserve_export.observers.finite import finite_each

# Rows of sorted (token, expert) pairs reduced at a time into per-expert statistics (bounds the
# float32 temporaries: 65,536 rows of a 4,096-wide input are 1 GiB).
STATS_ROWS = 1 << 16
# Bytes of the gate/up products that ``--moe-calib all`` holds at a time (experts per batched GEMM).
EXPERT_CHUNK_BYTES = 1 << 30


def _grouped_mm(x, w, offs):
    """``x`` (rows sorted by expert) times each expert's ``w[e]ᵀ`` (``w`` [E, out, in]): torch's
    grouped GEMM where it exists, else one GEMM per expert."""

    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is not None:
        try:
            return fn(x, w.transpose(-2, -1), offs=offs)
        except (RuntimeError, NotImplementedError):
            pass
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[e].t())
        start = end
    return torch.cat(out)


def _segment_stats(rows, weight, lengths, acc_sum, acc_amax) -> None:
    """Add Σ|row|·weight (into float64 ``acc_sum`` [E, K]) and fold max|row|·weight into
    ``acc_amax`` [E], for consecutive segments of rows, one per expert: ``lengths`` (a list, or
    the per-expert row counts as a tensor). ``weight``: 1 for a valid token's row, 0 for padding.

    On a GPU the sums are one float64 product of the (weighted) one-hot segment matrix with
    |rows| per chunk of rows: deterministic and exact for bf16 / fp16 rows, where
    ``torch.segment_reduce`` runs a serial loop per column. On the CPU each segment is reduced in
    float32 (``segment_reduce``), which is the faster there."""

    if rows.device.type != "cpu":
        _segment_stats_gemm(rows, weight, lengths, acc_sum, acc_amax)
        return
    if torch.is_tensor(lengths):
        lengths = lengths.tolist()
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    e0, r0 = 0, 0
    while e0 < len(lengths):
        e1, r1 = e0, r0
        while e1 < len(lengths) and (e1 == e0 or r1 - r0 + lengths[e1] <= STATS_ROWS):
            r1 += lengths[e1]
            e1 += 1
        lens = torch.tensor(lengths[e0:e1], device=rows.device)
        a = rows[r0:r1].abs().to(acc) * weight[r0:r1, None].to(acc)
        acc_sum[e0:e1] += torch.segment_reduce(a, "sum", lengths=lens, axis=0, initial=0)
        peak = torch.segment_reduce(a.amax(1) if a.shape[0] else a.new_zeros(0), "max", lengths=lens, initial=0)
        acc_amax[e0:e1] = torch.maximum(acc_amax[e0:e1], peak.float())
        e0, r0 = e1, r1


def _segment_stats_gemm(rows, weight, lengths, acc_sum, acc_amax) -> None:

    E, dev = acc_sum.shape[0], rows.device
    counts = lengths if torch.is_tensor(lengths) else torch.tensor(lengths)
    owner = torch.repeat_interleave(torch.arange(E, device=dev), counts.to(dev), output_size=rows.shape[0])
    for r0 in range(0, rows.shape[0], STATS_ROWS):
        r1 = min(r0 + STATS_ROWS, rows.shape[0])
        a = rows[r0:r1].abs()
        w = weight[r0:r1].to(torch.float64)
        onehot = torch.zeros(E, r1 - r0, dtype=torch.float64, device=dev)
        onehot[owner[r0:r1], torch.arange(r1 - r0, device=dev)] = w
        acc_sum += onehot @ a.to(torch.float64)
        peak = torch.zeros(E, dtype=torch.float32, device=dev).scatter_reduce_(0, owner[r0:r1], a.amax(1).float() * w.float(), "amax")
        acc_amax.copy_(torch.maximum(acc_amax, peak))


def every_expert_stats(mod, x, acc_sum, acc_amax, chunk_bytes: int = EXPERT_CHUNK_BYTES, scales=None, acc_in=None) -> None:
    """``--moe-calib all``: Σ|act(gate)·up| and its amax for every expert on every row of ``x``,
    the experts taken `chunk_bytes` of products at a time, each chunk's gate/up products one batched
    GEMM over its experts (one launch, not one per expert). On a GPU the bf16 / fp16 sums are
    exact per exponent band (`banded`: the same in any order, and the plain float64 sum wherever
    that one is exact), taken with Triton in one pass over the products for ``F.silu`` experts
    (act·up is then never written); float32 sums are one float64 reduction per expert. On the CPU
    each expert's rows go through `_segment_stats`, whose float32 reduction fixes the order.

    With `scales` (``[rows, E]``; experts whose routing weight scales their input, Llama 4) expert
    e reads ``x · scales[:, e]``, rounded to x's dtype as the model's forward rounds it, and the
    statistics of those inputs go to `acc_in` (``(Σ|x| [E, H], amax [E])``)."""

    w = mod.gate_up_proj  # [E, 2I, H]
    gate_up_bias = biases(mod)[0]
    E, n = w.shape[0], x.shape[0]
    # bf16 / fp16 on a GPU with Triton: silu(gate)·up reduced as it is computed (`banded`)
    fused = x.dtype in banded.EXACT_DTYPES and _plain_silu(mod) and banded.available(x.device)
    per_expert = max(1, n * w.shape[1] * (1 if fused else 2) * x.element_size())  # the gate/up product (and act·up)
    if scales is not None:
        per_expert += n * x.shape[1] * x.element_size()  # the expert's scaled input
    step = max(1, min(E, chunk_bytes // per_expert))
    # cuBLAS picks another algorithm for a batched float32 GEMM than for one expert's (outputs
    # differ in the last bits, measured on an H200); in bf16 / fp16 both agree. Float32 on a GPU
    # keeps one GEMM per expert so that its statistics stay those of the per-expert loop.
    exact_per_expert = x.device.type == "cuda" and x.dtype == torch.float32
    ones = torch.ones(n, dtype=torch.bool, device=x.device)
    seg = torch.full((1,), n, dtype=torch.int64, device=x.device)
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        xe = x
        if scales is not None:
            xe = x.unsqueeze(0) * scales[:, e0:e1].t().unsqueeze(-1).to(x.dtype)  # [experts, rows, H]
            _rows_stats(xe, ones, seg, acc_in[0][e0:e1], acc_in[1][e0:e1])
        if exact_per_expert:  # written in place: a stacked copy would hold the chunk twice
            prod = x.new_empty((e1 - e0, n, w.shape[1]))
            for c in range(e1 - e0):
                torch.matmul(xe if scales is None else xe[c], w[e0 + c].t(), out=prod[c])
        else:
            prod = torch.matmul(xe, w[e0:e1].transpose(-2, -1))
        if gate_up_bias is not None:
            prod += gate_up_bias[e0:e1, None, :].to(prod.dtype)
        if fused and banded.silu_stats(prod, acc_sum[e0:e1], acc_amax[e0:e1]):
            continue  # act·up's statistics straight from the products, act·up never in memory
        gate, up = prod.chunk(2, dim=-1)
        h = gated(mod, gate, up)  # [experts, rows, I]
        _rows_stats(h, ones, seg, acc_sum[e0:e1], acc_amax[e0:e1])


def _plain_silu(mod) -> bool:
    """Whether the experts compute ``F.silu(gate) · up`` (no clamped GLU of their own)."""
    act = getattr(mod, "act_fn", None)
    if getattr(mod, "glu", None) is not None or act is None:
        return False
    return act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _rows_stats(h, ones, seg, acc_sum, acc_amax) -> None:
    """Σ|h| and amax over the rows of each expert's ``h[c]`` (``[experts, rows, width]``) into
    ``acc_sum[c]`` / ``acc_amax[c]``, as `every_expert_stats` takes them on the device: bf16 /
    fp16 sums exact per exponent band (`banded`), the same with the Triton kernel as without."""
    if h.device.type == "cpu":
        for c in range(h.shape[0]):
            _segment_stats(h[c], ones, seg, acc_sum[c : c + 1], acc_amax[c : c + 1])
        return
    if h.dtype in banded.EXACT_DTYPES:
        if banded.available(h.device):
            banded.abs_stats(h, acc_sum, acc_amax)
            return
        acc_sum += banded.exact_abs_sums(h)
    else:
        acc_sum += torch.linalg.vector_norm(h, ord=1, dim=1, dtype=torch.float64)
    peak = torch.linalg.vector_norm(h, ord=float("inf"), dim=(1, 2)).float()
    acc_amax.copy_(torch.maximum(acc_amax, peak))


def _install(mod, forward) -> tuple[str, object]:
    """Make `forward` the module's computation. Under accelerate's offloading hooks (device_map
    with CPU / disk offload) the hook's wrapper stays in front: it brings the weights to the
    execution device, then calls ``_old_forward``, which is what gets replaced."""
    name = "_old_forward" if hasattr(mod, "_hf_hook") and "_old_forward" in mod.__dict__ else "forward"
    previous = mod.__dict__.get(name)
    mod.__dict__[name] = forward
    return name, previous


def _uninstall(mod, installed: tuple[str, object] | None) -> None:
    if installed is None:
        return
    name, previous = installed
    if previous is None:
        mod.__dict__.pop(name, None)
    else:
        mod.__dict__[name] = previous


@dataclass(frozen=True)
class _Routed:
    """One grouped forward of an experts module: the (token, slot) pairs sorted by expert, the
    rows each expert read (``xs``) and produced in the middle (``h``, ``act(gate) · up``), and the
    module's output."""

    ids: torch.Tensor  # expert of each (token, slot) pair, in (token, slot) order
    ids_sorted: torch.Tensor
    token: torch.Tensor  # the token of each sorted pair
    counts: torch.Tensor  # rows per expert
    offs: torch.Tensor  # their running sum (int32, the grouped GEMM's offsets)
    xs: torch.Tensor
    h: torch.Tensor
    out: torch.Tensor
    on_input: bool


def _grouped_forward(mod, hidden_states, top_k_index, top_k_weights, E: int) -> _Routed:
    """The experts' output as transformers' ``grouped_mm`` experts compute it: rows sorted by
    expert, one grouped GEMM per projection; the routing weight scales the output, or the input
    where the module says ``weights_on_input`` (Llama 4)."""

    T, k, dev = hidden_states.shape[0], top_k_index.shape[-1], hidden_states.device
    on_input = getattr(mod, "weights_on_input", False)
    ids = top_k_index.reshape(-1)
    ids_sorted, perm = torch.sort(ids, stable=True)
    token = perm // k
    # per-expert row counts without a device sync (bincount reads the maximum back to
    # the host: once per layer, that stalls the launch queue of a GPU forward)
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    offs = counts.cumsum(0).to(torch.int32)
    xs = hidden_states[token]
    slot_w = top_k_weights.reshape(-1)[perm, None]
    if on_input:
        xs = xs * slot_w.to(xs.dtype)
    gate_up = _grouped_mm(xs, mod.gate_up_proj, offs)
    gate_up_bias, down_bias = biases(mod)  # gpt-oss
    if gate_up_bias is not None:
        gate_up = gate_up + gate_up_bias[ids_sorted].to(gate_up.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    h = gated(mod, gate, up)
    y = _grouped_mm(h, mod.down_proj, offs)
    if down_bias is not None:
        y = y + down_bias[ids_sorted].to(y.dtype)
    if not on_input:
        y = y * slot_w
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0], device=dev)
    # back to (token, slot) order by a gather (a scatter of the rows runs ~5x slower on a GPU)
    out = y[inv].view(T, k, -1).sum(1).to(hidden_states.dtype)  # a fixed order: deterministic
    return _Routed(ids, ids_sorted, token, counts, offs, xs, h, out, on_input)


def _count_routed(r: _Routed, keep, acc: dict) -> None:
    """Add the valid tokens routed to each expert (`keep`: validity of each sorted pair's token)."""
    acc["routed"] += torch.zeros_like(acc["routed"]).index_add_(0, r.ids_sorted, keep.long())


class ExpertCollector(Observer):
    """Per-expert Σ|x| (float64), amax and token counts over the valid (non-padding) tokens, for
    every fused experts module of the model. While installed, each module's forward is replaced
    by a grouped one (rows sorted by expert, one grouped GEMM per projection, as transformers'
    default ``grouped_mm`` experts compute) that also takes the statistics: gate/up inputs are
    the routed hidden rows, down inputs ``act(gate) · up`` as computed for the output."""

    def __init__(self, model, blocks: list[ExpertBlock], mode: str = "all"):
        if mode not in MOE_CALIB:
            raise UserError(f"--moe-calib must be one of {', '.join(MOE_CALIB)}, got {mode!r}")
        super().__init__()
        self.blocks = blocks
        self.mode = mode
        self._modules = fused_modules(model, blocks)
        self._valid_on: dict = {}
        self._acc: dict[str, dict] = {b.prefix: {} for b in blocks}
        self._previous = {b.prefix: _install(self._modules[b.prefix], self._forward(self._modules[b.prefix], b, self._acc[b.prefix])) for b in blocks}

    def remove(self) -> None:
        for prefix, mod in self._modules.items():
            _uninstall(mod, self._previous.pop(prefix, None))
        super().remove()

    def set_mask(self, attention_mask) -> None:
        super().set_mask(attention_mask)
        self._valid_on = {}  # the mask per device, copied once per batch, not once per layer

    def _valid_at(self, dev, index: bool = False):
        """The batch's valid-token mask (or, with `index`, the valid tokens' indices) on `dev`."""

        key = (dev, index)
        v = self._valid_on.get(key)
        if v is None:
            v = self._valid_on[key] = (torch.nonzero(self.valid).reshape(-1) if index else self.valid).to(dev)
        return v

    @staticmethod
    def _init(acc: dict, b: ExpertBlock, device) -> None:

        E = b.num_experts
        acc.update(
            routed=torch.zeros(E, dtype=torch.int64, device=device),
            rows=torch.zeros(E, dtype=torch.int64, device=device),
            sum_in=torch.zeros(E, b.hidden, dtype=torch.float64, device=device),
            amax_in=torch.zeros(E, dtype=torch.float32, device=device),
            sum_mid=torch.zeros(E, b.intermediate, dtype=torch.float64, device=device),
            amax_mid=torch.zeros(E, dtype=torch.float32, device=device),
        )

    def _forward(self, mod, b: ExpertBlock, acc: dict):
        """The grouped forward installed on `mod`: its output as the model computes it, and the
        statistics of the batch's valid tokens taken on the way."""

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            if self.valid is None:
                raise RuntimeError("ExpertCollector.set_mask() must be called before each forward pass")
            T, E = hidden_states.shape[0], b.num_experts
            dev = hidden_states.device
            if self.valid.numel() != T:
                raise UserError(
                    f"the experts see {T} rows, not the batch's {self.valid.numel()} tokens: padding cannot be "
                    "excluded for them; this architecture's layout is not supported"
                )
            if not acc:
                self._init(acc, b, dev)
            with torch.no_grad():
                r = _grouped_forward(mod, hidden_states, top_k_index, top_k_weights, E)
                if self.mode == "routed":
                    self._routed_stats(r, acc, hidden_states, top_k_index, E)
                else:
                    self._every_expert_stats(r, mod, b, acc, hidden_states)
            return r.out

        return forward

    def _routed_stats(self, r: _Routed, acc: dict, hidden_states, top_k_index, E: int) -> None:
        """``--moe-calib routed``: each expert's statistics over the valid tokens routed to it."""

        dev = hidden_states.device
        valid = self._valid_at(dev)
        keep = valid[r.token]
        if segment_stats.available(dev):
            # one pass per statistic over the rows sorted by expert (gate/up: the gathered
            # token rows; down: act(gate)·up), the routed-token count taken with the first
            segment_stats.segment_stats(r.xs, keep, r.offs, acc["sum_in"], acc["amax_in"], acc["routed"])
            segment_stats.segment_stats(r.h, keep, r.offs, acc["sum_mid"], acc["amax_mid"])
            return
        _count_routed(r, keep, acc)
        if r.on_input:
            # gate/up read the token rows scaled by their weight: the sorted rows themselves
            _segment_stats(r.xs, keep, r.counts, acc["sum_in"], acc["amax_in"])
        else:
            # gate/up read the token rows themselves: Σ|x| per expert is one product of the
            # (valid) routing matrix with |x|, in float64 (exact for bf16 / fp16 inputs)
            k = top_k_index.shape[-1]
            routing = torch.zeros(hidden_states.shape[0], E, dtype=torch.float64, device=dev)
            routing.scatter_(1, top_k_index, 1.0)
            routing *= valid[:, None]
            a = hidden_states.abs()
            acc["sum_in"] += routing.t() @ a.to(torch.float64)
            row_max = a.amax(1).float() * valid
            peak = torch.zeros(E, dtype=torch.float32, device=dev).scatter_reduce_(0, r.ids, row_max.repeat_interleave(k), "amax")
            acc["amax_in"].copy_(torch.maximum(acc["amax_in"], peak))
        _segment_stats(r.h, keep, r.counts, acc["sum_mid"], acc["amax_mid"])

    def _every_expert_stats(self, r: _Routed, mod, b: ExpertBlock, acc: dict, hidden_states) -> None:
        """``--moe-calib all``: every expert on every valid token, for its statistics only (the
        routed-token counts still go to the record)."""

        dev = hidden_states.device
        _count_routed(r, self._valid_at(dev)[r.token], acc)
        idx = self._valid_at(dev, index=True)
        everyone = hidden_states.index_select(0, idx)
        n = idx.shape[0]
        acc["rows"] += n
        if r.on_input:  # each expert's input: every token scaled by its score for that expert
            scores = mod.router_scores.index_select(0, idx)
            every_expert_stats(mod, everyone, acc["sum_mid"], acc["amax_mid"], scales=scores, acc_in=(acc["sum_in"], acc["amax_in"]))
            return
        ones = torch.ones(n, dtype=torch.bool, device=dev)
        seg = torch.full((1,), n, dtype=torch.int64, device=dev)  # made on the device: no host copy, no sync
        one = torch.zeros(1, b.hidden, dtype=torch.float64, device=dev)
        peak = torch.zeros(1, dtype=torch.float32, device=dev)
        _segment_stats(everyone, ones, seg, one, peak)
        acc["sum_in"] += one
        acc["amax_in"].copy_(torch.maximum(acc["amax_in"], peak))
        every_expert_stats(mod, everyone, acc["sum_mid"], acc["amax_mid"])

    def end_batch(self) -> None:
        """Stop at the first expert block whose activations hold NaN/Inf."""

        super().end_batch()
        self._valid_on = {}
        ran = [b for b in self.blocks if self._acc[b.prefix]]
        finite = finite_each([t for b in ran for t in (self._acc[b.prefix]["amax_in"], self._acc[b.prefix]["amax_mid"])])
        for i, b in enumerate(ran):
            if not (finite[2 * i] and finite[2 * i + 1]):
                raise UserError(
                    f"non-finite (NaN/Inf) activations reach the experts of {b.prefix}: the model's weights or dtype overflow; "
                    "try --dtype float32 or check the checkpoint"
                )

    def result(self) -> tuple[dict[str, dict], dict]:
        """(salience ``{module: {"mean_abs", "amax"}}`` under checkpoint names, calibration.json's
        ``moe`` record: mode, routed-token counts per expert, experts that took the fallback)."""

        stats: dict[str, dict] = {}
        record = {"calib": self.mode, "blocks": {}}
        fallbacks = []
        for b in self.blocks:
            a = self._acc[b.prefix]
            if not a:
                raise UserError(f"the experts of {b.prefix} never ran in the forward pass: they cannot be calibrated")
            rows = (a["rows"] if self.mode == "all" else a["routed"]).cpu()  # routed: the rows are the routed tokens
            seen = rows > 0
            if not bool(seen.any()):
                raise UserError(f"no expert of {b.prefix} saw a calibration token: use more samples or --moe-calib all")
            missing = [int(e) for e in torch.nonzero(~seen).reshape(-1)]
            per = {}
            for key in ("in", "mid"):
                total, amax = a["sum_" + key].cpu(), a["amax_" + key].cpu().clone()
                mean = total / rows.clamp_min(1)[:, None]
                if missing:  # the fallback: Σ|x| / Σ tokens over the experts that saw tokens, and their max amax
                    mean[~seen] = total[seen].sum(0) / rows[seen].sum()
                    amax[~seen] = amax[seen].max()
                per[key] = (mean.to(torch.float32).numpy(), amax.to(torch.float32).numpy())
            # one tensor of its own per module (safetensors refuses tensors that share storage),
            # copied through numpy: a torch clone per tensor costs twice as much, for ~18k of them
            # on a 48-layer model of 128 experts
            gate, up, down = b.leaves
            (m_in, a_in), (m_mid, a_mid) = per["in"], per["mid"]
            new = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
            for e in range(b.num_experts):
                stem = f"{b.prefix}.{e}."
                stats[stem + gate] = {"mean_abs": new(m_in[e]), "amax": new(a_in[e])}
                stats[stem + up] = {"mean_abs": new(m_in[e]), "amax": new(a_in[e])}
                stats[stem + down] = {"mean_abs": new(m_mid[e]), "amax": new(a_mid[e])}
            fallbacks += [f"{b.prefix}.{e}" for e in missing]
            record["blocks"][b.prefix] = {"experts": b.num_experts, "routed_tokens": a["routed"].cpu().tolist(), "fallback": missing}
        record["fallback_rule"] = "pooled statistics of the layer's experts that saw tokens (sum |x| / sum tokens, max amax)"
        self.fallbacks = fallbacks
        return stats, record
