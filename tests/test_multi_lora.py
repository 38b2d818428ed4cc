"""Multi-LoRA: several task adapters on one frozen base, applied per token in one mixed packed batch.

The oracle is the single-adapter model (itself checked against PEFT on HF): a multi-task model seen
through `task_view(model, task)` is exactly the plain model of that task, on the same parameters.
The two compute the same math and are compared in float64 (fp64 models inside
`fp32_islands_in_fp64`), where what is left between them is float64 rounding.
"""

import pytest
import torch
from helpers import assert_close_reporting, randomise_lora

from archon.batch import PackedBatch
from archon.build import build_model
from archon.lora import (
    LoRAConfig,
    MultiExpertLoRA,
    MultiLoRALinear,
    adapter_routing,
    lora_parameters,
    task_parameters,
    task_view,
)

TASKS = {
    # different ranks and different targets: "b" adapts a few dense modules and no experts
    "a": LoRAConfig(rank=4, alpha=8.0),
    "b": LoRAConfig(rank=2, alpha=3.0, target_modules=("q_proj", "v_proj", "down_proj"), experts=False),
}
LENGTHS = [7, 5, 9, 4, 6]
FP64_TOL = 1e-10
"""Absolute tolerance of logits, log-probs and gradients. The single-adapter layer folds the scaling
into its GEMMs (`_FrozenBaseLoRALinear`) and the mixed one scales the [N, r] factor, so the two
round at other points: in float64 measured at most 6.9e-15 apart in logits and 1.1e-12 in gradients
(of magnitude up to about 1e2; 4.1e-13 with AVX-512 kernels, 1.1e-12 with scalar ones)."""
TASK_OF_SEQUENCE = [0, 1, 1, 0, 1]


pytestmark = pytest.mark.usefixtures("float64_math")  # every test compares in float64


def _batch(vocab, seed, lengths=LENGTHS, task_of_sequence=TASK_OF_SEQUENCE):
    g = torch.Generator().manual_seed(seed)
    batch = PackedBatch.from_sequences([torch.randint(0, vocab, (n,), generator=g) for n in lengths])
    task_of_token = torch.repeat_interleave(torch.tensor(task_of_sequence), torch.tensor(lengths))
    return batch, task_of_token


def _loss(logits, labels, weight):
    """A loss with a different gradient for every logit (a fixed random projection) plus the NLL."""
    lp = torch.log_softmax(logits.float(), -1)
    return (lp * weight[: logits.shape[0]]).sum() - lp.gather(1, labels[:, None]).sum()


def _forward(model, batch):
    return model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)


def _mixed_pass(model, batch, task_of_token, weight):
    model.zero_grad(set_to_none=True)
    with adapter_routing(model, task_of_token):
        logits = _forward(model, batch)
    _loss(logits, batch.labels, weight).backward()
    grads = {task: {n: p.grad.clone() for n, p in task_parameters(model, task).items()} for task in TASKS}
    return logits.detach(), grads


@pytest.fixture(params=["qwen3", "qwen3_moe"])
def multi_model(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    loaded = build_model(path, task_loras=TASKS, dtype=torch.float64)
    randomise_lora(lora_parameters(loaded.model), 0.2, torch.Generator().manual_seed(3))
    return loaded


def test_multi_task_model_holds_each_tasks_adapter_where_it_targets(multi_model):
    model = multi_model.model
    multi = [m for m in model.modules() if isinstance(m, MultiLoRALinear)]
    assert multi and all(m.task_names == ("a", "b") for m in multi)
    assert all("a" in m.tasks for m in multi)  # all-linear
    b_leaves = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, MultiLoRALinear) and "b" in m.tasks
    }
    assert b_leaves <= {"q_proj", "v_proj", "down_proj"} and {"q_proj", "v_proj"} <= b_leaves
    if multi_model.hf_config.model_type == "qwen3_moe":
        experts = [m for m in model.modules() if isinstance(m, MultiExpertLoRA)]
        assert experts and all(set(m.tasks) == {"a"} for m in experts)
    # each task's view has the plain recipe's parameter names and its own ranks
    with task_view(model, "b"):
        names = set(lora_parameters(model))
    assert names and all(".lora_a.weight" in n or ".lora_b.weight" in n for n in names)
    assert all(p.shape[0] == 2 for n, p in task_parameters(model, "b").items() if n.endswith("lora_a.weight"))


