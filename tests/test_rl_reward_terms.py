"""Rewards of several weighted terms: routing by data_source, group reward functions, verl-style
functions, the per-term and per-source metrics, and the HTTP terms (a reward server and an LLM
judge) against local HTTP servers that work, are slow, fail, reply garbage or never answer."""

from __future__ import annotations

import dataclasses
import http.server
import json
import socket
import textwrap
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from archon.rl.reward_http import JudgeConfig, RewardServerConfig, judge_request, parse_judge_score
from archon.rl.rewards import (
    RewardConfig,
    RewardScorer,
    RewardTermConfig,
    UnroutedSourceError,
    reward_breakdown,
)

USER_TERMS = textwrap.dedent(
    """
    def length(prompt, completion, reference):
        return len(completion)

    def flaky(prompt, completion, reference):
        if completion == "boom":
            raise RuntimeError("flaky term broke")
        return 2.0

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        bonus = extra_info["bonus"] if extra_info else 0.0
        return {"score": float(solution_str == ground_truth) + bonus, "acc": solution_str == ground_truth}

    def with_source(prompt, completion, reference, data_source, **kwargs):
        return {"a": 10.0, "b": 20.0}.get(data_source, -1.0) + (kwargs["extra_info"] or 0)

    def rank(prompt, completions, reference):
        # 1 for the shortest completion of the group, 0 for the others; "fail" fails the group
        if "fail" in completions:
            raise ValueError("cannot rank")
        if "short" in completions:
            return [1.0]
        shortest = min(len(c) for c in completions)
        return [float(len(c) == shortest) for c in completions]
    """
)


@pytest.fixture(scope="module")
def terms(importable_module):
    return importable_module("reward_terms_module", USER_TERMS)


def _term(name, function="", kind="function", weight=1.0, **extra):
    return RewardTermConfig(name=name, kind=kind, function=function, weight=weight, **extra)


def test_the_reward_is_the_weighted_sum_of_the_terms_each_logged(terms):
    config = RewardConfig(
        num_workers=0,
        terms=(
            _term("exact", "exact", weight=1.0),
            _term("length", f"{terms}:length", weight=0.25),
            _term("flaky", f"{terms}:flaky", weight=-0.5),
        ),
    )
    with RewardScorer(config) as scorer:
        batch = scorer.score_batch(["p"] * 3, ["42", "boom", "7"], ["42", "42", "8"])
    # exact + 0.25 * length - 0.5 * flaky (the flaky term failed on "boom" and gives 0 there)
    assert batch.rewards.tolist() == [1.0 + 0.5 - 1.0, 0.0 + 1.0 + 0.0, 0.0 + 0.25 - 1.0]
    assert batch.parts["length"].tolist() == [2.0, 4.0, 1.0]
    assert batch.parts["flaky"].tolist() == [2.0, 0.0, 2.0]
    metrics = batch.metrics
    assert metrics["reward/exact_mean"] == pytest.approx(1 / 3)
    assert metrics["reward/length_mean"] == pytest.approx(7 / 3)
    assert metrics["reward/flaky_errors"] == 1 and metrics["reward/exact_errors"] == 0
    assert metrics["reward_errors"] == 1 and metrics["reward_timeouts"] == 0
    assert "flaky term broke" in scorer.last_traceback


def test_a_sample_counts_once_in_the_total_however_many_of_its_terms_fail(terms):
    config = RewardConfig(
        num_workers=1,
        timeout_s=5.0,
        terms=(
            _term("a", f"{terms}:flaky"),
            _term("b", f"{terms}:flaky"),
            _term("c", "exact"),
        ),
    )
    with RewardScorer(config) as scorer:
        batch = scorer.score_batch(["p"] * 2, ["boom", "x"], ["x", "x"])
    assert batch.metrics["reward/a_errors"] == batch.metrics["reward/b_errors"] == 1
    assert batch.metrics["reward_errors"] == 1
    assert batch.rewards.tolist() == [0.0, 5.0]


