"""`calibrate`: statistics against direct computation, padding exclusion, determinism, atomic output.

Models are tiny random Llama models built here (hidden 64, 2 layers) with the SmolLM2 tokenizer;
texts are small generated JSONL files, so every test runs in seconds on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resserve_export.stages.calibrate import run as cal
from resserve_export.stages.calibrate.config import CONFIG_DIR, CalibConfig, make_config
from resserve_export.observers import stats
from resserve_export.storage import calibration
from resserve_export.core.errors import UserError
from resserve_export.modeling import data
from resserve_export.modeling import modelio
from resserve_export.modeling.groups import group_linears, is_quantized, linears_of

from tests.fixtures.models import make_llama, varied_texts, write_jsonl



@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("tiny64") / "model", dtype=torch.float64)


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("texts") / "docs.jsonl", varied_texts())


def run(model: Path, out: Path, dataset: Path, **kw) -> Path:
    settings = dict(dataset=str(dataset), num_samples=10, seq_len=64, batch_size=4, seed=3, device="cpu", dtype="float32", scores="none")
    settings.update(kw)
    overwrite = settings.pop("overwrite", False)
    on_batch = settings.pop("on_batch", None)
    return cal.calibrate(str(model), out, CalibConfig(**settings), overwrite=overwrite, show_progress=False, on_batch=on_batch).path


def read(out: Path) -> tuple[dict, dict]:
    return calibration.load_stats(out), json.loads((out / "calibration.json").read_text())


def direct_stats(model_dir: Path, samples: list[data.Sample], dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """Reference: every quantized linear's captured inputs, one sample at a time, reduced in float64."""
    model = modelio.load_model(model_dir, dtype)
    names = [n for n in linears_of(model) if is_quantized(n)]
    acc: dict[str, list] = {n: [torch.zeros(0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64), 0] for n in names}
    mods = dict(model.named_modules())

    def capture(name):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64).abs()
            a = acc[name]
            a[0] = x.sum(0) if a[2] == 0 else a[0] + x.sum(0)
            a[1] = torch.maximum(a[1], x.max())
            a[2] += x.shape[0]

        return hook

    handles = [mods[n].register_forward_pre_hook(capture(n)) for n in names]
    with torch.inference_mode():
        for s in samples:
            model(input_ids=torch.tensor([s.input_ids]), use_cache=False)
    for h in handles:
        h.remove()
    return {n: (a[0] / a[2], a[1], a[2]) for n, a in acc.items()}


def test_statistics_equal_direct_computation(tiny, texts, tmp_path):
    out = run(tiny, tmp_path / "calib", texts)
    stats, rec = read(out)
    tok = modelio.load_tokenizer(tiny)
    samples = data.make_samples(tok, data.load_documents(str(texts)), 10, 64, 3)
    assert rec["samples_sha256"] == data.samples_digest(samples)
    ref = direct_stats(tiny, samples, "float32")
    assert set(stats) == set(ref) and len(ref) == 2 * 7
    total = sum(len(s.input_ids) for s in samples)
    assert rec["num_tokens"] == total
    assert total < 10 * 64, "some samples must be shorter than seq_len so that padding is exercised"
    for name, (mean_abs, amax, count) in ref.items():
        assert count == total
        got = stats[name]
        assert got["mean_abs"].dtype == torch.float32 and got["mean_abs"].shape == (64 if "down_proj" not in name else 128,)
        assert got["amax"].dtype == torch.float32 and got["amax"].shape == ()
        torch.testing.assert_close(got["mean_abs"].double(), mean_abs, rtol=2e-6, atol=0)
        torch.testing.assert_close(got["amax"].double(), amax, rtol=2e-6, atol=0)


def test_fused_groups_share_records(tiny, texts, tmp_path):
    stats, rec = read(run(tiny, tmp_path / "calib", texts, num_samples=4))
    groups = rec["groups"]
    assert [len(g) for g in groups] == [3, 1, 2, 1] * 2
    for g in groups:
        for m in g[1:]:
            assert torch.equal(stats[m]["mean_abs"], stats[g[0]]["mean_abs"])
            assert torch.equal(stats[m]["amax"], stats[g[0]]["amax"])


