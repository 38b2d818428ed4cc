"""Kept sessions of the embedded engine (archon/rollout/native.py, `generate(..., sessions=)`): each
sample's cached state, kept under its key between the turns of a multi-turn generation.

A kept state (archon/rollout/kv_cache.py KeptState) is valid for the adapter version and the task it
was computed with; a later prompt under its key that starts with its tokens prefills only the rest.
The store is bounded by a number of tokens, the least recently kept sessions evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from archon.rollout.kv_cache import KeptState


@dataclass
class KeptSession:
    kept: KeptState
    version: int
    """The adapter version the state was computed with."""
    adapter: int


class SessionStore:
    """Kept sessions by key, least recently kept first, at most `max_tokens` tokens of state in all
    (None: no bound)."""

    def __init__(self, max_tokens: int | None) -> None:
        self.max_tokens = max_tokens
        self._sessions: OrderedDict[Hashable, KeptSession] = OrderedDict()
        self.tokens = 0
        """Tokens of kept state held now."""

    def clear(self) -> None:
        self._sessions.clear()
        self.tokens = 0

    def drop(self, key) -> KeptSession | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self.tokens -= len(session.kept.tokens)
        return session

    def keep(self, key, session: KeptSession) -> None:
        self.drop(key)
        self._sessions[key] = session
        self.tokens += len(session.kept.tokens)
        while self.max_tokens is not None and self.tokens > self.max_tokens:
            self.drop(next(iter(self._sessions)))

    def take_kept_states(self, groups: list, version: int, continues: bool) -> None:
        """Give each group (archon/rollout/generation.py PromptGroup) the longest state its keys keep
        for a prefix of its prompt (same adapter version and task, at least one prompt token left to
        prefill); the call's keys are taken out of the store, to be replaced by its samples' states.
        continues False: no state is continued (the keys are dropped all the same)."""
        for group in groups:
            for key in group.session_keys:
                session = self.drop(key)
                if not continues or session is None or session.version != version or session.adapter != group.adapter:
                    continue
                tokens = session.kept.tokens
                if len(tokens) < len(group.prompt) and group.prompt[: len(tokens)] == tokens:
                    if group.kept is None or len(tokens) > len(group.kept.tokens):
                        group.kept = session.kept
