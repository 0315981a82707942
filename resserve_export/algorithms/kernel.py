"""The fused quantize-and-extend kernel and its PyTorch reference (docs/formats.md, "The fused
quantize-and-extend kernel").

`quantize_extend(x, mask, ratio, fmt, ...)` returns exactly what `kext.extended_activation`
returns — ``[X̂ | R̂_S | 0]`` as one `FP4Tensor` — and `quantize_full` what `kext.full_residue`
returns. Backends: ``reference`` (the eager PyTorch functions, any device), ``cuda`` (the kernel
in ``kernels/``, built just in time for the GPU present) and ``auto`` (the kernel for CUDA inputs
when it can run, else the reference; ``RESSERVE_BACKEND=reference`` forces the reference).

The same extension holds `exact_bf16`, the bf16 operand of FP4 codes and block scales that the
grad scores' bf16 path multiplies (kernels/exact_operand.cu), and `prepare_operands`, a group's
whole preparation of one activation (its quantizations and operands) in one call.

Whether the kernel can run is decided once at import (`KERNEL_AVAILABLE`, with the reason in
`KERNEL_UNAVAILABLE_REASON`); asking for ``backend="cuda"`` without it raises `KernelUnavailable`
saying what is needed. The build itself happens on first use (about a minute) and is cached by
PyTorch's extension builder.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch
from torch.utils.cpp_extension import CUDA_HOME, load

from resserve_export.algorithms import kext
from resserve_export.algorithms.selection import check_ratio, mask_to_indices
from resserve_export.core.errors import UserError
from resserve_export.formats import registry
from resserve_export.formats.constants import SELECTION_GROUP
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.nvfp4 import global_scale
from resserve_export.formats.ops import quantize as quantize_ref
from resserve_export.formats.qtensor import FP4Tensor

BACKENDS = ("auto", "cuda", "reference")
_ROUNDING_CODE = {ScaleRounding.CEIL: 0, ScaleRounding.FLOOR: 1, ScaleRounding.EVEN: 2}
_SOURCES = ("quantize_extend.cu", "exact_operand.cu", "binding.cpp")
# The grad scores' group reduction: an extension of its own, so that its build failing leaves the
# quantize-and-extend kernel usable.
_GROUP_SOURCES = ("group_sums.cu", "group_sums_binding.cpp")
# The exact RMSNorm's elementwise steps, launched from C++ (opt-in: `scores.norm`).
_NORM_SOURCES = ("rms_norm.cu", "rms_norm_binding.cpp")
# Compiler flags: no fast math, and no multiply fused into an add anywhere (the order of docs/formats.md, "NVFP4").
CUDA_FLAGS = ("-O3", "-std=c++17", "-fmad=false")
# Rows each thread loads before computing (1, 2 or 4): more bytes in flight per thread.
DEFAULT_ROWS = int(os.environ.get("RESSERVE_KERNEL_ROWS", "4"))
# Cap on CTAs per launch: > 0 at most that many, 0 none, < 0 as many as are resident at once
# (occupancy x SMs, one wave); capped CTAs loop over rows. Unset: 16 per SM, the fastest in
# bench/kernel.py's scan on the H200 (one-wave and uncapped grids were 2-12% slower).
_MAX_CTAS_ENV = os.environ.get("RESSERVE_KERNEL_MAX_CTAS")
CTAS_PER_SM = 16


@functools.lru_cache(maxsize=None)
def default_max_ctas(device_index: int) -> int:
    if _MAX_CTAS_ENV is not None:
        return int(_MAX_CTAS_ENV)
    return CTAS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


class KernelUnavailable(UserError):
    """The CUDA kernel was asked for but cannot run here."""


def kernels_dir() -> Path | None:
    """Directory holding the CUDA sources: ``$RESSERVE_KERNELS_DIR`` or ``<repo>/kernels``."""
    env = os.environ.get("RESSERVE_KERNELS_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "kernels")  # a source checkout
    candidates.append(Path(__file__).resolve().parents[1] / "_kernels")  # an installed wheel
    for d in candidates:
        if all((d / s).is_file() for s in _SOURCES):
            return d
    return None


def _unavailable_reason() -> str | None:
    if torch.version.cuda is None or not torch.cuda.is_available():
        return "the fused kernel needs a CUDA GPU and a CUDA build of PyTorch"
    if kernels_dir() is None:
        return "the kernel sources (kernels/quantize_extend.cu, kernels/exact_operand.cu, kernels/binding.cpp) were not found; set RESSERVE_KERNELS_DIR"

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        return "building the fused kernel needs the CUDA compiler nvcc (set CUDA_HOME)"
    return None


KERNEL_UNAVAILABLE_REASON = _unavailable_reason()
KERNEL_AVAILABLE = KERNEL_UNAVAILABLE_REASON is None


def _build(prefix: str, sources: tuple) -> object:
    """Build (or load the cached build of) the extension of `sources` for the GPU present."""
    if not KERNEL_AVAILABLE:
        raise KernelUnavailable(KERNEL_UNAVAILABLE_REASON)
    d = kernels_dir()
    missing = [s for s in sources if not (d / s).is_file()]
    if missing:
        raise KernelUnavailable(f"the kernel sources {missing} were not found in {d}")
    major, minor = torch.cuda.get_device_capability()
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    return load(
        name=f"{prefix}_sm{major}{minor}",
        sources=[str(d / s) for s in sources],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=list(CUDA_FLAGS),
        verbose=os.environ.get("RESSERVE_KERNEL_VERBOSE") == "1",
    )


@functools.lru_cache(maxsize=None)
def _extension():
    """The quantize-and-extend extension (with the exact operands and the group preparation)."""
    return _build("resserve_qext", _SOURCES)


@functools.lru_cache(maxsize=None)
def _group_extension():
    """The grad scores' group-reduction extension."""
    return _build("resserve_gsums", _GROUP_SOURCES)


