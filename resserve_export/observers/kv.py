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

import torch

from resserve_export.core.errors import UserError
from resserve_export.formats.kv import kv_qdq
from resserve_export.modeling.attention import cache_kwargs, layer_names, observing_cache
from resserve_export.modeling.hooks import Observer

POINT = "keys after k-norm and rotary embedding, values after v_proj, as the KV cache stores them"


# ----------------------------------------------------------------------------- layers and names


# ----------------------------------------------------------------------------- arithmetic


# ----------------------------------------------------------------------------- the observing cache


class KVCollector(Observer):
    """amax(|k|) and amax(|v|) per attention layer over valid tokens, from the cache updates.

    Call :meth:`set_mask` with each batch's attention mask, pass :meth:`forward_kwargs` to the
    forward pass, then :meth:`end_batch`.
    """

    def __init__(self, model):
        super().__init__()
        self.names = layer_names(model)
        # Why statistics cannot be recorded for this model (None while they can).
        self.problem: str | None = None if self.names else "the model has no attention layers with k_proj / v_proj"
        self._model = model
        self._mask: torch.Tensor | None = None
        self._all_valid = False
        self._on_device: dict = {}
        self._amax: dict[int, list[torch.Tensor]] = {}
        self.paused = False  # updates pass through unobserved while set (a second pass over a layer)

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
        if self.problem is not None or self.paused:
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
        super().end_batch()
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


class KVQuantizer(Observer):
    """The KV cache's quantize-dequantize with stored per-layer scales, as attention sees it.

    ``emulate=True``: attention reads the quantize-dequantized keys and values (perplexity with
    a quantized KV cache). ``emulate=False``: attention reads the originals and the error is
    measured: per layer Σ(kv_qdq(x) − x)² and Σx² over valid tokens accumulate in float64
    (`nmse`).
    """

    def __init__(self, model, scales: dict[str, tuple[torch.Tensor, torch.Tensor]], kind: str, *, emulate: bool):
        super().__init__()
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

    def set_mask(self, attention_mask: torch.Tensor) -> None:
        self._mask = attention_mask.detach().to("cpu").bool()

    def forward_kwargs(self) -> dict:
        return cache_kwargs(self._model, observing_cache(self._model, self._observe))

    def _observe(self, idx: int, k: torch.Tensor, v: torch.Tensor):
        name = self.names[idx]
        if self.emulate:
            kq, vq = (kv_qdq(x, s, self.kind) for x, s in zip((k, v), self.scales[name]))
            return kq, vq
        valid = None
        if self._mask is not None and k.dim() == 4 and (k.shape[0], k.shape[2]) == tuple(self._mask.shape):
            valid = self._mask.to(k.device)[:, None, :, None]
        with torch.no_grad():
            for j, (x, s) in enumerate(zip((k, v), self.scales[name])):
                xf = x.detach().double()
                d2, r2 = (kv_qdq(x, s, self.kind).detach().double() - xf).square(), xf.square()
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


