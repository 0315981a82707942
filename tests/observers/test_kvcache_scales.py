"""KV-cache scales: calibrated k / v amax, the scales `pack --kv-cache` writes, `size`, `inspect`,
`verify`'s KV error and perplexity, and the bad inputs.

The engine side (vLLM loading the scales and running an FP8 KV cache) is in tests/test_vllm.py.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from resserve_export.stages.calibrate import run as cal
from resserve_export.stages.calibrate.config import make_config
from resserve_export.modeling import data
from resserve_export.observers import kv as kvcache
from resserve_export.formats import kv as kv_format
from resserve_export.storage import kv_stats as kv_file
from resserve_export.modeling import modelio
from resserve_export.storage.checkpoint import Checkpoint
from resserve_export.cli import main
from resserve_export.formats.ops import qdq as fp4_qdq
from resserve_export.stages.pack.run import pack
from resserve_export.stages.size import estimate

from tests.fixtures.console import assert_one_line_error, leftovers, run_main
from tests.fixtures.models import make_gemma3, make_llama, varied_texts, write_jsonl
from tests.fixtures.tiny import make_calibration, make_model



# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv-models")
    return {
        "llama": make_llama(root / "llama", dtype=torch.bfloat16),
        "qwen3": make_model(root / "qwen3", head_dim=32),
        "gemma3": make_gemma3(root / "gemma3"),
    }


# ----------------------------------------------------------------------------- calibration


def _independent_kv_amax(model, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[float, float]]:
    """k / v amax over valid tokens, without the cache: keys are what the modeling file's own
    ``apply_rotary_pos_emb`` returns (after k-norm and rotary), values are v_proj's outputs."""
    names = [n for n, m in model.named_modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj")]
    attn = dict(model.named_modules())
    modeling = sys.modules[type(attn[names[0]]).__module__]
    keys: list[torch.Tensor] = []
    values: dict[str, torch.Tensor] = {}
    original = modeling.apply_rotary_pos_emb

    def rotary(*args, **kwargs):
        q, k = original(*args, **kwargs)
        keys.append(k.detach())
        return q, k

    hooks = [attn[n].v_proj.register_forward_hook(lambda mod, a, out, n=n: values.__setitem__(n, out.detach())) for n in names]
    modeling.apply_rotary_pos_emb = rotary
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        modeling.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()
    assert len(keys) == len(names)
    valid = mask.bool()
    out = {}
    for n, k in zip(names, keys):  # layers run in module order
        k_tok = k.abs().amax(dim=(1, 3))  # [B, T]
        v_tok = values[n].abs().amax(dim=-1)  # [B, T]
        out[n] = (float(k_tok[valid].max()), float(v_tok[valid].max()))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_kv_amax_equal_an_independent_computation_after_rotary(models, arch):
    model = modelio.load_model(models[arch], "float32")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (3, 24), generator=g)
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, 17:] = 0
    mask[2, 5:] = 0
    # Padding positions get huge keys and values if they counted: poison them.
    ids[1, 17:] = ids[2, 5:6]
    col = kvcache.KVCollector(model)
    col.set_mask(mask)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **col.forward_kwargs())
    col.end_batch()
    got = col.result()
    want = _independent_kv_amax(model, ids, mask)
    assert col.problem is None and list(got) == list(want)
    for n, (k, v) in want.items():
        assert float(got[n]["k_amax"]) == k and float(got[n]["v_amax"]) == v, n
    if arch in ("qwen3", "gemma3"):  # the k-norm and rotary matter: k_proj's raw output differs
        raw = {}
        attn = dict(model.named_modules())
        hs = [attn[n].k_proj.register_forward_hook(lambda m, a, o, n=n: raw.__setitem__(n, float(o[mask.bool()].abs().max()))) for n in want]
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        for h in hs:
            h.remove()
        assert all(raw[n] != want[n][0] for n in want)


def test_padding_never_enters_kv_amax(models):
    """The same valid tokens with and without padding after them give the same amax."""
    model = modelio.load_model(models["qwen3"], "float32")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    padded = torch.cat([ids, torch.full((1, 9), 7)], dim=1)
    results = []
    for x, m in ((ids, torch.ones(1, 12, dtype=torch.long)), (padded, torch.cat([torch.ones(1, 12), torch.zeros(1, 9)], 1).long())):
        col = kvcache.KVCollector(model)
        col.set_mask(m)
        with torch.no_grad():
            model(input_ids=x, attention_mask=m, **col.forward_kwargs())
        results.append(col.result())
    for n in results[0]:
        for f in ("k_amax", "v_amax"):
            torch.testing.assert_close(results[0][n][f], results[1][n][f], rtol=1e-6, atol=0)


