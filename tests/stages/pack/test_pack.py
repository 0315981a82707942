"""`pack` writes what docs/formats.md says (NVFP4, MXFP4, selection, K-Ext, the checkpoint directory): reference quantization, shared fused scales, masks = top-k
of the calibration, extension = the extended quantization's extra columns, readable by ModelOpt
and compressed-tensors, deterministic, sharded sources, pinned byte counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from resserve_export.formats import ops as formats
from resserve_export.modeling import modelio
from resserve_export.formats import nvfp4
from resserve_export.storage.checkpoint import Checkpoint, read_checkpoint
from resserve_export.algorithms.kext import compact, ext_width
from resserve_export.stages.pack.run import pack
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.algorithms.selection import mask_to_bool

from tests.fixtures.checkpoints import assert_loaders_decode, source_tensors, topk_mask_bool
from tests.fixtures.tensors import bits
from tests.fixtures.tiny import group_list, make_calibration, make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    model = make_model(root / "model")
    return model, make_calibration(model, root / "calib")


def _stats(calib: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(calib / "salience.safetensors"), "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def _eq(a: FP4Tensor, b: FP4Tensor) -> None:
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(bits(a.scales), bits(b.scales))


@pytest.mark.parametrize(
    "fmt,ratio,rounding", [("nvfp4", 0.25, "ceil"), ("nvfp4", 0.125, "ceil"), ("mxfp4", 0.5, "even"), ("mxfp4", 0.125, "floor")]
)
def test_read_back_equals_reference(tiny, tmp_path, fmt, ratio, rounding):
    model, calib = tiny
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=ratio, mx_scale=rounding, progress=False).out
    src, stats = source_tensors(model), _stats(calib)
    packed = read_checkpoint(out)
    groups = group_list(model)
    assert sorted(packed) == sorted(m for g in groups for m in g.modules)
    k = int(ratio * 8)
    for g in groups:
        ws = [src[f"{m}.weight"] for m in g.modules]
        alpha = nvfp4.global_scale(torch.stack([w.abs().amax().float() for w in ws]).max()) if fmt == "nvfp4" else None
        expect_mask = topk_mask_bool(stats[f"{g.modules[0]}.mean_abs"], k)
        for m, w in zip(g.modules, ws):
            p = packed[m]
            assert (p.ratio, p.mode, p.K, p.members) == (ratio, "k_ext", g.in_features, g.modules)
            ref = formats.quantize(w, fmt, alpha=alpha, rounding=rounding, backend="reference")
            _eq(p.base, ref)
            # the mask is the top-k of the stored float32 mean_abs, and the same for every member
            assert torch.equal(mask_to_bool(p.mask), expect_mask)
            # extension = the extra columns of quantizing [W | W_S | 0] over its full width
            K = w.shape[-1]
            K_E = ext_width(K, ratio, fmt)
            assert p.ext.codes.shape == (w.shape[0], K_E // 2) and p.K_E == K_E
            full = torch.cat([w.float(), compact(w, p.mask, K_E)], dim=-1)
            fq = formats.quantize(full, fmt, alpha=alpha, rounding=rounding, backend="reference")
            _eq(p.ext, fq.narrow(K, K_E))
            _eq(p.base, fq.narrow(0, K))
            assert torch.equal(p.ext.dequantize()[:, : int(ratio * K)], fq.dequantize()[:, K : K + int(ratio * K)])
            if fmt == "nvfp4":
                # fused members share weight_scale_2 (max over the group) and input_scale
                assert torch.equal(bits(p.base.global_scale), bits(alpha))
                amax_x = stats[f"{g.modules[0]}.amax"]
                assert torch.equal(bits(p.input_scale), bits(nvfp4.global_scale(amax_x).reshape(())))
            else:
                assert p.input_scale is None
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["resserve"]["mx_scale_rounding"] == (rounding if fmt == "mxfp4" else None)


def test_fused_members_share_scales_with_different_amax(tiny, tmp_path):
    """q/k/v have different weight amax; the stored α is the max, identical for all three."""
    model, calib = tiny
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.0, progress=False).out
    src = source_tensors(model)
    names = [f"model.layers.0.self_attn.{x}_proj" for x in "qkv"]
    amax = [src[f"{n}.weight"].abs().amax().float() for n in names]
    assert len({float(a) for a in amax}) == 3
    with safe_open(str(next(out.glob("model-*.safetensors"))), "pt") as h:
        ws2 = [h.get_tensor(f"{n}.weight_scale_2") for n in names]
        ins = [h.get_tensor(f"{n}.input_scale") for n in names]
    assert all(w.shape == () and w.dtype == torch.float32 for w in ws2)
    assert all(torch.equal(bits(w), bits(ws2[0])) for w in ws2) and all(torch.equal(i, ins[0]) for i in ins)
    assert float(ws2[0]) == float(torch.stack(amax).max() / 2688.0)


def test_modelopt_and_compressed_tensors_decode_our_tensors(tiny, tmp_path):
    model, calib = tiny
    assert_loaders_decode(model, calib, tmp_path, ["model.layers.1.mlp.down_proj"])


def test_quantization_configs_match_what_loaders_expect(tiny, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    model, calib = tiny
    nv = pack(model, calib, tmp_path / "nv", "nvfp4", ratio=0.25, progress=False).out
    hf = json.loads((nv / "hf_quant_config.json").read_text())
    assert hf["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head"]}
    qc = json.loads((nv / "config.json").read_text())["quantization_config"]
    for key, value in convert_hf_quant_config_format(hf).items():
        assert qc[key] == value, key
    assert qc["group_size"] == 16 and qc["ignore"] == ["lm_head"]
    mx = pack(model, calib, tmp_path / "mx", "mxfp4", ratio=0.25, progress=False).out
    assert not (mx / "hf_quant_config.json").exists()
    qc = json.loads((mx / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["quant_method"] == "compressed-tensors"
    qc.pop("resserve")
    w = QuantizationConfig.model_validate(qc).config_groups["group_0"].weights
    assert (w.num_bits, w.type, w.strategy, w.group_size, w.symmetric) == (4, "float", "group", 32, True)


def test_resserve_section_and_sidecar_never_in_model_index(tiny, tmp_path):
    model, calib = tiny
    out = pack(model, calib, tmp_path / "ck", "mxfp4", ratio=0.125, progress=False).out
    r = json.loads((out / "config.json").read_text())["quantization_config"]["resserve"]
    assert (r["format_version"], r["element_format"], r["selection_group"], r["mx_scale_rounding"]) == (1, "mxfp4", 8, "ceil")
    g = r["groups"][0]
    # down_proj K=128: 128+16=144 padded to 256 for MXFP4 -> K_E = 128
    assert g == {"members": ["model.layers.0.mlp.down_proj"], "ratio": 0.125, "mode": "k_ext", "K": 128, "K_E": 128}
    prov = r["provenance"]
    assert prov["calibration"]["dataset"] == "random-test-stats" and prov["calibration"]["seed"] == 0 and prov["ratio"] == 0.125
    model_index = json.loads((out / "model.safetensors.index.json").read_text())
    side_index = json.loads((out / "resserve.safetensors.index.json").read_text())
    assert not any("resserve" in k or "resserve" in v for k, v in model_index["weight_map"].items())
    assert all(v.startswith("resserve-") for v in side_index["weight_map"].values())
    for idx, glob in ((model_index, "model-*.safetensors"), (side_index, "resserve-*.safetensors")):
        data = 0
        for f in out.glob(glob):
            with safe_open(str(f), "pt") as h:
                data += sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys())
        assert idx["metadata"]["total_size"] == data
    # non-weight files are copied verbatim; norms and embeddings stay bf16
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (model / name).read_bytes()
    ck = Checkpoint(out)
    assert ck.model.entries["model.embed_tokens.weight"].dtype == "BF16"
    assert ck.model.entries["model.layers.0.self_attn.q_norm.weight"].dtype == "BF16"


def test_full_stores_masks_only_and_zero_stores_nothing(tiny, tmp_path):
    model, calib = tiny
    full = pack(model, calib, tmp_path / "full", "nvfp4", ratio=1.0, progress=False).out
    side = Checkpoint(full).sidecar.entries
    assert side and all(k.endswith(".resserve_mask") for k in side)
    p = read_checkpoint(full)["model.layers.0.mlp.up_proj"]
    assert p.mode == "full" and p.ext is None and bool((p.mask == 0xFF).all())
    plain = pack(model, calib, tmp_path / "plain", "nvfp4", ratio=0.0, progress=False).out
    assert not list(plain.glob("resserve*"))
    assert (plain / "model.safetensors.index.json").exists()
    p = read_checkpoint(plain)["model.layers.0.mlp.up_proj"]
    assert p.mode == "plain" and p.mask is None and p.ext is None


def test_deterministic_bytes(tiny, tmp_path):
    model, calib = tiny
    a = pack(model, calib, tmp_path / "a", "nvfp4", ratio=0.25, progress=False).out
    b = pack(model, calib, tmp_path / "b", "nvfp4", ratio=0.25, progress=False).out
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_three_shard_source_and_sharded_output(tmp_path):
    """Members of fused groups live in different source shards; output splits into shards too."""
    one = make_model(tmp_path / "one", seed=3)
    many = make_model(tmp_path / "many", seed=3, shard_size="40KB")
    assert len(modelio.weight_files(many)) >= 3
    # the same weights, so the same fingerprint and calibration
    calib = make_calibration(one, tmp_path / "calib")
    a = pack(one, calib, tmp_path / "a", "nvfp4", ratio=0.5, progress=False).out
    b = pack(many, calib, tmp_path / "b", "nvfp4", ratio=0.5, max_shard_size="30KB", progress=False).out
    assert len(list(b.glob("model-*-of-*.safetensors"))) >= 3 and len(list(b.glob("resserve-*-of-*.safetensors"))) >= 2
    ra, rb = read_checkpoint(a), read_checkpoint(b)
    for m in ra:
        _eq(ra[m].base, rb[m].base)
        _eq(ra[m].ext, rb[m].ext)
        assert torch.equal(ra[m].mask, rb[m].mask)


def test_tied_embeddings_stored_once(tmp_path):
    model = make_model(tmp_path / "m", tied=True)
    calib = make_calibration(model, tmp_path / "c")
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    names = Checkpoint(out).model.entries
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


# Pinned byte counts of the fixed tiny model (2 layers, hidden 64, intermediate 128, vocab 256,
# untied) per file class. A change here changes what every user's checkpoint holds. Tensor data
# by docs/formats.md, "Checkpoint size": NVFP4 linears 73,728 weights · 9/16 + 14 · 8 = 41,584 B, MXFP4 73,728 · 17/32 =
# 39,168 B, bf16 embeddings 65,536 B and norms 768 B; the rest is safetensors headers.
PINNED = {
    ("nvfp4", 0.25): {"model": 114824, "sidecar": 41632, "model_index": 5699, "sidecar_index": 4008, "hf_quant_config": 232},
    ("mxfp4", 0.125): {"model": 109552, "sidecar": 43864, "model_index": 3363, "sidecar_index": 4008, "hf_quant_config": 0},
    ("nvfp4", 1.0): {"model": 114824, "sidecar": 1528, "model_index": 5699, "sidecar_index": 1334, "hf_quant_config": 232},
}


@pytest.mark.parametrize("fmt,ratio", list(PINNED))
def test_pinned_byte_counts(tiny, tmp_path, fmt, ratio):
    model, calib = tiny
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=ratio, progress=False).out

    def size(glob):
        return sum(p.stat().st_size for p in out.glob(glob))

    got = {
        "model": size("model-*.safetensors"),
        "sidecar": size("resserve-*.safetensors"),
        "model_index": size("model.safetensors.index.json"),
        "sidecar_index": size("resserve.safetensors.index.json"),
        "hf_quant_config": size("hf_quant_config.json"),
    }
    assert got == PINNED[(fmt, ratio)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (quantization on --device cuda)")
@pytest.mark.parametrize("fmt,ratio", [("nvfp4", 0.25), ("mxfp4", 0.5)])
def test_cuda_pack_is_byte_identical_to_cpu(tiny, tmp_path, fmt, ratio):
    model, calib = tiny
    a = pack(model, calib, tmp_path / "cpu", fmt, ratio=ratio, device="cpu", progress=False).out
    b = pack(model, calib, tmp_path / "cuda", fmt, ratio=ratio, device="cuda", progress=False).out
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_pack_of_a_calibrated_config_does_not_import_transformers(tiny, tmp_path):
    """calibrate records the architecture check it made (config's architectures and model type,
    transformers' version); pack of the same config trusts it and never imports transformers
    (whose import indexes every model module: seconds of a GPU pack), and checks again itself
    when the record differs (the unknown-architecture refusal is tested in test_exit_codes)."""
    import subprocess
    import sys

    model, calib = tiny
    rec = json.loads((calib / "calibration.json").read_text())
    mine = tmp_path / "calib"
    mine.mkdir()
    for f in calib.iterdir():
        (mine / f.name).write_bytes(f.read_bytes())
    code = (
        "import json, sys; from pathlib import Path\n"
        "from resserve_export.stages.pack.run import pack\n"
        "pack(sys.argv[1], sys.argv[2], sys.argv[3], 'nvfp4', ratio=0.25, progress=False)\n"
        "print(json.dumps('transformers' in sys.modules))\n"
    )
    for i, key in enumerate([modelio.architecture_key(model), {**modelio.architecture_key(model), "transformers": "0.0"}]):
        (mine / "calibration.json").write_text(json.dumps({**rec, "architecture": key}))
        p = subprocess.run([sys.executable, "-c", code, str(model), str(mine), str(tmp_path / f"ck{i}")], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        assert json.loads(p.stdout.strip().splitlines()[-1]) is (i == 1), p.stdout
