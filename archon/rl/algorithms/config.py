"""The algorithm section of the config (`algorithm`, and each task's `tasks[i].algorithm`): its
dataclasses, the settings they resolve to, and the rules that check them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from archon.rl.algorithms.losses import Aggregation, ImportanceSampling, KLEstimator
from archon.rl.algorithms.registry import ALGORITHMS, AlgorithmName, unknown_algorithm
from archon.rl.problems import Problems


@dataclass
class LossConfig:
    """The settings of an algorithm's loss (the `algorithm.loss` section of the recipe config; the
    algorithm itself is `algorithm.name`). Every default leaves the algorithm as its paper defines it."""

    clip_low: float | None = None
    """Lower clip: the ratio (or CISPO weight) is kept >= 1 - clip_low. None: the algorithm's default."""
    clip_high: float | None = None
    """Upper clip: the ratio (or CISPO weight) is kept <= 1 + clip_high. None: the algorithm's default."""
    clip_ratio_c: float | None = None
    """Dual-clip PPO: for tokens with a negative advantage the loss is at most -A * clip_ratio_c, so a
    ratio far above 1 cannot blow the loss up (3.0 is the usual choice). Must be > 1; None disables
    it. Only for the PPO clipped objective (not gspo or cispo)."""
    aggregation: Aggregation | None = None
    """token_mean, seq_mean_token_mean or seq_mean_token_sum_norm. None: the algorithm's default."""
    max_response_length: int | None = None
    """Constant length divisor for seq_mean_token_sum_norm (Dr.GRPO). None: the generation limit,
    rollout.max_new_tokens."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against the reference policy (the model with its adapter off); 0 disables it."""
    kl_estimator: KLEstimator = "k3"
    kl_cap: float | None = None
    """Clamp each token's k3 KL value to at most this (needs kl_estimator k3 and kl_coef > 0); None: no cap."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef * the mean entropy of the response tokens,
    aggregated like the policy loss; 0 disables it."""
    importance_sampling: ImportanceSampling | None = None
    """Off-policy correction (the decoupled PPO objective): the PPO ratio is taken against pi_old,
    the trainer's score of the batch before the update, and each token's loss is multiplied by the
    truncated weight pi_old / mu for the behaviour policy mu that sampled it. token: a weight per
    token; sequence: one weight per response, exp(sum of its tokens' log-ratios). none: no weight.
    Default: token in the asynchronous mode (rollout.max_staleness >= 1), where mu is an older
    adapter, or with icepop_band; none otherwise. Needs algorithm.recompute_old_logprobs."""
    importance_cap: float = 2.0
    """Truncation C of the importance weights: w = min(ratio, C). Must be > 0. Not used with
    icepop_band, whose band replaces the truncation."""
    icepop_band: tuple[float, float] | None = None
    """IcePop, e.g. (0.5, 5.0): each token's loss is weighted by its ratio pi_old / mu when the ratio
    is inside [low, high], and the token is left out of the policy loss (weight 0, the metric
    icepop_masked_fraction counts it) when it is outside. It is token-level importance sampling
    with the band in place of the truncation, so importance_sampling must be token or unset (not
    sequence or none). Needs 0 < low <= 1 <= high and algorithm.recompute_old_logprobs. None
    disables it."""
    advantage_whitening: Literal["token", "response"] = "token"
    """reinforce_pp and reinforce_pp_baseline: what the batch mean and standard deviation of the
    advantages are taken over. token: every loss token, so each response counts once per token it
    has (the REINFORCE++ definition, as in verl); response: each response once."""

    def __post_init__(self) -> None:
        if self.max_response_length is not None and self.max_response_length <= 0:
            raise ValueError(f"LossConfig.max_response_length must be positive, got {self.max_response_length}")


