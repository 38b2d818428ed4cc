"""Multi-teacher on-policy distillation (algorithm.teachers): each sample is distilled from its
prompt's data source's teacher. The advantages against an HF oracle of each sample's own teacher,
teachers shared between sources, the default teacher, the missing-teacher error, and short runs
(one task, several tasks) whose per-source metrics and advantages are checked against the teachers."""

import json
from pathlib import Path

import pytest
import torch
from test_grpo_recipe import write_tiny_setup

from archon.batch import PackedBatch
from archon.rl.algorithms import get_algorithm
from archon.rl.config import AlgorithmConfig, TeacherConfig, parse_config, validate
from archon.rl.loop import RLRun
from archon.rl.run import teachers as rollouts
from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model, prompts of two sources (additions "add", subtractions "sub") and two teachers
    of the model's architecture and tokenizer with other random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = write_tiny_setup(tmp_path_factory.mktemp("mopd"))
    train, _ = arithmetic_splits(ArithmeticTaskConfig(operations=("+", "-"), num_train=64, num_held_out=4))
    with open(root / "mixed.jsonl", "w") as f:
        for row in train:
            f.write(json.dumps({**row, "data_source": "add" if row["operation"] == "+" else "sub"}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    for seed, name in ((1, "teacher_a"), (2, "teacher_b")):
        torch.manual_seed(seed)
        teacher = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / "model"))
        teacher.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def _hf_logprobs(path: Path, sequence: list[int], temperature: float) -> torch.Tensor:
    """The HF model at `path`: log-probs of each next token of `sequence` at `temperature`, [len - 1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].double() / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0].float()


@pytest.mark.parametrize("weight", [None, 0.5], ids=["teachers-alone", "mixed-with-rewards"])
def test_each_sample_is_distilled_from_its_own_sources_teacher(setup, weight):
    """A batch mixing two sources, each with its own teacher: every token's advantage is the one
    computed by hand from its own sample's teacher (HF's forward as the oracle)."""
    from archon.build import build_model

    teachers = {name: build_model(setup / name).model.eval() for name in ("teacher_a", "teacher_b")}
    sequences = [[3, 5, 7, 9, 11, 4], [6, 8, 10, 12], [13, 5, 9, 2, 7], [4, 4, 6, 8, 10, 12, 14]]
    sources = ["add", "sub", "add", "sub"]
    teacher_of = {"add": "teacher_a", "sub": "teacher_b"}
    task_advantages = [0.5, -1.0, 1.5, 0.25]
    batch = PackedBatch.from_sequences(sequences, prompt_lens=[2, 1, 3, 2], advantages=task_advantages)
    torch.manual_seed(0)
    batch.old_logprobs = -torch.rand(batch.num_tokens) * 3
    algorithm = get_algorithm(
        AlgorithmConfig(teachers=(TeacherConfig("add", "a"), TeacherConfig("sub", "b")), distillation_weight=weight),
        max_new_tokens=8,
    )
    original = batch.advantages.clone()
    picked = [1, 2, 3]  # the batch's sequences of this task: sequence 0 is another task's, left alone
    gaps = rollouts.distill_from_teachers(
        batch,
        picked,
        [teachers[teacher_of[sources[i]]] for i in picked],
        [sources[i] for i in picked],
        algorithm,
        torch.device("cpu"),
        TEMPERATURE,
    )
    bounds = batch.cu_seqlens.tolist()
    expected_gaps = {"add": [0.0, 0.0], "sub": [0.0, 0.0]}
    other_teacher = {"add": "teacher_b", "sub": "teacher_a"}
    for i in picked:
        span = slice(bounds[i], bounds[i + 1])
        mask = batch.loss_mask[span]
        old = batch.old_logprobs[span]
        teacher = torch.zeros(len(sequences[i]))
        teacher[: len(sequences[i]) - 1] = _hf_logprobs(setup / teacher_of[sources[i]], sequences[i], TEMPERATURE)
        distill = (teacher - old) * mask
        expected = distill if weight is None else (task_advantages[i] + weight * (teacher - old)) * mask
        assert torch.allclose(batch.advantages[span], expected, atol=1e-6, rtol=0), (
            i,
            batch.advantages[span],
            expected,
        )
        # the other source's teacher gives other advantages, so the test can tell them apart
        wrong = torch.zeros(len(sequences[i]))
        wrong[:-1] = _hf_logprobs(setup / other_teacher[sources[i]], sequences[i], TEMPERATURE)
        assert ((wrong - teacher) * mask).abs().max() > 1e-2
        expected_gaps[sources[i]][0] += float(((old - teacher) * mask).sum())
        expected_gaps[sources[i]][1] += float(mask.sum())
    assert torch.equal(batch.advantages[bounds[0] : bounds[1]], original[bounds[0] : bounds[1]])
    for source, (total, count) in expected_gaps.items():
        assert gaps[source][1] == count
        assert gaps[source][0] == pytest.approx(total, abs=1e-5)


def _config_file(root: Path, run_dir: Path, algorithm: str, steps: int = 1, tasks: str = "") -> Path:
    data = "" if tasks else f"data: {{path: {root / 'mixed.jsonl'}}}\nreward: {{function: exact, num_workers: 0}}\n"
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"steps: {steps}\nmodel: {{path: {root / 'model'}, device: cpu}}\n"
        "rollout: {group_size: 2, prompts_per_step: 8, max_new_tokens: 4, temperature: 0.7}\n"
        "eval: {every: 0}\nlora: {rank: 4, alpha: 8}\noptim: {lr: 1e-2}\n"
        f"logging: {{run_dir: {run_dir}, backends: [], progress: false}}\n"
        + (f"algorithm: {algorithm}\n" if algorithm else "")
        + data
        + tasks
    )
    return path


def _run(root: Path, run_dir: Path, algorithm: str, steps: int = 1, tasks: str = "") -> RLRun:
    return RLRun(parse_config(["--config", str(_config_file(root, run_dir, algorithm, steps, tasks))]))


def test_sources_naming_one_path_share_one_teacher(setup, tmp_path, monkeypatch):
    """Two sources, one teacher path: the teacher is loaded once, both sources have that model, and
    a step runs one teacher forward over both sources' samples."""
    from archon.rl.run import loop

    loads, forwards = [], []
    load_teacher, teacher_logprobs = loop.load_teacher, rollouts.teacher_logprobs
    monkeypatch.setattr(loop, "load_teacher", lambda path, *args: loads.append(path) or load_teacher(path, *args))
    monkeypatch.setattr(rollouts, "teacher_logprobs", lambda *args: forwards.append(1) or teacher_logprobs(*args))
    teacher = setup / "teacher_a"
    run = _run(
        setup,
        tmp_path / "run",
        f"{{teachers: [{{data_source: add, path: {teacher}}}, {{data_source: sub, path: {teacher}/.}}]}}",
    )
    (task,) = run.tasks
    assert loads == [str(teacher)]
    assert task.teachers["add"] is task.teachers["sub"]
    assert task.teacher is None  # no default teacher
    run.run()
    assert len(forwards) == 1


