"""Speculative decoding for the embedded engine (archon/rollout/native.py): a drafter proposes k
tokens per row, the target model verifies the k + 1 positions in one forward, and each row keeps
the longest prefix of the draft the target accepts, then one token of the target's own.

The acceptance rule keeps the output exactly the target's:
- greedy (temperature 0): a draft token is accepted while it equals the target's argmax; the next
  token is the target's argmax. The tokens are plain greedy decoding's, token for token.
- sampled: draft token x, drawn from the drafter's distribution q, is accepted with probability
  min(1, p(x) / q(x)) under the target's distribution p; at the first rejection the token is drawn
  from normalize(max(0, p - q)); after k acceptances a bonus token is drawn from p. Each token is
  then distributed as p (p and q are the processed distributions: temperature, then top-k and
  top-p, as `truncated_logprobs`). Every emitted token's log-prob is log p of it, the target's.

Drafters:
- `DraftModelDrafter`: any smaller archon model with the target's tokenizer, with a KV cache of its
  own laid out like the target's (same slots and rows); it prefills each prompt in full and feeds
  its own proposals.
- `MTPDrafter`: the target's own multi-token-prediction layer (models/common/mtp.py). Its block is
  one more cache layer, at the target's positions: the entry at position t pairs the target's final
  hidden state at t with the token at t + 1 and predicts the token at t + 2. The prompt's entries are
  prefilled from the target's prefill; after each verification the entries of the accepted tokens
  are recomputed from the target's hidden states there (the drafts' own entries, made from the MTP
  layer's hidden states, are overwritten); a draft of k > 1 tokens chains the layer on its own
  hidden state and draft token, one position further each time (one layer serves every depth).

- `DraftHeadDrafter` (archon/rollout/drafter.py): a small MLP on the target's final hidden states,
  distilled for one base; no attention, no cache of its own.

The engine's round (draft, verify, accept, emit) is one of its decode steps (archon/rollout/decode.py);
`check_speculative_engine` refuses the engines it cannot run in (several processes, routing replay).
A target with recurrent layers (archon.recurrent) has their states rolled back to each row's kept
tokens after the verify forward (archon/rollout/recurrent_cache.py: `RecurrentRollback`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from archon.build import build_model
from archon.head import full_vocab_logits
from archon.lora import adapter_routing, task_names
from archon.recurrent import recurrent_mixers
from archon.rollout.base import SamplingParams
from archon.rollout.drafter import DraftHeadDrafter, load_draft_head
from archon.rollout.kv_cache import KVCache
from archon.rollout.prefill import prompt_chunks
from archon.rollout.sampling import draw_from, processed_logprobs


@dataclass
class SpeculativeConfig:
    """Speculative decoding in the built-in engine (rollout.engine=native; docs/rollouts.md)."""

    method: Literal["off", "mtp", "draft_model", "draft_head"] = "off"
    """off: one token per decode step. draft_model: a smaller model with the policy's tokenizer
    (draft_model_path) proposes the tokens. mtp: the policy's own multi-token-prediction layer (a
    checkpoint that ships one: DeepSeek-V3, Qwen3.5) proposes them. draft_head: a draft head
    distilled for the policy's base (draft_head_path; archon/rollout/drafter.py)."""
    num_tokens: int = 3
    """Draft tokens proposed per row and decode round (k); a round emits 1 to k + 1 tokens."""
    draft_model_path: str | None = None
    """method=draft_model: the draft model's HF checkpoint directory (same tokenizer as the policy)."""
    draft_head_path: str | None = None
    """method=draft_head: the draft head's safetensors file, made for the policy's base (the demo's:
    `python -m archon.demos.drafter` writes it under archon/demos/drafters)."""
    max_rows: int | None = None
    """Speculate only in generations of at most this many rows (a `generate` call's batch: its
    prompts times samples per prompt, capped by rollout.max_batch_sequences); a larger one decodes
    one token per step. None: every generation. Where a decode step is bound by compute (a CPU),
    verifying k + 1 tokens of every row costs nearly k + 1 steps, and a large batch runs slower with
    speculative decoding than without (docs/performance.md, "The demo's draft head")."""

    def __post_init__(self) -> None:
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(
                f"rollout.speculative.max_rows must be >= 1 or None (every generation), got {self.max_rows}"
            )


