"""Llama 4 (Scout, Maverick), text and multimodal.

Every MoE layer stores its experts fused on disk, input-major as Qwen3-VL-MoE's hub checkpoints do
(``feed_forward.experts.gate_up_proj`` ``[E, hidden, 2·intermediate]``, gate then up, and
``down_proj`` ``[E, intermediate, hidden]``); they are read, quantized and written one linear per
expert (``feed_forward.experts.E.gate_proj`` …), the names vLLM's Llama 4 loader takes for
quantized experts. The router (``feed_forward.router``) stays exact; the shared expert is an MLP
like any other.

What sets Llama 4 apart is where the routing weight goes: the router's score (a sigmoid of the
top-k logits) multiplies the expert's *input*, and the expert's output is summed unweighted
(vLLM: ``apply_router_weight_on_input``). transformers computes it by running every expert on every
token with the non-routed scores zero; `adapt` swaps in an experts module with the interface the
rest of the tool hooks (``forward(hidden_states, top_k_index, top_k_weights)``, ``gate_up_proj``
``[E, 2I, H]``, a view of the loaded parameter) that routes each token to its top-k experts only,
with ``weights_on_input`` set. The expert statistics then see what the FP4 GEMM of each expert
sees: the routed tokens scaled by their score (``--moe-calib routed``), or every token scaled by
the sigmoid of that expert's logit (``all``: ``router_scores``, the score the token would carry if
routed there)."""

from __future__ import annotations

import torch

from resserve_export.modeling.families.base import Family, FusedOnDisk


class InputRoutedExperts(torch.nn.Module):
    """A Llama 4 layer's experts as grouped-GEMM-hookable experts: each token runs through its
    top-k experts with its input scaled by the routing weight; outputs are summed unweighted.
    `router_scores` (``[T, E]``, set by `_moe_forward` for the duration of one call): every
    expert's sigmoid score per token, for ``--moe-calib all``."""

    weights_on_input = True

    def __init__(self, fused: torch.nn.Module):
        super().__init__()
        # [E, H, 2I] and [E, I, H] loaded; the interface is [E, 2I, H] and [E, H, I]: views, no copy
        self.gate_up_proj = torch.nn.Parameter(fused.gate_up_proj.detach().transpose(1, 2), requires_grad=False)
        self.down_proj = torch.nn.Parameter(fused.down_proj.detach().transpose(1, 2), requires_grad=False)
        self.act_fn = fused.act_fn
        self.router_scores = None

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        out = torch.zeros_like(hidden_states)
        I = self.gate_up_proj.shape[1] // 2
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            if not token.numel():
                continue
            x = hidden_states[token] * top_k_weights[token, slot, None].to(hidden_states.dtype)
            gate_up = x @ self.gate_up_proj[e].t()
            y = (self.act_fn(gate_up[:, :I]) * gate_up[:, I:]) @ self.down_proj[e].t()
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _moe_forward(moe):
    """Llama4TextMoe.forward over `InputRoutedExperts`: the same router, top-k and shared expert."""

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, moe.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, moe.router.weight)
        top_value, top_index = torch.topk(logits, moe.router.top_k, dim=1)
        weights = torch.sigmoid(top_value.float()).to(hidden_states.dtype)
        moe.experts.router_scores = torch.sigmoid(logits.float()).to(hidden_states.dtype)
        try:
            routed = moe.experts(hidden_states, top_index, weights)
        finally:
            moe.experts.router_scores = None
        out = moe.shared_expert(hidden_states)
        out.add_(routed)
        return out, logits

    return forward


def _text_forward(language_model):
    """The multimodal wrapper's forward on text: its language model's."""

    def forward(input_ids=None, attention_mask=None, pixel_values=None, **kwargs):
        if pixel_values is not None:
            raise ValueError("this Llama 4 model runs on text only here (calibration and verify feed text)")
        return language_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    return forward


def adapt(model: torch.nn.Module) -> None:
    """Swap every Llama 4 MoE block's experts for `InputRoutedExperts` (in place). The multimodal
    wrapper (``Llama4ForConditionalGeneration``) runs its language model on text: in transformers
    5.24 its own forward fails on every input (it reads ``image_outputs`` from its language
    model's output, which has none), and this tool feeds text only."""
    lm = getattr(model, "language_model", None)
    if lm is not None and hasattr(model, "multi_modal_projector"):
        model.forward = _text_forward(lm)
    for _, mod in list(model.named_modules()):
        experts = getattr(mod, "experts", None)
        if not (hasattr(mod, "router") and hasattr(mod, "shared_expert") and isinstance(experts, torch.nn.Module)):
            continue
        if isinstance(experts, InputRoutedExperts) or getattr(experts, "gate_up_proj", None) is None:
            continue
        mod.experts = InputRoutedExperts(experts)
        mod.forward = _moe_forward(mod)


FAMILY = Family(
    name="Llama 4 (experts fused on disk, routing weight on the experts' input)",
    model_types=("llama4", "llama4_text"),
    quantized="decoder linears, each routed expert's gate / up / down as its own linear, the shared expert; router exact",
    wrapper=True,
    exact=("vision_model", "multi_modal_projector", r"model\.vision_model", r"model\.multi_modal_projector"),
    experts_on_disk=FusedOnDisk(),
    adapt=adapt,
    test="tests/modeling/families/test_families.py::test_family_packs_its_language_model_and_copies_the_rest[llama4]",
)
