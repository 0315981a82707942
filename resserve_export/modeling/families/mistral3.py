"""Mistral 3 (Mistral Small 3.1 / 3.2, Ministral 3, Magistral): ``Mistral3ForConditionalGeneration``,
a Pixtral vision tower and a patch-merging projector around a Mistral decoder. The vision tower and
projector stay exact; hub names (``language_model.model.layers.…``) and transformers 5's
(``model.language_model.layers.…``) are both accepted."""

from resserve_export.modeling.families.base import Family

FAMILY = Family(
    name="Mistral 3 (vision-language, Mistral3ForConditionalGeneration)",
    model_types=("mistral3",),
    quantized="the language model's decoder linears; vision tower and projector exact",
    wrapper=True,
    exact=("vision_tower", "multi_modal_projector", r"model\.vision_tower", r"model\.multi_modal_projector"),
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[mistral3]",
)
