"""Runs the GRPO recipe in this process and SIGKILLs it at a chosen point of a checkpoint or
adapter write, for the fault tests (tests/test_checkpoint_faults.py).

    # killed once DCP has written the shards of that checkpoint, before its index (.metadata)
    python tests/fault_driver.py dcp-save .step-00000003.tmp RECIPE_ARGS...
    # killed just before that directory is renamed into place
    python tests/fault_driver.py rename .step-00000002.tmp RECIPE_ARGS...
    # resumes the newest checkpoint and saves it again (a re-save), killed at that rename; with
    # tasks in the config, the first task's re-save is killed
    python tests/fault_driver.py resave .step-00000002.tmp RECIPE_ARGS... --resume
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    point, target, recipe_args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if point == "dcp-save":
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        original_finish = _FileSystemWriter.finish

        def finish(self, metadata, results):
            if Path(self.path).name == target:  # the shards are written, the index (.metadata) is not
                _die()
            return original_finish(self, metadata, results)

        _FileSystemWriter.finish = finish
    elif point in ("rename", "resave"):
        original_replace = os.replace

        def replace(src, dst, **kwargs):
            if Path(src).name == target:
                _die()
            return original_replace(src, dst, **kwargs)

        os.replace = replace
    else:
        raise SystemExit(f"unknown kill point {point!r}")
    if point == "resave":
        from archon.rl.config import parse_config
        from archon.rl.loop import RLRun

        config = parse_config(recipe_args)
        run = RLRun(config)
        run.save(run._resume())
        return
    from archon.recipes.grpo_lora import main as recipe

    recipe(recipe_args)


if __name__ == "__main__":
    main()
