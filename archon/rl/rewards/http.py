"""Reward terms answered over HTTP: a reward server (batches of samples POSTed as JSON) and an LLM
judge (an OpenAI-compatible chat endpoint asked to grade each completion with a rubric).

Both run in the scoring process, in threads (`concurrency` requests in flight). Every request
attempt is limited to about `timeout_s` seconds and retried `retries` times, waiting `backoff_s`,
then twice that, and so on, between attempts. A sample whose request still fails (a refused
connection, an HTTP error status, a reply that is not the JSON described below, a judge reply the
score parser cannot read) gets no value and is reported to the scorer as a failure, never raised.

Reward server protocol (docs/rewards.md):

    POST url  {"samples": [{"prompt": str, "completion": str, "reference": any, "data_source": str,
                            "extra_info": any}, ...]}        (at most batch_size samples)
    200       {"rewards": [float, ...]}                      (one finite number per sample, in order)

This module does not import torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from archon.secrets import secret_field

NUMBER = r"-?\d+(?:\.\d+)?"
MAX_CHOICES = 101
"""The most scores a `choice` structured output lists (the integers of score_range)."""
RETRIED_STATUSES = (408, 429, 500, 502, 503, 504)
"""HTTP statuses worth another attempt; any other error status fails at once."""


@dataclass
class RewardServerConfig:
    """A reward term `kind: server`: samples POSTed in batches to a reward server (docs/rewards.md)."""

    url: str = secret_field("", kind="url")
    """http(s) URL the batches are POSTed to."""
    batch_size: int = 32
    """Samples per request."""
    timeout_s: float = 60.0
    """Time limit of one request attempt."""
    retries: int = 2
    """Further attempts after a failed one (refused connection, time-out, error status, malformed reply)."""
    backoff_s: float = 1.0
    """Wait before the first retry; doubled before each next one."""
    concurrency: int = 4
    """Requests in flight at once."""
    api_key_env: str = secret_field("", kind="env")
    """An environment variable holding a token sent as `Authorization: Bearer <token>`; "" for none."""


@dataclass
class JudgeConfig:
    """A reward term `kind: judge`: an LLM behind an OpenAI-compatible chat endpoint grades each completion."""

    base_url: str = secret_field("", kind="url")
    """The endpoint's base URL, e.g. http://localhost:8000/v1 (requests go to base_url/chat/completions)."""
    model: str = ""
    """The model name the endpoint serves."""
    prompt: str = ""
    """The rubric: a template with {prompt}, {completion} and {reference} (literal braces doubled),
    sent as the user message."""
    system_prompt: str = ""
    """A system message before it; "" for none."""
    score_range: tuple[float, float] = (0.0, 1.0)
    """The lowest and highest score; a parsed score outside it is a parse failure."""
    score_regex: str = ""
    """A regex searched in the reply whose first group (or whole match) is the score, e.g.
    'Score: (\\d+)'; "" : the whole reply, stripped, must be a number."""
    normalize: bool = False
    """Map score_range onto [0, 1] (the term's value is (score - low) / (high - low))."""
    structured_output: Literal["none", "choice", "regex"] = "none"
    """Constrain the judge's reply with vLLM's structured outputs: choice (one of the integers of
    score_range) or regex (score_regex, or a number when it is ""). Needs a vLLM server."""
    max_tokens: int = 16
    """The reply's token limit."""
    timeout_s: float = 60.0
    """Time limit of one request attempt."""
    retries: int = 2
    """Further attempts after a failed request (not after an unparsable reply)."""
    backoff_s: float = 1.0
    """Wait before the first retry; doubled before each next one."""
    concurrency: int = 8
    """Requests in flight at once."""
    api_key_env: str = secret_field("", kind="env")
    """An environment variable holding the endpoint's API key; "" for none."""


class RewardRequestFailed(Exception):
    """A failed request: `kind` is "timeout", "error" or "parse" (an unreadable judge reply);
    `retry`: whether another attempt may go better."""

    def __init__(self, kind: str, message: str, retry: bool = True):
        super().__init__(message)
        self.kind = kind
        self.retry = retry and kind != "parse"


@dataclass
class HttpOutcome:
    """What one term's HTTP requests of a batch gave: a value or a failure per sample, and counts."""

    values: list[float | None]
    failures: list[tuple[str, str] | None]
    """Per sample: None, or (kind, message) with kind "timeout", "error" or "parse"."""
    requests: int = 0
    retries: int = 0


