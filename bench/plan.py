"""Planner and scoring costs (docs/formats.md, "Ratio planner").

1. Solve time for 400 groups × 5 ratios (target < 1 s) with CBC, HiGHS (when installed) and the
   greedy baseline, on seeded random scores shaped like real ones (damage falls with the ratio,
   group sizes of Qwen3-8B's linears), and the greedy objective's gap to the optimum.
2. On SmolLM2-135M (the embedded default model): the cost of grad scoring as a ratio to one
   calibration pass (`calibrate.collect`, the statistics forward) over the same batches (target
   ≤ 3×), for the default precision (bf16 GEMMs where fast) and the FP32 emulation, next to a
   plain forward + backward of the same loss (the floor); the one-off weight quantization of the
   candidates and the first run's compiles reported apart; and the cost of KL scoring, measured
   on a subset of groups and extrapolated per (group, ratio) pass.

    python bench/plan.py                       # both parts, markdown on stdout
    python bench/plan.py --part solve
    python bench/plan.py --samples 8 --seq-len 128 --write   # also write bench/results/plan.md

CPU timings on a shared machine are noisy: each figure is the median of `--repeat` runs, and the
scoring ratio compares passes run back to back in the same process. `--write` regenerates the
measured sections and keeps any other `## ` section of the existing file (earlier runs under
their own headings, the hand-written Reading).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RATIOS = (0.0, 0.125, 0.25, 0.5, 1.0)
# (out, in) of Qwen3-8B's decision groups: q/k/v, o, gate/up, down.
QWEN3_8B = [(4096 + 1024 + 1024, 4096), (4096, 4096), (2 * 12288, 4096), (4096, 12288)]


def random_scores(groups: int, seed: int) -> dict:
    rng = random.Random(seed)
    out = []
    for l in range(groups):
        n, k = QWEN3_8B[l % 4]
        base = rng.lognormvariate(0, 1.0)
        # Damage falls with the ratio at a group-specific rate, with noise.
        rate = rng.uniform(0.2, 0.9)
        vals = [base * (1 - rate * (r ** 0.7)) * rng.uniform(0.95, 1.05) for r in RATIOS]
        out.append({"modules": [f"model.layers.{l // 4}.g{l % 4}"], "weight_count": n * k, "scores": {f"{r:g}": v for r, v in zip(RATIOS, vals)}})
    return {"method": "synthetic", "samples": 0, "ratios": list(RATIOS), "groups": out}


def bench_solve(repeat: int) -> list[str]:
    from resserve_export.planners.ilp import available
    from resserve_export.stages.plan import build_plan

    solvers = ["cbc"] + (["highs"] if available("highs") else []) + ["greedy"]
    lines = [
        "## Solve time: 400 groups × 5 ratios",
        "",
        f"Median of {repeat} runs, wall time of `plan.build_plan` (problem build + solve + checks).",
        "",
        "| budget | solver | time (s) | objective | gap to ILP |",
        "| --- | --- | --- | --- | --- |",
    ]
    scores = random_scores(400, seed=0)
    for budget in (4.5, 5.0, 6.0):
        best = None
        for solver in solvers:
            times, obj = [], None
            for _ in range(repeat):
                t = time.perf_counter()
                plan = build_plan(scores, budget, solver=solver)
                times.append(time.perf_counter() - t)
                obj = plan["objective"]
                assert plan["achieved_bits"] <= budget
            best = obj if best is None else best
            gap = (obj - best) / best
            lines.append(f"| {budget:g} | {solver} | {statistics.median(times):.3f} | {obj:.4f} | {gap:+.3%} |")
    return lines


def forward_backward(model, batches) -> None:
    """The floor of any grad method: forward + backward of the scores' loss (summed next-token
    cross-entropy over valid targets, `scores.loss`), input gradients only, no score hooks."""
    from resserve_export.algorithms.scores.loss import next_token_loss
    from resserve_export.algorithms.scores.mlp import fused_mlps
    from resserve_export.algorithms.scores.norm import fused_norms

    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        with fused_norms(model), fused_mlps(model):  # as the grad scores run them (RESSERVE_FUSED_NORM/_MLP=1)
            for b in batches:
                ids, mask = b["input_ids"], b["attention_mask"]
                emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=emb, attention_mask=mask, use_cache=False).logits
                next_token_loss(logits, ids, mask)[0].backward()
    finally:
        for p, f in flags:
            p.requires_grad_(f)


def bench_scores(samples: int, seq_len: int, batch_size: int, kl_groups: int, repeat: int) -> list[str]:
    import torch

    from resserve_export.modeling import data
    from resserve_export.modeling import modelio
    from resserve_export.algorithms import scores as S
    from resserve_export.observers.stats import collect
    from resserve_export.modeling.groups import group_linears, linears_of

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model_dir = modelio.resolve_model(str(modelio.default_model()))
    model = modelio.load_model(model_dir, dtype="bfloat16")
    tok = modelio.load_tokenizer(model_dir)
    batches = data.batches(data.make_samples(tok, data.load_documents("shakespeare"), samples, seq_len, 42), batch_size, data.pad_id(tok))
    groups = group_linears(linears_of(model))
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)

    collect(model, batches[:1], groups)  # warm-up
    calib = []
    for _ in range(repeat):
        t = time.perf_counter()
        stats, _ = collect(model, batches, groups)
        calib.append(time.perf_counter() - t)
    t_calib = statistics.median(calib)

    t = time.perf_counter()
    cands = S.build_candidates(model, groups, stats, RATIOS)
    t_build = time.perf_counter() - t

    # The floor of any grad method: forward + backward of the same loss with no score hooks.
    def fwd_bwd():
        forward_backward(model, batches)

    floor = []
    for _ in range(repeat):
        t = time.perf_counter()
        fwd_bwd()
        floor.append(time.perf_counter() - t)
    t_floor = statistics.median(floor)

    precision = S.resolve_precision("auto", torch.device("cpu"), torch.bfloat16)
    # One-off costs of the bf16 path (compiling its fused preparation, the bf16 weight operands),
    # paid on the first batch and reported apart.
    t = time.perf_counter()
    S.compute_scores(model, batches[:1], stats, groups, "grad", candidates=cands, show_progress=False, precision=precision)
    t_first = time.perf_counter() - t

    def timed(prec):
        runs = []
        for _ in range(repeat):
            t = time.perf_counter()
            S.compute_scores(model, batches, stats, groups, "grad", candidates=cands, show_progress=False, precision=prec)
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    t_grad = timed(precision)
    t_grad32 = timed("fp32") if precision != "fp32" else t_grad

    # KL: the first and last layers' groups (reruns from layer 0 are the longest, from the last the shortest).
    sub = groups[: kl_groups // 2] + groups[-(kl_groups - kl_groups // 2) :]
    t = time.perf_counter()
    S.compute_scores(model, batches, stats, sub, "kl", candidates=cands, show_progress=False)
    t_kl_sub = time.perf_counter() - t
    per_pass = t_kl_sub / (len(sub) * len(RATIOS))
    t_kl_all = per_pass * len(groups) * len(RATIOS)

    return [
        "## Scoring cost on SmolLM2-135M (bf16, CPU)",
        "",
        f"{samples} calibration samples × ≤{seq_len} tokens ({tokens} valid tokens), batch {batch_size}, "
        f"{len(groups)} decision groups × {len(RATIOS)} ratios, {torch.get_num_threads()} threads, median of {repeat}.",
        "",
        "| pass | time (s) | × calibration pass |",
        "| --- | --- | --- |",
        f"| calibration pass (`calibrate.collect`) | {t_calib:.2f} | 1.00 |",
        f"| forward + backward of the loss alone, no score hooks (the floor of any grad method) | {t_floor:.2f} | {t_floor / t_calib:.2f} |",
        f"| **grad scores, all groups, all ratios, `precision={precision}` (the default here)** | {t_grad:.2f} | **{t_grad / t_calib:.2f}** |",
        f"| grad scores, `precision=fp32` (FP32 emulation) | {t_grad32:.2f} | {t_grad32 / t_calib:.2f} |",
        f"| one-off weight quantization of every candidate (independent of the data) | {t_build:.2f} | {t_build / t_calib:.2f} |",
        f"| first grad run on one batch, `precision={precision}`: compiles + bf16 weight operands (one-off) | {t_first:.2f} | {t_first / t_calib:.2f} |",
        f"| KL scores, {len(sub)} groups measured | {t_kl_sub:.2f} | {t_kl_sub / t_calib:.2f} |",
        f"| KL scores, all groups (extrapolated: {per_pass:.2f} s per (group, ratio) pass) | {t_kl_all:.0f} | {t_kl_all / t_calib:.0f} |",
    ]


# The opt-in pieces, each alone and all together: (key, what the rows call it, environment).
OPT_INS = (
    ("eager-pieces", "the models' own RMSNorms and the eager loss backward (`RESSERVE_FUSED_NORM=0 RESSERVE_FUSED_LOSS=0`; the defaults give their bits with less traffic)", {"RESSERVE_FUSED_NORM": "0", "RESSERVE_FUSED_LOSS": "0"}),
    ("group-python", "each group's GEMMs and sums launched from Python, a Triton reduction per member (`RESSERVE_GROUP_SUMS=0`; the default is one call of the CUDA extension per group)", {"RESSERVE_GROUP_SUMS": "0"}),
    ("old-paths", "all four defaults of 2026-12-07 off: norms, loss, group sums and the build in the forward pass (`RESSERVE_FUSED_NORM=0 RESSERVE_FUSED_LOSS=0 RESSERVE_GROUP_SUMS=0 RESSERVE_BUILD_IN_FORWARD=0`)", {"RESSERVE_FUSED_NORM": "0", "RESSERVE_FUSED_LOSS": "0", "RESSERVE_GROUP_SUMS": "0", "RESSERVE_BUILD_IN_FORWARD": "0"}),
    ("norm-ext", "the exact norms' steps launched from the CUDA extension, not Triton (`RESSERVE_NORM_LAUNCH=extension`)", {"RESSERVE_NORM_LAUNCH": "extension"}),
    ("norm-eager", "the models' own RMSNorms and autograd (`RESSERVE_FUSED_NORM=0`; the default is their bits through `norm._ExactNorm`)", {"RESSERVE_FUSED_NORM": "0"}),
    ("loss", "the fused loss (`RESSERVE_FUSED_LOSS=1`)", {"RESSERVE_FUSED_LOSS": "1"}),
    ("norm", "the fused RMSNorms (`RESSERVE_FUSED_NORM=1`)", {"RESSERVE_FUSED_NORM": "1"}),
    ("norm-bwd", "the RMSNorms' backward fused, their own forward (`RESSERVE_FUSED_NORM=backward`)", {"RESSERVE_FUSED_NORM": "backward"}),
    ("mlp", "the fused MLP activations (`RESSERVE_FUSED_MLP=1`)", {"RESSERVE_FUSED_MLP": "1"}),
    ("exact-triton", "the exact bf16 operands through the Triton kernel, not the CUDA extension (`RESSERVE_EXACT_OPERAND=triton`)", {"RESSERVE_EXACT_OPERAND": "triton"}),
    ("fused", "all three fused pieces", {"RESSERVE_FUSED_LOSS": "1", "RESSERVE_FUSED_NORM": "1", "RESSERVE_FUSED_MLP": "1"}),
    ("all", "all three fused pieces and the candidates built ahead", {"RESSERVE_FUSED_LOSS": "1", "RESSERVE_FUSED_NORM": "1", "RESSERVE_FUSED_MLP": "1", "RESSERVE_BUILD_AHEAD": "1"}),
)


def bench_scores_gpu(batches_n: int, batch_size: int, seq_len: int, repeat: int, smoke: bool = False, profile: bool = False,
                     opt_ins: list[str] | None = None, skip: frozenset = frozenset()) -> list[str]:
    """Grad-scoring cost on one CUDA GPU: a random Qwen3-1.7B-shaped bf16 model on random tokens
    (the cost does not depend on the weights), against the calibration pass over the same batches.
    Each figure is also printed to stderr as soon as it is measured (a run cut short keeps them),
    and an opt-in piece that fails is reported in the table instead of ending the run. `opt_ins`:
    the keys of `OPT_INS` to time (None: all); `skip`: rows left out to save device time
    (``fp32``, ``eager``, ``hooks``, ``thread``, ``ahead``)."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import calibrate as bench_calibrate  # bench/calibrate.py: the model shape and random batches

    from resserve_export.algorithms import scores as S
    from resserve_export.observers.stats import collect
    from resserve_export.modeling.groups import group_linears, linears_of

    if smoke:
        bench_calibrate.SHAPE.update(bench_calibrate.SMOKE)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = bench_calibrate.qwen3_shaped(dev)
    vocab = bench_calibrate.SHAPE["vocab_size"]
    batches = [{k: v.to(dev) for k, v in b.items()} for b in bench_calibrate.random_batches(batches_n, batch_size, seq_len, vocab)]
    groups = group_linears(linears_of(model))
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def timed(fn, runs_n: int | None = None):
        fn()  # warm-up: compiles, cuBLAS handles, the allocator
        runs = []
        for _ in range(runs_n or repeat):
            sync()
            t = time.perf_counter()
            out = fn()
            sync()
            runs.append(time.perf_counter() - t)
        return statistics.median(runs), out

    def peak(fn) -> float:
        """Peak GPU memory (GiB) allocated during one run of `fn` (0 on a CPU)."""
        if dev != "cuda":
            return 0.0
        sync()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        return torch.cuda.max_memory_allocated() / 2**30

    t, runs, peaks, failed = {}, {}, {}, {}

    def measure(key: str, fn, runs_n: int | None = None) -> None:
        t[key], runs[key] = timed(fn, runs_n)
        print(f"[plan --part gpu] {key}: {t[key]:.3f} s", file=sys.stderr, flush=True)

    def failed_on(key: str, e: Exception) -> None:
        """Record (for the table) and print that opt-in `key` raised `e`; the run goes on."""
        failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"[plan --part gpu] {key} failed: {failed[key]}", file=sys.stderr, flush=True)

    # The anchor: at least 5 runs (one run once read 0.45 s for a pass that takes 0.19 s).
    measure("calib", lambda: collect(model, batches, groups), max(5, repeat))
    stats = runs["calib"][0]
    from resserve_export.algorithms.scores.bf16 import split_base

    def build():
        """The one-off work: every candidate quantized, and the bf16 path's weight operands made
        (which the first scored batch would otherwise make)."""
        cands = S.build_candidates(model, groups, stats, RATIOS)
        x = torch.empty((1, 1), dtype=torch.bfloat16, device=dev)
        for c in cands.values():
            c.build_fast_weights(split_base(x, c.linears))
        return cands

    measure("build", build)
    cands = runs["build"]
    if profile:
        profiled("one-off weight quantization of every candidate", build)
        profiled(
            "grad scores, bf16 (after one warm-up run)",
            lambda: S.compute_scores(model, batches, stats, groups, "grad", candidates=cands, show_progress=False, precision="bf16"),
            warm=True,
        )

    def fwd_bwd():
        forward_backward(model, batches)

    def scored(prec):
        return lambda: S.compute_scores(model, batches, stats, groups, "grad", candidates=cands, show_progress=False, precision=prec)

    scratch = lambda: S.compute_scores(model, batches, stats, groups, "grad", show_progress=False, precision="bf16")  # noqa: E731
    measure("floor", fwd_bwd)
    peaks["eager"] = peak(fwd_bwd)
    for prec in ("bf16", "fp32"):
        if prec not in skip:
            measure(prec, scored(prec))
    # The bf16 path as it was before its Triton kernels (`scores.fused`): eager reductions and
    # operands, for the time and as the reference the kernels' scores are compared with.
    from resserve_export.algorithms.scores import fused
    from resserve_export.algorithms.scores.device import mm_f32_native

    if "eager" not in skip:
        with mock.patch.object(fused, "available", lambda device: False):
            measure("eager", scored("bf16"))
    # Each opt-in piece alone, then all of them: the forward + backward, its peak, and the scores.
    chosen = [o for o in OPT_INS if opt_ins is None or o[0] in opt_ins]
    for key, _, env in chosen:
        with mock.patch.dict(os.environ, env):
            try:
                measure(f"floor-{key}", fwd_bwd)
                peaks[key] = peak(fwd_bwd)
                measure(f"grad-{key}", scored("bf16"))
                measure(f"scratch-{key}", scratch)
            except Exception as e:  # noqa: BLE001 - a bench reports a broken opt-in and goes on
                failed_on(key, e)
    # The scoring thread (`scores.worker`) on and off, whichever is the default: scores from the
    # prebuilt candidates, and what `calibrate --scores grad` runs, compute_scores building its own
    # candidates (with the thread, each group on first use there, while the model's passes run);
    # and from scratch with the candidates built ahead on a thread of their own while the first
    # batch runs (`pool.build_ahead`, RESSERVE_BUILD_AHEAD=1) instead of all before the first batch.
    from resserve_export.algorithms.scores.worker import wanted

    for flag, tag in (("0", "hooks"), ("1", "thread")):
        if tag in skip:
            continue
        with mock.patch.dict(os.environ, {"RESSERVE_SCORE_THREAD": flag}):
            measure(tag, scored("bf16"))
            measure(f"scratch-{tag}", scratch)
    if "ahead" not in skip:
        with mock.patch.dict(os.environ, {"RESSERVE_SCORE_THREAD": "0", "RESSERVE_BUILD_AHEAD": "1"}):
            try:
                measure("scratch-ahead", scratch)
            except Exception as e:  # noqa: BLE001
                failed_on("ahead", e)
    default = "thread" if wanted() else "hooks"

    def moved(a: str, b: str) -> str:
        """Largest relative difference between two runs' scores.json records, over (group, ratio)."""
        if a not in runs or b not in runs:
            return "n/a"
        pairs = zip(runs[a]["groups"], runs[b]["groups"])
        return f"{max(abs(x - y) / max(abs(y), 1e-30) for ga, gb in pairs for x, y in zip(ga['scores'].values(), gb['scores'].values())):.2e}"

    def row(label: str, key: str, bold: bool = False) -> str:
        if key not in t:
            why = failed.get(key.split("-", 1)[-1])
            return f"| {label} | {'failed' if why else 'not run'} | {why or ''} |"
        r = f"{t[key] / t['calib']:.2f}"
        return f"| {label} | {t[key]:.3f} | {'**' + r + '**' if bold else r} |"

    kernels = fused.available(torch.device(dev))
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    # The bf16 path's base product: two GEMMs with FP32 outputs where torch runs them, else one
    # GEMM of width 3K (`scores.Candidates.prepare_fast`).
    split = mm_f32_native(torch.device(dev, 0) if dev == "cuda" else torch.device(dev), torch.bfloat16)
    layout = "split: X̂'Ŵ'ᵀ and X Wᵀ with FP32 outputs" if split else "fused: one GEMM of width 3K"
    t["apart"] = t["bf16"] + t["build"]
    return [
        f"## Scoring cost on one GPU ({name}, random Qwen3-1.7B-shaped bf16 model)",
        "",
        f"{batches_n} batches × {batch_size} × {seq_len} random tokens ({tokens} tokens), {len(groups)} decision groups × "
        f"{len(RATIOS)} ratios, median of {repeat} after one warm-up run (the calibration pass: of {max(5, repeat)}), torch {torch.__version__}, bf16 base product {layout}. "
        "Produced by `python bench/plan.py --part gpu`.",
        "",
        "| pass | time (s) | × calibration pass |",
        "| --- | --- | --- |",
        row("calibration pass (`calibrate.collect`)", "calib"),
        row("forward + backward of the loss alone, no score hooks", "floor"),
        *(row(f"the same with {label}", f"floor-{key}") for key, label, _ in chosen),
        row("**grad scores, `precision=bf16` (the default for bf16 models)**", "bf16", bold=True),
        row(f"grad scores, bf16, scored inside the gradient hooks{' (the default)' if default == 'hooks' else ''}", "hooks"),
        row(f"grad scores, bf16, on the scoring thread{' (the default)' if default == 'thread' else ''}", "thread"),
        *(row(f"grad scores, bf16, with {label}", f"grad-{key}") for key, label, _ in chosen),
        row("grad scores, bf16, eager reductions and operands (no Triton kernels)", "eager"),
        row("grad scores, `precision=fp32` (FP32 emulation)", "fp32"),
        row("one-off weight quantization of every candidate, bf16 weight operands included", "build"),
        row("**grad scores + one-off quantization, timed apart**", "apart", bold=True),
        row("**grad scores from scratch** (`compute_scores` building its own candidates before the first batch, what `calibrate` runs), inside the hooks", "scratch-hooks", bold=True),
        row("grad scores from scratch, candidates built ahead on their own thread (`RESSERVE_BUILD_AHEAD=1`)", "scratch-ahead"),
        *(row(f"grad scores from scratch with {label}", f"scratch-{key}") for key, label, _ in chosen),
        row("grad scores from scratch, on the scoring thread (candidates built there on first use)", "scratch-thread"),
        "",
        "Peak GPU memory of the forward + backward (GiB): "
        + ", ".join(f"{k} {v:.2f}" for k, v in peaks.items())
        + ".",
        "",
        f"Triton kernels {'used' if kernels else 'NOT available (the bf16 rows ran eagerly)'}. Largest relative difference over "
        f"{len(groups) * len(RATIOS)} (group, ratio) scores against the eager bf16 path: {moved('bf16', 'eager')} "
        "(stated tolerance 2e-4: the same FP32 products summed in another order); "
        + "; ".join(f"with {label}: {moved('bf16', f'grad-{key}')}" for key, label, _ in chosen)
        + f"; from scratch with all four: {moved('bf16', 'scratch-all')} (the same run's default from scratch against the prebuilt: {moved('bf16', 'scratch-hooks')}); between the hooks and the thread: "
        f"{moved('hooks', 'thread')}, and from scratch: {', '.join(moved('bf16', k) for k in ('scratch-hooks', 'scratch-thread', 'scratch-ahead'))} "
        f"(the same operations), against {moved('bf16', 'hooks')} between two runs of the same setting "
        "(on a GPU the model's backward is not deterministic, so two runs differ; on a CPU all three are 0).",
    ]


