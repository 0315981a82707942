"""The weightless model of the layer-by-layer calibration, and moving one decoder layer's
tensors in and out of it.

The model is built without weights (accelerate's ``init_empty_weights``: parameters on the meta
device, buffers such as the rotary frequencies computed as usual), with the same dtype and
attention implementation as a whole-model load; only the tensors outside the decoder layers
(embeddings, final norm; never ``lm_head``) are loaded (`open_shell`). A layer's tensors are
read ahead into reused pinned buffers (`LayerReader`, on `storage.reader.SlabReader`), placed on
the device for the layer's pass, and sent back to the meta device after it.

accelerate and transformers are imported inside the functions that use them (tensors are placed
and unloaded without accelerate): importing them costs about 1 s and 3 s (measured with
``python -X importtime`` after torch), which the ``calibrate`` argument checks that import this
package's `PIPELINES` must not pay.
"""

from __future__ import annotations

import ctypes
import gc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from resserve_export.core import devices
from resserve_export.core.errors import UserError
from resserve_export.modeling import modelio
from resserve_export.storage.reader import Reading, SlabReader, slab_bytes
from resserve_export.storage.safetensors import SafetensorsFiles


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """(qualified name, module list) of the decoder layers: the ModuleList as long as the
    config's ``num_hidden_layers``."""
    cfg = getattr(model.config, "text_config", None) or model.config
    n = getattr(cfg, "num_hidden_layers", None)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n and name.endswith("layers"):
            return name, mod
    raise UserError("cannot find this model's list of decoder layers: use --pipeline whole")


def empty_model(model_dir: Path, dtype: str):
    """The model with parameters on the meta device (buffers real), built as `modelio.load_model`
    builds it (the same class, under the checkpoint's tensor names)."""
    from accelerate import init_empty_weights  # about 1 s: see the module docstring
    from transformers import AutoConfig  # about 3 s: see the module docstring
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = modelio.build_empty(cfg.to_dict(), cfg, getattr(torch, dtype))
    model.eval()
    return modelio.as_checkpoint(model, model_dir)


@contextmanager
def replaced(layers: torch.nn.ModuleList, new: list):
    """`layers` with its first modules replaced by `new` inside the block."""
    old = list(layers)
    for i, m in enumerate(new):
        layers[i] = m
    try:
        yield
    finally:
        for i, m in enumerate(old):
            layers[i] = m


def require(names, source) -> None:
    for n in names:
        if n not in source:
            raise UserError(f"the checkpoint has no tensor {n}, which the model's layout expects: use --pipeline whole")


def _read(names: list[str], source, dtype) -> dict[str, torch.Tensor]:
    """The tensors `names` from the shards, in `dtype`, in fresh memory."""
    require(names, source)
    out = {}
    for n in names:
        t = source.get(n)
        out[n] = t.to(dtype) if t.is_floating_point() else t
    return out


def _assign(model, name: str, value: torch.Tensor) -> None:
    """The model's parameter or buffer `name` (qualified) becomes `value`, as a parameter of the
    same class and ``requires_grad``. (accelerate's ``set_module_tensor_to_device`` empties the
    CUDA allocator's cache after every tensor it places on a GPU: each layer's activations were
    then allocated from the driver again.)"""
    owner, _, leaf = name.rpartition(".")
    mod = model.get_submodule(owner) if owner else model
    if leaf in mod._parameters:
        old = mod._parameters[leaf]
        cls = type(old) if isinstance(old, torch.nn.Parameter) else torch.nn.Parameter
        mod._parameters[leaf] = cls(value, requires_grad=bool(old is not None and old.requires_grad))
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of the model")


def place(model, tensors: dict[str, torch.Tensor], device) -> None:
    """Set the model's tensors (by qualified name) to `tensors`, copied to `device`."""
    for n, t in tensors.items():
        _assign(model, n, t.to(device, non_blocking=True))


def unload(model, names: list[str]) -> None:
    """Send the model's tensors `names` back to the meta device."""
    for n in names:
        owner, _, leaf = n.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        old = mod._parameters[leaf] if leaf in mod._parameters else mod._buffers[leaf]
        _assign(model, n, torch.empty_like(old, device="meta"))


def release_host_memory(device: torch.device | None = None) -> None:
    """Hand freed heap pages back to the system after each layer: the allocator otherwise keeps
    the unloaded layer's memory behind the small allocations made while it ran, and the peak
    grows with every layer. A full collection walks every object of the process (0.15 s with
    transformers loaded, once per layer); on a GPU the layer's host memory is a reused pinned
    slab, so the young generations, where the pass's own objects are, suffice (1 ms)."""
    gc.collect(1 if device is not None and device.type == "cuda" else 2)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class Shell:
    """The weightless model on its device, and where its decoder layers' tensors are."""

    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    source: SafetensorsFiles
    prefix: str  # the decoder layers' qualified name
    layers: torch.nn.ModuleList
    per_layer: list[list[str]]  # each decoder layer's parameter names

    def load(self, names: list[str]) -> None:
        """Read the tensors `names` onto the device (in the model's dtype)."""
        place(self.model, _read(names, self.source, self.dtype), self.device)


