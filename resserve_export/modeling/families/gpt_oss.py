"""gpt-oss: experts fused on disk with biases (``mlp.experts.gate_up_proj`` ``[E, hidden, 2·I]``,
gate and up interleaved, and ``gate_up_proj_bias``), hub checkpoints with those experts as MXFP4
blocks (``…_blocks`` / ``…_scales``), attention sinks. Refused up front, naming the tensor, until
experts fused on disk are supported."""

from resserve_export.modeling.families.base import FUSED_EXPERTS, Family

FAMILY = Family(
    name="gpt-oss (refused: experts fused on disk, with biases)",
    model_types=("gpt_oss",),
    refused=(
        (r"\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$", "gpt-oss experts already quantized to MXFP4 blocks on disk; "
         "re-quantizing them is not supported yet"),
        (r"\.experts\.(gate_up_proj|down_proj)_bias$", "the biases of experts fused on disk (gpt-oss); quantizing experts stored "
         "fused is not supported yet"),
        (r"\.experts\.(gate_up_proj|down_proj)$", FUSED_EXPERTS),
    ),
    test="tests/stages/calibrate/test_moe_calibrate.py::test_gpt_oss_is_refused_before_any_work",
)
