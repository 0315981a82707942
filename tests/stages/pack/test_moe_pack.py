"""`pack` on mixture-of-experts models: every expert quantized as the reference, in the layouts vLLM
loads; the loaders decode expert tensors; CUDA writes the CPU bytes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from resserve_export.algorithms.selection import mask_to_bool
from resserve_export.formats import ops as formats
from resserve_export.formats import nvfp4
from resserve_export.modeling import modelio
from resserve_export.modeling.experts import expert_blocks
from resserve_export.stages.pack.run import pack
from resserve_export.storage.checkpoint import read_checkpoint

from tests.fixtures.checkpoints import assert_loaders_decode, source_tensors, topk_mask_bool
from tests.fixtures.moe import ARCHS, CUDA, calibrated
from tests.fixtures.tensors import bits

# The session's MoE models and their cached calibrations (tests.fixtures.moe) are built once:
# under pytest-xdist (--dist loadgroup) every MoE test runs on one worker.
pytestmark = pytest.mark.xdist_group("moe")



@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_pack_quantizes_every_expert_as_the_reference(moe, arch, fmt, tmp_path):
    model, calib = moe["models"][arch], calibrated(moe, arch)
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=0.25, progress=False).out
    src, packed = source_tensors(model), read_checkpoint(out)
    with safe_open(str(calib / "salience.safetensors"), "pt") as h:
        stats = {k: h.get_tensor(k) for k in h.keys()}
    shapes = modelio.tensor_shapes(model)
    blocks = expert_blocks(shapes)
    n_experts = 0
    for b in blocks:
        for e in range(b.num_experts):
            for members in ((b.module(e, "gate"), b.module(e, "up")), (b.module(e, "down"),)):
                ws = [src[f"{m}.weight"] for m in members]
                alpha = nvfp4.global_scale(torch.stack([w.abs().amax().float() for w in ws]).max()) if fmt == "nvfp4" else None
                mask = topk_mask_bool(stats[f"{members[0]}.mean_abs"], 2)  # the expert's own salience
                for m, w in zip(members, ws):
                    p = packed[m]
                    assert p.members == members and p.ratio == 0.25
                    ref = formats.quantize(w, fmt, alpha=alpha, backend="reference")
                    assert torch.equal(p.base.codes, ref.codes) and torch.equal(bits(p.base.scales), bits(ref.scales))
                    assert torch.equal(mask_to_bool(p.mask), mask)
                    if fmt == "nvfp4":  # gate and up share weight_scale_2 (vLLM's w13) and input_scale
                        assert torch.equal(bits(p.base.global_scale), bits(alpha))
                        want = nvfp4.global_scale(stats[f"{members[0]}.amax"]).reshape(())
                        assert torch.equal(bits(p.input_scale), bits(want))
                n_experts += 1
    assert n_experts == sum(2 * b.num_experts for b in blocks)
    # routers (and DeepSeek's correction bias) are stored as they were, and named unquantized
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    routers = [b.prefix.rsplit(".", 1)[0] + ".gate" for b in blocks]
    assert cfg["ignore"] == ["lm_head", *routers]
    if fmt == "nvfp4":
        assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"] == ["lm_head", *routers]
    stored = {}
    for f in out.glob("model-*.safetensors"):
        with safe_open(str(f), "pt") as h:
            stored.update({k: h.get_tensor(k) for k in h.keys() if ".gate." in k or k.endswith(".gate.weight")})
    for r in routers:
        assert stored[f"{r}.weight"].dtype == torch.bfloat16 and torch.equal(stored[f"{r}.weight"], src[f"{r}.weight"])
    # every quantized tensor of the checkpoint is accounted for: attention and dense MLPs too
    from resserve_export.modeling.groups import group_linears, linears_from_shapes

    assert sorted(packed) == sorted(m for g in group_linears(linears_from_shapes(shapes)) for m in g.modules)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pack --device cuda)")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_pack_of_experts_writes_the_cpu_bytes(moe, fmt, tmp_path):
    model, calib = moe["models"]["deepseek_v3"], calibrated(moe, "deepseek_v3")
    cpu = pack(model, calib, tmp_path / "cpu", fmt, ratio=0.25, progress=False).out
    gpu = pack(model, calib, tmp_path / "gpu", fmt, ratio=0.25, device="cuda", progress=False).out
    names = sorted(p.name for p in cpu.iterdir())
    assert names == sorted(p.name for p in gpu.iterdir()) and any(n.endswith(".safetensors") for n in names)
    for n in names:
        assert (cpu / n).read_bytes() == (gpu / n).read_bytes(), n


def test_loaders_decode_expert_tensors(moe, tmp_path):
    """ModelOpt's NVFP4 and compressed-tensors' MXFP4 decoders read an expert's tensors as ours."""
    model, calib = moe["models"]["qwen3_moe"], calibrated(moe, "qwen3_moe")
    assert_loaders_decode(model, calib, tmp_path, ["model.layers.1.mlp.experts.5.up_proj", "model.layers.0.mlp.experts.2.down_proj"])
