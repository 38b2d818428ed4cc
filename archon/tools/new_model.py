"""Scaffold a model family from an existing one, so the add-model guide starts from working code.

    python -m archon.tools.new_model NAME --like FAMILY [--model-type HF_TYPE] [--like-type HF_TYPE] [--generic-test]

Copies models/FAMILY/ to models/NAME/ with its classes renamed (`LlamaArgs` -> `MistralArgs`,
`archon.models.llama` -> `archon.models.mistral`), makes the ModelSpec serve HF_TYPE (default NAME) with the
tiny config of the like-family's type (less the fields HF_TYPE's config class does not define, which HF
would keep without a word), appends the registration line to models/__init__.py and writes
tests/models/test_NAME.py from the like-family's test (--generic-test: the generic one). Nothing is overwritten: an
existing folder or test file is an error. When HF_TYPE is architecturally the like-family's
type, the scaffold passes `python -m archon.tools.align --model-type HF_TYPE` as written.
"""

from __future__ import annotations

import ast
import dataclasses
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
    """Repository root holding models/ and tests/; default: the current directory, which must be one."""
    generic_test: bool = False
    """Write the generic family test (parity, state-dict round trip, meta completeness) instead of a copy
    of the like-family's test, whose cases name the like-family's features."""


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
    dropped_tiny_fields: list[str] = dataclasses.field(default_factory=list)
    """Fields of the like-family's tiny config that the new type's HF config class does not define, left
    out of the new tiny config: HF config classes keep unknown keys without a word, so a copied
    `use_sliding_window` would look like a setting while nothing reads it."""


def is_checkout(path: Path) -> bool:
    return (path / "models" / "__init__.py").is_file() and (path / "archon" / "__init__.py").is_file()


def default_root() -> Path:
    """The current directory, when it is an archon checkout (models/ and archon/ side by side)."""
    cwd = Path.cwd()
    if not is_checkout(cwd):
        raise FileNotFoundError(
            f"{cwd} is not an archon checkout (no models/__init__.py and archon/__init__.py); run from the "
            "repository root or pass --root"
        )
    return cwd


def imported_root() -> Path | None:
    """The checkout the `archon.models` package is imported from (None when it cannot be found)."""
    found = importlib.util.find_spec("archon.models")
    if found is None or not found.submodule_search_locations:
        return None
    return Path(list(found.submodule_search_locations)[0]).parent.resolve()


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
    """Text substitutions that turn the like-family's identifiers into the new family's, in one pass
    over the text (so a new name that extends the old one, qwen3 -> qwen3_next, is not renamed again)."""

    def __init__(self, like: str, name: str, like_prefix: str, new_prefix: str) -> None:
        self.like_prefix = like_prefix
        rules = [
            # HF's module paths name the like-family's HF type, which stays true of HF
            (r"\btransformers(\.\w+)+", None),
            (rf"\barchon\.models\.{like}\b", f"archon.models.{name}"),
            (rf"\bfrom archon\.models import {like}\b", f"from archon.models import {name}"),
            (rf"\b{like_prefix}(?=[A-Z])", new_prefix),  # LlamaArgs, LlamaModel, ...
            (rf"\b{like.upper()}(?=_)", name.upper()),  # LLAMA_CASES
            (rf"(?<=_){like}\b", name),  # parallelize_llama, test_llama
            (rf"\b{like}(?=_)", name),  # llama_plan
        ]
        self._pattern = re.compile("|".join(f"(?P<r{i}>{pattern})" for i, (pattern, _) in enumerate(rules)))
        self._replacements = {f"r{i}": replacement for i, (_, replacement) in enumerate(rules)}

    def __call__(self, text: str) -> str:
        def replace(match: re.Match) -> str:
            replacement = self._replacements[match.lastgroup]
            return match.group(0) if replacement is None else replacement

        return self._pattern.sub(replace, text)


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


# ModelSpec fields keyed by HF model_type: the scaffold keeps the like-type's entry, keyed by the new
# type. The renderer table is emptied: another family's chat format would train on the wrong tokens
# without a word, while no renderer is a clear error until the family names one (SKILL.md 7b).
PER_TYPE_FIELDS = ("tiny_hf_config", "vllm_modes", "vllm_hf_overrides", "vllm_cpu_attention_backends")
# Stands for the new family's name and HF type in the text until the like-family's identifiers are
# renamed, so that a new name that extends the old one (qwen3 -> qwen3_next) is not renamed twice.
NAME_SLOT, TYPE_SLOT = "@@ARCHON_NEW_FAMILY@@", "@@ARCHON_NEW_MODEL_TYPE@@"


