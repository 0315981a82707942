"""Input capture: the valid-token rows one member of each fused group sees, kept on the CPU."""

from __future__ import annotations

import torch


class InputCapture:
    """Forward pre-hooks keeping the valid-token rows of one member's input per fused group."""

    def __init__(self, model, groups: list[tuple[str, ...]], max_tokens: int):
        mods = dict(model.named_modules())
        self.rows: dict[tuple[str, ...], list[torch.Tensor]] = {g: [] for g in groups}
        self.count = {g: 0 for g in groups}
        self.max_tokens = max_tokens
        self._valid: torch.Tensor | None = None
        self._handles = [mods[g[0]].register_forward_pre_hook(self._hook(g)) for g in groups]

    def _hook(self, g):
        def hook(_mod, args):
            if self.count[g] >= self.max_tokens:
                return
            x = args[0]
            x2 = x.reshape(-1, x.shape[-1])
            # An expert's linear sees only the valid rows routed to it (`experts.unfused`).
            if self._valid is not None and x2.shape[0] == self._valid.numel():
                x2 = x2[self._valid.to(x2.device)]
            x2 = x2[: self.max_tokens - self.count[g]].detach().to("cpu", copy=True)
            self.rows[g].append(x2)
            self.count[g] += x2.shape[0]

        return hook

    def set_mask(self, attention_mask: torch.Tensor) -> None:
        self._valid = attention_mask.reshape(-1).bool()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def inputs(self, g) -> torch.Tensor:
        return torch.cat(self.rows[g])
