"""Every code block of README.md and docs/*.md is run or checked; a block that fails fails its test.

A block's info string is its kind, then options (```bash no-run: REASON, ```yaml file=NAME):

- python: run, in a working directory of its page. The placeholder "path/to/hf_checkpoint" stands
  for a tiny random-weight Qwen3 checkpoint (with the tokenizer-free layout the tests use).
- yaml, toml: loaded with archon's config loader (archon.rl.config.load_config_file) and validated
  (archon.rl.config.validate), model and data paths that do not exist standing for a tiny
  checkpoint and a small JSONL file.
- bash, sh, shell: split into commands. A command that launches recipes/grpo_lora.py is parsed with
  the recipe's own parser (archon.rl.config.parse_config, world size from torchrun's
  --nproc_per_node × --nnodes) and validated as above, never trained. Other commands are run, unless
  the block says `no-run: REASON`: then the reason is printed, and the repository paths and the
  archon modules and names its commands use must exist.
- text tree: a layout tree; every path it names must exist.

`file=NAME` (python, yaml, toml) also writes the block to NAME in the working directory of the
page's other blocks (a config file that a command passes with --config, a reward
module that a config names). Any other kind of block is an error.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKPOINT_PLACEHOLDER = "path/to/hf_checkpoint"
# A hang guard, not a speed check: the README's align block takes ~40 s on 2 idle cores and
# passed 120 s when other jobs loaded the machine.
RUN_TIMEOUT_S = 300


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    kind: str
    options: str
    text: str

    @property
    def file_name(self) -> str | None:
        match = re.search(r"(?:^|\s)file=(\S+)", self.options)
        return match.group(1) if match else None

    @property
    def no_run_reason(self) -> str | None:
        match = re.search(r"(?:^|\s)no-run:?\s*(.*)", self.options)
        return match.group(1).strip() or "(no reason given)" if match else None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}:{self.kind}"


def read_blocks(page: Path) -> list[Block]:
    blocks, lines, i = [], page.read_text(encoding="utf-8").split("\n"), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,}|~{3,})(.*)$", lines[i])
        if not fence:
            i += 1
            continue
        indent, marker, info = fence.groups()
        kind, _, options = info.strip().partition(" ")
        if kind == "text" and options.split()[:1] == ["tree"]:
            kind, options = "text tree", options[len("tree") :]
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(marker):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        assert j < len(lines), f"{page}:{i + 1}: code block never closed"
        blocks.append(Block(page, i + 1, kind, options.strip(), "\n".join(body) + "\n"))
        i = j + 1
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]


# ---- stand-ins for the paths the docs name --------------------------------------------------------


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """A tiny random-weight Qwen3 checkpoint (long enough a context for every documented
    max_new_tokens) and a JSONL data file."""
    from archon.tools.align import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("stand_ins")
    checkpoint = make_tiny_hf_checkpoint("qwen3", root / "hf_checkpoint", max_position_embeddings=40960)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(8)))
    return checkpoint, data


def _replaced(instance, dotted: str, value):
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(instance, **{head: value})
    return dataclasses.replace(instance, **{head: _replaced(getattr(instance, head), rest, value)})


def _get(instance, dotted: str):
    for name in dotted.split("."):
        instance = getattr(instance, name)
    return instance


MODEL_PATHS = ("model.path", "model.tokenizer", "algorithm.teacher_path")
DATA_PATHS = ("data.path", "eval.path")
TASK_MODEL_PATHS = ("algorithm.teacher_path",)
TASK_DATA_PATHS = ("data.path", "eval_path")


def mtp_stand_in(root: Path) -> Path:
    """A tiny DeepSeek-V3 checkpoint with an MTP layer, made once under `root`: the stand-in model of
    a config that loads or trains MTP layers (the Qwen3 stand-in has none)."""
    from helpers import add_mtp_weights

    from archon.tools.align import make_tiny_hf_checkpoint

    path = root / "mtp_checkpoint"
    if not (path / "config.json").is_file():
        add_mtp_weights(make_tiny_hf_checkpoint("deepseek_v3", path), "num_nextn_predict_layers")
    return path


def with_stand_ins(config, stand_ins, substituted: list[str]):
    """`config` with each model or data path that does not exist replaced by a stand-in."""
    checkpoint, data = stand_ins
    if config.model.mtp == "load" or any(task.algorithm.mtp_loss_weight > 0 for task in config.task_configs()):
        checkpoint = mtp_stand_in(checkpoint.parent)

    def swap(instance, fields, stand_in, prefix):
        for name in fields:
            value = _get(instance, name)
            if value and not Path(value).exists() and not value.startswith("reasoning_gym:"):  # validated as it is
                substituted.append(f"{prefix}{name}={value} -> {stand_in.name}")
                instance = _replaced(instance, name, str(stand_in))
        return instance

    def swap_teachers(instance, prefix):  # algorithm.teachers[i].path
        teachers = tuple(
            swap(teacher, ("path",), checkpoint, f"{prefix}algorithm.teachers[{j}].")
            for j, teacher in enumerate(instance.algorithm.teachers)
        )
        return dataclasses.replace(instance, algorithm=dataclasses.replace(instance.algorithm, teachers=teachers))

    config = swap(config, MODEL_PATHS, checkpoint, "")
    config = swap_teachers(swap(config, DATA_PATHS, data, ""), "")
    tasks = []
    for i, task in enumerate(config.tasks):
        task = swap_teachers(swap(task, TASK_MODEL_PATHS, checkpoint, f"tasks[{i}]."), f"tasks[{i}].")
        tasks.append(swap(task, TASK_DATA_PATHS, data, f"tasks[{i}]."))
    return dataclasses.replace(config, tasks=tuple(tasks))


# ---- a page's working directory ----------------------------------------------------------------------


@pytest.fixture
def workdir(block_under_test: Block, tmp_path, monkeypatch):
    """A working directory on sys.path holding the page's other `file=` blocks."""
    for block in BLOCKS:
        if block.page == block_under_test.page and block is not block_under_test and block.file_name:
            (tmp_path / block.file_name).write_text(block.text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for block in BLOCKS:  # modules written for this block must not answer for another page's
        if block.page == block_under_test.page and block.file_name and block.file_name.endswith(".py"):
            sys.modules.pop(block.file_name[: -len(".py")], None)


@pytest.fixture
def block_under_test(request):
    return request.param


# ---- the kinds -------------------------------------------------------------------------------------


def run_python(block: Block, workdir: Path, stand_ins) -> None:
    source = block.text.replace(CHECKPOINT_PLACEHOLDER, str(stand_ins[0]))
    if block.file_name:
        (workdir / block.file_name).write_text(block.text, encoding="utf-8")
    code = compile(source, block.id, "exec")
    exec(code, {"__name__": "__main__", "__file__": str(workdir / (block.file_name or "block.py"))})


def check_config_file(block: Block, workdir: Path, stand_ins) -> None:
    from archon.rl.config import load_config_file, validate

    path = workdir / (block.file_name or f"block.{block.kind}")
    path.write_text(block.text, encoding="utf-8")
    substituted: list[str] = []
    config = with_stand_ins(load_config_file(path), stand_ins, substituted)
    print(f"{block.id}: loaded; stand-ins: {substituted or 'none'}")
    validate(config, world_size=1)


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a shell block, each as its words (comments dropped, continuations joined,
    `&&` and `;` split)."""
    commands = []
    for line in text.replace("\\\n", " ").split("\n"):
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in words:
            if word in ("&&", ";", "||"):
                commands.append(current)
                current = []
            else:
                current.append(word)
        commands.append(current)
    return [c for c in commands if c]


def without_env_assignments(words: list[str]) -> list[str]:
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        i += 1
    return words[i:]


def world_size(words: list[str]) -> int:
    """Processes a launch starts: torchrun's --nproc_per_node × --nnodes, else 1."""
    if Path(words[0]).name != "torchrun":
        return 1

    def option(name: str, default: int) -> int:
        for i, word in enumerate(words):
            for spelling in (name, name.replace("_", "-")):
                if word == spelling:
                    return int(words[i + 1])
                if word.startswith(spelling + "="):
                    return int(word.split("=", 1)[1])
        return default

    return option("--nproc_per_node", 1) * option("--nnodes", 1)


def check_recipe_launch(words: list[str], stand_ins, monkeypatch, label: str) -> None:
    """Parse the launch's flags with the recipe's parser and validate them, stand-ins for paths."""
    import archon.rl.config as config_module
    from archon.recipes.grpo_lora import recipe_argv

    script = next(i for i, w in enumerate(words) if w.endswith("recipes/grpo_lora.py"))
    argv = recipe_argv(words[script + 1 :])
    if "--config" in argv:  # a repository file, or one an earlier block of the page wrote
        i = argv.index("--config") + 1
        if not Path(argv[i]).exists() and (ROOT / argv[i]).exists():
            argv[i] = str(ROOT / argv[i])
    import archon.rl.config.cli as cli

    validate = cli.validate
    substituted: list[str] = []
    monkeypatch.setattr(cli, "validate", lambda config: validate(with_stand_ins(config, stand_ins, substituted)))
    monkeypatch.setenv("WORLD_SIZE", str(world_size(words)))
    try:
        config_module.parse_config(argv)
    except SystemExit as e:  # tyro's answer to a flag it does not take
        pytest.fail(f"{label}: the recipe's parser refused {shlex.join(words)} (exit {e.code})")
    print(f"{label}: parsed {shlex.join(words)} (world size {world_size(words)}); stand-ins: {substituted or 'none'}")


REPO_PATH = re.compile(r"(?<![\w./-])((?:archon|benchmarks|docs|models|recipes|skills|tests|\.ci)/[\w./-]*\w)")
ARCHON_NAME = re.compile(r"(?<![\w./-])(archon(?:\.\w+)+)")


def check_names_exist(text: str, label: str) -> None:
    """The repository paths and archon modules (and the names in them) that `text` uses exist."""
    for path in REPO_PATH.findall(text):
        assert (ROOT / path).exists(), f"{label}: {path} does not exist"
    for dotted in ARCHON_NAME.findall(text):
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            module = ".".join(parts[:n])
            try:
                spec = importlib.util.find_spec(module)
            except ModuleNotFoundError:
                spec = None
            if spec is not None:
                break
        assert spec is not None and spec.origin, f"{label}: no module {dotted}"
        if n < len(parts):
            name = parts[n]
            source = Path(spec.origin).read_text(encoding="utf-8")
            assert re.search(rf"^(?:class|def) {name}\b|^{name}\s*[:=]", source, re.M), (
                f"{label}: {module} defines no {name}"
            )


ENV_LINE = re.compile(r"^\s*(#.*)?$|^\s*(export\s|if\s)|^\s*[A-Za-z_][A-Za-z0-9_]*=\S*\s*(#.*)?$")


COMMAND_SEPARATOR = re.compile(r"\s(?:&&|\|\||;)\s")


def logical_lines(text: str) -> list[str]:
    """A shell block's lines, continuations joined."""
    return text.replace("\\\n", " ").split("\n")


def env_prelude(block: Block) -> str:
    """The page's environment before `block`: the lines of its earlier shell blocks that only set
    variables (exports, assignments, `if ...; then export ...; fi`)."""
    lines = []
    for earlier in BLOCKS:
        if earlier.page != block.page or earlier.line >= block.line or earlier.kind not in ("bash", "sh", "shell"):
            continue
        block_lines = logical_lines(earlier.text)
        if all(ENV_LINE.match(line) for line in block_lines):
            lines += block_lines
    return "\n".join(lines)


def expanded(line: str, prelude: str, label: str) -> list[str]:
    """The words of a command line after the shell's expansions, in the page's environment."""
    script = f"{prelude}\nprintf '%s\\0' {line}"
    result = subprocess.run(["bash", "-euc", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"{label}: expanding {line!r} failed:\n{result.stderr}"
    return result.stdout.split("\0")[:-1]


def check_shell(block: Block, workdir: Path, stand_ins, monkeypatch) -> None:
    reason = block.no_run_reason
    if reason is not None:
        print(f"{block.id}: not run: {reason}")
        check_names_exist(block.text, block.id)
    prelude = env_prelude(block)
    for line in logical_lines(block.text):
        if ENV_LINE.match(line):
            prelude += "\n" + line
            if reason is None and line.strip() and not line.strip().startswith("#"):
                result = subprocess.run(["bash", "-euc", prelude], cwd=ROOT, capture_output=True, text=True, timeout=30)
                assert result.returncode == 0, f"{block.id}: {line!r} failed:\n{result.stderr}"
            continue
        if "recipes/grpo_lora.py" in line:
            # only the launch itself is expanded (by printf): the commands around it are not run
            launch = next(part for part in COMMAND_SEPARATOR.split(line) if "recipes/grpo_lora.py" in part)
            words = without_env_assignments(expanded(launch, prelude, block.id))
            check_recipe_launch(words, stand_ins, monkeypatch, block.id)
        if reason is not None or "recipes/grpo_lora.py" in line:
            continue
        for words in shell_commands(line):
            words = without_env_assignments(words)
            assert not INSTALLS.search(shlex.join(words)), (
                f"{block.id}: {shlex.join(words)} installs packages; mark the block `no-run: REASON`"
            )
            if words[0] in ("python", "python3"):
                words = [sys.executable, *words[1:]]
            result = subprocess.run(
                words,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            assert result.returncode == 0, f"{block.id}: {shlex.join(words)} failed:\n{result.stdout}\n{result.stderr}"
            print(f"{block.id}: ran {shlex.join(words)}")


def check_tree(block: Block) -> None:
    """Each entry of a layout tree (a name at two spaces a level, then its description) exists."""
    parents: list[str] = []
    for line in block.text.split("\n"):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        name = line.split()[0]
        if (
            indent % 2
            or indent // 2 > len(parents)
            or not re.match(r"^[\w.-]+/?$", name)
            or not (name.endswith("/") or "." in name)
        ):
            continue  # a description's continuation
        parents = parents[: indent // 2]
        path = "".join(parents) + name
        assert (ROOT / path).exists(), f"{block.id}: {path} does not exist"
        if name.endswith("/"):
            parents.append(name)


INSTALLS = re.compile(r"(^|\s)(pip3?|uv|conda|apt(-get)?)\s|-m pip\s")
KINDS = {"python", "yaml", "toml", "bash", "sh", "shell", "text tree"}


@pytest.mark.parametrize("block_under_test", BLOCKS, ids=[b.id for b in BLOCKS], indirect=True)
def test_code_block(block_under_test: Block, workdir, stand_ins, monkeypatch):
    block = block_under_test
    assert block.kind in KINDS, (
        f"{block.id}: a code block of kind {block.kind!r}; give it one of {sorted(KINDS)} (tests/test_docs.py)"
    )
    if block.kind == "python":
        run_python(block, workdir, stand_ins)
    elif block.kind in ("yaml", "toml"):
        check_config_file(block, workdir, stand_ins)
    elif block.kind == "text tree":
        check_tree(block)
    else:
        check_shell(block, workdir, stand_ins, monkeypatch)


def test_every_page_is_read():
    assert BLOCKS and {b.page.name for b in BLOCKS} >= {"README.md", "configuration.md", "models.md"}


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run runs the README's test command; each of its steps is one of .ci/run's."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash[^\n]*\n(.*?)```", readme.split("**Run the tests**", 1)[1], re.S).group(1)

    def normal(words: list[str]) -> list[str]:
        words = words[2:] if words[:2] in (["python", "-m"], ["python3", "-m"]) else words
        return [w for w in words if w not in ("-q", "-y")]

    ci = [normal(c) for c in shell_commands((ROOT / ".ci" / "run").read_text(encoding="utf-8"))]
    for command in shell_commands(block):
        assert normal(command) in ci, f"the README's test step {shlex.join(command)!r} is not in .ci/run"


def test_the_skill_calls_the_generation_cache_as_it_is():
    """Each `cache.<method>(...)` the add-model skill tells a layer to call is a method of
    LayerKVCache taking that many arguments."""
    import inspect

    from archon.rollout.kv_cache import LayerKVCache

    skill = (ROOT / "skills" / "add-model" / "SKILL.md").read_text()
    calls = re.findall(r"cache\.(\w+)\(([^()]*)\)", skill)
    assert {name for name, _ in calls} >= {"attention", "recurrent_state", "store_recurrent_state"}
    for name, arguments in calls:
        method = getattr(LayerKVCache, name, None)
        assert method is not None, f"SKILL.md calls cache.{name}, which LayerKVCache has not"
        given = [a for a in arguments.split(",") if a.strip()]
        parameters = list(inspect.signature(method).parameters.values())[1:]
        required = [p for p in parameters if p.default is inspect.Parameter.empty]
        assert len(required) <= len(given) <= len(parameters), (name, arguments, parameters)


# A measured figure: a decimal, a percentage, or a number in e-notation (not part of a name such as
# GLM-4.5 or a version such as 0.32.0).
FIGURE = re.compile(r"(?<![\w.,-])(\d+\.\d+(?:e-\d+)?%?|\d+(?:\.\d+)?e-\d+|\d+%)(?![\w.])")


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip("# ").lower()).replace(" ", "-")


def _readme_performance_quotes() -> list[tuple[str, str, str]]:
    """(anchor, README passage, performance.md section) for each README paragraph (with the table
    that follows it) that links a section of docs/performance.md."""
    performance = (ROOT / "docs" / "performance.md").read_text()
    sections = {_anchor(part.split("\n")[0]): part for part in re.split(r"\n(?=## )", performance)}
    blocks = re.split(r"\n\s*\n", (ROOT / "README.md").read_text())
    quotes = []
    for i, block in enumerate(blocks):
        table = blocks[i + 1] if i + 1 < len(blocks) and blocks[i + 1].lstrip().startswith("|") else ""
        for anchor in re.findall(r"docs/performance\.md#([\w-]+)", block):
            assert anchor in sections, f"README links docs/performance.md#{anchor}, which has no such section"
            quotes.append((anchor, block + "\n" + table, sections[anchor]))
    return quotes


def test_every_figure_the_readme_quotes_is_in_performance_md_with_its_command_and_date():
    """A figure in a README passage that cites docs/performance.md is there, in the cited section,
    beside the date the passage gives and the command that measured it; a passage with figures
    gives its date."""
    quotes = _readme_performance_quotes()
    assert {anchor for anchor, _, _ in quotes} >= {"the-demo", "multi-turn-rollouts", "long-context", "quantized-bases"}
    for anchor, passage, section in quotes:
        figures = FIGURE.findall(passage)
        if not figures:
            continue
        dates = re.findall(r"20\d\d-\d\d-\d\d", passage)
        assert dates, f"README passage citing performance.md#{anchor} quotes {figures[:3]} with no date"
        for date in dates:
            assert date in section, f"performance.md#{anchor} does not give the date {date} the README quotes"
        assert re.search(r"`[^`]*(python|torchrun)[^`]*`", section), f"performance.md#{anchor} names no command"
        for command in re.findall(r"`((?:python|torchrun)[^`]*)`", passage):
            if "benchmarks/" in command:
                assert command in section, f"performance.md#{anchor} lacks the README's command {command!r}"
        missing = sorted({figure for figure in figures if figure not in section})
        assert not missing, f"README figures {missing} (citing performance.md#{anchor}) are not in that section"
