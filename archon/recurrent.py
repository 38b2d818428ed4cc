"""Token mixers that carry a recurrent state from token to token (linear attention).

A model family marks such a layer by deriving it from `RecurrentTokenMixer`; archon learns from it
that the model has one, without naming the family. In generation, the layer keeps a conv window and
a recurrent state per sequence in its cache (archon/rollout/kv_cache.py: `recurrent_state`,
`store_recurrent_state`) instead of keys and values. Speculative decoding rolls such states back to
the tokens it keeps (archon/rollout/recurrent_cache.py: `RecurrentRollback`).
"""

from __future__ import annotations

from torch import nn


class RecurrentTokenMixer(nn.Module):
    """The base of a token mixer whose state after a token depends on every token before it, kept
    as a conv window and a recurrent state rather than as keys and values."""


def recurrent_mixers(model: nn.Module) -> list[str]:
    """The names of `model`'s recurrent token mixers, in module order."""
    return [name for name, module in model.named_modules() if isinstance(module, RecurrentTokenMixer)]
