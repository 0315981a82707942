"""gpt-oss: experts fused on disk with biases, attention sinks.

Every layer stores its experts fused on disk, input-major, with gate and up *interleaved*
(``mlp.experts.gate_up_proj`` ``[E, hidden, 2·I]``: column 2i is gate unit i, column 2i+1 up
unit i), their biases (``gate_up_proj_bias`` ``[E, 2I]``, interleaved alike, and
``down_proj_bias`` ``[E, hidden]``) and ``down_proj`` ``[E, I, hidden]``. The experts are read as
one gate / up / down linear each and quantized so (masks and K-Ext per expert); they are written
as vLLM's gpt-oss loader reads quantized experts (``mlp.experts.E.w13_weight_packed`` …, gate
and up interleaved, transposed: `storage.fused_experts`). The biases, the router
(``mlp.router``, with its bias) and the attention sinks (``self_attn.sinks``) are copied byte
for byte.

Formats: MXFP4 (compressed-tensors). vLLM 0.32's gpt-oss loader takes quantized experts one
expert at a time under the suffixes ``w13_weight``, ``w13_weight_packed``, ``w13_weight_scale``,
``w13_bias`` (and ``w2_…``) only: ModelOpt NVFP4's per-expert ``weight_scale_2`` and
``input_scale`` have no name it loads, so NVFP4 is refused for gpt-oss. Its compressed-tensors
MXFP4 MoE method reads the per-expert weights and scales through its unquantized path, which
transposes them: hence the transposed storage. One gap remains on vLLM's side: neither of its FP4
MoE methods for these formats makes a parameter for expert biases, so stock vLLM 0.32 stops at
gpt-oss's first expert bias (``tests/test_vllm.py`` shows that everything else loads where vLLM
reads it).

Stock vLLM's one FP4 path with expert bias parameters is the hub's own MXFP4 format
(``quant_method: mxfp4``: vLLM's ``GptOssMxfp4Config`` and ``GptOssMxfp4MoEMethod``), which
``pack --experts-layout hub`` writes (`storage.hub_experts`, with `HUB_MXFP4_CONFIG`, the hub's
quantization_config); vLLM's gpt-oss model and loader take every tensor of such a checkpoint,
biases included (``tests/test_vllm.py``). That method quantizes no linear (its
``get_quant_method`` gives every linear layer ``UnquantizedLinearMethod``): the attention is
copied in bf16, as on the hub, and the experts run as W4A16 (bf16 activations, the only
activation dtype it admits), not as the W4A4 of this tool's format, with no sidecar.
`hub_mxfp4_experts` rearranges a per-expert checkpoint's experts into the same tensors (the
tests' independent check of that layout).

The expert computes ``gate_up = x·W + b``, then the clamped SwiGLU ``(clamp(up, ±limit) + 1) ·
g·σ(α·g)`` with ``g = min(gate, limit)`` (α = 1.702, limit = 7.0 in the config), then ``down``
plus its bias, scaled by the routing weight (a softmax over the top-k router logits). `adapt`
swaps in an experts module with the interface the rest of the tool hooks
(``forward(hidden_states, top_k_index, top_k_weights)``, ``gate_up_proj`` ``[E, 2I, H]`` gate rows
first, de-interleaved once at load) whose `glu` and biases the expert statistics and verify
use, so they see what the expert GEMMs see with the real routing.

Hub checkpoints whose experts are MXFP4 blocks on disk (``…gate_up_proj_blocks`` uint8
``[E, 2I, H/32, 16]``, ``…_scales`` uint8 ``[E, 2I, H/32]``, as openai/gpt-oss-20b ships, with
``quantization_config.quant_method: mxfp4``) are read exactly: `dequantize_mxfp4` gives each
element E2M1 × 2^(scale − 127) in bf16, laid out as the bf16 checkpoints store the experts (the
blocks' rows are gate_up's output units, interleaved as its columns), as transformers
dequantizes them (``integrations/mxfp4.py``, ``convert_moe_packed_tensors``); `modelio` does it
once per checkpoint into a bf16 copy in the cache, and everything else reads that copy."""