@pytest.mark.parametrize("task_of_sequence", [TASK_OF_SEQUENCE, sorted(TASK_OF_SEQUENCE)], ids=["mixed", "grouped"])
def test_mixed_batch_forward_and_backward_equal_separate_single_adapter_passes(multi_model, task_of_sequence):
    """Logits: each task's sequences alone through its single-adapter model. Gradients: the whole
    batch through each task's single-adapter model with the loss on that task's tokens only (the
    same matmul shapes as the mixed pass, so only the LoRA arithmetic differs). Sequences in any
    order, or already grouped by task (no rows moved)."""
    model = multi_model.model
    vocab = multi_model.hf_config.vocab_size
    batch, task_of_token = _batch(vocab, seed=0, task_of_sequence=task_of_sequence)
    weight = torch.randn(batch.num_tokens, vocab, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logits, grads = _mixed_pass(model, batch, task_of_token, weight)

    bounds = batch.cu_seqlens.tolist()
    for index, task in enumerate(TASKS):
        chosen = [i for i, t in enumerate(task_of_sequence) if t == index]
        rows = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in chosen])
        mine = task_of_token == index
        model.zero_grad(set_to_none=True)
        with task_view(model, task):
            with torch.no_grad():
                alone = _forward(model, batch.select(chosen))
            whole = _forward(model, batch)
            _loss(whole[mine], batch.labels[mine], weight[mine]).backward()
            single_grads = {n: p.grad for n, p in lora_parameters(model).items()}
        assert_close_reporting(logits[rows], alone, FP64_TOL, f"{task}: logits")
        assert_close_reporting(logits[mine], whole[mine].detach(), FP64_TOL, f"{task}: logits (whole batch)")
        assert single_grads.keys() == grads[task].keys()
        for name, grad in single_grads.items():
            assert_close_reporting(grads[task][name], grad, FP64_TOL, f"{task}: gradient of {name}")
        assert all(g.abs().max() > 0 for g in single_grads.values())


def test_a_tasks_gradient_is_bitwise_unaffected_by_another_tasks_data(multi_model):
    model = multi_model.model
    vocab = multi_model.hf_config.vocab_size
    batch, task_of_token = _batch(vocab, seed=0)
    weight = torch.randn(batch.num_tokens, vocab, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, grads = _mixed_pass(model, batch, task_of_token, weight)

    other = batch.tokens.clone()
    b_tokens = task_of_token == 1
    other[b_tokens] = torch.randint(0, vocab, (int(b_tokens.sum()),), generator=torch.Generator().manual_seed(9))
    changed = PackedBatch.from_sequences([other[a:b] for a, b in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:])])
    _, changed_grads = _mixed_pass(model, changed, task_of_token, weight)

    for name, grad in grads["a"].items():
        if multi_model.hf_config.model_type == "qwen3_moe":
            # The frozen MoE base itself is not bitwise batch-independent: another task's tokens change
            # how many rows each expert's GEMM has, and the GEMM rounds differently (adapter off too).
            # The expert LoRA layer's own isolation is bitwise: see the test below.
            assert_close_reporting(changed_grads["a"][name], grad, FP64_TOL, f"gradient of {name}")
        else:
            difference = float((grad - changed_grads["a"][name]).abs().max())
            assert torch.equal(grad, changed_grads["a"][name]), f"{name}: max |difference| {difference:.3e}"
    assert any(not torch.equal(g, changed_grads["b"][n]) for n, g in grads["b"].items())  # b did see its data


def test_multi_task_forward_without_routing_is_an_error(multi_model):
    batch, _ = _batch(multi_model.hf_config.vocab_size, seed=0)
    with pytest.raises(RuntimeError, match="adapter_routing"):
        _forward(multi_model.model, batch)


def test_each_task_starts_from_the_single_adapter_models_init(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    multi = build_model(path, task_loras=TASKS, seed=5).model
    for task, lora in TASKS.items():
        single = build_model(path, lora=lora, seed=5).model
        expected = lora_parameters(single)
        got = task_parameters(multi, task)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[n], expected[n]) for n in got)


