"""The model families with an adapter (vision-language wrappers, hybrid decoders), each on a tiny
random model saved with hub-style names: calibrate -> pack (NVFP4 and MXFP4) -> size, and the
refusals of the layouts not supported yet.

Per family: the quantized linears are exactly the language model's decoder linears (the expected
set is derived here from the tensor names, not from the adapters); every other source tensor is
copied byte for byte (the vision tower, the projector, convolutions, state-space parameters,
norms); the quantized ones decode with ModelOpt (NVFP4) and compressed-tensors (MXFP4) to ours;
`size` from config.json alone equals the bytes `pack` wrote; the processor files are carried over.

Four calibration samples of 32 tokens and no planner scores: what is asserted (which tensors are
quantized, bytes, decoders) does not depend on how many tokens the statistics saw.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from resserve_export.api import calibrate
from resserve_export.core.errors import UserError
from resserve_export.modeling import families as fam
from resserve_export.modeling import modelio
from resserve_export.stages.pack.run import pack
from resserve_export.stages.size import estimate, shapes_from_config
from resserve_export.api import verify
from resserve_export.storage.checkpoint import read_checkpoint

from tests.fixtures.checkpoints import written_classes
from tests.fixtures.families import EXACT, REFUSED, SUPPORTED
from tests.fixtures.models import varied_texts, write_jsonl

pytestmark = pytest.mark.xdist_group("families")


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("texts") / "t.jsonl", varied_texts(8))


_CALIBRATED: dict[str, Path] = {}


def calibrated(families, name: str, texts: Path, root: Path) -> Path:
    if name not in _CALIBRATED:
        out = root / f"calib-{name}"
        calibrate(str(families[name]), out, dataset=str(texts), num_samples=4, seq_len=32, batch_size=2, scores="none", progress=False)
        _CALIBRATED[name] = out
    return _CALIBRATED[name]


def expected_quantized(name: str, shapes) -> set[str]:
    """The language model's decoder linears: 2-D ``.weight`` tensors inside decoder layers, outside
    the family's exact prefixes (vision tower, projector), routers (``mlp.gate``) excepted; experts
    fused on disk (``experts.gate_up_proj`` / ``down_proj``, E experts) count as E gate / up / down
    linears. `shapes`: as stored."""
    out = set()
    for k, (_, shape) in shapes.items():
        if k.endswith((".experts.gate_up_proj", ".experts.down_proj")) and len(shape) == 3:
            leaves = ("gate_proj", "up_proj") if k.endswith("gate_up_proj") else ("down_proj",)
            out |= {f"{k.rsplit('.', 1)[0]}.{e}.{leaf}" for e in range(shape[0]) for leaf in leaves}
            continue
        if k.endswith((".mlp.gate.weight", ".feed_forward.router.weight", ".mlp.router.weight", ".mlp.shared_expert_gate.weight")):  # routers, the shared expert's gate
            continue
        model_level = k.endswith("per_layer_model_projection.weight")  # Gemma 4: vLLM quantizes it too
        if not k.endswith(".weight") or len(shape) != 2 or k.startswith(EXACT[name]) or (".layers." not in k and not model_level):
            continue
        if "norm" in k.rsplit(".", 2)[-2]:
            continue
        out.add(k[: -len(".weight")])
    return out


def raw(files: list[Path]) -> dict[str, bytes]:
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k).contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
    return out


@pytest.mark.parametrize("name", SUPPORTED)
def test_family_packs_its_language_model_and_copies_the_rest(families, name, texts, tmp_path_factory, tmp_path):
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    import torch

    model = families[name]
    shapes = modelio.tensor_shapes(model)
    calib = calibrated(families, name, texts, tmp_path_factory.mktemp("c"))
    want = expected_quantized(name, modelio.stored_shapes(model))
    got = {m for g in json.loads((calib / "calibration.json").read_text())["groups"] for m in g}
    assert got == want and want

    source = raw(modelio.weight_files(model))
    for fmt in ("mxfp4",) if name == "gpt_oss" else ("nvfp4", "mxfp4"):  # gpt-oss: NVFP4 refused (test_moe_calibrate)
        out = pack(model, calib, tmp_path / fmt, fmt, ratio=0.25, progress=False).out
        written = raw(modelio.weight_files(out))
        # experts fused on disk are quantized one linear per expert (parts of the stored tensor)
        fused = {p.source for p in fam.expert_parts(json.loads((model / "config.json").read_text()), modelio.stored_shapes(model)).values()}
        assert bool(fused) == name.startswith(("qwen3_vl_moe", "llama4", "gpt_oss"))
        quantized = {k for k in source if k.endswith(".weight") and k[: -len(".weight")] in want} | fused
        copied = set(source) - quantized
        assert copied <= set(written) and all(written[k] == source[k] for k in copied)  # byte for byte, keys as on disk
        assert any(k.startswith(EXACT[name]) for k in copied) or not EXACT[name]
        ck = read_checkpoint(out)
        assert set(ck) == want
        cfg = json.loads((out / "config.json").read_text())
        qc = cfg["quantization_config"]
        ignore = qc["ignore"]
        # every linear of the exact parts (embedders and patch projections included) is named, so no loader quantizes it
        exact_linears = {k[: -len(".weight")] for k, (_, s) in shapes.items() if k.startswith(EXACT[name]) and len(s) == 2 and k.endswith(".weight")
                         and "norm" not in k.rsplit(".", 2)[-2]}
        assert exact_linears <= set(ignore)
        assert json.loads((out / "preprocessor_config.json").read_text())["family"] == name
        m = sorted(want)[0]
        q = ck[m].base
        if fmt == "nvfp4":
            theirs = NVFP4QTensor(torch.Size(q.shape), torch.float32, q.codes).dequantize(
                dtype=torch.float32, scale=q.scales, double_scale=q.global_scale, block_sizes={-1: 16})
            assert torch.equal(q.dequantize(), theirs)
        else:
            qc = dict(qc)
            qc.pop("resserve")
            scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
            dec = MXFP4PackedCompressor.decompress({"weight_packed": q.codes, "weight_scale": q.scales}, scheme)
            assert torch.equal(dec["weight"].float(), q.dequantize())
        # size from config.json alone: every tensor as on disk, and the bytes pack wrote
        src_cfg = json.loads((model / "config.json").read_text())
        if name not in ("gemma3_v5_names", "qwen3_vl_moe_hub"):  # these copies were rewritten after transformers saved them
            assert shapes_from_config(src_cfg) == modelio.stored_shapes(model)
            rep = estimate(src_cfg, fmt, ratio=0.25)
            w = written_classes(out)
            assert {k: rep.classes[k] for k in w} == w


def test_experts_fused_on_disk_are_quantized_per_expert_in_either_orientation(families, texts, tmp_path_factory, tmp_path):
    """Qwen3-VL-MoE's experts, stored fused output-major (as transformers saves them) or
    input-major (as hub checkpoints do): each expert's gate / up / down, cut from the fused tensors
    here, is quantized as the reference quantizes that linear, gate and up sharing one global
    scale; both orientations calibrate to the same statistics and pack to the same bytes."""
    import torch
    from safetensors.torch import load_file

    from resserve_export.formats import nvfp4
    from resserve_export.formats import ops as formats
    from tests.fixtures.tensors import bits

    written = {}
    for name in ("qwen3_vl_moe", "qwen3_vl_moe_hub"):
        model = families[name]
        calib = calibrated(families, name, texts, tmp_path_factory.mktemp("c"))
        out = pack(model, calib, tmp_path / name, "nvfp4", ratio=0.0, progress=False).out
        stored = {k: t for f in modelio.weight_files(model) for k, t in load_file(str(f)).items()}
        ck = read_checkpoint(out)
        n = 0
        for k, gu in stored.items():
            if not k.endswith(".experts.gate_up_proj"):
                continue
            prefix, dn = k.rsplit(".", 1)[0], stored[k.replace("gate_up_proj", "down_proj")]
            for e in range(gu.shape[0]):
                if name.endswith("_hub"):  # [E, H, 2I] and [E, I, H]
                    I = gu.shape[2] // 2
                    w = {"gate_proj": gu[e][:, :I].T, "up_proj": gu[e][:, I:].T, "down_proj": dn[e].T}
                else:  # [E, 2I, H] and [E, H, I]
                    I = gu.shape[1] // 2
                    w = {"gate_proj": gu[e][:I], "up_proj": gu[e][I:], "down_proj": dn[e]}
                for members in (("gate_proj", "up_proj"), ("down_proj",)):
                    alpha = nvfp4.global_scale(torch.stack([w[m].abs().amax().float() for m in members]).max())
                    for m in members:
                        ref = formats.quantize(w[m].contiguous(), "nvfp4", alpha=alpha, backend="reference")
                        got = ck[f"{prefix}.{e}.{m}"].base
                        assert torch.equal(got.codes, ref.codes) and torch.equal(bits(got.scales), bits(ref.scales))
                        n += 1
        assert n == 2 * 4 * 3  # two MoE layers, four experts, three projections
        salience = load_file(str(calib / "salience.safetensors"))
        written[name] = (raw(modelio.weight_files(out)), salience)
    (a, sa), (b, sb) = written.values()
    assert a == b
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_gpt_oss_experts_rearrange_into_the_hubs_mxfp4_blocks(families, texts, tmp_path_factory, tmp_path):
    """gpt-oss's experts as pack writes them (per expert, w13 / w2), rearranged by
    `hub_mxfp4_experts` into the hub's MXFP4 layout (``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]``,
    ``…_scales``, ``down_proj_…``): the codes and scales are the checkpoint's, gate and up rows
    interleaved as on the hub, and the hub reader `dequantize_mxfp4` (checked against transformers
    in test_moe_calibrate) reads back, expert by expert, a fresh MXFP4 quantization of the
    source's gate / up / down."""
    import torch
    from safetensors.torch import load_file

    from resserve_export.formats import ops as formats
    from resserve_export.modeling.families.gpt_oss import dequantize_mxfp4, hub_mxfp4_experts

    model = families["gpt_oss"]
    calib = calibrated(families, "gpt_oss", texts, tmp_path_factory.mktemp("c"))
    out = pack(model, calib, tmp_path / "ck", "mxfp4", ratio=0.0, progress=False).out
    written = {k: t for f in modelio.weight_files(out) for k, t in load_file(str(f)).items()}
    hub = hub_mxfp4_experts(written)
    source = {k: t for f in modelio.weight_files(model) for k, t in load_file(str(f)).items()}
    ck = read_checkpoint(out)
    layers = sorted({k.rsplit(".", 1)[0] for k in hub})
    assert layers == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
    for p in layers:
        gu_b, gu_s, dn_b, dn_s = (hub[f"{p}.{n}"] for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"))
        E, H, I = 4, 64, 128
        assert (gu_b.shape, gu_s.shape, dn_b.shape, dn_s.shape) == ((E, 2 * I, H // 32, 16), (E, 2 * I, H // 32), (E, H, I // 32, 16), (E, H, I // 32))
        assert {t.dtype for t in (gu_b, gu_s, dn_b, dn_s)} == {torch.uint8}
        gu, dn = dequantize_mxfp4(gu_b, gu_s), dequantize_mxfp4(dn_b, dn_s)  # [E, H, 2I], [E, I, H]: the bf16 checkpoints' layout
        src_gu, src_dn = source[f"{p}.gate_up_proj"], source[f"{p}.down_proj"]  # [E, H, 2I] interleaved, [E, I, H]
        for e in range(E):
            for m, rows, w in (("gate_proj", slice(0, None, 2), src_gu[e][:, 0::2].t()), ("up_proj", slice(1, None, 2), src_gu[e][:, 1::2].t()),
                               ("down_proj", slice(None), src_dn[e].t())):
                q = ck[f"{p}.{e}.{m}"].base
                blocks, scales = (gu_b, gu_s) if m != "down_proj" else (dn_b, dn_s)
                assert torch.equal(blocks[e, rows].reshape(q.codes.shape), q.codes) and torch.equal(scales[e, rows], q.scales), (p, e, m)
                ref = formats.quantize(w.contiguous(), "mxfp4", backend="reference").dequantize()
                got = (gu[e].t()[rows] if m != "down_proj" else dn[e].t()).float()
                assert torch.equal(got, ref), (p, e, m)


@pytest.mark.parametrize("name", ["gemma3", "gemma4", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe_hub", "llama4", "llama4_vl", "gpt_oss"])
def test_verify_reads_back_a_family_checkpoint(families, name, texts, tmp_path_factory, tmp_path):
    """verify loads the model with its own class under the checkpoint's names: the stored weights
    equal a fresh quantization and compensation lowers the linears' output error."""
    model = families[name]
    calib = calibrated(families, name, texts, tmp_path_factory.mktemp("c"))
    out = pack(model, calib, tmp_path / "ck", "mxfp4" if name == "gpt_oss" else "nvfp4", ratio=0.25, progress=False).out
    rep = verify(out, str(model), calib=calib, text=str(texts), samples=2, seq_len=32, device="cpu", out=tmp_path / "v")
    assert rep.weights_match is True
    assert rep.pooled_nmse["full"] < rep.pooled_nmse["checkpoint"] < rep.pooled_nmse["plain"]


def test_fused_experts_of_neither_orientation_are_refused_naming_the_tensor():
    """A gate_up / down pair that is neither input-major nor output-major is not cut into experts
    by guesswork: it stays a 3-D tensor, refused by name and shape before any work."""
    cfg = {"model_type": "qwen3_vl_moe"}
    prefix = "model.language_model.layers.0.mlp.experts"
    shapes = {f"{prefix}.gate_up_proj": ("BF16", (4, 64, 100)), f"{prefix}.down_proj": ("BF16", (4, 64, 64))}
    assert fam.expert_parts(cfg, shapes) == {} and fam.unfused_shapes(cfg, shapes) == shapes
    with pytest.raises(UserError, match=rf"^{prefix}.down_proj is a 3-D tensor \[4, 64, 64\]: every expert of its layer in one tensor .*nothing was packed$"):
        fam.check_tensors(fam.unfused_shapes(cfg, shapes), "packed")
    # the same pair, consistent, is read per expert in either orientation
    for gu, dn, transposed in (((4, 192, 64), (4, 64, 96), False), ((4, 64, 192), (4, 96, 64), True)):
        parts = fam.expert_parts(cfg, {f"{prefix}.gate_up_proj": ("BF16", gu), f"{prefix}.down_proj": ("BF16", dn)})
        assert len(parts) == 12 and all(p.transposed is transposed for p in parts.values())
        assert (parts[f"{prefix}.3.up_proj.weight"].start, parts[f"{prefix}.3.up_proj.weight"].stop) == (96, 192)


def test_unknown_layouts_are_refused_with_what_they_are():
    """A tensor of 3 or more dimensions outside the exact parts, not a known convolution: refused
    by name and shape; a known convolution or a vision tower's is not."""
    fam.check_tensors({"model.layers.0.linear_attn.conv1d.weight": ("BF16", (192, 1, 4)),
                       "backbone.layers.0.mixer.conv1d.weight": ("BF16", (96, 1, 4)),
                       "vision_tower.embeddings.patch_embedding.weight": ("BF16", (32, 3, 8, 8)),
                       "model.visual.patch_embed.proj.weight": ("BF16", (32, 3, 2, 16, 16))})
    with pytest.raises(UserError, match=r"^model.layers.0.mlp.mystery.weight is a 3-D tensor \[4, 8, 8\] of a layout this tool does not know"):
        fam.check_tensors({"model.layers.0.mlp.mystery.weight": ("BF16", (4, 8, 8))}, "packed")


def test_every_family_names_its_test_and_model_types_once():
    """Each adapter's `test` is a test that exists (file, function, and a family parameter of the
    tests here), so README's table, built from them, points at real proofs."""
    root = Path(__file__).resolve().parents[3]
    seen = set()
    for f in fam.FAMILIES:
        assert f.name
        path, _, node = f.test.partition("::")
        assert (root / path).is_file(), f.test
        func, _, param = node.partition("[")
        assert not func or f"def {func}(" in (root / path).read_text(), f.test
        assert not param or param.rstrip("]") in SUPPORTED + REFUSED, f.test
        assert not seen & set(f.model_types)
        seen |= set(f.model_types)
    assert {"gemma3", "qwen2_5_vl", "qwen3_vl", "mistral3", "qwen3_5", "nemotron_h", "llama4", "gpt_oss"} <= seen
