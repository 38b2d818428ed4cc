"""GRPO-family RL with LoRA.

    torchrun --nproc_per_node 2 recipes/grpo_lora.py                       # the built-in demo
    torchrun --nproc_per_node 2 recipes/grpo_lora.py --config recipes/configs/code_tool_demo.yaml  # with a tool
    torchrun --nproc_per_node 8 recipes/grpo_lora.py --config recipes/configs/qwen3_math.yaml \\
        --model.path /models/Qwen3-8B --data.path train.jsonl --eval.path test.jsonl

Every option is a field of archon.rl.config.RLConfig (`--help` lists them). `--config FILE`
(YAML or TOML) gives the starting values and later flags override them. With neither `--config`
nor `--model.path`, recipes/configs/demo.yaml is used: a small Qwen3 warm-started by SFT on
synthetic arithmetic (cached), then GRPO-LoRA on it, all on CPU with no downloads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from archon.demos import DEMO_CONFIG


def run(config) -> dict:
    import torch.distributed as dist

    from archon.parallel import init_distributed
    from archon.rl.run_dir import prepare_run_dir

    _, rank, _ = init_distributed(config.model.device)
    # Before the demo's warm start, so a run directory in use is reported at once; held until the
    # plot is written.
    prepared = prepare_run_dir(
        config.logging.run_dir, config.resume, config.overwrite, config.lora, tasks=[task.name for task in config.tasks]
    )
    try:
        last = _train_and_report(config, prepared, rank)
    finally:
        prepared.release()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return last


def _train_and_report(config, prepared, rank: int) -> dict:
    """The run in the directory `prepared` (prepare_run_dir's), then on rank 0 its plot and summary."""
    from archon.demos.warm_start import prepare_demo
    from archon.rl.logging.metrics import summary
    from archon.rl.logging.trackers import check_tracker_packages
    from archon.rl.loop import RLRun
    from archon.tools.plot import plot_run

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    if config.model.path is None:
        check_tracker_packages(config.logging)  # a missing tracker package: now, not after the warm start
        files = prepare_demo(config.demo, config.parallel, config.seed, rank, log)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(files.model_dir)))
        if config.demo.kind == "reasoning_gym":  # data.path names the task's source; the demo's held-out set
            config = _with_reasoning_gym_demo_data(config)
        elif not config.tasks:  # each task names its own data
            config = dataclasses.replace(
                config,
                data=dataclasses.replace(config.data, path=str(files.train_path)),
                eval=dataclasses.replace(config.eval, path=config.eval.path or str(files.held_out_path)),
            )
    elif not config.data.path and not config.tasks:
        raise SystemExit("--data.path is required with --model.path (a .jsonl, .parquet or datasets directory)")
    last = RLRun(config, prepared).run()
    if rank == 0:
        run_dir = Path(config.logging.run_dir)
        plot = plot_run(run_dir)
        print(f"final: {summary(last)}")
        adapters = [run_dir / "tasks" / t.name / "adapter" for t in config.tasks] or [run_dir / "adapter"]
        print(f"adapter (PEFT): {', '.join(map(str, adapters))}")
        print(f"metrics: {run_dir / 'metrics.jsonl'}")
        print(f"plot: {plot}")
    return last


def _with_reasoning_gym_demo_data(config):
    """The reasoning-gym demo's run: eval.path and data.system_prompt, when unset, are the demo's held-out
    problems and system prompt (validation checks that set ones are the same)."""
    problems = config.demo.reasoning_gym
    data = dataclasses.replace(
        config.data,
        system_prompt=problems.system_prompt if config.data.system_prompt is None else config.data.system_prompt,
    )
    evaluation = dataclasses.replace(config.eval, path=config.eval.path or problems.held_out)
    return dataclasses.replace(config, data=data, eval=evaluation)


