"""The calibrate stage: presets, the whole-model, layer-by-layer and data-parallel pipelines."""
