"""Run one checkpoint in the real vLLM engine (the vllm venv) and write what it produced as JSON.

Usage: python engine.py JOB.json OUT.json, where JOB has
  ckpt:        checkpoint directory
  dtype:       "bfloat16" | "float32" | ...
  quantization: optional method name forced on the engine (e.g. "modelopt_fp4")
  stock_fp32:  serve a ModelOpt NVFP4 checkpoint in float32 through vLLM's own ModelOpt NVFP4
               method: stock vLLM admits only bf16/fp16 activations for it, so this registers a
               subclass that changes nothing but the admitted dtypes (same parameters, loaders
               and kernel); compressed-tensors admits float32 already
  generate:    list of prompts as token-id lists: greedy continuations of `max_tokens` tokens
  score:       list of token-id lists: per position, the logprob of the actual next token and the
               engine's top-`topk` logprobs (prompt logprobs)
  kv_cache_dtype: optional KV-cache dtype of the engine (e.g. "fp8"); the output then has
               "kv_scales": {attention layer: [k_scale, v_scale]} as the engine's attention
               layers hold them after loading
Prompts run one request at a time, so every engine step holds one request (a prefill of the whole
prompt, then single-row decode steps).

A batch: JOB is {"runs": [job, ...]}, each job with a "name" besides the keys above. The engines
are built one after the other in this one process (vLLM imported once), each shut down with
vLLM's own cleanup before the next is built; OUT is then {"runs": {name: output}}, rewritten
(atomically) after every run, so that a caller can take each run's output as soon as it is
there. A job's checkpoint may still be being packed when the batch starts: the run waits up to
"wait_s" seconds (default 0) for its config.json (pack renames a finished checkpoint into place). Each run's
log lines follow a line "<RUN_MARKER> name" (common.split_log cuts the log there). The process
environment (RESSERVE_VLLM_METHOD, VLLM_ENABLE_V1_MULTIPROCESSING, ...) is the same for every
run of a batch: runs that need another environment go in another batch.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


STOCK_FP32 = "modelopt_fp4_admit_fp32"
RUN_MARKER = "=== resserve test engine run:"  # common.RUN_MARKER
_stock_fp32_registered = False


def register_stock_fp32() -> None:
    global _stock_fp32_registered
    if _stock_fp32_registered:  # once per process: a second registration of the name is an error
        return
    _stock_fp32_registered = True
    import torch
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    @register_quantization_config(STOCK_FP32)
    class ModelOptNvFp4AdmitFp32(ModelOptNvFp4Config):
        def get_name(self):
            return STOCK_FP32

        def get_supported_act_dtypes(self):
            return [torch.float32, *super().get_supported_act_dtypes()]

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
            return STOCK_FP32 if user_quant == STOCK_FP32 else None


def kv_scales(model) -> dict:
    """{attention layer: [k_scale, v_scale]} of the loaded model's attention layers: the floats
    vLLM's kernels receive (``_k_scale_float`` / ``_v_scale_float``)."""
    from vllm.model_executor.layers.attention import Attention

    return {n: [m._k_scale_float, m._v_scale_float] for n, m in model.named_modules() if isinstance(m, Attention)}


def wait_for_checkpoint(job: dict) -> None:
    deadline = time.time() + job.get("wait_s", 0)
    while not os.path.exists(os.path.join(job["ckpt"], "config.json")):
        if time.time() > deadline:
            raise FileNotFoundError(f"no checkpoint at {job['ckpt']} after {job.get('wait_s', 0)} s")
        time.sleep(0.5)


def run(job: dict) -> dict:
    """Build the engine of one job, answer its questions, shut it down; its output."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    kw = {}
    if job.get("stock_fp32"):
        register_stock_fp32()
        kw["quantization"] = STOCK_FP32
    if job.get("quantization"):
        kw["quantization"] = job["quantization"]
    llm = LLM(
        model=job["ckpt"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job.get("max_model_len", 512),
        enforce_eager=True,
        seed=0,
        max_num_seqs=1,
        # A prefix-cache hit would shorten a step to the uncached rows, and the resserve method
        # picks its mode (K-Ext or full) from a step's row count: keep steps whole.
        enable_prefix_caching=False,
        **({"kv_cache_dtype": job["kv_cache_dtype"]} if job.get("kv_cache_dtype") else {}),
        **kw,
    )
    out = {"load_s": time.time() - t0, "quantization": llm.llm_engine.model_config.quantization}
    if job.get("kv_cache_dtype"):
        out["kv_cache_dtype"] = llm.llm_engine.vllm_config.cache_config.cache_dtype
        out["kv_scales"] = llm.apply_model(kv_scales)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 32), ignore_eos=True)
    out["generate"] = []
    for ids in job.get("generate", []):
        res = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)[0]
        out["generate"].append(list(res.outputs[0].token_ids))
    topk = job.get("topk", 5)
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=topk)
    out["score"] = []
    for ids in job.get("score", []):
        res = llm.generate([TokensPrompt(prompt_token_ids=ids)], scoring, use_tqdm=False)[0]
        actual, top = [], []
        for pos, lp in enumerate(res.prompt_logprobs[1:], start=1):
            actual.append(lp[ids[pos]].logprob)
            top.append({str(t): v.logprob for t, v in lp.items() if v.rank is not None and v.rank <= topk})
        out["score"].append({"actual": actual, "top": top})
    out["wall_s"] = time.time() - t0
    shutdown(llm)
    return out


def shutdown(llm) -> None:
    """Stop the engine and free what it holds, so that the next engine of a batch starts as in a
    fresh process: vLLM's own teardown between engines (its test suite builds many in one
    process), which also drops its cached environment variables; "once" log lines are logged
    again by the next engine (the MoE tests look for the kernel line in each run's log)."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.logger import _print_debug_once, _print_info_once, _print_warning_once

    llm.llm_engine.engine_core.shutdown()
    del llm
    cleanup_dist_env_and_memory()
    gc.collect()
    for f in (_print_debug_once, _print_info_once, _print_warning_once):
        f.cache_clear()


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    import torch

    torch.set_num_threads(int(os.environ.get("RESSERVE_TEST_THREADS", "2")))
    if "runs" not in job:
        json.dump(run(job), open(out_path, "w"))
        return
    import vllm  # noqa: F401  (imported while the first checkpoint may still be being packed)

    outs = {}
    for j in job["runs"]:
        wait_for_checkpoint(j)
        print(f"{RUN_MARKER} {j['name']}", flush=True)
        outs[j["name"]] = run(j)
        with open(out_path + ".tmp", "w") as f:
            json.dump({"runs": outs}, f)
        os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
