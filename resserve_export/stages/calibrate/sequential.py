"""Layer-by-layer calibration (``calibrate --pipeline sequential``): one decoder layer in memory
at a time, for models larger than the device (or the host).

1. The model is built without weights (accelerate's ``init_empty_weights``: parameters on the
   meta device, buffers such as the rotary frequencies computed as usual), with the same dtype
   and attention implementation as a whole-model load. Only the tensors outside the decoder
   layers (embeddings, final norm; never ``lm_head``) are loaded.
2. One pass of every batch through that shell, each decoder layer replaced by a recorder,
   captures what the model hands each layer: the embedding output (layer 0's input) and the
   layer's keyword arguments (attention mask, position embeddings, the KV-observing cache), which
   depend on the input ids only. The pass stops after the last recorder.
3. Per layer: its tensors are read from the safetensors shards onto the device, every batch's
   hidden states go through it with the statistics hooks on (the same `StatsCollector` as the
   whole-model run), its outputs replace the stored hidden states, and its tensors go back to
   the meta device.

Each layer sees the same inputs as in the whole model and runs the same kernels, and each
group's float64 sums add the batches in the same order, so the statistics are bit-identical to
a whole-model run on the same device and dtype (tests check it). Hidden states stay on the
device while they fit (`HIDDEN_ENV` forces ``cpu`` or ``disk``), else in CPU memory (pinned for
a GPU), else in a spill directory next to the output, one file per batch.

Grad scores (`_grad_scores_backward`): the score samples' input of every layer is kept during
the layer passes; the loss's gradient is taken at the final hidden states through the model's
own tail; then layers, last to first, are recomputed with autograd from their stored inputs and
fed the incoming gradient, with the same candidate hooks as the whole-model backward pass
(`scores.grad.score_hooks`), adding per group in the same batch order. Stated tolerance against
the whole-model scores: 1e-6 relative (the tests see them equal bit for bit).

Resume points (`resume.ResumePoints`, ``calibrate --resume``) are saved between layers, forward
and backward; a data-parallel rank (``calibrate`` under torchrun) runs all of this on its share,
its statistics merged with the other ranks' between the forward and the backward passes.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from resserve_export.core.errors import UserError

PIPELINES = ("whole", "sequential", "auto")
HIDDEN_ENV = "RESSERVE_HIDDEN_STORE"  # device | cpu | disk: where hidden states live (default: by free memory)


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
    builds it."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.eval()
    return model


class _Hidden:
    """Per-batch hidden states on the device, in CPU memory or in files under `spill`."""

    def __init__(self, where: str, spill: Path | None, device: torch.device):
        self.where, self.spill, self.device = where, spill, device
        self.items: list = []
        if where == "disk" and spill is not None:
            spill.mkdir(parents=True, exist_ok=True)

    @classmethod
    def of_files(cls, paths: list[Path], device: torch.device) -> _Hidden:
        """Hidden states saved one file per batch (a resume point's), read on demand."""
        h = cls("disk", None, device)
        h.items = list(paths)
        return h

    def put(self, i: int, h: torch.Tensor) -> None:
        if self.where == "device":
            v = h.to(self.device)
        elif self.where == "cpu":
            v = h.to("cpu")
            if self.device.type == "cuda":
                v = v.pin_memory()
        else:
            path = self.spill / f"h{i}.pt"
            torch.save(h.to("cpu"), path)
            v = path
        if i < len(self.items):
            self.items[i] = v
        else:
            self.items.append(v)

    def get(self, i: int) -> torch.Tensor:
        return self.host(i).to(self.device, non_blocking=True)

    def host(self, i: int) -> torch.Tensor:
        """Batch `i` where it is kept (on the device, in CPU memory, or read from its file),
        without a copy to the device: what a resume point writes."""
        v = self.items[i]
        return torch.load(v, weights_only=True) if self.where == "disk" else v

    def all_host(self):
        """Every batch, one at a time (`host`)."""
        return (self.host(i) for i in range(len(self.items)))


def choose_store(total_bytes: int, device: torch.device) -> str:
    forced = os.environ.get(HIDDEN_ENV, "").strip().lower()
    if forced:
        if forced not in ("device", "cpu", "disk"):
            raise UserError(f"{HIDDEN_ENV}={forced!r}: use device, cpu or disk")
        return forced
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if total_bytes < 0.5 * free:
            return "device"
    return ("device" if device.type == "cpu" else "cpu") if total_bytes < 0.5 * available_memory() else "disk"


def available_memory() -> int:
    """Bytes of host memory available now (MemAvailable)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@contextmanager
def _replaced(layers: torch.nn.ModuleList, new: list):
    old = list(layers)
    for i, m in enumerate(new):
        layers[i] = m
    try:
        yield
    finally:
        for i, m in enumerate(old):
            layers[i] = m


def _require(names, source) -> None:
    for n in names:
        if n not in source:
            raise UserError(f"the checkpoint has no tensor {n}, which the model's layout expects: use --pipeline whole")


def _read(names: list[str], source, dtype) -> dict[str, torch.Tensor]:
    """The tensors `names` from the shards, in `dtype`, in fresh memory."""
    _require(names, source)
    out = {}
    for n in names:
        t = source.get(n)
        out[n] = t.to(dtype) if t.is_floating_point() else t
    return out


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


class _LayerReader:
    """Reads one layer's tensors ahead, on background threads, into one of two reused staging
    buffers (pinned for a GPU, so the copy to the device is asynchronous); a buffer is reused
    only once the copy out of it has finished. Tensors whose stored dtype is not the model's
    take the plain path (`_read`)."""

    THREADS = 4

    def __init__(self, per_layer: list[list[str]], source, device, dtype):
        from resserve_export.storage.safetensors import ST_DTYPES

        self.source, self.device, self.dtype = source, device, dtype
        for names in per_layer:  # every layer's tensors, before the first is read
            _require(names, source)
        self.direct = all(ST_DTYPES[source.entries[n].dtype][0] == dtype for ns in per_layer for n in ns)
        size = max((sum(_aligned(source.entries[n].nbytes) for n in ns) for ns in per_layer), default=0)
        pin = device.type == "cuda"
        self.bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)] if self.direct else []
        self.copied = [None, None]  # CUDA event per buffer: its last copy to the device is done
        self.pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="layer-read")
        self.slot = 0

    def submit(self, names: list[str]) -> Future:
        """Start reading `names`; the future's result is ({name: CPU tensor}, staging buffer or None)."""
        if not self.direct:
            return self.pool.submit(lambda: (_read(names, self.source, self.dtype), None))
        slot, self.slot = self.slot, 1 - self.slot
        ev = self.copied[slot]
        if ev is not None:
            ev.synchronize()
        buf, offsets, off = self.bufs[slot], [], 0
        for n in names:
            offsets.append(off)
            off += _aligned(self.source.entries[n].nbytes)
        parts = [self.pool.submit(self.source.read_into, n, buf[o:]) for n, o in zip(names, offsets)]
        return self.pool.submit(lambda: ({n: f.result() for n, f in zip(names, parts)}, slot))

    def place(self, model, future: Future) -> None:
        tensors, slot = future.result()
        _place(model, tensors, self.device)
        if slot is not None and self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self.copied[slot] = ev

    def close(self) -> None:
        self.pool.shutdown()


def _place(model, tensors: dict[str, torch.Tensor], device) -> None:
    from accelerate.utils import set_module_tensor_to_device

    for n, t in tensors.items():
        set_module_tensor_to_device(model, n, device, value=t.to(device, non_blocking=True))


def _unload(model, names: list[str]) -> None:
    from accelerate.utils import set_module_tensor_to_device

    for n in names:
        set_module_tensor_to_device(model, n, "meta")


def _load(model, names: list[str], source, device, dtype) -> None:
    _place(model, _read(names, source, dtype), device)


def _release_host_memory() -> None:
    """Hand freed heap pages back to the system after each layer: the allocator otherwise keeps
    the unloaded layer's memory behind the small allocations made while it ran, and the peak
    grows with every layer."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class ScoreSpec:
    """What `calibrate --scores grad` asks of the sequential pipeline."""

    ratios: list[float]
    fmt: str
    rounding: str
    precision: str
    samples: int


class _Injector(torch.nn.Module):
    """Stands in for layer 0 in the loss pass: returns the final hidden states `h` whatever it
    is given, so the model's own tail (final norm, lm_head, any logit soft-capping) runs on them."""

    def __init__(self):
        super().__init__()
        self.h = None

    def forward(self, hidden_states, *args, **kwargs):
        return self.h


class _Identity(torch.nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _capture(model, layers, batches, dev, kw, store, make_extra=None) -> list[list[dict]]:
    """Layer 0's input of each batch into `store` and every layer's keyword arguments."""
    captured: list[list[dict]] = [[] for _ in layers]
    sink: list = []
    recorders = [_Recorder(i, sink, i == len(layers) - 1) for i in range(len(layers))]
    with _replaced(layers, recorders):
        for bi, b in enumerate(batches):
            extra = make_extra() if make_extra is not None else {}
            sink.clear()
            try:
                model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev), **{**kw, **extra})
            except _Stop:
                pass
            for i, h, kwargs in sink:
                if i == 0:
                    store.put(bi, h)
                captured[i].append(kwargs)
    return captured