from __future__ import annotations

import re

import torch

from resserve_export.formats.constants import E8M0_BIAS, F4_E2M1_VALUES
from resserve_export.modeling.families.base import Family, FusedOnDisk

# ``<…>.experts.gate_up_proj_blocks`` / ``down_proj_blocks`` and their ``_scales``.
MXFP4_BLOCKS = re.compile(r"^(?P<fused>.+\.experts\.(?:gate_up_proj|down_proj))_blocks$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The bf16 tensor ``[E, G·32, R]`` of MXFP4 blocks ``[E, R, G, 16]`` (two E2M1 codes a byte,
    element 2i in the low nibble) with E8M0 scales ``[E, R, G]``: element E2M1 × 2^(scale − 127),
    transposed to the input-major layout of the bf16 checkpoints. Exact: every such value with a
    scale in [1, 254] is a bf16 number."""
    signed = torch.tensor([*F4_E2M1_VALUES, *(-v for v in F4_E2M1_VALUES)], dtype=torch.float32)
    E, R, G, B = blocks.shape
    out = torch.empty(E, G * 2 * B, R, dtype=torch.bfloat16)
    for e in range(E):  # one expert's temporaries at a time (gpt-oss-120b: 128 experts of 5,760 × 2,880)
        codes = torch.stack([blocks[e] & 0x0F, blocks[e] >> 4], dim=-1).reshape(R, G, 2 * B)
        values = torch.ldexp(signed[codes.long()], scales[e].to(torch.int32)[..., None] - E8M0_BIAS)
        out[e] = values.reshape(R, -1).t().to(torch.bfloat16)
    return out


# The quantization_config of the hub's MXFP4 gpt-oss checkpoints (openai/gpt-oss-20b, -120b): the
# experts are MXFP4 blocks, everything else is listed as not converted and stays as it is.
HUB_MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}
# The experts as `pack` writes them (`storage.fused_experts`): per expert, transposed, w13's
# columns gate and up interleaved.
_WRITTEN = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<fused>w13|w2)_(?P<kind>weight_packed|weight_scale)$")


def hub_mxfp4_experts(written: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's MXFP4 expert tensors for the MXFP4 experts `pack` wrote: from each layer's
    ``<…>.experts.E.w13_weight_packed`` ``[H/2, 2I]`` / ``w13_weight_scale`` ``[H/32, 2I]`` and
    ``w2_…`` ``[I/2, H]`` / ``[I/32, H]`` (all E experts of the layer), ``<…>.experts.gate_up_proj_blocks``
    ``[E, 2I, H/32, 16]``, ``gate_up_proj_scales`` ``[E, 2I, H/32]``, ``down_proj_blocks``
    ``[E, H, I/32, 16]`` and ``down_proj_scales`` ``[E, H, I/32]``: the same codes and E8M0 scales,
    only rearranged (row r of gate_up is w13's column r: gate and up interleaved, as on the hub;
    two E2M1 codes a byte, element 2i in the low nibble in both layouts), as ``pack --experts-layout
    hub`` writes them (`storage.hub_experts`). `dequantize_mxfp4` reads them back. Other tensors of
    `written` are ignored."""
    layers: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in written.items():
        m = _WRITTEN.match(name)
        if m:
            layers.setdefault(m["experts"], {}).setdefault(f"{m['fused']}_{m['kind']}", {})[int(m["e"])] = t
    out = {}
    for experts, kinds in layers.items():
        for fused, hub in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            codes, scales = kinds[f"{fused}_weight_packed"], kinds[f"{fused}_weight_scale"]
            E = len(codes)
            if sorted(codes) != list(range(E)) or sorted(scales) != list(range(E)):
                raise ValueError(f"{experts}: the {fused} tensors are not those of experts 0..{E - 1}")
            blocks = torch.stack([codes[e].t() for e in range(E)])  # [E, rows, K/2]
            out[f"{experts}.{hub}_blocks"] = blocks.reshape(E, blocks.shape[1], -1, 16).contiguous()
            out[f"{experts}.{hub}_scales"] = torch.stack([scales[e].t() for e in range(E)]).contiguous()
    return out