def fill_slots(text: str, name: str, model_type: str) -> str:
    return text.replace(NAME_SLOT, name).replace(TYPE_SLOT, model_type)


def _per_type_entry(source: str, field: ast.Dict, like_type: str, field_name: str, spec_file: Path) -> str:
    """The dict literal `field` reduced to its `like_type` entry, keyed by the new type."""
    lines = source.splitlines()
    previous_end = field.lineno  # the line the previous entry (or the opening brace) ends on
    for key, value in zip(field.keys, field.values):
        if isinstance(key, ast.Constant) and key.value == like_type:
            # Keep the entry's own indentation so its multi-line value stays aligned.
            entry_indent = " " * key.col_offset
            closing_indent = re.match(r"\s*", lines[field.end_lineno - 1]).group(0)
            if field.lineno == field.end_lineno:
                return f'{{"{TYPE_SLOT}": {ast.get_source_segment(source, value)}}}'
            # the comment lines right above the entry describe it: they come along
            above = lines[previous_end : key.lineno - 1]
            comments = "".join(f"{line}\n" for line in above if line.strip().startswith("#"))
            value_text = ast.get_source_segment(source, value)
            return f'{{\n{comments}{entry_indent}"{TYPE_SLOT}": {value_text},\n{closing_indent}}}'
        if value is not None:
            previous_end = value.end_lineno
    if field_name == "tiny_hf_config":
        raise ValueError(f"tiny_hf_config in {spec_file} has no entry for {like_type!r}")
    return "{}"


def adapt_spec(source: str, spec_file: Path, name: str, model_type: str, like_type: str) -> str:
    """Make the ModelSpec call name the new family and serve `model_type`; each per-type field keeps
    `like_type`'s entry (its tiny config, vLLM mode ...) under the new type, and the renderer table
    is emptied. The names are left as slots (`fill_slots`)."""
    call = _model_spec_call(ast.parse(source), spec_file)
    edits: list[tuple[ast.AST, str]] = [
        (_keyword(call, "name", spec_file), f'"{NAME_SLOT}"'),
        (_keyword(call, "hf_model_types", spec_file), f'("{TYPE_SLOT}",)'),
    ]
    for keyword in call.keywords:
        if keyword.arg == "renderers":
            edits.append((keyword.value, "{}"))
            continue
        if keyword.arg not in PER_TYPE_FIELDS:
            continue
        if not isinstance(keyword.value, ast.Dict):
            raise ValueError(f"{keyword.arg} in {spec_file} must be a dict literal keyed by model_type")
        edits.append((keyword.value, _per_type_entry(source, keyword.value, like_type, keyword.arg, spec_file)))
    return _replace_segments(source, edits)