def test_samples_are_routed_by_data_source_with_per_source_metrics(terms):
    config = RewardConfig(
        num_workers=1,
        timeout_s=5.0,
        terms=(_term("exact", "exact"), _term("length", f"{terms}:length", weight=0.5)),
        sources={"gsm": ("exact",), "essay": ("length",), "both": ("exact", "length")},
        default_terms=("exact",),
    )
    with RewardScorer(config, data_sources=["essay", "gsm", "both", "other", ""]) as scorer:
        batch = scorer.score_batch(
            ["p"] * 6,
            ["1", "abcd", "1", "1", "xy", "1"],
            ["1", "1", "1", "2", "1", "1"],
            data_sources=["gsm", "essay", "both", "other", "gsm", ""],
        )
    assert batch.rewards.tolist() == [1.0, 2.0, 1.5, 0.0, 0.0, 1.0]
    # a term's values are kept only where it scored; its mean is over those samples
    assert batch.parts["length"].tolist() == [0.0, 4.0, 1.0, 0.0, 0.0, 0.0]
    assert batch.metrics["reward/length_samples"] == 2 and batch.metrics["reward/length_mean"] == 2.5
    assert batch.metrics["reward/exact_samples"] == 5 and batch.metrics["reward/exact_mean"] == 0.6
    assert batch.metrics["source/none/count"] == 1 and batch.metrics["source/none/accuracy"] == 1.0
    assert batch.metrics["source/gsm/count"] == 2 and batch.metrics["source/gsm/accuracy"] == 0.5
    assert batch.metrics["source/essay/reward_mean"] == 2.0 and batch.metrics["source/essay/accuracy"] == 1.0
    assert batch.metrics["source/both/reward_mean"] == 1.5
    assert batch.metrics["source/other/count"] == 1 and batch.metrics["source/other/reward_mean"] == 0.0


def test_a_source_without_terms_is_an_error_naming_it_and_the_setting():
    config = RewardConfig(num_workers=0, terms=(_term("exact", "exact"),), sources={"gsm": ("exact",)})
    with pytest.raises(UnroutedSourceError, match=r"data_source 'code' has no reward terms: reward.sources"):
        RewardScorer(config, data_sources=["gsm", "code"])
    scorer = RewardScorer(config, data_sources=["gsm"])
    with pytest.raises(UnroutedSourceError, match="'math'.*reward.default_terms"):
        scorer.score_batch(["p"], ["1"], ["1"], data_sources=["math"])


def test_totals_summed_over_ranks_give_the_run_wide_means(terms):
    """The step sums RewardBatch.sums over the data-parallel ranks: equal keys, in the same order,
    also for a rank that scored nothing of a source or term."""
    config = RewardConfig(
        num_workers=0,
        terms=(_term("exact", "exact"), _term("length", f"{terms}:length")),
        sources={"a": ("exact",), "b": ("length",)},
    )
    with RewardScorer(config, data_sources=["a", "b"]) as scorer:
        first = scorer.score_batch(["p"] * 2, ["1", "2"], ["1", "1"], data_sources=["a", "a"])
        second = scorer.score_batch(["p"], ["abc"], ["1"], data_sources=["b"])
        empty = scorer.score_batch([], [], [])
    assert list(first.sums) == list(second.sums) == list(empty.sums)
    total = {key: first.sums[key] + second.sums[key] + empty.sums[key] for key in first.sums}
    metrics = reward_breakdown(total)
    assert metrics["reward/exact_mean"] == 0.5 and metrics["reward/length_mean"] == 3.0
    assert metrics["source/a/accuracy"] == 0.5 and metrics["source/b/reward_mean"] == 3.0


