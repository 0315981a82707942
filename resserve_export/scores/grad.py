"""The gradient-weighted scores: Σ over valid tokens of Σ_j (∂L/∂Y ⊙ (Y_q − Y))² per group
(Fisher-diagonal, as in BRECQ), L the summed next-token cross-entropy, reported per valid token.

One forward + backward per batch; backward hooks on each quantized linear's output receive
∂L/∂Y and score every candidate ratio of the group right there from the captured input (all
candidates from one pass). Weight gradients are never computed. The candidate products run in
FP32 (the emulated linear's own arithmetic, `Candidates.member_outputs`) or as bf16 GEMMs on the
same FP4 operands (`Candidates.prepare_fast` / `member_sums_fast`, see `bf16`), as
`precision.resolve_precision` chose. Padded targets are ignored by the loss, so their ∂L/∂Y is
zero.
"""

from __future__ import annotations

import torch

from .batches import _valid


def _grad_scores(model, batches, groups, cands, ratios, step, precision: str = "fp32") -> dict:
    fast = precision == "bf16"
    # Per group, the per-ratio sums as one float64 vector on the device of its gradients, read
    # back once at the end: the same additions in the same order as Python floats, without a host
    # sync per linear inside the backward pass.
    acc: dict[tuple[str, ...], torch.Tensor] = {}

    def add(key, v: torch.Tensor) -> None:
        acc[key] = (acc[key] if key in acc else torch.zeros_like(v)) + v

    tokens = 0
    params = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in params:
        p.requires_grad_(False)
    embed = model.get_input_embeddings()
    try:
        for batch in batches:
            ids, mask = batch["input_ids"], batch.get("attention_mask")
            valid = _valid(mask, ids)
            # Next-token targets: position t predicts t+1 when both are valid tokens.
            target_ok = valid[:, 1:] & valid[:, :-1]
            tokens += int(target_ok.sum())
            hooks = []

            for g in groups:
                # Fused members read the same input: prepare it once, at the first member's gradient.
                # The group's candidates are looked up there too and released after its last
                # member (a memory-bounded pool may have built them for this batch only).
                shared = {"prepared": None, "left": 0, "cand": None}
                for i, m in enumerate(g.modules):
                    lin = model.get_submodule(m)

                    def fwd(mod, args, out, i=i, key=g.modules, shared=shared):
                        if not out.requires_grad:
                            return
                        x = args[0].detach()
                        y = None if fast else out.detach()
                        shared["left"] += 1

                        def on_grad(grad):
                            x2 = x.reshape(-1, x.shape[-1])
                            if shared["cand"] is None:
                                shared["cand"] = cands[key]
                                if list(shared["cand"].ratios) != list(ratios):
                                    raise ValueError(f"candidates of {key} are for ratios {shared['cand'].ratios}, not {list(ratios)}")
                            cand = shared["cand"]
                            if fast:
                                if shared["prepared"] is None:
                                    shared["prepared"] = cand.prepare_fast(x2)
                                g2 = grad.reshape(-1, grad.shape[-1])
                                add(key, cand.member_sums_fast(shared["prepared"], i, g2))
                            else:
                                if shared["prepared"] is None:
                                    shared["prepared"] = cand.prepare(x2)
                                y2 = y.reshape(-1, y.shape[-1]).float()
                                g2 = grad.reshape(-1, grad.shape[-1]).float()
                                sq = []
                                for _, yq in cand.member_outputs(shared["prepared"], i):
                                    d = (yq - y2) * g2
                                    sq.append(torch.sum(d * d))
                                add(key, torch.stack(sq).double())
                            shared["left"] -= 1
                            if shared["left"] == 0:
                                shared["prepared"] = shared["cand"] = None

                        out.register_hook(on_grad)

                    hooks.append(lin.register_forward_hook(fwd))
            try:
                emb = embed(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=emb, attention_mask=mask, use_cache=False).logits
                lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
                loss = torch.sum(nll[target_ok])
                loss.backward()
            finally:
                for h in hooks:
                    h.remove()
            del logits, lp, nll, loss, emb
            step(len(groups) * len(ratios))
    finally:
        for p, flag in params:
            p.requires_grad_(flag)
    sums = {g.modules: acc[g.modules].tolist() if g.modules in acc else [0.0] * len(ratios) for g in groups}
    return {k: {r: s / max(tokens, 1) for r, s in zip(ratios, v)} for k, v in sums.items()}
