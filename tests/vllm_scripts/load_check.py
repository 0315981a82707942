"""vLLM's own model class and weight loader on checkpoints, without an engine (the vllm venv).

For families whose vLLM model file cannot be imported here: the vision-language ones import
torchvision at module level, and the only torchvision wheels the vLLM venv can get are built
against another torch, so the venv has none (see the Makefile). Their model files use torchvision
only for image preprocessing, which building the model and loading its weights never run; so
this process alone makes ``import torchvision`` succeed with a placeholder package (its
attributes are empty classes), after transformers has recorded that torchvision is not installed.

Usage: python load_check.py JOB.json OUT.json, where JOB is {"checkpoints": [dir, ...]} and
optionally "withhold" ({dir: regex}: checkpoint tensors not given to the loader, reported as
``withheld``) and "values" ({dir: regex}: parameters whose bytes after loading are reported as
``values``, {name: [dtype, shape, sha256]}) and "no_moe_kernel" ([dir, ...]: vLLM's MXFP4 MoE
kernel choice, ``select_mxfp4_moe_backend``, answers "none" instead of looking for a kernel; it
decides how the loaded experts are computed, not which parameters exist or how they load, and on
a CPU without AMX it finds none, so the model could not be built otherwise). For
each checkpoint, vLLM builds its config as an engine would (EngineArgs, bf16: the dtype ModelOpt NVFP4 admits; eager), builds
the model class that config names on the CPU, and runs the model's own ``load_weights`` over the
loader's tensors of the checkpoint. OUT is {dir: report}, report:
  architecture, model_class, quantization: what vLLM chose
  tensors:      number of tensors the loader read from the checkpoint
  unread:       checkpoint tensors none of whose bytes any copy into a parameter read
  params:       number of the model's parameters
  not_loaded:   parameters that ``load_weights`` did not report as loaded
  error:        the exception, when building or loading failed
The resserve method is chosen as in the engine (RESSERVE_VLLM_METHOD, the plugin's default).
"""

import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys
import traceback
import types

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class _Placeholder(type):
    """An empty class whose attributes are empty classes (``InterpolationMode.BICUBIC``, base
    classes, default arguments): enough for a module-level import, useless for any call."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reads_mode():
    """A torch function mode that follows the checkpoint's tensors into the model: every tensor
    an operation makes from (a view or a copy of) a checkpoint tensor carries that tensor's name,
    and a copy into another tensor (``copy_``, item assignment: the loaders' ways into a
    parameter) marks the names its source carries as read. Loaders permute, transpose, cast and
    concatenate before they copy (Llama 4's q/k rows, fused q/k/v scales); these are followed."""
    import weakref

    import torch
    from torch.overrides import TorchFunctionMode

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []
            self.read: set[str] = set()
            self._spans: dict[int, tuple[int, int, frozenset]] = {}  # id -> (lo, hi, names)
            self._next = 0

        def _span(self, t, names) -> None:
            if t.numel() == 0 or not names:
                return
            lo = t.data_ptr()
            key, self._next = self._next, self._next + 1
            self._spans[key] = (lo, lo + t.numel() * t.element_size(), frozenset(names))
            weakref.finalize(t, self._spans.pop, key, None)  # freed memory carries no name

        def _carried(self, args) -> set[str]:
            out: set[str] = set()
            for t in torch.utils._pytree.tree_leaves(args):
                if isinstance(t, torch.Tensor) and t.numel() and t.device.type == "cpu":
                    p = t.data_ptr()
                    for lo, hi, names in self._spans.values():
                        if lo <= p < hi:
                            out |= names
            return out

        def weights(self, it):
            for name, tensor in it:
                self.names.append(name)
                self._span(tensor, {name})
                yield name, tensor

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            carried = self._carried((args, kwargs)) if self._spans else set()
            out = func(*args, **kwargs)
            if carried:
                if func in (torch.Tensor.copy_, torch.Tensor.__setitem__):
                    self.read |= carried
                else:
                    for t in torch.utils._pytree.tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            self._span(t, carried)
            return out

    return Reads()


def _one_rank() -> None:
    """A world of one process (vLLM's layers ask for their tensor-parallel rank), its groups made
    again for each model (the expert-parallel group exists only when the current config is MoE)."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    else:
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo")
    ps.ensure_model_parallel_initialized(1, 1)


def check(ckpt: str, withhold: str | None = None, values: str | None = None, no_moe_kernel: bool = False) -> dict:
    import contextlib
    import hashlib
    import re
    from unittest import mock

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    cfg = EngineArgs(model=ckpt, dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0).create_engine_config()
    report = {"architecture": cfg.model_config.architectures[0], "quantization": cfg.model_config.quantization}
    loader = get_model_loader(cfg.load_config)
    no_kernel = contextlib.nullcontext()
    if no_moe_kernel:
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

        no_kernel = mock.patch("vllm.model_executor.layers.quantization.mxfp4.select_mxfp4_moe_backend",
                               lambda moe, activation_key=None: (Mxfp4MoeBackend.NONE, None))
    with set_current_vllm_config(cfg), torch.device("cpu"), no_kernel:
        _one_rank()
        model = initialize_model(vllm_config=cfg, model_config=cfg.model_config)
        report["model_class"] = type(model).__name__
        params = {n for n, _ in model.named_parameters()}
        reads = _reads_mode()
        withheld = []

        def given(it):
            for name, t in it:
                if withhold and re.search(withhold, name):
                    withheld.append(name)
                    continue
                yield name, t

        with reads:
            loaded = model.load_weights(reads.weights(given(loader.get_all_weights(cfg.model_config, model))))
        if values:
            report["values"] = {n: [str(p.dtype), list(p.shape), hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
                                for n, p in model.named_parameters() if re.search(values, n)}
    report.update(tensors=len(reads.names), unread=sorted(set(reads.names) - reads.read), params=len(params),
                  not_loaded=sorted(params - set(loaded or ())), withheld=sorted(withheld))
    return report


def main() -> None:
    # transformers asks once (and caches) whether torchvision is installed: ask before the
    # placeholder is there, so that the answer stays no.
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()
    sys.meta_path.insert(0, _PlaceholderFinder())
    # vLLM inspects a model class in a child process (to keep CUDA out of this one), where the
    # placeholder is not: inspect it here (no CUDA on this machine).
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()
    job = json.loads(open(sys.argv[1]).read())
    out = {}
    for ckpt in job["checkpoints"]:
        try:
            out[ckpt] = check(ckpt, job.get("withhold", {}).get(ckpt), job.get("values", {}).get(ckpt), ckpt in job.get("no_moe_kernel", ()))
        except Exception as e:  # noqa: BLE001  (reported per checkpoint; the caller's test raises it)
            out[ckpt] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        print(f"load check {ckpt}: {json.dumps({k: v for k, v in out[ckpt].items() if k != 'traceback'})[:2000]}", flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
