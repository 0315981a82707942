"""Layer-by-layer calibration (``calibrate --pipeline sequential``): one decoder layer in memory
at a time, for models larger than the device (or the host).

1. The model is built without weights, and only the tensors outside the decoder layers are
   loaded (`shell.open_shell`).
2. One pass of every batch through that shell, each decoder layer replaced by a recorder,
   captures what the model hands each layer: the embedding output (layer 0's input) and the
   layer's keyword arguments (attention mask, position embeddings, the KV-observing cache), which
   depend on the input ids only (`shell.capture`). The pass stops after the last recorder.
3. Per layer: its tensors are read from the safetensors shards onto the device (read ahead while
   the previous layer computes: `shell.LayerReader`), every batch's hidden states go through it
   with the statistics hooks on (the same `StatsCollector` as the whole-model run), its outputs
   replace the stored hidden states (`hidden.HiddenStore`), and its tensors go back to the meta
   device.

Each layer sees the same inputs as in the whole model and runs the same kernels, and each
group's float64 sums add the batches in the same order, so the statistics are bit-identical to
a whole-model run on the same device and dtype (tests check it). Hidden states stay on the
device while they fit, else in CPU memory, else in a spill directory (`hidden`).

Grad scores: the score samples' input of every layer is kept during the layer passes, then the
layers are recomputed last to first with autograd (`backward.grad_scores_backward`).

Resume points (`resume.ResumePoints`, ``calibrate --resume``) are saved between layers, forward
and backward; a data-parallel rank (``calibrate`` under torchrun) runs all of this on its share,
its statistics merged with the other ranks' between the forward and the backward passes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from resserve_export.algorithms import gptq
from resserve_export.algorithms.emulate import DequantizedLinear, QuantizedWeight, swapped
from resserve_export.algorithms.scores.batches import take
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.modeling.forward import forward_kwargs
from resserve_export.observers.hessian import HessianCollector
from resserve_export.observers.kv import KVCollector
from resserve_export.observers.stats import StatsCollector
from resserve_export.stages.calibrate.backward import ScoreSpec, grad_scores_backward
from resserve_export.stages.calibrate.hidden import HIDDEN_ENV, HiddenStore, available_memory, choose_store
from resserve_export.stages.calibrate.shell import (
    LayerReader,
    Shell,
    capture,
    decoder_layers,
    empty_model,
    open_shell,
    release_host_memory,
    unload,
)

PIPELINES = ("whole", "sequential", "auto")


@dataclass
class SequentialResult:
    """What `collect_sequential` computes: the statistics of a whole-model `calibrate.collect`
    and, when asked, the grad scores."""

    stats: dict  # {module: statistics}, as `StatsCollector.result`
    num_tokens: int
    kv_stats: dict | None  # KV-cache statistics, None without
    kv_problem: str | None  # why there are none
    scores: dict | None  # the grad scores record (`algorithms.scores.scores_record`), None without
    gptq: dict | None = None  # ``--weight-algo gptq``: {module: FP4Tensor}
    gptq_record: dict | None = None  # its calibration.json record


class _Passes:
    """The state of one `collect_sequential` run: the shell, the collectors and the stored
    hidden states (see `collect_sequential` for the arguments)."""

    def __init__(
        self, shell: Shell, batches, groups, spill: Path, kv: bool, scores: ScoreSpec | None, score_batches, combine, gptq_format=None,
        gptq_propagate: bool = False,
    ):
        self.shell, self.batches, self.groups, self.scores, self.combine = shell, batches, groups, scores, combine
        # ``--weight-algo gptq``: (format, MX scale rounding, column order), and what it quantized so far.
        self.gptq_format = gptq_format
        # Later layers' inputs through the earlier layers as served (`_propagate`).
        self.gptq_propagate = gptq_propagate and gptq_format is not None
        self.gptq_out: dict = {}
        self.gptq_fallback: dict = {}
        model, dev = shell.model, shell.device
        self.kvc = KVCollector(model) if kv else None
        self.col = StatsCollector(model, groups, keep_batches=combine is not None)
        self.kw = forward_kwargs(model)
        self.kw.pop("logits_to_keep", None)
        hidden = int(model.config.get_text_config().hidden_size) * shell.dtype.itemsize
        self.store = HiddenStore(choose_store(sum(int(b["input_ids"].numel()) for b in batches) * hidden, dev), spill / "stats", dev)
        self._waiting: HiddenStore | None = None  # layer 0's inputs in host memory until `settle`
        self.sb, self.s_inputs, self.s_kwargs = [], [], []
        self.captured: list[list[dict]] = []
        if scores is not None:
            self.sb = take(batches, scores.samples, dev) if score_batches is None else score_batches
            # Every layer's input for the score batches (the backward pass recomputes each layer from it).
            n = len(shell.layers)
            where = choose_store((n + 1) * sum(int(b["input_ids"].numel()) for b in self.sb) * hidden, dev)
            # [i]: layer i's input; [n]: the final hidden states.
            self.s_inputs = [HiddenStore(where, spill / f"scores-{i}", dev) for i in range(n + 1)]

    def capture(self, forward: bool) -> None:
        """The capture passes: layer 0's input and every layer's keyword arguments, per batch (the
        score batches without the KV cache and outside inference mode, as autograd needs)."""
        if forward:
            # On a GPU layer 0's inputs wait in host memory until the embedding has left the
            # device (`settle`): the embedding and every batch's hidden states never share it.
            into = self.store
            if self.store.where == "device" and self.shell.device.type == "cuda":
                into = self._waiting = HiddenStore("cpu", None, self.shell.device)
            with torch.inference_mode():
                self.captured = capture(self.shell, self.batches, self.kw, into, self.kvc.forward_kwargs if self.kvc is not None else None)
        if self.sb:
            with torch.no_grad():
                self.s_kwargs = capture(self.shell, self.sb, {"use_cache": False}, self.s_inputs[0])

    def settle(self) -> None:
        """Layer 0's inputs onto the device, once the embedding has left it (`capture`); batches a
        resume point already restored stay as restored."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            for bi in range(len(self.store.items), len(waiting.items)):
                self.store.put(bi, waiting.get(bi))
                waiting.items[bi] = None

    def restore(self, point, resume) -> None:
        """Continue from the resume point: its hidden states and accumulators, exactly."""
        meta, state, files = point
        phase, done = meta["phase"], meta["layer"]
        # Score inputs: a backward point needs those of the layers still to do, a forward point
        # those of the layers done and the next.
        if self.sb:
            for i in range(done if phase == "backward" else done + 2):
                self.s_inputs[i] = HiddenStore.of_files(resume.inputs(i, len(self.sb)), self.shell.device)
        if phase == "forward":
            self.col.restore(state["stats"], self.shell.device)
            if self.kvc is not None:
                self.kvc.restore(state["kv"], self.shell.device)
            for bi, f in enumerate(files["h"]):
                self.store.put(bi, torch.load(f, weights_only=True))
            for li in range(done + 1):
                self.captured[li] = []

    def forward(self, done: int, progress, resume) -> None:
        """The layer passes after layer `done`: statistics, and the score batches' inputs of the
        next layer. The next layer's tensors are read on background threads while one computes."""
        layers = self.shell.layers
        with LayerReader(self.shell) as reader:
            pending = reader.submit(done + 1) if done + 1 < len(layers) else None
            for li in range(done + 1, len(layers)):
                reader.place(li, pending)
                if li + 1 < len(layers):
                    pending = reader.submit(li + 1)
                self._layer(li, progress)
                reader.unload(li)
                release_host_memory(self.shell.device)
                if resume is not None and resume.due():
                    for i in range(li + 2 if self.sb else 0):
                        resume.save_inputs(i, self.s_inputs[i].all_host())
                    state = {"stats": self.col.state(), "kv": self.kvc.state() if self.kvc is not None else None}
                    resume.save({"phase": "forward", "layer": li, "layers": len(layers)}, state, {"h": self.store.all_host()})

    def _layer(self, li: int, progress) -> None:
        """Layer `li`'s pass over every batch with the statistics hooks on, then over the score
        batches with them paused."""
        layer, col = self.shell.layers[li], self.col
        mine = [g for g in self.groups if g.modules[0].startswith(f"{self.shell.prefix}.{li}.")]
        # GPTQ: this layer's input Hessians, taken in the same pass (one layer's at a time).
        hc = HessianCollector(self.shell.model, [g.modules[0] for g in mine]) if self.gptq_format is not None else None
        try:
            with torch.inference_mode():
                for bi, b in enumerate(self.batches):
                    col.set_mask(b["attention_mask"])
                    if self.kvc is not None:
                        self.kvc.set_mask(b["attention_mask"])
                    if hc is not None:
                        hc.set_mask(b["attention_mask"])
                    out = layer(self.store.get(bi), **self.captured[li][bi])
                    if not self.gptq_propagate:  # else the inputs stay for `_propagate`
                        self.store.put(bi, out[0] if isinstance(out, tuple) else out)
                    if hc is not None:
                        hc.end_batch()
                    if progress is not None:
                        progress(li, bi, len(self.batches))
        finally:
            if hc is not None:
                hc.remove()
        col.check_finite()
        if hc is not None:
            fmt, rounding, order = self.gptq_format
            for g in mine:
                h, rows = hc.take(g.modules[0])
                ws = [self.shell.model.get_submodule(m).weight.detach() for m in g.modules]
                gptq.quantize_group(g, ws, h, rows, fmt, rounding, self.gptq_out, self.gptq_fallback, order=order)
            if self.gptq_propagate:
                self._propagate(li, mine)
        self.captured[li] = []
        if self.sb:
            col.paused = True
            with torch.no_grad():
                for bi in range(len(self.sb)):
                    out = layer(self.s_inputs[li].get(bi), **self.s_kwargs[li][bi])
                    out = out[0] if isinstance(out, tuple) else out
                    self.s_inputs[li + 1].put(bi, out)
            col.paused = False

    def _served(self, groups: list) -> dict:
        """``{module: DequantizedLinear}``: the GPTQ weights of `groups`' members, dequantized."""
        fmt, rounding, _ = self.gptq_format
        model, dev = self.shell.model, self.shell.device
        served = {}
        for g in groups:
            for m in g.modules:
                q = self.gptq_out[m]
                q = FP4Tensor(q.fmt, q.codes.to(dev), q.scales.to(dev), None if q.global_scale is None else q.global_scale.to(dev))
                served[m] = DequantizedLinear(model.get_submodule(m), QuantizedWeight.from_stored(fmt, 0.0, rounding, None, q, None))
        return served

    @contextmanager
    def _observers_paused(self):
        self.col.paused = True
        if self.kvc is not None:
            self.kvc.paused = True
        try:
            yield
        finally:
            self.col.paused = False
            if self.kvc is not None:
                self.kvc.paused = False

    def _propagate(self, li: int, mine: list) -> None:
        """Layer `li`'s outputs, the next layer's inputs, computed again with its linears' GPTQ
        weights (dequantized; the inputs unquantized, `emulate.DequantizedLinear`), so that the later
        layers' Hessians and statistics see the earlier layers' weight error, as llm-compressor's
        sequential pipeline propagates it (``--gptq-propagate``)."""
        model = self.shell.model
        with self._observers_paused(), swapped(model, self._served(mine)), torch.inference_mode():
            for bi in range(len(self.batches)):
                out = self.shell.layers[li](self.store.get(bi), **self.captured[li][bi])
                self.store.put(bi, out[0] if isinstance(out, tuple) else out)

    def statistics(self) -> SequentialResult:
        """The statistics of every batch (of every rank with `combine`), without scores."""
        col, kvc = self.col, self.kvc
        num_tokens = sum(int(b["attention_mask"].sum()) for b in self.batches)
        col.num_tokens = num_tokens
        if self.combine is not None:
            stats, num_tokens, kv_stats, kv_problem = self.combine(col, kvc)
        else:
            col.check_all_ran()
            stats = col.result()
            kv_stats = kvc.result() if kvc is not None else None
            kv_problem = kvc.problem if kvc is not None else None
        col.remove()
        result = SequentialResult(stats, num_tokens, kv_stats, kv_problem, None)
        if self.gptq_format is not None:
            fmt, rounding, order = self.gptq_format
            result.gptq, result.gptq_record = self.gptq_out, gptq.record(fmt, rounding, self.gptq_out, self.gptq_fallback, order=order)
            if self.gptq_propagate:
                result.gptq_record["propagate"] = True
        return result

    def backward(self, result: SequentialResult, progress, resume, at=None, log=None) -> dict:
        """The grad scores record, from the layer passes' statistics `result`."""
        save = None if resume is None else _saver(resume, result, len(self.shell.layers), self.s_inputs)
        spec = self.scores if result.gptq is None else replace(self.scores, base_weights=result.gptq)
        return grad_scores_backward(
            self.shell, self.sb, self.s_inputs, self.s_kwargs, self.groups, result.stats, spec, progress, at=at, save=save, log=log,
        )


