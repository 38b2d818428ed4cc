"""Runs a multi-task RL config with recorded rollouts, for the layout tests of
tests/test_multi_lora_run.py (not collected by pytest).

    # one process: the run as configured; each step's rollouts of every task are saved to ROLLOUTS
    python tests/multi_task_worker.py record ROLLOUTS RECIPE_ARGS...
    # any layout: the same run, each rank training on its share of the recorded rollouts
    python -m torch.distributed.run --nproc_per_node 2 tests/multi_task_worker.py replay ROLLOUTS RECIPE_ARGS...
    # several runs, one after the other in the same processes (which then start and import once)
    ... tests/multi_task_worker.py replay ROLLOUTS RECIPE_ARGS... --then replay ROLLOUTS2 RECIPE_ARGS2...

Generation is the one part of a step whose result may depend on the layout (each data-parallel rank
samples its own prompts with its own seed); replaying the recorded samples leaves every other
phase (rewards, advantages, log-probs, the losses, the updates, the sync) to be compared with the
one-process run. Both runs compute in float64 (pass --model.dtype float64): this worker keeps the
fp32 islands of the code in fp64 (archon.precision), so the layouts agree to float64 rounding on
any CPU.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from archon.precision import fp32_islands_in_fp64
from archon.rl.config import parse_config
from archon.rl.loop import RLRun

JOB_SEPARATOR = "--then"
OWN_ROLLOUTS = RLRun._own_rollouts


def main() -> None:
    jobs = [[]]
    for arg in sys.argv[1:]:
        if arg == JOB_SEPARATOR:
            jobs.append([])
        else:
            jobs[-1].append(arg)
    for job in jobs:
        run_job(job[0], Path(job[1]), job[2:])


def run_job(mode: str, path: Path, recipe_args: list[str]) -> None:
    own_rollouts = OWN_ROLLOUTS
    if mode == "record":
        recorded = []

        def recording(self, step):
            collected = own_rollouts(self, step)
            recorded.append(collected)
            path.write_bytes(pickle.dumps(recorded))
            return collected

        RLRun._own_rollouts = recording
    elif mode == "replay":
        recorded = pickle.loads(path.read_bytes())

        def replaying(self, step):
            collected = {}
            for name, rollouts in recorded[step].items():
                G = self.config.rollout.group_size
                groups = list(range(len(rollouts.examples)))[self.dp_rank :: self.dp]
                samples = []
                for slot, group in enumerate(groups):
                    for sample in rollouts.samples[group * G : (group + 1) * G]:
                        sample.prompt_index = slot
                        samples.append(sample)
                rollouts.examples = [rollouts.examples[g] for g in groups]
                rollouts.samples = samples
                next(self.tasks[[t.name for t in self.tasks].index(name)].iterator)
                collected[name] = rollouts
            return collected

        RLRun._own_rollouts = replaying
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    with fp32_islands_in_fp64():
        RLRun(parse_config(recipe_args)).run()


if __name__ == "__main__":
    main()
