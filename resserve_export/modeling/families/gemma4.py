"""Gemma 4 (``Gemma4ForConditionalGeneration``): a vision tower (and, in some sizes, an audio
tower) with their embedders around the Gemma 4 text decoder, saved as
``model.language_model.…``, ``model.vision_tower.…``, ``model.embed_vision.…``.

Quantized: the decoder layers' linears, the per-layer-input gate and projection of each layer
included, and the model-level ``per_layer_model_projection``: the linears vLLM's Gemma 4 model
builds with the checkpoint's quantization config. The towers and their embedders stay exact (and
are named in the ignore list); the per-layer embedding table and ``layer_scalar`` are copied."""

from resserve_export.modeling.families.base import Family

FAMILY = Family(
    name="Gemma 4 (vision-language, Gemma4ForConditionalGeneration)",
    model_types=("gemma4",),
    quantized="the language model's linears (decoder layers, per-layer-input gates and projections); towers and embedders exact",
    wrapper=True,
    exact=(r"model\.vision_tower", r"model\.embed_vision", r"model\.audio_tower", r"model\.embed_audio"),
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[gemma4]",
)
