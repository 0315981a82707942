"""Benchmark `pack` on a Qwen3-4B-shaped random bf16 checkpoint (~8 GB), or with ``--arch
qwen3-moe`` on Qwen3-30B-A3B-shaped mixture-of-experts layers (128 experts of 768 per layer;
6 layers by default, ~8.6 GB: per-expert tensors, as the hub checkpoints name them).

Generates the checkpoint once under ``.cache/bench/`` (4 shards, written tensor by tensor), a
calibration dir of random statistics following the contract, then runs in separate processes
(so each peak RSS is its own):

  ours        `pack` NVFP4 at the given ratios (default 0 and 0.25)
  modelopt    ModelOpt 0.47 ``NVFP4QTensor.quantize`` per linear + safetensors save, shard by shard
  io          plain safetensors load + save of the same tensors (the I/O floor)
  fingerprint `modelio.fingerprint` alone (sha256 of every tensor's bytes), cold cache
  ours-warm   `pack` at the first ratio with the fingerprint already cached (untimed), as after a
              `calibrate` on the same machine (skip with ``--skip ours-warm``)

Every run starts with an empty fingerprint cache (a fresh ``RESSERVE_CACHE``), so `ours`
includes hashing the whole source once, as a pack on a machine that did not calibrate does.

and prints a Markdown table: seconds, GB/s of bf16 source, peak RSS, ratio to the peers.

  .venv/bin/python bench/pack.py [--arch qwen3-4b|qwen3-moe] [--layers N] [--ratios 0,0.25] [--device cpu] [--depth N]

``--depth N`` runs `ours` with ``RESSERVE_PACK_DEPTH=N`` (0: read, quantize and write one after
another on one thread; default: the pipelined pack's own depth).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".cache" / "bench"

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "hidden_act": "silu",
}


# Qwen3-30B-A3B's published shape (config.json of Qwen/Qwen3-30B-A3B).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "hidden_act": "silu",
}
ARCHS = {"qwen3-4b": (QWEN3_4B, 36), "qwen3-moe": (QWEN3_30B_A3B, 6)}


def paths(arch: str, layers: int) -> tuple[Path, Path]:
    """The generated checkpoint and its calibration directory."""
    if arch == "qwen3-4b":
        return BENCH / f"qwen3-4b-L{layers}", BENCH / f"calib-L{layers}"
    return BENCH / f"{arch}-L{layers}", BENCH / f"calib-{arch}-L{layers}"


def _peak_rss_gb() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux carries the parent's RSS at fork
    into a child's ru_maxrss across exec, which would charge the generator's memory to each run."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def generate(model_dir: Path, layers: int, arch: str = "qwen3-4b") -> None:
    """Random bf16 weights (std 0.02, a few outlier columns) with the architecture's tensor layout."""
    import torch

    from resserve_export.storage.checkpoint import MODEL_INDEX, dump_json
    from resserve_export.storage.safetensors import ShardedWriter, TensorSpec, split_shards
    from resserve_export.stages.size import shapes_from_config

    cfg = {**ARCHS[arch][0], "num_hidden_layers": layers}
    if (model_dir / "config.json").exists() and json.loads((model_dir / "config.json").read_text()) == cfg:
        return
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shapes = shapes_from_config(cfg)
    specs = [TensorSpec(n, d, s) for n, (d, s) in shapes.items()]
    total = sum(s.nbytes for s in specs)
    w = ShardedWriter(tmp, "model", split_shards(specs, total // 4 + 1))
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # drawn on a GPU where there is one: tens of GB in seconds
    g = torch.Generator(device=dev).manual_seed(0)
    for s in specs:
        if len(s.shape) == 1:
            t = torch.ones(s.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(s.shape, generator=g, device=dev) * 0.02).to(torch.bfloat16)
            t[:, :: max(1, s.shape[1] // 8)] *= 20  # some salient input channels
            t = t.cpu()
        w.write(s.name, t)
        del t
    w.close()
    (tmp / MODEL_INDEX).write_text(dump_json(w.index()))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "tokenizer.json").write_text("{}")
    os.replace(tmp, model_dir)


def calibration(model_dir: Path, calib: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from resserve_export.modeling import modelio
    from resserve_export.stages.layout import model_groups

    fp = modelio.fingerprint(model_dir)
    if (calib / "calibration.json").exists() and json.loads((calib / "calibration.json").read_text())["fingerprint"] == fp:
        return
    calib.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    t = {}
    groups = model_groups(modelio.tensor_shapes(model_dir))
    for grp in groups:
        mean_abs = torch.rand(grp.in_features, generator=g) + 0.01
        for m in grp.modules:
            t[f"{m}.mean_abs"] = mean_abs.clone()
            t[f"{m}.amax"] = (mean_abs.max() * 10).reshape(())
    save_file(t, str(calib / "salience.safetensors"))
    meta = {"model": model_dir.name, "fingerprint": fp, "fingerprint_method": modelio.FINGERPRINT_METHOD, "architecture": modelio.architecture_key(model_dir), "dataset": "random", "num_samples": 0, "num_tokens": 0,
            "seq_len": 0, "batch_size": 0, "seed": 1, "versions": {}, "wall_time_s": 0, "groups": [list(x.modules) for x in groups]}
    (calib / "calibration.json").write_text(json.dumps(meta))


def run_ours(model_dir: Path, calib: Path, out: Path, ratio: float, device: str) -> dict:
    from resserve_export.stages.pack.run import pack

    t = time.perf_counter()
    res = pack(model_dir, calib, out, "nvfp4", ratio=ratio, device=device, overwrite=True, progress=False)
    return {"seconds": time.perf_counter() - t, "out_bytes": res.bytes_written}


def _save_durable(tensors: dict, path: Path) -> None:
    """safetensors save + fsync: the same durability `pack` gives its files."""
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _linear(name: str) -> bool:
    return name.endswith("_proj.weight")


def run_modelopt(model_dir: Path, out: Path, device: str = "cpu") -> dict:
    import torch
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from safetensors import safe_open

    from resserve_export.modeling import modelio

    t = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    written = 0
    for i, f in enumerate(modelio.weight_files(model_dir)):
        shard = {}
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                w = h.get_tensor(k)
                if _linear(k):
                    q, s, s2 = NVFP4QTensor.quantize(w.to(device), 16)
                    m = k[: -len(".weight")]
                    shard[k] = q._quantized_data.cpu()
                    shard[f"{m}.weight_scale"] = s.cpu()
                    shard[f"{m}.weight_scale_2"] = s2.reshape(()).cpu()
                    shard[f"{m}.input_scale"] = torch.ones((), dtype=torch.float32)
                else:
                    shard[k] = w
        _save_durable(shard, out / f"model-{i:05d}.safetensors")
        written += (out / f"model-{i:05d}.safetensors").stat().st_size
        del shard
    return {"seconds": time.perf_counter() - t, "out_bytes": written}


def run_io(model_dir: Path, out: Path) -> dict:
    from safetensors import safe_open

    from resserve_export.modeling import modelio

    t = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    written = 0
    for i, f in enumerate(modelio.weight_files(model_dir)):
        with safe_open(str(f), "pt") as h:
            shard = {k: h.get_tensor(k) for k in h.keys()}
        _save_durable(shard, out / f"model-{i:05d}.safetensors")
        written += (out / f"model-{i:05d}.safetensors").stat().st_size
        del shard
    return {"seconds": time.perf_counter() - t, "out_bytes": written}


def child(args) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    model_dir, calib = paths(args.arch, args.layers)
    cold = tempfile.mkdtemp(prefix="resserve-bench-cache-")
    os.environ["RESSERVE_CACHE"] = cold  # no fingerprint cached: every run hashes the source
    if args.child == "fingerprint":
        from resserve_export.modeling import modelio

        t = time.perf_counter()
        modelio.fingerprint(model_dir)
        r = {"seconds": time.perf_counter() - t, "out_bytes": 0}
    elif args.child == "ours":
        r = run_ours(model_dir, calib, BENCH / "out-ours", args.ratio, args.device)
    elif args.child == "ours-warm":
        from resserve_export.modeling import modelio

        modelio.fingerprint(model_dir)  # untimed: the digests cached, as on a machine that calibrated
        r = run_ours(model_dir, calib, BENCH / "out-ours", args.ratio, args.device)
    elif args.child == "modelopt":
        r = run_modelopt(model_dir, BENCH / "out-modelopt", "cuda" if args.device == "cuda" else "cpu")
    else:
        r = run_io(model_dir, BENCH / "out-io")
    shutil.rmtree(cold, ignore_errors=True)
    r["peak_rss_gb"] = _peak_rss_gb()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    r["cpu_s"] = ru.ru_utime + ru.ru_stime  # less sensitive than wall time to other load
    print("RESULT " + json.dumps(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3-4b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 36 for qwen3-4b, 6 for qwen3-moe)")
    ap.add_argument("--ratios", default="0,0.25")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip", default="", help="comma list of runs to skip: modelopt,io,fingerprint,ours-warm")
    ap.add_argument("--depth", type=int, default=None, help="RESSERVE_PACK_DEPTH for ours (0: serial; default: pack's own)")
    ap.add_argument("--child", choices=["ours", "ours-warm", "modelopt", "io", "fingerprint"], help=argparse.SUPPRESS)
    ap.add_argument("--ratio", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.layers = args.layers or ARCHS[args.arch][1]
    if args.child:
        return child(args)
    sys.path.insert(0, str(ROOT))
    model_dir, calib = paths(args.arch, args.layers)
    t = time.perf_counter()
    generate(model_dir, args.layers, args.arch)
    calibration(model_dir, calib)
    src = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    print(f"source: {model_dir.name}, {src / 1e9:.2f} GB bf16 (ready in {time.perf_counter() - t:.0f} s)", flush=True)
    ratios = [float(r) for r in args.ratios.split(",")]
    runs = [("io", None), ("modelopt", None), ("fingerprint", None)] + [("ours", r) for r in ratios] + [("ours-warm", ratios[0])]
    skip = set(filter(None, args.skip.split(",")))
    results = {}
    for kind, ratio in runs:
        if kind in skip:
            continue
        cmd = [sys.executable, __file__, "--arch", args.arch, "--layers", str(args.layers), "--child", kind, "--device", args.device]
        if ratio is not None:
            cmd += ["--ratio", str(ratio)]
        env = dict(os.environ)
        if args.depth is not None and kind == "ours":
            env["RESSERVE_PACK_DEPTH"] = str(args.depth)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            print(p.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{kind} failed")
        r = json.loads(line[-1][7:])
        shutil.rmtree(BENCH / f"out-{kind.split('-')[0]}", ignore_errors=True)  # keep the disk for the source
        label = kind if ratio is None else f"ours NVFP4 ρ={ratio:g}" + (f" depth {args.depth}" if args.depth is not None else "")
        if kind == "ours-warm":
            label += ", fingerprint cached"
        results[label] = r
        print(
            f"{label}: {r['seconds']:.1f} s wall, {r['cpu_s']:.1f} s CPU, {src / 1e9 / r['seconds']:.3f} GB/s, "
            f"peak RSS {r['peak_rss_gb']:.2f} GB",
            flush=True,
        )
    print()
    print("| run | wall s | CPU s | GB/s (bf16 source, wall) | peak RSS GB | output GB | ModelOpt wall / this | this / I/O-floor wall | ModelOpt CPU / this |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    vm = results.get("modelopt", {}).get("seconds")
    vi = results.get("io", {}).get("seconds")
    cm = results.get("modelopt", {}).get("cpu_s")
    for label, r in results.items():
        sec = r["seconds"]
        peer_m = f"{vm / sec:.2f}×" if vm else "–"
        peer_i = f"{sec / vi:.2f}×" if vi else "–"
        peer_c = f"{cm / r['cpu_s']:.2f}×" if cm else "–"
        print(
            f"| {label} | {sec:.1f} | {r['cpu_s']:.1f} | {src / 1e9 / sec:.3f} | {r['peak_rss_gb']:.2f} | {r['out_bytes'] / 1e9:.2f} "
            f"| {peer_m} | {peer_i} | {peer_c} |"
        )
    fp = results.get("fingerprint", {}).get("seconds")
    for label, r in results.items():
        if fp and label.startswith("ours") and "cached" not in label:
            print(f"\nfingerprint (cold) {fp:.1f} s = {100 * fp / r['seconds']:.0f}% of {label}'s wall time (which includes it)")

if __name__ == "__main__":
    main()