def test_padded_batches_equal_one_by_one(tiny64, texts, tmp_path):
    batched, rec_b = read(run(tiny64, tmp_path / "b4", texts, batch_size=4, dtype="float64"))
    single, rec_1 = read(run(tiny64, tmp_path / "b1", texts, batch_size=1, dtype="float64"))
    assert rec_b["num_tokens"] == rec_1["num_tokens"] < 10 * 64
    for name in single:
        a, b = batched[name]["mean_abs"].double(), single[name]["mean_abs"].double()
        assert torch.all((a - b).abs() <= 1e-9 * b.abs()), name
        assert batched[name]["amax"] == single[name]["amax"], name


def test_padding_tokens_would_change_the_statistics(tiny64, texts):
    """The check above can fail: counting padded positions gives different numbers."""
    tok = modelio.load_tokenizer(tiny64)
    samples = data.make_samples(tok, data.load_documents(str(texts)), 8, 64, 3)
    bs = data.batches(samples, 4, data.pad_id(tok))
    model = modelio.load_model(tiny64, "float64")
    groups = group_linears(linears_of(model))
    masked, _ = stats.collect(model, bs, groups)
    full = [{"input_ids": b["input_ids"], "attention_mask": torch.ones_like(b["attention_mask"])} for b in bs]
    unmasked, _ = stats.collect(model, full, groups)
    name = groups[0].modules[0]
    assert not torch.allclose(masked[name]["mean_abs"], unmasked[name]["mean_abs"], rtol=1e-6, atol=0)


def test_same_seed_same_files(tiny, texts, tmp_path):
    a = run(tiny, tmp_path / "a", texts)
    b = run(tiny, tmp_path / "b", texts)
    c = run(tiny, tmp_path / "c", texts, seed=4)
    assert (a / "salience.safetensors").read_bytes() == (b / "salience.safetensors").read_bytes()
    assert (a / "kv_cache.safetensors").read_bytes() == (b / "kv_cache.safetensors").read_bytes()
    ja, jb, jc = (json.loads((d / "calibration.json").read_text()) for d in (a, b, c))
    # wall_time_s is the only run-dependent field; everything else must match exactly.
    for j in (ja, jb, jc):
        assert j.pop("wall_time_s") > 0
    assert ja == jb
    assert ja["samples_sha256"] != jc["samples_sha256"]
    assert (a / "salience.safetensors").read_bytes() != (c / "salience.safetensors").read_bytes()
    assert sorted(p.name for p in a.iterdir()) == ["calibration.json", "kv_cache.safetensors", "salience.safetensors"]


def test_calibration_json_contract(tiny, texts, tmp_path):
    _, rec = read(run(tiny, tmp_path / "calib", texts))
    for key in ("model", "fingerprint", "dataset", "num_samples", "num_tokens", "seq_len", "batch_size", "seed", "versions", "wall_time_s", "groups"):
        assert key in rec, key
    assert rec["fingerprint"] == modelio.fingerprint(tiny)
    assert (rec["num_samples"], rec["seq_len"], rec["batch_size"], rec["seed"]) == (10, 64, 4, 3)
    assert rec["versions"]["torch"] == torch.__version__


def test_interrupt_during_forward_leaves_nothing(tiny, texts, tmp_path):
    def stop(batch):
        if batch == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(tiny, tmp_path / "calib", texts, on_batch=stop)
    assert list(tmp_path.iterdir()) == []


