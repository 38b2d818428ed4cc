"""Sync payloads and the bucketed broadcast, without a rollout server.

The merged and full payloads are checked against the merged HF export (itself checked against
PEFT-merged HF logits in test_peft_export.py); the buckets go over a real gloo group between two
threads."""

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close_reporting
from safetensors.torch import load_file

from archon.build import build_model
from archon.checkpoint.hf_weights import save_merged_hf
from archon.lora import LoRAConfig
from archon.precision import fp32_islands_in_fp64
from archon.rollout.base import SamplingParams
from archon.rollout.policy import ServedPolicy
from archon.rollout.vllm_network import free_port
from archon.rollout.vllm_server import RequestThreads, Server, VLLMServerError, VLLMServers
from archon.sync import (
    StatelessGroup,
    full_payload,
    merged_payload,
    receive_tensors,
    send_tensors,
)

# Merged weights computed along two paths, both in float64: float64 rounding is what is left
FLOAT64_TOL = 1e-10


def _broadcast(named_tensors, bucket_bytes: int) -> tuple[dict, list]:
    """Rank 0 sends in one thread, rank 1 receives in another; returns (send stats, received)."""
    port = free_port("127.0.0.1")
    received, errors = [], []

    def receiver() -> None:
        try:
            group = StatelessGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
            received.extend((name, t.clone()) for name, t in receive_tensors(group))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    thread = threading.Thread(target=receiver)
    thread.start()
    group = StatelessGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
    stats = send_tensors(group, named_tensors, bucket_bytes)
    thread.join(timeout=60)
    if errors:
        raise errors[0]
    return stats, received


def test_buckets_carry_every_tensor_whole_in_order():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "big": torch.randn(40, 33, generator=g),  # 5280 bytes: spans several 1 KiB buckets
        "half": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "strided": torch.randn(6, 10, generator=g).t(),  # not contiguous
    }
    stats, received = _broadcast(tensors.items(), bucket_bytes=1024)
    assert [name for name, _ in received] == list(tensors)
    for name, tensor in received:
        assert tensor.dtype == tensors[name].dtype and tensor.shape == tensors[name].shape, name
        assert torch.equal(tensor, tensors[name]), name
    assert stats["tensors"] == len(tensors)
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert stats["buckets"] >= stats["bytes"] // 1024


@pytest.mark.parametrize(
    "model_type, targets, units, changed_names",
    [
        ("qwen3", ("q_proj", "v_proj", "gate_proj"), ("self_attn", "mlp"), {"q_proj", "v_proj", "gate_proj"}),
        # per-expert HF keys; the router (mlp.gate) stays behind
        (
            "qwen3_moe",
            ("o_proj", "experts"),
            ("self_attn", "mlp.experts"),
            {"o_proj", "gate_proj", "up_proj", "down_proj"},
        ),
        # shared experts (and the first, dense, layer's MLP) without the routed experts
        ("glm4_moe", ("gate_proj",), ("mlp.shared_experts", "0.mlp"), {"gate_proj"}),
    ],
)
def test_merged_payload_sends_the_modules_holding_lora(
    tiny_checkpoint, lora_model, tmp_path, model_type, targets, units, changed_names
):
    path = tiny_checkpoint(model_type)
    loaded = lora_model(path, LoRAConfig(rank=4, alpha=8, target_modules=targets))
    loaded.model.double()  # the payload and the export merge the same way: compared in float64
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    with fp32_islands_in_fp64():
        merged_dir = save_merged_hf(loaded.model, loaded.converter, tmp_path / "merged", loaded.hf_config.to_dict())
        merged = load_file(str(merged_dir / "model.safetensors"))
        payload = dict(merged_payload(loaded.model, loaded.converter))
    original = load_file(str(path / "model.safetensors"))

    # every tensor of each attention / MLP / MoE part that carries LoRA, e.g. k_proj beside q_proj
    expected = {k for k in merged if any(f".{unit}." in k for unit in units)}
    assert set(payload) == expected
    changed = set()
    for key, tensor in payload.items():
        assert_close_reporting(tensor, merged[key], FLOAT64_TOL, f"{model_type} payload {key}")
        if not torch.equal(tensor, original[key].double()):
            changed.add(key.split(".")[-2] if key.endswith("weight") else key.split(".")[-1])
    assert changed == changed_names
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed by the merged payload"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "gpt_oss"])
def test_lora_modules_declare_their_adapter_and_its_delta(tiny_checkpoint, lora_model, model_type):
    """adapter_params() of the LoRA modules are the model's LoRA parameters, and delta_weight() is
    s * B @ A in each adapted weight's own shape."""
    from archon.lora import lora_modules, lora_parameters

    loaded = lora_model(tiny_checkpoint(model_type), LoRAConfig(rank=4, alpha=8))
    declared = {f"{path}.{name}" for path, module in lora_modules(loaded.model) for name in module.adapter_params()}
    assert declared == set(lora_parameters(loaded.model))
    for path, module in lora_modules(loaded.model):
        for name, delta in module.delta_weight().items():
            assert delta.dtype == torch.float32, f"{path}.{name}: the delta of an fp32 model is fp32"
    loaded.model.double()  # the values: two ways to the same math, compared in float64
    with fp32_islands_in_fp64():
        _check_deltas(loaded.model, model_type)


