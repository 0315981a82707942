"""`pack --experts-layout hub`: gpt-oss's MXFP4 experts written as the hub's blocks and scales
(`storage.hub_experts`), the one FP4 layout whose expert biases stock vLLM 0.32 loads; `size`
counts it exactly; what it cannot be is refused before any work."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from resserve_export.api import size
from resserve_export.formats import ops as formats
from resserve_export.modeling import modelio
from resserve_export.modeling.families.gpt_oss import HUB_MXFP4_CONFIG, dequantize_mxfp4, hub_mxfp4_experts
from resserve_export.stages.inspect import inspect_checkpoint
from resserve_export.stages.pack.run import pack
from resserve_export.storage.checkpoint import read_checkpoint

from tests.fixtures.checkpoints import written_classes
from tests.fixtures.console import assert_one_line_error, leftovers, run_main
from tests.fixtures.moe import calibrated

pytestmark = pytest.mark.xdist_group("moe")

E, H, I = 4, 64, 64  # tests.fixtures.moe's gpt-oss
FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in modelio.weight_files(d):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("rounding", ["ceil", "even"])
def test_gpt_oss_packs_its_experts_in_the_hubs_mxfp4_layout(moe, tmp_path, rounding):
    """The experts of each layer as the hub's four tensors (uint8 blocks ``[E, 2I, H/32, 16]`` and
    E8M0 scales, gate and up rows interleaved): the hub reader `dequantize_mxfp4` and
    compressed-tensors (on the per-linear view the reader cuts from them) both decode every
    expert's gate / up / down to a fresh reference MXFP4 quantization of the source's; they are the
    per-expert checkpoint's codes and scales rearranged (`hub_mxfp4_experts`); every other tensor
    (attention linears too) is the source's, byte for byte; config.json carries the hub's
    quantization_config and our section; `size` counts exactly what was written."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    model = moe["models"]["gpt_oss"]
    calib = calibrated(moe, "gpt_oss", "routed")
    out = tmp_path / "hub"
    p = run_main("pack", str(model), "--calib", str(calib), "--out", str(out), "--format", "mxfp4", "--ratio", "0",
                 "--mx-scale", rounding, "--experts-layout", "hub", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-2000:]
    source, written = tensors(model), tensors(out)
    layers = [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
    hub_names = {f"{p}.{n}" for p in layers for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")}
    copied = {k for k in source if not FUSED.search(k)}
    assert set(written) == copied | hub_names
    assert all(raw(written[k]) == raw(source[k]) and written[k].dtype == source[k].dtype for k in copied)  # attention in bf16, biases, sinks
    assert any(".self_attn.q_proj.weight" in k for k in copied) and any(k.endswith("gate_up_proj_bias") for k in copied)

    per_expert = pack(model, calib, tmp_path / "per-expert", "mxfp4", ratio=0.0, mx_scale=rounding, progress=False).out
    rearranged = hub_mxfp4_experts(tensors(per_expert))
    assert set(rearranged) == hub_names and all(torch.equal(rearranged[k], written[k]) for k in hub_names)

    ck = read_checkpoint(out)
    assert sorted(ck) == sorted(f"{p}.{e}.{m}" for p in layers for e in range(E) for m in ("gate_proj", "up_proj", "down_proj"))
    ct = json.loads((per_expert / "config.json").read_text())["quantization_config"]  # compressed-tensors' MXFP4 scheme
    ct.pop("resserve")
    scheme = QuantizationConfig.model_validate(ct).config_groups["group_0"]
    for p in layers:
        gu_b, gu_s, dn_b, dn_s = (written[f"{p}.{n}"] for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"))
        assert (gu_b.shape, gu_s.shape, dn_b.shape, dn_s.shape) == ((E, 2 * I, H // 32, 16), (E, 2 * I, H // 32), (E, H, I // 32, 16), (E, H, I // 32))
        assert {t.dtype for t in (gu_b, gu_s, dn_b, dn_s)} == {torch.uint8}
        gu, dn = dequantize_mxfp4(gu_b, gu_s), dequantize_mxfp4(dn_b, dn_s)  # [E, H, 2I] interleaved, [E, I, H]: as the bf16 source
        src_gu, src_dn = source[f"{p}.gate_up_proj"], source[f"{p}.down_proj"]
        for e in range(E):
            for m, w, got in (("gate_proj", src_gu[e][:, 0::2].t(), gu[e][:, 0::2].t()), ("up_proj", src_gu[e][:, 1::2].t(), gu[e][:, 1::2].t()),
                              ("down_proj", src_dn[e].t(), dn[e].t())):
                ref = formats.quantize(w.contiguous(), "mxfp4", backend="reference", rounding=rounding)
                assert torch.equal(got.float(), ref.dequantize()), (p, e, m)
                q = ck[f"{p}.{e}.{m}"].base
                assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales), (p, e, m)
                dec = MXFP4PackedCompressor.decompress({"weight_packed": q.codes, "weight_scale": q.scales}, scheme)
                assert torch.equal(dec["weight"].float(), ref.dequantize()), (p, e, m)

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    section = qc.pop("resserve")
    assert qc == HUB_MXFP4_CONFIG
    assert section["experts_layout"] == "hub" and section["element_format"] == "mxfp4" and section["mx_scale_rounding"] == rounding
    assert {m for g in section["groups"] for m in g["members"]} == set(ck) and {g["ratio"] for g in section["groups"]} == {0.0}
    names = {f.name for f in out.iterdir()}
    assert "resserve.safetensors.index.json" not in names and "hf_quant_config.json" not in names and "tokenizer.json" in names
    assert not any(n.startswith("resserve-") for n in names)

    rep = size(model / "config.json", "mxfp4", ratio=0.0, experts_layout="hub")
    w = written_classes(out)
    assert {k: rep.classes[k] for k in w} == w
    assert w["quantized linears"] == sum(written[k].numel() for k in hub_names)
    assert rep.total == sum(f.stat().st_size for f in out.iterdir() if f.name != "config.json") + (model / "config.json").stat().st_size
    assert inspect_checkpoint(out)["bytes"]["quantized_linears"] == w["quantized linears"]

    p = run_main("verify", str(out), "--model", str(model), "--calib", str(calib), "--device", "cpu")
    assert_one_line_error(p, 2, "hub's MXFP4 layout", "W4A16", "without --experts-layout hub")


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--format", "nvfp4", "--ratio", "0"], ["--experts-layout hub writes the hub's MXFP4 expert blocks, not nvfp4", "--format mxfp4"]),
        (["--format", "mxfp4", "--ratio", "0.25"], ["no residue-compensation sidecar", "--ratio 0"]),
        (["--format", "mxfp4", "--plan", "plan.json"], ["no residue-compensation sidecar", "--ratio 0"]),
        (["--format", "mxfp4", "--ratio", "0", "--kv-cache", "fp8"], ["no KV-cache scales", "--kv-cache none"]),
        (["--format", "mxfp4", "--ratio", "0", "--experts-layout", "fused"], ["unknown --experts-layout 'fused'", "per-expert, hub"]),
        (["--format", "mxfp4", "--ratio", "0", "--model", "qwen3_moe"], ["is the layout of gpt-oss's hub checkpoints", "'qwen3_moe'", "nothing was packed"]),
    ],
)
def test_the_hub_layout_is_refused_where_it_cannot_be_written(moe, tmp_path, args, needles):
    """One line that says why and what to do, exit code 2, nothing written: another format, a
    ratio or plan (no sidecar), KV-cache scales, an unknown layout, a model that is not gpt-oss;
    all before the calibration is read (there is none here)."""
    args = list(args)
    arch = "gpt_oss"
    if "--model" in args:
        i = args.index("--model")
        arch = args.pop(i + 1)
        args.pop(i)
    if "--experts-layout" not in args:
        args += ["--experts-layout", "hub"]
    out = tmp_path / "ck"
    # no calibration: every refusal comes before it is read
    p = run_main("pack", str(moe["models"][arch]), "--calib", str(tmp_path / "calib"), "--out", str(out), "--device", "cpu", *args)
    assert_one_line_error(p, 2, *needles)
    assert leftovers(out) == []
    if "--plan" not in args and "--ratio" in args:  # size refuses alike, from config.json alone
        size_args = [a for a in args if a != "--device"]
        p = run_main("size", str(moe["models"][arch] / "config.json"), *size_args)
        assert_one_line_error(p, 2, *needles[:1])
