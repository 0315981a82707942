"""Decision groups: fused siblings share one group only when they read inputs of one width; no
quantized linear is ever dropped."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from resserve_export.modeling.groups import group_linears, is_quantized


def test_siblings_of_another_width_get_their_own_group():
    linears = {
        "m.layers.0.self_attn.q_proj": (64, 64),
        "m.layers.0.self_attn.k_proj": (32, 96),  # a different input width than q's
        "m.layers.0.self_attn.v_proj": (32, 96),
        "m.layers.0.self_attn.o_proj": (64, 64),
        "m.layers.0.mlp.gate_proj": (128, 64),
        "m.layers.0.mlp.up_proj": (128, 64),
        "m.layers.0.mlp.down_proj": (64, 128),
    }
    groups = group_linears(linears)
    assert [g.modules for g in groups] == [
        ("m.layers.0.self_attn.q_proj",),
        ("m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj"),
        ("m.layers.0.self_attn.o_proj",),
        ("m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj"),
        ("m.layers.0.mlp.down_proj",),
    ]
    assert [g.in_features for g in groups] == [64, 96, 64, 64, 128]
    assert groups[1].out_features == (32, 32)


LEAVES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w3", "w2", "lm_head", "gate"]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.tuples(st.integers(0, 2), st.sampled_from(LEAVES)), st.tuples(st.sampled_from([32, 64]), st.sampled_from([32, 64, 96])), min_size=1))
def test_every_quantized_linear_is_in_exactly_one_group_of_one_width(spec):
    linears = {f"model.layers.{layer}.blk.{leaf}": shape for (layer, leaf), shape in sorted(spec.items())}
    groups = group_linears(linears)
    members = [m for g in groups for m in g.modules]
    assert sorted(members) == sorted(n for n in linears if is_quantized(n))
    for g in groups:
        assert {linears[m][1] for m in g.modules} == {g.in_features}
        assert g.out_features == tuple(linears[m][0] for m in g.modules)
