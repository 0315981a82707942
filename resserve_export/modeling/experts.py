"""Mixture-of-experts blocks: which checkpoint tensors are experts, how they map onto the loaded
model, and the calibration hooks that see each expert's input rows.

Checkpoints name experts per expert (``model.layers.L.mlp.experts.E.gate_proj.weight``,
Mixtral's ``…block_sparse_moe.experts.E.w1.weight``); transformers 5 loads them as fused 3-D
parameters of one module per layer (``gate_up_proj`` ``[E, 2I, H]``, gate rows first, and
``down_proj`` ``[E, H, I]``) whose forward takes ``(hidden_states, top_k_index, top_k_weights)``.
Everything this tool writes (salience keys, decision groups, checkpoint tensors, sidecar) uses the
checkpoint's per-expert names; only the calibration hooks know the fused layout.

Per expert, gate and up read the same rows (one decision group: one mask, one ``weight_scale_2``,
as vLLM fuses them into w13) and down reads ``act(gate) * up``. Routers stay unquantized.

Calibration (`ExpertCollector`) runs each layer's experts as one grouped GEMM per projection over
the (token, expert) rows sorted by expert, as transformers' default experts implementation does,
and takes statistics inside it: ``routed`` takes each expert's statistics over the tokens the
router sends it; ``all`` (the default) runs every expert on every calibration token for its
statistics while the model's output keeps the true routing, so rarely routed experts still get
scales from real activations. Either way the routed-token count per expert is recorded. An
expert that saw no token (``routed`` only) takes the pooled statistics of its layer's experts:
mean |x| = Σ|x| / Σ tokens over the experts that saw tokens, amax = their maximum; a warning
names it.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

from resserve_export.core.errors import UserError

MOE_CALIB = ("all", "routed")
# Checkpoint leaf names of an expert's projections, by role.
ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>[A-Za-z0-9_]+)\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertBlock:
    """One layer's experts as the checkpoint names them."""

    prefix: str  # "model.layers.3.mlp.experts"
    num_experts: int
    leaves: tuple[str, str, str]  # checkpoint leaf names of (gate, up, down)
    hidden: int
    intermediate: int

    @property
    def layer(self) -> int | None:
        m = _LAYER.search(self.prefix + ".")
        return int(m.group(1)) if m else None

    def module(self, e: int, role: str) -> str:
        return f"{self.prefix}.{e}.{self.leaves[('gate', 'up', 'down').index(role)]}"

    def linears(self) -> dict[str, tuple[int, int]]:
        """``{module: (out_features, in_features)}`` of every expert projection, expert by expert."""
        out = {}
        for e in range(self.num_experts):
            out[self.module(e, "gate")] = (self.intermediate, self.hidden)
            out[self.module(e, "up")] = (self.intermediate, self.hidden)
            out[self.module(e, "down")] = (self.hidden, self.intermediate)
        return out


def _refuse(what: str, doing: str) -> UserError:
    return UserError(f"{what}: this mixture-of-experts layout is not supported; nothing was {doing}")


def expert_blocks(shapes: dict[str, tuple[str, tuple[int, ...]]], doing: str = "done") -> list[ExpertBlock]:
    """The expert blocks of a checkpoint from its headers, refusing any layout that cannot be
    quantized completely: fused expert tensors on disk (gpt-oss), other 3-D weights, experts
    whose projections are not gate / up / down, or experts of differing shapes."""
    from resserve_export.storage.checkpoint import natural_key

    fused = sorted((n for n, (_, s) in shapes.items() if len(s) >= 3), key=natural_key)
    if fused:
        raise _refuse(
            f"{fused[0]} is a {len(shapes[fused[0]][1])}-D tensor (fused expert weights as gpt-oss stores them, with their biases)",
            doing,
        )
    found: dict[str, dict[int, dict[str, tuple[str, tuple[int, ...]]]]] = {}
    for n, (dtype, shape) in shapes.items():
        m = _EXPERT_WEIGHT.match(n)
        if m:
            found.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["leaf"]] = (dtype, tuple(shape))
    blocks = []
    for prefix in sorted(found, key=natural_key):
        experts = found[prefix]
        E = len(experts)
        if sorted(experts) != list(range(E)):
            raise _refuse(f"{prefix} numbers its experts {sorted(experts)[:4]}…, not 0..{E - 1}", doing)
        leaves = set(experts[0])
        roles = {ROLES.get(x) for x in leaves}
        if roles != {"gate", "up", "down"} or len(leaves) != 3:
            raise _refuse(f"{prefix}.0 holds {', '.join(sorted(leaves))}, not gate / up / down projections", doing)
        by_role = {ROLES[x]: x for x in leaves}
        gate, up, down = (by_role[r] for r in ("gate", "up", "down"))
        I, H = experts[0][gate][1]
        for e, projs in experts.items():
            want = {gate: (I, H), up: (I, H), down: (H, I)}
            got = {x: s for x, (_, s) in projs.items()}
            if got != want:
                raise _refuse(f"{prefix}.{e} has projections {got}, unlike expert 0's {want}", doing)
        blocks.append(ExpertBlock(prefix, E, (gate, up, down), H, I))
    return blocks


