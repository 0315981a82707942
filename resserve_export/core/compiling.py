"""`torch.compile` for the format core's fixed-shape graphs, with the eager function as fallback.

Several of our compiled callables are partials or closures of one Python function (the MXFP4
block quantizer per rounding, the scores' preparation per layer shape), and Dynamo keys its cache
on the code object: they share one frame's recompile budget (8 by default), which a process that
quantizes many shapes and formats (a test session, a model with many layer widths) exhausts, and
with ``fullgraph=True`` that is an error. So the budget is raised once, and a call that Dynamo
still refuses runs the eager function instead: the compiled graphs are bit-identical to it (each
caller's tests check that), so only speed changes. The same holds when compilation itself
fails (an inductor error on some torch version or CPU: seen with torch 2.11 on an Intel CPU for
the scores' preparation graph): the eager function runs from then on, and an error that is not
the compiler's is raised again by the eager call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings

import torch

RECOMPILE_LIMIT = 64
# Raised by Dynamo when a fullgraph function exceeds its budget (absent from older torch).
_LIMIT_HIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())


def _raise_limits() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
            setattr(cfg, name, RECOMPILE_LIMIT)
    if hasattr(cfg, "accumulated_recompile_limit") and cfg.accumulated_recompile_limit < 4 * RECOMPILE_LIMIT:
        cfg.accumulated_recompile_limit = 4 * RECOMPILE_LIMIT


_RAISED_HERE = threading.local()


def forget_raised_limits() -> None:
    """After the limits were restored (`api.restoring_process_state`): raise them again on next use."""
    _RAISED_HERE.done = False


def _raise_limits_in_this_thread() -> None:
    """`_raise_limits` once per thread: Dynamo's config is thread-local since torch 2.12, the
    autograd engine's GPU threads included (where the grad scores' hooks call compiled graphs),
    so a budget raised in the main thread does not reach them."""
    if not getattr(_RAISED_HERE, "done", False):
        _raise_limits()
        _RAISED_HERE.done = True


def compile_or_eager(fn, **options):
    """``torch.compile(fn, **options)``, falling back to `fn` itself for good once Dynamo refuses
    a recompilation (recompile limit reached)."""
    _raise_limits()
    _RAISED_HERE.done = True
    compiled = torch.compile(fn, **options)
    state = {"eager": False}

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not state["eager"]:
            _raise_limits_in_this_thread()
            try:
                return compiled(*args, **kwargs)
            except _LIMIT_HIT:
                state["eager"] = True
                warnings.warn("torch.compile recompile limit reached: running the eager (bit-identical) path", RuntimeWarning, stacklevel=2)
            except Exception as e:  # a compiler failure; a genuine error repeats in the eager call
                state["eager"] = True
                warnings.warn(
                    f"torch.compile failed ({type(e).__name__}): running the eager (bit-identical) path", RuntimeWarning, stacklevel=2
                )
        return fn(*args, **kwargs)

    return run


@functools.lru_cache(maxsize=None)
def triton_modules():
    """``(triton, triton.language)``, or None where Triton is missing or fails to import: the
    callers with Triton kernels then run their eager path."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 (no Triton, or one that fails to import: eager instead)
        return None
    return triton, tl


def triton_kernel(build):
    """Decorator: ``build(triton, tl)`` (which defines and returns a Triton kernel) becomes a
    function of no arguments that builds it once and returns it, or None where Triton is
    missing (`triton_modules`)."""

    @functools.lru_cache(maxsize=None)
    def get():
        mods = triton_modules()
        return None if mods is None else build(*mods)

    return get


def launch_device(t: torch.Tensor):
    """A context in which a Triton kernel launched for `t` runs on `t`'s GPU (Triton launches on
    the current CUDA device; a model spread over several GPUs has tensors on others); nothing for
    CPU tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def kernel_available(device, kernel, interpret: bool = False) -> bool:
    """Whether a `triton_kernel` runs for tensors on `device`: CUDA with Triton, unless
    ``RESSERVE_BACKEND=reference`` asks for the eager paths. `interpret`: CPU tensors too under
    ``TRITON_INTERPRET=1`` (for kernels whose tests check their logic that way)."""
    if os.environ.get("RESSERVE_BACKEND", "") == "reference":
        return False
    on_cpu = interpret and device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "") == "1"
    if device.type != "cuda" and not on_cpu:
        return False
    return kernel() is not None


def identical(y: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a kernel's `y` is the eager `want` bit for bit (shape, dtype and values; NaN where
    NaN): what a kernel that claims the eager bits is checked against before it is used."""
    if y.shape != want.shape or y.dtype != want.dtype:
        return False
    return bool(((y == want) | (torch.isnan(y) & torch.isnan(want))).all())


__all__ = ["RECOMPILE_LIMIT", "compile_or_eager", "triton_modules", "triton_kernel", "kernel_available", "launch_device", "identical"]
