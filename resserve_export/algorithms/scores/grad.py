"""The gradient-weighted scores: Σ over valid tokens of Σ_j (∂L/∂Y ⊙ (Y_q − Y))² per group
(Fisher-diagonal, as in BRECQ), L the summed next-token cross-entropy, reported per valid token.

One forward + backward per batch; backward hooks on each quantized linear's output receive
∂L/∂Y, and once every member of a group has its gradient the group's candidate ratios are
scored from the captured input (all candidates from one pass, one product per ratio over the
group's stacked members). Weight gradients are never computed. With ``RESSERVE_SCORE_THREAD=1``
the hooks only hand each group over, and a thread of its own launches the candidate products
(`worker`), so the backward keeps launching meanwhile. The loss is `loss.next_token_loss` (on
CUDA its eager gradient's bits from one kernel; two fused kernels with
``RESSERVE_FUSED_LOSS=1``); on CUDA the model's RMSNorms give their eager bits with less memory
traffic (`norm.fused_norms`; two fused kernels with ``RESSERVE_FUSED_NORM=1``), and gated MLPs'
SiLU · up run fused with
``RESSERVE_FUSED_MLP=1`` (`mlp.fused_mlps`). The candidate products run in
FP32 (the emulated linear's own arithmetic, `Candidates.member_outputs`) or as bf16 GEMMs on the
same FP4 operands (`Candidates.prepare_fast` / `group_sums_fast`, see `bf16`), as
`precision.resolve_precision` chose. Padded targets are ignored by the loss, so their ∂L/∂Y is
zero.
"""

from __future__ import annotations

import torch

from resserve_export.algorithms.scores import worker as W
from resserve_export.algorithms.scores.loss import next_token_loss
from resserve_export.algorithms.scores.mlp import fused_mlps
from resserve_export.algorithms.scores.norm import fused_norms


class _GroupScorer:
    """One decision group's scores in one batch: each member's input from its forward pass and
    ∂L/∂Y from the backward pass, paired by forward call. When every member of a call has its
    gradient, the group is scored at once: the input prepared once and, in the bf16 path, one
    product per ratio over the members' stacked weights (`Candidates.group_sums_fast`). `flush`
    scores what is left after the backward pass (members whose output got no gradient are
    skipped). `run`: how a group's scoring job is run (called at once by default; a
    `worker.ScoringThread`'s ``submit`` runs it on that thread, in order)."""

    def __init__(self, key, cands, ratios, fast: bool, add, run=None):
        self.key, self.cands, self.ratios, self.fast, self.add = key, cands, ratios, fast, add
        self.run = run if run is not None else (lambda job: job())
        self.calls = [0] * len(key)
        self.slots: list[dict] = []

    def forward(self, i: int, x: torch.Tensor, out: torch.Tensor) -> None:
        k = self.calls[i]
        self.calls[i] += 1
        if k == len(self.slots):
            self.slots.append({"x": {}, "at": {}, "y": {}, "g": {}, "open": 0})
            warm = getattr(self.cands, "warm", None)
            if k == 0 and warm is not None:  # a pool that builds groups in the first forward pass
                warm(self.key)
        slot = self.slots[k]
        slot["x"][i] = x
        slot["at"][i] = (x.data_ptr(), tuple(x.shape), x.stride())
        slot["y"][i] = None if self.fast else out.detach()  # the fp32 path's reference output
        slot["open"] += 1

        def on_grad(grad, slot=slot, i=i):
            slot["g"][i] = grad
            slot["open"] -= 1
            if slot["open"] == 0:
                self._score(slot)

        out.register_hook(on_grad)

    def flush(self) -> None:
        for slot in self.slots:
            if slot["g"]:
                self._score(slot)
        self.slots, self.calls = [], [0] * len(self.key)

    def _score(self, slot: dict) -> None:
        members = sorted(slot["g"])
        xs, ys, gs, at = slot["x"], slot["y"], slot["g"], slot["at"]
        slot["x"], slot["y"], slot["g"], slot["at"] = {}, {}, {}, {}
        # Fused members read one input (the same memory); a member fed another is scored on its own.
        first = at[members[0]]
        same = [i for i in members if at[i] == first]
        parts = [same] + [[i] for i in members if at[i] != first]
        self.run(lambda: self._score_parts(parts, xs, ys, gs))

    def _score_parts(self, parts, xs, ys, gs) -> None:
        # Asked for here, where the products run: a pool builds a group's candidates on first use,
        # on the scoring thread when there is one.
        cand = self.cands[self.key]
        if list(cand.ratios) != list(self.ratios):
            raise ValueError(f"candidates of {self.key} are for ratios {cand.ratios}, not {list(self.ratios)}")
        for part in parts:
            x2 = xs[part[0]].reshape(-1, xs[part[0]].shape[-1])
            g2 = [gs[i].reshape(-1, gs[i].shape[-1]) for i in part]
            if self.fast:
                self.add(self.key, cand.group_sums_fast(cand.prepare_fast(x2), part, g2))
            else:
                prepared = cand.prepare(x2)
                sq = None
                for i, g in zip(part, g2):
                    y2 = ys[i].reshape(g.shape).float()
                    gf = g.float()
                    terms = []
                    for _, yq in cand.member_outputs(prepared, i):
                        d = (yq - y2) * gf
                        terms.append(torch.sum(d * d))
                    m = torch.stack(terms).double()
                    sq = m if sq is None else sq + m
                self.add(self.key, sq)