def open_shell(model_dir: Path, device: str, dtype: str) -> Shell:
    """The model of `model_dir` without its decoder layers' tensors, on ``--device`` `device`, in
    `dtype`; every parameter frozen."""
    dev = devices.resolve_device(device)
    model = empty_model(model_dir, dtype)
    source = modelio.source_files(model_dir)
    prefix, layers = decoder_layers(model)
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    per_layer = [[n for n in params if n.startswith(f"{prefix}.{i}.")] for i in range(len(layers))]
    shell = Shell(model, dev, getattr(torch, dtype), source, prefix, layers, per_layer)
    in_layers = {n for ns in per_layer for n in ns}
    outside = [n for n in params if n not in in_layers and not n.startswith("lm_head.")]
    shell.load([n for n in dict(model.named_parameters()) if n in outside])
    # Buffers (rotary frequencies) were built for real by init_empty_weights(include_buffers=False).
    for name, buf in list(model.named_buffers()):
        if buf.device != dev:
            mod_name, _, bname = name.rpartition(".")
            mod = model.get_submodule(mod_name) if mod_name else model
            mod._buffers[bname] = buf.to(dev)
    for p_ in model.parameters():
        p_.requires_grad_(False)
    return shell


class LayerReader:
    """Reads decoder layers' tensors ahead, on background threads, into one of two reused slabs
    (pinned for a GPU, so the copy to the device is asynchronous): `submit` the next layer while
    this one computes, `place` it when its turn comes, `unload` it after. A slab is read into
    again only once the copy out of it has finished and its layer is unloaded (on the CPU the
    layer's parameters are views of it). Tensors whose stored dtype is not the model's are
    converted when placed."""

    THREADS = 4

    def __init__(self, shell: Shell):
        self.shell = shell
        for names in shell.per_layer:  # every layer's tensors, before the first is read
            require(names, shell.source)
        size = max((slab_bytes(shell.source, ns) for ns in shell.per_layer), default=0)
        pin = shell.device.type == "cuda"
        self.reader = SlabReader(shell.source, size, 2, pin=pin, threads=self.THREADS, thread_name="layer-read")
        self.placed: dict[int, tuple] = {}  # layer: (its slab, the event of its copy to the device)

    def __enter__(self) -> LayerReader:
        return self

    def __exit__(self, *exc) -> None:
        self.reader.close()

    def submit(self, li: int) -> Reading:
        """Start reading layer `li`'s tensors (at most two layers are submitted or placed)."""
        return self.reader.submit(self.shell.per_layer[li], self.reader.take())

    def place(self, li: int, reading: Reading) -> None:
        """Layer `li`'s tensors, once read, onto the device."""
        s = self.shell
        tensors = self.reader.wait(reading)
        place(s.model, {n: t.to(s.dtype) if t.is_floating_point() else t for n, t in tensors.items()}, s.device)
        event = None
        if s.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.placed[li] = (reading.slab, event)

    def unload(self, li: int) -> None:
        """Layer `li`'s tensors back to the meta device, its slab free for another layer."""
        unload(self.shell.model, self.shell.per_layer[li])
        slab, event = self.placed.pop(li)
        self.reader.give(slab, event)


class _Stop(Exception):
    pass


class _Recorder(torch.nn.Module):
    """Stands in for decoder layer `index` during the capture pass."""

    def __init__(self, index: int, sink: list, last: bool):
        super().__init__()
        self.index, self.sink, self.last = index, sink, last

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise UserError("this architecture passes positional arguments to its decoder layers: use --pipeline whole")
        self.sink.append((self.index, hidden_states if self.index == 0 else None, kwargs))
        if self.last:
            raise _Stop
        return hidden_states


def capture(shell: Shell, batches, kw, store, make_extra=None) -> list[list[dict]]:
    """Layer 0's input of each batch into `store` and every layer's keyword arguments (attention
    mask, position embeddings, the KV-observing cache of ``make_extra()``), which depend on the
    input ids only: one pass of every batch through the shell, each decoder layer replaced by a
    recorder, stopped after the last one."""
    layers, dev = shell.layers, shell.device
    captured: list[list[dict]] = [[] for _ in layers]
    sink: list = []
    recorders = [_Recorder(i, sink, i == len(layers) - 1) for i in range(len(layers))]
    with replaced(layers, recorders):
        for bi, b in enumerate(batches):
            extra = make_extra() if make_extra is not None else {}
            sink.clear()
            try:
                shell.model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev), **{**kw, **extra})
            except _Stop:
                pass
            for i, h, kwargs in sink:
                if i == 0:
                    store.put(bi, h)
                captured[i].append(kwargs)
    return captured


__all__ = [
    "decoder_layers", "empty_model", "replaced", "require", "place", "unload", "release_host_memory", "Shell", "open_shell",
    "LayerReader", "capture",
]