@pytest.mark.parametrize("grouped", [True, False])
def test_expert_lora_rows_of_one_task_are_bitwise_unaffected_by_another_tasks_rows(grouped):
    from archon.grouped_mm import ExpertGroups
    from archon.lora import AdapterRouting

    torch.manual_seed(0)
    E, dim, out, T = 4, 16, 12, 10
    layer = MultiExpertLoRA(
        E, dim, out, {"a": LoRAConfig(rank=4), "b": None, "c": LoRAConfig(rank=2, alpha=5.0)}
    ).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    task_of_token = torch.tensor([0, 2, 1, 0, 2, 0, 1, 2, 0, 0])
    expert_of_row = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3, 3])
    token_of_row = torch.tensor([0, 4, 2, 9, 1, 3, 6, 5, 7, 8])
    groups = ExpertGroups.from_sorted(expert_of_row, E, grouped)

    def run(x):
        layer.zero_grad(set_to_none=True)
        layer.routing = AdapterRouting.from_task_ids(task_of_token, 3)
        y = layer(x, groups, layer.task_of_rows(token_of_row))
        layer.routing = None
        y.pow(2).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}

    x = torch.randn(T, dim, dtype=torch.float64)
    y, grads = run(x)
    # each row equals its own task's ExpertLoRA on that row alone (zero where the task has none)
    for row in range(T):
        task = ("a", "b", "c")[int(task_of_token[token_of_row[row]])]
        e = int(expert_of_row[row])
        if task == "b":
            assert torch.equal(y[row], torch.zeros(out, dtype=torch.float64))
            continue
        adapter = layer.tasks[task]
        expected = (x[row] @ adapter.lora_a[e].T) * adapter.scaling @ adapter.lora_b[e].T
        assert_close_reporting(y[row], expected, FP64_TOL, f"row {row} (task {task}, expert {e})")
    other = x.clone()
    not_a = torch.tensor([int(task_of_token[t]) != 0 for t in token_of_row])
    other[not_a] = torch.randn(int(not_a.sum()), dim, dtype=torch.float64)
    y2, grads2 = run(other)
    assert torch.equal(y[~not_a], y2[~not_a])
    assert all(torch.equal(grads[n], grads2[n]) for n in grads if n.startswith("tasks.a."))
    assert not torch.equal(grads["tasks.c.lora_a"], grads2["tasks.c.lora_a"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_native_engine_generates_a_mixed_batch_as_each_task_alone(tiny_checkpoint, temperature):
    """One generation of both tasks' prompts, each sequence under its task's adapter: greedy, each
    task's tokens are those of its single-adapter model alone; sampled with a seed, each task's
    samples are those it draws alone (every group samples from its own generator, seeded from its
    task's), and their log-probs are its single-adapter model's."""
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    loaded = build_model(tiny_checkpoint("qwen3"), task_loras=TASKS, dtype=torch.float64)
    randomise_lora(lora_parameters(loaded.model), 0.2, torch.Generator().manual_seed(3))
    engine = NativeRolloutEngine(loaded.model)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 6, 4, 5, 2)]
    adapters = [0, 1, 1, 0, 1]
    sampling = SamplingParams(max_new_tokens=6, temperature=temperature, n=2, seed=11)
    mixed = engine.generate(prompts, sampling, adapters=adapters)
    for index, task in enumerate(TASKS):
        mine = [i for i, a in enumerate(adapters) if a == index]
        got = [s for s in mixed if s.prompt_index in mine]
        if temperature == 0:
            with task_view(loaded.model, task):
                alone = engine.generate([prompts[i] for i in mine], sampling)
        else:
            alone = engine.generate([prompts[i] for i in mine], sampling, adapters=[index] * len(mine))
        assert [s.completion_ids for s in got] == [s.completion_ids for s in alone], task
        with task_view(loaded.model, task), torch.no_grad():
            for s in got:
                ids = torch.tensor(s.prompt_ids + s.completion_ids)
                n = len(ids)
                logits = loaded.model(ids, torch.arange(n), torch.tensor([0, n]), n)
                expected = torch.log_softmax(logits[len(s.prompt_ids) - 1 : n - 1], dim=-1)
                expected = expected.gather(-1, ids[len(s.prompt_ids) :, None])[:, 0]
                assert_close_reporting(s.logprobs, expected, FP64_TOL, f"{task}, prompt {s.prompt_index}: log-probs")
    by_task = {t: [s.completion_ids for s in mixed if adapters[s.prompt_index] == t] for t in (0, 1)}
    assert by_task[0] != by_task[1]


def test_a_forward_builds_its_task_constants_once(multi_model, monkeypatch):
    """The tasks' scalings and dropout probabilities are made into tensors once per device, not at
    every forward (on an accelerator each would be a host-to-device copy that waits for the device)."""
    from archon.lora import multi_task

    model = multi_model.model
    batch, task_of_token = _batch(multi_model.hf_config.vocab_size, seed=0)
    with adapter_routing(model, task_of_token), torch.no_grad():
        first = _forward(model, batch)
        made = []
        tensor = torch.tensor
        monkeypatch.setattr(multi_task.torch, "tensor", lambda *a, **k: made.append(a) or tensor(*a, **k))
        again = _forward(model, batch)
    assert not made
    assert torch.equal(first, again)


