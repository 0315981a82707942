"""Overhead of calibrate's statistics hooks and KV-cache observer (what `calibrate` runs), as a
ratio to the same forward passes without them; ``stats_only_*`` is the hooks alone.

Both arms run in one process on the same batches, interleaved (A B A B ...), after one warm-up
each; the ratio is the median of per-pair ratios (robust to a noisy, shared machine) and the
ratio of total times. On CPU the process CPU time is reported too (wall time on a shared 2-core
machine is mostly scheduling noise).

  python bench/calibrate.py cpu              # SmolLM2-135M (embedded), real text, bf16
  python bench/calibrate.py gpu              # random Qwen3-1.7B-shaped model on one CUDA GPU
  python bench/calibrate.py multi-gpu        # same model through device_map="auto" over every
                                             # visible GPU; statistics compared with one GPU
  python bench/calibrate.py moe [--device cpu|cuda:0]
                                             # random mixture-of-experts model (Qwen3-MoE layout):
                                             # --moe-calib routed and all against the bare forward

Targets: hooked / plain <= 1.10 (dense); routed / plain <= 1.15 (MoE), all reported beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from resserve_export.stages.calibrate import run as cal  # noqa: E402
from resserve_export.observers import stats
from resserve_export.modeling import forward
from resserve_export.storage import calibration
from resserve_export.modeling import modelio  # noqa: E402
from resserve_export.modeling.groups import group_linears, linears_of  # noqa: E402

# Qwen3-1.7B's published shape (config.json of Qwen/Qwen3-1.7B).
QWEN3_1_7B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
)


def sync(model) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def forward_plain(model, batches, kw) -> None:
    dev = forward.input_device(model)
    with torch.inference_mode():
        for b in batches:
            model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev), **kw)


def forward_hooked(model, batches, groups, kw, with_kv: bool = True) -> dict:
    """What `calibrate` runs: the statistics hooks and (`with_kv`) the KV-cache observer."""
    from resserve_export.observers.kv import KVCollector

    dev = forward.input_device(model)
    kv = KVCollector(model) if with_kv else None
    with stats.StatsCollector(model, groups) as col, torch.inference_mode():
        for b in batches:
            col.set_mask(b["attention_mask"])
            extra = {}
            if kv is not None:
                kv.set_mask(b["attention_mask"])
                extra = kv.forward_kwargs()
            model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev), **{**kw, **extra})
            col.end_batch()
            if kv is not None:
                kv.end_batch()
        return col.result(), kv.result() if kv is not None else None


def timed(fn, model) -> tuple[float, float]:
    sync(model)
    w, c = time.perf_counter(), time.process_time()
    fn()
    sync(model)
    return time.perf_counter() - w, time.process_time() - c


def overhead(model, batches, reps: int) -> dict:
    groups = group_linears(linears_of(model))
    kw = forward.forward_kwargs(model)
    plain = lambda: forward_plain(model, batches, kw)  # noqa: E731
    hooked = lambda: forward_hooked(model, batches, groups, kw)  # noqa: E731
    stats_only = lambda: forward_hooked(model, batches, groups, kw, with_kv=False)  # noqa: E731
    plain(), hooked(), stats_only()  # warm-up
    pw, pc, hw, hc, sw = [], [], [], [], []
    for _ in range(reps):
        a = timed(plain, model)
        b = timed(hooked, model)
        c = timed(stats_only, model)
        pw.append(a[0]), pc.append(a[1]), hw.append(b[0]), hc.append(b[1]), sw.append(c[0])
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    return {
        "stats_only_ratio_wall_median_of_pairs": statistics.median(s / p for s, p in zip(sw, pw)),
        "tokens_per_pass": tokens,
        "reps": reps,
        "plain_wall_s_median": statistics.median(pw),
        "hooked_wall_s_median": statistics.median(hw),
        "ratio_wall_median_of_pairs": statistics.median(h / p for h, p in zip(hw, pw)),
        "ratio_wall_total": sum(hw) / sum(pw),
        "ratio_cpu_total": sum(hc) / sum(pc),
        "plain_tokens_per_s": tokens / statistics.median(pw),
    }


def random_batches(n: int, batch: int, seq: int, vocab: int, pad_rows: int = 0, seed: int = 0) -> list[dict]:
    """Random token batches; `pad_rows` rows per batch are cut to half length (right padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[:pad_rows, seq // 2 :] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


SHAPE = dict(QWEN3_1_7B)
# --smoke: the same code paths on a tiny model, to check the script on a CPU before a GPU run.
SMOKE = dict(QWEN3_1_7B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)


def qwen3_shaped(device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**SHAPE)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return model.eval()


def bench_cpu(args) -> dict:
    from resserve_export.modeling import data

    torch.set_num_threads(args.threads)
    model_dir = modelio.resolve_model(str(modelio.default_model()))
    model = modelio.load_model(model_dir, "bfloat16")
    tok = modelio.load_tokenizer(model_dir)
    samples = data.make_samples(tok, data.load_documents("shakespeare"), args.batch * args.batches, args.seq, 42)
    batches = data.batches(samples, args.batch, data.pad_id(tok))
    res = {}
    default = stats.CPU_CHUNK_ELEMENTS
    # The default row-chunked reduction, and one chunk per hook (whole activation, reused buffer).
    for name, chunk in (("chunked", default), ("one_chunk", 1 << 62)):
        stats.CPU_CHUNK_ELEMENTS = chunk
        res[name] = overhead(model, batches, args.reps)
    stats.CPU_CHUNK_ELEMENTS = default
    res.update(device="cpu", threads=args.threads, model="SmolLM2-135M-Instruct (bf16)", batch=args.batch, seq=args.seq, batches=args.batches)
    return res


def bench_gpu(args) -> dict:
    model = qwen3_shaped(args.device)
    out = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "model": "random Qwen3-1.7B-shaped (bf16)" if SHAPE == QWEN3_1_7B else "tiny smoke model", "batch": args.batch, "seq": args.seq}
    full = random_batches(args.batches, args.batch, args.seq, SHAPE["vocab_size"])
    padded = random_batches(args.batches, args.batch, args.seq, SHAPE["vocab_size"], pad_rows=args.batch // 2)
    default = stats.StatsCollector.gpu_reduction
    for variant in (default, *[v for v in ("norm", "abs") if v != default]):
        stats.StatsCollector.gpu_reduction = variant
        out[f"no_padding[{variant}]"] = overhead(model, full, args.reps)
        out[f"half_rows_padded[{variant}]"] = overhead(model, padded, args.reps)
    stats.StatsCollector.gpu_reduction = default
    return out


def bench_multi_gpu(args) -> dict:
    """device_map="auto" over every visible GPU, through the same loader and hooks as the CLI."""
    n_gpu = torch.cuda.device_count()
    batches = random_batches(args.batches, args.batch, args.seq, SHAPE["vocab_size"], pad_rows=1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3-1.7b-random"
        m = qwen3_shaped("cpu")
        m.save_pretrained(model_dir)
        del m
        t = time.perf_counter()
        model = modelio.load_model_on(model_dir, "auto", "bfloat16", offload_folder=Path(tmp) / "offload")
        load_s = time.perf_counter() - t
        placement: dict[str, int] = {}
        for v in getattr(model, "hf_device_map", {"": "cpu"}).values():
            placement[str(v)] = placement.get(str(v), 0) + 1
        groups = group_linears(linears_of(model))
        t = time.perf_counter()
        spread, tokens = stats.collect(model, batches, groups)
        sync(model)
        spread_s = time.perf_counter() - t
        del model
        torch.cuda.empty_cache()
        single_model = modelio.load_model_on(model_dir, "cuda:0" if n_gpu else "cpu", "bfloat16")
        t = time.perf_counter()
        single, tokens1 = stats.collect(single_model, batches, groups)
        sync(single_model)
        single_s = time.perf_counter() - t
        out_dir = cal.write_dir_atomic(Path(tmp) / "calib", lambda d: calibration.save_stats(spread, d / "salience.safetensors"))
        written = sorted(p.name for p in out_dir.iterdir())
    rel = max(float(((spread[k]["mean_abs"].double() - single[k]["mean_abs"].double()).abs() / single[k]["mean_abs"].double().clamp_min(1e-30)).max()) for k in single)
    amax_equal = all(torch.equal(spread[k]["amax"], single[k]["amax"]) for k in single)
    return {
        "gpus": n_gpu,
        "device_map_modules_per_device": placement,
        "load_s": load_s,
        "tokens": tokens,
        "tokens_single": tokens1,
        "spread_collect_s": spread_s,
        "single_gpu_collect_s": single_s,
        "mean_abs_max_rel_diff_vs_single_gpu": rel,
        "amax_identical": amax_equal,
        "written": written,
    }


# A Qwen3-30B-A3B-like expert layout (128 experts of 768, top 8) scaled to a CPU: 64 experts of
# 256 over hidden 1024, top 8; --shape 30b for the real Qwen3-30B-A3B shape on a GPU.
MOE_SMALL = dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
                 num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000)
MOE_30B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936)


def bench_moe(args) -> dict:
    """The statistics hooks with every expert seen (`experts.ExpertCollector`, routed and all)
    against the bare forward: transformers' default experts implementation and its eager loop
    (which the collector runs)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from resserve_export.observers.experts import ExpertCollector
    from resserve_export.modeling.experts import expert_blocks
    from resserve_export.modeling.groups import group_linears, linears_of
    from resserve_export.observers.kv import KVCollector

    torch.set_num_threads(args.threads)
    shape = MOE_30B if args.shape == "30b" else MOE_SMALL
    if args.layers:  # fewer decoder layers of the same shape (the 30b shape's 48 need a 141 GB card)
        shape = dict(shape, num_hidden_layers=args.layers)
    if args.smoke:
        shape = dict(shape, hidden_size=64, moe_intermediate_size=32, num_experts=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: the 30b shape in float32 would not fit one GPU
    try:
        with torch.device(dev):
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape)).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    from resserve_export.stages.size import shapes_from_config

    blocks = expert_blocks(shapes_from_config(dict(model.config.to_dict(), model_type="qwen3_moe")))  # the checkpoint's expert names
    batches = random_batches(args.batches, args.batch, args.seq, shape["vocab_size"], pad_rows=args.batch // 4)
    dense = group_linears(linears_of(model))
    kw = forward.forward_kwargs(model)
    default_impl = model.config._experts_implementation

    def plain(impl):
        def run():
            model.config._experts_implementation = impl
            forward_plain(model, batches, kw)
            model.config._experts_implementation = default_impl
        return run

    result_s = {"routed": [], "all": []}

    def hooked(mode):
        def run():
            kv = KVCollector(model)
            with ExpertCollector(model, blocks, mode) as ec:
                stats.collect(model, batches, dense, kv=kv, experts=ec)
            sync(model)
            t = time.perf_counter()
            ec.result()  # once per calibration run, whatever its length: timed apart as well
            result_s[mode].append(time.perf_counter() - t)
        return run

    arms = {"plain_default": plain(default_impl), "plain_eager": plain("eager"), "routed": hooked("routed"), "all": hooked("all")}
    for fn in arms.values():
        fn()  # warm-up
    times = {k: [] for k in arms}
    for _ in range(args.reps):
        for k, fn in arms.items():
            times[k].append(timed(fn, model)[0])
    base = times["plain_default"]
    for mode in ("routed", "all"):  # the passes alone: the arm's time less its one-off result()
        times[f"{mode}_passes"] = [t - r for t, r in zip(times[mode], result_s[mode][1:])]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({args.threads} threads)",
        "model": f"random Qwen3-MoE, {shape['num_hidden_layers']} layers, {shape['num_experts']} experts x {shape['moe_intermediate_size']} "
        f"(top {shape['num_experts_per_tok']}), hidden {shape['hidden_size']}, bf16",
        "default_experts_implementation": default_impl,
        "tokens_per_pass": tokens,
        "reps": args.reps,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "result_median_s": {k: statistics.median(v[1:]) for k, v in result_s.items()},
        "ratio_to_default_median_of_pairs": {k: statistics.median(a / b for a, b in zip(v, base)) for k, v in times.items()},
        "ratio_to_eager_median_of_pairs": {k: statistics.median(a / b for a, b in zip(v, times["plain_eager"])) for k, v in times.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["cpu", "gpu", "multi-gpu", "moe"])
    p.add_argument("--shape", choices=["small", "30b"], default="small", help="moe: the model's shape")
    p.add_argument("--layers", type=int, default=None, help="moe: decoder layers (default: the shape's)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batches", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny model, few reps: check the script itself")
    args = p.parse_args()
    if args.smoke:
        SHAPE.update(SMOKE)
    if args.mode == "cpu":
        args.seq, args.batches, args.reps = args.seq or 256, args.batches or 2, args.reps or 5
        res = bench_cpu(args)
    elif args.mode == "moe":
        args.seq, args.batches, args.reps = args.seq or 256, args.batches or 2, args.reps or 5
        res = bench_moe(args)
    elif args.mode == "gpu":
        args.seq, args.batches, args.reps = args.seq or 2048, args.batches or 4, args.reps or 10
        res = bench_gpu(args)
    else:
        args.seq, args.batches = args.seq or 2048, args.batches or 4
        res = bench_multi_gpu(args)
    res["mode"] = args.mode
    res["torch"] = torch.__version__
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
