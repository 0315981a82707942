"""The default model's FP32 references (greedy tokens and logprobs), computed in a process of
their own (the main venv) while the engines run.

Computing a reference is the longest step of the tests that check the default model's engine
runs. In the test process it would run after the engines, on one core, while the other idles;
here it runs beside them from the start. Each reference is what the tests would compute
themselves (`common.reference`, or `common.smoothed_reference` for an AWQ calibration; one torch
thread, the same arithmetic).

Usage: python references.py JOB.json OUTDIR, where JOB has
  md, prompts, windows, decode_rows, wait_s
  refs: [{"name", "calib", "fmt", "ratio", "arithmetic", "smoothed"}, ...], in order
Each reference waits up to wait_s for its calibration's calibration.json (the AWQ calibration is
written while this runs), then writes OUTDIR/<name>.pt: {"tokens": 32 greedy tokens per prompt,
"lps": the logprobs [len-1, vocab] of each of prompts + windows} (renamed into place when
complete).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    md = Path(job["md"])
    for r in job["refs"]:
        calib = Path(r["calib"])
        deadline = time.monotonic() + job["wait_s"]
        while not (calib / "calibration.json").exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"no calibration at {calib} after {job['wait_s']} s")
            time.sleep(1)
        build = C.smoothed_reference if r["smoothed"] else C.reference
        kw = {} if r["smoothed"] else {"dtype": torch.float32}
        t0 = time.time()
        model = build(md, calib, r["fmt"], r["ratio"], arithmetic=r["arithmetic"], decode_rows=job["decode_rows"],
                      attention="vllm-cpu", **kw)
        res = {
            "tokens": [C.greedy(model, p, 32) for p in job["prompts"]],
            "lps": [C.logprobs(model, ids) for ids in job["prompts"] + job["windows"]],
        }
        del model
        tmp = out / f".{r['name']}.pt"
        torch.save(res, tmp)
        os.replace(tmp, out / f"{r['name']}.pt")
        print(f"reference {r['name']}: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
