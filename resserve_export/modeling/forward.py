"""How a loaded model is run for calibration and evaluation: where inputs go, and the forward
arguments that skip the KV cache and all but the last position's logits."""

from __future__ import annotations

import inspect

import torch


def forward_kwargs(model) -> dict:
    """Extra forward arguments: no KV cache, and logits of the last position only (lm_head is not quantized)."""

    kw = {"use_cache": False}
    try:
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            kw["logits_to_keep"] = 1
    except (TypeError, ValueError):
        pass
    return kw


def input_device(model):
    """Where input ids go: the embedding's device (accelerate moves them on when offloading)."""

    emb = model.get_input_embeddings()
    dev = emb.weight.device if emb is not None else next(model.parameters()).device
    return torch.device("cpu") if dev.type == "meta" else dev