def test_stacked_factors_are_reused_in_decoding_but_never_stale(multi_model):
    """Inside cached_task_factors a no-grad forward stacks each layer's factors once; a factor changed
    in place (optimizer step, load) or replaced is stacked again, and a forward that takes gradients
    of the factors never reads the cache."""
    from archon.lora import cached_task_factors

    model = multi_model.model
    model.eval()
    batch, task_of_token = _batch(multi_model.hf_config.vocab_size, seed=0)
    layers = [m for m in model.modules() if isinstance(m, (MultiLoRALinear, MultiExpertLoRA))]

    def forward():
        with adapter_routing(model, task_of_token):
            return _forward(model, batch)

    with cached_task_factors(model):
        with torch.no_grad():
            first = forward()
            stacks = [layer.factor_cache.stacked for layer in layers]
            assert all(s is not None for s in stacks)
            assert torch.equal(forward(), first)
            assert all(layer.factor_cache.stacked is s for layer, s in zip(layers, stacks))  # reused
            factors = lora_parameters(model)
            some_a = next(p for n, p in factors.items() if ".tasks.b." in n and n.endswith("lora_a.weight"))
            some_b = next(p for n, p in factors.items() if ".tasks.a." in n and "lora_b" in n.split("."))
            some_a.add_(0.5)  # as an optimizer step does
            after_step = forward()
            some_b.copy_(torch.randn_like(some_b))  # as a load does
            after_load = forward()
        logits = forward()  # gradients flow to the factors: stacked afresh, in the graph
        logits.float().pow(2).mean().backward()
        assert some_a.grad is not None and some_a.grad.abs().max() > 0
    assert all(layer.factor_cache is None for layer in layers)
    with torch.no_grad():
        uncached = forward()
    assert torch.equal(after_load, uncached)
    assert not torch.equal(after_step, first) and not torch.equal(after_load, after_step)
    assert_close_reporting(logits.detach(), uncached, FP64_TOL, "logits with gradients against uncached")


def test_lora_init_draws_what_it_always_drew():
    """One init for every LoRA layer, drawing as each did before: A as kaiming_uniform_(a=sqrt(5)) on
    each [r, in] matrix (bound 1/sqrt(in) for stacked experts), B zeros, in the same RNG order."""
    import math

    from torch import nn

    from archon.lora import ExpertLoRA, LoRALinear
    from archon.lora.multi_task import TaskAdapter

    for in_features, out_features, rank in ((16, 12, 4), (48, 7, 2), (100, 33, 8), (7, 64, 3)):
        torch.manual_seed(11)
        layer = LoRALinear(in_features, out_features, True, LoRAConfig(rank=rank))
        after = torch.rand(3)
        torch.manual_seed(11)
        base = nn.Linear(in_features, out_features)
        nn.Linear(in_features, rank, bias=False), nn.Linear(rank, out_features, bias=False)
        expected_a = torch.empty(rank, in_features)
        nn.init.kaiming_uniform_(expected_a, a=math.sqrt(5))
        assert torch.equal(layer.weight, base.weight) and torch.equal(layer.lora_a.weight, expected_a)
        assert torch.equal(layer.lora_b.weight, torch.zeros(out_features, rank))
        assert torch.equal(torch.rand(3), after)

        torch.manual_seed(12)
        adapter = TaskAdapter(in_features, out_features, rank, 1.0, 0.0)
        torch.manual_seed(12)
        nn.Linear(in_features, rank, bias=False), nn.Linear(rank, out_features, bias=False)
        nn.init.kaiming_uniform_(expected_a, a=math.sqrt(5))
        assert torch.equal(adapter.lora_a.weight, expected_a) and not adapter.lora_b.weight.any()

        torch.manual_seed(13)
        experts = ExpertLoRA(4, in_features, out_features, LoRAConfig(rank=rank))
        torch.manual_seed(13)
        bound = 1.0 / math.sqrt(in_features)
        assert torch.equal(experts.lora_a, torch.empty(4, rank, in_features).uniform_(-bound, bound))
        assert not experts.lora_b.any()


def test_built_models_start_from_the_seeded_init(tiny_checkpoint):
    """build_model's adapters: every A drawn in parameter order from one generator seeded with `seed`
    (uniform in +-1/sqrt(in)), every B zero; each task of a multi-task model as its own model."""
    import math

    path = tiny_checkpoint("qwen3_moe")
    loaded = build_model(path, lora=TASKS["a"], seed=5)
    generator = torch.Generator().manual_seed(5)
    params = lora_parameters(loaded.model)
    assert any(".experts." in n for n in params)
    for name, param in params.items():
        if "lora_b" in name.split("."):
            assert not param.any(), name
            continue
        bound = 1.0 / math.sqrt(param.shape[-1])
        assert torch.equal(param, torch.empty(param.shape).uniform_(-bound, bound, generator=generator)), name
