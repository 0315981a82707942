"""Qwen3.5 and Qwen3-Next: hybrid decoders whose layers alternate Gated DeltaNet linear attention
(``linear_attn``) and full attention, with a dense MLP (Qwen3.5) or mixture-of-experts (Qwen3.5-MoE,
Qwen3-Next); Qwen3.5 ships as a vision-language model (``Qwen3_5ForConditionalGeneration``).

Quantized, as vLLM's model files give the quantization config to them: the Gated DeltaNet input
projections (``in_proj_qkv`` + ``in_proj_z`` read one input and vLLM fuses them into
``in_proj_qkvz``; ``in_proj_b`` + ``in_proj_a`` into ``in_proj_ba``; Qwen3-Next stores both fused)
and ``out_proj``, the attention and MLP linears. Exact: the causal convolution
(``linear_attn.conv1d``), the state-space parameters (``A_log``, ``dt_bias``), the gated norm, the
vision part."""

from resserve_export.modeling.families.base import FUSED_EXPERTS, Family

_KEPT = (
    (r"\.linear_attn\.conv1d\.weight$", "is the Gated DeltaNet causal convolution, kept exact"),
)

FAMILY = Family(
    name="Qwen3.5 (vision-language, hybrid Gated DeltaNet + attention)",
    model_types=("qwen3_5", "qwen3_5_moe"),
    quantized="decoder linears incl. Gated DeltaNet in/out projections; conv1d, A_log, dt_bias, vision part exact",
    wrapper=True,
    exact=("visual", r"model\.visual", "mtp"),
    kept=_KEPT,
    refused=((r"\.experts\.(gate_up_proj|down_proj)$", FUSED_EXPERTS),),
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[qwen3_5]",
)

HYBRID_TEXT = Family(
    name="Qwen3.5 text, Qwen3-Next (hybrid Gated DeltaNet + attention)",
    model_types=("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"),
    quantized="decoder linears incl. Gated DeltaNet in/out projections; conv1d, A_log, dt_bias exact",
    exact=("mtp",),
    kept=_KEPT,
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[qwen3_5_text]",
)
