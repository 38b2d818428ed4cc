"""What a newcomer met scaffolding GLM-4 from Qwen2 (`python -m archon.tools.new_model glm4 --like qwen2`):
the comments of the per-type tables, the like-family's tiny-config fields that the new type's config
class does not have (HF keeps unknown keys without a word), the generic test file, and the gate's
warning for a one-kind `layers_block_type`."""

import ast
import shutil
from pathlib import Path

import pytest

from archon.tools.new_model import NewModelArgs, main, scaffold

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def root(tmp_path):
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for family in ("common", "qwen2"):
        shutil.copytree(REPO / "models" / family, tmp_path / "models" / family, ignore=ignore)
    (tmp_path / "models" / "__init__.py").write_text("from archon.models import qwen2  # noqa: F401\n")
    (tmp_path / "tests" / "models").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "models" / "test_qwen2.py", tmp_path / "tests" / "models" / "test_qwen2.py")
    return tmp_path


def _tiny_config_call(spec_source: str) -> ast.Call:
    tree = ast.parse(spec_source)
    table = next(
        k.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg == "tiny_hf_config"
    )
    (value,) = table.values
    return value


def test_the_tiny_config_keeps_its_comment_and_loses_fields_the_new_type_lacks(root, capsys):
    like_spec = (root / "models" / "qwen2" / "spec.py").read_text()
    comment = "# The second layer slides over 8 tokens, fewer than the longest aligned sequence has."
    assert comment in like_spec
    assert main(["glm4", "--like", "qwen2", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    spec = (root / "models" / "glm4" / "spec.py").read_text()
    assert comment in spec  # was dropped with the other entries of the table
    ast.parse(spec)
    call = _tiny_config_call(spec)
    # Glm4Config has no sliding window: the copied fields would sit in the config unread
    assert [k.arg for k in call.keywords] == []
    assert ast.unparse(call) == "dict(TINY_DECODER_CONFIG)"
    assert "left out of the tiny config" in out and "use_sliding_window, sliding_window, max_window_layers" in out


def test_fields_the_new_type_defines_are_kept(root):
    result = scaffold(NewModelArgs(name="qwen2_copy", like="qwen2", model_type="qwen2", root=root))
    assert result.dropped_tiny_fields == []
    call = _tiny_config_call((root / "models" / "qwen2_copy" / "spec.py").read_text())
    assert [k.arg for k in call.keywords] == ["use_sliding_window", "sliding_window", "max_window_layers"]


def test_generic_test_file_on_request(root):
    result = scaffold(NewModelArgs(name="glm4", like="qwen2", root=root, generic_test=True))
    text = result.test_file.read_text()
    assert 'MODEL_TYPE = "glm4"' in text and 'CASES = {"tiny": {}}' in text
    assert "sliding" not in text  # nothing of the like-family's cases
    ast.parse(text)


def test_single_kind_layers_block_type_is_named():
    from transformers import AutoConfig

    from archon.tools.tiny_checkpoint import single_kind_patterns

    kinds = ["mamba", "mamba", "attention", "mamba"]
    mixed = AutoConfig.for_model("nemotron_h", num_hidden_layers=4, layers_block_type=kinds)
    assert not any("layers_block_type" in p for p in single_kind_patterns(mixed))
    one_kind = AutoConfig.for_model("nemotron_h", num_hidden_layers=4, layers_block_type=["mamba"] * 4)
    # HF stores the Mamba kind as 'linear_attention'
    assert "layers_block_type (every layer 'linear_attention')" in single_kind_patterns(one_kind)
