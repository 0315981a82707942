"""KV-cache quantization on the embedded default model: what `verify` reports for FP8 and NVFP4
KV caches, and how much of the FP8 cost is saturation.

Calibrates the default model once (`--config quick --scores none`), packs NVFP4 checkpoints at
ρ = 0 and 0.25 with `--kv-cache fp8` and `--kv-cache nvfp4`, and measures each on the held-out
text as `verify` does (keys / values NMSE, perplexity with bf16 linears and with the checkpoint's
linears, each with and without the KV cache quantized). Then, for the FP8 checkpoints, the same
perplexity with every KV scale multiplied by 2 and 4, and how many cached values saturate
(|x| > 448 · scale) on the held-out text. Prints Markdown tables.

  .venv/bin/python bench/kv_cache.py [--samples 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from resserve_export import api
from resserve_export.modeling import data
from resserve_export.observers import kv as kvcache
from resserve_export.modeling import modelio
from resserve_export.storage.checkpoint import Checkpoint
from resserve_export.stages.verify.perplexity import emulated, forward_nll
from resserve_export.stages.verify.run import DEFAULT_TEXT


class CountingQuantizer(kvcache.KVQuantizer):
    """`KVQuantizer` that also counts cached values beyond the FP8 range of their scale."""

    saturated = 0

    def _observe(self, idx, k, v):
        ks, vs = self.scales[self.names[idx]]
        self.saturated += int((k.abs() > 448 * ks).sum()) + int((v.abs() > 448 * vs).sum())
        return super()._observe(idx, k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="bench-kv-"))
    t0 = time.perf_counter()
    calib = api.calibrate("default", root / "calib", config="quick", scores="none", progress=False).path
    rows, probe = [], []
    for ratio in (0.0, 0.25):
        for kind in ("fp8", "nvfp4"):
            ck = api.pack("default", calib, root / f"ck-{ratio}-{kind}", "nvfp4", ratio=ratio, kv_cache=kind, progress=False).out
            rep = api.verify(ck, "default", calib=calib, samples=args.samples, seq_len=args.seq_len).report
            kv, ppl = rep["kv_cache"], rep["perplexity"]
            rows.append((ratio, kind, kv["pooled"]["k"], kv["pooled"]["v"], ppl["bf16"], ppl["bf16_kv"], ppl["checkpoint"], ppl["checkpoint_kv"]))
            if kind == "fp8":
                probe += fp8_margin(ck, ratio, args)
    print(f"KV cache on {modelio.model_label('default')}, NVFP4 linears, {args.samples} x {args.seq_len} held-out tokens ({DEFAULT_TEXT})\n")
    print("| ρ | KV cache | keys NMSE | values NMSE | ppl bf16 linears | + KV | ppl checkpoint linears | + KV |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]:g} | {r[1]} | {r[2]:.3e} | {r[3]:.3e} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.3f} | {r[7]:.3f} |")
    print("\nFP8 KV cache with the stored scales multiplied (checkpoint linears):\n")
    print("| ρ | scale × | saturated cached values | perplexity |")
    print("|---|---:|---:|---:|")
    for r in probe:
        print(f"| {r[0]:g} | {r[1]:g} | {r[2]:,} | {r[3]:.3f} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


def fp8_margin(ckpt: Path, ratio: float, args) -> list[tuple]:
    ck = Checkpoint(ckpt)
    md = modelio.resolve_model("default")
    net = modelio.load_model(md, "bfloat16")
    tok = modelio.load_tokenizer(md)
    batches = data.batches(data.make_samples(tok, data.load_documents(DEFAULT_TEXT), args.samples, args.seq_len, 0), 4, data.pad_id(tok))
    packed = {m: ck.read(m) for m in ck.modules}
    out = []
    for mult in (1.0, 2.0, 4.0):
        scales = {a: (k * mult, v * mult) for a, (k, v) in ck.kv_scales().items()}
        with emulated(net, ck, "checkpoint", packed, {}):
            q = CountingQuantizer(net, scales, "fp8", emulate=True)
            ppl = forward_nll(net, batches, torch.device("cpu"), kv=q)
        out.append((ratio, mult, q.saturated, ppl))
    return out


if __name__ == "__main__":
    main()
