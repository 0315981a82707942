"""A loaded model under its checkpoint's names.

transformers 5 renames some checkpoints' tensors on load (a vision-language model's
``language_model.model.layers.…`` becomes ``model.language_model.layers.…``; Nemotron-H's
``backbone.`` becomes ``model.``). Everything this tool records and writes (salience keys,
decision groups, checkpoint tensors, the sidecar) uses the checkpoint's names, so a model whose
loaded names differ is wrapped in a `CheckpointView`: the same modules, mounted at the
checkpoint's paths, so that ``named_modules``, ``named_parameters`` and ``get_submodule`` answer
in checkpoint names while the forward pass is the model's own. A model whose names already match
is returned as it is.

The renaming is transformers' own (`transformers.conversion_mapping`, the rules it loads with),
applied to the checkpoint's tensor names: the two sides are matched, not guessed.
"""

from __future__ import annotations

import torch

from resserve_export.core.errors import UserError


def loaded_names(model, checkpoint_names) -> dict[str, str]:
    """``{loaded parameter name: checkpoint tensor name}`` for every checkpoint tensor that
    transformers' load-time renaming maps onto one of the model's parameters (tensors combined on
    load, such as experts fused into one parameter, are left out: `experts` maps those)."""
    from transformers.conversion_mapping import get_model_conversion_mapping  # 3-5 s with transformers
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    params = dict(model.named_parameters())
    try:
        conversions = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - a model transformers has no rules for loads under its own names
        conversions = []
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    meta = dict.fromkeys(params, True)
    out = {}
    for name in checkpoint_names:
        if name in params:
            out[name] = name
            continue
        new, _ = rename_source_key(name, renamings, [], getattr(model, "base_model_prefix", None), meta)
        if new in params and new not in out:
            out[new] = name
    return out


def placements(model, names: dict[str, str]) -> dict[str, str]:
    """``{loaded module path: checkpoint module path}``: the fewest subtrees whose parameters all
    move by one prefix substitution, found from the root down. A subtree with no mapped parameter
    (buffers only, or a tied ``lm_head``) keeps its path."""
    params = [n for n, _ in model.named_parameters()]
    out: dict[str, str] = {}

    def substitution(path: str) -> str | None:
        """The checkpoint path of module `path` if every mapped parameter below it moves with it."""
        found = set()
        for p in params:
            if path and not p.startswith(path + "."):
                continue
            if p not in names:
                continue
            rest = p[len(path) + 1 :] if path else p
            ckpt = names[p]
            if ckpt == rest:
                found.add("")
            elif ckpt.endswith("." + rest):
                found.add(ckpt[: -len(rest) - 1])
            else:
                return None
        if len(found) > 1:
            return None
        return found.pop() if found else path

    def visit(path: str, mod: torch.nn.Module) -> None:
        sub = substitution(path)
        if sub is not None and (path or sub == ""):
            out[path] = sub
            return
        if any(True for _ in mod.named_parameters(recurse=False)):
            raise UserError(f"the loaded model's module {path or '(root)'} holds parameters whose checkpoint names do not share one prefix: its layout is not supported")
        for child, m in mod.named_children():
            visit(f"{path}.{child}" if path else child, m)

    visit("", model)
    return out


class CheckpointView(torch.nn.Module):
    """`model`'s modules mounted at their checkpoint paths (`placements`); calls run the model."""

    def __init__(self, model: torch.nn.Module, where: dict[str, str]):
        super().__init__()
        object.__setattr__(self, "wrapped", model)
        order = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}
        # In the model's own order, so that a tied parameter keeps the name it has in the model
        # (the embedding's, before lm_head's).
        for loaded, ckpt in sorted(where.items(), key=lambda kv: order[kv[0]]):
            mod = model.get_submodule(loaded)
            node: torch.nn.Module = self
            parts = ckpt.split(".")
            for part in parts[:-1]:
                if part not in node._modules:
                    node._modules[part] = torch.nn.Module()  # not add_module: the view answers every name of the model
                node = node._modules[part]
            if parts[-1] in node._modules:
                raise UserError(f"the loaded model maps two modules onto the checkpoint path {ckpt}: its layout is not supported")
            node._modules[parts[-1]] = mod

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "wrapped"), name)

    def _apply(self, fn, recurse=True):
        self.wrapped._apply(fn, recurse)
        return self

    def train(self, mode: bool = True):
        self.wrapped.train(mode)
        return self


def checkpoint_view(model, checkpoint_names) -> torch.nn.Module:
    """`model` itself when its parameters carry the checkpoint's names, else a `CheckpointView`."""
    names = loaded_names(model, checkpoint_names)
    if all(k == v for k, v in names.items()):
        return model
    where = placements(model, names)
    if list(where.items()) == [("", "")]:
        return model
    return CheckpointView(model, where)