@pytest.mark.parametrize("num_workers", [0, 1])
def test_verl_style_and_keyword_functions_get_data_source_and_extra_info(terms, num_workers):
    config = RewardConfig(
        num_workers=num_workers,
        timeout_s=5.0,
        terms=(
            _term("verl", f"{terms}:compute_score"),
            _term("keywords", f"{terms}:with_source"),
        ),
    )
    with RewardScorer(config) as scorer:
        batch = scorer.score_batch(
            ["p"] * 2, ["4", "5"], ["4", "4"], data_sources=["a", "b"], extra_infos=[{"bonus": 0.5}, None]
        )
    assert batch.parts["verl"].tolist() == [1.5, 0.0]
    # with_source gets extra_info through **kwargs and adds it: the dict of the first sample makes it raise
    assert batch.metrics["reward/keywords_errors"] == 1
    assert batch.parts["keywords"].tolist() == [0.0, 20.0]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_group_term_scores_each_prompts_completions_together(terms, num_workers):
    config = RewardConfig(
        num_workers=num_workers,
        timeout_s=5.0,
        terms=(
            _term("shortest", f"{terms}:rank", kind="group"),
            _term("exact", "exact", weight=2.0),
        ),
    )
    completions = ["aaa", "b", "cc", "dd", "fail", "e", "short", "zz"]
    groups = [0, 0, 0, 1, 1, 1, 2, 3]  # prompt 1's group fails as a whole; prompt 3's has one sample
    with RewardScorer(config) as scorer:
        batch = scorer.score_batch(["p"] * 8, completions, ["b"] * 8, groups=groups)
    assert batch.parts["shortest"].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert batch.rewards.tolist() == [0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert batch.metrics["reward/shortest_errors"] == 3 and batch.metrics["reward_errors"] == 3
    assert "cannot rank" in scorer.last_traceback


def test_a_group_function_returning_the_wrong_number_of_values_fails_its_group(terms):
    config = RewardConfig(num_workers=0, terms=(_term("shortest", f"{terms}:rank", kind="group"),))
    with RewardScorer(config) as scorer:
        batch = scorer.score_batch(["p"] * 3, ["short", "x", "y"], [None] * 3, groups=[0, 0, 1])
    assert batch.parts["shortest"].tolist() == [0.0, 0.0, 1.0]
    assert batch.metrics["reward/shortest_errors"] == 2
    assert "returned 1 values for 2 completions" in scorer.last_traceback


def test_a_group_term_that_hangs_times_out_and_fails_its_group(importable_module):
    module = importable_module("hanging_group", "def group(p, cs, r):\n    while True:\n        pass\n")
    config = RewardConfig(num_workers=1, timeout_s=0.5, terms=(_term("g", f"{module}:group", kind="group"),))
    with RewardScorer(config) as scorer:
        batch = scorer.score_batch(["p"] * 2, ["a", "b"], [None] * 2, groups=[0, 0])
    assert batch.metrics["reward/g_timeouts"] == 2 and batch.metrics["reward_timeouts"] == 2


def test_the_one_function_shorthand_logs_no_terms():
    with RewardScorer(RewardConfig(function="exact", num_workers=0)) as scorer:
        batch = scorer.score_batch(["p"], ["1"], ["1"])
    assert batch.parts == {} and batch.sums == {}
    assert batch.rewards.tolist() == [1.0]


# ---- HTTP terms ---------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    """Behaviour by path: /ok (reward = completion length), /slow, /error (HTTP 500), /garbage (not
    JSON), /short (one reward too few), /flaky (500 on each batch's first attempt), /judge/<reply>
    (an OpenAI chat completion whose content is <reply>)."""

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.requests.append((self.path, body))
            server.authorizations.append(self.headers.get("Authorization"))
        if self.path == "/slow":
            time.sleep(2.0)
        if self.path == "/error":
            return self._reply(500, b"reward model crashed")
        if self.path == "/garbage":
            return self._reply(200, b"<html>not json</html>")
        if self.path == "/flaky":
            key = json.dumps(body)
            with server.lock:
                first = key not in server.seen
                server.seen.add(key)
            if first:
                return self._reply(503, b"warming up")
        if self.path.startswith("/judge/"):
            content = self.path[len("/judge/") :].removesuffix("/chat/completions").replace("_", " ")
            reply = {"choices": [{"message": {"role": "assistant", "content": content}}]}
            return self._reply(200, json.dumps(reply).encode())
        rewards = [float(len(s["completion"])) for s in body["samples"]]
        if self.path == "/short":
            rewards = rewards[:-1]
        self._reply(200, json.dumps({"rewards": rewards}).encode())

    def _reply(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture(scope="module")
def reward_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.requests, server.authorizations, server.seen, server.lock = [], [], set(), threading.Lock()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@contextmanager
def _silent_server():
    """A server that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()


def _server_scorer(url, **server):
    settings = {"batch_size": 2, "timeout_s": 1.0, "retries": 0, "backoff_s": 0.05, "concurrency": 2, **server}
    term = _term("rm", kind="server", server=RewardServerConfig(url=url, **settings))
    return RewardScorer(RewardConfig(num_workers=0, terms=(term, _term("exact", "exact"))))


def _url(server, path):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def test_the_reward_server_scores_in_batches(reward_server):
    reward_server.requests.clear()
    with _server_scorer(_url(reward_server, "/ok")) as scorer:
        batch = scorer.score_batch(
            ["p"] * 5,
            ["a", "bb", "ccc", "dddd", "x"],
            ["x"] * 5,
            data_sources=["s"] * 5,
            extra_infos=[{"i": i} for i in range(5)],
        )
    assert batch.parts["rm"].tolist() == [1.0, 2.0, 3.0, 4.0, 1.0]
    assert batch.rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 2.0]
    sizes = sorted(len(body["samples"]) for _, body in reward_server.requests)
    assert sizes == [1, 2, 2] and batch.metrics["reward/rm_requests"] == 3
    sample = reward_server.requests[0][1]["samples"][0]
    assert set(sample) == {"prompt", "completion", "reference", "data_source", "extra_info"}
    assert batch.metrics["reward/rm_errors"] == 0 and batch.metrics["reward_errors"] == 0


