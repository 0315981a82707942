"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a vision transformer (``visual.…``) and its merger around a
Qwen2 / Qwen3 decoder. Qwen2/2.5-VL hub checkpoints name the decoder ``model.layers.…`` and the
vision part ``visual.…``; Qwen3-VL's ``model.language_model.layers.…`` and ``model.visual.…``.
The vision part stays exact.

Qwen3-VL-MoE stores its experts fused on disk (``experts.gate_up_proj`` ``[E, H, 2I]``, gate
then up, and ``experts.down_proj`` ``[E, I, H]``); they are read, quantized and written one linear
per expert (``experts.E.gate_proj`` …), the names vLLM's Qwen3-VL-MoE loader takes for quantized
experts."""

from resserve_export.modeling.families.base import Family, FusedOnDisk

_EXACT = ("visual", r"model\.visual")

QWEN2_VL = Family(
    name="Qwen2-VL, Qwen2.5-VL (vision-language)",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    quantized="the language model's decoder linears; vision transformer and merger exact",
    wrapper=True,
    exact=_EXACT,
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[qwen2_5_vl]",
)

QWEN3_VL = Family(
    name="Qwen3-VL (vision-language, dense)",
    model_types=("qwen3_vl",),
    quantized="the language model's decoder linears; vision transformer, mergers and deepstack mergers exact",
    wrapper=True,
    exact=_EXACT,
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[qwen3_vl]",
)

QWEN3_VL_MOE = Family(
    name="Qwen3-VL-MoE (vision-language, experts fused on disk)",
    model_types=("qwen3_vl_moe",),
    quantized="the language model's decoder linears, each expert's gate / up / down as its own linear; vision transformer, mergers and routers exact",
    wrapper=True,
    exact=_EXACT,
    experts_on_disk=FusedOnDisk(),
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[qwen3_vl_moe]",
)
