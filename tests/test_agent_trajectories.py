"""Multi-turn trajectories in training: the environment's ids take no loss, and every sampled id
keeps its own log-prob and adapter version (hand-built trajectories)."""

import pytest
import torch

from archon.agents.environment import StopReason
from archon.agents.trajectory import Trajectory
from archon.rl.producer import Rollouts
from archon.rl.rollouts import replace_stale_groups, rollout_batch
from archon.trainer import LossContext
from tests.test_rl_losses import ALGORITHMS, algorithm


def hand_built(turn_versions=(3, 4), start_version=3) -> Trajectory:
    """prompt [1, 2]; sampled turn [3, 4]; environment [5, 6]; sampled turn [7, 8]."""
    trajectory = Trajectory(prompt_ids=[1, 2], start_version=start_version)
    trajectory.add_sampled([3, 4], [-0.1, -0.2], [turn_versions[0]] * 2)
    trajectory.add_environment([5, 6])
    trajectory.add_sampled([7, 8], [-0.3, -0.4], [turn_versions[1]] * 2)
    trajectory.stop_reason = StopReason.DONE
    return trajectory


def test_trajectory_packs_with_the_environment_ids_out_of_the_loss():
    trajectory = hand_built()
    assert trajectory.sampled_mask == [True, True, False, False, True, True]
    assert trajectory.token_versions == [3, 3, 3, 3, 4, 4]  # added ids carry the version of the turn before
    batch = rollout_batch([trajectory.to_sample(0)], torch.tensor([1.0]), trainer_version=5)
    # position t predicts tokens[t + 1]: 3, 4 (sampled), 5, 6 (added), 7, 8 (sampled); the last predicts nothing
    assert batch.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert batch.loss_mask.tolist() == [False, True, True, False, False, True, True, False]
    assert batch.rollout_logprobs.tolist() == pytest.approx([0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4, 0.0])
    assert batch.extras["version_lag"].tolist() == [0, 2, 2, 2, 2, 1, 1, 0]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_environment_ids_get_no_gradient(name):
    """d loss / d log-prob is 0 at every position that predicts an environment id, for every
    algorithm, and not 0 at the sampled ones."""
    batch = rollout_batch([hand_built().to_sample(0), hand_built().to_sample(0)], torch.tensor([1.0, -1.0]), 5)
    batch.old_logprobs = batch.rollout_logprobs.clone()
    logprobs = batch.rollout_logprobs.clone().requires_grad_(True)  # ratio 1: no clipping
    loss, _ = algorithm(name).loss(batch, logprobs, LossContext.for_batch(batch.loss_mask, batch.cu_seqlens))
    (grad,) = torch.autograd.grad(loss, logprobs)
    environment = torch.tensor([False, False, False, True, True, False, False, False] * 2)
    assert torch.all(grad[environment] == 0)
    assert torch.all(grad[batch.loss_mask] != 0)


def test_the_staleness_bound_reads_every_sampled_token_of_a_trajectory():
    """A group whose first turn was sampled with a version older than version - N is sampled again,
    even though its later turns are fresh."""
    groups = [hand_built(turn_versions=(3, 5), start_version=3), hand_built(turn_versions=(4, 5), start_version=4)]
    rollouts = Rollouts(0, ["old", "fresh"], [t.to_sample(i) for i, t in enumerate(groups)], {}, 0.0)
    regenerated = []

    def generate(examples):
        regenerated.extend(examples)
        return [hand_built(turn_versions=(5, 5), start_version=5).to_sample(0) for _ in examples]

    replace_stale_groups(rollouts, group_size=1, version=5, max_staleness=1, generate=generate)
    assert regenerated == ["old"]
    assert rollouts.stale_dropped == 1
    assert min(rollouts.samples[0].token_versions) == 5 and rollouts.samples[0].prompt_index == 0
    assert min(rollouts.samples[1].token_versions) == 4