@dataclass
class TeacherConfig:
    """A teacher of multi-teacher on-policy distillation: the samples of the prompts whose row's
    `data_source` is `data_source` are distilled from the model at `path`."""

    data_source: str = ""
    """The rows' `data_source` value (the dataset they came from) that this teacher serves."""
    path: str = ""
    """HF checkpoint directory, loaded read-only; it must share the student's tokenizer. Sources
    (and tasks) naming the same path share one copy."""


@dataclass
class AlgorithmConfig:
    name: AlgorithmName = "grpo"
    """The algorithm (archon.rl.algorithms): grpo, drgrpo, dapo, gspo, cispo, rloo, reinforce_pp or
    reinforce_pp_baseline. Formerly algorithm.loss.algorithm, which still works in files and on the
    command line until the next release."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The algorithm's loss: clip range, dual clip, aggregation, KL penalty, entropy bonus, importance
    sampling, IcePop."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty over the last N tokens before max_new_tokens; 0 disables it."""
    overlong_penalty_factor: float = 1.0
    ppo_epochs: int = 1
    minibatches: int = 1
    """Optimizer steps per PPO epoch (the step's samples split by prompt group)."""
    recompute_old_logprobs: bool = True
    """Score the rollout with the trainer before the update (pi_old); otherwise use the rollout log-probs,
    which is allowed only without truncation (rollout.top_p = 1, top_k = 0): the rollout log-probs are
    those of the truncated distribution that sampled, not of the policy the loss scores."""
    teacher_path: str | None = None
    """On-policy distillation: an HF checkpoint loaded read-only; the per-token advantage becomes
    -(log pi_theta - log pi_teacher) on the student's own samples and rewards are only logged
    (unless distillation_weight is set). With `teachers`: the teacher of the data sources they do
    not list."""
    teachers: tuple[TeacherConfig, ...] = ()
    """Multi-teacher on-policy distillation: a teacher per data source (the rows' `data_source`),
    e.g. [{data_source: gsm8k, path: /models/math}, {data_source: code, path: /models/coder}];
    each sample is distilled from its prompt's source's teacher, as with teacher_path. A source
    not listed takes teacher_path, and without it is an error at start."""
    distillation_weight: float | None = None
    """On-policy distillation mixed with task rewards: the per-token advantage becomes the reward
    advantage plus distillation_weight * (log pi_teacher - log pi_theta), one advantage per token
    clipped as one surrogate (archon.rl.algorithms.advantages.mixed_distillation_advantages). Needs
    teacher_path or teachers; must be > 0. None: the teacher's advantage alone."""
    routing_replay: Literal["off", "rollout"] = "off"
    """MoE models: "rollout" makes the trainer route every token of a sample to the experts the
    built-in rollout engine routed it to (recorded at generation), in the scoring of pi_old and the
    reference and in the training forward; the gate weights are still the router's, taken at those
    experts. "off": the trainer's routers choose their own top-k. See docs/rollouts.md."""
    mtp_loss_weight: float = 0.0
    """> 0: train the model's MTP layer beside the policy (model.mtp loads it) with this weight on an
    auxiliary cross-entropy: at each completion position the MTP layer predicts the sampled token after
    next from the policy's hidden state and the next sampled token, masked as the policy loss; logged
    as mtp_loss and mtp_accuracy (its top-1 agreement with the sampled token, which draft acceptance
    tracks). The MTP blocks carry the run's LoRA (their PEFT names are the checkpoint's `mtp` modules);
    the policy's own weights get no gradient from it. 0: off. See docs/mtp.md."""
    max_skipped_steps: int = 3
    """An update whose loss or gradient norm is NaN or inf is skipped (adapter and optimizer state
    left as they were, the LR schedule still follows the RL step; counted in the metric
    skipped_steps). This many RL steps in a row with a skipped update stop the run with an error."""

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(unknown_algorithm(self.name))


def importance_sampling_for(loss: LossConfig, max_staleness: int) -> ImportanceSampling:
    """loss.importance_sampling, or its default: token when samples may come from an older adapter
    or with IcePop (a token-level weight)."""
    if loss.importance_sampling is not None:
        return loss.importance_sampling
    return "token" if max_staleness > 0 or loss.icepop_band is not None else "none"