def test_calibrate_records_kv_statistics_deterministically(models, tmp_path):
    texts = write_jsonl(tmp_path / "docs.jsonl", varied_texts(8))
    cfg = make_config("quick", dataset=str(texts), num_samples=6, seq_len=32, batch_size=3, device="cpu", scores="none")
    outs = [cal.calibrate(str(models["llama"]), tmp_path / f"c{i}", cfg, show_progress=False).path for i in range(2)]
    assert (outs[0] / kv_file.FILE).read_bytes() == (outs[1] / kv_file.FILE).read_bytes()
    meta = json.loads((outs[0] / "calibration.json").read_text())
    assert meta["kv_cache"] == {"file": kv_file.FILE, "point": kvcache.POINT, "layers": 2}
    kv = load_file(str(outs[0] / kv_file.FILE))
    assert sorted(kv) == [f"model.layers.{i}.self_attn.{w}_amax" for i in range(2) for w in "kv"]
    assert all(t.dtype == torch.float32 and t.shape == () and float(t) > 0 for t in kv.values())
    # The same numbers as the collector on the same batches, computed here directly.
    tok = modelio.load_tokenizer(models["llama"])
    samples = data.make_samples(tok, data.load_documents(str(texts)), 6, 32, cfg.seed)
    model = modelio.load_model(models["llama"], "bfloat16")
    want: dict[str, list[float]] = {}
    for b in data.batches(samples, 3, data.pad_id(tok)):
        for n, (k, v) in _independent_kv_amax(model, b["input_ids"], b["attention_mask"]).items():
            old = want.get(n, [0.0, 0.0])
            want[n] = [max(old[0], k), max(old[1], v)]
    for n, (k, v) in want.items():
        assert float(kv[f"{n}.k_amax"]) == k and float(kv[f"{n}.v_amax"]) == v


# ----------------------------------------------------------------------------- arithmetic


def test_fp8_qdq_is_e4m3_of_x_over_scale_saturating():
    scale = torch.tensor(0.0371)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[torch.isfinite(codes.float())].float()
    x = (finite * scale).reshape(-1, 1)
    # Every E4M3 value times the scale survives exactly (x / scale rounds back to itself).
    assert torch.equal(kv_format.kv_qdq(x, scale, "fp8"), (finite * scale).reshape(-1, 1))
    big = torch.tensor([[1e6, -1e6, 449.0 * 0.0371, float("inf")]])
    top = float(torch.tensor(448.0) * scale)  # float32 arithmetic, as kv_qdq's
    assert kv_format.kv_qdq(big, scale, "fp8").tolist()[0] == [top, -top, top, top]
    # Round to nearest even between two E4M3 neighbours (1.0 and 1.125 → tie 1.0625 goes to 1.0).
    assert kv_format.kv_qdq(torch.tensor([[1.0625, 1.1875]]), 1.0, "fp8").tolist() == [[1.0, 1.25]]


def test_nvfp4_qdq_is_nvfp4_with_the_scale_as_tensor_scale(gen):
    x = torch.randn(2, 3, 5, 32, generator=gen, dtype=torch.float32) * 4
    scale = x.abs().amax() / kv_format.SCALE_DIVISOR
    want = fp4_qdq(x.reshape(-1, 32), "nvfp4", alpha=scale, backend="reference").reshape(x.shape)
    assert torch.equal(kv_format.kv_qdq(x, scale, "nvfp4"), want)


# ----------------------------------------------------------------------------- pack


def _kv_amax(calib: Path) -> dict[str, torch.Tensor]:
    return load_file(str(calib / kv_file.FILE))


