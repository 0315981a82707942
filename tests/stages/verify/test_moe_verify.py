"""`verify` on mixture-of-experts checkpoints: every expert measured, experts emulated (unfusing keeps
the model), a wrong expert named."""

from __future__ import annotations

import pytest
import torch

from resserve_export.formats import nvfp4
from resserve_export.modeling import modelio
from resserve_export.modeling.experts import expert_blocks
from resserve_export.stages.pack.run import pack

from tests.fixtures.console import assert_one_line_error, leftovers, run_main
from tests.fixtures.moe import CUDA, TOP_K, calibrated

# The session's MoE models and their cached calibrations (tests.fixtures.moe) are built once:
# under pytest-xdist (--dist loadgroup) every MoE test runs on one worker.
pytestmark = pytest.mark.xdist_group("moe")



@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_verify_measures_every_expert(moe, arch, device, tmp_path):
    from resserve_export import api

    model, calib = moe["models"][arch], calibrated(moe, arch)
    ck = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    rep = api.verify(ck, str(model), calib=calib, text=str(moe["texts"]), samples=6, seq_len=48, device=device, out=tmp_path / "v").report
    assert rep["weights_match_reference"] is True
    blocks = expert_blocks(modelio.tensor_shapes(model))
    rows = {r["module"]: r for r in rep["layers"]}
    experts = [b.module(e, r) for b in blocks for e in range(b.num_experts) for r in ("gate", "up", "down")]
    assert set(experts) <= set(rows)
    for b in blocks:
        # each expert linear measured on the valid tokens routed to it: top-k of every token
        assert sum(rows[b.module(e, "gate")]["tokens"] for e in range(b.num_experts)) == rep["tokens_scored"] * TOP_K
        for e in range(b.num_experts):
            r = rows[b.module(e, "down")]
            assert 1e-3 < r["plain"] < 1e-1 and r["full"] < r["checkpoint"] < r["plain"]
    kinds = rep["nmse"]["by_kind"]
    assert {"expert gate/up", "expert down", "attention"} <= set(kinds)
    assert all(v["full"] < v["plain"] for v in kinds.values())
    assert (tmp_path / "v" / "verify.json").exists()


def test_verify_emulates_experts_and_unfusing_keeps_the_model(moe):
    """The perplexity passes run every expert linear emulated from the checkpoint; the per-expert
    view verify mounts computes what the fused model computes."""
    from resserve_export.storage.checkpoint import Checkpoint
    from resserve_export.algorithms.emulate import EmulatedLinear
    from resserve_export.modeling.experts import unfused
    from resserve_export.stages.verify.perplexity import emulated

    model = moe["models"]["mixtral"]
    ck_dir = pack(model, calibrated(moe, "mixtral"), moe["root"] / "ck-mixtral-verify", "nvfp4", ratio=0.25, progress=False).out
    net = modelio.load_model(model)
    net.config._experts_implementation = "eager"
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = net(input_ids=ids, use_cache=False).logits
        blocks = expert_blocks(modelio.tensor_shapes(model))
        with unfused(net, blocks):
            got = net(input_ids=ids, use_cache=False).logits
            ck = Checkpoint(ck_dir)
            with emulated(net, ck, "plain"):
                kinds = {m: type(net.get_submodule(m)) for m in ck.modules}
                emu = net(input_ids=ids, use_cache=False).logits
        after = net(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(after, ref)  # the fused experts are back
    assert set(kinds.values()) == {EmulatedLinear} and sum(".experts." in m for m in kinds) == 2 * 4 * 3
    assert not torch.allclose(emu, ref, atol=1e-3)
    assert not any("block_sparse_moe" in n for n, _ in net.named_modules())  # the holders are gone too


def test_verify_names_a_wrong_expert(moe, tmp_path):
    """A checkpoint whose one expert's weights were changed is a mismatch (exit 3) naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    model, calib = moe["models"]["qwen3_moe"], calibrated(moe, "qwen3_moe")
    ck = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    other = tmp_path / "other"
    shutil.copytree(model, other)
    f = next(other.glob("*.safetensors"))
    t = load_file(str(f))
    name = "model.layers.1.mlp.experts.6.down_proj.weight"
    t[name] = (t[name].float() * 1.5).to(torch.bfloat16)
    save_file(t, str(f), metadata={"format": "pt"})
    p = run_main("verify", str(ck), "--model", str(other), "--calib", str(calib), "--out", str(tmp_path / "v"), "--device", "cpu",
            "--text", str(moe["texts"]), "--samples", "2")
    assert_one_line_error(p, 3, "other weights", "--model")  # the fingerprint tells first
    assert leftovers(tmp_path / "v") == []
    # and the bit-for-bit check names the expert
    from resserve_export.storage.checkpoint import Checkpoint
    from resserve_export.modeling.experts import unfused
    from resserve_export.stages.verify.checks import linear_weights, weight_mismatches

    net = modelio.load_model(other)
    with unfused(net, expert_blocks(modelio.tensor_shapes(other))):
        bad = weight_mismatches(Checkpoint(ck), linear_weights(net, Checkpoint(ck)))
    assert [m for m, _ in bad] == ["model.layers.1.mlp.experts.6.down_proj"]
    p = run_main("verify", str(ck), "--model", str(model), "--out", str(tmp_path / "v"))
    assert_one_line_error(p, 2, "pass --calib")