def profiled(title: str, fn, warm: bool = False, rows: int = 25) -> None:
    """Run `fn` under torch.profiler and print its most expensive operators by CUDA time and by
    host self time (the profile decides what to speed up next)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if warm:
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    table = prof.key_averages()
    print(f"\n### Profile: {title} ({wall:.3f} s wall under the profiler)\n")
    print(table.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["all", "solve", "scores", "gpu"], default="all", help="gpu: grad-scoring cost on one CUDA GPU (not part of all)")
    ap.add_argument("--gpu-batches", type=int, default=4)
    ap.add_argument("--gpu-batch-size", type=int, default=4)
    ap.add_argument("--gpu-seq-len", type=int, default=1024)
    ap.add_argument("--smoke", action="store_true", help="--part gpu on a tiny model (checks the script on a CPU)")
    ap.add_argument("--profile", action="store_true", help="--part gpu: also print torch.profiler tables of the one-off quantization and of one bf16 grad-scores run")
    ap.add_argument("--opt-ins", default=None, help="--part gpu: comma-separated opt-in keys to time (" + ", ".join(k for k, _, _ in OPT_INS) + "; default all)")
    ap.add_argument("--skip", default="", help="--part gpu: comma-separated rows to leave out (fp32, eager, hooks, thread, ahead)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--kl-groups", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="runs per solve figure")
    ap.add_argument("--score-repeat", type=int, default=1, help="runs per scoring figure (slow on CPU)")
    ap.add_argument("--write", action="store_true", help="write bench/results/plan.md")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "planners", "resserve_export", "bench"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# Planner benchmark (bench/plan.py)",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}{' (+ local changes)' if dirty else ''}, "
        f"{os.cpu_count()} CPU cores, load average {load:.1f} at start.",
        "",
    ]
    if args.part in ("all", "solve"):
        lines += bench_solve(args.repeat) + [""]
    if args.part in ("all", "scores"):
        lines += bench_scores(args.samples, args.seq_len, args.batch_size, args.kl_groups, args.score_repeat) + [""]
    if args.part == "gpu":
        lines += bench_scores_gpu(args.gpu_batches, args.gpu_batch_size, args.gpu_seq_len, args.score_repeat, args.smoke, args.profile,
                                  None if args.opt_ins is None else args.opt_ins.split(","), frozenset(filter(None, args.skip.split(",")))) + [""]
    text = "\n".join(lines)
    print(text)
    if args.write:
        out = ROOT / "bench" / "results" / "plan.md"
        kept = hand_written(out.read_text() if out.exists() else "", {l for l in lines if l.startswith("## ")})
        out.write_text(text.rstrip("\n") + "\n" + ("\n" + kept if kept else ""))


def hand_written(old: str, generated: set[str]) -> str:
    """The `## ` sections of an existing results file that this script does not generate (earlier
    runs under their own headings, the hand-written Reading), kept in order by --write."""
    keep, out = False, []
    for line in old.splitlines():
        if line.startswith("## "):
            keep = line not in generated
        elif line.startswith("# "):
            keep = False
        if keep:
            out.append(line)
    return "\n".join(out).strip("\n") + "\n" if out else ""


if __name__ == "__main__":
    main()