@pytest.mark.parametrize(
    "fmt,kind,algo",
    [("nvfp4", "fp8", "FP8"), ("nvfp4", "nvfp4", "NVFP4"), ("mxfp4", "fp8", None)],
)
def test_pack_writes_kv_scales_as_the_loaders_read_them(models, tmp_path, fmt, kind, algo):
    model = models["qwen3"]
    calib = make_calibration(model, tmp_path / "c", kv=True)
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=0.25, kv_cache=kind, progress=False).out
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    amax = _kv_amax(calib)
    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for f in sorted(set(idx.values())):
        tensors.update(load_file(str(out / f)))
    for i in range(2):
        a = f"model.layers.{i}.self_attn"
        if fmt == "nvfp4":
            names, shape = (f"{a}.k_proj.k_scale", f"{a}.v_proj.v_scale"), ()
        else:
            names, shape = (f"{a}.k_scale", f"{a}.v_scale"), (1,)
        for name, which in zip(names, "kv"):
            t = tensors[name]
            assert t.dtype == torch.float32 and tuple(t.shape) == shape
            # amax / 448, computed in float32
            assert t.reshape(()).item() == (amax[f"{a}.{which}_amax"] / 448).item()
    assert cfg["quantization_config"]["resserve"]["kv_cache"] == kind
    if fmt == "nvfp4":
        hf = json.loads((out / "hf_quant_config.json").read_text())
        assert hf["quantization"]["kv_cache_quant_algo"] == algo
        want = {"dynamic": False, "num_bits": 8, "type": "float"} if kind == "fp8" else "NVFP4"
        assert qc["kv_cache_scheme"] == want
    else:
        assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    ck = Checkpoint(out)
    assert list(ck.kv_scales()) == [f"model.layers.{i}.self_attn" for i in range(2)]


def test_pack_without_kv_cache_writes_no_kv_scales(models, tmp_path):
    model = models["qwen3"]
    calib = make_calibration(model, tmp_path / "c", kv=True)
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0.25, progress=False).out
    cfg = json.loads((out / "config.json").read_text())
    assert "kv_cache" not in cfg["quantization_config"]["resserve"]
    assert cfg["quantization_config"]["kv_cache_scheme"] is None
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [n for n in names if n.endswith(("k_scale", "v_scale"))]


def _classes(out: Path) -> dict[str, int]:
    ck = Checkpoint(out)
    kv = {n for a in ck.kv_scales() for n in kv_format.scale_names(a, ck.format.kv_style)}
    got = {"kv-cache scales": sum(e.nbytes for n, e in ck.model.entries.items() if n in kv)}
    st = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    js = sum(p.stat().st_size for p in out.iterdir() if p.name.endswith(".index.json") or p.name == "hf_quant_config.json")
    return {**got, "safetensors": st, "json": js}


@pytest.mark.parametrize("fmt,kind,shard", [("nvfp4", "fp8", "5GB"), ("nvfp4", "nvfp4", "30KB"), ("mxfp4", "fp8", "20KB")])
def test_size_equals_pack_with_kv_scales(models, tmp_path, fmt, kind, shard):
    model = models["qwen3"]
    calib = make_calibration(model, tmp_path / "c", kv=True)
    out = pack(model, calib, tmp_path / "ck", fmt, ratio=0.5, kv_cache=kind, max_shard_size=shard, progress=False).out
    rep = estimate(json.loads((model / "config.json").read_text()), fmt, ratio=0.5, max_shard_size=shard, kv_cache=kind)
    got = _classes(out)
    assert rep.classes["kv-cache scales"] == got["kv-cache scales"] == 2 * 2 * 4  # 2 layers x (k, v) x float32
    tensor_bytes = sum(v for k, v in rep.classes.items() if k not in ("index / quant json", "config, tokenizer, other files"))
    assert tensor_bytes == got["safetensors"]
    assert rep.classes["index / quant json"] == got["json"]


def test_size_cli_counts_kv_scales(models, capsys):
    main_args = ["size", str(models["qwen3"] / "config.json"), "--ratio", "0", "--kv-cache", "fp8", "--json"]
    main(main_args)
    rep = json.loads(capsys.readouterr().out)
    assert rep["classes"]["kv-cache scales"] == 16


def test_inspect_shows_kv_scales(models, tmp_path, capsys):
    model = models["qwen3"]
    calib = make_calibration(model, tmp_path / "c", kv=True)
    out = pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0, kv_cache="fp8", progress=False).out
    main(["inspect", str(out), "--json"])
    info = json.loads(capsys.readouterr().out)
    amax = _kv_amax(calib)
    assert info["kv_cache"]["format"] == "fp8"
    assert [r["module"] for r in info["kv_cache"]["layers"]] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert info["kv_cache"]["layers"][1]["v_scale"] == (amax["model.layers.1.self_attn.v_amax"] / 448).item()
    assert info["bytes"]["kv_cache_scales"] == 16
    # k_proj's own bytes do not absorb its k_scale
    g = next(g for g in info["groups"] if "model.layers.0.self_attn.k_proj" in g["members"])
    assert g["base_bytes"] == sum(
        e.nbytes for n, e in Checkpoint(out).model.entries.items()
        if n.rsplit(".", 1)[0] in g["members"] and not n.endswith(("k_scale", "v_scale"))
    )