def test_the_api_key_is_sent_as_a_bearer_token(reward_server, monkeypatch):
    monkeypatch.setenv("ARCHON_TEST_RM_KEY", "secret-token")
    reward_server.authorizations.clear()
    with _server_scorer(_url(reward_server, "/ok"), api_key_env="ARCHON_TEST_RM_KEY") as scorer:
        batch = scorer.score_batch(["p"], ["abc"], [None])
    assert batch.parts["rm"].tolist() == [3.0]
    assert reward_server.authorizations == ["Bearer secret-token"]


def test_failed_requests_are_retried_with_backoff(reward_server):
    reward_server.requests.clear()
    with _server_scorer(_url(reward_server, "/flaky"), retries=1, batch_size=4) as scorer:
        batch = scorer.score_batch(["p"] * 3, ["a", "bb", "ccc"], ["x"] * 3)
    assert batch.parts["rm"].tolist() == [1.0, 2.0, 3.0]
    assert batch.metrics["reward/rm_requests"] == 2 and batch.metrics["reward/rm_retries"] == 1
    assert len(reward_server.requests) == 2


@pytest.mark.parametrize(
    "path, kind, message",
    [
        ("/error", "errors", "answered HTTP 500"),
        ("/garbage", "errors", "not JSON"),
        ("/short", "errors", 'expected {"rewards": [...]} with 2 numbers'),
        ("/slow", "timeouts", "no reply"),
    ],
)
def test_a_failing_reward_server_is_a_counted_failure_within_the_time_limit(reward_server, caplog, path, kind, message):
    with _server_scorer(_url(reward_server, path), retries=1) as scorer:
        start = time.monotonic()
        batch = scorer.score_batch(["p"] * 3, ["a", "bb", "1"], ["1"] * 3)
        elapsed = time.monotonic() - start
    assert batch.parts["rm"].tolist() == [0.0, 0.0, 0.0]
    assert batch.rewards.tolist() == [0.0, 0.0, 1.0]  # the exact term still counts
    assert batch.metrics[f"reward/rm_{kind}"] == 3
    assert batch.metrics["reward_errors"] + batch.metrics["reward_timeouts"] == 3
    assert batch.metrics["reward/rm_retries"] == 2  # both batches were tried twice
    assert message in caplog.text
    assert elapsed < 2 * (1.0 + 0.05) + 2.0


