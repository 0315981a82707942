"""Mixture-of-experts structure: the fused expert parameters transformers loads are the checkpoint's
per-expert tensors; layouts that cannot be quantized completely are refused up front."""

from __future__ import annotations

import pytest
import torch

from resserve_export.core.errors import UserError
from resserve_export.modeling import modelio
from resserve_export.modeling.experts import expert_blocks, fused_modules

from tests.fixtures.checkpoints import source_tensors
from tests.fixtures.moe import ARCHS

# The session's MoE models and their cached calibrations (tests.fixtures.moe) are built once:
# under pytest-xdist (--dist loadgroup) every MoE test runs on one worker.
pytestmark = pytest.mark.xdist_group("moe")



@pytest.mark.parametrize("arch", ARCHS)
def test_fused_parameters_are_the_checkpoint_experts(moe, arch):
    """The blocks found in the headers name the experts as the checkpoint does, and the loaded
    model's fused parameters hold exactly those weights (gate rows first), expert by expert."""
    model = moe["models"][arch]
    blocks = expert_blocks(modelio.tensor_shapes(model))
    want_leaves = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    layers = [1] if arch == "deepseek_v3" else [0, 1]  # DeepSeek's first layer is dense
    assert [b.layer for b in blocks] == layers and all(b.leaves == want_leaves for b in blocks)
    net = modelio.load_model(model)
    src = source_tensors(model)
    for b, mod in fused_modules(net, blocks).items():
        blk = next(x for x in blocks if x.prefix == b)
        for e in range(blk.num_experts):
            I = blk.intermediate
            assert torch.equal(mod.gate_up_proj[e, :I], src[blk.module(e, "gate") + ".weight"])
            assert torch.equal(mod.gate_up_proj[e, I:], src[blk.module(e, "up") + ".weight"])
            assert torch.equal(mod.down_proj[e], src[blk.module(e, "down") + ".weight"])


def test_expert_layouts_that_cannot_be_quantized_completely_are_refused():
    base = {"model.layers.0.mlp.experts.0.gate_proj.weight": ("BF16", (32, 64)), "model.layers.0.mlp.experts.0.up_proj.weight": ("BF16", (32, 64))}
    with pytest.raises(UserError, match="not gate / up / down"):
        expert_blocks(base)
    with pytest.raises(UserError, match="numbers its experts"):
        expert_blocks({**base, "model.layers.0.mlp.experts.0.down_proj.weight": ("BF16", (64, 32)),
                       "model.layers.0.mlp.experts.2.down_proj.weight": ("BF16", (64, 32))})
    with pytest.raises(UserError, match="unlike expert 0"):
        expert_blocks({**base, "model.layers.0.mlp.experts.0.down_proj.weight": ("BF16", (64, 32)),
                       **{f"model.layers.0.mlp.experts.1.{x}.weight": ("BF16", (32, 64)) for x in ("gate_proj", "up_proj", "down_proj")}})
