"""llm-compressor's NVFP4 checkpoints of a model, for `bench/accuracy.py`: RTN
(``--llmcompressor-checkpoint``) and, with ``--gptq IDS.json``, GPTQ (``--checkpoint NAME=DIR``).

Runs in its own venv (llm-compressor pins transformers <= 5.17 and compressed-tensors 0.19):

  python3 -m venv .venv-llmc && .venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
  .venv-llmc/bin/python bench/llmcompressor_rtn.py MODEL_DIR OUT_DIR
  .venv-llmc/bin/python bench/llmcompressor_rtn.py MODEL_DIR OUT_DIR --gptq IDS.json

RTN: `QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])` through
`oneshot`, saved compressed. The weights of an RTN scheme do not depend on the calibration data;
the eight random 64-token rows only give the activations' global scales, which
`bench/accuracy.py` does not read.

GPTQ: `GPTQModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])` (its defaults otherwise:
block size 128, dampening 0.01, actorder static) on the token ids of IDS.json, which
`bench/accuracy.py --write-ids IDS.json --config quick` writes: the very samples our
``calibrate --config quick --weight-algo gptq`` calibrates on.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    src, out = sys.argv[1], sys.argv[2]
    gptq = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--gptq" else None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    if gptq:
        rows = json.loads(open(gptq).read())
        ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
        recipe = GPTQModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])
        length = max(len(r) for r in rows)
    else:
        ids = torch.randint(100, 40000, (8, 64))
        ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
        recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])
        rows, length = ids, 64
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=length, num_calibration_samples=len(rows))
    model.save_pretrained(out, save_compressed=True)


if __name__ == "__main__":
    main()