def test_a_reward_server_that_never_answers_times_out(caplog):
    with _silent_server() as url, _server_scorer(url, timeout_s=0.5, retries=1) as scorer:
        start = time.monotonic()
        batch = scorer.score_batch(["p"] * 2, ["a", "b"], ["x", "x"])
        elapsed = time.monotonic() - start
    assert batch.metrics["reward/rm_timeouts"] == 2 and batch.metrics["reward_timeouts"] == 2
    assert batch.metrics["reward/rm_requests"] == 2
    assert elapsed < 2 * 0.5 + 0.05 + 1.5
    assert "no reply" in caplog.text


def test_a_refused_connection_is_a_counted_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with _server_scorer(f"http://127.0.0.1:{port}/") as scorer:
        batch = scorer.score_batch(["p"], ["a"], ["x"])
    assert batch.metrics["reward/rm_errors"] == 1


def _judge(reward_server, reply, **settings):
    settings = {"timeout_s": 1.0, "retries": 0, "concurrency": 3, **settings}
    config = JudgeConfig(
        base_url=_url(reward_server, f"/judge/{reply}"),
        model="judge",
        prompt="Q: {prompt}\nA: {completion}\nRef: {reference}",
        **settings,
    )
    return RewardScorer(RewardConfig(num_workers=0, terms=(_term("judge", kind="judge", judge=config),)))


def test_the_judge_is_asked_with_the_rubric_and_its_score_parsed(reward_server):
    reward_server.requests.clear()
    with _judge(reward_server, "7", score_range=(0.0, 10.0), normalize=True) as scorer:
        batch = scorer.score_batch(["2+2?", "3+3?"], ["4", "6"], ["4", None])
    assert batch.parts["judge"].tolist() == pytest.approx([0.7, 0.7])
    assert batch.metrics["reward/judge_requests"] == 2 and batch.metrics["reward/judge_parse_failures"] == 0
    bodies = sorted(body["messages"][0]["content"] for _, body in reward_server.requests)
    assert bodies == ["Q: 2+2?\nA: 4\nRef: 4", "Q: 3+3?\nA: 6\nRef: "]
    assert all(body["temperature"] == 0 and body["model"] == "judge" for _, body in reward_server.requests)
    assert all(path == "/judge/7/chat/completions" for path, _ in reward_server.requests)


@pytest.mark.parametrize("reply", ["The_answer_looks_right_to_me", "11", "Score:_nine"])
def test_a_judge_reply_without_a_score_in_range_is_a_counted_parse_failure(reward_server, reply):
    with _judge(reward_server, reply, score_range=(0.0, 10.0), retries=2) as scorer:
        batch = scorer.score_batch(["p"] * 2, ["a", "b"], ["x", "x"])
    assert batch.metrics["reward/judge_parse_failures"] == 2 and batch.metrics["reward_errors"] == 2
    assert batch.metrics["reward/judge_retries"] == 0  # the judge said what it says: no retry


def test_a_score_regex_reads_the_score_out_of_prose(reward_server):
    with _judge(reward_server, "Good_work._Score:_4", score_range=(1.0, 5.0), score_regex=r"Score:\s*(\d+)") as scorer:
        batch = scorer.score_batch(["p"], ["a"], ["x"])
    assert batch.parts["judge"].tolist() == [4.0]


def test_judge_requests_carry_structured_outputs_when_asked():
    choice = JudgeConfig(model="m", prompt="{completion}", score_range=(0.0, 3.0), structured_output="choice")
    sample = {"prompt": "p", "completion": "c", "reference": None}
    assert judge_request(choice, sample)["structured_outputs"] == {"choice": ["0", "1", "2", "3"]}
    regex = JudgeConfig(model="m", prompt="{completion}", structured_output="regex", score_regex=r"[0-9]")
    assert judge_request(regex, sample)["structured_outputs"] == {"regex": "[0-9]"}
    assert "structured_outputs" not in judge_request(JudgeConfig(model="m", prompt="x"), sample)
    assert parse_judge_score(JudgeConfig(score_range=(0.0, 3.0)), " 2\n") == 2.0


