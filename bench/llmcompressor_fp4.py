"""llm-compressor's NVFP4 and MXFP4 checkpoints of a model, the peer rows of `bench/accuracy.py`.

Runs in its own venv (llm-compressor pins transformers <= 5.17 and compressed-tensors 0.19);
`bench/accuracy.py --llmc-python .venv-llmc/bin/python` calls it:

  python3 -m venv .venv-llmc && .venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
  .venv-llmc/bin/python bench/llmcompressor_fp4.py MODEL_DIR OUT_DIR [--scheme NVFP4|MXFP4] [--ids IDS.json] [--gptq]

RTN: `QuantizationModifier(targets="Linear", scheme=SCHEME, ignore=["lm_head"])` through
`oneshot`, saved compressed. Its weights do not depend on the calibration data; the calibration
tokens give NVFP4's activation global scales (`input_global_scale`), which a W4A4 engine uses
(MXFP4's activation scales are dynamic). GPTQ (``--gptq``): `GPTQModifier(targets="Linear",
scheme=SCHEME, ignore=["lm_head"])`, its
defaults otherwise (block size 128, dampening 0.01, actorder static).

IDS.json (written by `bench/accuracy.py`) holds the token ids of our calibration preset's
samples, so that both tools calibrate on the very same tokens. Without it (RTN only) eight
random 64-token rows are used, which is enough for the weights but not for W4A4 activations.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--scheme", default="NVFP4", choices=("NVFP4", "MXFP4"), help="compressed-tensors preset scheme (W4A4)")
    ap.add_argument("--ids", help="JSON list of token-id lists: the calibration samples")
    ap.add_argument("--gptq", action="store_true", help="GPTQModifier instead of QuantizationModifier (needs --ids)")
    a = ap.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if a.gptq and not a.ids:
        raise SystemExit("--gptq needs --ids: GPTQ's Hessians come from the calibration tokens")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
    if a.ids:
        rows = json.loads(open(a.ids).read())
    else:
        rows = torch.randint(100, 40000, (8, 64)).tolist()
    ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    modifier = GPTQModifier if a.gptq else QuantizationModifier
    recipe = modifier(targets="Linear", scheme=a.scheme, ignore=["lm_head"])
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=max(map(len, rows)), num_calibration_samples=len(rows))
    model.save_pretrained(a.out, save_compressed=True)
    AutoTokenizer.from_pretrained(a.model).save_pretrained(a.out)  # a server needs it beside the weights


if __name__ == "__main__":
    main()