@functools.lru_cache(maxsize=None)
def _norm_extension():
    """The exact RMSNorm steps' extension."""
    return _build("resserve_norm", _NORM_SOURCES)


def norm_square(x: torch.Tensor, p: torch.Tensor) -> None:
    """p = x² in FP32 (kernels/rms_norm.cu): x contiguous bf16/fp16 CUDA, p contiguous FP32 of x's size."""
    _norm_extension().norm_square(x, p)


def norm_output(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, y: torch.Tensor, gemma: bool) -> None:
    """y = w · narrow(x · r), or narrow(x · r · w) with ``gemma`` (w = 1 + weight in FP32): the exact
    RMSNorm's output, into y (contiguous, x's dtype); r one FP32 1/rms a row."""
    _norm_extension().norm_output(x, w, r, y, gemma)


def norm_backward(dy, w, x, r, gp, out, gemma: bool, grad: bool, lead) -> None:
    """The exact RMSNorm's backward step into `out`: with `grad` x's gradient narrow(gh · r + gp · 2x),
    else the FP32 product gh · x whose row sum is 1/rms's gradient (gh = dy · w, narrowed in the
    Llama form). `lead`: dy's (d1, d2, s0, s1, s2) and out's (o0, o1, o2), `scores.norm._lead`'s."""
    _norm_extension().norm_backward(dy, w, x, r, gp, out, gemma, grad, list(lead))


def group_sums_split(xhat, x, extras, b0, wres, weights, grads, rows, c) -> torch.Tensor:
    """The grad scores' split-layout sums of one decision group in one call of the extension
    (kernels/group_sums_binding.cpp): the residue products ``extras[j] @ wres[j]ᵀ``, the stacked
    product ``xhat @ b0ᵀ`` and each member's ``x @ weights[k]ᵀ`` (FP32 outputs), the same ATen
    GEMMs as `Candidates.group_sums_fast` makes; then each member's squared sums over its columns
    ``[rows[k], rows[k+1])`` (kernels/group_sums.cu). float64 ``[1 + len(extras)]``, summed over
    the members. `c`: α_x·α_w, an FP32 scalar on the device."""
    return _group_extension().group_sums_split(xhat, x, list(extras), b0, list(wres), list(weights), list(grads), list(rows), c)


