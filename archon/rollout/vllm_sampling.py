"""A vLLM completion request from archon's SamplingParams (`completion_body`: token ids in and out,
the sampled tokens' log-probs, stop only on stop_token_ids), and the seed of a request that
continues a sample after a publish under the update policy 'continue' (`continuation_seed`)."""

from __future__ import annotations

import hashlib

from archon.rollout.base import SamplingParams

# Tokens per streamed chunk under 'continue': a publish takes effect at a request's next chunk, so
# this bounds how many tokens a request still samples on the replaced version, while a chunk per
# token costs the server and the reading thread an event per token.
STREAM_INTERVAL_TOKENS = 8


def continuation_seed(seed: int, sample: int, tokens_so_far: int) -> int:
    """The seed of the request that continues sample `sample` (of a request seeded with `seed`)
    after `tokens_so_far` tokens: reproducible, and unlike the seeds vLLM gives the samples of a
    request (seed + their index), so that the continuation does not draw the noise it drew before."""
    digest = hashlib.blake2b(f"{seed}:{sample}:{tokens_so_far}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def completion_body(model_name: str, prompts: list[list[int]], sampling: SamplingParams, stream: bool = False) -> dict:
    body = {
        "model": model_name,
        "prompt": prompts,
        "n": sampling.n,
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "logprobs": 0,
        "return_token_ids": True,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": True,  # stop only on stop_token_ids, as the native engine does
        "skip_special_tokens": False,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if stream:
        body["stream"] = True
        body["stream_interval"] = STREAM_INTERVAL_TOKENS
    return body
