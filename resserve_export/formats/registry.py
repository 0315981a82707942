"""The checkpoint formats: one object each, and the only place a format's name is branched on.

A `Format` owns everything that differs between formats: block size and scale encoding, whether
it has a tensor scale (NVFP4's α, stored as ``weight_scale_2``, and the static activation α,
``input_scale``), the MX scale rounding choice, the K-Ext padding multiple, the per-linear tensor
names of the plain part, the quantization config it writes (and the extra files), the stock
vLLM method and linear-kernel family that serve the plain part, and its code in the fused CUDA
kernel. Callers ask the format (`get(name)`); they never compare names.

Registered today:

- ``nvfp4``: NVFP4 in ModelOpt's unified HF format (``quant_method: modelopt``), blocks of 16,
  E4M3 block scales and an FP32 tensor scale; served by vLLM's ``modelopt_fp4`` method.
- ``mxfp4``: MXFP4 in compressed-tensors' ``mxfp4-pack-quantized`` format, blocks of 32, E8M0
  block scales (uint8), no tensor scale; served by vLLM's ``compressed-tensors`` method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from resserve_export.formats import mxfp4
from resserve_export.formats import nvfp4
from resserve_export.formats import scale_rules
from resserve_export.formats.constants import MXFP4_BLOCK, NVFP4_BLOCK
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.scale_rules import BlockScaleRule

PRODUCER = "resserve-export"
HF_QUANT_CONFIG = "hf_quant_config.json"  # NVFP4's extra file (ModelOpt's unified HF format)


@dataclass(frozen=True)
class Format:
    """One checkpoint format (see the module docstring)."""

    name: str
    block: int
    ext_pad: int  # K + K_E is padded to a multiple of this (block-scale columns a multiple of 4)
    scale_st_dtype: str  # safetensors dtype of block scales
    scale_torch_dtype: torch.dtype
    has_tensor_scale: bool  # an FP32 α for weights (weight_scale_2) and activations (input_scale)
    has_rounding: bool  # block exponents follow a ScaleRounding choice
    weight_name: str
    scale_name: str
    tensor_scale_name: str | None
    input_scale_name: str | None
    stock_method: str  # vLLM's --quantization that serves the plain part
    stock_kernel: str  # vLLM's linear-kernel family (register_linear_kernel) of the plain part
    kernel_code: int  # the format argument of the fused CUDA kernel (kernels/quantize_extend.cu)
    kv_kinds: tuple[str, ...]  # KV-cache formats whose scales its loaders read (see kvcache.py)
    kv_style: str  # naming and shape of those scales: "modelopt" or "compressed-tensors"
    _quantize_blocks: Callable
    _dequantize_blocks: Callable
    _config: Callable[[list[str], str, str], dict]
    _extra_files: Callable[[list[str], str, str], dict]

    # ------------------------------------------------------------------ tensors and names

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """Per-linear tensor suffixes of the plain part, in write order."""
        extra = (self.tensor_scale_name, self.input_scale_name) if self.has_tensor_scale else ()
        return (self.weight_name, self.scale_name, *extra)

    def base_specs(self, module: str, N: int, K: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, safetensors dtype, shape) of one linear's plain tensors, in write order."""
        specs = [(f"{module}.{self.weight_name}", "U8", (N, K // 2)), (f"{module}.{self.scale_name}", self.scale_st_dtype, (N, K // self.block))]
        if self.has_tensor_scale:
            specs += [(f"{module}.{self.tensor_scale_name}", "F32", ()), (f"{module}.{self.input_scale_name}", "F32", ())]
        return specs

    def base_tensors(self, q, input_scale: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
        """(suffix, tensor) of one quantized linear's plain part, in `base_specs` order."""
        out = [(self.weight_name, q.codes), (self.scale_name, q.scales)]
        if self.has_tensor_scale:
            out += [(self.tensor_scale_name, q.global_scale.reshape(()).float()), (self.input_scale_name, input_scale.reshape(()).float())]
        return out

    def __reduce__(self):
        # A format pickles as its registry name: vLLM's engine core is a spawned process that
        # receives the quantization config (and the Format it holds) by pickle.
        return get, (self.name,)

    def as_scales(self, raw: torch.Tensor) -> torch.Tensor:
        """Block scales from their raw bytes (uint8 as kernels and loaders hand them over)."""
        return raw.view(self.scale_torch_dtype)

    # ------------------------------------------------------------------ arithmetic

    def quantize_blocks(
        self, blocks: torch.Tensor, alpha: torch.Tensor | None, rounding: ScaleRounding, rule: BlockScaleRule | str = BlockScaleRule.MINMAX
    ):
        """(codes, scales) of ``[n, block]`` blocks (the reference block functions); `rule` is the
        block-scale rule of weights (`scale_rules`), which only NVFP4 offers beyond ``minmax``."""
        if self.check_scale_rule(rule) is BlockScaleRule.MINMAX:
            return self._quantize_blocks(blocks, alpha, ScaleRounding(rounding))
        return scale_rules.quantize_blocks(blocks, alpha, rule)

    def blocks_fn(self, rounding: ScaleRounding, rule: BlockScaleRule | str = BlockScaleRule.MINMAX) -> Callable:
        """``fn(blocks, *alpha_args)`` for compiled chunking: α is an argument only where it exists."""
        rule = self.check_scale_rule(rule)
        if self.has_tensor_scale:
            return scale_rules.blocks_fn(rule)
        return functools.partial(mxfp4.quantize_blocks, rounding=ScaleRounding(rounding))

    def check_scale_rule(self, rule: BlockScaleRule | str) -> BlockScaleRule:
        """`rule` as a `BlockScaleRule`; ValueError where the format has no such choice (MXFP4's
        E8M0 exponents follow `rounding` instead)."""
        rule = BlockScaleRule(rule)
        if rule is not BlockScaleRule.MINMAX and not self.has_tensor_scale:
            raise ValueError(f"{self.name} has no block scale rule {rule.value!r}: its scale exponents follow the scale rounding")
        return rule

    def dequantize_blocks(self, codes: torch.Tensor, scales: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
        return self._dequantize_blocks(codes, scales, alpha)

    def weight_alpha(self, weights: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """The tensor scale of a fused group's weights (one for all members), None without one."""
        return nvfp4.group_global_scale(weights) if self.has_tensor_scale else None

    def tensor_alpha(self, x: torch.Tensor) -> torch.Tensor | None:
        """The tensor scale from one tensor's own amax (a weight quantized alone)."""
        if not self.has_tensor_scale:
            return None
        return nvfp4.global_scale(nvfp4.abs_max(x))

    def input_alpha(self, amax: torch.Tensor) -> torch.Tensor | None:
        """The static activation scale from a calibrated amax, None without a tensor scale."""
        return nvfp4.global_scale(torch.as_tensor(amax, dtype=torch.float32)) if self.has_tensor_scale else None

    def rounding_record(self, rounding: ScaleRounding | str) -> str | None:
        """What records say about the scale rounding: its name where it matters, else None."""
        return ScaleRounding(rounding).value if self.has_rounding else None

    # ------------------------------------------------------------------ configs

    def quantization_config(self, ignore: list[str], version: str, kv_cache: str = "none") -> dict:
        """config.json ``quantization_config`` for stock vLLM (without our ``resserve`` section);
        `kv_cache` is the KV-cache format whose scales the checkpoint carries (``none``, or one of
        `kv_kinds`)."""
        self.check_kv(kv_cache)
        return self._config(list(ignore), version, kv_cache)

    def extra_files(self, ignore: list[str], version: str, kv_cache: str = "none") -> dict[str, dict]:
        """Files besides config.json the format's loaders read: ``{file name: JSON}``."""
        self.check_kv(kv_cache)
        return self._extra_files(list(ignore), version, kv_cache)

    def check_kv(self, kv_cache: str) -> None:
        """ValueError unless the format's loaders read scales of KV-cache format `kv_cache`."""
        if kv_cache != "none" and kv_cache not in self.kv_kinds:
            raise ValueError(f"{self.name} checkpoints carry KV-cache scales for {', '.join(self.kv_kinds)} only, not {kv_cache}")


def stored_scalar(t: torch.Tensor) -> torch.Tensor:
    return t.float().reshape(())


def _nvfp4_quantize(blocks, alpha, rounding):
    return nvfp4.quantize_blocks(blocks, alpha)


def _nvfp4_dequantize(codes, scales, alpha):
    return nvfp4.dequantize_blocks(codes, scales, alpha)


def _mxfp4_quantize(blocks, alpha, rounding):
    return mxfp4.quantize_blocks(blocks, rounding)


def _mxfp4_dequantize(codes, scales, alpha):
    return mxfp4.dequantize_blocks(codes, scales)


def _no_files(ignore: list[str], version: str, kv_cache: str) -> dict[str, dict]:
    return {}


# ModelOpt's names of the KV-cache formats (hf_quant_config.json's kv_cache_quant_algo).
_MODELOPT_KV = {"none": None, "fp8": "FP8", "nvfp4": "NVFP4"}


def _modelopt_kv_scheme(kv_cache: str):
    """config.json's ``kv_cache_scheme`` as ModelOpt's export converts ``kv_cache_quant_algo``:
    FP8 becomes a compressed-tensors-style scheme, other algorithms stay their name."""
    if kv_cache == "fp8":
        return {"dynamic": False, "num_bits": 8, "type": "float"}
    return _MODELOPT_KV[kv_cache]


def _nvfp4_config(ignore: list[str], version: str, kv_cache: str) -> dict:
    """What ModelOpt 0.47's export writes (``quant_method: modelopt``, ``quant_algo: NVFP4``, its
    compressed-tensors-style ``config_groups``), plus ``group_size``."""
    g = NVFP4_BLOCK
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": g,
        "kv_cache_scheme": _modelopt_kv_scheme(kv_cache),
        "ignore": ignore,
        "producer": {"name": PRODUCER, "version": version},
        "config_groups": {
            "group_0": {
                "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": g},
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": g},
                "targets": ["Linear"],
            }
        },
    }


def _nvfp4_files(ignore: list[str], version: str, kv_cache: str) -> dict[str, dict]:
    """``hf_quant_config.json`` of ModelOpt's unified HF export."""
    return {
        HF_QUANT_CONFIG: {
            "producer": {"name": PRODUCER, "version": version},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": _MODELOPT_KV[kv_cache], "group_size": NVFP4_BLOCK, "exclude_modules": ignore},
        }
    }


def _mxfp4_config(ignore: list[str], version: str, kv_cache: str) -> dict:
    """compressed-tensors ``mxfp4-pack-quantized``: 4-bit float weights, strategy group, group size
    32, symmetric; activations the same, dynamic. An FP8 KV cache is compressed-tensors'
    ``kv_cache_scheme`` (8-bit float, one static symmetric scale per tensor)."""
    args = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_BLOCK, "symmetric": True}
    kv = None
    if kv_cache == "fp8":
        kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": kv,
        "ignore": ignore,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**args, "dynamic": False},
                "input_activations": {**args, "dynamic": True},
                "output_activations": None,
                "format": "mxfp4-pack-quantized",
            }
        },
    }


