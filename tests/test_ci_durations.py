""".ci/test_durations.py on the JUnit XML report pytest writes (seconds per test file, test
classes and packages included), and the order tests/conftest.py gives the files from that table:
longest first, each file's own order kept, files not in the table last."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import conftest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "test_durations.py"

FILES = {
    "tests/__init__.py": "",
    "tests/test_slow.py": "import time\n\ndef test_a():\n    time.sleep(0.6)\n\ndef test_b():\n    time.sleep(0.6)\n",
    "tests/models/__init__.py": "",
    "tests/models/test_fast.py": "class TestGroup:\n    def test_c(self):\n        pass\n",
}


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_seconds_are_summed_per_file_and_written_longest_first(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    run = _run(
        tmp_path, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", "junit.xml", "tests"
    )
    assert run.returncode == 0, run.stdout + run.stderr

    out = tmp_path / "durations.json"
    result = _run(tmp_path, sys.executable, str(SCRIPT), "junit.xml", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    table = json.loads(out.read_text())
    assert list(table) == ["tests/test_slow.py", "tests/models/test_fast.py"]
    assert table["tests/test_slow.py"] >= 1 and table["tests/models/test_fast.py"] == 0

    (tmp_path / "tests/models/test_fast.py").unlink()  # a report from another tree is refused by name
    result = _run(tmp_path, sys.executable, str(SCRIPT), "junit.xml", str(out))
    assert result.returncode != 0 and "tests.models.test_fast.TestGroup" in result.stderr


def test_files_are_ordered_longest_first_keeping_each_files_own_order():
    table = json.loads(conftest.TEST_DURATIONS.read_text())
    long_file, short_file = sorted(table, key=table.get)[-1], sorted(table, key=table.get)[0]
    assert table[long_file] > table[short_file]

    def item(file: str, name: str):
        return SimpleNamespace(path=ROOT / file, name=name)

    items = [
        item("tests/test_not_in_the_table.py", "x"),
        item(short_file, "s1"),
        item(long_file, "l1"),
        item(short_file, "s2"),
        item(long_file, "l2"),
    ]
    conftest.pytest_collection_modifyitems(SimpleNamespace(rootpath=ROOT), items)
    assert [i.name for i in items] == ["l1", "l2", "s1", "s2", "x"]
