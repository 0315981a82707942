"""llm-compressor's RTN NVFP4 checkpoint of a model, for `bench/accuracy.py --llmcompressor-checkpoint`.

Runs in its own venv (llm-compressor pins transformers <= 5.17 and compressed-tensors 0.19):

  python3 -m venv .venv-llmc && .venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
  .venv-llmc/bin/python bench/llmcompressor_rtn.py MODEL_DIR OUT_DIR

`QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])` through `oneshot`,
saved compressed. The weights of an RTN scheme do not depend on the calibration data; the eight
random 64-token rows only give the activations' global scales, which `bench/accuracy.py` does not
read.
"""

from __future__ import annotations

import sys


def main() -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    src, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ids = torch.randint(100, 40000, (8, 64))
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=64, num_calibration_samples=8)
    model.save_pretrained(out, save_compressed=True)


if __name__ == "__main__":
    main()
