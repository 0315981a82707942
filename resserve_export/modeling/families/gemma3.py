"""Gemma 3 (4B and larger) as published: ``Gemma3ForConditionalGeneration``, a SigLIP vision tower
and a multimodal projector around the Gemma 3 text decoder.

Hub checkpoints name the decoder ``language_model.model.layers.…``; transformers 5 loads it as
``model.language_model.layers.…`` (and writes either, by version): both are accepted, and the
packed checkpoint keeps the source's names. The vision tower and the projector stay exact. Hub
checkpoints name the SigLIP tower ``vision_tower.vision_model.…``, where transformers 5.24 writes
``vision_tower.…``."""

from resserve_export.modeling.families.base import Family

FAMILY = Family(
    name="Gemma 3 (vision-language, Gemma3ForConditionalGeneration)",
    model_types=("gemma3",),
    quantized="the language model's decoder linears; vision tower and projector exact",
    wrapper=True,
    exact=("vision_tower", "multi_modal_projector", r"model\.vision_tower", r"model\.multi_modal_projector"),
    disk_names=(("vision_tower.", "vision_tower.vision_model."),),
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[gemma3]",
)