def distills(config: AlgorithmConfig) -> bool:
    """On-policy distillation: a teacher (algorithm.teacher_path) or teachers per data source
    (algorithm.teachers) give the token advantages, at least in part."""
    return config.teacher_path is not None or bool(config.teachers)


def teacher_setting(config: AlgorithmConfig, data_source: str, where: str = "algorithm") -> tuple[str, str] | None:
    """(path, the setting that names it) of the teacher of the samples of rows with `data_source`:
    the entry of config.teachers for it, else the default teacher config.teacher_path; None when
    neither is set. `where` is the algorithm section's place (algorithm, or tasks[i].algorithm)."""
    for i, teacher in enumerate(config.teachers):
        if teacher.data_source == data_source:
            return teacher.path, f"{where}.teachers[{i}].path"
    if config.teacher_path is not None:
        return config.teacher_path, f"{where}.teacher_path"
    return None


def uses_reward_advantages(config: AlgorithmConfig) -> bool:
    """The token advantages include the rewards' advantages: always but with teachers alone
    (algorithm.teacher_path or algorithm.teachers set and algorithm.distillation_weight not)."""
    return not distills(config) or config.distillation_weight is not None


def group_size_problem(name: str, group_size: int) -> str | None:
    """Why algorithm `name` cannot learn from groups of `group_size` samples per prompt, or None.

    A group of one sample has no other sample to compare with: the group-normalised algorithms
    (grpo, drgrpo, dapo, gspo, cispo) would give every sample advantage 0 and rloo has no
    leave-one-out baseline, so these need groups of 2 or more. reinforce_pp whitens the rewards over
    the batch and reinforce_pp_baseline, with no group mean to subtract, does the same."""
    reason = ALGORITHMS[name].group_of_one
    if group_size != 1 or reason is None:
        return None
    single = ", ".join(n for n, spec in ALGORITHMS.items() if spec.group_of_one is None)
    return f"algorithm {name!r} {reason}; use groups of 2 or more, or an algorithm that learns from one ({single})"


def icepop_problem(loss: LossConfig, where: str = "algorithm") -> str | None:
    """Why loss.icepop_band cannot go with loss.importance_sampling, or None: IcePop weights each
    token by its own ratio, a token-level weight that a sequence-level weight would multiply twice
    and that 'none' would contradict."""
    if loss.icepop_band is None or loss.importance_sampling in (None, "token"):
        return None
    return (
        f"{where}.loss.importance_sampling={loss.importance_sampling!r}: IcePop ({where}.loss.icepop_band="
        f"{loss.icepop_band}) weights each token by its own ratio pi_old / mu inside the band, a token-level "
        "importance weight; set importance_sampling to 'token' or leave it unset"
    )


def algorithm_problems(config: AlgorithmConfig, group_size: int, where: str = "algorithm") -> list[str]:
    """What is wrong with the algorithm settings `config` (the field `where`: algorithm, or a task's
    tasks[i].algorithm) for groups of `group_size` samples per prompt, each as 'field=value: rule'."""
    loss = config.loss
    problems = []
    if uses_reward_advantages(config) and (problem := group_size_problem(config.name, group_size)) is not None:
        problems.append(f"rollout.group_size={group_size}: {where}.name={config.name!r}: {problem}")
    if config.dynamic_sampling and group_size == 1:
        problems.append(
            f"{where}.dynamic_sampling=True: keeps only the groups whose rewards differ, and with "
            "rollout.group_size=1 no group has two rewards to differ"
        )
    if (problem := icepop_problem(loss, where)) is not None:
        problems.append(problem)
    if loss.advantage_whitening != "token" and not ALGORITHMS[config.name].batch_whitened:
        whitened = ", ".join(n for n, spec in ALGORITHMS.items() if spec.batch_whitened)
        problems.append(
            f"{where}.loss.advantage_whitening={loss.advantage_whitening!r}: only algorithms that whiten their "
            f"advantages over the batch ({whitened}) use it, not {config.name!r}"
        )
    return problems