def routers(shapes: dict[str, tuple[str, tuple[int, ...]]], blocks: list[ExpertBlock]) -> list[str]:
    """The linears of a mixture-of-experts checkpoint that stay unquantized besides ``lm_head``:
    its routers (``mlp.gate``, ``block_sparse_moe.gate``) and gates such as Qwen2-MoE's
    ``shared_expert_gate`` — named in the quantization config so that no loader quantizes them."""
    from resserve_export.storage.checkpoint import natural_key
    from resserve_export.modeling.groups import is_quantized, linears_from_shapes

    if not blocks:
        return []
    return sorted((m for m in linears_from_shapes(shapes) if not is_quantized(m) and m != "lm_head"), key=natural_key)


def is_expert(module: str) -> bool:
    return _EXPERT_WEIGHT.match(module + ".weight") is not None


def expert_parts(module: str) -> tuple[str, int, str] | None:
    """(block prefix, expert index, role) of a routed expert's linear, else None."""
    m = _EXPERT_WEIGHT.match(module + ".weight")
    if m is None or m["leaf"] not in ROLES:
        return None
    return m["prefix"], int(m["e"]), "down" if ROLES[m["leaf"]] == "down" else "gate/up"


# --- the loaded model ------------------------------------------------------------------------


def fused_modules(model, blocks: list[ExpertBlock]) -> dict[str, object]:
    """``{block prefix: the loaded model's fused experts module}``, matched by decoder layer and
    checked against the checkpoint's shapes; a layout this tool cannot hook is refused."""
    return {p: mod for p, (_, mod) in _fused(model, blocks).items()}


def _fused(model, blocks: list[ExpertBlock]) -> dict[str, tuple[str, object]]:
    """``{block prefix: (module path, module)}`` of `fused_modules`."""
    import inspect

    import torch

    by_layer: dict[int, list[tuple[str, object]]] = {}
    per_expert_linears = []
    for name, mod in model.named_modules():
        gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if isinstance(gu, torch.nn.Parameter) and isinstance(dn, torch.nn.Parameter) and gu.dim() == 3:
            m = _LAYER.search(name + ".")
            by_layer.setdefault(int(m.group(1)) if m else -1, []).append((name, mod))
        elif isinstance(mod, torch.nn.Linear) and is_expert(name):
            per_expert_linears.append(name)
    if per_expert_linears:
        raise UserError(
            f"the loaded model holds experts as separate linears ({per_expert_linears[0]}), which calibration cannot "
            "attribute to routed tokens; load it with transformers >= 5 (fused experts)"
        )
    out = {}
    for b in blocks:
        cands = by_layer.get(b.layer if b.layer is not None else -1, [])
        if len(cands) != 1:
            raise UserError(f"found {len(cands)} fused expert modules for {b.prefix} in the loaded model: its layout is not supported")
        name, mod = cands[0]
        E, H, I = b.num_experts, b.hidden, b.intermediate
        if tuple(mod.gate_up_proj.shape) != (E, 2 * I, H) or tuple(mod.down_proj.shape) != (E, H, I):
            raise UserError(
                f"{name} holds gate_up_proj {tuple(mod.gate_up_proj.shape)} and down_proj {tuple(mod.down_proj.shape)}, not "
                f"[{E}, {2 * I}, {H}] and [{E}, {H}, {I}] as the checkpoint's experts imply: its layout is not supported"
            )
        params = list(inspect.signature(mod.forward).parameters)
        if params[:3] != ["hidden_states", "top_k_index", "top_k_weights"] or not hasattr(mod, "act_fn"):
            raise UserError(f"{name}.forward{tuple(params)} is not the experts interface this tool hooks")
        out[b.prefix] = (name, mod)
    return out


