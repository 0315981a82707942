"""Input capture: the valid-token rows one member of each fused group sees, kept on the CPU."""

from __future__ import annotations

import torch
from resserve_export.modeling.hooks import Observer


class InputCapture(Observer):
    """Forward pre-hooks keeping the valid-token rows of one member's input per fused group."""

    def __init__(self, model, groups: list[tuple[str, ...]], max_tokens: int):
        super().__init__()
        mods = dict(model.named_modules())
        self.rows: dict[tuple[str, ...], list[torch.Tensor]] = {g: [] for g in groups}
        self.count = {g: 0 for g in groups}
        self.max_tokens = max_tokens
        for g in groups:
            self.pre_hook(mods[g[0]], self._hook(g))

    def _hook(self, g):
        def hook(_mod, args):
            if self.count[g] >= self.max_tokens:
                return
            x = args[0]
            x2 = x.reshape(-1, x.shape[-1])
            # An expert's linear sees only the valid rows routed to it (`experts.unfused`).
            if self.valid is not None and x2.shape[0] == self.valid.numel():
                x2 = x2[self.valid.to(x2.device)]
            x2 = x2[: self.max_tokens - self.count[g]].detach().to("cpu", copy=True)
            self.rows[g].append(x2)
            self.count[g] += x2.shape[0]

        return hook

    def inputs(self, g) -> torch.Tensor:
        return torch.cat(self.rows[g])