def hf_config_fields(model_type: str) -> set[str] | None:
    """The fields transformers' config class of `model_type` defines (None when transformers has no
    such type)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
    except (KeyError, ValueError):
        return None
    return set(config.to_dict()) | set(getattr(type(config), "attribute_map", {}))


def drop_unknown_tiny_fields(spec_source: str, spec_file: Path, known: set[str]) -> tuple[str, list[str]]:
    """The spec with the keyword arguments of its tiny config (a `dict(BASE, key=value, ...)` entry of
    tiny_hf_config) that are not in `known` left out, and the names left out."""
    call = _model_spec_call(ast.parse(spec_source), spec_file)
    table = _keyword(call, "tiny_hf_config", spec_file)
    edits, dropped = [], []
    for value in table.values if isinstance(table, ast.Dict) else []:
        if not (isinstance(value, ast.Call) and getattr(value.func, "id", None) == "dict"):
            continue
        kept = [k for k in value.keywords if k.arg is None or k.arg in known]
        dropped += [k.arg for k in value.keywords if k not in kept]
        if len(kept) < len(value.keywords):
            parts = [ast.get_source_segment(spec_source, a) for a in value.args]
            parts += [ast.get_source_segment(spec_source, k) for k in kept]
            edits.append((value, f"dict({', '.join(parts)})"))
    return _replace_segments(spec_source, edits), dropped


def is_renderer_module(path: Path) -> bool:
    """A family's chat-format module (renderer.py, <format>_renderer.py): it registers renderers by
    name, so a scaffold does not copy it (the new family names a renderer when it has its format)."""
    return path.suffix == ".py" and (path.stem == "renderer" or path.stem.endswith("_renderer"))


def drop_renderer_imports(init_source: str, like: str) -> str:
    """A family's __init__.py without its renderer modules in the imports (`from archon.models.glm4_moe
    import renderer, spec` keeps `spec`, on one line or one name a line in parentheses); a statement
    left with nothing to import goes."""

    def is_renderer(name: str) -> bool:
        return name == "renderer" or name.endswith("_renderer")

    def keep_others(match: re.Match) -> str:
        names = [n.strip() for n in match.group(2).split(",") if n.strip()]
        kept = [n for n in names if not is_renderer(n)]
        return f"{match.group(1)}{', '.join(kept)}{match.group(3) or ''}\n" if kept else ""

    def keep_other_lines(match: re.Match) -> str:
        lines = [line for line in match.group(2).splitlines(keepends=True) if line.strip()]
        kept = [line for line in lines if not is_renderer(line.split("#")[0].strip().rstrip(","))]
        return f"{match.group(1)}{''.join(kept)})\n" if kept else ""

    parenthesized = rf"^(from archon\.models\.{like} import \(\n)(.*?)^\)\n?"
    init_source = re.sub(parenthesized, keep_other_lines, init_source, flags=re.M | re.S)
    one_line = rf"^(from archon\.models\.{like} import )([\w ,]+?)(\s*#.*)?$\n?"
    return re.sub(one_line, keep_others, init_source, flags=re.M)


def adapt_test(source: str, like_type: str) -> str:
    """The like-family's test with its type's string literals as the new type's slot."""
    return re.sub(rf"([\"']){re.escape(like_type)}\1", lambda m: f"{m.group(1)}{TYPE_SLOT}{m.group(1)}", source)


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


def registered(registry_source: str, name: str) -> str:
    """models/__init__.py with family `name` imported: added to its `from archon.models import (...)`
    block in name order, or as a line of its own when there is no block; unchanged when the family is
    imported already."""
    if re.search(
        rf"^\s*(from archon\.models import {name}\b|import archon\.models\.{name}\b|"
        rf"from archon\.models\.{name}\b|{name},)",
        registry_source,
        flags=re.M,
    ):
        return registry_source
    block = re.search(r"^from archon\.models import \(\n(.*?)^\)", registry_source, flags=re.M | re.S)
    if block is None:
        return (
            registry_source
            + ("" if registry_source.endswith("\n") else "\n")
            + f"from archon.models import {name}  # noqa: F401\n"
        )
    lines = block.group(1).splitlines(keepends=True)
    names = [line.strip().split(",")[0] for line in lines]
    position = sum(existing < name for existing in names)
    lines.insert(position, f"    {name},  # noqa: F401\n")
    return registry_source[: block.start(1)] + "".join(lines) + registry_source[block.end(1) :]


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
            outputs[dest] = fill_slots(rename(text), args.name, model_type)
        else:
            outputs[dest] = src.read_bytes()
    dropped: list[str] = []
    known = hf_config_fields(model_type)
    spec_dest = family_dir / "spec.py"
    if known is not None and spec_dest in outputs:
        outputs[spec_dest], dropped = drop_unknown_tiny_fields(outputs[spec_dest], spec_dest, known)
    like_test = root / "tests" / "models" / f"test_{args.like}.py"
    if like_test.is_file() and not args.generic_test:
        originals[test_file] = like_test.read_text()
        outputs[test_file] = fill_slots(rename(adapt_test(originals[test_file], like_type)), args.name, model_type)
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
    registry_file.write_text(registered(registry, args.name))
    changed = [line for dest, original in originals.items() for line in _changed_lines(dest, original, outputs[dest])]
    mentions = _mentions(written, args.like, rename)
    return Scaffold(family_dir, test_file, registry_file, model_type, mentions, changed, dropped)


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
    if result.dropped_tiny_fields:
        print(
            f"left out of the tiny config (the {result.model_type} config class does not define them, and HF "
            f"keeps unknown keys silently): {', '.join(result.dropped_tiny_fields)}"
        )
    if result.like_mentions:
        print(f"lines that still name {args.like!r} (rewrite or confirm):")
        for mention in result.like_mentions:
            print(f"  {mention}")
    imported = imported_root()
    if imported is not None and imported != result.family_dir.parent.parent.resolve():
        print(
            f"warning: archon is imported from {imported}, not from {result.family_dir.parent.parent}: the new "
            f"family is invisible to `python -m archon.tools.align` until you run it from that checkout with it "
            f"installed (pip install -e {result.family_dir.parent.parent})"
        )
    print(
        "renderers: none yet. Multi-turn episodes need the family's chat format: name an existing renderer "
        "in the spec if the chat template is the same, or write one (skills/add-model/SKILL.md, 7b)"
    )
    print("next: follow skills/add-model/SKILL.md, then gate with")
    print(f"  python -m archon.tools.align --model-type {result.model_type} --lora-rank 8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
