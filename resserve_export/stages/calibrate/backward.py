"""Grad scores of the layer-by-layer calibration (``calibrate --pipeline sequential --scores
grad``), by layer-wise recomputation.

The score samples' input of every layer is kept during the layer passes; the loss's gradient is
taken at the final hidden states through the model's own tail (`_loss_gradients`); then layers,
last to first, are recomputed with autograd from their stored inputs and fed the incoming
gradient, with the same candidate hooks as the whole-model backward pass
(`algorithms.scores.grad.score_hooks`) and the same RMSNorms and MLP activations (`algorithms.scores.norm`, `.mlp`), adding
per group in the same batch order. Stated
tolerance against the whole-model scores: 1e-6 relative (the tests see them equal bit for bit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from resserve_export.algorithms.scores import scores_record
from resserve_export.algorithms.scores.candidates import Candidates
from resserve_export.algorithms.scores.grad import ScoreSums, score_hooks
from resserve_export.algorithms.scores.loss import next_token_loss
from resserve_export.algorithms.scores.mlp import fused_mlps
from resserve_export.algorithms.scores.norm import fused_norms
from resserve_export.algorithms.scores.precision import resolve_precision
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.stages.calibrate.shell import LayerReader, Shell, release_host_memory, replaced, unload


@dataclass
class ScoreSpec:
    """What `calibrate --scores grad` asks of the sequential pipeline."""

    ratios: list[float]
    fmt: str
    rounding: str
    precision: str
    samples: int
    base_weights: dict | None = None  # {module: FP4Tensor} of ``--weight-algo gptq`` (`Candidates`)


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


def _loss_gradients(shell: Shell, sb: list[dict], final) -> tuple[list[torch.Tensor], int]:
    """(the loss's gradient at the final hidden states of each score batch, loss tokens): the
    model's tail (lm_head: its own tensor, or the embedding's when tied) run on the stored final
    hidden states `final`."""
    model, layers = shell.model, shell.layers
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False) or "lm_head.weight" not in shell.source:
        model.tie_weights()
    else:
        shell.load(["lm_head.weight"])
    for p_ in model.parameters():
        p_.requires_grad_(False)
    grads, tokens = [], 0
    inj = _Injector()
    with replaced(layers, [inj] + [_Identity() for _ in range(len(layers) - 1)]), fused_norms(model):
        for bi, b in enumerate(sb):
            ids, mask = b["input_ids"], b["attention_mask"]
            inj.h = final.get(bi).detach().requires_grad_(True)
            loss, n = next_token_loss(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, mask)
            tokens += n
            loss.backward()
            grads.append(inj.h.grad.detach())
            inj.h = None
    unload(model, [n for n, _ in model.named_parameters() if n.startswith("lm_head.")])
    return grads, tokens


def grad_scores_backward(shell: Shell, sb, s_inputs, s_kwargs, groups, stats, spec: ScoreSpec, progress, at=None, save=None, log=None):
    """The grad scores record (`scores.scores_record`) by layer-wise recomputation (see the module
    docstring): `sb` the score batches, ``s_inputs[i]`` layer i's stored inputs of them (the last:
    the final hidden states), ``s_kwargs[i]`` its keyword arguments per batch. `at`: (first layer
    done, gradients at its input, score sums, loss tokens) of a resume point; ``save(layer,
    grads, sums, tokens)`` after the loss pass and after each layer. `log`: every score addition
    and the loss's token count, for a data-parallel rank."""
    t0 = time.perf_counter()
    precision = resolve_precision(spec.precision, shell.device, shell.dtype)
    sums = ScoreSums(log=log)
    if at is None:
        grads, tokens = _loss_gradients(shell, sb, s_inputs[-1])
        start = len(shell.layers)
        if save is not None:
            save(start, grads, sums, tokens)
    else:
        start, grads, acc, tokens = at
        sums.acc = {k: v.to(shell.device) for k, v in acc.items()}
    with LayerReader(shell) as reader:
        pending = reader.submit(start - 1) if start > 0 else None
        for li in reversed(range(start)):
            reader.place(li, pending)
            if li > 0:
                pending = reader.submit(li - 1)
            _layer_backward(shell, li, sb, s_inputs[li], s_kwargs[li], grads, groups, stats, spec, precision == "bf16", sums, progress)
            reader.unload(li)
            release_host_memory(shell.device)
            if save is not None:
                save(li, grads, sums, tokens)
    if log is not None:
        log["tokens"] = tokens
    n = sum(int(b["input_ids"].shape[0]) for b in sb)
    normalised = sums.normalised(groups, spec.ratios, tokens)
    return scores_record(normalised, groups, spec.ratios, "grad", n, spec.fmt, spec.rounding, precision, time.perf_counter() - t0)


def _layer_backward(shell: Shell, li: int, sb, inputs, kwargs, grads: list, groups, stats, spec: ScoreSpec, fast: bool, sums, progress) -> None:
    """Layer `li` recomputed with autograd from its stored `inputs` and fed ``grads`` (replaced by
    the gradients at its input), the candidate hooks of its groups adding to `sums`."""
    model, layer = shell.model, shell.layers[li]
    for p_ in layer.parameters():
        p_.requires_grad_(False)
    mine = [g for g in groups if g.modules[0].startswith(f"{shell.prefix}.{li}.")]
    cands = {g.modules: Candidates(model, g, stats, spec.ratios, spec.fmt, ScaleRounding(spec.rounding), spec.base_weights) for g in mine}
    # The same RMSNorms and MLP activations as the whole-model pass (`algorithms.scores.norm`,
    # `.mlp`), entered before the score hooks.
    with fused_norms(layer), fused_mlps(layer):
        hooks, scorers = score_hooks(model, mine, cands, spec.ratios, fast, sums.add)
        try:
            for bi in range(len(sb)):
                x = inputs.get(bi).detach().requires_grad_(True)
                out = layer(x, **kwargs[bi])
                out = out[0] if isinstance(out, tuple) else out
                out.backward(grads[bi])
                for scorer in scorers:
                    scorer.flush()
                grads[bi] = x.grad.detach()
                if progress is not None:
                    progress(li, bi, len(sb))
        finally:
            for h in hooks:
                h.remove()
    del cands


__all__ = ["ScoreSpec", "grad_scores_backward"]
