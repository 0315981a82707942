"""Scale: calibration statistics of a model too large to hold, layer by layer
(`calibrate --pipeline sequential`) against the whole model, on one device.

Builds a random bf16 model of a real model's shape (default: Qwen3-8B, 16 GB; ``--shape
qwen3-1.7b`` or ``tiny`` for a quick check), saves it as safetensors, then collects the
statistics of ``--samples`` × ``--seq`` random tokens (batch ``--batch``) twice: the whole model
loaded on the device (`modelio.load_model_on` + `calibrate.collect`), and
`sequential.collect_sequential`. Prints a table: wall time (loading included), tokens/s, peak
device memory, the size of one decoder layer and of the hidden states, and whether the two
statistics are bit-identical. With ``--scores`` the sequential run also computes grad scores
(on ``--score-samples`` sequences), timed separately. With ``--resume`` the sequential run is
timed once more saving a resume point after every layer (``RESSERVE_RESUME_SECONDS=0``, the
most frequent; the default saves one every 600 s), with the state's size on disk.

  python bench/scale.py [--device cuda] [--shape qwen3-8b] [--samples 64] [--seq 2048] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from resserve_export.observers import stats
from resserve_export.modeling import data, forward, modelio
from resserve_export.stages.calibrate import sequential
from resserve_export.stages.calibrate.backward import ScoreSpec  # noqa: E402
from resserve_export.modeling.groups import group_linears, linears_of

SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=True),
}


def random_model(path: Path, shape: str, device: str) -> int:
    """Write the random model (kept when `path` already holds it: a second run with the same
    ``--dir`` reuses it) and return the bytes of one decoder layer."""
    import json

    from transformers import Qwen3Config, Qwen3ForCausalLM

    made = path / "bench-layer-bytes.json"
    if made.exists():
        return json.loads(made.read_text())["layer_bytes"]
    torch.manual_seed(0)
    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=4096)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    del model
    made.write_text(json.dumps({"layer_bytes": layer_bytes}))
    return layer_bytes


def random_batches(n: int, batch: int, seq: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(0, n, batch):
        b = min(batch, n - i)
        ids = torch.randint(0, vocab, (b, seq), generator=g)
        mask = torch.ones(b, seq, dtype=torch.long)
        mask[0, seq - seq // 4 :] = 0  # some padding
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")


def profile_sequential(model_dir: Path, device: str, batches, groups, spill: Path) -> None:
    """One more sequential run with timers around its phases (the device synchronised at each
    boundary, so the phases do not overlap as they do unprofiled), printed as a table, with the
    device's peak memory inside the first layer pass that is not layer 0."""
    from resserve_export.stages.calibrate import shell as shell_mod

    spent: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}

    def timed(owner, name: str, label: str):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            sync(device)
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                sync(device)
                spent.setdefault(label, []).append(time.perf_counter() - t0)

        setattr(owner, name, wrapper)
        return real

    def layer_peak(real):
        def wrapper(self, li, progress):
            if li == 1 and device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated() / 2**30
            out = real(self, li, progress)
            if li == 1 and device.startswith("cuda"):
                peaks["allocated before layer 1's pass"] = before
                peaks["peak during layer 1's pass"] = torch.cuda.max_memory_allocated() / 2**30
            return out
        return wrapper

    patched = [
        (shell_mod.LayerReader, "place", "place (wait for the read, copy to the device)"),
        (shell_mod.LayerReader, "unload", "unload"),
        (sequential, "release_host_memory", "release_host_memory (gc + malloc_trim)"),
        (sequential, "capture", "capture pass"),
        (sequential, "open_shell", "open_shell"),
        (sequential.StatsCollector, "check_finite", "check_finite"),
        (sequential.StatsCollector, "result", "statistics result"),
    ]
    saved = [(o, n, timed(o, n, label)) for o, n, label in patched]
    real_layer = sequential._Passes._layer
    timed(sequential._Passes, "_layer", "layer passes (compute + hooks)")
    inner = sequential._Passes._layer
    sequential._Passes._layer = layer_peak(inner)
    try:
        t = time.perf_counter()
        sequential.collect_sequential(model_dir, device, "bfloat16", batches, groups, spill)
        sync(device)
        total = time.perf_counter() - t
    finally:
        for o, n, real in saved:
            setattr(o, n, real)
        sequential._Passes._layer = real_layer
        shutil.rmtree(spill, ignore_errors=True)
    print(f"\nsequential, profiled: {total:.2f} s in all\n")
    print("| phase | calls | s | share |")
    print("|---|---:|---:|---:|")
    for label, ts in spent.items():
        print(f"| {label} | {len(ts)} | {sum(ts):.2f} | {sum(ts) / total:.0%} |")
    print(f"| (the rest) | | {total - sum(sum(v) for k, v in spent.items() if k != 'check_finite'):.2f} | |")
    for k, v in peaks.items():
        print(f"{k}: {v:.2f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--scores", action="store_true")
    ap.add_argument("--score-samples", type=int, default=8)
    ap.add_argument("--resume", action="store_true", help="also time sequential with a resume point after every layer")
    ap.add_argument("--micro-batch", choices=("auto", "off"), default="auto",
                    help="auto: batches cut into micro-batches as `calibrate` cuts them on a GPU (forward.micro_batch_rows); off: as given")
    ap.add_argument("--dir", default=None, help="where to write the random model (default: a temporary directory)")
    ap.add_argument("--profile", action="store_true",
                    help="also time the sequential run's phases (each timed region synchronises the device, so this run is slower)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-scale-"))
    model_dir = root / f"random-{args.shape}"
    t = time.perf_counter()
    layer_bytes = random_model(model_dir, args.shape, args.device)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    print(f"random {args.shape} ({size / 1e9:.1f} GB) written in {time.perf_counter() - t:.1f} s", flush=True)
    batches = random_batches(args.samples, args.batch, args.seq, SHAPES[args.shape]["vocab_size"])
    rows = None
    if args.micro_batch == "auto":  # what `calibrate` runs on this device, in both pipelines alike
        rows = forward.micro_batch_rows(json.loads((model_dir / "config.json").read_text()), 2, args.device)
        batches = data.micro_batches(batches, rows)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    hidden_bytes = args.samples * args.seq * SHAPES[args.shape]["hidden_size"] * 2

    # Whole model on the device.
    peak_reset(args.device)
    sync(args.device)
    t = time.perf_counter()
    model = modelio.load_model_on(model_dir, args.device, "bfloat16")
    groups = group_linears(linears_of(model))
    t_load = time.perf_counter() - t
    whole, _ = stats.collect(model, batches, groups)
    sync(args.device)
    t_whole = time.perf_counter() - t
    p_whole = peak(args.device)
    del model
    peak_reset(args.device)

    # Sequential.
    spill = root / "spill"
    t = time.perf_counter()
    seq = sequential.collect_sequential(model_dir, args.device, "bfloat16", batches, groups, spill).stats
    shutil.rmtree(spill, ignore_errors=True)
    sync(args.device)
    t_seq = time.perf_counter() - t
    p_seq = peak(args.device)
    same = all(torch.equal(whole[m]["mean_abs"], seq[m]["mean_abs"]) and torch.equal(whole[m]["amax"], seq[m]["amax"]) for m in whole)

    if args.profile:
        profile_sequential(model_dir, args.device, batches, groups, spill)

    t_resume = None
    if args.resume:
        from resserve_export.storage.resume import RESUME_ENV, ResumePoints

        os.environ[RESUME_ENV] = "0"
        points = ResumePoints.open(root / "calib", {"bench": "scale"}, resume=False)
        largest = [0]
        real_save = points.save

        def save(*a, **k):
            real_save(*a, **k)
            largest[0] = max(largest[0], sum(f.stat().st_size for f in points.root.rglob("*") if f.is_file()))

        points.save = save
        t = time.perf_counter()
        again = sequential.collect_sequential(model_dir, args.device, "bfloat16", batches, groups, spill, resume=points).stats
        sync(args.device)
        t_resume = time.perf_counter() - t
        points.finish()
        shutil.rmtree(spill, ignore_errors=True)
        same = same and all(torch.equal(again[m]["mean_abs"], seq[m]["mean_abs"]) for m in seq)

    t_scores = None
    if args.scores:
        from resserve_export.formats.constants import RATIOS

        spec = ScoreSpec(list(RATIOS), "nvfp4", "ceil", "auto", args.score_samples)
        peak_reset(args.device)
        t = time.perf_counter()
        sequential.collect_sequential(model_dir, args.device, "bfloat16", batches, groups, spill, scores=spec)
        shutil.rmtree(spill, ignore_errors=True)
        sync(args.device)
        t_scores = time.perf_counter() - t

    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\nrandom {args.shape} ({size / 1e9:.1f} GB bf16) on {dev}: {args.samples} x {args.seq} tokens, batch {args.batch} "
          f"({'no micro-batches' if rows is None else f'micro-batches of {max(1, rows // args.seq)} samples'}); "
          f"one decoder layer {layer_bytes / 2**30:.2f} GiB, hidden states {hidden_bytes / 2**30:.2f} GiB\n")
    print("| pipeline | wall s (incl. load) | tokens/s | peak device memory GiB |")
    print("|---|---:|---:|---:|")
    print(f"| whole (load {t_load:.1f} s) | {t_whole:.1f} | {tokens / t_whole:,.0f} | {p_whole:.2f} |")
    print(f"| sequential | {t_seq:.1f} | {tokens / t_seq:,.0f} | {p_seq:.2f} |")
    print(f"\nstatistics bit-identical: {'yes' if same else 'NO'}; sequential speed {t_whole / t_seq:.2f}x whole; "
          f"sequential peak / (one layer + hidden states) = {p_seq * 2**30 / (layer_bytes + hidden_bytes):.2f}")
    if t_resume is not None:
        print(f"sequential with a resume point after each of its layers: {t_resume:.1f} s ({t_resume / t_seq:.2f}x), "
              f"state on disk up to {largest[0] / 2**30:.2f} GiB")
    if t_scores is not None:
        print(f"sequential with grad scores on {args.score_samples} samples: {t_scores:.1f} s ({t_scores / t_seq:.2f}x the statistics pass)")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