def test_http_terms_run_beside_the_worker_terms(reward_server, terms):
    config = RewardConfig(
        num_workers=1,
        timeout_s=5.0,
        terms=(
            _term("rm", kind="server", server=RewardServerConfig(url=_url(reward_server, "/ok"), timeout_s=2.0)),
            _term("length", f"{terms}:length", weight=10.0),
        ),
        sources={"a": ("rm",), "b": ("rm", "length")},
    )
    with RewardScorer(config, data_sources=["a", "b"]) as scorer:
        batch = scorer.score_batch(["p"] * 2, ["xy", "xyz"], [None] * 2, data_sources=["a", "b"])
    assert batch.rewards.tolist() == [2.0, 33.0]
    assert torch.equal(batch.parts["length"], torch.tensor([0.0, 3.0]))


# ---- configuration ------------------------------------------------------------------------------


def test_terms_and_routing_load_from_a_yaml_file(tmp_path):
    from archon.rl.config import load_config_file

    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent("""
        reward:
          terms:
            - {name: correct, function: math}
            - {name: rm, kind: server, weight: 0.5, server: {url: "http://rm:8000/score", batch_size: 16}}
            - name: judge
              kind: judge
              judge: {base_url: "http://judge:8000/v1", model: m, prompt: "{completion}", score_range: [0, 10]}
          sources: {gsm8k: [correct], chat: [rm, judge]}
          default_terms: [correct]
    """)
    )
    reward = load_config_file(path).reward
    assert [t.name for t in reward.terms] == ["correct", "rm", "judge"]
    assert reward.terms[1].server.batch_size == 16 and reward.terms[1].weight == 0.5
    assert reward.terms[2].judge.score_range == (0.0, 10.0)
    assert reward.sources == {"gsm8k": ("correct",), "chat": ("rm", "judge")}
    assert reward.default_terms == ("correct",)


def _invalid(reward: RewardConfig, run_dir, data_path=None) -> str:
    from archon.rl.config import RLConfig
    from archon.rl.loop import RLRun

    config = RLConfig()
    config = dataclasses.replace(
        config, reward=reward, logging=dataclasses.replace(config.logging, run_dir=str(run_dir))
    )
    if data_path is not None:
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, path=str(data_path)))
    with pytest.raises(ValueError) as error:
        RLRun(config)  # validation is its first act: no model is built
    return str(error.value)


def _judge_term(**judge):
    settings = {"base_url": "http://judge:8000/v1", "model": "m", "prompt": "{completion}", **judge}
    return _term("judge", kind="judge", judge=JudgeConfig(**settings))


