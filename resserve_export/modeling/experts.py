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

import inspect
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from resserve_export.core.errors import UserError
from resserve_export.core.names import layer_index, natural_key
from resserve_export.modeling.families import check_tensors
from resserve_export.modeling.groups import is_quantized, linears_from_shapes
from resserve_export.modeling.hooks import Observer

MOE_CALIB = ("all", "routed")
# Checkpoint leaf names of an expert's projections, by role.
ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>[A-Za-z0-9_]+)\.weight$")


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
        return layer_index(self.prefix)

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
    quantized completely: tensors the family adapters refuse or do not know
    (`families.check_tensors`: experts fused on disk, unknown 3-D layouts), experts whose
    projections are not gate / up / down, or experts of differing shapes."""

    check_tensors(shapes, doing)
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


def gated(mod, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The input of an expert's down projection from its gate and up outputs, as the fused
    experts module `mod` computes it: ``act(gate) · up``, or its own `glu` where it has one
    (gpt-oss's clamped SwiGLU)."""
    glu = getattr(mod, "glu", None)
    return glu(gate, up) if glu is not None else mod.act_fn(gate) * up


def biases(mod) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gate/up biases ``[E, 2I]`` in ``gate_up_proj``'s row order, down biases ``[E, H]``) of a
    fused experts module with biases (gpt-oss), else (None, None)."""
    return getattr(mod, "gate_up_bias", None), getattr(mod, "down_bias", None)


def fused_modules(model, blocks: list[ExpertBlock]) -> dict[str, object]:
    """``{block prefix: the loaded model's fused experts module}``, matched by decoder layer and
    checked against the checkpoint's shapes; a layout this tool cannot hook is refused."""
    return {p: mod for p, (_, mod) in fused_paths(model, blocks).items()}


def fused_paths(model, blocks: list[ExpertBlock]) -> dict[str, tuple[str, object]]:
    """``{block prefix: (module path, module)}`` of `fused_modules`."""


    by_layer: dict[int, list[tuple[str, object]]] = {}
    per_expert_linears = []
    for name, mod in model.named_modules():
        gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if isinstance(gu, torch.nn.Parameter) and isinstance(dn, torch.nn.Parameter) and gu.dim() == 3:
            layer = layer_index(name)
            by_layer.setdefault(-1 if layer is None else layer, []).append((name, mod))
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
    fused = fused_paths(model, [b for b in blocks if mounted[b.prefix] is None]) if None in mounted.values() else {}
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


# --- per-expert linears (verify) -------------------------------------------------------------


def _unfused_module(fused, block: ExpertBlock):

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
            gub, db = biases(fused)
            for e in range(block.num_experts):
                expert = torch.nn.Module()
                bs = (None, None, None) if gub is None else (gub[e, :I], gub[e, I:], db[e])
                for leaf, w, b in zip(block.leaves, (fused.gate_up_proj[e, :I], fused.gate_up_proj[e, I:], fused.down_proj[e]), bs):
                    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta", dtype=w.dtype)
                    lin.weight = torch.nn.Parameter(w.detach(), requires_grad=False)
                    if b is not None:
                        lin.bias = torch.nn.Parameter(b.detach(), requires_grad=False)
                    setattr(expert, leaf, lin)
                self.add_module(str(e), expert)

        def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            gate, up, down = block.leaves
            on_input = getattr(fused, "weights_on_input", False)  # Llama 4: the weight scales the input
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
                w = top_k_weights[token_idx, top_k_pos, None]
                if on_input:
                    x = x * w.to(x.dtype)
                y = getattr(ex, down)(gated(fused, getattr(ex, gate)(x), getattr(ex, up)(x)))
                final.index_add_(0, token_idx, (y if on_input else y * w).to(final.dtype))
            return final

    return UnfusedExperts()


class _Call:
    """A plain (non-module) stand-in for a fused experts module that calls the unfused one
    mounted at the checkpoint's path (Mixtral: ``block_sparse_moe.experts``, not ``mlp.experts``)."""

    def __init__(self, target):
        self.target = target

    def __call__(self, *args, **kwargs):
        return self.target(*args, **kwargs)


class Unfused(Observer):
    """`unfused`'s handle: :meth:`set_mask` before a forward pass whose expert inputs are
    captured (padding rows are then routed to no expert), :meth:`end_batch` after; `blocks`: the
    expert blocks it mounted. The mount itself is undone by `unfused` on leaving its block."""

    def __init__(self, modules: list, blocks: list[ExpertBlock]):
        super().__init__()
        self.modules = modules
        self.blocks = blocks

    def set_mask(self, attention_mask) -> None:
        super().set_mask(attention_mask)
        for m in self.modules:
            m.valid = self.valid

    def end_batch(self) -> None:
        super().end_batch()
        for m in self.modules:
            m.valid = None


@contextmanager
def unfused(model, blocks: list[ExpertBlock]):
    """The model's fused experts as per-expert linears at the checkpoint's module paths, for the
    duration of the block (so that everything keyed by linear module path — weight checks, input
    capture, emulated linears — treats experts like any other linear). Yields an `Unfused`."""

    undo = []
    mounted = []
    try:
        by_prefix = {b.prefix: b for b in blocks}
        for prefix, (name, fused) in fused_paths(model, blocks).items():
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