# The kernel's ksel for full compensation; a partial ratio's is the channels it selects per group of 8.
_FULL = 8


def _ksel(ratio: float) -> int:
    return int(ratio * SELECTION_GROUP)


def _pick(x: torch.Tensor, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}, available: {list(BACKENDS)}")
    if backend == "cuda":
        if not KERNEL_AVAILABLE:
            raise KernelUnavailable(KERNEL_UNAVAILABLE_REASON)
        if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"backend='cuda' needs a bfloat16/float16 CUDA tensor, got {x.dtype} on {x.device}")
        return "cuda"
    if backend == "reference" or os.environ.get("RESSERVE_BACKEND", "") == "reference":
        return "reference"
    ok = KERNEL_AVAILABLE and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
    return "cuda" if ok else "reference"


def backend_for(x: torch.Tensor, backend: str = "auto") -> str:
    """Which backend `quantize_extend` would use for `x` (``cuda`` or ``reference``)."""
    return _pick(x, backend)


def _alpha(x: torch.Tensor, alpha) -> torch.Tensor:
    if alpha is None:
        # amax / 2688 as one true FP32 division (a CUDA division by a Python scalar would be a
        # multiplication by its reciprocal).
        return global_scale(x.abs().amax().float().cpu()).to(x.device)
    return torch.as_tensor(alpha, dtype=torch.float32).reshape(()).to(x.device)


def _check_mask(mask: torch.Tensor, K: int, k: int, device, count: bool = True) -> torch.Tensor:
    """The mask as a contiguous uint8 vector on `device`; `count`: also check that every byte
    selects k channels (a reduction read back to the host: a GPU sync per call)."""
    if mask.dtype != torch.uint8 or mask.numel() != K // SELECTION_GROUP:
        raise ValueError(f"mask must be uint8 [{K // SELECTION_GROUP}], got {mask.dtype} {tuple(mask.shape)}")
    mask = mask.reshape(-1).to(device).contiguous()
    if count:
        bits = torch.stack([(mask >> b) & 1 for b in range(SELECTION_GROUP)]).sum(0)
        if not bool((bits == k).all()):
            raise ValueError(f"every mask byte must select exactly {k} channels for this ratio")
    return mask


_SPARE: dict = {}


def _spare(dev: torch.device) -> tuple:
    """Per device, the launch's unused arguments (no mask, no full residue, no α), made once: a
    call per activation and ratio in the grad scores would otherwise allocate them every time."""
    if dev not in _SPARE:
        _SPARE[dev] = (
            torch.empty(0, dtype=torch.uint8, device=dev),
            torch.empty((0, 0), dtype=torch.uint8, device=dev),
            torch.empty((0, 0), dtype=torch.uint8, device=dev),
            torch.zeros((), dtype=torch.float32, device=dev),
        )
    return _SPARE[dev]


