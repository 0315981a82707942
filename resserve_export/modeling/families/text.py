"""Decoder-only language models with the generic layout: Llama, Mistral, Qwen2 / Qwen3, Gemma 1-3
text, Phi-3, Granite, Cohere 2, OLMo 2 and the mixture-of-experts families with experts stored
per expert (Mixtral, Qwen2/3-MoE, GLM-4.5 MoE, DeepSeek-V3).

Every 2-D linear weight is quantized except embeddings, ``lm_head`` and routers; q/k/v and
gate/up form one decision group each. Experts stored per expert on disk are quantized per expert
(`modeling.experts`)."""

from resserve_export.modeling.families.base import Family

FAMILY = Family(
    name="Decoder-only LMs (Llama, Mistral, Qwen2/3, Gemma 1-3 text, Phi-3, Granite, Cohere 2, OLMo 2; "
    "Mixtral, Qwen2/3-MoE, GLM-4.5 MoE, DeepSeek-V3)",
    model_types=(),
    test="tests/stages/pack/test_pack.py"  # SmolLM2 and tiny Llamas; MoE: tests/stages/pack/test_moe_pack.py,
)
