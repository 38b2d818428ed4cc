"""Scaffold a model family from an existing one, so the add-model guide starts from working code.

    python -m archon.tools.new_model NAME --like FAMILY [--model-type HF_TYPE] [--like-type HF_TYPE]

Copies models/FAMILY/ to models/NAME/ with its classes renamed (`LlamaArgs` -> `MistralArgs`,
`archon.models.llama` -> `archon.models.mistral`), makes the ModelSpec serve HF_TYPE (default NAME) with the
tiny config of the like-family's type, appends the registration line to models/__init__.py and
writes tests/models/test_NAME.py from the like-family's test. Nothing is overwritten: an
existing folder or test file is an error. When HF_TYPE is architecturally the like-family's
type, the scaffold passes `python -m archon.tools.align --model-type HF_TYPE` as written.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

_NAME = re.compile(r"[a-z][a-z0-9_]*")
_TEXT_SUFFIXES = (".py", ".md")


@dataclass
class NewModelArgs:
    name: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="NAME")]
    """Name of the new family: its folder models/NAME/ (lower_snake_case)."""
    like: str
    """The existing family (folder in models/) to start from."""
    model_type: str | None = None
    """HF config.model_type the new family serves; default NAME."""
    like_type: str | None = None
    """Which of the like-family's HF model types to start from (its tiny config); default its first."""
    root: Path | None = None
    """Repository root holding models/ and tests/; default: where the `models` package is imported from."""


@dataclass
class Scaffold:
    family_dir: Path
    test_file: Path
    registry_file: Path
    model_type: str
    like_mentions: list[str]
    """`file:line: text` of the lines that still name the like-family (docstrings, messages) to rewrite."""
    changed_lines: list[str]
    """`file:line: new text  (was: old text)` for every line the scaffold changed from the like-family's
    files: renamed classes and imports, the ModelSpec, the test's model type. Renames also reach
    comments and strings, so each one is for review."""


def default_root() -> Path:
    found = importlib.util.find_spec("archon.models")
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError("cannot locate the `archon.models` package (the repository's models/); pass --root")
    return Path(list(found.submodule_search_locations)[0]).parent


def families(models_dir: Path) -> list[str]:
    return sorted(p.name for p in models_dir.iterdir() if (p / "spec.py").is_file())


def camel(name: str) -> str:
    """gpt_oss -> GptOss, qwen3 -> Qwen3."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def class_prefix(family_dir: Path, family: str) -> str:
    """The prefix of the family's class names, read from its `<Prefix>Args` class."""
    args_file = family_dir / "args.py"
    if args_file.is_file():
        match = re.search(r"^class (\w+)Args\b", args_file.read_text(), flags=re.M)
        if match:
            return match.group(1)
    return camel(family)


class Renamer:
    """Text substitutions that turn the like-family's identifiers into the new family's."""

    def __init__(self, like: str, name: str, like_prefix: str, new_prefix: str) -> None:
        self.like_prefix = like_prefix
        self._rules = [
            (re.compile(rf"\barchon\.models\.{like}\b"), f"archon.models.{name}"),
            (re.compile(rf"\bfrom archon\.models import {like}\b"), f"from archon.models import {name}"),
            (re.compile(rf"\b{like_prefix}(?=[A-Z])"), new_prefix),  # LlamaArgs, LlamaModel, ...
            (re.compile(rf"\b{like.upper()}(?=_)"), name.upper()),  # LLAMA_CASES
            (re.compile(rf"(?<=_){like}\b"), name),  # parallelize_llama, test_llama
            (re.compile(rf"\b{like}(?=_)"), name),  # llama_plan
        ]

    def __call__(self, text: str) -> str:
        for pattern, replacement in self._rules:
            text = pattern.sub(replacement, text)
        return text


def _replace_segments(source: str, edits: list[tuple[ast.AST, str]]) -> str:
    """Replace the source of each AST node with new text (node offsets are UTF-8 byte columns)."""
    data = source.encode()
    line_starts = [0]
    for line in data.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    spans = []
    for node, text in edits:
        start = line_starts[node.lineno - 1] + node.col_offset
        end = line_starts[node.end_lineno - 1] + node.end_col_offset
        spans.append((start, end, text.encode()))
    for start, end, text in sorted(spans, reverse=True):
        data = data[:start] + text + data[end:]
    return data.decode()


def _model_spec_call(tree: ast.AST, spec_file: Path) -> ast.Call:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ModelSpec":
            return node
    raise ValueError(f"{spec_file} has no ModelSpec(...) call to adapt")


def _keyword(call: ast.Call, name: str, spec_file: Path) -> ast.expr:
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    raise ValueError(f"ModelSpec(...) in {spec_file} does not set {name}= as a keyword")