def test_a_source_not_listed_takes_the_default_teacher(setup, tmp_path):
    run = _run(
        setup,
        tmp_path / "run",
        f"{{teacher_path: {setup / 'teacher_b'}, teachers: [{{data_source: add, path: {setup / 'teacher_a'}}}]}}",
    )
    try:
        (task,) = run.tasks
        assert set(task.teachers) == {"add", "sub"}
        assert task.teachers["sub"] is task.teacher
        assert task.teachers["add"] is not task.teacher
        assert run.teachers[str((setup / "teacher_a").resolve())] is task.teachers["add"]
    finally:
        run.close()


def test_a_source_without_a_teacher_is_an_error_at_start(setup, tmp_path):
    algorithm = f"{{teachers: [{{data_source: add, path: {setup / 'teacher_a'}}}]}}"
    with pytest.raises(ValueError) as error:
        _run(setup, tmp_path / "run", algorithm)
    message = str(error.value)
    assert "algorithm.teachers:" in message and "have data_source 'sub'" in message
    assert "mixed.jsonl:" in message  # a row of that source
    assert "add {data_source: 'sub', path: ...} to algorithm.teachers or set algorithm.teacher_path" in message


def test_teacher_settings_are_checked(setup, tmp_path):
    teacher = setup / "teacher_a"
    config = parse_config(["--config", str(_config_file(setup, tmp_path / "run", f"{{teacher_path: {teacher}}}"))])
    bad = AlgorithmConfig(
        teachers=(
            TeacherConfig("add", str(teacher)),
            TeacherConfig("add", str(teacher)),
            TeacherConfig("", "x"),
            TeacherConfig("sub", str(tmp_path / "nowhere")),
        ),
    )
    import dataclasses

    with pytest.raises(ValueError) as error:
        validate(dataclasses.replace(config, algorithm=bad))
    message = str(error.value)
    assert "algorithm.teachers[1].data_source='add': already has a teacher (algorithm.teachers[0])" in message
    assert "algorithm.teachers[2].data_source='': must name a data source" in message
    assert f"algorithm.teachers[3].path={str(tmp_path / 'nowhere')!r}: no config.json there" in message
    with pytest.raises(ValueError, match="neither algorithm.teacher_path nor algorithm.teachers is set"):
        validate(dataclasses.replace(config, algorithm=AlgorithmConfig(distillation_weight=0.5)))