def checkpoint_parameters(model, blocks: list[ExpertBlock]) -> dict[str, object]:
    """The loaded model's parameters under the checkpoint's tensor names, as tensors sharing their
    storage (writing into one changes the model): every parameter under its own name; each
    expert's projection (``…experts.E.gate_proj.weight``) as its slice of the fused
    ``gate_up_proj`` / ``down_proj`` (or, while `unfused` is mounted, as the per-expert linear's
    weight, itself such a slice); and the block's other tensors (routers, shared experts) also under
    the checkpoint's block path where the model's differs (Mixtral: ``block_sparse_moe`` on disk,
    ``mlp`` loaded)."""
    named = {n: p.detach() for n, p in model.named_parameters()}
    out = dict(named)
    if not blocks:
        return out
    mods = dict(model.named_modules())
    mounted = {b.prefix: getattr(mods.get(b.prefix), "fused_path", None) for b in blocks}
    fused = _fused(model, [b for b in blocks if mounted[b.prefix] is None]) if None in mounted.values() else {}
    for b in blocks:
        if b.prefix in fused:
            path, mod = fused[b.prefix]
            gu, dn, I = mod.gate_up_proj.detach(), mod.down_proj.detach(), b.intermediate
            for e in range(b.num_experts):
                out[f"{b.module(e, 'gate')}.weight"] = gu[e, :I]
                out[f"{b.module(e, 'up')}.weight"] = gu[e, I:]
                out[f"{b.module(e, 'down')}.weight"] = dn[e]
        else:
            path = mounted[b.prefix]
        model_parent, ckpt_parent = path.rpartition(".")[0], b.prefix.rpartition(".")[0]
        if model_parent != ckpt_parent:
            for n, t in named.items():
                if n.startswith(model_parent + ".") and not n.startswith(path + "."):
                    out[ckpt_parent + n[len(model_parent) :]] = t
    return out


# Rows of sorted (token, expert) pairs reduced at a time into per-expert statistics (bounds the
# float32 temporaries: 65,536 rows of a 4,096-wide input are 1 GiB).
STATS_ROWS = 1 << 16


def _grouped_mm(x, w, offs):
    """``x`` (rows sorted by expert) times each expert's ``w[e]ᵀ`` (``w`` [E, out, in]): torch's
    grouped GEMM where it exists, else one GEMM per expert."""
    import torch
    from torch.nn import functional as F

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
    import torch

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
    import torch

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


