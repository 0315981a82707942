"""The KL scores: damage as the mean KL(p_ref ‖ p_q) per valid token between next-token
distributions, one forward per (group, ρ).

The model runs once per batch to capture the hidden state entering every decoder layer; a
(group, ρ) then reruns only from the group's layer to the logits (`_decoder_layers` finds the
layers, final norm and head of a standard decoder-only LM). If the model's logits are not
`lm_head(norm(h))` of its last layer (checked on the first batch), every (group, ρ) runs the
whole model instead. The same KL judges a whole plan end to end (`evaluate_kl`, `evaluate_kls`:
every group of the plan installed at once). KL scores always use the FP32 candidate products.
"""

from __future__ import annotations

import torch
from torch import nn

from resserve_export.algorithms.scores.batches import device_of, valid_tokens, take
from resserve_export.algorithms.scores.candidates import quantized


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList, nn.Module, nn.Module] | None:
    """(prefix, layers, final norm, lm_head) of a standard decoder-only causal LM, else None."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(layers, nn.ModuleList) or norm is None or head is None:
        return None
    prefix = next((n for n, m in model.named_modules() if m is layers), None)
    if prefix is None:
        return None
    return prefix, layers, norm, head


def _layer_of(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _kl_sum(ref_logp: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> float:
    """Σ over valid positions of KL(p_ref ‖ p_q); ref_logp is already restricted to valid rows."""
    logq = torch.log_softmax(logits[valid].float(), dim=-1)
    return float(torch.sum(ref_logp.exp() * (ref_logp - logq)))


def kl_scores(model, batches, groups, cands, ratios, step) -> dict:
    structure = _decoder_layers(model)
    sums = {g.modules: {r: 0.0 for r in ratios} for g in groups}
    tokens = 0
    for batch in batches:
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        valid = valid_tokens(mask, ids)
        tokens += int(valid.sum())
        captured: dict[int, tuple[torch.Tensor, dict]] = {}
        final: list[torch.Tensor] = []
        hooks = []
        fast = structure is not None
        if fast:
            prefix, layers, norm, head = structure
            for j, layer in enumerate(layers):

                def pre(mod, args, kwargs, j=j):
                    h = args[0] if args else kwargs["hidden_states"]
                    kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                    captured[j] = (h.detach(), kw, args[1:])

                hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(norm.register_forward_pre_hook(lambda mod, args: final.append(args[0].detach())))
        try:
            with torch.no_grad():
                ref_logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        finally:
            for h in hooks:
                h.remove()
        ref_logp = torch.log_softmax(ref_logits[valid].float(), dim=-1)
        if fast:
            with torch.no_grad():
                again = head(norm(final[-1]))
            fast = len(final) == 1 and torch.allclose(again.float(), ref_logits.float(), rtol=1e-3, atol=1e-3)
        del ref_logits

        def tail(start: int):
            h = captured[start][0]
            for j in range(start, len(layers)):
                # Each layer gets the arguments it was called with (masks may differ per layer type).
                _, kw, extra = captured[j]
                h = _first(layers[j](h, *extra, **kw))
            return head(norm(h))

        for g in groups:
            layer = _layer_of(g.modules[0], prefix) if fast else None
            cand = cands[g.modules]
            for r in ratios:
                with torch.no_grad(), cand.installed(model, r):
                    if layer is not None:
                        logits = tail(layer)
                    else:
                        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                sums[g.modules][r] += _kl_sum(ref_logp, logits, valid)
                del logits
                step()
            del cand
    return {k: {r: s / max(tokens, 1) for r, s in v.items()} for k, v in sums.items()}


def evaluate_kl(model: nn.Module, batches: list[dict], candidates: dict, ratios: dict[tuple[str, ...], float]) -> float:
    """Mean KL(p_ref ‖ p_q) per valid token when every group in `ratios` is quantized at its ratio
    at once (e.g. a whole plan): the end-to-end check a plan is judged by."""
    return evaluate_kls(model, batches, candidates, [ratios])[0]


def evaluate_kls(model: nn.Module, batches: list[dict], candidates: dict, plans: list[dict[tuple[str, ...], float]]) -> list[float]:
    """`evaluate_kl` for several plans, sharing the unquantized reference pass."""
    batches = take(batches, None, device_of(model))
    totals, tokens = [0.0] * len(plans), 0
    with torch.no_grad():
        for b in batches:
            ids, mask = b["input_ids"], b.get("attention_mask")
            valid = valid_tokens(mask, ids)
            ref = torch.log_softmax(model(input_ids=ids, attention_mask=mask, use_cache=False).logits[valid].float(), dim=-1)
            for k, ratios in enumerate(plans):
                with quantized(model, candidates, ratios):
                    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                totals[k] += _kl_sum(ref, logits, valid)
                del logits
            tokens += int(valid.sum())
    return [t / max(tokens, 1) for t in totals]