def _check_deltas(model, model_type: str) -> None:
    from archon.lora import lora_modules

    for path, module in lora_modules(model):
        for name, delta in module.delta_weight().items():
            weight = getattr(module, name)
            assert delta.shape == weight.shape and delta.dtype == torch.float64, f"{path}.{name}"
            if weight.ndim == 2:  # a linear: [out, in] = s * B[out, r] @ A[r, in]
                expected = module.scaling * module.lora_b.weight.float() @ module.lora_a.weight.float()
            else:  # stacked experts: per expert e, s * B[e] @ A[e], in the weight's layout
                lora = getattr(module, f"{name}_lora")
                expected = torch.stack([lora.scaling * b @ a for a, b in zip(lora.lora_a, lora.lora_b)])
                if module.input_major:
                    expected = expected.transpose(1, 2)
            assert_close_reporting(delta, expected, FLOAT64_TOL, f"{model_type} delta of {path}.{name}")


def test_full_payload_is_the_merged_checkpoint(tiny_checkpoint, lora_model, tmp_path):
    path = tiny_checkpoint("qwen3")
    loaded = lora_model(path, LoRAConfig(rank=4, alpha=8))
    loaded.model.double()  # the payload and the export merge the same way: compared in float64
    with fp32_islands_in_fp64():
        merged = load_file(
            str(
                save_merged_hf(loaded.model, loaded.converter, tmp_path / "m", loaded.hf_config.to_dict())
                / "model.safetensors"
            )
        )
        payload = dict(full_payload(loaded.model, loaded.converter))
    assert set(payload) == set(merged)
    for key, tensor in payload.items():
        assert_close_reporting(tensor, merged[key], FLOAT64_TOL, f"full payload {key}")
    plain = build_model(path)  # without LoRA: the checkpoint as it is
    original = load_file(str(path / "model.safetensors"))
    sent = dict(full_payload(plain.model, plain.converter))
    assert set(sent) == set(original)
    for key, tensor in sent.items():
        assert torch.equal(tensor, original[key]), key


