"""AWQ's pure parts (not wired into the commands yet): the exact folds and the α search."""

from __future__ import annotations

import pytest
import torch

from resserve_export.algorithms.awq import smoothing as awq
from resserve_export.algorithms.awq import decoder
from resserve_export.algorithms.awq import search
from resserve_export.algorithms.awq import fold
from resserve_export.modeling import modelio
from resserve_export.formats.ops import qdq

from tests.fixtures.models import make_gemma3, make_llama, make_mha_qwen2
from tests.fixtures.tiny import make_model



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    return {
        "llama": make_llama(root / "llama", dtype=torch.float32),
        "qwen3": make_model(root / "qwen3", head_dim=32),
        "gemma3": make_gemma3(root / "gemma3"),
        "qwen2_mha": make_mha_qwen2(root / "qwen2_mha"),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen2_mha"])
def test_folding_random_scales_leaves_the_model_unchanged(models, arch):
    """Every fold the planner allows, with random positive scales over two orders of magnitude:
    the smoothed FP32 model's logits equal the original's to FP32 rounding."""
    model = modelio.load_model(models[arch], "float32")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    folds = decoder.plan_folds(model)
    layers = len(model.model.layers)
    assert len(folds) == 4 * layers
    g = torch.Generator().manual_seed(1)
    applied = 0
    mods = dict(model.named_modules())
    for f in folds:
        if f.unscaled:
            continue
        k = mods[f.consumers[0]].in_features
        s = torch.exp(torch.empty(k).uniform_(-2.3, 2.3, generator=g))
        awq.apply_fold(model, f, s)
        applied += 1
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    assert applied == (4 if arch == "qwen2_mha" else 3) * layers
    torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)
    # and the weights did change
    assert not torch.equal(mods[folds[0].consumers[0]].weight, modelio.load_model(models[arch], "float32").get_submodule(folds[0].consumers[0]).weight)


def test_gemma_norms_fold_as_one_plus_weight(models):
    model = modelio.load_model(models["gemma3"], "float32")
    folds = decoder.plan_folds(model)
    assert folds[0].kind == "norm_one_plus" and folds[1].producer.endswith("pre_feedforward_layernorm")
    w = torch.tensor([0.5, -0.25, 2.0])
    s = torch.tensor([2.0, 0.5, 3.0])
    assert torch.allclose(1 + fold.fold_into_norm(w, s, one_plus=True), (1 + w) / s)


def test_grouped_query_attention_leaves_o_proj_unscaled(models):
    model = modelio.load_model(models["llama"], "float32")  # 4 query heads, 2 value heads
    o = [f for f in decoder.plan_folds(model) if f.consumers[0].endswith("o_proj")]
    assert o and all(f.unscaled and "grouped-query" in f.unscaled for f in o)
    with pytest.raises(ValueError, match="cannot be scaled"):
        awq.apply_fold(model, o[0], torch.ones(64))


def test_search_picks_the_grid_minimum_of_the_w4a4_error():
    """Brute force: the chosen α's error is the smallest of an independent evaluation of every
    candidate (and of no smoothing), with FP4 weights and FP4 activations at the smoothed amax."""
    g = torch.Generator().manual_seed(7)
    K = 64
    x = torch.randn(96, K, generator=g) * torch.exp(torch.randn(K, generator=g) * 1.5)  # outlier channels
    ws = [torch.randn(32, K, generator=g) * 0.05, torch.randn(16, K, generator=g) * 0.05]
    grid = (0.0, 0.25, 0.5, 0.75, 1.0)
    res = search.search(x, ws, "nvfp4", grid=grid)

    def independent(s):
        xs = x / s
        alpha_x = (xs.abs().amax() / (6 * 448)).float()
        alpha_w = (torch.stack([(w * s).abs().amax() for w in ws]).max() / (6 * 448)).float()
        xq = qdq(xs, "nvfp4", alpha=alpha_x, backend="reference")
        e = r = 0.0
        for w in ws:
            y = x @ w.T
            yq = xq @ qdq(w * s, "nvfp4", alpha=alpha_w, backend="reference").T
            e += float((yq - y).double().square().sum())
            r += float(y.double().square().sum())
        return e / r

    mean_w = torch.cat([w.abs() for w in ws]).mean(0)
    scores = {a: independent(search.candidate_scales(x.abs().mean(0), mean_w, a)) for a in grid}
    none = independent(torch.ones(K))
    for a in grid:
        assert res.errors[a] == pytest.approx(scores[a], rel=1e-9)
    best = min(scores, key=lambda a: (scores[a], a))
    if scores[best] < none:
        assert res.alpha == best and torch.equal(res.scales, search.candidate_scales(x.abs().mean(0), mean_w, best))
    else:
        assert res.alpha != res.alpha and torch.equal(res.scales, torch.ones(K))
    # With strong activation outliers smoothing helps under W4A4.
    assert min(scores.values()) < none


def test_candidate_scales_are_normalised():
    s = search.candidate_scales(torch.tensor([1.0, 4.0, 16.0]), torch.tensor([1.0, 1.0, 1.0]), 0.5)
    assert float(s.max() * s.min()) == pytest.approx(1.0)
    assert torch.allclose(s / s[0], torch.tensor([1.0, 2.0, 4.0]))