# ----------------------------------------------------------------------------- bad inputs


def test_kv_cache_without_kv_statistics_is_one_line(models, tmp_path):
    model = models["qwen3"]
    calib = make_calibration(model, tmp_path / "c")  # no KV statistics
    out = tmp_path / "ck"
    p = run_main("pack", str(model), "--calib", str(calib), "--out", str(out), "--ratio", "0", "--kv-cache", "fp8", "--device", "cpu")
    assert_one_line_error(p, 2, "no KV-cache statistics", "--kv-cache none")
    assert leftovers(out) == []


@pytest.mark.parametrize(
    "fmt,kind,needle", [("mxfp4", "nvfp4", "mxfp4 checkpoints carry KV-cache scales for fp8 only"), ("nvfp4", "int8", "unknown --kv-cache 'int8'")]
)
def test_unsupported_kv_cache_is_one_line(models, tmp_path, fmt, kind, needle):
    model = models["qwen3"]
    calib = make_calibration(model, tmp_path / "c", kv=True)
    out = tmp_path / "ck"
    p = run_main("pack", str(model), "--calib", str(calib), "--out", str(out), "--ratio", "0", "--format", fmt, "--kv-cache", kind)
    assert_one_line_error(p, 2, needle)
    assert leftovers(out) == []


def test_non_finite_kv_amax_is_one_line(models, tmp_path):
    model = models["qwen3"]
    calib = make_calibration(model, tmp_path / "c", kv=True)
    kv = load_file(str(calib / kv_file.FILE))
    kv["model.layers.1.self_attn.v_amax"] = torch.tensor(float("nan"))
    save_file(kv, str(calib / kv_file.FILE))
    out = tmp_path / "ck"
    p = run_main("pack", str(model), "--calib", str(calib), "--out", str(out), "--ratio", "0", "--kv-cache", "fp8")
    assert_one_line_error(p, 2, "model.layers.1.self_attn", "finite and positive")


def test_corrupt_kv_file_is_one_line(models, tmp_path):
    model = models["qwen3"]
    calib = make_calibration(model, tmp_path / "c", kv=True)
    raw = (calib / kv_file.FILE).read_bytes()
    (calib / kv_file.FILE).write_bytes(struct.pack("<Q", 1 << 40) + raw[8:40])
    p = run_main("pack", str(model), "--calib", str(calib), "--out", str(tmp_path / "ck"), "--ratio", "0", "--kv-cache", "fp8")
    assert_one_line_error(p, 2, kv_file.FILE)


# ----------------------------------------------------------------------------- verify