def hub_mxfp4(config: dict) -> bool:
    """Whether `config` is a gpt-oss hub checkpoint whose experts are stored as MXFP4 blocks."""
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


class GptOssRoutedExperts(torch.nn.Module):
    """A gpt-oss layer's experts in the interface the tool hooks: ``gate_up_proj`` ``[E, 2I, H]``
    (gate rows, then up rows), ``down_proj`` ``[E, H, I]`` (a view of the loaded parameter),
    ``gate_up_bias`` / ``down_bias`` in the same orders, and `glu`, the clamped SwiGLU. The loaded
    biases stay the model's parameters (``gate_up_proj_bias`` interleaved, as on disk)."""

    def __init__(self, fused: torch.nn.Module):
        super().__init__()
        gu = fused.gate_up_proj.detach()  # [E, H, 2I], gate and up interleaved
        self.gate_up_proj = torch.nn.Parameter(torch.cat([gu[..., 0::2], gu[..., 1::2]], dim=2).transpose(1, 2).contiguous(), requires_grad=False)
        self.down_proj = torch.nn.Parameter(fused.down_proj.detach().transpose(1, 2), requires_grad=False)
        self.gate_up_proj_bias = fused.gate_up_proj_bias
        self.down_proj_bias = fused.down_proj_bias
        self.alpha, self.limit = float(fused.alpha), float(fused.limit)
        self.act_fn = torch.nn.SiLU()  # unused: `glu` is the activation (the hooks look for it)

    @property
    def gate_up_bias(self) -> torch.Tensor:
        """``[E, 2I]``: gate biases, then up biases (the order of ``gate_up_proj``'s rows)."""
        b = self.gate_up_proj_bias.detach()
        return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)

    @property
    def down_bias(self) -> torch.Tensor:
        return self.down_proj_bias.detach()

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """transformers' ``GptOssExperts._apply_gate`` on de-interleaved halves."""
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        out = torch.zeros_like(hidden_states)
        I = self.gate_up_proj.shape[1] // 2
        gub, db = self.gate_up_bias, self.down_bias
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            if not token.numel():
                continue
            gate_up = hidden_states[token] @ self.gate_up_proj[e].t() + gub[e]
            y = self.glu(gate_up[:, :I], gate_up[:, I:]) @ self.down_proj[e].t() + db[e]
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def adapt(model: torch.nn.Module) -> None:
    """Swap every gpt-oss layer's experts for `GptOssRoutedExperts` (in place)."""
    for _, mod in list(model.named_modules()):
        experts = getattr(mod, "experts", None)
        if hasattr(mod, "router") and isinstance(experts, torch.nn.Module) and not isinstance(experts, GptOssRoutedExperts):
            if getattr(experts, "gate_up_proj_bias", None) is not None:
                mod.experts = GptOssRoutedExperts(experts)


FAMILY = Family(
    name="gpt-oss (experts fused on disk, interleaved, with biases; attention sinks)",
    model_types=("gpt_oss",),
    quantized="attention linears, each expert's gate / up / down as its own linear; router, expert biases and attention sinks exact",
    experts_on_disk=FusedOnDisk(interleaved=True, written_fused=True),
    adapt=adapt,
    refused=(  # blocks without the checkpoint's mxfp4 quantization_config (which `modelio` reads them by)
        (r"\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$", "gpt-oss experts stored as MXFP4 blocks in a checkpoint whose "
         "config.json does not say quantization_config.quant_method mxfp4: restore the hub's config.json"),
    ),
    refused_formats=(
        ("nvfp4", "stock vLLM 0.32's gpt-oss loader reads quantized experts per expert only as w13/w2 weight and weight_scale "
         "tensors, so NVFP4's per-expert weight_scale_2 and input_scale would not load: use --format mxfp4"),
    ),
    refused_awq="gpt-oss's clamped SwiGLU ((up + 1) · …) and expert biases admit no exact fold of AWQ scales: use --weight-algo rtn",
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[gpt_oss]",
)