# ---- the published policy and the choice of weight sync -----------------------------------------
def test_served_policy_leases_defer_the_unload_of_a_replaced_adapter():
    from archon.rollout.policy import ServedPolicy

    policy = ServedPolicy()
    assert policy.current() == (None, 0)
    policy.publish("v1", 1)
    with policy.lease() as held:
        assert held == ("v1", 1)
        policy.publish("v2", 2)  # a request is in flight on v1
        assert policy.current() == ("v2", 2) and policy.leased_names() == {"v1"}
        assert policy.take_unused() == []  # v1 stays loaded while the request runs
        with policy.lease() as newer:
            assert newer == ("v2", 2)  # a request started after the publish gets the new version
        assert held == ("v1", 1)
    assert policy.in_flight() == 0
    policy.publish("v3", 3)
    assert policy.take_unused(leased_elsewhere={"v2"}) == ["v1"]  # v2 is held by another rank's request
    assert policy.take_unused() == ["v2"] and policy.take_unused() == []
    policy.publish("v4", 4)
    policy.publish("v3", 5)  # served again: not to be unloaded
    assert policy.take_unused() == ["v4"]


def test_served_policy_exclusive_waits_for_requests_in_flight_and_holds_new_ones():
    from archon.rollout.policy import ServedPolicy

    policy = ServedPolicy(version=1)
    events: list[str] = []
    in_flight, finish, swapping, held_back_started = (threading.Event() for _ in range(4))

    def request(label: str, started: threading.Event, until: threading.Event | None) -> None:
        started.set()
        with policy.lease() as (_, version):
            events.append(f"{label} starts on v{version}")
            in_flight.set()
            if until is not None:
                until.wait(10)
            events.append(f"{label} ends")

    def publish() -> None:
        with policy.exclusive():
            events.append("swap")
            swapping.set()
            policy.publish(None, 2)

    first = threading.Thread(target=request, args=("first", threading.Event(), finish))
    first.start()
    assert in_flight.wait(10)
    publisher = threading.Thread(target=publish)
    publisher.start()
    while not policy._exclusive:  # the publish has begun and waits for the first request
        publisher.join(0.01)
    second = threading.Thread(target=request, args=("second", held_back_started, None))
    second.start()
    assert held_back_started.wait(10)
    assert not swapping.wait(0.2), "the swap ran while a request was in flight"
    finish.set()
    for thread in (first, publisher, second):
        thread.join(10)
    assert events == ["first starts on v1", "first ends", "swap", "second starts on v2", "second ends"]


def _vllm_engine(path, lora_rank, **config):
    """A vLLM engine that holds no servers (a rank other than 0 with no URLs): enough to choose a sync."""
    from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    return VLLMRolloutEngine(VLLMConfig(**config), model_path=str(path), lora_rank=lora_rank, rank=1)


def test_build_weight_sync_follows_the_engine_transport_and_the_familys_mode(tiny_checkpoint, tmp_path):
    from archon.rl.config import RolloutConfig
    from archon.rollout.native import NativeRolloutEngine
    from archon.rollout.vllm import VLLMConfig
    from archon.sync import InProcessSync, build_weight_sync
    from archon.sync.vllm import CollectiveAdapterSync, CollectiveMergedSync, DiskAdapterSync

    lora = LoRAConfig(rank=4, alpha=8)
    loaded = build_model(tiny_checkpoint("qwen3"), lora=lora)
    native = NativeRolloutEngine(loaded.model)
    sync = build_weight_sync(RolloutConfig(engine="native"), native, lora=lora, sync_dir=tmp_path)
    assert isinstance(sync, InProcessSync)
    assert sync.publish(loaded.model, loaded.converter, lora, 7)["sync_s"] >= 0
    assert native.health()["adapter_version"] == 7
    sample = native.generate([[3, 4]], SamplingParams(max_new_tokens=3, temperature=0))[0]
    assert sample.version == 7 and sample.token_versions == [7, 7, 7]
    native.close()

    dense, moe = tiny_checkpoint("qwen3"), tiny_checkpoint("qwen3_moe")
    cases = [  # (model, LoRA rank, rollout.vllm settings) -> sync, servers' mode
        (dense, 4, {}, DiskAdapterSync, "adapter"),
        (dense, 4, {"transport": "collective"}, CollectiveAdapterSync, "adapter"),
        (dense, 4, {"transport": "collective", "mode": "merged"}, CollectiveMergedSync, "merged"),
        (moe, 4, {"transport": "collective"}, CollectiveMergedSync, "merged"),  # the family's mode
        (dense, None, {"transport": "collective"}, CollectiveMergedSync, "merged"),  # no LoRA: every weight
    ]
    for path, rank, settings, expected, mode in cases:
        engine = _vllm_engine(path, rank, **settings)
        assert engine.mode == mode, settings
        config = RolloutConfig(engine="vllm", vllm=VLLMConfig(**settings))
        sync = build_weight_sync(config, engine, lora=lora if rank else None, sync_dir=tmp_path)
        assert type(sync) is expected, (path.name, settings)
        if isinstance(sync, DiskAdapterSync):
            assert sync.sync_dir == tmp_path
        sync.close()
        engine.close()