def collect_sequential(
    model_dir: Path, device: str, dtype: str, batches: list[dict], groups, spill: Path, progress=None, kv: bool = True,
    scores: ScoreSpec | None = None, resume=None, on_resume=None, score_batches: list | None = None, combine=None,
    score_log: dict | None = None, gptq_format: tuple[str, str, str] | None = None, gptq_propagate: bool = False,
) -> SequentialResult:
    """Statistics of a whole-model `calibrate.collect`, layer by layer, and with `scores` the
    grad scores of `scores.compute_scores` by layer-wise recomputation. `spill`: a directory for
    hidden states that do not fit memory (the caller removes it).
    ``progress(layer, batch, batches)`` is called after each batch of each layer pass (forward,
    then with `scores` the backward passes, last layer first). `resume` (`resume.ResumePoints`):
    save resume points as due and continue from the saved one, ``on_resume(layer passes done)``
    told where that is. A data-parallel rank passes its share of `batches` and `score_batches`
    (else the first ``scores.samples`` of `batches`), ``combine(collector, kv collector)`` that
    returns the statistics of all ranks (stats, num_tokens, kv statistics, why none), and
    `score_log` for its score additions (`scores.grad.ScoreSums`). `gptq_format`: (format, MX
    scale rounding, `gptq.ORDERS` column order) of ``--weight-algo gptq``, whose linears are quantized at the end of their
    layer's pass from that pass's Hessians (no resume points: the caller passes none); with
    `gptq_propagate` each layer's outputs are then recomputed through its quantized linears
    (`_Passes._propagate`)."""
    shell = open_shell(model_dir, device, dtype)
    if gptq_format is not None and resume is not None:
        raise ValueError("GPTQ in the sequential pipeline keeps no resume points")
    run = _Passes(shell, batches, groups, spill, kv, scores, score_batches, combine, gptq_format, gptq_propagate)
    point = resume.load() if resume is not None else None
    phase, done = (point[0]["phase"], point[0]["layer"]) if point is not None else ("forward", -1)
    n_layers = len(shell.layers)
    if point is not None and on_resume is not None:
        on_resume(done + 1 if phase == "forward" else n_layers + (n_layers - done))
    try:
        run.capture(phase == "forward")
        if point is not None:
            run.restore(point, resume)
        # The embedding is needed again only for the loss pass of the scores.
        embed = shell.model.get_input_embeddings()
        embed_names = [n for n, p_ in shell.model.named_parameters() if any(p_ is q for q in embed.parameters())]
        unload(shell.model, embed_names)  # parameters only: buffers (Gemma's embedding scale) stay
        run.settle()
        if phase == "backward":
            # Statistics done; scores of layers >= `done` done.
            meta, state, files = point
            result = SequentialResult(state["stats"], state["num_tokens"], state["kv_stats"], state["kv_problem"], None)
            run.col.remove()
            at = (done, [torch.load(f, weights_only=True).to(shell.device) for f in files["g"]], state["sums"], meta["tokens"])
            result.scores = run.backward(result, progress, resume, at=at)
            return result
        run.forward(done, progress, resume)
        result = run.statistics()
        if run.sb:
            shell.load(embed_names)
            result.scores = run.backward(result, progress, resume, log=score_log)
        return result
    finally:
        run.col.remove()


def _saver(resume, result: SequentialResult, n_layers: int, s_inputs):
    """``save(layer, grads, sums, tokens)``: a backward resume point (scores of layers >= `layer`
    done) when one is due, with the score inputs of the layers still to do."""

    def save(layer: int, grads: list, sums, tokens: int) -> None:
        if resume.due():
            for i in range(layer):
                resume.save_inputs(i, s_inputs[i].all_host())
            state = {
                "stats": result.stats, "num_tokens": result.num_tokens, "kv_stats": result.kv_stats, "kv_problem": result.kv_problem,
                "sums": {k: v.detach().to("cpu", copy=True) for k, v in sums.acc.items()},
            }
            resume.save({"phase": "backward", "layer": layer, "layers": n_layers, "tokens": tokens}, state, {"g": grads})

    return save


__all__ = [
    "PIPELINES", "HIDDEN_ENV", "ScoreSpec", "SequentialResult", "collect_sequential", "decoder_layers", "empty_model", "choose_store",
    "available_memory", "grad_scores_backward",
]
