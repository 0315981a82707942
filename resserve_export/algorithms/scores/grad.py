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

from resserve_export.algorithms.scores.batches import valid_tokens


def score_hooks(model, groups, cands, ratios, fast: bool, add) -> list:
    """Forward hooks on every member of `groups` that, on the output's gradient, add each
    candidate ratio's Σ(∂L/∂Y ⊙ (Y_q − Y))² to ``add(group modules, float64 [ratios])``.
    Returns the hook handles (remove them after the backward pass)."""
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
    return hooks


class ScoreSums:
    """Per group, the per-ratio float64 sums, each on the device of its gradients and read back
    once at the end: the same additions in the same order as Python floats, without a host sync
    per linear inside the backward pass. `log`: also record every addition (``log["adds"]``, in
    order), for a data-parallel rank whose additions rank 0 replays (`replay`)."""

    def __init__(self, log: dict | None = None):
        self.acc: dict[tuple[str, ...], torch.Tensor] = {}
        self.log = log

    def add(self, key, v: torch.Tensor) -> None:
        self.acc[key] = (self.acc[key] if key in self.acc else torch.zeros_like(v)) + v
        if self.log is not None:
            self.log["adds"].append((key, v.detach().to("cpu", copy=True)))

    @classmethod
    def replay(cls, logs: list[dict]) -> ScoreSums:
        """The sums of the ranks' recorded additions, replayed in rank order."""
        sums = cls()
        for log in logs:
            for key, v in log["adds"]:
                sums.add(key, v)
        return sums

    def normalised(self, groups, ratios, tokens: int) -> dict:
        """Per group ``{ratio: sum / tokens}`` (zeros for a group never seen)."""
        sums = {g.modules: self.acc[g.modules].tolist() if g.modules in self.acc else [0.0] * len(ratios) for g in groups}
        return {k: {r: s / max(tokens, 1) for r, s in zip(ratios, v)} for k, v in sums.items()}


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Σ of the next-token cross-entropy (FP32 log-softmax) over the targets where position t
    and t+1 are both valid tokens, and their count."""
    valid = valid_tokens(mask, ids)
    target_ok = valid[:, 1:] & valid[:, :-1]
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.sum(nll[target_ok]), int(target_ok.sum())


def grad_scores(model, batches, groups, cands, ratios, step, precision: str = "fp32", log: dict | None = None) -> dict:
    """Per group ``{ratio: score}``. `log`: also record every addition and the token count
    (``log["tokens"]``), for a data-parallel rank (`distributed`)."""
    fast = precision == "bf16"
    sums = ScoreSums(log)
    tokens = 0
    params = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in params:
        p.requires_grad_(False)
    embed = model.get_input_embeddings()
    try:
        for batch in batches:
            ids, mask = batch["input_ids"], batch.get("attention_mask")
            hooks = score_hooks(model, groups, cands, ratios, fast, sums.add)
            try:
                emb = embed(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=emb, attention_mask=mask, use_cache=False).logits
                loss, n = next_token_loss(logits, ids, mask)
                tokens += n
                loss.backward()
            finally:
                for h in hooks:
                    h.remove()
            del logits, loss, emb
            step(len(groups) * len(ratios))
    finally:
        for p, flag in params:
            p.requires_grad_(flag)
    if log is not None:
        log["tokens"] = tokens
    return sums.normalised(groups, ratios, tokens)
