"""The lifecycle every hook on a model follows in this package (the observer protocol).

An observer is built on a loaded model and installs its hooks there; then, per batch:

1. ``set_mask(attention_mask)`` before the forward pass (the batch's validity ``[B, T]``: 1 for a
   real token, 0 for padding, which no observer counts);
2. the forward pass, with ``**forward_kwargs()`` added to its arguments (empty unless the observer
   needs the model to run a certain way, e.g. through an observing KV cache);
3. ``end_batch()`` after it (per-batch checks; the mask is dropped).

What the observer gathered is read through its own methods (``result()`` and the like), and
``remove()`` (or leaving a ``with`` block) takes every hook off, leaving the model as it was.
Subclasses register module hooks through `pre_hook` so that `remove` undoes them all, and override
the steps they need.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Observer:
    """Base of every hook class: the lifecycle above, with no-op defaults."""

    def __init__(self) -> None:
        self._handles: list = []
        # The current batch's flattened validity (CPU bool ``[B*T]``) between set_mask and end_batch.
        self.valid: torch.Tensor | None = None

    def pre_hook(self, module: torch.nn.Module, fn: Callable, *, with_kwargs: bool = False) -> None:
        """Run ``fn`` before every forward of `module` until `remove`."""
        self._handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def set_mask(self, attention_mask: torch.Tensor) -> None:
        """The next batch's attention mask ``[B, T]``."""
        self.valid = attention_mask.detach().reshape(-1).to("cpu").bool()

    def forward_kwargs(self) -> dict:
        """Extra arguments for the next forward pass."""
        return {}

    def end_batch(self) -> None:
        """After the forward pass of the batch given to `set_mask`."""
        self.valid = None

    def remove(self) -> None:
        """Take every hook off the model."""
        for h in reversed(self._handles):
            h.remove()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
