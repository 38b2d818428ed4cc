"""One sample request on the built-in engine: the Tinker SamplingParams mapped onto the engine's,
stop sequences cut, and the log-probs the request asks for (per sampled token, top-k, prompt)."""

from __future__ import annotations

from dataclasses import dataclass

from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.serve.scoring import completion_topk, prompt_scores
from archon.serve.wire import SampledOut


@dataclass
class SampleCall:
    sampling_session_id: str
    prompt: list[int]
    num_samples: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    """None: the model's EOS tokens stop (unless stop strings are given); (): nothing stops."""
    stop_strings: tuple[str, ...] = ()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0


def parse_stop(stop) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """SamplingParams.stop (None, a string, or a list of strings or of token ids) as (stop token
    ids or None for the default, stop strings)."""
    if stop is None:
        return None, ()
    if isinstance(stop, str):
        return (), (stop,)
    values = list(stop)
    if all(isinstance(v, str) for v in values):
        return (), tuple(values)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return tuple(values), ()
    raise ValueError(f"sampling_params.stop must be a string, or a list of strings or of token ids, got {stop!r}")


def _cut_at_stop_string(tokens: list[int], tokenizer, stops: tuple[str, ...]) -> int | None:
    """The fewest leading tokens whose text holds a stop string (None: no stop string in the text)."""
    if not any(stop in tokenizer.decode(tokens) for stop in stops):
        return None
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n])
        if any(stop in text for stop in stops):
            return n
    return None


def batch_key(call: SampleCall) -> tuple | None:
    """Requests with the same key can share one generation (the same sampler and settings, and no
    seed: a seeded request's samples must not depend on the other requests); None: alone."""
    if call.seed is not None:
        return None
    stop = None if call.stop_token_ids is None else tuple(call.stop_token_ids)
    return (
        call.sampling_session_id,
        call.num_samples,
        call.max_tokens,
        call.temperature,
        call.top_p,
        call.top_k,
        stop,
        call.stop_strings,
    )


def run_samples(
    engine: NativeRolloutEngine,
    calls: list[SampleCall],
    max_tokens: int,
    eos_token_ids: tuple[int, ...],
    tokenizer,
    generate=None,
) -> list[tuple[list[SampledOut], dict]]:
    """Requests of one batch_key (or one request) in one generation: per request, (its num_samples
    sequences, its prompt's scores {"prompt_logprobs", "topk_prompt"}). `generate(prompts, params)`:
    what generates (default: `engine`, whose model scores prompts and top-k either way)."""
    first = calls[0]
    stop_ids = first.stop_token_ids
    if stop_ids is None:
        stop_ids = () if first.stop_strings else eos_token_ids
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=first.temperature,
        top_p=first.top_p,
        top_k=max(first.top_k, 0),
        n=first.num_samples,
        stop_token_ids=tuple(stop_ids),
        seed=first.seed,
    )
    # the cache holds the requests' rows, n per prompt (the engine's cost grows with its rows)
    engine.max_batch_sequences = first.num_samples * len(calls)
    samples = (generate or engine.generate)([call.prompt for call in calls], params)
    n = first.num_samples
    return [_finish(engine, call, samples[i * n : (i + 1) * n], tokenizer) for i, call in enumerate(calls)]


def _finish(engine: NativeRolloutEngine, call: SampleCall, samples, tokenizer) -> tuple[list[SampledOut], dict]:
    """One request's sequences (cut at its stop strings) and the log-probs it asked for."""
    sequences = []
    for sample in samples:
        tokens, logprobs, reason = list(sample.completion_ids), list(sample.logprobs), sample.finish_reason
        if call.stop_strings:
            cut = _cut_at_stop_string(tokens, tokenizer, call.stop_strings)
            if cut is not None:
                tokens, logprobs, reason = tokens[:cut], logprobs[:cut], "stop"
        topk = None
        if call.topk_sample_logprobs > 0:
            topk = completion_topk(engine.model, call.prompt, tokens, call.topk_sample_logprobs, engine.device)
        sequences.append(SampledOut(tokens, logprobs, "stop" if reason == "stop" else "length", topk))
    scores: dict = {}
    if call.prompt_logprobs or call.topk_prompt_logprobs > 0:
        values, top = prompt_scores(engine.model, call.prompt, engine.device, call.topk_prompt_logprobs)
        scores["prompt_logprobs"] = values if call.prompt_logprobs else None
        scores["topk_prompt"] = top
    return sequences, scores
