"""Llama 4 (Scout, Maverick), text and multimodal: every MoE layer stores its experts fused on disk
(``feed_forward.experts.gate_up_proj`` ``[E, hidden, 2·intermediate]`` and ``down_proj``), which is
refused up front, naming the tensor, until experts fused on disk are supported."""

from resserve_export.modeling.families.base import FUSED_EXPERTS, Family

FAMILY = Family(
    name="Llama 4 (refused: experts fused on disk)",
    model_types=("llama4", "llama4_text"),
    wrapper=True,
    exact=("vision_model", "multi_modal_projector", r"model\.vision_model"),
    refused=((r"\.experts\.(gate_up_proj|down_proj)$", FUSED_EXPERTS),),
    test="tests/modeling/families/test_families.py::test_experts_fused_on_disk_are_refused_naming_the_tensor",
)