def _source_of(tokenizer, sequence: list[int]) -> str:
    text = tokenizer.decode(sequence)
    return "add" if "+" in text.split("=")[0] else "sub"


@pytest.mark.parametrize("tasks", [False, True], ids=["one-task", "two-tasks"])
def test_a_run_distills_each_source_from_its_teacher(setup, tmp_path, monkeypatch, tasks):
    """Two steps of a run (alone, or as one of two tasks beside a GRPO task) with a teacher per
    source: the trained batch's advantages are each sample's own teacher's, and the per-source
    metrics are the mean log-prob gaps of that source's tokens."""
    from transformers import AutoTokenizer

    from archon.rl.run import loop

    seen = []
    prepare = loop.RLRun.prepare

    def recording(self, *args):
        batch, prepared, score_s = prepare(self, *args)
        seen.append(batch)
        return batch, prepared, score_s

    monkeypatch.setattr(loop.RLRun, "prepare", recording)
    algorithm = (
        f"{{teachers: [{{data_source: add, path: {setup / 'teacher_a'}}}, "
        f"{{data_source: sub, path: {setup / 'teacher_b'}}}]}}"
    )
    run_dir = tmp_path / "run"
    if tasks:
        task = (
            "  - name: {name}\n    data: {{path: {data}}}\n    reward: {{function: exact, num_workers: 0}}\n"
            "    lora: {{rank: 4, alpha: 8}}\n    algorithm: {algorithm}\n"
        )
        listed = "tasks:\n" + task.format(name="plain", data=setup / "train.jsonl", algorithm="{name: grpo}")
        listed += task.format(name="mopd", data=setup / "mixed.jsonl", algorithm=algorithm)
        run = _run(setup, run_dir, "", steps=2, tasks=listed)
    else:
        run = _run(setup, run_dir, algorithm, steps=2)
    run.run()
    prefix = "mopd/" if tasks else ""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(setup / "model")
    teacher_of = {"add": setup / "teacher_a", "sub": setup / "teacher_b"}
    for batch, record in zip(seen, records[-2:]):
        bounds = batch.cu_seqlens.tolist()
        of_task = [i for i in range(batch.num_sequences) if not tasks or int(batch.extras["task"][bounds[i]]) == 1]
        gaps = {"add": [0.0, 0.0], "sub": [0.0, 0.0]}
        for i in of_task:
            sequence = batch.tokens[bounds[i] : bounds[i + 1]].tolist()
            source = _source_of(tokenizer, sequence)
            span = slice(bounds[i], bounds[i + 1])
            teacher = torch.zeros(len(sequence))
            teacher[:-1] = _hf_logprobs(teacher_of[source], sequence, TEMPERATURE)
            mask = batch.loss_mask[span]
            old = batch.old_logprobs[span]
            assert torch.allclose(batch.advantages[span], (teacher - old) * mask, atol=1e-5, rtol=0)
            gaps[source][0] += float(((old - teacher) * mask).sum())
            gaps[source][1] += float(mask.sum())
        assert gaps["add"][1] > 0 and gaps["sub"][1] > 0, "the step's prompts should mix both sources"
        for source, (total, count) in gaps.items():
            assert record[f"{prefix}distill_logprob_gap/{source}"] == pytest.approx(total / count, abs=1e-5)
        both = (gaps["add"][0] + gaps["sub"][0]) / (gaps["add"][1] + gaps["sub"][1])
        assert record[f"{prefix}distill_logprob_gap"] == pytest.approx(both, abs=1e-5)
    if tasks:
        assert not any(key.startswith("plain/distill") for key in records[-1])
    # the adapter's model card names the teachers
    from huggingface_hub import ModelCard

    card = ModelCard.load((run_dir / "tasks" / "mopd" if tasks else run_dir) / "adapter" / "README.md")
    assert "on-policy-distillation" in card.data.tags
    assert f"| teacher of `add` | `{setup / 'teacher_a'}` |" in card.text
    assert f"| teacher of `sub` | `{setup / 'teacher_b'}` |" in card.text
    assert "- data sources: `add` " in card.text
    if tasks:
        assert "task `mopd` of the run" in card.text