def algorithm_section_problems(algorithm: AlgorithmConfig, where: str = "algorithm") -> Problems:
    """What is wrong with the algorithm section `where` (algorithm, or tasks[i].algorithm) on its own:
    IcePop's band, the dual clip, the entropy bonus, the KL cap, the distillation weight, the teachers
    and the skipped-step limit."""
    problems = _loss_problems(algorithm, where)
    if algorithm.distillation_weight is not None:
        problems.require(
            distills(algorithm),
            f"{where}.distillation_weight",
            algorithm.distillation_weight,
            f"weights a teacher's advantage, but neither {where}.teacher_path nor {where}.teachers is set",
        )
        problems.require(
            algorithm.distillation_weight > 0,
            f"{where}.distillation_weight",
            algorithm.distillation_weight,
            "must be > 0 (None: the teacher's advantage alone)",
        )
    sources = [teacher.data_source for teacher in algorithm.teachers]
    for i, teacher in enumerate(algorithm.teachers):
        problems.require(
            bool(teacher.data_source),
            f"{where}.teachers[{i}].data_source",
            teacher.data_source,
            f"must name a data source (the rows' data_source); the teacher of rows without one is {where}.teacher_path",
        )
        problems.require(
            sources.index(teacher.data_source) == i,
            f"{where}.teachers[{i}].data_source",
            teacher.data_source,
            f"already has a teacher ({where}.teachers[{sources.index(teacher.data_source)}]); one teacher a source",
        )
        problems.require(bool(teacher.path), f"{where}.teachers[{i}].path", teacher.path, "must be a model directory")
    problems.require(
        algorithm.max_skipped_steps >= 1,
        f"{where}.max_skipped_steps",
        algorithm.max_skipped_steps,
        "must be at least 1",
    )
    return problems


def _loss_problems(algorithm: AlgorithmConfig, where: str) -> Problems:
    """The loss settings of the section: IcePop's band, the dual clip, the entropy bonus, the KL cap."""
    loss = algorithm.loss
    spec = ALGORITHMS[algorithm.name]
    problems = Problems()
    if loss.icepop_band is not None:
        low, high = loss.icepop_band
        problems.require(
            0 < low <= 1 <= high,
            f"{where}.loss.icepop_band",
            loss.icepop_band,
            "must be (low, high) with 0 < low <= 1 <= high (the band of pi_old / mu ratios kept)",
        )
    if loss.clip_ratio_c is not None:
        problems.require(
            loss.clip_ratio_c > 1,
            f"{where}.loss.clip_ratio_c",
            loss.clip_ratio_c,
            "must be > 1 (None disables dual clip)",
        )
        problems.require(
            spec.dual_clip,
            f"{where}.loss.clip_ratio_c",
            loss.clip_ratio_c,
            f"dual clip bounds the PPO clipped objective, which {where}.name={algorithm.name!r} does not use",
        )
    problems.require(
        loss.entropy_coef >= 0,
        f"{where}.loss.entropy_coef",
        loss.entropy_coef,
        "must be >= 0 (0 disables the entropy bonus)",
    )
    if loss.kl_cap is not None:
        problems.require(loss.kl_cap > 0, f"{where}.loss.kl_cap", loss.kl_cap, "must be > 0 (None: no cap)")
        problems.require(
            loss.kl_estimator == "k3",
            f"{where}.loss.kl_cap",
            loss.kl_cap,
            f"caps the k3 estimator, but {where}.loss.kl_estimator={loss.kl_estimator!r}",
        )
        problems.require(
            loss.kl_coef > 0,
            f"{where}.loss.kl_cap",
            loss.kl_cap,
            f"has no effect with {where}.loss.kl_coef=0 (no KL penalty)",
        )
    return problems