def like_model_types(spec_file: Path) -> tuple[str, ...]:
    call = _model_spec_call(ast.parse(spec_file.read_text()), spec_file)
    value = _keyword(call, "hf_model_types", spec_file)
    try:
        return tuple(ast.literal_eval(value))
    except ValueError:
        raise ValueError(f"hf_model_types in {spec_file} must be a literal tuple of strings") from None


def adapt_spec(source: str, spec_file: Path, name: str, model_type: str, like_type: str) -> str:
    """Make the ModelSpec call name the new family and serve `model_type` with `like_type`'s tiny config."""
    call = _model_spec_call(ast.parse(source), spec_file)
    edits: list[tuple[ast.AST, str]] = [
        (_keyword(call, "name", spec_file), f'"{name}"'),
        (_keyword(call, "hf_model_types", spec_file), f'("{model_type}",)'),
    ]
    tiny = next((k.value for k in call.keywords if k.arg == "tiny_hf_config"), None)
    if tiny is not None:
        if not isinstance(tiny, ast.Dict):
            raise ValueError(f"tiny_hf_config in {spec_file} must be a dict literal keyed by model_type")
        for key, value in zip(tiny.keys, tiny.values):
            if isinstance(key, ast.Constant) and key.value == like_type:
                # Keep the entry's own indentation so its multi-line value stays aligned.
                lines = source.splitlines()
                entry_indent = " " * key.col_offset
                closing_indent = re.match(r"\s*", lines[tiny.end_lineno - 1]).group(0)
                if tiny.lineno == tiny.end_lineno:
                    text = f'{{"{model_type}": {ast.get_source_segment(source, value)}}}'
                else:
                    text = (f'{{\n{entry_indent}"{model_type}": {ast.get_source_segment(source, value)},'
                            f"\n{closing_indent}}}")
                edits.append((tiny, text))
                break
        else:
            raise ValueError(f"tiny_hf_config in {spec_file} has no entry for {like_type!r}")
    renderers = next((k.value for k in call.keywords if k.arg == "renderers"), None)
    if renderers is not None:
        # the new family speaks the like-family's chat format until it has a renderer of its own
        try:
            like_renderer = ast.literal_eval(renderers)[like_type]
        except (ValueError, KeyError):
            raise ValueError(f"renderers in {spec_file} must be a dict literal with an entry for {like_type!r}") from None
        edits.append((renderers, f'{{"{model_type}": "{like_renderer}"}}'))
    return _replace_segments(source, edits)


def is_renderer_module(path: Path) -> bool:
    """A family's chat-format module (renderer.py, <format>_renderer.py): it registers renderers by
    name, so a scaffold does not copy it (the new family's spec names the like-family's renderer)."""
    return path.suffix == ".py" and (path.stem == "renderer" or path.stem.endswith("_renderer"))


def drop_renderer_imports(init_source: str, like: str) -> str:
    """A family's __init__.py without the lines that import its renderer modules."""
    return re.sub(rf"^from archon\.models\.{like} import \w*renderer\b.*\n", "", init_source, flags=re.M)


def adapt_test(source: str, like_type: str, model_type: str) -> str:
    return re.sub(rf"([\"']){re.escape(like_type)}\1", lambda m: f"{m.group(1)}{model_type}{m.group(1)}", source)


def generic_test(name: str, model_type: str) -> str:
    return f'''"""{camel(name)} against HF transformers and PEFT."""

import pytest
from family_checks import assert_aligned, assert_meta_weights_complete, assert_state_dict_round_trip

MODEL_TYPE = "{model_type}"
# Tiny-config overrides (on top of the ModelSpec's tiny_hf_config) that exercise the family's features.
CASES = {{"tiny": {{}}}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    assert_aligned(MODEL_TYPE, CASES[case], lora_rank=8)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(MODEL_TYPE, **CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    assert_meta_weights_complete(MODEL_TYPE, CASES[case])
'''


def register_line(registry_source: str, name: str) -> str | None:
    """The line to append to models/__init__.py, or None when the family is imported already."""
    if re.search(rf"^\s*(from archon\.models import {name}\b|import archon\.models\.{name}\b|from archon\.models\.{name}\b)",
                 registry_source, flags=re.M):
        return None
    return f"from archon.models import {name}  # noqa: F401\n"