def _headers(api_key_env: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        token = os.environ.get(api_key_env, "")
        if not token:
            raise RewardRequestFailed("error", f"environment variable {api_key_env} (api_key_env) is not set")
        headers["Authorization"] = f"Bearer {token}"
    return headers


def post_json(url: str, body: Any, timeout_s: float, headers: dict[str, str]) -> Any:
    """POST `body` as JSON and return the decoded reply; raises RewardRequestFailed. The reply is
    read in chunks until `timeout_s` has passed, so a server that trickles its reply is cut off too."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            chunks = []
            while chunk := response.read1(1 << 16):
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise RewardRequestFailed("timeout", f"no complete reply from {url} in {timeout_s} s")
    except urllib.error.HTTPError as e:
        detail = e.read(300).decode(errors="replace").strip()
        message = f"{url} answered HTTP {e.code} {e.reason}: {detail}"
        raise RewardRequestFailed("error", message, retry=e.code in RETRIED_STATUSES) from None
    except TimeoutError:
        raise RewardRequestFailed("timeout", f"no reply from {url} in {timeout_s} s") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise RewardRequestFailed("timeout", f"no reply from {url} in {timeout_s} s") from None
        raise RewardRequestFailed("error", f"{url}: {type(reason).__name__}: {reason}") from None
    text = b"".join(chunks).decode(errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise RewardRequestFailed("error", f"{url} replied with something that is not JSON: {text[:200]!r}") from None


def _with_retries(attempt: Callable[[], Any], retries: int, backoff_s: float, counts: list[int]) -> Any:
    """attempt(), tried again up to `retries` times after a failure worth retrying;
    counts[0] += requests, counts[1] += retries."""
    wait = backoff_s
    for number in range(retries + 1):
        counts[0] += 1
        try:
            return attempt()
        except RewardRequestFailed as e:
            if not e.retry or number == retries:
                raise
        counts[1] += 1
        time.sleep(wait)
        wait *= 2
    raise AssertionError("unreachable")


def _run_jobs(jobs: Sequence[Callable[[list[int]], None]], concurrency: int) -> tuple[int, int]:
    """Run the jobs on `concurrency` threads; the (requests, retries) they counted."""
    counts = [[0, 0] for _ in jobs]
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(jobs)))) as pool:
        for future in [pool.submit(job, count) for job, count in zip(jobs, counts)]:
            future.result()
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    return float(value)


def server_rewards(config: RewardServerConfig, samples: Sequence[dict[str, Any]]) -> HttpOutcome:
    """Each sample's reward from the reward server; `samples` are the request's sample objects."""
    outcome = HttpOutcome([None] * len(samples), [None] * len(samples))
    if not samples:
        return outcome
    try:
        headers = _headers(config.api_key_env)
    except RewardRequestFailed as e:
        outcome.failures = [(e.kind, str(e))] * len(samples)
        return outcome

    def attempt(batch: Sequence[dict[str, Any]]) -> list[float]:
        reply = post_json(config.url, {"samples": list(batch)}, config.timeout_s, headers)
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(batch):
            shown = json.dumps(reply)[:200]
            raise RewardRequestFailed(
                "error", f'{config.url} replied {shown}, expected {{"rewards": [...]}} with {len(batch)} numbers'
            )
        try:
            return [_finite(value) for value in rewards]
        except ValueError as e:
            raise RewardRequestFailed("error", f"{config.url} replied a reward that {e}") from None

    def job(start: int) -> Callable[[list[int]], None]:
        def run(counts: list[int]) -> None:
            batch = samples[start : start + config.batch_size]
            try:
                values = _with_retries(lambda: attempt(batch), config.retries, config.backoff_s, counts)
                outcome.values[start : start + len(batch)] = values
            except RewardRequestFailed as e:
                outcome.failures[start : start + len(batch)] = [(e.kind, str(e))] * len(batch)

        return run

    outcome.requests, outcome.retries = _run_jobs(
        [job(start) for start in range(0, len(samples), config.batch_size)], config.concurrency
    )
    return outcome


def judge_choices(config: JudgeConfig) -> list[str]:
    """The replies a `choice` structured output allows: the integers of score_range."""
    low, high = config.score_range
    return [str(score) for score in range(math.ceil(low), math.floor(high) + 1)]


def parse_judge_score(config: JudgeConfig, reply: str) -> float:
    """The score in a judge's reply (see JudgeConfig.score_regex), checked against score_range and
    normalized when asked; raises RewardRequestFailed("parse", ...)."""
    text = reply.strip()
    if config.score_regex:
        match = re.search(config.score_regex, text)
        found = None if match is None else (match.group(1) if match.groups() else match.group(0))
    else:
        found = text if re.fullmatch(NUMBER, text) else None
    try:
        score = float(found) if found is not None else math.nan
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise RewardRequestFailed("parse", f"no score in the judge's reply {reply[:200]!r}")
    low, high = config.score_range
    if not low <= score <= high:
        raise RewardRequestFailed("parse", f"the judge's score {score} is outside score_range [{low}, {high}]")
    return (score - low) / (high - low) if config.normalize else score


def judge_request(config: JudgeConfig, sample: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request asking the judge to grade one sample."""
    reference = "" if sample["reference"] is None else sample["reference"]
    content = config.prompt.format(prompt=sample["prompt"], completion=sample["completion"], reference=reference)
    messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    messages.append({"role": "user", "content": content})
    body: dict[str, Any] = {
        "model": config.model,
        "messages": messages,
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
    }
    if config.structured_output == "choice":
        body["structured_outputs"] = {"choice": judge_choices(config)}
    elif config.structured_output == "regex":
        body["structured_outputs"] = {"regex": config.score_regex or NUMBER}
    return body


def judge_rewards(config: JudgeConfig, samples: Sequence[dict[str, Any]]) -> HttpOutcome:
    """Each sample's score from the judge, one chat completion request per sample."""
    outcome = HttpOutcome([None] * len(samples), [None] * len(samples))
    if not samples:
        return outcome
    url = config.base_url.rstrip("/") + "/chat/completions"
    try:
        headers = _headers(config.api_key_env)
    except RewardRequestFailed as e:
        outcome.failures = [(e.kind, str(e))] * len(samples)
        return outcome

    def attempt(sample: dict[str, Any]) -> float:
        reply = post_json(url, judge_request(config, sample), config.timeout_s, headers)
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            text = None
        if not isinstance(text, str):
            raise RewardRequestFailed("error", f"{url} replied {json.dumps(reply)[:200]}, not a chat completion")
        return parse_judge_score(config, text)

    def job(index: int) -> Callable[[list[int]], None]:
        def run(counts: list[int]) -> None:
            try:
                outcome.values[index] = _with_retries(
                    lambda: attempt(samples[index]), config.retries, config.backoff_s, counts
                )
            except RewardRequestFailed as e:
                outcome.failures[index] = (e.kind, str(e))

        return run

    outcome.requests, outcome.retries = _run_jobs([job(i) for i in range(len(samples))], config.concurrency)
    return outcome
