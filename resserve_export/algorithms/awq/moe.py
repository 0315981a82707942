"""AWQ for mixture-of-experts layers: where their scales fold, and the rows they are searched on.

Every routed expert's gate/up, any shared expert's gate/up and the router (Qwen2-MoE: also its
``shared_expert_gate``) read the same output of the layer's norm before the MLP. Dividing that
norm by ``s`` therefore takes one ``s`` ``[hidden]`` for all of them (one `awq.Fold` whose
consumers are every expert's and the shared expert's decision groups): the quantized consumers'
columns are multiplied by ``s``, and so are the routers' (the fold's readers), which keeps the
router logits, and with them the routing, exact in real arithmetic. Routers stay unquantized in
the checkpoint's dtype, so only the storage rounding remains: the norm's ``w / s`` (the scales are
the ones the stored norm really applies, `awq.realized_norm_scales`) and the router's ``W · s``
each round once to bf16 (relative 2⁻⁹), which moves the logits by about that much; a token's
top-k experts can then change only where the original logits nearly tie.

Each expert's down_proj reads ``act(gate) · up`` of its own tokens: its own ``s``
``[intermediate]`` folds into that expert's up_proj rows, as for a dense MLP (and a shared
expert's likewise).

Search rows: the first ``--awq-tokens`` valid tokens reaching the layer's experts with the
router's top-k choice for each (`ExpertRows`, a pre-hook on the fused experts module of the
unsmoothed model). The gate/up objective is `awq.group_error` summed over every expert on the
tokens routed to it (what it computes when serving) plus any shared expert on every token, over
the summed references (pooled NMSE); each expert with its own weight tensor scale and with the
static activation scale of the amax the calibration records for it (``--moe-calib all``: over
every token; ``routed``: over its routed tokens). The candidates' mean |x| is over every search
token (the one input they share), mean |w| over every member's rows. An expert's down_proj is
searched on its routed tokens; an expert no search token was routed to keeps ``s = 1`` (its
fold recorded as unscaled), while its gate/up still take the layer's shared scales, which its
error simply does not weigh on.
"""

from __future__ import annotations

import torch

from resserve_export.algorithms.awq.fold import Fold
from resserve_export.algorithms.awq.search import Part
from resserve_export.core.errors import UserError
from resserve_export.modeling.experts import (
    ExpertBlock,
    expert_parts,
    fused_modules,
    fused_paths,
    routers,
)
from resserve_export.modeling.hooks import Observer


class MoELayers:
    """The mixture-of-experts layers of a loaded model: which decoder layer holds which block,
    and their folds (`folds`) under the checkpoint's names (`shapes`: its headers)."""

    def __init__(self, model, blocks: list[ExpertBlock], shapes: dict | None):
        if shapes is None:
            raise ValueError("the folds of mixture-of-experts layers need the checkpoint's tensor headers")
        self.blocks = blocks
        self._paths = {p: (path, mod) for p, (path, mod) in fused_paths(model, blocks).items()}
        for p, (_, mod) in self._paths.items():
            if getattr(mod, "weights_on_input", False):
                raise UserError(
                    f"AWQ does not support experts whose routing weight scales their input (Llama 4: {p}) yet: "
                    "calibrate without --weight-algo awq"
                )
        self._mods = dict(model.named_modules())
        self._routers = routers(shapes, blocks)

    def block_of(self, layer: str) -> ExpertBlock | None:
        """The expert block of the decoder layer at module path `layer`, if it has one."""
        return next((b for b in self.blocks if self._paths[b.prefix][0].startswith(layer + ".")), None)

    def folds(self, block: ExpertBlock, norm: str, norm_kind: str) -> tuple:
        """(the fold of `norm` into every expert's gate/up, the shared experts' and the routers,
        the down_proj folds: each expert's, then each shared expert's)."""

        path = self._paths[block.prefix][0]
        moe_path = path.rpartition(".")[0]
        shared = [
            f"{moe_path}.{n}" for n, child in self._mods[moe_path].named_children()
            if all(isinstance(getattr(child, x, None), torch.nn.Linear) for x in ("gate_proj", "up_proj", "down_proj"))
        ]
        consumers = [block.module(e, r) for e in range(block.num_experts) for r in ("gate", "up")]
        consumers += [f"{sh}.{x}" for sh in shared for x in ("gate_proj", "up_proj")]
        ckpt_parent = block.prefix.rpartition(".")[0]
        readers = tuple(r for r in self._routers if r.startswith(ckpt_parent + "."))
        gate_up = Fold(norm, norm_kind, tuple(consumers), readers=readers)
        downs = [Fold(block.module(e, "up"), "rows", (block.module(e, "down"),)) for e in range(block.num_experts)]
        downs += [Fold(f"{sh}.up_proj", "rows", (f"{sh}.down_proj",)) for sh in shared]
        return gate_up, downs


