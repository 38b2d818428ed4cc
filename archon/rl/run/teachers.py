"""On-policy distillation: the frozen teachers, their log-probs of a batch's tokens, and the token
advantages distillation trains on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from archon.batch import PackedBatch
from archon.build import build_model, load_hf_config
from archon.checkpoint.hf import TOKENIZER_VOCAB_FILES, load_tokenizer
from archon.head import label_logprobs
from archon.spec import get_spec


def load_teacher(path: str, option: str, policy, policy_tokenizer, device) -> torch.nn.Module:
    """The frozen teacher model at `path` (`option` names the setting). Distillation compares the
    teacher's and the policy's (`policy`, a LoadedModel) log-probs of the same token ids, so the
    teacher must have the policy's vocabulary size and, when its directory holds a tokenizer, give
    every token the two tokenizers share the same id; both are checked before the weights are read."""
    hf_config = load_hf_config(path, option)
    vocab_size = get_spec(hf_config.model_type).args_cls.from_hf_config(hf_config).vocab_size
    if vocab_size != policy.args.vocab_size:
        raise ValueError(
            f"{option}={path!r}: the teacher's vocabulary has {vocab_size} tokens (vocab_size in "
            f"{Path(path) / 'config.json'}) and the policy's {policy.args.vocab_size} (in "
            f"{policy.path / 'config.json'}); distillation compares log-probs of the same token ids, so they must "
            "share a vocabulary"
        )
    if any((Path(path) / name).exists() for name in TOKENIZER_VOCAB_FILES):
        teacher_ids = load_tokenizer(path, option).get_vocab()
        policy_ids = policy_tokenizer.get_vocab()
        differing = sorted(t for t in teacher_ids.keys() & policy_ids.keys() if teacher_ids[t] != policy_ids[t])
        if differing:
            token = differing[0]
            raise ValueError(
                f"{option}={path!r}: the teacher's tokenizer gives {len(differing)} of the tokens it shares with "
                f"the policy's another id (e.g. {token!r}: {teacher_ids[token]} for the teacher, "
                f"{policy_ids[token]} for the policy); distillation compares log-probs of the same token ids, "
                "so they must share a tokenizer"
            )
    teacher = build_model(path, device=device, path_option=option)
    return teacher.model.eval().requires_grad_(False)


def teacher_logprobs(teacher: torch.nn.Module, batch: PackedBatch, device, temperature: float) -> torch.Tensor:
    """The teacher's log-probs of the batch's labels, [T] on the host, zero outside the loss mask."""
    with torch.no_grad():
        b = batch.to(device)
        hidden = teacher(b.tokens, b.positions, b.cu_seqlens, b.max_seqlen, return_hidden=True)
        lp, _ = label_logprobs(hidden, teacher.output_weight, b.labels, temperature)
    return lp.float().cpu() * batch.loss_mask


def distill_from_teachers(
    batch: PackedBatch,
    sequences: list[int],
    teachers: list[torch.nn.Module],
    sources: list[str],
    algorithm,
    device,
    temperature: float,
) -> dict[str, tuple[float, float]]:
    """On-policy distillation of the sequences `sequences` of `batch`, sequence sequences[k] from the
    teacher teachers[k] (its prompt's data source's, sources[k]): writes their token advantages
    (`algorithm.token_advantages` of the teacher's log-probs and batch.old_logprobs) into
    batch.advantages, with one teacher forward over all the sequences of each distinct teacher
    (sources sharing a teacher share its forward). Returns, by source, the sum over its loss tokens
    of the log-prob gap log pi_student - log pi_teacher and the number of those tokens.

    The teachers are whole, unsharded models on every rank (no collectives in their forward), so a
    rank runs the forwards of the teachers its own samples need, whatever the other ranks run."""
    by_teacher: dict[int, list[int]] = {}
    for k, teacher in enumerate(teachers):
        by_teacher.setdefault(id(teacher), []).append(k)
    bounds = batch.cu_seqlens.tolist()
    gaps: dict[str, tuple[float, float]] = {}
    for ks in by_teacher.values():
        chosen = [sequences[k] for k in ks]
        sub = batch.select(chosen)
        teacher_lp = teacher_logprobs(teachers[ks[0]], sub, device, temperature)
        tokens = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in chosen])
        batch.advantages[tokens] = algorithm.token_advantages(
            sub.advantages, sub.old_logprobs, teacher_lp, sub.loss_mask
        )
        gap = (sub.old_logprobs.double() - teacher_lp.double()) * sub.loss_mask
        sub_bounds = sub.cu_seqlens.tolist()
        for j, k in enumerate(ks):
            span = slice(sub_bounds[j], sub_bounds[j + 1])
            total, count = gaps.get(sources[k], (0.0, 0.0))
            gaps[sources[k]] = (total + float(gap[span].sum()), count + float(sub.loss_mask[span].sum()))
    return gaps
