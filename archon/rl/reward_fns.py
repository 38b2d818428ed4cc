"""Built-in reward functions, the lookup of user ones ("module:function") and how they are called.

A reward function is `fn(prompt: str, completion: str, reference) -> float` (bool and int are
accepted). It sees the prompt text as given to the model, the decoded completion and the reference
answer from the dataset. A function that also names a parameter `data_source` or `extra_info` (or
takes **kwargs) gets the row's `data_source` and `extra_info` as keywords. A function in verl's
form, `compute_score(data_source, solution_str, ground_truth, extra_info=None)` (detected by a
parameter named `solution_str`, or a first parameter named `data_source`), is called with those
keywords instead, and may return a dict with a "score" entry as verl's do.

A group reward function, `fn(prompt, completions: list[str], reference) -> list[float]`, scores all
the completions of one prompt at once (a pairwise or ranking judge) and gets the same keywords.
This module does not import torch: reward worker processes load it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

from archon.workers import import_function

RewardFn = Callable[[str, str, Any], float]


class _DropMathVerifyTimeoutWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@functools.cache
def _math_verify():
    """Import math-verify (about a second: it loads sympy) and return (parse, verify)."""
    from math_verify import parse, verify

    # math-verify warns once when its own signal.alarm timeouts are off; ours replace them.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropMathVerifyTimeoutWarning())
    return parse, verify


def math_verify_reward(prompt: str, completion: str, reference: Any) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference, else 0.0.

    math-verify's own timeouts use signal.alarm, which only works on the main thread and would
    cancel the scorer's timer, so they are switched off here; the scorer enforces the time limit.
    """
    parse, verify = _math_verify()
    reference = str(reference)
    gold = parse(reference, parsing_timeout=None) or parse(f"${reference}$", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify could not parse the reference answer {reference!r}")
    answer = parse(completion, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


def exact_match_reward(prompt: str, completion: str, reference: Any) -> float:
    """1.0 when the completion equals the reference after stripping surrounding whitespace."""
    return 1.0 if completion.strip() == str(reference).strip() else 0.0


BUILTIN_REWARDS: dict[str, str] = {
    "math": "archon.rl.reward_fns:math_verify_reward",
    "exact": "archon.rl.reward_fns:exact_match_reward",
    "reasoning_gym": "archon.rl.data.reasoning_gym:reasoning_gym_reward",
}


def _split_spec(spec: str) -> tuple[str, str]:
    """ "math", "exact" or "package.module:function" -> (module name, attribute path)."""
    target = BUILTIN_REWARDS.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {spec!r} must be one of {', '.join(BUILTIN_REWARDS)} or 'module:function'")
    return module_name, attr


def reward_function_problem(spec: str) -> str | None:
    """What is wrong with a reward function spec that can be told without running user code (a bad
    form, a module that cannot be found), or None. resolve_reward_function checks the rest."""
    try:
        module_name, _ = _split_spec(spec)
    except ValueError as e:
        return str(e)
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as e:  # a parent package that is missing or fails to import
        return f"module {module_name!r} cannot be found: {type(e).__name__}: {e}"
    if found is None:
        return f"no module named {module_name!r} (looked on sys.path; add its directory to PYTHONPATH)"
    return None


def resolve_reward_function(spec: str) -> RewardFn:
    """ "math", "exact" or "package.module:function" -> the callable. Fails clearly on a bad spec."""
    module_name, attr = _split_spec(spec)
    fn = import_function(module_name, attr, f"reward function {spec!r}")
    if fn is math_verify_reward:
        _math_verify()  # import now, so the first sample's time limit does not include it
    return fn


@dataclass(frozen=True)
class CallStyle:
    """How a reward function is called, read from its signature (see the module doc)."""

    verl: bool = False
    """verl's form: keywords data_source, solution_str, ground_truth (and extra_info)."""
    keywords: tuple[str, ...] = ()
    """Of data_source and extra_info, the keywords it takes beside (prompt, completion, reference)."""


def call_style(fn: Callable) -> CallStyle:
    """The CallStyle of `fn`, from its parameter names; a callable without a signature gets the plain style."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins and C callables
        return CallStyle()
    names = list(parameters)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if "solution_str" in names or (names and names[0] == "data_source"):
        return CallStyle(verl=True, keywords=tuple(k for k in ("extra_info",) if k in names or takes_any))
    return CallStyle(keywords=tuple(k for k in ("data_source", "extra_info") if k in names or takes_any))


def _call(
    fn: Callable, style: CallStyle, prompt: str, completion: Any, reference: Any, data_source: str, extra_info: Any
) -> Any:
    extras = {"data_source": data_source, "extra_info": extra_info}
    if style.verl:
        kwargs = {k: extras[k] for k in style.keywords}
        return fn(data_source=data_source, solution_str=completion, ground_truth=reference, **kwargs)
    return fn(prompt, completion, reference, **{k: extras[k] for k in style.keywords})


def _as_reward(value: Any, what: str) -> float:
    if isinstance(value, dict) and "score" in value:  # verl's functions may return {"score": ..., ...}
        value = value["score"]
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{what} returned {type(value).__name__}, expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} returned {value}")
    return value


def call_reward(
    fn: RewardFn,
    prompt: str,
    completion: str,
    reference: Any,
    data_source: str = "",
    extra_info: Any = None,
    style: CallStyle | None = None,
) -> float:
    """Call a reward function (in its CallStyle) and check that it returned a finite number."""
    style = call_style(fn) if style is None else style
    return _as_reward(_call(fn, style, prompt, completion, reference, data_source, extra_info), "reward function")


def call_group_reward(
    fn: Callable,
    prompt: str,
    completions: list[str],
    reference: Any,
    data_source: str = "",
    extra_info: Any = None,
    style: CallStyle | None = None,
) -> list[float]:
    """Call a group reward function on one prompt's completions; checks it returned one finite number each."""
    style = call_style(fn) if style is None else style
    values = _call(fn, style, prompt, list(completions), reference, data_source, extra_info)
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        shown = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"group reward function returned {shown} for {len(completions)} completions")
    return [_as_reward(value, "group reward function") for value in values]