class ExpertRows(Observer):
    """Forward pre-hooks on the fused experts modules keeping, per block, the rows of the first
    `max_rows` valid (non-padding) tokens that reach them and the experts the router chose for
    each (`set_mask` before every forward pass)."""

    def __init__(self, model, blocks: list[ExpertBlock], max_rows: int):
        super().__init__()
        self.blocks = {b.prefix: b for b in blocks}
        self.modules = fused_modules(model, blocks)
        self.max_rows = max_rows
        self._x: dict[str, list] = {p: [] for p in self.modules}
        self._idx: dict[str, list] = {p: [] for p in self.modules}
        self.count = {p: 0 for p in self.modules}
        for p, mod in self.modules.items():
            self.pre_hook(mod, self._hook(p), with_kwargs=True)

    def _hook(self, prefix: str):
        def hook(_mod, args, kwargs):
            if self.count[prefix] >= self.max_rows:
                return
            hs = args[0] if args else kwargs["hidden_states"]
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            x = hs.detach().reshape(-1, hs.shape[-1])
            idx = idx.detach().reshape(x.shape[0], -1)
            if self.valid is None or self.valid.numel() != x.shape[0]:
                raise UserError(
                    f"the experts of {prefix} see {x.shape[0]} rows, not the batch's tokens: padding cannot be excluded for "
                    "them; this architecture's layout is not supported"
                )
            v = self.valid.to(x.device)
            n = self.max_rows - self.count[prefix]
            x, idx = x[v][:n], idx[v][:n]
            self._x[prefix].append(x.to("cpu", copy=True))
            self._idx[prefix].append(idx.to("cpu", copy=True))
            self.count[prefix] += x.shape[0]

        return hook

    def full(self) -> bool:
        return all(n >= self.max_rows for n in self.count.values())

    def tokens(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the search tokens' rows ``[N, hidden]``, their top-k expert indices ``[N, k]``)."""
        return torch.cat(self._x[prefix]), torch.cat(self._idx[prefix])

    def part(self, group: tuple[str, ...], weights: list[torch.Tensor], mode: str):
        """The search `awq.Part` of an expert's decision group (its gate/up, or its down_proj) on
        the tokens routed to it, or None when none was; the activation scale's amax over every
        search token with ``--moe-calib all`` (`mode`), as the calibration records it."""

        prefix, e, role = expert_parts(group[0])
        x, idx = self.tokens(prefix)
        routed = (idx == e).any(-1)
        if not bool(routed.any()):
            return None
        if role == "gate/up":
            return Part(x[routed], weights, x.abs().amax(0) if mode == "all" else None)
        mod = self.modules[prefix]
        w = mod.gate_up_proj[e].detach()

        def mid(rows: torch.Tensor) -> torch.Tensor:
            # act(gate) · up in the model's dtype, as the experts compute it
            with torch.no_grad():
                gate, up = (rows.to(w.device, w.dtype) @ w.t()).chunk(2, dim=-1)
                return mod.act_fn(gate) * up

        return Part(mid(x[routed]), weights, mid(x).abs().amax(0) if mode == "all" else None)

    def release(self, prefix: str) -> None:
        self._x[prefix], self._idx[prefix] = [], []


__all__ = ["ExpertRows", "MoELayers"]
