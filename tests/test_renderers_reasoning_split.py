"""split_reasoning, the one reading of a sampled turn's `REASONING</think>REST` that the renderers share, on
hand-written cases; each family's parse_turn is checked against its template in its own test file."""

from __future__ import annotations

import pytest

from archon.models.common.chat_format import REASONING_NOT_CLOSED, split_reasoning


@pytest.mark.parametrize(
    "text, expected",
    [
        ("r</think>answer", ("r", "answer", None)),
        ("\nr\n</think>\n\nanswer", ("\nr\n", "\n\nanswer", None)),
        ("</think>answer", ("", "answer", None)),
        ("r</think>", ("r", "", None)),
        ("a</think>b</think>c", ("a", "b</think>c", None)),  # the first </think> closes the reasoning
        ("still thinking", ("still thinking", "", REASONING_NOT_CLOSED)),
        ("", ("", "", REASONING_NOT_CLOSED)),
        ("<think>r</think>a", ("<think>r", "a", None)),  # an opening tag is the caller's to remove
    ],
)
def test_split_reasoning(text, expected):
    assert split_reasoning(text) == expected


def test_not_closed_message_names_the_tag():
    assert REASONING_NOT_CLOSED == "the reasoning is never closed by </think>"