@pytest.mark.slow
def test_a_two_rank_run_equals_the_one_process_run(setup, tmp_path):
    """The run with a teacher per source on two data-parallel ranks (each a share of the prompts,
    scoring its own samples with their sources' teachers) trains on the same recorded rollouts as
    one process (tests/multi_task_worker.py): the per-source log-prob gaps (summed over the ranks),
    losses, gradient norms and final adapter equal the one-process run's."""
    import os
    import subprocess
    import sys

    from helpers import assert_close_reporting
    from safetensors.torch import load_file

    algorithm = (
        f"{{teachers: [{{data_source: add, path: {setup / 'teacher_a'}}}, "
        f"{{data_source: sub, path: {setup / 'teacher_b'}}}], distillation_weight: 0.5}}"
    )
    worker = Path(__file__).with_name("multi_task_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(worker.parent)}
    runs = {}
    for name, launcher, mode in (
        ("one", [], "record"),
        ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"], "replay"),
    ):
        run_dir = tmp_path / name
        config = _config_file(setup, run_dir, algorithm, steps=2)
        cmd = [
            sys.executable,
            *launcher,
            str(worker),
            mode,
            str(tmp_path / "rollouts.pkl"),
            "--config",
            str(config),
            "--optim.lr",
            "1e-3",
            "--model.dtype",
            "float64",
        ]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        runs[name] = run_dir
    one, two = ({r["step"]: r for r in _records_of(runs[name])} for name in ("one", "two"))
    for step in (1, 2):
        keys = ["loss", "grad_norm", "distill_logprob_gap", "distill_logprob_gap/add", "distill_logprob_gap/sub"]
        for key in keys:
            # both runs in float64 (multi_task_worker.py): float64 rounding is left, far below this
            assert_close_reporting(two[step][key], one[step][key], 1e-10, f"step {step} {key}")
    expected = load_file(str(runs["one"] / "adapter" / "adapter_model.safetensors"))
    got = load_file(str(runs["two"] / "adapter" / "adapter_model.safetensors"))
    assert expected.keys() == got.keys()
    for key in expected:
        assert_close_reporting(got[key], expected[key], 1e-10, f"adapter {key}")


def _records_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_source_teacher_with_another_tokenizer_is_refused_naming_its_entry(setup, tmp_path):
    from test_bad_input_config import _teacher

    other = _teacher(setup / "model", tmp_path / "other", "tokenizer")
    algorithm = (
        f"{{teachers: [{{data_source: add, path: {setup / 'teacher_a'}}}, {{data_source: sub, path: {other}}}]}}"
    )
    with pytest.raises(ValueError, match=r"algorithm\.teachers\[1\]\.path='.*other': the teacher's tokenizer gives"):
        _run(setup, tmp_path / "run", algorithm)


def test_a_teacher_of_a_source_the_data_lacks_is_not_loaded(setup, tmp_path, monkeypatch, caplog):
    import shutil

    from archon.rl.run import loop

    unused = shutil.copytree(setup / "teacher_a", tmp_path / "code_teacher")
    loads = []
    load_teacher = loop.load_teacher
    monkeypatch.setattr(loop, "load_teacher", lambda path, *args: loads.append(path) or load_teacher(path, *args))
    run = _run(
        setup,
        tmp_path / "run",
        f"{{teacher_path: {setup / 'teacher_a'}, teachers: [{{data_source: code, path: {unused}}}]}}",
    )
    try:
        assert loads == [str(setup / "teacher_a")]
        assert set(run.tasks[0].teachers) == {"add", "sub"}
        assert "algorithm.teachers[0].data_source='code': no training prompt of" in caplog.text
    finally:
        run.close()
