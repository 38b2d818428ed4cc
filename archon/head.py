"""Log-probabilities (and entropy) of label tokens straight from hidden states, in chunks.

For N positions with hidden states h[N, D], unembedding W[V, D] and labels y[N], at temperature tau:

    z = h W^T / tau                          (never built whole: `chunk_size` rows at a time)
    logprob[n] = z[n, y[n]] - logsumexp(z[n])
    entropy[n] = logsumexp(z[n]) - sum_v softmax(z[n])_v z[n, v]

The backward pass recomputes each chunk's logits, so neither pass holds more than one chunk of
[chunk_size, V] fp32 logits. Under tensor parallelism W is sharded on V (vocab-parallel): each rank
works on its own vocabulary slice and the max, the sum of exponentials, the label logit and the
entropy sum are all-reduced over the tensor-parallel group; the gradient with respect to h is
all-reduced too, since h is replicated there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 1024


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """[c, D] x [V_local, D] -> fp32 [c, V_local] scaled logits."""
    logits = F.linear(h, weight).float()
    if inv_temp != 1.0:
        logits.mul_(inv_temp)
    return logits


def _chunk_stats(logits, labels, vocab_start, group, with_entropy):
    """Per-row logsumexp, label logit and (optionally) entropy, reduced over the vocab shards.
    Allocates one more [c, V_local] buffer besides `logits`."""
    row_max = logits.max(dim=-1).values
    _all_reduce(row_max, dist.ReduceOp.MAX, group)
    exp = torch.sub(logits, row_max[:, None]).exp_()
    sum_exp = exp.sum(dim=-1)
    local_labels = labels - vocab_start
    in_shard = (local_labels >= 0) & (local_labels < logits.shape[-1])
    label_logit = logits.gather(-1, local_labels.clamp(0, logits.shape[-1] - 1)[:, None])[:, 0]
    label_logit = torch.where(in_shard, label_logit, torch.zeros_like(label_logit))
    stats = [sum_exp, label_logit]
    if with_entropy:
        stats.append(torch.einsum("cv,cv->c", exp, logits))  # sum_v exp_v z_v, no [c, V] temporary
    del exp
    packed = torch.stack(stats)
    _all_reduce(packed, dist.ReduceOp.SUM, group)
    sum_exp, label_logit = packed[0], packed[1]
    lse = row_max + torch.log(sum_exp)
    entropy = lse - packed[2] / sum_exp if with_entropy else None
    return lse, label_logit, entropy


class _ChunkedLabelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temp, chunk_size, vocab_start, group, with_entropy):
        N = hidden.shape[0]
        logprobs = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(N, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(N, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for start in range(0, N, chunk_size):
            end = min(start + chunk_size, N)
            logits = _chunk_logits(hidden[start:end], weight, inv_temp)
            lse, label_logit, ent = _chunk_stats(logits, labels[start:end], vocab_start, group, with_entropy)
            logprobs[start:end] = label_logit - lse
            lse_all[start:end] = lse
            if with_entropy:
                entropy[start:end] = ent
            del logits
        ctx.save_for_backward(hidden, weight, labels, lse_all, entropy if with_entropy else lse_all)
        ctx.config = (inv_temp, chunk_size, vocab_start, group, with_entropy)
        if with_entropy:
            return logprobs, entropy
        return logprobs, torch.zeros(0, device=hidden.device)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, lse_all, entropy = ctx.saved_tensors
        inv_temp, chunk_size, vocab_start, group, with_entropy = ctx.config
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if need_h else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        use_entropy = with_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        V_local = weight.shape[0]
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            g_lp = grad_logprobs[start:end] if grad_logprobs is not None else torch.zeros(end - start, device=h.device)
            # With log p_v = z_v - lse:  d logprob/d z_v = 1[v = y] - p_v,
            # d entropy/d z_v = -p_v (log p_v + H). Two [c, V_local] buffers in all.
            log_p = _chunk_logits(h, weight, inv_temp).sub_(lse_all[start:end, None])
            grad_z = log_p.exp()
            if use_entropy:
                coef = log_p.add_(entropy[start:end, None]).mul_(grad_entropy[start:end, None])
                grad_z.mul_(coef.add_(g_lp[:, None])).neg_()
            else:
                grad_z.mul_(-g_lp[:, None])
            del log_p
            local_labels = labels[start:end] - vocab_start
            rows = torch.nonzero((local_labels >= 0) & (local_labels < V_local))[:, 0]
            grad_z[rows, local_labels[rows]] += g_lp[rows]
            if inv_temp != 1.0:
                grad_z.mul_(inv_temp)
            grad_z = grad_z.to(weight.dtype)
            if need_h:
                grad_hidden[start:end] = grad_z @ weight
            if need_w:
                grad_weight += grad_z.t().float() @ h.float()
            del grad_z
        if need_h:
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int, object]:
    """(this rank's rows of the unembedding, the global id of its first row, the process group over
    which the vocabulary is sharded or None)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(weight, DTensor):
        return weight, 0, None
    vocab_dims = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0]
    others = [p for i, p in enumerate(weight.placements) if i not in vocab_dims and not p.is_replicate()]
    if len(vocab_dims) != 1 or others:
        raise ValueError(
            f"the unembedding must be sharded on the vocabulary over one mesh dimension (or replicated); "
            f"got placements {weight.placements}"
        )
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return weight.to_local(), offset[0], weight.device_mesh.get_group(vocab_dims[0])


def label_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `labels` [N] under softmax(hidden[N, D] @ weight[V, D]^T / temperature), fp32 [N],
    and the entropy of that distribution [N] (or None). `weight` may be a vocab-sharded DTensor."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    local_weight, vocab_start, group = vocab_shard(weight)
    logprobs, entropy = _ChunkedLabelLogprobs.apply(
        hidden, local_weight, labels, 1.0 / temperature, chunk_size, vocab_start, group, with_entropy
    )
    return logprobs, (entropy if with_entropy else None)