class ExpertCollector:
    """Per-expert Σ|x| (float64), amax and token counts over the valid (non-padding) tokens, for
    every fused experts module of the model. While installed, each module's forward is replaced
    by a grouped one (rows sorted by expert, one grouped GEMM per projection, as transformers'
    default ``grouped_mm`` experts compute) that also takes the statistics: gate/up inputs are
    the routed hidden rows, down inputs ``act(gate) · up`` as computed for the output."""

    def __init__(self, model, blocks: list[ExpertBlock], mode: str = "all"):
        if mode not in MOE_CALIB:
            raise UserError(f"--moe-calib must be one of {', '.join(MOE_CALIB)}, got {mode!r}")
        self.blocks = blocks
        self.mode = mode
        self._modules = fused_modules(model, blocks)
        self._valid = None
        self._valid_on: dict = {}
        self._acc: dict[str, dict] = {b.prefix: {} for b in blocks}
        self._previous = {b.prefix: _install(self._modules[b.prefix], self._forward(self._modules[b.prefix], b, self._acc[b.prefix])) for b in blocks}

    def __enter__(self) -> ExpertCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for prefix, mod in self._modules.items():
            _uninstall(mod, self._previous.pop(prefix, None))

    def set_mask(self, attention_mask) -> None:
        self._valid = attention_mask.detach().reshape(-1).to("cpu").bool()
        self._valid_on = {}  # the mask per device, copied once per batch, not once per layer

    def _valid_at(self, dev, index: bool = False):
        """The batch's valid-token mask (or, with `index`, the valid tokens' indices) on `dev`."""
        import torch

        key = (dev, index)
        v = self._valid_on.get(key)
        if v is None:
            v = self._valid_on[key] = (torch.nonzero(self._valid).reshape(-1) if index else self._valid).to(dev)
        return v

    @staticmethod
    def _init(acc: dict, b: ExpertBlock, device) -> None:
        import torch

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
        import torch

        from resserve_export.observers import segment_stats

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            if self._valid is None:
                raise RuntimeError("ExpertCollector.set_mask() must be called before each forward pass")
            T, k, E = hidden_states.shape[0], top_k_index.shape[-1], b.num_experts
            dev = hidden_states.device
            if self._valid.numel() != T:
                raise UserError(
                    f"the experts see {T} rows, not the batch's {self._valid.numel()} tokens: padding cannot be "
                    "excluded for them; this architecture's layout is not supported"
                )
            if not acc:
                self._init(acc, b, dev)
            valid = self._valid_at(dev)
            with torch.no_grad():
                ids = top_k_index.reshape(-1)
                ids_sorted, perm = torch.sort(ids, stable=True)
                token = perm // k
                # per-expert row counts without a device sync (bincount reads the maximum back to
                # the host: once per layer, that stalls the launch queue of a GPU forward)
                counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
                offs = counts.cumsum(0).to(torch.int32)
                xs = hidden_states[token]
                gate, up = _grouped_mm(xs, mod.gate_up_proj, offs).chunk(2, dim=-1)
                h = mod.act_fn(gate) * up
                y = _grouped_mm(h, mod.down_proj, offs) * top_k_weights.reshape(-1)[perm, None]
                inv = torch.empty_like(perm)
                inv[perm] = torch.arange(perm.shape[0], device=dev)
                # back to (token, slot) order by a gather (a scatter of the rows runs ~5x slower on a GPU)
                out = y[inv].view(T, k, -1).sum(1).to(hidden_states.dtype)  # a fixed order: deterministic

                keep = valid[token]
                if self.mode == "routed" and segment_stats.available(dev):
                    # one pass per statistic over the rows sorted by expert (gate/up: the gathered
                    # token rows; down: act(gate)·up), the routed-token count taken with the first
                    segment_stats.segment_stats(xs, keep, offs, acc["sum_in"], acc["amax_in"], acc["routed"])
                    segment_stats.segment_stats(h, keep, offs, acc["sum_mid"], acc["amax_mid"])
                    return out
                routed = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, ids_sorted, keep.long())
                acc["routed"] += routed
                if self.mode == "routed":
                    # gate/up read the token rows themselves: Σ|x| per expert is one product of the
                    # (valid) routing matrix with |x|, in float64 (exact for bf16 / fp16 inputs)
                    r = torch.zeros(T, E, dtype=torch.float64, device=dev)
                    r.scatter_(1, top_k_index, 1.0)
                    r *= valid[:, None]
                    a = hidden_states.abs()
                    acc["sum_in"] += r.t() @ a.to(torch.float64)
                    row_max = a.amax(1).float() * valid
                    peak = torch.zeros(E, dtype=torch.float32, device=dev).scatter_reduce_(0, ids, row_max.repeat_interleave(k), "amax")
                    acc["amax_in"].copy_(torch.maximum(acc["amax_in"], peak))
                    _segment_stats(h, keep, counts, acc["sum_mid"], acc["amax_mid"])
                else:
                    # every expert on every valid token, for its statistics only
                    idx = self._valid_at(dev, index=True)
                    everyone = hidden_states.index_select(0, idx)
                    n = idx.shape[0]
                    ones = torch.ones(n, dtype=torch.bool, device=dev)
                    seg = torch.full((1,), n, dtype=torch.int64, device=dev)  # made on the device: no host copy, no sync
                    one = torch.zeros(1, b.hidden, dtype=torch.float64, device=dev)
                    peak = torch.zeros(1, dtype=torch.float32, device=dev)
                    _segment_stats(everyone, ones, seg, one, peak)
                    acc["sum_in"] += one
                    acc["amax_in"].copy_(torch.maximum(acc["amax_in"], peak))
                    for e in range(E):
                        g_all, u_all = (everyone @ mod.gate_up_proj[e].t()).chunk(2, dim=-1)
                        _segment_stats(mod.act_fn(g_all) * u_all, ones, seg, acc["sum_mid"][e : e + 1], acc["amax_mid"][e : e + 1])
                    acc["rows"] += n
            return out

        return forward

    def end_batch(self) -> None:
        """Stop at the first expert block whose activations hold NaN/Inf."""
        from resserve_export.stages.calibrate.run import finite_each

        self._valid, self._valid_on = None, {}
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
        import numpy as np
        import torch

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


# --- per-expert linears (verify) -------------------------------------------------------------