NVFP4 = Format(
    name="nvfp4",
    block=NVFP4_BLOCK,
    ext_pad=64,
    scale_st_dtype="F8_E4M3",
    scale_torch_dtype=torch.float8_e4m3fn,
    has_tensor_scale=True,
    has_rounding=False,
    weight_name="weight",
    scale_name="weight_scale",
    tensor_scale_name="weight_scale_2",
    input_scale_name="input_scale",
    stock_method="modelopt_fp4",
    stock_kernel="nvfp4",
    kernel_code=0,
    kv_kinds=("fp8", "nvfp4"),
    kv_style="modelopt",
    _quantize_blocks=_nvfp4_quantize,
    _dequantize_blocks=_nvfp4_dequantize,
    _config=_nvfp4_config,
    _extra_files=_nvfp4_files,
)

MXFP4 = Format(
    name="mxfp4",
    block=MXFP4_BLOCK,
    ext_pad=128,
    scale_st_dtype="U8",
    scale_torch_dtype=torch.uint8,
    has_tensor_scale=False,
    has_rounding=True,
    weight_name="weight_packed",
    scale_name="weight_scale",
    tensor_scale_name=None,
    input_scale_name=None,
    stock_method="compressed-tensors",
    stock_kernel="mxfp4",
    kernel_code=1,
    # vLLM's compressed-tensors loader accepts an 8-bit float KV scheme only.
    kv_kinds=("fp8",),
    kv_style="compressed-tensors",
    _quantize_blocks=_mxfp4_quantize,
    _dequantize_blocks=_mxfp4_dequantize,
    _config=_mxfp4_config,
    _extra_files=_no_files,
)

FORMATS: dict[str, Format] = {f.name: f for f in (NVFP4, MXFP4)}


def get(fmt: str | Format) -> Format:
    """The `Format` named `fmt` (a `Format` passes through); ValueError lists the choices."""
    if isinstance(fmt, Format):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {fmt!r}, available formats: {list(FORMATS)}") from None


__all__ = ["Format", "FORMATS", "NVFP4", "MXFP4", "HF_QUANT_CONFIG", "PRODUCER", "get"]