def collect_sequential(
    model_dir: Path, device: str, dtype: str, batches: list[dict], groups, spill: Path, progress=None, kv: bool = True,
    scores: ScoreSpec | None = None, resume=None, on_resume=None, score_batches: list | None = None, combine=None,
    score_log: dict | None = None,
):
    """Statistics of a whole-model `calibrate.collect`, layer by layer, and with `scores` the
    grad scores of `scores.compute_scores` by layer-wise recomputation. `spill`: a directory for
    hidden states that do not fit memory (the caller removes it). Returns (stats,
    num_tokens, kv statistics or None, why there are none, scores record or None).
    ``progress(layer, batch, batches)`` is called after each batch of each layer pass (forward,
    then with `scores` the backward passes, last layer first). `resume` (`resume.ResumePoints`):
    save resume points as due and continue from the saved one, ``on_resume(layer passes done)``
    told where that is. A data-parallel rank passes its share of `batches` and `score_batches`
    (else the first ``scores.samples`` of `batches`), ``combine(collector, kv collector)`` that
    returns the statistics of all ranks (stats, num_tokens, kv statistics, why none), and
    `score_log` for its score additions (`scores.grad.ScoreSums`)."""
    from resserve_export.modeling import modelio
    from resserve_export.observers.stats import StatsCollector
    from resserve_export.modeling.forward import forward_kwargs
    from resserve_export.storage.safetensors import SafetensorsFiles
    from resserve_export.observers.kv import KVCollector

    d = modelio.parse_device(device)
    dev = torch.device("cuda" if d == "auto" and torch.cuda.is_available() else ("cpu" if d == "auto" else d))
    model = empty_model(model_dir, dtype)
    dt = getattr(torch, dtype)
    source = SafetensorsFiles(modelio.weight_files(model_dir))
    prefix, layers = decoder_layers(model)
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    per_layer = [[n for n in params if n.startswith(f"{prefix}.{i}.")] for i in range(len(layers))]
    in_layers = {n for ns in per_layer for n in ns}
    shell = [n for n in params if n not in in_layers and not n.startswith("lm_head.")]
    _load(model, [n for n in dict(model.named_parameters()) if n in shell], source, dev, dt)
    # Buffers (rotary frequencies) were built for real by init_empty_weights(include_buffers=False).
    for name, buf in list(model.named_buffers()):
        if buf.device != dev:
            mod_name, _, bname = name.rpartition(".")
            mod = model.get_submodule(mod_name) if mod_name else model
            mod._buffers[bname] = buf.to(dev)
    for p_ in model.parameters():
        p_.requires_grad_(False)

    kvc = KVCollector(model) if kv else None
    col = StatsCollector(model, groups, keep_batches=combine is not None)
    kw = forward_kwargs(model)
    kw.pop("logits_to_keep", None)
    hidden = int(model.config.get_text_config().hidden_size) * dt.itemsize
    store = _Hidden(choose_store(sum(int(b["input_ids"].numel()) for b in batches) * hidden, dev), spill / "stats", dev)
    sb, s_inputs, s_kwargs = [], [], []
    if scores is not None:
        from resserve_export.algorithms.scores.batches import _take

        sb = _take(batches, scores.samples, dev) if score_batches is None else score_batches
        # Every layer's input for the score batches (the backward pass recomputes each layer from it).
        where = choose_store((len(layers) + 1) * sum(int(b["input_ids"].numel()) for b in sb) * hidden, dev)
        # [i]: layer i's input; [len(layers)]: the final hidden states.
        s_inputs = [_Hidden(where, spill / f"scores-{i}", dev) for i in range(len(layers) + 1)]
    point = resume.load() if resume is not None else None
    phase, done = (point[0]["phase"], point[0]["layer"]) if point is not None else ("forward", -1)
    n_layers = len(layers)
    if point is not None and on_resume is not None:
        on_resume(done + 1 if phase == "forward" else n_layers + (n_layers - done))
    try:
        # 1. The capture passes: layer 0's input and every layer's keyword arguments, per batch
        #    (the score batches without the KV cache and outside inference mode, as autograd needs).
        if phase == "forward":
            with torch.inference_mode():
                captured = _capture(model, layers, batches, dev, kw, store, kvc.forward_kwargs if kvc is not None else None)
        if sb:
            with torch.no_grad():
                s_kwargs = _capture(model, layers, sb, dev, {"use_cache": False}, s_inputs[0])
        if point is not None:
            # Continue from the resume point: its hidden states and accumulators, exactly.
            meta, state, files = point
            # Score inputs: a backward point needs those of the layers still to do, a forward
            # point those of the layers done and the next.
            if sb:
                for i in range(done if phase == "backward" else done + 2):
                    s_inputs[i] = _Hidden.of_files(resume.inputs(i, len(sb)), dev)
            if phase == "forward":
                col.restore(state["stats"], dev)
                if kvc is not None:
                    kvc.restore(state["kv"], dev)
                for bi, f in enumerate(files["h"]):
                    store.put(bi, torch.load(f, weights_only=True))
                for li in range(done + 1):
                    captured[li] = []
        # The embedding is needed again only for the loss pass of the scores.
        embed = model.get_input_embeddings()
        embed_names = [n for n, p_ in model.named_parameters() if any(p_ is q for q in embed.parameters())]
        _unload(model, embed_names)  # parameters only: buffers (Gemma's embedding scale) stay
        if phase == "backward":
            # Statistics done; scores of layers >= `done` done.
            stats, num_tokens, kv_stats, kv_problem = state["stats"], state["num_tokens"], state["kv_stats"], state["kv_problem"]
            col.remove()
            at = (done, [torch.load(f, weights_only=True).to(dev) for f in files["g"]], state["sums"], meta["tokens"])
            record = _grad_scores_backward(
                model, layers, per_layer, prefix, source, dev, dt, sb, s_inputs, s_kwargs, groups, stats, scores, progress,
                at=at, save=_saver(resume, stats, num_tokens, kv_stats, kv_problem, n_layers, s_inputs),
            )
            return stats, num_tokens, kv_stats, kv_problem, record
        # 2. Layer by layer: statistics, and the score batches' inputs of the next layer. The next
        #    layer's tensors are read on a background thread while this one computes.
        reader = _LayerReader(per_layer, source, dev, dt)
        pending = reader.submit(per_layer[done + 1]) if done + 1 < n_layers else None
        for li, layer in enumerate(layers):
            if li <= done:
                continue
            reader.place(model, pending)
            if li + 1 < len(layers):
                pending = reader.submit(per_layer[li + 1])
            with torch.inference_mode():
                for bi, b in enumerate(batches):
                    col.set_mask(b["attention_mask"])
                    if kvc is not None:
                        kvc.set_mask(b["attention_mask"])
                    out = layer(store.get(bi), **captured[li][bi])
                    store.put(bi, out[0] if isinstance(out, tuple) else out)
                    if progress is not None:
                        progress(li, bi, len(batches))
            col.check_finite()
            captured[li] = []
            if sb:
                col.paused = True
                with torch.no_grad():
                    for bi in range(len(sb)):
                        out = layer(s_inputs[li].get(bi), **s_kwargs[li][bi])
                        out = out[0] if isinstance(out, tuple) else out
                        s_inputs[li + 1].put(bi, out)
                col.paused = False
            _unload(model, per_layer[li])
            _release_host_memory()
            if resume is not None and resume.due():
                for i in range(li + 2 if sb else 0):
                    resume.save_inputs(i, s_inputs[i].all_host())
                state = {"stats": col.state(), "kv": kvc.state() if kvc is not None else None}
                resume.save({"phase": "forward", "layer": li, "layers": n_layers}, state, {"h": store.all_host()})
        reader.close()
        num_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        col.num_tokens = num_tokens
        if combine is not None:
            stats, num_tokens, kv_stats, kv_problem = combine(col, kvc)
        else:
            col.check_all_ran()
            stats = col.result()
            kv_stats = kvc.result() if kvc is not None else None
            kv_problem = kvc.problem if kvc is not None else None
        col.remove()
        record = None
        if sb:
            _load(model, embed_names, source, dev, dt)
            save = None
            if resume is not None:
                save = _saver(resume, stats, num_tokens, kv_stats, kv_problem, n_layers, s_inputs)
            record = _grad_scores_backward(
                model, layers, per_layer, prefix, source, dev, dt, sb, s_inputs, s_kwargs, groups, stats, scores, progress,
                save=save, log=score_log,
            )
        return stats, num_tokens, kv_stats, kv_problem, record
    finally:
        col.remove()


