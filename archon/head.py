"""Log-probabilities (and entropy) of label tokens straight from hidden states, in chunks.

For N positions with hidden states h[N, D], unembedding W[V, D] and labels y[N], at temperature tau:

    z = h W^T / tau                          (never built whole: `chunk_size` rows at a time)
    logprob[n] = z[n, y[n]] - logsumexp(z[n])
    entropy[n] = logsumexp(z[n]) - sum_v softmax(z[n])_v z[n, v]

Neither pass holds more than a chunk of [chunk_size, V] fp32 logits (two such buffers at most).

Gradients: d logprob[n]/d z[n] = onehot(y[n]) - p[n] and d entropy[n]/d z[n] = -p[n] (log p[n] + H[n])
do not depend on the incoming gradient, which only scales each row. So when W is frozen (LoRA),
the forward pass also computes the two [N, D] directions

    u[n] = (onehot(y[n]) - p[n]) W,    e[n] = -(p[n] (log p[n] + H[n])) W

and the backward pass is just grad_h = (g_logprob * u + g_entropy * e) / tau, with no second pass
over the vocabulary. When W is trained (full fine-tuning) the backward pass recomputes each chunk's
logits to form grad_W as well.

Under tensor parallelism W is sharded on V (vocab-parallel): each rank works on its own vocabulary
slice; the max, the sum of exponentials, the label logit, the entropy sum and u, e (or grad_h) are
all-reduced over the tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from archon import packed_linear

DEFAULT_CHUNK_SIZE = 1024


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and narrower inputs; fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """[c, D] x [V_local, D] -> fp32 (fp64 for fp64 inputs) [c, V_local] scaled logits."""
    logits = F.linear(h, weight).to(_accumulation_dtype(h.dtype))
    if inv_temp != 1.0:
        logits.mul_(inv_temp)
    return logits


def _chunk_stats(logits, labels, vocab_start, group, with_entropy, keep_probs=False):
    """Per-row logsumexp, label logit and (optionally) entropy, reduced over the vocab shards.
    Allocates one more [c, V_local] buffer besides `logits`; with keep_probs it is returned as
    this shard's softmax probabilities p [c, V_local] (else None)."""
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
    packed = torch.stack(stats)
    _all_reduce(packed, dist.ReduceOp.SUM, group)
    sum_exp, label_logit = packed[0], packed[1]
    lse = row_max + torch.log(sum_exp)
    entropy = lse - packed[2] / sum_exp if with_entropy else None
    probs = exp.div_(sum_exp[:, None]) if keep_probs else None
    return lse, label_logit, entropy, probs


def _label_rows(labels, vocab_start, V_local):
    """(rows whose label is in this vocab shard, those labels as local indices)."""
    local = labels - vocab_start
    rows = torch.nonzero((local >= 0) & (local < V_local))[:, 0]
    return rows, local[rows]