def score_hooks(model, groups, cands, ratios, fast: bool, add, run=None) -> tuple[list, list]:
    """Hooks on every member of `groups` that, on the outputs' gradients, add each candidate
    ratio's Σ(∂L/∂Y ⊙ (Y_q − Y))² to ``add(group modules, float64 [ratios])``. Returns (handles
    to remove after the backward pass, the groups' scorers to `flush` after it). `run`: a
    `worker.ScoringThread`'s ``submit`` to score on that thread (drain it after the flushes)."""
    hooks, scorers = [], []
    for g in groups:
        scorer = _GroupScorer(g.modules, cands, ratios, fast, add, run)
        scorers.append(scorer)
        for i, m in enumerate(g.modules):
            lin = model.get_submodule(m)

            def fwd(mod, args, out, i=i, scorer=scorer):
                if out.requires_grad:
                    scorer.forward(i, args[0].detach(), out)

            hooks.append(lin.register_forward_hook(fwd))
    return hooks, scorers


class ScoreSums:
    """Per group, the per-ratio float64 sums, each on the device of its gradients and read back
    once at the end: the same additions in the same order as Python floats, without a host sync
    per linear inside the backward pass. `log`: also record every addition (``log["adds"]``, in
    order), for a data-parallel rank whose additions rank 0 replays (`replay`)."""

    def __init__(self, log: dict | None = None):
        self.acc: dict[tuple[str, ...], torch.Tensor] = {}
        self.log = log
        self.tokens = 0  # valid targets scored (`grad_scores` counts them)

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


def grad_scores(model, batches, groups, cands, ratios, step, precision: str = "fp32", log: dict | None = None) -> dict:
    """Per group ``{ratio: score}``. `log`: also record every addition and the token count
    (``log["tokens"]``), for a data-parallel rank (`distributed`). Scored on a
    `worker.ScoringThread` where `worker.wanted`."""
    fast = precision == "bf16"
    sums = ScoreSums(log)
    params = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in params:
        p.requires_grad_(False)
    embed = model.get_input_embeddings()
    worker = W.ScoringThread(embed.weight.device) if W.wanted() else None
    try:
        with fused_norms(model), fused_mlps(model):  # entered before the score hooks (`mlp`)
            _passes(model, batches, groups, cands, ratios, step, fast, sums, worker)
        if worker is not None:
            worker.close()  # waits for the last groups; raises a scoring error
    except BaseException:
        if worker is not None:  # end the thread (a no-op if it ended above), keep this error
            worker.close(raise_error=False)
        raise
    finally:
        for p, flag in params:
            p.requires_grad_(flag)
    if log is not None:
        log["tokens"] = sums.tokens
    return sums.normalised(groups, ratios, sums.tokens)


def _passes(model, batches, groups, cands, ratios, step, fast: bool, sums: ScoreSums, worker) -> None:
    """One forward + backward per batch with the score hooks on; the tokens counted in `sums`."""
    embed = model.get_input_embeddings()
    for batch in batches:
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        hooks, scorers = score_hooks(model, groups, cands, ratios, fast, sums.add, None if worker is None else worker.submit)
        try:
            emb = embed(ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=emb, attention_mask=mask, use_cache=False).logits
            loss, n = next_token_loss(logits, ids, mask)
            sums.tokens += n
            loss.backward()
            for scorer in scorers:
                scorer.flush()
        finally:
            for h in hooks:
                h.remove()
        del logits, loss, emb
        step(len(groups) * len(ratios))
