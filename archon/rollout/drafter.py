"""A draft head: a drafter for speculative decoding (archon/rollout/speculative.py) made of one small
MLP on the target's own final hidden states, without attention and without a cache of its own.

Like a multi-token-prediction layer, the head pairs the target's final (normed) hidden state at
position t with the token at t + 1 and predicts the token at t + 2, reading the token through the
target's embedding and scoring through the target's output head (both shared, not copied):

    g = h + W2 silu(W1 [norm(embed(x)), norm(h)])        logits = output_weight @ norm(g)

A draft of k tokens chains the head on its own output g and its own draft token. With no attention,
a draft step is a dozen ops (two matmuls, [R, 2D] x [2D, H] and [R, H] x [H, D], the norms and the
head's logits), whatever the context length, against the hundreds of a target forward with its
cache. The demo's (D 128, H 512) is 0.21 M multiply-adds a token, the demo base 0.80 M plus its
attention: where ops, not FLOPs, set the time (small batches on a CPU), k = 3 draft steps cost a
fraction of a target step. The head learns from the
target alone (`distill_draft_head`: the target's distributions at its own outputs, soft targets).

The head's weights are a small safetensors file (`save_draft_head` / `load_draft_head`) tied to the
target it was distilled for: it has no embedding or output head of its own.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from archon.checkpoint.atomic import atomic_file
from archon.head import full_vocab_logits
from archon.rollout.base import SamplingParams
from archon.rollout.kv_cache import KVCache
from archon.rollout.sampling import draw_from, processed_logprobs


class DraftHead(nn.Module):
    """(hidden [N, D] the target's final normed hidden states at t, or the head's own output;
    tokens [N] at t + 1; the target's embedding) -> the head's output g [N, D] (see the module
    docstring); `logits(g, output_weight)` scores the token at t + 2."""

    def __init__(self, dim: int, hidden_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.embedding_norm = nn.RMSNorm(dim, eps=eps)
        self.hidden_norm = nn.RMSNorm(dim, eps=eps)
        self.in_proj = nn.Linear(2 * dim, hidden_dim, bias=False)
        self.out_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.output_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        joined = torch.cat([self.embedding_norm(embed(tokens)), self.hidden_norm(hidden)], dim=-1)
        return hidden + self.out_proj(F.silu(self.in_proj(joined)))

    def logits(self, out: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
        return full_vocab_logits(self.output_norm(out), output_weight)


def save_draft_head(head: DraftHead, path: str | Path, settings: dict) -> None:
    """Write the head's weights (float32) and `settings` (what made it: JSON metadata) to `path`, atomically."""
    from safetensors.torch import save

    tensors = {name: t.detach().float().contiguous() for name, t in head.state_dict().items()}
    metadata = {"dim": str(head.in_proj.in_features // 2), "hidden_dim": str(head.in_proj.out_features)}
    metadata["settings"] = json.dumps(settings, sort_keys=True)
    with atomic_file(path) as f:
        f.write(save(tensors, metadata=metadata))


def load_draft_head(path: str | Path, model: nn.Module) -> DraftHead:
    """The draft head in `path` for the target `model` (its dtype and device); a clear error when the
    file does not fit the model."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"draft head {path}: no such file (rollout.speculative.draft_head_path)")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if "dim" not in metadata or "hidden_dim" not in metadata:
        raise ValueError(f"draft head {path}: its metadata lacks dim / hidden_dim (not written by save_draft_head)")
    dim, hidden_dim = int(metadata["dim"]), int(metadata["hidden_dim"])
    model_dim = model.embed_tokens.weight.shape[-1]
    if dim != model_dim:
        raise ValueError(f"draft head {path} was made for hidden size {dim}, the model has {model_dim}")
    head = DraftHead(dim, hidden_dim)
    expected = head.state_dict()
    if set(tensors) != set(expected):
        raise ValueError(f"draft head {path}: tensors {sorted(tensors)}, expected {sorted(expected)}")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise ValueError(
                f"draft head {path}: {name} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
            )
    head.load_state_dict(tensors)
    weight = model.embed_tokens.weight
    return head.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)


class DraftHeadDrafter:
    """Proposes `num_tokens` tokens per row with a DraftHead on the target `model`'s hidden states.
    Per row it keeps the target's hidden state before the row's last token and that token; the
    engine hands it the target's prefill hidden states (`prefill_hidden`) and those of every
    verification (`verified`), as to MTPDrafter."""

    needs_target_hidden = True

    def __init__(self, model: nn.Module, head: DraftHead, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"speculative decoding needs num_tokens >= 1 draft tokens per round, got {num_tokens}")
        self.model = model
        self.head = head
        self.num_tokens = num_tokens
        self.cache = None
        self.position_counts = torch.zeros(2, num_tokens, dtype=torch.long)
        """Over every round so far, per draft position i: [rows that reached it (drafts 1..i-1
        accepted, and the tokens before it not cut by a stop token or the length limit), rows of
        those whose draft i was accepted]."""
        self._drafts: torch.Tensor | None = None

    def acceptance_by_position(self) -> list[float | None]:
        """Per draft position: the share of the rows that reached it whose draft was accepted (None
        where none reached it)."""
        reached, passed = self.position_counts.tolist()
        return [p / r if r else None for r, p in zip(reached, passed)]

    def begin(self, target_cache: KVCache) -> None:
        """A generation starts: per slot the hidden state at its prompt's last token; per row the
        hidden state before its last token (`row_hidden`) and that token (`row_token`)."""
        c = target_cache
        weight = self.model.embed_tokens.weight
        dim = weight.shape[-1]
        self.slot_hidden = torch.zeros(c.num_slots, dim, dtype=weight.dtype, device=c.device)
        self.row_hidden = torch.zeros(c.num_rows_total, dim, dtype=weight.dtype, device=c.device)
        self.row_token = torch.zeros(c.num_rows_total, dtype=torch.long, device=c.device)

    def end(self) -> None:
        self.slot_hidden = self.row_hidden = self.row_token = None

    def prefill(self, prompts: dict[int, list[int]], adapters: dict[int, int], budget: int | None) -> None:
        """Nothing: the head reads the target's prefill (`prefill_hidden`)."""

    def prefill_hidden(
        self, pieces: list[tuple[int, int, int]], prompts: dict[int, list[int]], hidden: torch.Tensor
    ) -> None:
        """After a target prefill forward of `pieces` ((slot, start, end), packed) with final hidden
        states `hidden` [T, D]: each ending prompt's hidden state at its last token."""
        offset = 0
        for slot, start, end in pieces:
            if end == len(prompts[slot]):
                self.slot_hidden[slot] = hidden[offset + end - start - 1]
            offset += end - start

    def start_rows(self, rows: list[int], slots: list[int], places: list[int], first_tokens: torch.Tensor) -> None:
        dev = self.row_token.device
        rows_t = torch.tensor(rows, device=dev)
        self.row_hidden[rows_t] = self.slot_hidden[torch.tensor(slots, device=dev)]
        self.row_token[rows_t] = first_tokens

    def release_rows(self, rows: list[int], slots: list[int], places: list[int]) -> None:
        """Nothing: a row's state is overwritten when it starts again."""

    def verified(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        ngen_before: torch.Tensor,
        emitted: torch.Tensor,
        live: torch.Tensor,
    ) -> None:
        """After a verification (as MTPDrafter.verified): the hidden state at the fed position before
        each live row's new last token, tokens[r, emitted - 1], and that token."""
        R = hidden.shape[0]
        rows = torch.arange(R, device=hidden.device)
        last = (emitted - 1).clamp(min=0)
        new_hidden = hidden[rows, last].to(self.row_hidden.dtype)
        self.row_hidden[:R] = torch.where(live[:, None], new_hidden, self.row_hidden[:R])
        self.row_token[:R] = torch.where(live, tokens[rows, last], self.row_token[:R])
        # a rejected draft differs from the token emitted in its place (greedy: the argmax; sampled:
        # the correction has no mass on a token the target rejected)
        accepted = (self._drafts[:R] == tokens[:, : self.num_tokens]).long().cumprod(dim=1).sum(dim=1)
        position = torch.arange(1, self.num_tokens + 1, device=tokens.device)[None, :]
        reached = (accepted[:, None] >= position - 1) & (emitted[:, None] >= position) & live[:, None]
        passed = reached & (accepted[:, None] >= position)
        counts = torch.stack([reached.sum(dim=0), passed.sum(dim=0)])
        if self.position_counts.device != counts.device:  # kept where the rows are: no sync per round
            self.position_counts = self.position_counts.to(counts.device)
        self.position_counts += counts

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
        """As DraftModelDrafter.propose (archon/rollout/speculative.py): drafts [R, k] and, sampled,
        their processed distributions [R, k, V]. The head does not depend on the task (row_tasks)."""
        R = ngen.shape[0]
        greedy = sampling.temperature == 0
        hidden, token = self.row_hidden[:R], self.row_token[:R]
        drafts, probs = [], []
        for i in range(self.num_tokens):
            hidden = self.head(hidden, token, self.model.embed_tokens)
            logits = self.head.logits(hidden, self.model.output_weight)[:, :vocab_size]
            if greedy:  # the argmax of the logits is that of their log_softmax
                token = logits.argmax(dim=-1)
            else:
                logprobs = processed_logprobs(logits, sampling)
                token = draw_from(logprobs, noise[:, i], greedy)
                probs.append(logprobs.exp())
            drafts.append(token)
        self._drafts = torch.stack(drafts, dim=1)
        return self._drafts, (None if greedy else torch.stack(probs, dim=1))


def distill_draft_head(
    model: nn.Module,
    sequences: list[tuple[list[int], int]],
    head: DraftHead,
    depth: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    tv_steps: int = 0,
    tv_lr: float = 0.0,
    log=print,
) -> float:
    """Fit `head` to `model`'s own distributions: `sequences` are (token ids, prompt length) pairs,
    the target's outputs after their prompts. At each completion position t - 1 (from the prompt's
    last token) and each draft depth i < `depth`, the head chained i + 1 times from the target's
    hidden state at t - 1 over the tokens t .. t + i (teacher forcing: the target's own tokens, as
    accepted drafts are) is scored against the target's distribution at t + i (soft targets).

    Two phases of Adam on `batch_size` entries a step: `steps` steps at `lr` of the KL divergence
    KL(p || q), then `tv_steps` steps of the total variation distance TV(p, q) = 1 - sum_x min(p(x),
    q(x)), the lr decaying from `tv_lr` to 0 (cosine). A sampled draft drawn from q is accepted with
    probability sum_x min(p(x), q(x)), so the second phase minimises exactly what a rejection costs;
    the KL phase gets there from a random start (the TV's gradient vanishes where q has no mass on
    p's tokens). Returns the last step's loss."""
    data = _distillation_data(model, sequences)
    head.train()
    loss = _fit(head, model, data, "KL", depth, steps, batch_size, lr, seed, log, decay=False)
    if tv_steps > 0:
        loss = _fit(head, model, data, "TV", depth, tv_steps, batch_size, tv_lr, seed + 1, log, decay=True)
    head.eval()
    return loss


def _fit(head, model, data, objective: str, depth, steps, batch_size, lr, seed, log, decay: bool) -> float:
    """`steps` Adam steps of `objective` (KL or TV, see distill_draft_head) over `data`
    (_distillation_data's); with `decay` the lr follows a cosine from `lr` to 0."""
    hidden, target_logprobs, tokens, entries, room = data
    rng = random.Random(seed)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    order = list(range(len(entries)))
    loss = torch.zeros(())
    for step in range(steps):
        if decay:
            optimizer.param_groups[0]["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        chosen = torch.tensor(rng.sample(order, min(batch_size, len(order))))
        start, depths = entries[chosen], room[chosen].clamp(max=depth)  # [B] positions t - 1, depths to score
        optimizer.zero_grad()
        out, loss = hidden[start], torch.zeros(())
        for i in range(depth):
            scored = depths > i  # the entries whose sequence has a token at t + 1 + i
            if not scored.any():
                break
            out, start, depths = out[scored], start[scored], depths[scored]
            out = head(out, tokens[start + 1 + i], model.embed_tokens)
            logprobs = F.log_softmax(head.logits(out, model.output_weight).float(), dim=-1)
            target = target_logprobs[start + 1 + i]
            if objective == "KL":
                divergence = F.kl_div(logprobs, target, log_target=True, reduction="batchmean")
            else:
                divergence = 0.5 * (target.exp() - logprobs.exp()).abs().sum(dim=-1).mean()
            loss = loss + divergence / depth
        loss.backward()
        optimizer.step()
        if (step + 1) % max(steps // 5, 1) == 0 or step + 1 == steps:
            log(f"draft head step {step + 1}/{steps}: {objective} {float(loss.detach()):.4f}")
    return float(loss.detach())


def _distillation_data(model: nn.Module, sequences: list[tuple[list[int], int]]):
    """The target's final hidden states [T, D] and log-probs [T, V] over the packed sequences (row
    j scores token j + 1), the packed tokens [T], the packed indices of the entries [E] (each
    sequence's positions from its prompt's last token to the one before its last token) and each
    entry's room [E] (the tokens after t = entry + 1 in its sequence: the depths it can score)."""
    lens = torch.tensor([len(s) for s, _ in sequences])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    tokens = torch.tensor([t for s, _ in sequences for t in s])
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])
    with torch.no_grad():
        model.eval()
        hidden = model(tokens, positions, cu_seqlens, int(lens.max()), return_hidden=True)
        logprobs = F.log_softmax(full_vocab_logits(hidden, model.output_weight).float(), dim=-1)
    entries, room = [], []
    for j, (_, prompt_len) in enumerate(sequences):
        start, end = int(cu_seqlens[j]), int(cu_seqlens[j + 1])  # end: one past the sequence's last token
        first = start + max(prompt_len, 1) - 1
        entries.append(torch.arange(first, end - 1))
        room.append(end - 2 - entries[-1])
    return hidden, logprobs, tokens, torch.cat(entries), torch.cat(room)