class _ChunkedLabelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temp, chunk_size, vocab_start, group, with_entropy, directions):
        N = hidden.shape[0]
        f32 = dict(dtype=_accumulation_dtype(hidden.dtype), device=hidden.device)
        logprobs = torch.empty(N, **f32)
        lse_all = torch.empty(N, **f32)
        entropy = torch.empty(N, **f32) if with_entropy else None
        u = torch.empty(N, hidden.shape[1], **f32) if directions else None
        e = torch.empty(N, hidden.shape[1], **f32) if directions and with_entropy else None
        for start in range(0, N, chunk_size):
            end = min(start + chunk_size, N)
            logits = _chunk_logits(hidden[start:end], weight, inv_temp)
            lse, label_logit, ent, probs = _chunk_stats(
                logits, labels[start:end], vocab_start, group, with_entropy, keep_probs=directions
            )
            logprobs[start:end] = label_logit - lse
            lse_all[start:end] = lse
            if with_entropy:
                entropy[start:end] = ent
            if directions:
                rows, cols = _label_rows(labels[start:end], vocab_start, weight.shape[0])
                # u = (onehot - p) W ; e = -(p (log p + H)) W, with log p = z - lse (in place on z)
                u_chunk = -(probs.to(weight.dtype) @ weight).to(f32["dtype"])
                u_chunk[rows] += weight[cols].to(f32["dtype"])
                if with_entropy:
                    coef = logits.sub_(lse[:, None]).add_(ent[:, None]).mul_(probs)
                    e_chunk = -(coef.to(weight.dtype) @ weight).to(f32["dtype"])
                    packed = _all_reduce(torch.stack([u_chunk, e_chunk]), dist.ReduceOp.SUM, group)
                    u[start:end], e[start:end] = packed[0], packed[1]
                else:
                    u[start:end] = _all_reduce(u_chunk, dist.ReduceOp.SUM, group)
            del logits, probs
        if directions:
            ctx.save_for_backward(u, e if with_entropy else u)
        else:
            ctx.save_for_backward(hidden, weight, labels, lse_all, entropy if with_entropy else lse_all)
        ctx.config = (inv_temp, chunk_size, vocab_start, group, with_entropy, directions, hidden.dtype)
        if with_entropy:
            return logprobs, entropy
        return logprobs, torch.zeros(0, device=hidden.device)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        inv_temp, chunk_size, vocab_start, group, with_entropy, directions, hidden_dtype = ctx.config
        use_entropy = with_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        if directions:
            u, e = ctx.saved_tensors
            grad = torch.zeros_like(u) if grad_logprobs is None else u * grad_logprobs[:, None]
            if use_entropy:
                grad += e * grad_entropy[:, None]
            if inv_temp != 1.0:
                grad.mul_(inv_temp)
            return grad.to(hidden_dtype), None, None, None, None, None, None, None, None
        hidden, weight, labels, lse_all, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = _accumulation_dtype(hidden.dtype)
        grad_hidden = torch.zeros_like(hidden, dtype=acc) if need_h else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_w else None
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
            rows, cols = _label_rows(labels[start:end], vocab_start, V_local)
            grad_z[rows, cols] += g_lp[rows]
            if inv_temp != 1.0:
                grad_z.mul_(inv_temp)
            grad_z = grad_z.to(weight.dtype)
            if need_h:
                grad_hidden[start:end] = grad_z @ weight
            if need_w:
                grad_weight += grad_z.t().to(acc) @ h.to(acc)
            del grad_z
        if need_h:
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


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


def full_vocab_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [N, D] @ weight [V, D]^T -> logits [N, V] over the whole vocabulary, gathering the
    vocabulary shards when `weight` is sharded (tensor parallelism). No gradient flows through the
    gather: training scores labels with `label_logprobs` instead."""
    local_weight, _, group = vocab_shard(weight)
    logits = packed_linear.linear(hidden, local_weight)
    if group is None:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def label_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `labels` [N] under softmax(hidden[N, D] @ weight[V, D]^T / temperature), fp32 [N]
    (fp64 for an fp64 model),
    and the entropy of that distribution [N] (or None). `weight` may be a vocab-sharded DTensor."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    local_weight, vocab_start, group = vocab_shard(weight)
    grad_enabled = torch.is_grad_enabled()
    directions = grad_enabled and hidden.requires_grad and not local_weight.requires_grad
    logprobs, entropy = _ChunkedLabelLogprobs.apply(
        hidden, local_weight, labels, 1.0 / temperature, chunk_size, vocab_start, group, with_entropy, directions
    )
    return logprobs, (entropy if with_entropy else None)


def model_label_logprobs(
    model,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    rows: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    context_parallel=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The path training scores labels by: the model's final hidden states ([T, D], packed input as
    in the model's forward), then the chunked head on the positions `rows` [N] with `labels` [N].
    Returns (log-probs [N], entropies [N] or None). Whatever a family puts between its last norm
    and the unembedding must therefore be inside `return_hidden=True`'s output or the output weight,
    not only in its logits.

    With context parallelism each rank scores its own slice of the rows, `chunk_size` / cp at a time,
    so the group holds `chunk_size` rows of logits at once, as one process does."""
    if context_parallel is not None:
        chunk_size = max(chunk_size // context_parallel.size, 1)
    hidden = model(tokens, positions, cu_seqlens, max_seqlen, return_hidden=True, context_parallel=context_parallel)
    return label_logprobs(hidden[rows], model.output_weight, labels, temperature, chunk_size, with_entropy)
