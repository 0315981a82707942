"""Input Hessians of quantized linears, ``H = Σ xᵀx`` over the valid (non-padding) tokens, taken by
forward pre-hooks on one member of each fused group (the members share the input, so one H).

An expert's linear under `modeling.experts.unfused` sees only the valid tokens routed to it; any
other linear sees the batch's tokens, of which the padding rows are dropped here.
"""

from __future__ import annotations

import torch

from resserve_export.core.errors import UserError
from resserve_export.modeling.hooks import Observer


class HessianCollector(Observer):
    """Forward pre-hooks accumulating ``Σ xᵀx`` (float32, on the input's device) and the number of
    rows per group head. `heads`: the first member of each group whose Hessian is wanted."""

    def __init__(self, model, heads: list[str]):
        super().__init__()
        mods = dict(model.named_modules())
        self.h: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {h: 0 for h in heads}
        for head in heads:
            if head not in mods:
                raise UserError(f"linear {head} is not in the model: the weights and the architecture do not match")
            self.pre_hook(mods[head], self._hook(head))

    def _hook(self, head: str):
        def hook(_mod, args):
            x = args[0].detach()
            x2 = x.reshape(-1, x.shape[-1])
            if self.valid is not None and x2.shape[0] == self.valid.numel() and not bool(self.valid.all()):
                x2 = x2[self.valid.to(x2.device)]
            if not x2.shape[0]:
                return
            xf = x2.float()
            if not bool(torch.isfinite(xf).all()):
                raise UserError(
                    f"non-finite (NaN/Inf) activations reach {head}: the model's weights or dtype overflow; try --dtype float32 or check the checkpoint"
                )
            acc = self.h.get(head)
            if acc is None:
                acc = self.h[head] = torch.zeros((xf.shape[1], xf.shape[1]), dtype=torch.float32, device=xf.device)
            acc.addmm_(xf.t(), xf)
            self.rows[head] += int(xf.shape[0])

        return hook

    def take(self, head: str) -> tuple[torch.Tensor | None, int]:
        """(Σ xᵀx or None when no row reached it, row count) of `head`, dropped from the collector."""
        return self.h.pop(head, None), self.rows.pop(head, 0)


__all__ = ["HessianCollector"]