def test_build_weight_sync_refuses_what_cannot_be_sent(tiny_checkpoint, tmp_path):
    from archon.rl.config import RolloutConfig
    from archon.rollout.native import NativeRolloutEngine
    from archon.rollout.vllm import VLLMConfig
    from archon.sync import build_weight_sync

    lora = LoRAConfig(rank=4, alpha=8)
    with pytest.raises(
        ValueError,
        match=r"rollout.vllm.transport='disk': rollout.vllm.mode='merged', and merged "
        r"weights go over the collective transport only",
    ):
        VLLMConfig(mode="merged", transport="disk")
    moe = _vllm_engine(tiny_checkpoint("qwen3_moe"), 4)  # merged: qwen3_moe's mode
    with pytest.raises(
        ValueError,
        match=r"rollout.vllm.transport='disk': the model is served merged \(rollout.vllm.mode "
        r"is unset: its family is served merged\), .*; set rollout.vllm.transport='collective'",
    ):
        build_weight_sync(RolloutConfig(engine="vllm"), moe, lora=lora, sync_dir=tmp_path)
    adapter = _vllm_engine(tiny_checkpoint("qwen3"), None, mode="adapter")
    with pytest.raises(ValueError, match=r"rollout.vllm.mode='adapter' sends the LoRA adapter, but lora=None"):
        build_weight_sync(
            RolloutConfig(engine="vllm", vllm=VLLMConfig(mode="adapter")), adapter, lora=None, sync_dir=tmp_path
        )
    with pytest.raises(TypeError, match=r"rollout.engine='native' needs a NativeRolloutEngine, got VLLMRolloutEngine"):
        build_weight_sync(RolloutConfig(engine="native"), adapter, lora=lora, sync_dir=tmp_path)
    native = NativeRolloutEngine(build_model(tiny_checkpoint("qwen3")).model)
    with pytest.raises(TypeError, match=r"rollout.engine='vllm' needs a VLLMRolloutEngine, got NativeRolloutEngine"):
        build_weight_sync(RolloutConfig(engine="vllm"), native, lora=lora, sync_dir=tmp_path)