def _unfused_module(fused, block: ExpertBlock):
    import torch

    class UnfusedExperts(torch.nn.Module):
        """One layer's experts as per-expert ``nn.Linear`` modules under the checkpoint's names
        (``E.gate_proj`` …), their weights views of the fused parameters. Routing as the fused
        module's eager loop; with `valid` set (the batch's flattened attention mask) padding rows
        are routed nowhere, so each linear sees only the valid tokens sent to its expert."""

        def __init__(self):
            super().__init__()
            self.act_fn = fused.act_fn
            self.valid = None
            I = block.intermediate
            for e in range(block.num_experts):
                expert = torch.nn.Module()
                for leaf, w in zip(block.leaves, (fused.gate_up_proj[e, :I], fused.gate_up_proj[e, I:], fused.down_proj[e])):
                    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
                    lin.weight = torch.nn.Parameter(w.detach(), requires_grad=False)
                    setattr(expert, leaf, lin)
                self.add_module(str(e), expert)

        def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            gate, up, down = block.leaves
            final = torch.zeros_like(hidden_states)
            valid = None if self.valid is None else self.valid.to(hidden_states.device)
            for e in range(block.num_experts):
                hit = top_k_index == e
                if valid is not None:
                    hit = hit & valid[:, None]
                top_k_pos, token_idx = torch.where(hit.t())
                if not token_idx.numel():
                    continue
                ex = getattr(self, str(e))
                x = hidden_states[token_idx]
                y = getattr(ex, down)(self.act_fn(getattr(ex, gate)(x)) * getattr(ex, up)(x))
                final.index_add_(0, token_idx, (y * top_k_weights[token_idx, top_k_pos, None]).to(final.dtype))
            return final

    return UnfusedExperts()


class _Call:
    """A plain (non-module) stand-in for a fused experts module that calls the unfused one
    mounted at the checkpoint's path (Mixtral: ``block_sparse_moe.experts``, not ``mlp.experts``)."""

    def __init__(self, target):
        self.target = target

    def __call__(self, *args, **kwargs):
        return self.target(*args, **kwargs)


class Unfused:
    """`unfused`'s handle: :meth:`set_mask` before a forward pass whose expert inputs are
    captured, :meth:`clear` after; `blocks`: the expert blocks it mounted."""

    def __init__(self, modules: list, blocks: list[ExpertBlock]):
        self.modules = modules
        self.blocks = blocks

    def set_mask(self, attention_mask) -> None:
        valid = attention_mask.detach().reshape(-1).to("cpu").bool()
        for m in self.modules:
            m.valid = valid

    def clear(self) -> None:
        for m in self.modules:
            m.valid = None


@contextmanager
def unfused(model, blocks: list[ExpertBlock]):
    """The model's fused experts as per-expert linears at the checkpoint's module paths, for the
    duration of the block (so that everything keyed by linear module path — weight checks, input
    capture, emulated linears — treats experts like any other linear). Yields an `Unfused`."""
    import torch

    undo = []
    mounted = []
    try:
        by_prefix = {b.prefix: b for b in blocks}
        for prefix, (name, fused) in _fused(model, blocks).items():
            b = by_prefix[prefix]
            if fused.gate_up_proj.device.type == "meta":
                raise UserError(
                    f"the experts of {prefix} are offloaded (the model does not fit the devices): scores and verify need them in "
                    "memory; use --scores none, or a device that holds the model"
                )
            u = _unfused_module(fused, b)
            u.fused_path = name  # where the fused module sits (`checkpoint_parameters` maps the block's other tensors)
            mounted.append(u)
            parent_path, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_path)
            if name == b.prefix:
                setattr(parent, leaf, u)
                undo.append(lambda p=parent, lf=leaf, m=fused: setattr(p, lf, m))
                continue
            # mount at the checkpoint's path, creating the missing holders
            node = model
            parts = b.prefix.split(".")
            for part in parts[:-1]:
                if not hasattr(node, part):
                    node.add_module(part, torch.nn.Module())
                    undo.append(lambda n=node, pt=part: delattr(n, pt))
                node = getattr(node, part)
            node.add_module(parts[-1], u)
            undo.append(lambda n=node, pt=parts[-1]: delattr(n, pt))
            del parent._modules[leaf]
            object.__setattr__(parent, leaf, _Call(u))
            undo.append(lambda p=parent, lf=leaf, m=fused: (object.__delattr__(p, lf), p.add_module(lf, m)))
        yield Unfused(mounted, list(blocks))
    finally:
        for f in reversed(undo):
            f()


__all__ = [
    "ExpertBlock", "ExpertCollector", "MOE_CALIB", "ROLES", "Unfused", "checkpoint_parameters", "expert_blocks", "expert_parts", "fused_modules",
    "is_expert", "routers", "unfused",
]
