"""`calibrate` on mixture-of-experts models: Qwen2-MoE's shared expert and its gate, grad scores for
every expert, gpt-oss's experts fused on disk, and what MoE calibration refuses (options it does not support yet)."""

from __future__ import annotations

import json

import pytest
import torch

from resserve_export.formats import nvfp4
from resserve_export.modeling import modelio
from resserve_export.modeling.experts import expert_blocks
from resserve_export.stages.pack.run import pack
from resserve_export.storage.checkpoint import read_checkpoint

from tests.fixtures.console import assert_one_line_error, leftovers, run_main
from tests.fixtures.moe import calibrated
from tests.fixtures.tiny import make_calibration

# The session's MoE models and their cached calibrations (tests.fixtures.moe) are built once:
# under pytest-xdist (--dist loadgroup) every MoE test runs on one worker.
pytestmark = pytest.mark.xdist_group("moe")



def test_qwen2_moe_shared_expert_and_its_gate(moe, tmp_path):
    """Qwen2-MoE: the shared expert (read as [B·T, H] rows) is a dense MLP calibrated without
    padding; its sigmoid gate stays bf16 and unquantized, like the router."""
    model = moe["models"]["qwen2_moe"]
    calib = calibrated(moe, "qwen2_moe")
    rec = json.loads((calib / "calibration.json").read_text())
    assert ["model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj"] in rec["groups"]
    assert not any("shared_expert_gate" in m for g in rec["groups"] for m in g)
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["ignore"] == ["lm_head"] + [f"model.layers.{i}.mlp.{x}" for i in (0, 1) for x in ("gate", "shared_expert_gate")]
    packed = read_checkpoint(out)
    assert "model.layers.1.mlp.shared_expert.down_proj" in packed and "model.layers.1.mlp.experts.3.down_proj" in packed