# ---- vLLM syncs with fake servers and trainer ranks in threads ----------------------------------
class _FakeServers:
    """`n` servers as archon.rollout.vllm_server.VLLMServers presents them, with its request
    threads: completions answer at once; a worker receiving weights waits for the sender."""

    wait_all = VLLMServers.wait_all
    on_each = VLLMServers.on_each

    def __init__(self, n: int, fail_register: bool = False) -> None:
        # loopback URLs, never reached: the requests and the sends are faked
        self.servers = [Server(f"http://127.0.0.1:{9000 + i}") for i in range(n)]
        self.config = SimpleNamespace(health_timeout_s=30.0)
        self.served_model = "base"
        self.fail_register = fail_register
        self.sent = threading.Event()
        self._requests = RequestThreads("fake-vllm-request")

    def __iter__(self):
        return iter(self.servers)

    def __len__(self) -> int:
        return len(self.servers)

    def __getitem__(self, index: int) -> Server:
        return self.servers[index]

    def submit(self, fn, *args):
        return self._requests.submit(fn, *args)

    def check_alive(self, server) -> None:
        pass

    def request(self, server, method, path, body=None, timeout=None):
        if path == "/v1/load_lora_adapter" and self.fail_register:
            raise VLLMServerError(f"vLLM server {server.url}{path} answered HTTP 400: no adapter there")
        count = len(body["prompt"]) * body["n"]
        return {
            "choices": [
                {
                    "index": i,
                    "token_ids": [5, 6],
                    "logprobs": {"token_logprobs": [-0.5, -0.5]},
                    "finish_reason": "length",
                }
                for i in range(count)
            ]
        }

    def rpc(self, server, method, *args, timeout=600):
        if method == "archon_worker_info":
            return [{"rank": 0}]
        if method == "archon_receive_weights" and not self.sent.wait(5):
            raise VLLMServerError(f"{server.url}: the sender never sent")
        return []

    def close(self) -> None:
        self._requests.close()


class _FakeGroup:
    def __init__(self, *args, **kwargs) -> None:
        pass

    @staticmethod
    def host_store(host, port, world_size):
        return None


class _WatchedPolicy(ServedPolicy):
    """Counts the requests that asked for a lease."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Semaphore(0)

    @contextlib.contextmanager
    def lease(self):
        self.asked.release()
        with super().lease() as held:
            yield held


def test_a_merged_publish_sends_while_requests_wait_on_every_server(tiny_checkpoint, monkeypatch):
    """n requests, one per server, held back by the publish wait on their threads, and the send
    needs n + 1 more (a receiver per server and the sender): it must not wait for them."""
    import archon.sync.vllm
    from archon.sync.vllm import WorkerChannel

    def fake_send(group, named_tensors, bucket_bytes):
        sent = list(named_tensors)
        servers.sent.set()
        return {"bytes": sum(t.numel() * t.element_size() for _, t in sent), "buckets": 1, "tensors": len(sent)}

    monkeypatch.setattr(archon.sync.vllm, "send_tensors", fake_send)
    monkeypatch.setattr(archon.sync.vllm, "StatelessGroup", _FakeGroup)
    engine = _vllm_engine(tiny_checkpoint("qwen3"), None, transport="collective")
    servers = engine.servers = _FakeServers(4)
    policy = engine.policy = _WatchedPolicy()
    channel = WorkerChannel(servers, "127.0.0.1", 0, bucket_mb=1.0)
    samples = []
    producer = threading.Thread(
        target=lambda: samples.extend(engine.generate([[1], [2], [3], [4]], SamplingParams(max_new_tokens=2)))
    )
    try:
        with policy.exclusive():
            producer.start()
            for _ in range(4):  # one request per server, each on a pool thread, waiting for the swap
                assert policy.asked.acquire(timeout=10)
            stats = channel.send_weights([("w", torch.ones(3))])
            policy.publish(None, 1)
        producer.join(10)
        assert stats["bytes"] == 12
        assert [s.version for s in samples] == [1, 1, 1, 1]
    finally:
        channel.close()
        servers.close()


class _ThreadRanks:
    """The torch.distributed calls the syncs make, between threads standing for trainer ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.local = threading.local()
        self._barrier = threading.Barrier(world_size, timeout=10)
        self._slots: list = [None] * world_size

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self) -> int:
        return self.world_size

    def barrier(self) -> None:
        self._barrier.wait()

    def broadcast_object_list(self, objects: list, src: int = 0) -> None:
        if self.local.rank == src:
            self._slots[src] = list(objects)
        self._barrier.wait()
        objects[:] = self._slots[src]
        self._barrier.wait()

    def all_gather_object(self, out: list, obj) -> None:
        self._slots[self.local.rank] = obj
        self._barrier.wait()
        out[:] = list(self._slots)
        self._barrier.wait()

    def run(self, fn) -> list:
        """fn(rank) on every rank at once; per rank its result or the exception it raised."""
        outcomes: list = [None] * self.world_size

        def target(rank: int) -> None:
            self.local.rank = rank
            try:
                outcomes[rank] = fn(rank)
            except Exception as e:  # noqa: BLE001 - returned to the test
                outcomes[rank] = e

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return outcomes