@pytest.mark.parametrize(
    "reward, culprit",
    [
        (
            RewardConfig(terms=(_term("a", "exact"), _term("a", "exact"))),
            "reward.terms[1].name='a': is the name of an earlier term",
        ),
        (RewardConfig(terms=(_term("a b", "exact"),)), "reward.terms[0].name='a b': must be letters"),
        (
            RewardConfig(terms=(_term("a", "nope_module:f"),)),
            "reward.terms[0].function='nope_module:f': no module named",
        ),
        (RewardConfig(terms=(_term("a", "exact", weight=float("nan")),)), "reward.terms[0].weight=nan"),
        (
            RewardConfig(terms=(_term("a", "exact"),), sources={"gsm": ("b",)}),
            "reward.sources['gsm']=['b']: names no term 'b'",
        ),
        (RewardConfig(terms=(_term("a", "exact"),), default_terms=("a",)), "reward.default_terms=['a']: only applies"),
        (RewardConfig(terms=(_term("rm", kind="server"),)), "reward.terms[0].server.url='': must be an http"),
        (
            RewardConfig(terms=(_term("rm", kind="server", server=RewardServerConfig(url="http://x", batch_size=0)),)),
            "reward.terms[0].server.batch_size=0",
        ),
        (RewardConfig(terms=(_judge_term(prompt=""),)), "reward.terms[0].judge.prompt is not set"),
        (RewardConfig(function="exact", terms=(_term("a", "exact"),)), "reward.function='exact': is not used"),
        (
            RewardConfig(terms=(_judge_term(api_key_env="ARCHON_TEST_UNSET_KEY"),)),
            "judge.api_key_env='ARCHON_TEST_UNSET_KEY': names an environment variable that is not set",
        ),
        (RewardConfig(terms=(_judge_term(prompt="{answer}"),)), "reward.terms[0].judge.prompt: KeyError: 'answer'"),
        (RewardConfig(terms=(_judge_term(model=""),)), "reward.terms[0].judge.model=''"),
        (RewardConfig(terms=(_judge_term(score_range=(1.0, 0.0)),)), "reward.terms[0].judge.score_range=[1.0, 0.0]"),
        (RewardConfig(terms=(_judge_term(score_regex="(unclosed"),)), "judge.score_regex='(unclosed': not a regular"),
        (
            RewardConfig(terms=(_judge_term(score_range=(0.0, 1000.0), structured_output="choice"),)),
            "with structured_output=choice must hold 1 to 101 integers",
        ),
    ],
)
def test_invalid_reward_terms_fail_before_anything_is_built(reward, culprit, tmp_path):
    assert culprit in _invalid(reward, tmp_path / "run")


def test_a_data_source_without_terms_fails_before_a_model_is_built(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [
        {"prompt": "1+1", "answer": "2", "data_source": "gsm"},
        {"prompt": "x", "answer": "y", "data_source": "code"},
        {"prompt": "z", "answer": "z"},
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reward = RewardConfig(terms=(_term("exact", "exact"),), sources={"gsm": ("exact",)})
    message = _invalid(reward, tmp_path / "run", data)
    assert "data_source '', 'code' has no reward terms: reward.sources does not list it" in message
    assert str(data) in message


# ---- in the RL loop -----------------------------------------------------------------------------


def test_a_run_logs_each_term_and_each_source(tmp_path):
    """A tiny GRPO run whose rows come from two sources, routed to different terms: every step logs
    the per-term and per-source metrics, and the step's reward is their weighted sum."""
    from test_grpo_recipe import _args, write_tiny_setup

    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun

    root = write_tiny_setup(tmp_path / "setup")
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["data_source"] = "digits" if i % 2 else "exact"
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    yaml_path = tmp_path / "reward.yaml"
    yaml_path.write_text(
        textwrap.dedent("""
        reward:
          num_workers: 0
          terms:
            - {name: digits, function: "reward_fixtures:digits_or_raise", weight: 2.0}
            - {name: exact, function: exact}
          sources: {digits: [digits], exact: [exact]}
    """)
    )
    args = [*_args(root, tmp_path / "run", steps=2), "--eval.every", "0", "--config", str(yaml_path)]
    args = [a for a in args if a not in ("--reward.function", "reward_fixtures:digits_or_raise")]
    RLRun(parse_config(args)).run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    records = [record for record in records if "reward_mean" in record]
    assert len(records) == 2
    for record in records:
        for key in (
            "reward/digits_mean",
            "reward/exact_mean",
            "reward/digits_errors",
            "source/digits/reward_mean",
            "source/exact/accuracy",
            "source/digits/count",
            "source/exact/count",
        ):
            assert key in record, key
        assert record["source/digits/count"] + record["source/exact/count"] == 16
        assert record["reward/digits_samples"] == record["source/digits/count"]
        total = 2.0 * record["reward/digits_mean"] * record["reward/digits_samples"] + (
            record["reward/exact_mean"] * record["reward/exact_samples"]
        )
        assert record["reward_mean"] == pytest.approx(total / 16, abs=1e-6)