def test_crash_while_writing_leaves_nothing_and_keeps_old_dir(tiny, texts, tmp_path, monkeypatch):
    out = tmp_path / "calib"
    out.mkdir()
    (out / "old.txt").write_text("previous run")

    def broken_save(stats, path):
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(cal, "save_stats", broken_save)
    with pytest.raises(KeyboardInterrupt):
        run(tiny, out, texts, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    with pytest.raises(KeyboardInterrupt):
        run(tiny, tmp_path / "fresh", texts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib"]


def test_overwrite_replaces_the_directory(tiny, texts, tmp_path):
    out = tmp_path / "calib"
    out.mkdir()
    (out / "old.txt").write_text("previous run")
    run(tiny, out, texts, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["calibration.json", "kv_cache.safetensors", "salience.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib"]


def test_presets_and_overrides():
    quick = make_config("quick")
    assert (quick.num_samples, quick.seq_len, quick.batch_size, quick.seed) == (32, 256, 8, 42)
    paper = make_config(str(CONFIG_DIR / "paper.yaml"))
    assert (paper.num_samples, paper.seq_len, paper.batch_size, paper.seed) == (1024, 2048, 8, 42)
    assert make_config("quick", seq_len=128, seed=7).seq_len == 128
    assert make_config("quick", seq_len=None).seq_len == 256
    with pytest.raises(UserError, match=r"available names: \[.*paper.*quick.*\]"):
        make_config("nope")


def test_preset_with_unknown_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_samples: 4\nsequence_length: 9\n")
    with pytest.raises(UserError, match="unknown setting.*sequence_length"):
        make_config(str(bad))


def test_samples_are_seeded_and_capped(tiny, texts):
    tok = modelio.load_tokenizer(tiny)
    docs = data.load_documents(str(texts))
    a = data.make_samples(tok, docs, 30, 16, 1)
    b = data.make_samples(tok, docs, 30, 16, 1)
    c = data.make_samples(tok, docs, 30, 16, 2)
    assert a == b and a != c
    assert all(1 <= len(s.input_ids) <= 16 for s in a)
    # more samples than documents: every document is used before any is used twice
    assert sorted(s.document for s in a[: len(docs)]) == list(range(len(docs)))


def test_default_text_splits_are_disjoint():
    calib, held = data.default_texts("calib"), data.default_texts("eval")
    assert calib and held and not set(calib) & set(held)
    plays = {data._play_of(p) for p in held}
    assert plays == set(data.EVAL_PLAYS)
    assert len(held) == 2 * len(data.EVAL_PLAYS)  # both editions of each held-out play
    assert not {data._play_of(p) for p in calib} & plays
    assert all(p.name != "metadata.txt" for p in calib)


def test_scores_written_beside_salience(tiny, texts, tmp_path):
    out = run(tiny, tmp_path / "calib", texts, num_samples=4, scores="kl", score_samples=2)
    scores = json.loads((out / "scores.json").read_text())
    _, rec = read(out)
    assert scores["method"] == "kl" and scores["samples"] == 2
    assert scores["ratios"] == [0, 0.125, 0.25, 0.5, 1]
    assert [g["modules"] for g in scores["groups"]] == rec["groups"]
    for g in scores["groups"]:
        assert set(g["scores"]) == {"0", "0.125", "0.25", "0.5", "1"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compiled_and_eager_reductions_give_the_same_statistics(tiny, monkeypatch, dtype):
    """The CPU hooks reduce inputs of at least `COMPILED_MIN_ELEMENTS` elements with a compiled
    graph and smaller ones eagerly: the two give the same statistics bit for bit, so the
    threshold changes speed only (here every input, then none, takes the compiled graph)."""
    net = modelio.load_model(tiny, dtype=dtype)
    groups = group_linears(linears_of(net))
    ids = torch.randint(0, 256, (3, 400), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, 350:] = 0
    batches = [{"input_ids": ids, "attention_mask": mask}]
    got = {}
    for threshold in (0, 1 << 40):
        monkeypatch.setattr(stats, "COMPILED_MIN_ELEMENTS", threshold)
        got[threshold], _ = stats.collect(net, batches, groups)
    compiled, eager = got[0], got[1 << 40]
    assert set(compiled) == set(eager) and len(compiled) == 2 * 7
    for name in compiled:
        assert torch.equal(compiled[name]["mean_abs"], eager[name]["mean_abs"]), name
        assert torch.equal(compiled[name]["amax"], eager[name]["amax"]), name