class _FailingChannel:
    """Rank 0's channel: the send fails once `release` is set."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def send(self, method, spec, named_tensors, device):
        self.started.set()
        self.release.wait(10)
        raise VLLMServerError("archon worker method archon_receive_weights failed on vLLM server http://fake-0: boom")

    def close(self) -> None:
        pass


def test_merged_publish_on_two_ranks_holds_requests_until_rank_0s_send_and_fails_on_both(tiny_checkpoint, monkeypatch):
    import archon.sync.vllm
    from archon.sync.vllm import CollectiveMergedSync

    ranks = _ThreadRanks(2)
    monkeypatch.setattr(archon.sync.vllm, "dist", ranks)
    loaded = build_model(tiny_checkpoint("qwen3"))
    channel = _FailingChannel()
    policies = [ServedPolicy(version=3), ServedPolicy(version=3)]
    syncs = [
        CollectiveMergedSync(
            SimpleNamespace(
                servers=_FakeServers(0), policy=policies[r], rank=r, model="m", update_policy="finish", session=f"s{r}"
            ),
            channel,
        )
        for r in range(2)
    ]
    observed = {}

    def watch() -> None:  # while rank 0 sends, a request of rank 1 must wait
        channel.started.wait(10)
        request = threading.Thread(target=lambda: observed.setdefault("lease", policies[1].lease().__enter__()))
        request.start()
        request.join(0.5)
        observed["during_send"] = (policies[1].version, "lease" in observed)
        channel.release.set()
        request.join(10)

    watcher = threading.Thread(target=watch)
    watcher.start()
    outcomes = ranks.run(lambda r: syncs[r].publish(loaded.model, loaded.converter, None, 4))
    watcher.join(10)
    assert observed["during_send"] == (3, False)
    assert isinstance(outcomes[0], VLLMServerError)
    assert isinstance(outcomes[1], RuntimeError) and str(outcomes[1]) == (
        "the weight sync failed on trainer rank 0: VLLMServerError: " + str(outcomes[0])
    )
    assert [p.version for p in policies] == [3, 3]  # nobody tags requests with a version not served
    assert observed["lease"] == (None, 3)


def test_adapter_publish_failing_on_rank_0_before_the_broadcast_fails_every_rank_promptly(
    tiny_checkpoint, lora_model, tmp_path, monkeypatch
):
    import archon.sync.vllm
    from archon.sync.vllm import DiskAdapterSync

    ranks = _ThreadRanks(2)
    monkeypatch.setattr(archon.sync.vllm, "dist", ranks)
    lora = LoRAConfig(rank=4, alpha=8)
    loaded = lora_model(tiny_checkpoint("qwen3"), lora)
    servers = [_FakeServers(1, fail_register=True), _FakeServers(0)]
    syncs = [
        DiskAdapterSync(
            SimpleNamespace(
                servers=servers[r], policy=ServedPolicy(), rank=r, model="m", update_policy="finish", session=f"s{r}"
            ),
            tmp_path,
        )
        for r in range(2)
    ]
    outcomes = ranks.run(lambda r: syncs[r].publish(loaded.model, loaded.converter, lora, 1))
    assert isinstance(outcomes[0], VLLMServerError) and "HTTP 400: no adapter there" in str(outcomes[0])
    assert isinstance(outcomes[1], RuntimeError)
    assert str(outcomes[1]) == "the weight sync failed on trainer rank 0: VLLMServerError: " + str(outcomes[0])
    assert [s.policy.version for s in syncs] == [0, 0]
