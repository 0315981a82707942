"""Llama 4's experts, whose routing weight scales their input: the adapted model computes what
transformers' own Llama 4 computes, and the expert statistics are those of the inputs each
expert's FP4 GEMM sees, checked against transformers' own experts module as the oracle (its input
holds every expert's rows, the non-routed ones zero).

The family's tiny model (tests/fixtures/families.py: 2 MoE layers of 4 experts, top-1) in float32,
4 samples of 32 tokens: what is asserted is equality to the oracle on the same tokens."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from resserve_export.api import calibrate
from resserve_export.modeling import modelio
from resserve_export.modeling import data
from resserve_export.stages.calibrate.config import make_config

from tests.fixtures.console import assert_one_line_error, run_main
from tests.fixtures.models import varied_texts, write_jsonl

pytestmark = pytest.mark.xdist_group("families")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("texts") / "t.jsonl", varied_texts(8))


def _oracle_inputs(model_dir, ids, mask=None):
    """(transformers' own Llama 4, unadapted, in float32; its logits on `ids`; {experts prefix:
    the experts module's input on them, ``[E, T, H]``})."""
    import transformers as T

    model = T.Llama4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = {}
    hooks = []
    for name, mod in model.named_modules():
        if type(mod).__name__ == "Llama4TextExperts":
            prefix = name  # model.layers.L.feed_forward.experts
            E = mod.gate_up_proj.shape[0]
            hooks.append(mod.register_forward_pre_hook(lambda m, a, p=prefix, E=E: seen.__setitem__(p, a[0].reshape(E, -1, a[0].shape[-1]).clone())))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    for h in hooks:
        h.remove()
    return model, logits, seen


def test_adapted_llama4_computes_what_transformers_computes(families):
    model_dir = families["llama4"]
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    _, want, _ = _oracle_inputs(model_dir, ids)
    ours = modelio.load_model(model_dir, dtype="float32")
    assert any(type(m).__name__ == "InputRoutedExperts" for m in ours.modules())
    with torch.no_grad():
        got = ours(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["routed", "all"])
def test_llama4_expert_statistics_are_those_of_each_experts_scaled_input(families, texts, mode, tmp_path):
    model_dir = families["llama4"]
    out = tmp_path / "c"
    calibrate(str(model_dir), out, dataset=str(texts), num_samples=4, seq_len=32, batch_size=4, scores="none", dtype="float32",
              moe_calib=mode, progress=False)
    sal = load_file(str(out / "salience.safetensors"))
    ids, mask = _calibration_tokens(model_dir, texts, out)
    _, _, seen = _oracle_inputs(model_dir, ids, mask)
    valid = mask.reshape(-1).bool()
    checked = 0
    for prefix, rows in seen.items():  # rows: [E, T, H], expert e's input (zero where not routed)
        rows = rows[:, valid]
        for e in range(rows.shape[0]):
            x = rows[e]
            if mode == "routed":
                x = x[x.abs().amax(1) > 0]  # the routed tokens (a routed row of zeros has no effect either way)
                if not x.shape[0]:
                    continue
            else:  # every token, scaled by the sigmoid of this expert's logit
                x = _all_inputs(model_dir, prefix, ids, mask)[e][valid]
            for leaf in ("gate_proj", "up_proj"):
                key = f"{prefix}.{e}.{leaf}"
                torch.testing.assert_close(sal[f"{key}.mean_abs"], x.abs().mean(0), rtol=1e-5, atol=1e-7)
                torch.testing.assert_close(sal[f"{key}.amax"], x.abs().amax(), rtol=0, atol=0)
            checked += 1
    assert checked >= 4


_ALL: dict = {}


def _all_inputs(model_dir, prefix, ids, mask):
    """Every token's layer input scaled by sigmoid(logit) of each expert: [E, T, H] (transformers'
    router and the same rounding as its own scaling)."""
    import transformers as T

    key = (str(model_dir), prefix)
    if key not in _ALL:
        model = T.Llama4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        moe = model.get_submodule(prefix.rsplit(".", 1)[0])
        got = {}
        h = moe.register_forward_pre_hook(lambda m, a: got.__setitem__("x", a[0].reshape(-1, a[0].shape[-1]).clone()))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        h.remove()
        x = got["x"]
        s = torch.sigmoid(torch.nn.functional.linear(x, moe.router.weight).float()).to(x.dtype)
        _ALL[key] = x.unsqueeze(0) * s.t().unsqueeze(-1)
    return _ALL[key]


def _calibration_tokens(model_dir, texts, out):
    """The token ids and attention mask the calibration ran on (one batch of 4), rebuilt as it
    builds them and checked against the digest it recorded."""
    import json

    cfg = make_config(None, dataset=str(texts), num_samples=4, seq_len=32, batch_size=4)
    tok = modelio.load_tokenizer(model_dir)
    samples = data.make_samples(tok, data.load_documents(cfg.dataset), cfg.num_samples, cfg.seq_len, cfg.seed)
    assert data.samples_digest(samples) == json.loads((out / "calibration.json").read_text())["samples_sha256"]
    (b,) = data.batches(samples, 4, data.pad_id(tok))
    return b["input_ids"], b["attention_mask"]


def test_awq_refuses_experts_scaled_on_their_input(families, texts, tmp_path):
    """`calibrate --weight-algo awq` on Llama 4: one line naming why, exit 2, nothing written."""
    p = run_main("calibrate", str(families["llama4"]), "--out", str(tmp_path / "c"), "--dataset", str(texts), "--num-samples", "2",
                 "--seq-len", "16", "--scores", "none", "--weight-algo", "awq", "--format", "nvfp4", "--dtype", "float32")
    err = assert_one_line_error(p, 2)
    assert err == ("error: AWQ does not support experts whose routing weight scales their input "
                   "(Llama 4: model.layers.0.feed_forward.experts) yet: calibrate without --weight-algo awq")
    assert not (tmp_path / "c").exists()
