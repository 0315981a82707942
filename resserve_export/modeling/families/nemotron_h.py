"""Nemotron-H (and Nemotron Nano 2): a hybrid of Mamba-2 mixers, attention and MLP layers.
Hub checkpoints name the decoder ``backbone.layers.N.mixer.…`` (transformers loads it as
``model.layers.…``; the packed checkpoint keeps the source's names).

Quantized, as vLLM's Mamba-2 mixer gives the quantization config to them: the mixer's ``in_proj``
and ``out_proj``, the attention and MLP linears. Exact: the causal convolution (``mixer.conv1d``),
the state-space parameters (``A_log``, ``D``, ``dt_bias``) and the mixer's gated norm."""

from resserve_export.modeling.families.base import Family

FAMILY = Family(
    name="Nemotron-H (hybrid Mamba-2 + attention)",
    model_types=("nemotron_h",),
    quantized="mixer in_proj / out_proj, attention and MLP linears; conv1d, A_log, D, dt_bias exact",
    kept=((r"\.mixer\.conv1d\.weight$", "is the Mamba-2 causal convolution, kept exact"),),
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[nemotron_h]",
)
