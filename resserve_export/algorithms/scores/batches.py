"""The token batches the scores run on: where they go, which sequences, which tokens count.

`take` keeps the first n sequences on the model's device (`device_of`) and trims columns that
are padding in every row; `valid_tokens` is the mask of the tokens that count. Both score methods and
`evaluate_kls` read their batches through these, so padding is handled in one place (padding
never counts: KL is averaged over positions with attention_mask = 1, and the grad loss ignores
padded targets).
"""

from __future__ import annotations

import torch
from torch import nn


def device_of(model: nn.Module) -> torch.device:
    emb = model.get_input_embeddings()
    dev = emb.weight.device if emb is not None else next(model.parameters()).device
    return torch.device("cpu") if dev.type == "meta" else dev


def take(batches: list[dict], n: int | None, device: torch.device) -> list[dict]:
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



def valid_tokens(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    return (mask if mask is not None else torch.ones_like(ids)).bool()
