"""KV-cache quantization: what attention layers store, its calibrated amax, the scales a
checkpoint carries for it, and the quantize-dequantize that emulates it.

The observation point is the cache itself: a `DynamicCache` whose ``update`` sees each
attention layer's keys and values exactly as a serving engine stores them (keys after the
k-norm and the rotary embedding, values after ``v_proj``, before any head repetition).
`calibrate` records per layer amax(|k|) and amax(|v|) over the valid (non-padding) tokens;
`pack --kv-cache fp8|nvfp4` writes ``k_scale = k_amax / 448`` and ``v_scale = v_amax / 448``;
`verify` quantizes the cached keys and values with the stored scales in attention.

Scales. vLLM quantizes a cached key as ``k / k_scale`` and dequantizes by multiplying with
``k_scale``. FP8 (E4M3): ``k_scale = amax / 448`` maps the calibrated amax to E4M3's largest
finite value (values beyond it saturate). NVFP4 KV uses the same scale, ``amax / 448``: that is
ModelOpt's convention (``modelopt/torch/export/unified_export_hf.py``: "We define kv cache scale
as amax / 448 for both FP8 and NVFP4 KV cache quantization", applied in
``quant_utils.postprocess_state_dict``). The cache then holds ``k / k_scale`` in NVFP4 blocks of
16 along the head dimension, each with an E4M3 block scale (block amax / 6), i.e. NVFP4 with
the tensor scale α = ``k_scale``.

Tensor names follow the checkpoint format's producer: ModelOpt writes
``….self_attn.k_proj.k_scale`` / ``….self_attn.v_proj.v_scale`` (0-d float32),
compressed-tensors ``….self_attn.k_scale`` / ``….self_attn.v_scale`` (shape [1], float32); vLLM
maps both onto its attention layers' ``attn.k_scale`` / ``attn.v_scale``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import torch

from resserve_export.core.errors import UserError

KINDS = ("none", "fp8", "nvfp4")
FP8_MAX = 448.0  # E4M3's largest finite value
SCALE_DIVISOR = 448.0  # scale = amax / 448, for FP8 and NVFP4 alike (ModelOpt's convention)
NVFP4_KV_BLOCK = 16
FILE = "kv_cache.safetensors"
POINT = "keys after k-norm and rotary embedding, values after v_proj, as the KV cache stores them"
_ATTN = re.compile(r"^(?P<attn>.+)\.k_proj\.weight$")


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UserError(f"unknown --kv-cache {kind!r}: choose one of {', '.join(KINDS)}")
    return kind


def check_for_format(kind: str, fmt) -> str:
    """`kind` checked, and supported by checkpoint format `fmt` (its loaders read those scales);
    a one-line `UserError` otherwise."""
    from resserve_export.formats import registry

    f = registry.get(fmt)
    try:
        f.check_kv(check_kind(kind))
    except ValueError as e:
        raise UserError(f"{e} (what their vLLM loader reads): choose --kv-cache {' or '.join(f.kv_kinds)}, or --format nvfp4") from None
    return kind


# ----------------------------------------------------------------------------- layers and names


def attention_modules(shapes: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """Attention modules of a checkpoint from its headers: those with 2-D ``k_proj`` and
    ``v_proj`` weights (model order)."""
    from resserve_export.storage.checkpoint import natural_key

    out = []
    for name, (_, shape) in shapes.items():
        m = _ATTN.match(name)
        if m and len(shape) == 2 and len(shapes.get(f"{m['attn']}.v_proj.weight", ("", ()))[1]) == 2:
            out.append(m["attn"])
    return sorted(out, key=natural_key)


def layer_names(model) -> dict[int, str]:
    """``{layer_idx: module name}`` of the loaded model's attention layers (the index the cache
    is updated with)."""
    out: dict[int, str] = {}
    for name, mod in model.named_modules():
        idx = getattr(mod, "layer_idx", None)
        if isinstance(idx, int) and hasattr(mod, "k_proj") and hasattr(mod, "v_proj"):
            if idx in out:
                raise UserError(f"attention layers {out[idx]} and {name} share cache index {idx}: KV-cache statistics cannot tell them apart")
            out[idx] = name
    return out


def scale_names(attn: str, style: str) -> tuple[str, str]:
    """(k_scale name, v_scale name) of attention module `attn` in a checkpoint: ``style`` is
    ``"modelopt"`` or ``"compressed-tensors"``."""
    if style == "modelopt":
        return f"{attn}.k_proj.k_scale", f"{attn}.v_proj.v_scale"
    return f"{attn}.k_scale", f"{attn}.v_scale"


def scale_shape(style: str) -> tuple[int, ...]:
    return () if style == "modelopt" else (1,)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The stored KV scale (float32) of a calibrated amax: amax / 448."""
    return (torch.as_tensor(amax, dtype=torch.float32).reshape(()) / SCALE_DIVISOR).float()


# ----------------------------------------------------------------------------- arithmetic