def test_gpt_oss_experts_are_quantized_per_expert_from_their_interleaved_layout(moe, tmp_path):
    """gpt-oss's experts fused on disk (gate_up_proj [E, H, 2I], gate and up interleaved, with
    biases): the adapted experts compute what transformers' do; each expert's gate (even columns),
    up (odd columns) and down are quantized as the reference quantizes that linear; they are
    written as vLLM's gpt-oss loader reads them (w13 = gate and up rows interleaved, transposed);
    biases, router, sinks and norms are copied byte for byte."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from resserve_export.formats import ops as formats
    from resserve_export.modeling import families

    model = moe["models"]["gpt_oss"]
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 12))
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ref = net(ids).logits
    families.adapt(net, json.loads((model / "config.json").read_text()))
    assert type(net.model.layers[0].mlp.experts).__name__ == "GptOssRoutedExperts"
    torch.testing.assert_close(net(ids).logits, ref, rtol=1e-5, atol=1e-5)

    calib = calibrated(moe, "gpt_oss", "routed")
    out = pack(model, calib, tmp_path / "ck", "mxfp4", ratio=0.25, progress=False).out
    src = load_file(str(model / "model.safetensors"))
    written = {k: t for f in out.glob("model-*.safetensors") for k, t in load_file(str(f)).items()}
    ck = read_checkpoint(out)
    n = 0
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts"
        gu, dn = src[f"{p}.gate_up_proj"], src[f"{p}.down_proj"]
        for e in range(gu.shape[0]):
            w = {"gate_proj": gu[e][:, 0::2].T, "up_proj": gu[e][:, 1::2].T, "down_proj": dn[e].T}
            q = {}
            for m, wm in w.items():
                q[m] = formats.quantize(wm.contiguous(), "mxfp4", backend="reference")
                got = ck[f"{p}.{e}.{m}"].base
                assert torch.equal(got.codes, q[m].codes) and torch.equal(got.scales, q[m].scales)
                n += 1
            w13 = written[f"{p}.{e}.w13_weight_packed"]
            assert torch.equal(w13[:, 0::2].T, q["gate_proj"].codes) and torch.equal(w13[:, 1::2].T, q["up_proj"].codes)
            assert torch.equal(written[f"{p}.{e}.w2_weight_scale"].T, q["down_proj"].scales)
        for k in (f"{p}.gate_up_proj_bias", f"{p}.down_proj_bias", f"model.layers.{layer}.mlp.router.weight",
                  f"model.layers.{layer}.mlp.router.bias", f"model.layers.{layer}.self_attn.sinks", f"model.layers.{layer}.input_layernorm.weight"):
            assert torch.equal(written[k].view(torch.uint8), src[k].view(torch.uint8)), k
    assert n == 2 * 4 * 3
    assert not any(k.endswith((".gate_up_proj", ".down_proj")) for k in written)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.router" in cfg["ignore"]
    # routed statistics: every expert's gate/up input is its routed tokens', its down input the clamped SwiGLU's
    rec = json.loads((calib / "calibration.json").read_text())
    assert sum(rec["moe"]["blocks"]["model.layers.0.mlp.experts"]["routed_tokens"]) > 0


def _hub_mxfp4(src, dst):
    """`src` (gpt-oss in bf16) as openai/gpt-oss-20b ships it: each layer's experts as MXFP4
    blocks (``gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16], ``_scales`` [E, 2I, H/32]; down
    alike), quantized here with this tool's MXFP4 quantizer, and ``quantization_config: mxfp4``."""
    import shutil

    from safetensors.torch import load_file, save_file

    from resserve_export.formats import ops as formats

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for k in [k for k in tensors if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        w = tensors.pop(k).transpose(1, 2)  # [E, out, in]: the blocks' rows are output units
        qs = [formats.quantize(w[e].contiguous(), "mxfp4", backend="reference") for e in range(w.shape[0])]
        tensors[f"{k}_blocks"] = torch.stack([q.codes for q in qs]).reshape(*w.shape[:2], -1, 16)
        tensors[f"{k}_scales"] = torch.stack([q.scales for q in qs])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, tensors


def test_gpt_oss_hub_checkpoint_with_mxfp4_blocks_is_read_exactly(moe, tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 blocks on disk: the blocks dequantize to
    exactly what transformers' own dequantization gives (and to the FP4 values they encode), the
    model calibrates and packs from them, every other tensor is copied byte for byte, and `size`
    from its config.json equals what pack wrote."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from resserve_export.formats import ops as formats
    from resserve_export.formats.qtensor import FP4Tensor
    from resserve_export.modeling.families import gpt_oss
    from resserve_export.stages.size import estimate
    from tests.fixtures.checkpoints import written_classes

    hub, stored = _hub_mxfp4(moe["models"]["gpt_oss"], tmp_path / "hub")
    p = "model.layers.1.mlp.experts"
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = stored[f"{p}.{proj}_blocks"], stored[f"{p}.{proj}_scales"]
        ours = gpt_oss.dequantize_mxfp4(blocks, scales)
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
        codes = FP4Tensor("mxfp4", blocks[2].reshape(blocks.shape[1], -1), scales[2], None)
        assert torch.equal(ours[2].T.float(), codes.dequantize())
    calib = tmp_path / "c"
    run = run_main("calibrate", str(hub), "--out", str(calib), "--dataset", str(moe["texts"]), "--num-samples", "4", "--seq-len", "32",
                   "--batch-size", "2", "--device", "cpu", "--scores", "none")
    assert run.returncode == 0, run.stderr
    out = pack(hub, calib, tmp_path / "ck", "mxfp4", ratio=0.25, progress=False).out
    bf16 = modelio.resolve_model(hub)
    assert bf16 != hub and not (json.loads((bf16 / "config.json").read_text())).get("quantization_config")
    copy = load_file(str(modelio.weight_files(bf16)[0]))
    ck = read_checkpoint(out)
    gu = gpt_oss.dequantize_mxfp4(stored[f"{p}.gate_up_proj_blocks"], stored[f"{p}.gate_up_proj_scales"])
    assert torch.equal(copy[f"{p}.gate_up_proj"], gu)
    for e in range(gu.shape[0]):
        for m, w in (("gate_proj", gu[e][:, 0::2].T), ("up_proj", gu[e][:, 1::2].T)):
            q = formats.quantize(w.contiguous(), "mxfp4", backend="reference")
            assert torch.equal(ck[f"{p}.{e}.{m}"].base.codes, q.codes) and torch.equal(ck[f"{p}.{e}.{m}"].base.scales, q.scales)
    written = {k: t for f in out.glob("model-*.safetensors") for k, t in load_file(str(f)).items()}
    for k, t in stored.items():
        if not gpt_oss.MXFP4_BLOCKS.match(k) and not k.endswith("_scales") and k.rsplit(".", 1)[0] not in {m for m in ck}:
            assert torch.equal(written[k].view(torch.uint8), t.view(torch.uint8)), k
    cfg = json.loads((hub / "config.json").read_text())
    rep = estimate(cfg, "mxfp4", ratio=0.25)
    got = written_classes(out)
    assert {k: rep.classes[k] for k in got} == got


def test_gpt_oss_refuses_nvfp4_awq_and_unlabelled_mxfp4_blocks_before_any_work(moe, tmp_path):
    """What gpt-oss cannot get is refused in one line, before anything is written: NVFP4 (stock
    vLLM's gpt-oss loader has no per-expert name for its scales), AWQ (no exact fold through the
    clamped SwiGLU and biases), and MXFP4 blocks in a checkpoint whose config does not say so,
    named."""
    from resserve_export.core.errors import UserError
    from resserve_export.modeling import families

    model = moe["models"]["gpt_oss"]
    calib = calibrated(moe, "gpt_oss", "routed")
    p = run_main("pack", str(model), "--calib", str(calib), "--out", str(tmp_path / "ck"), "--format", "nvfp4", "--ratio", "0", "--device", "cpu")
    assert_one_line_error(p, 2, "--format nvfp4 is not written for gpt-oss", "weight_scale_2", "--format mxfp4", "nothing was packed")
    assert leftovers(tmp_path / "ck") == []
    p = run_main("calibrate", str(model), "--out", str(tmp_path / "c"), "--config", "quick", "--device", "cpu", "--scores", "none",
                 "--weight-algo", "awq")
    assert_one_line_error(p, 2, "--weight-algo awq", "clamped SwiGLU", "nothing was calibrated")
    assert leftovers(tmp_path / "c") == []
    blocks = {"model.layers.0.mlp.experts.gate_up_proj_blocks": ("U8", (4, 128, 2, 16)),
              "model.layers.0.mlp.experts.gate_up_proj_scales": ("U8", (4, 128, 2))}
    with pytest.raises(UserError, match=r"^model.layers.0.mlp.experts.gate_up_proj_blocks is a 4-D tensor \[4, 128, 2, 16\]: gpt-oss experts stored as MXFP4 blocks in a checkpoint whose config.json does not say"):
        families.check_tensors(blocks, "packed")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--scores", "none", "--pipeline", "sequential"], "--pipeline sequential does not run mixture-of-experts models yet"),
        (["--scores", "none", "--moe-calib", "some"], "--moe-calib must be one of all, routed"),
    ],
)
def test_calibrate_refuses_what_moe_does_not_do_yet(moe, tmp_path, extra, needle):
    out = tmp_path / "calib"
    p = run_main("calibrate", str(moe["models"]["qwen3_moe"]), "--out", str(out), "--config", "quick", "--device", "cpu", *extra)
    assert_one_line_error(p, 2, needle)
    assert leftovers(out) == []


def test_grad_scores_cover_every_expert(moe, moe_scored):
    sc = json.loads((moe_scored / "scores.json").read_text())
    rec = json.loads((moe_scored / "calibration.json").read_text())
    assert [g["modules"] for g in sc["groups"]] == rec["groups"]
    blocks = expert_blocks(modelio.tensor_shapes(moe["models"]["qwen3_moe"]))
    by_head = {g["modules"][0]: g for g in sc["groups"]}
    for b in blocks:
        for e in range(b.num_experts):
            for role in ("gate", "down"):
                g = by_head[b.module(e, role)]
                s = {float(k): v for k, v in g["scores"].items()}
                assert g["weight_count"] == (2 if role == "gate" else 1) * b.hidden * b.intermediate
                # an expert's error falls as compensation rises, and full beats plain by far
                assert all(v >= 0 for v in s.values()) and s[1.0] < 0.8 * s[0.0]