def scaffold(args: NewModelArgs) -> Scaffold:
    if not _NAME.fullmatch(args.name):
        raise ValueError(f"family name {args.name!r} must be lower_snake_case (letters, digits, _)")
    root = (args.root or default_root()).resolve()
    models_dir = root / "models"
    like_dir = models_dir / args.like
    if not (like_dir / "spec.py").is_file():
        raise FileNotFoundError(
            f"no family {args.like!r} in {models_dir} (no {args.like}/spec.py); "
            f"families: {', '.join(families(models_dir))}"
        )
    family_dir = models_dir / args.name
    test_file = root / "tests" / "models" / f"test_{args.name}.py"
    registry_file = models_dir / "__init__.py"
    for existing in (family_dir, test_file):
        if existing.exists():
            raise FileExistsError(f"{existing} already exists; refusing to overwrite it")
    if not registry_file.is_file():
        raise FileNotFoundError(f"{registry_file} does not exist; it registers the families")

    like_types = like_model_types(like_dir / "spec.py")
    like_type = args.like_type or like_types[0]
    if like_type not in like_types:
        raise ValueError(f"--like-type {like_type!r} is not served by {args.like!r}; it serves {list(like_types)}")
    model_type = args.model_type or args.name
    rename = Renamer(args.like, args.name, class_prefix(like_dir, args.like), camel(args.name))

    # Render everything before writing anything.
    outputs: dict[Path, str | bytes] = {}
    originals: dict[Path, str] = {}
    for src in sorted(like_dir.rglob("*")):
        if not src.is_file() or "__pycache__" in src.parts or src.suffix == ".pyc" or is_renderer_module(src):
            continue
        dest = family_dir / src.relative_to(like_dir)
        if src.suffix in _TEXT_SUFFIXES:
            text = originals[dest] = src.read_text()
            if src.relative_to(like_dir) == Path("spec.py"):
                text = adapt_spec(text, src, args.name, model_type, like_type)
            elif src.relative_to(like_dir) == Path("__init__.py"):
                text = drop_renderer_imports(text, args.like)
            outputs[dest] = rename(text)
        else:
            outputs[dest] = src.read_bytes()
    like_test = root / "tests" / "models" / f"test_{args.like}.py"
    if like_test.is_file():
        originals[test_file] = like_test.read_text()
        outputs[test_file] = rename(adapt_test(originals[test_file], like_type, model_type))
    else:
        outputs[test_file] = generic_test(args.name, model_type)

    written: list[Path] = []
    try:
        for dest, content in outputs.items():
            dest.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                dest.write_bytes(content)
            else:
                dest.write_text(content)
            written.append(dest)
    except BaseException:
        shutil.rmtree(family_dir, ignore_errors=True)
        test_file.unlink(missing_ok=True)
        raise
    registry = registry_file.read_text()
    line = register_line(registry, args.name)
    if line is not None:
        registry_file.write_text(registry + ("" if registry.endswith("\n") else "\n") + line)
    changed = [line for dest, original in originals.items() for line in _changed_lines(dest, original, outputs[dest])]
    return Scaffold(family_dir, test_file, registry_file, model_type, _mentions(written, args.like, rename), changed)


def _changed_lines(path: Path, before: str, after: str) -> list[str]:
    old_lines, new_lines = before.splitlines(), after.splitlines()
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if i2 - i1 == j2 - j1:  # line for line
            pairs = [(j, old_lines[i].strip()) for i, j in zip(range(i1, i2), range(j1, j2))]
        else:  # the new lines stand for the old block as a whole
            block = " / ".join(line.strip() for line in old_lines[i1:i2]) or "nothing"
            pairs = [(j, block) for j in range(j1, j2)]
        out += [f"{path}:{j + 1}: {new_lines[j].strip()}  (was: {was})" for j, was in pairs]
    return out


def _mentions(files: list[Path], like: str, rename: Renamer) -> list[str]:
    like_word = re.compile(rf"(?i)\b{like.replace('_', '[-_ ]?')}\b|{rename.like_prefix}")
    out = []
    for path in files:
        if path.suffix not in _TEXT_SUFFIXES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if like_word.search(line):
                out.append(f"{path}:{number}: {line.strip()}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(NewModelArgs, args=argv)
    try:
        result = scaffold(args)
    except (FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"new_model: {err}", file=sys.stderr)
        return 1
    print(f"created {result.family_dir}/ ({', '.join(sorted(p.name for p in result.family_dir.iterdir()))})")
    print(f"created {result.test_file}")
    print(f"registered in {result.registry_file}")
    print(f"lines changed from {args.like!r} (review each: renames reach comments and strings too):")
    for change in result.changed_lines:
        print(f"  {change}")
    if result.like_mentions:
        print(f"lines that still name {args.like!r} (rewrite or confirm):")
        for mention in result.like_mentions:
            print(f"  {mention}")
    print("next: follow skills/add-model/SKILL.md, then gate with")
    print(f"  python -m archon.tools.align --model-type {result.model_type} --lora-rank 8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
