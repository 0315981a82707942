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


# On a GPU one forward pass holds a whole batch's activations; the widest are an MLP's
# [rows, intermediate] tensors, about four of them alive at once (gate and up projections, the
# activation and their product). A batch whose four would pass this many bytes runs as
# micro-batches of whole samples (`data.micro_batches`), in both calibration pipelines alike, so
# that a layer's working memory stays a fraction of the hidden states the sequential pipeline keeps.
GPU_ACTIVATION_BYTES = 256 << 20


def micro_batch_rows(config: dict, itemsize: int, device) -> int | None:
    """The most token rows one forward pass of a model with `config` (config.json's dict; a
    vision-language wrapper's ``text_config`` is used) runs on `device`, activations of
    `itemsize` bytes; None (no limit) on a CPU, whose memory a batch's activations barely dent."""
    if torch.device(device).type != "cuda":
        return None
    text = config.get("text_config") or config
    width = int(text.get("intermediate_size") or 4 * int(text.get("hidden_size") or 0))
    if width <= 0:
        return None
    return max(1, GPU_ACTIVATION_BYTES // (4 * width * itemsize))