def _exit_with_error(error: BaseException, every_rank: bool) -> None:
    """Print `error: <message>` to stderr (the message names the field or file, so no traceback is
    needed) and exit with status 1. Under torchrun every rank exits; with `every_rank` False only rank
    0 prints, for an error every rank meets alike (the settings), so it is printed once. The error
    also goes to torchrun's error file, so its failure summary names it instead of "<N/A>"."""
    from archon.secrets import redact

    rank = int(os.environ.get("RANK", "0"))
    message = redact(str(error))
    if rank == 0 or every_rank:
        print(f"error: {message}" + (f" (rank {rank})" if rank else ""), file=sys.stderr, flush=True)
    # writes only under torchrun (TORCHELASTIC_ERROR_FILE)
    get_error_handler().record_exception(error if message == str(error) else RuntimeError(message))
    raise SystemExit(1) from None


def _print_redacted_traceback(kind, error, traceback_) -> None:
    """sys.excepthook: the traceback as Python prints it, with the config's secrets redacted."""
    import traceback

    from archon.secrets import redact

    sys.stderr.write(redact("".join(traceback.format_exception(kind, error, traceback_))))
    sys.stderr.flush()


def recipe_argv(argv: list[str]) -> list[str]:
    """The recipe's arguments as parse_config takes them: with neither --config nor --model.path
    (nor --help), the built-in demo's config comes first."""
    if "--config" not in argv and not any(a.startswith("--model.path") for a in argv) and "--help" not in argv:
        return ["--config", str(DEMO_CONFIG), *argv]
    return argv


@record  # under torchrun, any other error's message and traceback reach its failure summary
def main(argv: list[str] | None = None) -> None:
    from archon.checkpoint.resume import CheckpointError
    from archon.rl.config import parse_config
    from archon.rl.interrupt import terminate_as_interrupt
    from archon.rl.logging.trackers import TrackerError
    from archon.rl.run.run_dir import RunDirInUseError
    from archon.rollout.vllm_launch import separate_inductor_cache
    from archon.secrets import redact_logs

    # under ATEN_CPU_CAPABILITY, compiled blocks build into an inductor cache of that capability's own
    separate_inductor_cache(os.environ)
    argv = recipe_argv(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    redact_logs()  # the secrets of the config (archon.secrets), once it is parsed, never reach a log line
    sys.excepthook = _print_redacted_traceback  # nor the traceback of an unexpected error
    try:
        config = parse_config(argv)
    except (ValueError, FileNotFoundError) as e:
        _exit_with_error(e, every_rank=False)
    try:
        with terminate_as_interrupt():  # SIGTERM stops the run as Ctrl-C does: the launched servers are closed
            run(config)
    except (ValueError, FileNotFoundError) as e:  # a setting or file the model or data turned out not to fit
        _exit_with_error(e, every_rank=True)
    except (RunDirInUseError, CheckpointError, TrackerError, FileExistsError, NotADirectoryError, PermissionError) as e:
        _exit_with_error(e, every_rank=True)  # each names the run directory, checkpoint or setting at fault
    except Exception as e:  # anything else goes on to @record, which writes its message to torchrun's error file
        _redact_exception_messages(e)
        raise


def _redact_exception_messages(error: BaseException) -> None:
    """Redact the config's secrets from the string arguments of `error` and the errors it chains,
    in place, keeping their types and tracebacks."""
    from archon.secrets import redact

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.args = tuple(redact(arg) if isinstance(arg, str) else arg for arg in error.args)
        error = error.__cause__ or error.__context__


def _end_launched_process() -> None:
    """End a torchrun-launched rank once its run is over, skipping the interpreter's teardown.

    By then the run has closed everything it opened (servers, trackers, run directory) and
    destroyed its process group; what is left are C++ threads of torch.distributed's stores and
    groups. Destroying those at interpreter exit has aborted a rank that had finished
    ("terminate called without an active exception", SIGABRT) under load, and torchrun then
    reports the whole run as failed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _end_launched_process()
