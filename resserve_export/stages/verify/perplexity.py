"""Perplexity of a model over token batches, and the model with its quantized linears emulated
from a checkpoint's stored tensors."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable

import torch

from resserve_export.algorithms.emulate import EmulatedLinear, QuantizedWeight, swapped
from resserve_export.core.errors import UserError
from resserve_export.formats import registry
from resserve_export.storage.checkpoint import Checkpoint


def nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[float, int]:
    """Summed next-token negative log-likelihood over valid positions, and their count."""
    lg = logits[:, :-1].float()
    labels = input_ids[:, 1:].to(lg.device)
    valid = (attention_mask[:, 1:] & attention_mask[:, :-1]).bool().to(lg.device)
    ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), reduction="none")
    return float(ce[valid.reshape(-1)].sum()), int(valid.sum())


def forward_nll(
    model, batches: list[dict], dev, on_batch: Callable | None = None, tick: Callable | None = None, kv=None
) -> float:
    """Perplexity over `batches`; `kv`: an `observers.kv.KVQuantizer` that sees (and with ``emulate``
    quantizes) the keys and values every attention layer caches."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for b in batches:
            if on_batch is not None:
                on_batch(b)
            extra = {"use_cache": False}
            if kv is not None:
                kv.set_mask(b["attention_mask"])
                extra = kv.forward_kwargs()
            out = model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev), **extra)
            s, n = nll(out.logits, b["input_ids"], b["attention_mask"])
            total, count = total + s, count + n
            if tick is not None:
                tick()
    if count == 0:
        raise UserError("the evaluation text has no token pairs to score: pass longer --text or more --samples")
    return math.exp(total / count)


def _emulated_linear(lin, pk, fmt: str, rounding: str, mode: str, cache: dict):
    """An `EmulatedLinear` for `lin` whose weights are the checkpoint's stored tensors.

    `EmulatedLinear` quantizes the bf16 weight itself; here its `QuantizedWeight` is the stored
    base and extension instead (`QuantizedWeight.from_stored`, dequantized once, shared by every
    mode through `cache`), so what is measured is what was packed.
    """
    dev = lin.weight.device
    ratio = pk.ratio if mode == "checkpoint" else 0.0
    partial = 0 < ratio < 1
    if "w" not in cache:
        cache["w"] = pk.base.dequantize().to(dev)
    if partial and "w_ext" not in cache:
        cache["w_ext"] = pk.ext.dequantize().to(dev)
    qw = QuantizedWeight.from_stored(
        fmt, ratio, rounding, pk.mask if partial else None, pk.base, cache["w"],
        pk.ext if partial else None, cache["w_ext"] if partial else None,
    )
    input_alpha = pk.input_scale.to(dev) if registry.get(fmt).has_tensor_scale else None
    return EmulatedLinear.from_weight(lin, qw, input_alpha=input_alpha, mode=None if mode == "checkpoint" else mode)


@contextmanager
def emulated(model, ck: Checkpoint, mode: str, packed: dict | None = None, cache: dict | None = None):
    """Replace every quantized linear by an emulated one (``plain``, ``checkpoint`` or ``full``)
    for the duration of the block (`emulate.swapped`)."""
    packed = packed if packed is not None else {m: ck.read(m) for m in ck.modules}
    cache = cache if cache is not None else {}
    swaps = {
        m: _emulated_linear(model.get_submodule(m), packed[m], ck.fmt, ck.rounding, mode, cache.setdefault(m, {}))
        for m in ck.modules
    }
    with swapped(model, swaps):
        yield model


__all__ = ["nll", "forward_nll", "emulated"]