def _run(x: torch.Tensor, mask, ksel: int, fmt: str, alpha, rounding: ScaleRounding, K_E: int, out=None, rows=None, max_ctas=None):
    """Launch the kernel on 2-D contiguous x; returns (codes, scales, rcodes, rscales) as uint8."""
    M, K = x.shape
    f = registry.get(fmt)
    b = f.block
    dev = x.device
    spare = _spare(dev)
    if out is None:
        out = (
            torch.empty((M, (K + K_E) // 2), dtype=torch.uint8, device=dev),
            torch.empty((M, (K + K_E) // b), dtype=torch.uint8, device=dev),
            torch.empty((M, K // 2), dtype=torch.uint8, device=dev) if ksel == 8 else spare[1],
            torch.empty((M, K // b), dtype=torch.uint8, device=dev) if ksel == 8 else spare[2],
        )
    empty = spare[0]
    a = alpha if alpha is not None else spare[3]
    _extension().quantize_extend_out(
        x, mask if mask is not None else empty, a, *out, ksel, f.kernel_code, _ROUNDING_CODE[rounding], K_E,
        DEFAULT_ROWS if rows is None else rows,
        default_max_ctas(x.device.index if x.device.index is not None else torch.cuda.current_device()) if max_ctas is None else max_ctas,
    )
    return out


def _as_fp4(fmt: str, codes, scales, alpha, lead) -> FP4Tensor:
    f = registry.get(fmt)
    scales = f.as_scales(scales)
    return FP4Tensor(
        f.name, codes.reshape(*lead, codes.shape[-1]), scales.reshape(*lead, scales.shape[-1]), alpha if f.has_tensor_scale else None
    )


def _prepare(x: torch.Tensor, fmt: str, alpha):
    f = registry.get(fmt)
    K = x.shape[-1]
    if K % f.block:
        raise ValueError(f"last dim {K} is not a multiple of the {f.name} block size {f.block}")
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous().clone() if x2.is_contiguous() else x2.contiguous()
    a = _alpha(x2, alpha) if f.has_tensor_scale else None
    return x2, a


def quantize_extend(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    ratio: float,
    fmt: str,
    alpha: torch.Tensor | float | None = None,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    backend: str = "auto",
    check_mask: bool = True,
) -> FP4Tensor:
    """``[X̂ | R̂_S | 0]`` for activations x ``[..., K]``: same result as `kext.extended_activation`.

    Ratio 0 and 1 return X̂ alone (for 1 use `quantize_full` to get R̂ too). `mask` (uint8
    ``[K/8]``) is needed for partial ratios; `alpha` is the NVFP4 input scale (None: amax(x)/2688).
    `check_mask=False` skips counting the mask's bits (a GPU sync), for callers whose masks
    were checked when they were built.
    """
    ratio = check_ratio(ratio)
    rounding = ScaleRounding(rounding)
    if _pick(x, backend) == "reference":
        if registry.get(fmt).has_tensor_scale:
            alpha = _alpha(x, alpha)
        # On the CPU, large tensors take formats.quantize's compiled (bit-identical) path.
        backend = "auto" if x.device.type == "cpu" else "reference"
        return kext.extended_activation(x, mask, ratio, fmt, alpha=alpha, rounding=rounding, backend=backend)
    x2, a = _prepare(x, fmt, alpha)
    K = x2.shape[-1]
    K_E = kext.ext_width(K, ratio, fmt)
    ksel = _ksel(ratio) if K_E else 0
    m = None
    if ksel:
        if mask is None:
            raise ValueError("a partial ratio needs a mask")
        m = _check_mask(mask, K, ksel, x2.device, count=check_mask)
    codes, scales, _, _ = _run(x2, m, ksel, fmt, a, rounding, K_E)
    return _as_fp4(fmt, codes, scales, a, x.shape[:-1])


def quantize_full(
    x: torch.Tensor,
    fmt: str,
    alpha: torch.Tensor | float | None = None,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    backend: str = "auto",
) -> tuple[FP4Tensor, FP4Tensor]:
    """(X̂, R̂) for full compensation: same result as `kext.full_residue`."""
    rounding = ScaleRounding(rounding)
    if _pick(x, backend) == "reference":
        if registry.get(fmt).has_tensor_scale:
            alpha = _alpha(x, alpha)
        backend = "auto" if x.device.type == "cpu" else "reference"
        return kext.full_residue(x, fmt, alpha=alpha, rounding=rounding, backend=backend)
    x2, a = _prepare(x, fmt, alpha)
    codes, scales, rcodes, rscales = _run(x2, None, 8, fmt, a, rounding, 0)
    lead = x.shape[:-1]
    return _as_fp4(fmt, codes, scales, a, lead), _as_fp4(fmt, rcodes, rscales, a, lead)


def quantize(x: torch.Tensor, fmt: str, alpha: torch.Tensor | None = None, rounding: ScaleRounding | str = ScaleRounding.CEIL) -> FP4Tensor:
    """``formats.quantize(x, fmt, alpha=alpha, rounding=rounding)`` (the minmax block scales): for
    contiguous bf16/fp16 CUDA tensors where the kernel runs, its X̂ (one launch; bit for bit the
    reference's codes and scales: the kernel is checked against it), else `formats.quantize`.
    NVFP4 without `alpha` takes the tensor's own (`Format.tensor_alpha`), as the reference does."""
    f = registry.get(fmt)
    rounding = ScaleRounding(rounding)
    if not (_pick(x, "auto") == "cuda" and x.is_contiguous() and x.shape[-1] % f.block == 0 and x.numel()):
        return quantize_ref(x, f, alpha=alpha, rounding=rounding)
    if f.has_tensor_scale and alpha is None:
        alpha = f.tensor_alpha(x)
    x2 = x.reshape(-1, x.shape[-1])
    a = torch.as_tensor(alpha, dtype=torch.float32).reshape(()).to(x.device) if f.has_tensor_scale else None
    codes, scales, _, _ = _run(x2, None, 0, f.name, a, rounding, 0)
    return _as_fp4(f.name, codes, scales, a, x.shape[:-1])


def extend_weight(
    weight: torch.Tensor, mask: torch.Tensor, ratio: float, fmt: str, rounding: ScaleRounding | str = ScaleRounding.CEIL,
    alpha: torch.Tensor | None = None,
) -> FP4Tensor | None:
    """`kext.extend_weight` (the quantized ``[W_S | 0]``), through `quantize` on CUDA
    (`extend_weights` of one ratio): the selected columns are gathered in the weight's own dtype,
    which holds them exactly, so the codes and scales are those of the reference's FP32 gather."""
    K = weight.shape[-1]
    K_E = kext.ext_width(K, ratio, fmt)
    if K_E == 0 or _pick(weight, "auto") != "cuda":
        return kext.extend_weight(weight, mask, ratio, fmt, rounding, alpha=alpha)
    return extend_weights(weight, [mask], [ratio], fmt, rounding, alpha=alpha)[0]


def extend_weights(
    weight: torch.Tensor, masks: list, ratios: list[float], fmt: str, rounding: ScaleRounding | str = ScaleRounding.CEIL,
    alpha: torch.Tensor | None = None,
) -> tuple[FP4Tensor | None, list[int]]:
    """The K-Ext extensions of `weight` ``[N, K]`` at several `ratios` (one uint8 ``[K/8]`` mask
    each) as one quantization: ``([W_S1 | 0 | W_S2 | 0 | …]`` quantized, the column offset of each
    ratio's extension in it). A ratio's extension is the column block ``[offset, offset + K_E)``:
    every K_E is a multiple of the block, blocks are quantized on their own and α is given, so
    each block is the bits of `extend_weight` for that ratio alone (tested). One gather and one
    quantization (one launch on CUDA) instead of one of each per ratio. None where no ratio has
    an extension (plain and full)."""
    K = weight.shape[-1]
    widths = [kext.ext_width(K, r, fmt) for r in ratios]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    if not sum(widths):
        return None, offsets
    if alpha is None:
        alpha = registry.get(fmt).tensor_alpha(weight)
    # Each ratio's selected channels, then any column up to its width (zeroed after the gather):
    # one index vector for all of them, one gather.
    idx, pads = [], []
    for m, o, w in zip(masks, offsets, widths):
        if w:
            chosen = mask_to_indices(m)
            idx += [chosen, chosen.new_zeros(w - chosen.numel())]
            pads.append((o + chosen.numel(), o + w))
    sel = weight.index_select(-1, torch.cat(idx).to(weight.device))
    for a, b in pads:
        sel[..., a:b] = 0
    if sel.device.type == "cpu":  # the reference's FP32 gather (`kext.compact`): the same values
        sel = sel.float()
    return quantize(sel, fmt, alpha=alpha, rounding=rounding), offsets


def exact_bf16(codes: torch.Tensor, scales: torch.Tensor, factors: torch.Tensor, block: int) -> torch.Tensor:
    """bf16 ``[M, width]``: each FP4 code's E2M1 value times its block's factor (``factors[scale
    byte]``, FP32 ``[256]``), in one launch of the extension (kernels/exact_operand.cu). codes
    ``[M, width/2]`` and scales ``[M, width/block]``: uint8 CUDA tensors with unit column stride
    (row-strided views are read in place). The products are exact, so these are the bits of
    `emulate.exact_operand` and of `scores.fused.exact_bf16`'s Triton kernel."""
    out = torch.empty((codes.shape[0], 2 * codes.shape[1]), dtype=torch.bfloat16, device=codes.device)
    _extension().exact_bf16_out(codes, scales, factors, out, block)
    return out


def prepare_operands(x: torch.Tensor, masks: list, ratios: list[float], widths: list[int], fmt: str, alpha, rounding, factors: torch.Tensor) -> list[torch.Tensor]:
    """The grad scores' bf16 operands of activation x ``[M, K]`` (bf16/fp16 CUDA) for a group's
    compensated `ratios` in one call of the extension: ``[X̂', R̂'_1, …]``, the launches and bits
    of `quantize_extend` (partial ratios: residue width from ``widths``, uint8 ``[K/8]`` mask on
    x's device) or `quantize_full` (ratio 1: no mask) followed by `exact_bf16`; ``alpha`` the
    NVFP4 input scale as an FP32 scalar on x's device, None for MXFP4; ``factors`` the format's
    scale-byte values, `scores.fused.scale_factors`. X̂' and the first partial ratio's R̂' are
    column views of one tensor."""
    f = registry.get(fmt)
    dev = x.device
    spare = _spare(dev)
    ksels = [_FULL if check_ratio(r) == 1.0 else _ksel(r) for r in ratios]
    if any(k == 0 for k in ksels):
        raise ValueError(f"only compensated ratios are prepared, got {ratios}")
    return _extension().prepare_operands(
        x, [spare[0] if m is None else m for m in masks], ksels, list(widths), spare[3] if alpha is None else alpha,
        factors, f.kernel_code, _ROUNDING_CODE[ScaleRounding(rounding)], DEFAULT_ROWS,
        default_max_ctas(dev.index if dev.index is not None else torch.cuda.current_device()),
    )


def quantize_extend_raw(x: torch.Tensor, mask, ksel: int, fmt: str, alpha, rounding, K_E: int, out, rows=None, max_ctas=None) -> None:
    """Launch into caller-provided uint8 outputs (tests poison them; the benchmark reuses them).

    x: contiguous 2-D CUDA bf16/fp16; out = (codes, scales, rcodes, rscales); ksel 0/1/2/4/8;
    rows: rows per thread (1, 2, 4; default `DEFAULT_ROWS`); max_ctas: cap on CTAs (0: none;
    < 0: the CTAs resident at once; default `default_max_ctas`).
    """
    _run(x, mask, ksel, fmt, alpha, ScaleRounding(rounding), K_E, out=out, rows=rows, max_ctas=max_ctas)


__all__ = [
    "BACKENDS",
    "KERNEL_AVAILABLE",
    "KERNEL_UNAVAILABLE_REASON",
    "KernelUnavailable",
    "backend_for",
    "exact_bf16",
    "group_sums_split",
    "norm_backward",
    "norm_output",
    "norm_square",
    "kernels_dir",
    "quantize_extend",
    "quantize_full",
    "quantize_extend_raw",
    "quantize",
    "extend_weight",
    "extend_weights",
    "prepare_operands",
]
