#!/usr/bin/env python3
"""Writes the seconds each test file took in a run, from the JUnit XML report pytest wrote.

    .ci/test_durations.py JUNIT_XML [OUT]

OUT (by default test_durations.json beside this script) maps each file, as pytest names it
("tests/test_vllm.py"), to the seconds its tests took, rounded. tests/conftest.py hands the files
to the xdist workers longest first, so that `--dist loadfile` does not start a long file last while
the other worker has nothing left to do. Rerun it on a recent report when files are added or grow.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "test_durations.json"


def file_seconds(junit_xml: Path) -> dict[str, int]:
    """Seconds per test file. JUnit names a test by its dotted class path ("tests.test_vllm" or
    "tests.models.test_glm4.TestX"); the file is the part up to the first component that names a
    module (a `.py` that exists under the report's repository)."""
    root = Path.cwd()
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).iter("testcase"):
        parts = case.get("classname", "").split(".")
        for end in range(len(parts), 0, -1):
            path = Path(*parts[:end]).with_suffix(".py")
            if (root / path).is_file():
                seconds[path.as_posix()] += float(case.get("time") or 0.0)
                break
        else:
            raise SystemExit(f"{junit_xml}: no test file under {root} for testcase class {case.get('classname')!r}")
    return {name: round(value) for name, value in sorted(seconds.items(), key=lambda item: -item[1])}


def main(argv: list[str]) -> None:
    if len(argv) not in (2, 3):
        raise SystemExit(__doc__)
    out = Path(argv[2]) if len(argv) == 3 else DEFAULT_OUT
    table = file_seconds(Path(argv[1]))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=0) + "\n", encoding="utf-8")
    tmp.replace(out)
    print(f"{out}: {len(table)} files, {sum(table.values())} s")


if __name__ == "__main__":
    main(sys.argv)
