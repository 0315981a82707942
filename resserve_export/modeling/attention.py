"""Attention layers of a model: which modules they are (from checkpoint headers or the loaded
model), and a transformers cache that lets an observer see every key and value update."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import torch

from resserve_export.core.errors import UserError
from resserve_export.core.names import natural_key
from resserve_export.modeling.families import is_exact

# transformers (3 to 5 s to import after torch, python -X importtime) is imported where the
# observing cache is built: `size` and `inspect` read attention modules from headers alone.


def attention_modules(shapes: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """Attention modules of a checkpoint from its headers: those with 2-D ``k_proj`` and
    ``v_proj`` weights (model order), outside the parts that stay exact (a vision tower's
    attention has no KV cache)."""

    out = []
    for name, (_, shape) in shapes.items():
        m = _ATTN.match(name)
        if m and not is_exact(name) and len(shape) == 2 and len(shapes.get(f"{m['attn']}.v_proj.weight", ("", ()))[1]) == 2:
            out.append(m["attn"])
    return sorted(out, key=natural_key)


def layer_names(model) -> dict[int, str]:
    """``{layer_idx: module name}`` of the loaded model's attention layers (the index the cache
    is updated with), outside the parts that stay exact (a vision tower's attention layers number
    themselves too, but write no KV cache)."""
    out: dict[int, str] = {}
    for name, mod in model.named_modules():
        if is_exact(name):
            continue
        idx = getattr(mod, "layer_idx", None)
        if isinstance(idx, int) and hasattr(mod, "k_proj") and hasattr(mod, "v_proj"):
            if idx in out:
                raise UserError(f"attention layers {out[idx]} and {name} share cache index {idx}: KV-cache statistics cannot tell them apart")
            out[idx] = name
    return out


def observing_cache(
    model, on_kv: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], store: bool = True
):
    """A fresh `DynamicCache` whose ``update(k, v, layer_idx)`` first calls ``on_kv(layer_idx, k, v)``
    and caches (and hands to attention) what it returns. ``store=False``: for one forward pass
    that never reads the cache back (calibration), nothing is kept, attention gets the update's
    keys and values as they are."""
    from transformers import DynamicCache

    class ObservingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            key_states, value_states = on_kv(layer_idx, key_states, value_states)
            if not store:
                return key_states, value_states
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    try:
        return ObservingCache(config=model.config)
    except (TypeError, ValueError, AttributeError):
        return ObservingCache()


def cache_kwargs(model, cache) -> dict:
    """Forward arguments that make `model` use `cache` (transformers names it ``cache`` since
    5.x, ``past_key_values`` before)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}


_ATTN = re.compile(r"^(?P<attn>.+)\.k_proj\.weight$")
