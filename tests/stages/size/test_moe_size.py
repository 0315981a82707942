"""`size` of mixture-of-experts models from their config: what `pack` writes, every expert counted,
gpt-oss's experts fused on disk included."""

from __future__ import annotations

import json

import pytest
import torch

from resserve_export.core.errors import UserError
from resserve_export.formats import nvfp4
from resserve_export.modeling import modelio
from resserve_export.stages.pack.run import pack
from resserve_export.stages.inspect import inspect_checkpoint
from resserve_export.stages.size import estimate

from tests.fixtures.checkpoints import written_classes
from tests.fixtures.moe import ARCHS
from tests.fixtures.tiny import make_calibration

# The session's MoE models and their cached calibrations (tests.fixtures.moe) are built once:
# under pytest-xdist (--dist loadgroup) every MoE test runs on one worker.
pytestmark = pytest.mark.xdist_group("moe")



@pytest.mark.parametrize("fmt,ratio", [("nvfp4", 0.25), ("mxfp4", 0.125), ("nvfp4", 0.0)])
@pytest.mark.parametrize("arch", ARCHS)
def test_size_equals_what_pack_writes(moe, arch, fmt, ratio, tmp_path):
    from resserve_export.stages.size import shapes_from_config

    model = moe["models"][arch]
    cfg = json.loads((model / "config.json").read_text())
    assert shapes_from_config(cfg) == modelio.tensor_shapes(model)  # names, dtypes and shapes, every tensor
    calib = make_calibration(model, tmp_path / "c")
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=ratio, progress=False).out
    rep = estimate(cfg, fmt, ratio=ratio)
    got = written_classes(out)
    assert {k: rep.classes[k] for k in got} == got and got["quantized linears"] > 0


@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_size_of_gpt_oss_equals_what_pack_writes(moe, ratio, tmp_path):
    """gpt-oss's experts, fused on disk and written fused per expert (w13 / w2), and their biases:
    size from config.json counts what pack writes in MXFP4; NVFP4, which pack refuses for gpt-oss,
    size refuses too, in one line."""
    model = moe["models"]["gpt_oss"]
    cfg = json.loads((model / "config.json").read_text())
    calib = make_calibration(model, tmp_path / "c")
    out = pack(model, calib, tmp_path / "ck", "mxfp4", ratio=ratio, progress=False).out
    got = written_classes(out)
    rep = estimate(cfg, "mxfp4", ratio=ratio)
    assert {k: rep.classes[k] for k in got} == got and got["quantized linears"] > 0
    # inspect counts an expert's gate and up once each, though both are read from its one w13 tensor
    from resserve_export.storage.safetensors import SafetensorsFiles

    on_disk = SafetensorsFiles(list(out.glob("model-*.safetensors"))).entries
    for g in inspect_checkpoint(out)["groups"]:
        if ".experts." in g["members"][0]:
            expert, fused = g["members"][0].rsplit(".", 1)[0], "w2" if g["members"][0].endswith("down_proj") else "w13"
            assert g["base_bytes"] == sum(on_disk[f"{expert}.{fused}_{s}"].nbytes for s in ("weight_packed", "weight_scale"))
    with pytest.raises(UserError, match=r"^--format nvfp4 is not written for gpt-oss: .*nothing was estimated$"):
        estimate(cfg, "nvfp4", ratio=0.0)


def test_size_of_a_qwen3_moe_config_counts_every_expert():
    """Qwen3-30B-A3B's shape: 48 layers of 128 experts (768 wide) under NVFP4, from its config alone."""
    cfg = {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    }
    rep = estimate(cfg, "nvfp4", ratio=0.0)
    experts = 48 * 128 * 3 * 768 * 2048
    attn = 48 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048)
    # NVFP4: 4.5 bits per weight plus two FP32 scalars per linear
    assert rep.classes["quantized linears"] == (experts + attn) * 9 // 16 + 8 * 48 * (128 * 3 + 4)
    # the routers stay bf16
    assert rep.classes["norms & biases"] >= 48 * 128 * 2048 * 2
