"""`python -m archon.tools.new_model`: scaffolds into a temp copy of models/ and tests/models/."""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from archon.tools.new_model import NewModelArgs, main, scaffold

REPO = Path(__file__).resolve().parents[1]
REGISTRY = (
    '"""Model families."""\n\n'
    "from archon.models import llama  # noqa: F401\n"
    "from archon.models import qwen3  # noqa: F401\n"
)


@pytest.fixture
def root(tmp_path):
    """A repository root with only common/, llama/ and qwen3/ registered (other families stay out)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for family in ("common", "llama", "qwen3"):
        shutil.copytree(REPO / "models" / family, tmp_path / "models" / family, ignore=ignore)
    (tmp_path / "models" / "__init__.py").write_text(REGISTRY)
    (tmp_path / "tests" / "models").mkdir(parents=True)
    for name in ("family_checks.py", "test_llama.py"):
        shutil.copy(REPO / "tests" / "models" / name, tmp_path / "tests" / "models" / name)
    return tmp_path


def test_scaffold_of_an_identical_architecture_passes_alignment(root):
    """Mistral without a window is Llama: the scaffold imports and aligns with HF + PEFT as written."""
    assert main(["mistral", "--like", "llama", "--root", str(root)]) == 0
    family = root / "models" / "mistral"
    like_files = sorted(p.name for p in (root / "models" / "llama").glob("*.py"))
    assert sorted(p.name for p in family.glob("*.py")) == [name for name in like_files if name != "renderer.py"]
    code = "\n".join(p.read_text() for p in family.glob("*.py"))
    # no renderer yet (another family's chat format would be silently wrong): the spec names none
    assert "renderers={}" in code and "renderer" not in (family / "__init__.py").read_text()
    assert "LlamaArgs" not in code and "archon.models.llama" not in code
    assert "class MistralArgs" in code and "class MistralModel" in code and "class MistralStateDictConverter" in code
    registry = (root / "models" / "__init__.py").read_text()
    assert registry == REGISTRY + "from archon.models import mistral  # noqa: F401\n"
    test_file = (root / "tests" / "models" / "test_mistral.py").read_text()
    assert 'MODEL_TYPE = "mistral"' in test_file and "from archon.models.mistral.args import MistralArgs" in test_file

    # The scaffolded tree stands in for the repository: its models/ is imported as archon.models, the
    # way the package layout (setup.py) installs the repository's models/.
    script = (
        "import importlib.util, json, sys\n"
        f"init = {str(root / 'models' / '__init__.py')!r}\n"
        "spec = importlib.util.spec_from_file_location('archon.models', init, "
        "submodule_search_locations=[init[:-12]])\n"
        "sys.modules['archon.models'] = module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "from archon.spec import get_spec\n"
        "from archon.tools.align import AlignArgs, run_alignment\n"
        "spec = get_spec('mistral')\n"
        "report = run_alignment(AlignArgs(model_type='mistral', "
        "config_overrides={'sliding_window': None}, lora_rank=4))\n"
        "from archon.agents.renderer import default_renderer_name\n"
        "try:\n    renderer = default_renderer_name('mistral')\nexcept ValueError as e:\n    renderer = str(e)\n"
        "print(json.dumps({'family': spec.name, 'module': spec.model_cls.__module__,"
        " 'file': sys.modules['archon.models'].__file__,"
        " 'renderer': renderer,"
        " 'pass': report['pass'], 'failures': report['failures']}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["file"] == str(root / "models" / "__init__.py")
    assert (result["family"], result["module"]) == ("mistral", "archon.models.mistral.model")
    assert "family 'mistral' names no renderer for model_type 'mistral'" in result["renderer"]
    assert result["pass"], result["failures"]


def test_refuses_to_overwrite(root):
    scaffold(NewModelArgs(name="mistral", like="llama", root=root))
    args_file = root / "models" / "mistral" / "args.py"
    args_file.write_text("# edited by hand\n")
    with pytest.raises(FileExistsError, match="models/mistral already exists"):
        scaffold(NewModelArgs(name="mistral", like="llama", root=root))
    assert args_file.read_text() == "# edited by hand\n"
    assert (root / "models" / "__init__.py").read_text().count("from archon.models import mistral") == 1

    shutil.rmtree(root / "models" / "mistral")  # the test file alone also blocks
    with pytest.raises(FileExistsError, match="test_mistral.py already exists"):
        scaffold(NewModelArgs(name="mistral", like="llama", root=root))
    assert not (root / "models" / "mistral").exists()


def test_bad_arguments_name_the_problem(root):
    with pytest.raises(FileNotFoundError, match=r"no family 'falcon'.*families: llama, qwen3"):
        scaffold(NewModelArgs(name="x", like="falcon", root=root))
    with pytest.raises(ValueError, match="lower_snake_case"):
        scaffold(NewModelArgs(name="Mistral", like="llama", root=root))
    with pytest.raises(ValueError, match=r"--like-type 'llama_moe' is not served by 'llama'"):
        scaffold(NewModelArgs(name="x", like="llama", like_type="llama_moe", root=root))
    assert main(["mistral", "--like", "falcon", "--root", str(root)]) == 1
    assert not (root / "models" / "x").exists() and not (root / "models" / "mistral").exists()


def test_multi_type_family_keeps_only_the_chosen_type(root):
    """From qwen3 (qwen3 + qwen3_moe) with --like-type qwen3_moe: one type, the MoE tiny config."""
    scaffold(NewModelArgs(name="mymoe", like="qwen3", like_type="qwen3_moe", model_type="mymoe_hf", root=root))
    spec_source = (root / "models" / "mymoe" / "spec.py").read_text()
    call = next(
        n
        for n in ast.walk(ast.parse(spec_source))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ModelSpec"
    )
    keywords = {k.arg: k.value for k in call.keywords}
    assert ast.literal_eval(keywords["name"]) == "mymoe"
    assert ast.literal_eval(keywords["hf_model_types"]) == ("mymoe_hf",)
    tiny = keywords["tiny_hf_config"]
    assert [ast.literal_eval(k) for k in tiny.keys] == ["mymoe_hf"]
    assert "num_experts=8" in ast.get_source_segment(spec_source, tiny.values[0])
    assert "Qwen3" not in "".join(l for l in spec_source.splitlines() if not l.lstrip().startswith(("#", '"')))
    # qwen3 has no tests/models/test_qwen3.py here, so the generic family test is written.
    test_source = (root / "tests" / "models" / "test_mymoe.py").read_text()
    assert 'MODEL_TYPE = "mymoe_hf"' in test_source and "assert_meta_weights_complete" in test_source
    compile(test_source, "test_mymoe.py", "exec")


def test_every_changed_line_is_listed(root, capsys):
    """The scaffold lists each line it changed from the like-family's files (file, line, new text and
    the text it replaced), so renames inside comments and strings get reviewed too."""
    result = scaffold(NewModelArgs(name="mistral", like="llama", root=root))
    family, like = root / "models" / "mistral", root / "models" / "llama"
    expected = 0
    for path in [*family.glob("*.py"), result.test_file]:
        source = like / path.name if path.parent == family else root / "tests" / "models" / "test_llama.py"
        new, old = path.read_text().splitlines(), source.read_text().splitlines()
        if len(new) == len(old):
            expected += sum(a != b for a, b in zip(new, old))
            for number, (a, b) in enumerate(zip(new, old), 1):
                if a != b:
                    assert f"{path}:{number}: {a.strip()}  (was: {b.strip()})" in result.changed_lines
    assert expected > 0 and len(result.changed_lines) >= expected
    assert any("spec.py" in line and '"mistral"' in line for line in result.changed_lines)


def test_a_name_that_extends_the_like_family_is_not_renamed_twice(root):
    """qwen3_next from qwen3 (like-type qwen3_moe): the renames of qwen3's identifiers must not reach
    the new names, and every per-type table keeps the MoE type's entry under the new type (its vLLM
    mode `merged`), never a renamed key such as `qwen3_next_moe`. The spec must load as a ModelSpec."""
    scaffold(NewModelArgs(name="qwen3_next", like="qwen3", like_type="qwen3_moe", root=root))
    family = root / "models" / "qwen3_next"
    spec_source = (family / "spec.py").read_text()
    call = next(
        n
        for n in ast.walk(ast.parse(spec_source))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ModelSpec"
    )
    keywords = {k.arg: k.value for k in call.keywords}
    assert ast.literal_eval(keywords["name"]) == "qwen3_next"
    assert ast.literal_eval(keywords["hf_model_types"]) == ("qwen3_next",)
    assert ast.literal_eval(keywords["vllm_modes"]) == {"qwen3_next": "merged"}
    assert ast.literal_eval(keywords["renderers"]) == {}
    assert [ast.literal_eval(k) for k in keywords["tiny_hf_config"].keys] == ["qwen3_next"]
    every_file = "".join(p.read_text() for p in family.glob("*.py"))
    assert "qwen3_next_next" not in every_file
    literals = {
        n.value for n in ast.walk(ast.parse(spec_source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    assert "qwen3_next_moe" not in literals  # (a comment may say it: changed lines are listed for review)
    assert "class Qwen3NextArgs" in every_file and "parallelize_qwen3_next" in every_file
    code = (
        "import sys; sys.path.insert(0, {root!r})\n"
        "import archon.models as m; m.__path__.insert(0, {models!r})\n"
        "from archon.models.qwen3_next.spec import *\n"
        "from archon.spec import get_spec\n"
        "spec = get_spec('qwen3_next'); print(spec.name, spec.vllm_mode('qwen3_next'))\n"
    ).format(root=str(root), models=str(root / "models"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["qwen3_next", "merged"]


def test_the_default_root_is_the_current_checkout(root, tmp_path, monkeypatch, capsys):
    """Without --root the scaffold goes into the checkout the command runs in, not into the one archon
    happens to be imported from; it warns when the two differ, and outside a checkout it says so."""
    (root / "archon").mkdir()
    (root / "archon" / "__init__.py").write_text("")
    monkeypatch.chdir(root)
    assert main(["mistral", "--like", "llama"]) == 0
    assert (root / "models" / "mistral" / "spec.py").is_file()
    assert not (REPO / "models" / "mistral").exists()
    out = capsys.readouterr().out
    assert f"warning: archon is imported from {REPO}" in out and f"pip install -e {root}" in out

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["gemma", "--like", "llama"]) == 1
    assert "is not an archon checkout" in capsys.readouterr().err


def test_a_combined_renderer_import_keeps_the_spec(root):
    """glm4_moe's __init__.py imports `renderer, spec` on one line: the scaffold drops the renderer
    and keeps the spec import, so the new family registers."""
    glm = REPO / "models" / "glm4_moe"
    shutil.copytree(glm, root / "models" / "glm4_moe", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    init = (root / "models" / "glm4_moe" / "__init__.py").read_text()
    assert "renderer" in init and "spec" in init
    scaffold(NewModelArgs(name="minimax_like", like="glm4_moe", root=root))
    assert (
        (root / "models" / "minimax_like" / "__init__.py")
        .read_text()
        .startswith("from archon.models.minimax_like import spec  # noqa: F401")
    )


def test_registration_joins_the_grouped_import_in_name_order():
    from archon.tools.new_model import registered

    grouped = '"""Families."""\n\nfrom archon.models import (\n    llama,  # noqa: F401\n    qwen3,  # noqa: F401\n)\n'
    assert registered(grouped, "mistral") == (
        '"""Families."""\n\nfrom archon.models import (\n    llama,  # noqa: F401\n    mistral,  # noqa: F401\n'
        "    qwen3,  # noqa: F401\n)\n"
    )
    assert registered(registered(grouped, "zeta"), "zeta").count("zeta") == 1
    assert registered(REGISTRY, "mistral") == REGISTRY + "from archon.models import mistral  # noqa: F401\n"


def test_hf_module_paths_are_not_renamed():
    """A test that imports HF's own router for the like-family keeps that path: HF's module names the
    like-family's type, and a half-renamed path (`deepseek_v3.modeling_kimi_linear`) does not exist."""
    from archon.tools.new_model import Renamer

    rename = Renamer("deepseek_v3", "kimi_linear", "DeepseekV3", "KimiLinear")
    text = (
        'router = "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter.forward"\n'
        "from archon.models.deepseek_v3.args import DeepseekV3Args\n"
        "parallelize_deepseek_v3(DEEPSEEK_V3_CASES)\n"
    )
    assert rename(text) == (
        'router = "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter.forward"\n'
        "from archon.models.kimi_linear.args import KimiLinearArgs\n"
        "parallelize_kimi_linear(KIMI_LINEAR_CASES)\n"
    )