def _saver(resume, stats, num_tokens, kv_stats, kv_problem, n_layers, s_inputs):
    """``save(layer, grads, sums, tokens)``: a backward resume point (scores of layers >= `layer`
    done) when one is due, with the score inputs of the layers still to do."""

    def save(layer: int, grads: list, sums, tokens: int) -> None:
        if resume.due():
            for i in range(layer):
                resume.save_inputs(i, s_inputs[i].all_host())
            state = {
                "stats": stats, "num_tokens": num_tokens, "kv_stats": kv_stats, "kv_problem": kv_problem,
                "sums": {k: v.detach().to("cpu", copy=True) for k, v in sums.acc.items()},
            }
            resume.save({"phase": "backward", "layer": layer, "layers": n_layers, "tokens": tokens}, state, {"g": grads})

    return save


def _grad_scores_backward(
    model, layers, per_layer, prefix, source, dev, dt, sb, s_inputs, s_kwargs, groups, stats, spec, progress, at=None, save=None,
    log=None,
):
    """Grad scores by layer-wise recomputation: the loss's gradient at the final hidden states
    (the model's own tail on them), then layers last to first, each recomputed with autograd
    from its stored input and fed the incoming gradient, the candidate hooks of its groups
    (`scores.grad.score_hooks`) running as in the whole-model backward pass. `at`: (first layer
    done, gradients at its input, score sums, loss tokens) of a resume point; ``save(layer,
    grads, sums, tokens)`` after the loss pass and after each layer. `log`: every score addition
    and the loss's token count, for a data-parallel rank."""
    import time

    from resserve_export.formats.mxfp4 import ScaleRounding
    from resserve_export.algorithms.scores import scores_record
    from resserve_export.algorithms.scores.candidates import Candidates
    from resserve_export.algorithms.scores.grad import ScoreSums, next_token_loss, score_hooks
    from resserve_export.algorithms.scores.precision import resolve_precision

    t0 = time.perf_counter()
    precision = resolve_precision(spec.precision, dev, dt)
    fast = precision == "bf16"
    final = s_inputs[-1]
    sums = ScoreSums(log=log)
    if at is None:
        # The tail: lm_head (its own tensor, or the embedding's when tied).
        if getattr(model.config.get_text_config(), "tie_word_embeddings", False) or "lm_head.weight" not in source:
            model.tie_weights()
        else:
            _load(model, ["lm_head.weight"], source, dev, dt)
        for p_ in model.parameters():
            p_.requires_grad_(False)
        grads, tokens = [], 0
        inj = _Injector()
        with _replaced(layers, [inj] + [_Identity() for _ in range(len(layers) - 1)]):
            for bi, b in enumerate(sb):
                ids, mask = b["input_ids"], b["attention_mask"]
                inj.h = final.get(bi).detach().requires_grad_(True)
                loss, n = next_token_loss(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, mask)
                tokens += n
                loss.backward()
                grads.append(inj.h.grad.detach())
                inj.h = None
        _unload(model, [n for n, _ in model.named_parameters() if n.startswith("lm_head.")])
        start = len(layers)
        if save is not None:
            save(start, grads, sums, tokens)
    else:
        start, grads, acc, tokens = at
        sums.acc = {k: v.to(dev) for k, v in acc.items()}
    reader = _LayerReader(per_layer, source, dev, dt)
    pending = reader.submit(per_layer[start - 1]) if start > 0 else None
    for li in reversed(range(start)):
        layer = layers[li]
        reader.place(model, pending)
        if li > 0:
            pending = reader.submit(per_layer[li - 1])
        for p_ in layer.parameters():
            p_.requires_grad_(False)
        mine = [g for g in groups if g.modules[0].startswith(f"{prefix}.{li}.")]
        cands = {g.modules: Candidates(model, g, stats, spec.ratios, spec.fmt, ScaleRounding(spec.rounding)) for g in mine}
        hooks = score_hooks(model, mine, cands, spec.ratios, fast, sums.add)
        try:
            for bi in range(len(sb)):
                x = s_inputs[li].get(bi).detach().requires_grad_(True)
                out = layer(x, **s_kwargs[li][bi])
                out = out[0] if isinstance(out, tuple) else out
                out.backward(grads[bi])
                grads[bi] = x.grad.detach()
                if progress is not None:
                    progress(li, bi, len(sb))
        finally:
            for h in hooks:
                h.remove()
        del cands
        _unload(model, per_layer[li])
        _release_host_memory()
        if save is not None:
            save(li, grads, sums, tokens)
    reader.close()
    if log is not None:
        log["tokens"] = tokens
    n = sum(int(b["input_ids"].shape[0]) for b in sb)
    return scores_record(sums.normalised(groups, spec.ratios, tokens), groups, spec.ratios, "grad", n, spec.fmt, spec.rounding, precision, time.perf_counter() - t0)


__all__ = ["PIPELINES", "HIDDEN_ENV", "ScoreSpec", "collect_sequential", "decoder_layers", "empty_model", "choose_store", "available_memory"]