@pytest.fixture(scope="module")
def kv_packed(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-verify")
    texts = write_jsonl(root / "docs.jsonl", varied_texts(8))
    cfg = make_config("quick", dataset=str(texts), num_samples=6, seq_len=32, batch_size=3, device="cpu", scores="none")
    calib = cal.calibrate(str(models["llama"]), root / "calib", cfg, show_progress=False).path
    ckpt = pack(models["llama"], calib, root / "ckpt", "nvfp4", ratio=0.25, kv_cache="fp8", progress=False).out
    return texts, calib, ckpt


def test_verify_reports_kv_error_and_perplexity(models, kv_packed, tmp_path):
    texts, calib, ckpt = kv_packed
    out = tmp_path / "v"
    p = run_main("verify", str(ckpt), "--model", str(models["llama"]), "--calib", str(calib), "--text", str(texts), "--samples", "2",
            "--seq-len", "32", "--device", "cpu", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads((out / "verify.json").read_text())
    kv = rep["kv_cache"]
    assert kv["format"] == "fp8" and [r["module"] for r in kv["layers"]] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    # FP8 E4M3 keeps 3 mantissa bits: a relative error of at most 2^-4 per value, far less on average.
    for w in "kv":
        assert 0 < kv["pooled"][w] < 2**-8
    ppl = rep["perplexity"]
    assert set(ppl) >= {"bf16", "plain", "checkpoint", "full", "bf16_kv", "checkpoint_kv"}
    assert ppl["bf16_kv"] != ppl["bf16"] and ppl["checkpoint_kv"] != ppl["checkpoint"]
    assert abs(ppl["bf16_kv"] / ppl["bf16"] - 1) < 0.05
    assert "KV cache" in p.stdout


def test_verify_refuses_kv_scales_of_another_calibration(models, kv_packed, tmp_path):
    texts, calib, ckpt = kv_packed
    other = tmp_path / "calib"
    other.mkdir()
    for f in calib.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    kv = load_file(str(other / kv_file.FILE))
    kv["model.layers.1.self_attn.k_amax"] = kv["model.layers.1.self_attn.k_amax"] * 1.5
    save_file(kv, str(other / kv_file.FILE))
    out = tmp_path / "v"
    p = run_main("verify", str(ckpt), "--model", str(models["llama"]), "--calib", str(other), "--text", str(texts), "--samples", "2",
            "--seq-len", "32", "--device", "cpu", "--out", str(out))
    assert_one_line_error(p, 3, "model.layers.1.self_attn k_scale", "--calib")
    assert leftovers(out) == []


def test_a_model_without_k_proj_cannot_carry_kv_scales():
    from resserve_export.core.errors import UserError
    from resserve_export.stages.layout import kv_specs

    shapes = {"model.layers.0.self_attn.qkv_proj.weight": ("BF16", (192, 64)), "model.layers.0.mlp.down_proj.weight": ("BF16", (64, 128))}
    with pytest.raises(UserError, match="no attention layers with k_proj / v_proj: it cannot carry KV-cache scales; use --kv-cache none"):
        kv_specs(shapes, "nvfp4", "fp8")
    assert kv_specs(shapes, "nvfp4", "none") == {}


def test_nvfp4_kv_needs_a_head_dim_multiple_of_16():
    from resserve_export.core.errors import UserError

    with pytest.raises(UserError, match="head dimension 24 is not a multiple of 16"):
        kv_format.kv_qdq(torch.ones(1, 2, 3, 24), 1.0, "nvfp4")


def _packed_kv(models, tmp_path) -> Path:
    model = models["qwen3"]
    calib = make_calibration(model, tmp_path / "c", kv=True)
    return pack(model, calib, tmp_path / "ck", "nvfp4", ratio=0, kv_cache="fp8", progress=False).out


def test_checkpoint_declaring_kv_without_scales_is_one_line(models, tmp_path):
    out = _packed_kv(models, tmp_path)
    idx_path = out / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    for f in sorted(set(idx["weight_map"].values())):
        t = load_file(str(out / f))
        save_file({k: v for k, v in t.items() if not k.endswith(("k_scale", "v_scale"))}, str(out / f))
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if not k.endswith(("k_scale", "v_scale"))}
    idx_path.write_text(json.dumps(idx))
    assert_one_line_error(run_main("inspect", str(out)), 2, "declares a fp8 KV cache but holds no KV-cache scales", "re-run pack")


def test_checkpoint_with_a_k_scale_but_no_v_scale_is_one_line(models, tmp_path):
    out = _packed_kv(models, tmp_path)
    idx_path = out / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    gone = "model.layers.1.self_attn.v_proj.v_scale"
    f = idx["weight_map"].pop(gone)
    t = load_file(str(out / f))
    del t[gone]
    save_file(t, str(out / f))
    idx_path.write_text(json.dumps(idx))
    assert_one_line_error(run_main("inspect", str(out)), 2, "model.layers.1.self_attn.k_proj.k_scale but no " + gone, "incomplete")


def test_kv_quantizer_needs_a_scale_for_every_layer(models):
    from resserve_export.core.errors import UserError

    model = modelio.load_model(models["qwen3"], "float32")
    scales = {"model.layers.0.self_attn": (torch.tensor(0.1), torch.tensor(0.1))}
    with pytest.raises(UserError, match="no KV-cache scales for model.layers.1.self_attn: re-run pack with --kv-cache fp8"):
        kvcache.KVQuantizer(model, scales, "fp8", emulate=True)
    with pytest.raises(ValueError, match="measures nothing"):
        kvcache.KVQuantizer(model, {**scales, "model.layers.1.self_attn": scales["model.layers.0.self_attn"]}, "fp8", emulate=True).nmse()
