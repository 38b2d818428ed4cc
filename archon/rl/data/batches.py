"""PromptBatchIterator: endless, resumable batches of prompts, reshuffled every epoch."""

from __future__ import annotations

import random
from typing import Any, Sequence

from archon.rl.data.prompts import PromptExample


class PromptBatchIterator:
    """Endless batches of examples, reshuffled every epoch, deterministic per seed, and resumable.

    The order of epoch e depends only on (seed, e). state_dict() records the epoch and the position
    of the next batch in it; after load_state_dict() the iterator yields exactly the batches the
    original would have yielded next. With several data-parallel ranks, build the same iterator on
    every rank and have rank r take `batch[r::world_size]`.
    """

    def __init__(
        self,
        examples: Sequence[PromptExample],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and len(examples) < batch_size:
            raise ValueError(f"{len(examples)} examples are fewer than one batch of {batch_size} (drop_last=True)")
        if not examples:
            raise ValueError("no examples to iterate over")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(f"archon-prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> "PromptBatchIterator":
        return self

    def __next__(self) -> list[PromptExample]:
        remaining = len(self.examples) - self.position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += len(indices)
        return [self.examples[i] for i in indices]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_examples": len(self.examples),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position. Fails if the dataset or the batching differ from when it was saved."""
        expected = {
            "seed": self.seed,
            "num_examples": len(self.examples),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }
        different = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if different:
            details = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in different.items())
            raise ValueError(f"cannot resume the prompt iterator: {details}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