def qdq(x: torch.Tensor, scale: torch.Tensor | float, kind: str) -> torch.Tensor:
    """Keys or values `x` (last dim = head dim) after the KV cache's quantize-dequantize with
    the per-tensor `scale`, in x's dtype. FP8: E4M3 of ``x / scale`` (round to nearest even,
    saturating at ±448). NVFP4: NVFP4 blocks of 16 along the head dim with α = scale."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    if kind == "fp8":
        q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (q.float() * s).to(x.dtype)
    if kind == "nvfp4":
        from resserve_export.formats import nvfp4

        if x.shape[-1] % NVFP4_KV_BLOCK:
            raise UserError(f"head dimension {x.shape[-1]} is not a multiple of {NVFP4_KV_BLOCK}: NVFP4 KV cache needs one")
        blocks = x.float().reshape(-1, NVFP4_KV_BLOCK)
        codes, scales = nvfp4.quantize_blocks(blocks, s)
        return nvfp4.dequantize_blocks(codes, scales, s).reshape(x.shape).to(x.dtype)
    raise ValueError(f"unknown KV-cache format {kind!r}")


# ----------------------------------------------------------------------------- the observing cache


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


class KVCollector:
    """amax(|k|) and amax(|v|) per attention layer over valid tokens, from the cache updates.

    Call :meth:`set_mask` with each batch's attention mask, pass :meth:`forward_kwargs` to the
    forward pass, then :meth:`end_batch`.
    """

    def __init__(self, model):
        self.names = layer_names(model)
        # Why statistics cannot be recorded for this model (None while they can).
        self.problem: str | None = None if self.names else "the model has no attention layers with k_proj / v_proj"
        self._model = model
        self._mask: torch.Tensor | None = None
        self._all_valid = False
        self._on_device: dict = {}
        self._amax: dict[int, list[torch.Tensor]] = {}

    def set_mask(self, attention_mask: torch.Tensor) -> None:
        self._mask = attention_mask.detach().to("cpu").bool()
        self._all_valid = bool(self._mask.all())
        self._on_device = {}

    def forward_kwargs(self) -> dict:
        return cache_kwargs(self._model, observing_cache(self._model, self._observe, store=False))

    def _valid(self, device) -> torch.Tensor:
        m = self._on_device.get(device)
        if m is None:
            m = self._on_device[device] = self._mask.to(device)
        return m

    def _observe(self, idx: int, k: torch.Tensor, v: torch.Tensor):
        if self.problem is not None:
            return k, v
        m = self._mask
        if idx not in self.names:
            self.problem = f"the cache was updated for layer {idx}, which is not an attention layer with k_proj / v_proj"
            return k, v
        if m is None or k.dim() != 4 or v.shape[:3] != k.shape[:3] or (k.shape[0], k.shape[2]) != tuple(m.shape):
            self.problem = f"{self.names[idx]} caches keys of shape {tuple(k.shape)}, not [batch, kv heads, tokens, head dim]"
            return k, v
        with torch.no_grad():
            got = []
            for t in (k, v):
                t = t.detach()
                if self._all_valid:  # |x| and max fused, no temporary
                    got.append(torch.linalg.vector_norm(t, float("inf")).float())
                else:
                    per_token = torch.linalg.vector_norm(t, float("inf"), dim=(1, 3))  # [B, T], no |t| temporary
                    got.append(per_token.masked_fill(~self._valid(t.device), 0).amax().float())
            acc = self._amax.get(idx)
            self._amax[idx] = got if acc is None else [torch.maximum(a, b) for a, b in zip(acc, got)]
        return k, v

    def end_batch(self) -> None:
        self._mask = None

    def state(self) -> dict:
        """The running maxima so far, on the CPU (a resume point of the sequential pipeline)."""
        return {"amax": {i: [a.detach().to("cpu", copy=True) for a in kv] for i, kv in self._amax.items()}, "problem": self.problem}

    def restore(self, state: dict, device) -> None:
        self._amax = {i: [a.to(device) for a in kv] for i, kv in state["amax"].items()}
        self.problem = state["problem"]

    def result(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """``{attention module: {"k_amax": 0-d float32, "v_amax": 0-d float32}}`` (CPU), or None
        when they cannot be recorded for this model (`problem` says why)."""
        missing = [n for i, n in self.names.items() if i not in self._amax]
        if missing and self.problem is None:
            self.problem = f"attention layer {missing[0]} never updated the KV cache"
        if self.problem is not None:
            return None
        out = {}
        for i, name in sorted(self.names.items()):
            k, v = (a.to("cpu", torch.float32).reshape(()) for a in self._amax[i])
            for which, a in (("k", k), ("v", v)):
                if not bool(torch.isfinite(a)):
                    raise UserError(f"non-finite (NaN/Inf) {'keys' if which == 'k' else 'values'} reach the KV cache of {name}: try --dtype float32")
            out[name] = {"k_amax": k, "v_amax": v}
        return out


class KVQuantizer:
    """The KV cache's quantize-dequantize with stored per-layer scales, as attention sees it.

    ``emulate=True``: attention reads the quantize-dequantized keys and values (perplexity with
    a quantized KV cache). ``emulate=False``: attention reads the originals and the error is
    measured: per layer Σ(qdq(x) − x)² and Σx² over valid tokens accumulate in float64
    (`nmse`).
    """

    def __init__(self, model, scales: dict[str, tuple[torch.Tensor, torch.Tensor]], kind: str, *, emulate: bool):
        self.names = layer_names(model)
        lacking = [n for n in self.names.values() if n not in scales]
        if lacking:
            raise UserError(f"the checkpoint has no KV-cache scales for {lacking[0]}: re-run pack with --kv-cache {kind} on this model")
        self._model = model
        self.scales = scales
        self.kind = kind
        self.emulate = emulate
        self._mask: torch.Tensor | None = None
        self.err: dict[str, list[float]] = {n: [0.0, 0.0] for n in self.names.values()}
        self.ref: dict[str, list[float]] = {n: [0.0, 0.0] for n in self.names.values()}

    def forward_kwargs(self, attention_mask: torch.Tensor) -> dict:
        self._mask = attention_mask.detach().to("cpu").bool()
        return cache_kwargs(self._model, observing_cache(self._model, self._observe))

    def _observe(self, idx: int, k: torch.Tensor, v: torch.Tensor):
        name = self.names[idx]
        if self.emulate:
            kq, vq = (qdq(x, s, self.kind) for x, s in zip((k, v), self.scales[name]))
            return kq, vq
        valid = None
        if self._mask is not None and k.dim() == 4 and (k.shape[0], k.shape[2]) == tuple(self._mask.shape):
            valid = self._mask.to(k.device)[:, None, :, None]
        with torch.no_grad():
            for j, (x, s) in enumerate(zip((k, v), self.scales[name])):
                xf = x.detach().double()
                d2, r2 = (qdq(x, s, self.kind).detach().double() - xf).square(), xf.square()
                if valid is not None:
                    d2, r2 = d2.masked_fill(~valid, 0), r2.masked_fill(~valid, 0)
                self.err[name][j] += float(d2.sum())
                self.ref[name][j] += float(r2.sum())
        return k, v

    def nmse(self) -> dict:
        """``{"pooled": {"k", "v"}, "layers": [{"module", "k_scale", "v_scale", "k", "v"}]}``."""
        if self.emulate:
            raise ValueError("an emulating KVQuantizer measures nothing: use emulate=False for the NMSE")

        def ratio(e: float, r: float) -> float:
            return e / r if r > 0 else float("nan")

        layers = []
        for i, n in sorted(self.names.items()):
            ks, vs = self.scales[n]
            layers.append({"module": n, "k_scale": float(ks), "v_scale": float(vs), "k": ratio(self.err[n][0], self.ref[n][0]), "v": ratio(self.err[n][1], self.ref[n][1])})
        pooled = {
            w: ratio(sum(self.err[n][j] for n in self.err), sum(self.ref[n][j] for n in self.ref)) for j, w in enumerate(("k", "v"))
        }
        return {"pooled": pooled, "layers": layers}


def save(stats: dict[str, dict[str, torch.Tensor]], path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name in stats:
        tensors[f"{name}.k_amax"] = stats[name]["k_amax"].contiguous()
        tensors[f"{name}.v_amax"] = stats[name]["v_amax"].contiguous()
    save_file(dict(sorted(tensors.items())), str(path), metadata={"resserve_kv_cache": "1"})


def load(calib_dir, attention: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{attention module: (k_amax, v_amax)}`` from a calibration directory, for every module in
    `attention`; a one-line error when the calibration has none or lacks one, or an amax is not
    finite and positive."""
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(calib_dir) / FILE
    if not path.is_file():
        raise UserError(
            f"calibration in {calib_dir} has no KV-cache statistics ({FILE}): re-run `resserve-export calibrate` "
            "with this version, or pack with --kv-cache none"
        )
    try:
        t = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise UserError(f"{path} is not a readable safetensors file ({e}): re-run calibrate") from None
    out = {}
    for a in attention:
        k, v = t.get(f"{a}.k_amax"), t.get(f"{a}.v_amax")
        if k is None or v is None:
            raise UserError(f"calibration in {calib_dir} has no KV-cache statistics for {a}: re-run calibrate on this model")
        k, v = k.float().reshape(()), v.float().reshape(())
        for x in (k, v):
            if not bool(torch.isfinite(x)) or float(x) <= 0:
                raise UserError(f"calibration in {calib_dir} has KV amax {float(x)} for {a}: a KV scale must be finite and positive; re-run calibrate")
        out[a] = (k, v)
    return out


__all__ = [
    "KINDS", "FILE", "POINT", "SCALE_DIVISOR", "KVCollector", "KVQuantizer", "attention_modules", "layer_names", "scale_names",
    "scale_shape", "scale_from_amax", "qdq", "observing_cache", "cache_kwargs", "check_kind", "check_for_format", "save", "load",
]