def accept_greedy(
    target_logprobs: torch.Tensor, drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """target_logprobs [R, k + 1, V] (log_softmax of the target's logits at the k + 1 verified
    positions), drafts [R, k] -> (tokens [R, k + 1], their log-probs [R, k + 1], accepted [R]).

    Row r emits tokens[r, : accepted[r] + 1]: its accepted drafts, which equal the target's argmax,
    then the target's argmax after them."""
    tokens = target_logprobs.argmax(dim=-1)
    accepted = (drafts == tokens[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    return tokens, target_logprobs.gather(-1, tokens[..., None])[..., 0], accepted


def accept_sampled(
    target_logprobs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    accept_noise: torch.Tensor,
    correction_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling.

    target_logprobs [R, k + 1, V]: the target's processed log-probs at the verified positions;
    drafts [R, k]: the proposed tokens, drawn from draft_probs [R, k, V] (the drafter's processed
    distributions); accept_noise [R, k] and correction_noise [R, k + 1, V]: Exp(1) draws.
    -> (tokens [R, k + 1], their target log-probs [R, k + 1], accepted [R]): row r emits
    tokens[r, : accepted[r] + 1], its first accepted[r] drafts, then the token drawn at the first
    rejection (from normalize(max(0, p - q))) or, all accepted, the bonus token (from p).
    """
    k = drafts.shape[1]
    p = target_logprobs.exp()
    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_draft = draft_probs.gather(-1, drafts[..., None])[..., 0]
    uniform = torch.exp(-accept_noise)  # exp(-E) of E ~ Exp(1) is uniform on (0, 1]
    # accept with probability min(1, p / q): uniform * q < p (q > 0: the drafter drew the token)
    accepted = (uniform * q_draft < p_draft).long().cumprod(dim=1).sum(dim=1)
    residual = (p[:, :k] - draft_probs).clamp(min=0)
    # p == q leaves nothing to correct with (a rejection then has probability 0): draw from p
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p[:, :k], residual)
    correction_dist = torch.cat([residual, p[:, k:]], dim=1)  # [R, k + 1, V], unnormalised
    # an exponential race draws from the normalised distribution without normalising it
    corrections = (correction_dist.log() - correction_noise.log()).argmax(dim=-1)
    position = torch.arange(k + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, corrections[:, -1:]], dim=1)
    tokens = torch.where(position < accepted[:, None], padded, corrections)
    return tokens, target_logprobs.gather(-1, tokens[..., None])[..., 0], accepted


def forward_with_tasks(model: nn.Module, task_of_token: torch.Tensor | None, *args, **kwargs) -> torch.Tensor:
    """model(*args, **kwargs); on a multi-task model each token with its task's adapter."""
    if task_of_token is None or not task_names(model):
        return model(*args, **kwargs)
    with adapter_routing(model, task_of_token):
        return model(*args, **kwargs)


class DraftModelDrafter:
    needs_target_hidden = False

    """Proposes tokens with a smaller model of the same tokenizer (`model`, an archon model),
    `num_tokens` per row and round. Its cache has the target's slots and rows; it holds each row's
    prompt and generated tokens up to the one before the last, like the target's. A round feeds the
    last two tokens of each row (the one before the last may be missing: after a round whose drafts
    were all accepted the drafter never saw its own last draft), then its own proposals, one at a time.
    A multi-task draft model (the target itself, say) drafts each row with the row's task."""

    def __init__(self, model: nn.Module, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"speculative decoding needs num_tokens >= 1 draft tokens per round, got {num_tokens}")
        recurrent = recurrent_mixers(model)
        if recurrent:
            raise ValueError(
                f"a draft model with recurrent (linear-attention) layers ({recurrent[0]}, ...) cannot draft: it is "
                "fed a row's last token again at each round, which its state would take twice; draft with a model "
                "of attention layers (the target may have recurrent layers)"
            )
        self.model = model
        self.num_tokens = num_tokens
        self.cache: KVCache | None = None
        self.vocab_size = model.output_weight.shape[0]
        """The draft model's vocabulary: it proposes none of the target's tokens past it, and reads
        them (in a prompt, or sampled by the target) as token 0, so that they cost acceptance, never
        correctness."""

    def _readable(self, tokens: torch.Tensor) -> torch.Tensor:
        """`tokens` with the ids past the draft model's vocabulary replaced by 0."""
        return torch.where(tokens < self.vocab_size, tokens, torch.zeros_like(tokens))

    def begin(self, target_cache: KVCache) -> None:
        """A generation starts: a cache laid out like the target's."""
        c = target_cache
        self.model.eval()
        self.cache = KVCache(
            len(self.model.layers),
            c.num_slots,
            c.num_rows_total,
            c.group_size,
            c.max_prompt_len,
            c.max_new_tokens,
            c.device,
        )

    def end(self) -> None:
        self.cache = None

    def prefill(self, prompts: dict[int, list[int]], adapters: dict[int, int], budget: int | None) -> None:
        """Prefill whole prompts (slot -> prompt ids; slot -> task) into the draft cache's slots."""
        dev = self.cache.device
        for pieces in prompt_chunks([(slot, 0, len(p)) for slot, p in prompts.items()], budget):
            lens = torch.tensor([end - start for _, start, end in pieces])
            cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(dev)
            tokens = torch.tensor([t for slot, start, end in pieces for t in prompts[slot][start:end]], device=dev)
            tokens = self._readable(tokens)
            positions = torch.cat([torch.arange(start, end) for _, start, end in pieces]).to(dev)
            self.cache.begin_prefill(
                torch.tensor([s for s, _, _ in pieces]), lens, torch.tensor([s for _, s, _ in pieces])
            )
            tasks = torch.tensor([adapters[slot] for slot, _, _ in pieces], device=dev).repeat_interleave(lens.to(dev))
            forward_with_tasks(
                self.model,
                tasks,
                tokens,
                positions,
                cu_seqlens,
                int(lens.max()),
                cache=self.cache,
                logits_rows=torch.zeros(0, dtype=torch.long, device=dev),
            )

    def start_rows(self, rows: list[int], slots: list[int], places: list[int], first_tokens: torch.Tensor) -> None:
        """Rows start samples of the prompts in `slots` (first_tokens [N]: their first tokens)."""
        self.cache.start_rows(rows, slots, places)

    def release_rows(self, rows: list[int], slots: list[int], places: list[int]) -> None:
        self.cache.release_rows(rows, slots, places)

    def propose(
        self,
        tokens: torch.Tensor,
        ngen: torch.Tensor,
        prompt_lens: torch.Tensor,
        live: torch.Tensor,
        row_tasks: torch.Tensor | None,
        num_slots: int,
        prefix_span: int,
        suffix_span: int,
        sampling: SamplingParams,
        vocab_size: int,
        noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft of rows 0..R-1: tokens [R, >= max(ngen)] each row's generated tokens, ngen [R]
        how many, prompt_lens [R], live [R] the rows still generating, row_tasks [R] each row's task
        (or None), noise [R, k, V] Exp(1) draws (sampled).
        -> (drafts [R, k], their processed distributions [R, k, V], or None when greedy)."""
        R, dev = ngen.shape[0], ngen.device
        greedy = sampling.temperature == 0
        rows = torch.arange(R, device=dev)
        last = (ngen - 1).clamp(min=0)
        before = (ngen - 2).clamp(min=0)  # a row with one token feeds it twice, at the same position
        positions = torch.stack([before, last], dim=1)  # [R, 2]
        fed = self._readable(torch.stack([tokens[rows, before], tokens[rows, last]], dim=1))
        self.cache.begin_decode(R, num_slots, positions, prompt_lens, prefix_span, suffix_span, live_rows=live)
        logits = forward_with_tasks(
            self.model,
            None if row_tasks is None else row_tasks.repeat_interleave(2),
            fed.reshape(-1),
            (prompt_lens[:, None] + positions).reshape(-1),
            torch.arange(0, 2 * R + 1, 2, device=dev),
            2,
            cache=self.cache,
            logits_rows=torch.arange(1, 2 * R, 2, device=dev),
        )
        drafts, probs = [], []
        for i in range(self.num_tokens):
            if i > 0:
                position = last + i
                self.cache.begin_decode(R, num_slots, position, prompt_lens, prefix_span, suffix_span, live_rows=live)
                logits = forward_with_tasks(
                    self.model,
                    row_tasks,
                    drafts[-1],
                    prompt_lens + position,
                    torch.arange(R + 1, device=dev),
                    1,
                    cache=self.cache,
                )
            logprobs = processed_logprobs(_to_vocab(logits, vocab_size), sampling)
            drafts.append(draw_from(logprobs, None if greedy else noise[:, i], greedy))
            if not greedy:
                probs.append(logprobs.exp())
        return torch.stack(drafts, dim=1), (None if greedy else torch.stack(probs, dim=1))


class MTPDrafter:
    """Proposes `num_tokens` tokens per row with the first MTP layer of the target `model` (see the
    module docstring). The engine hands it the target's final hidden states: those of every prefill
    forward (`prefill_hidden`) and of every verification (`verified`)."""

    needs_target_hidden = True

    def __init__(self, model: nn.Module, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"speculative decoding needs num_tokens >= 1 draft tokens per round, got {num_tokens}")
        if len(getattr(model, "mtp", ())) == 0:
            raise ValueError(
                "speculative decoding with method=mtp needs the model's multi-token-prediction layers: a checkpoint "
                "that ships them (DeepSeek-V3, Qwen3.5), built with them (build_model(mtp=True))"
            )
        self.model = model
        self.layer = model.mtp[0]
        self.num_tokens = num_tokens
        self.cache: KVCache | None = None

    def begin(self, target_cache: KVCache) -> None:
        """A generation starts: a one-layer cache laid out like the target's, and per row the
        entries the next round computes first: the target's hidden states [k + 1, D] and the tokens
        after them [k + 1], from suffix position `pending_start`; the row's last token is entry
        `pending_last`."""
        c = target_cache
        k, dim, dev = self.num_tokens, self.model.embed_tokens.weight.shape[-1], c.device
        dtype = self.model.embed_tokens.weight.dtype
        self.cache = KVCache(1, c.num_slots, c.num_rows_total, c.group_size, c.max_prompt_len, c.max_new_tokens, dev)
        self.slot_hidden = torch.zeros(c.num_slots, dim, dtype=dtype, device=dev)
        self.pending_hidden = torch.zeros(c.num_rows_total, k + 1, dim, dtype=dtype, device=dev)
        self.pending_tokens = torch.zeros(c.num_rows_total, k + 1, dtype=torch.long, device=dev)
        self.pending_start = torch.zeros(c.num_rows_total, dtype=torch.long, device=dev)
        self.pending_last = torch.zeros(c.num_rows_total, dtype=torch.long, device=dev)

    def end(self) -> None:
        self.cache = None

    def _block(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens, max_seqlen):
        """The MTP layer over packed entries: hidden [T, D] (the target's, or the layer's own), the
        tokens after them [T], their positions [T] -> the layer's normed hidden states [T, D]."""
        model, layer = self.model, self.layer
        x = layer.combine(hidden, next_tokens, model.embed_tokens, positions)
        cos, sin = (None, None) if model.rotary is None else model.rotary(positions, x.dtype)
        return layer.norm(layer.block(x, cos, sin, cu_seqlens, max_seqlen, self.cache.layer(0), None))

    def prefill_hidden(
        self, pieces: list[tuple[int, int, int]], prompts: dict[int, list[int]], hidden: torch.Tensor
    ) -> None:
        """After a target prefill forward of `pieces` ((slot, start, end) slices of the slots'
        prompts, packed in order) with final hidden states `hidden` [T, D]: the MTP entries of those
        positions that have a next prompt token, and each ending prompt's last hidden state."""
        dev = self.cache.device
        entries, rows, next_tokens, offset = [], [], [], 0
        for slot, start, end in pieces:
            prompt = prompts[slot]
            stop = min(end, len(prompt) - 1)  # the last prompt position's next token is a sample's
            if stop > start:
                entries.append((slot, start, stop))
                rows.extend(range(offset, offset + stop - start))
                next_tokens.extend(prompt[start + 1 : stop + 1])
            if end == len(prompt):
                self.slot_hidden[slot] = hidden[offset + end - start - 1]
            offset += end - start
        if not entries:
            return
        lens = torch.tensor([stop - start for _, start, stop in entries])
        self.cache.begin_prefill(
            torch.tensor([s for s, _, _ in entries]), lens, torch.tensor([s for _, s, _ in entries])
        )
        positions = torch.cat([torch.arange(start, stop) for _, start, stop in entries]).to(dev)
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(dev)
        self._block(
            hidden[torch.tensor(rows, device=dev)],
            torch.tensor(next_tokens, device=dev),
            positions,
            cu_seqlens,
            int(lens.max()),
        )

    def prefill(self, prompts: dict[int, list[int]], adapters: dict[int, int], budget: int | None) -> None:
        """Nothing more: the entries come with the target's prefill forwards (`prefill_hidden`)."""

    def start_rows(self, rows: list[int], slots: list[int], places: list[int], first_tokens: torch.Tensor) -> None:
        """Rows start samples: their first entry pairs the prompt's last hidden state with the first token."""
        self.cache.start_rows(rows, slots, places)
        dev = self.cache.device
        rows_t, slots_t = torch.tensor(rows, device=dev), torch.tensor(slots, device=dev)
        self.pending_hidden[rows_t] = self.slot_hidden[slots_t][:, None]
        self.pending_tokens[rows_t] = first_tokens[:, None]
        self.pending_start[rows_t] = 0
        self.pending_last[rows_t] = 0

    def release_rows(self, rows: list[int], slots: list[int], places: list[int]) -> None:
        self.cache.release_rows(rows, slots, places)

    def verified(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        ngen_before: torch.Tensor,
        emitted: torch.Tensor,
        live: torch.Tensor,
    ) -> None:
        """After a verification of rows 0..R-1: hidden [R, k + 1, D] the target's final hidden states
        at the verified positions (the row's last token, then its drafts), tokens [R, k + 1] the tokens
        the round emitted (or would have, past `emitted` [R]), ngen_before [R] the rows' generated
        tokens before it. The next round recomputes the entries of suffix positions ngen_before ..
        ngen_before + k, whose hidden states the verification gave; the row's new last token is
        entry emitted - 1. Only the rows `live` [R] (generating before the round) change: a row
        that was done keeps its entries within the cache."""
        R = hidden.shape[0]
        self.pending_hidden[:R] = torch.where(
            live[:, None, None], hidden.to(self.pending_hidden.dtype), self.pending_hidden[:R]
        )
        self.pending_tokens[:R] = torch.where(live[:, None], tokens, self.pending_tokens[:R])
        self.pending_start[:R] = torch.where(live, ngen_before, self.pending_start[:R])
        self.pending_last[:R] = torch.where(live, (emitted - 1).clamp(min=0), self.pending_last[:R])

    def propose(
        self,
        tokens: torch.Tensor,
        ngen: torch.Tensor,
        prompt_lens: torch.Tensor,
        live: torch.Tensor,
        row_tasks: torch.Tensor | None,
        num_slots: int,
        prefix_span: int,
        suffix_span: int,
        sampling: SamplingParams,
        vocab_size: int,
        noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As DraftModelDrafter.propose. The layer's entries sit one position before the target's
        tokens: a prompt of L tokens has L - 1 prefix entries, and suffix position j pairs the
        target's hidden state at position L - 1 + j with generated token j."""
        k, R, dev = self.num_tokens, ngen.shape[0], ngen.device
        greedy = sampling.temperature == 0
        entry_lens = prompt_lens - 1
        prefix_span = max(prefix_span - 1, 0)
        positions = self.pending_start[:R, None] + torch.arange(k + 1, device=dev)  # [R, k + 1] suffix positions
        self.cache.begin_decode(R, num_slots, positions, entry_lens, prefix_span, suffix_span, live_rows=live)
        hidden = self._block(
            self.pending_hidden[:R].flatten(0, 1),
            self.pending_tokens[:R].flatten(),
            (entry_lens[:, None] + positions).flatten(),
            torch.arange(0, R * (k + 1) + 1, k + 1, device=dev),
            k + 1,
        ).view(R, k + 1, -1)
        hidden = hidden[torch.arange(R, device=dev), self.pending_last[:R]]  # [R, D] at each row's last token
        last = ngen - 1
        drafts, probs = [], []
        for i in range(k):
            if i > 0:
                position = last + i
                self.cache.begin_decode(R, num_slots, position, entry_lens, prefix_span, suffix_span, live_rows=live)
                hidden = self._block(hidden, drafts[-1], entry_lens + position, torch.arange(R + 1, device=dev), 1)
            logits = full_vocab_logits(hidden, self.model.output_weight)
            logprobs = processed_logprobs(_to_vocab(logits, vocab_size), sampling)
            drafts.append(draw_from(logprobs, None if greedy else noise[:, i], greedy))
            if not greedy:
                probs.append(logprobs.exp())
        return torch.stack(drafts, dim=1), (None if greedy else torch.stack(probs, dim=1))


def build_drafter(
    config: SpeculativeConfig, model: nn.Module, device
) -> DraftModelDrafter | MTPDrafter | DraftHeadDrafter | None:
    """The drafter `config` (rollout.speculative) asks for, for the policy `model`; None when off."""
    if config.method == "off":
        return None
    if config.method == "mtp":
        return MTPDrafter(model, config.num_tokens)
    if config.method == "draft_model":
        draft = build_model(config.draft_model_path, device=device, path_option="rollout.speculative.draft_model_path")
        return DraftModelDrafter(draft.model.eval().requires_grad_(False), config.num_tokens)
    if config.method == "draft_head":
        if config.draft_head_path is None:
            raise ValueError("rollout.speculative.method=draft_head needs rollout.speculative.draft_head_path")
        return DraftHeadDrafter(model, load_draft_head(config.draft_head_path, model), config.num_tokens)
    raise ValueError(f"rollout.speculative.method={config.method!r}: expected off, mtp, draft_model or draft_head")


def check_speculative_engine(model: nn.Module, sync_group, record_routing: bool) -> None:
    """Refuse speculative decoding where the engine cannot do it (a clear error at construction)."""
    if sync_group is not None:
        raise ValueError(
            "speculative decoding runs in one process: under FSDP/TP the ranks would run different numbers "
            "of forwards (a round's draft and verify forwards); turn rollout.speculative off or train on one process"
        )
    if record_routing:
        raise ValueError("speculative decoding does not record MoE routing (routing replay): turn one of them off")


def _to_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft model's logits [R, V'] on the target's vocabulary [R, vocab_size]: cut, or padded
    with -inf (tokens the draft model cannot propose)."""
    if logits.shape[-1] == vocab_size:
        return logits
    if logits.shape[-1] > vocab_size:
        return logits[:, :vocab_size]
    return torch.nn.functional.pad(logits, (0, vocab_size - logits.shape[-1]), value=float("-inf"))
