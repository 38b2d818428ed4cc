#!/usr/bin/env python3
"""Fails a test run that skipped a test for a reason nobody reviewed.

    .ci/check_skips.py JUNIT_XML [ALLOW_LIST]

Reads the JUnit XML report pytest wrote (--junitxml=JUNIT_XML), prints every skip with its reason,
and exits 1 listing each skip whose reason matches none of the allow-list's patterns (ALLOW_LIST,
by default allowed_skips.txt beside this script): one regular expression a line, matched against
the whole reason, each preceded by a comment line that says why the skip is allowed.
"""

from __future__ import annotations

import ast
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_ALLOW_LIST = Path(__file__).resolve().parent / "allowed_skips.txt"


def read_allow_list(path: Path) -> list[re.Pattern]:
    """The patterns of the allow-list at `path`; a pattern without a comment line above it (blank
    lines between are fine) is refused, as is one that is not a regular expression."""
    patterns = []
    commented = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = line.strip()
        if not text:
            continue
        if text.startswith("#"):
            commented = True
            continue
        if not commented:
            raise SystemExit(f"{path}:{number}: the pattern {text!r} has no comment above it saying why it is allowed")
        try:
            patterns.append(re.compile(text))
        except re.error as error:
            raise SystemExit(f"{path}:{number}: {text!r} is not a regular expression: {error}") from error
        commented = False
    return patterns


def skips(report: Path) -> list[tuple[str, str]]:
    """(test, reason) of every skipped test in a JUnit XML report pytest wrote. A test skipped in
    its body or by a marker carries the reason as its message; a module skipped while it was
    collected is a test named after the module, with the message "collection skipped" and
    ('path', line, 'Skipped: reason') as text.
    Expected failures (xfail) are not skips."""
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None or skipped.get("type") == "pytest.xfail":
            continue
        test = "::".join(part for part in (case.get("classname"), case.get("name")) if part)
        reason = skipped.get("message") or ""
        if reason == "collection skipped" and skipped.text:
            _path, _line, message = ast.literal_eval(skipped.text)  # where pytest.skip was called
            reason = message.removeprefix("Skipped: ")
        found.append((test, reason))
    return found


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    report = Path(argv[0])
    allow_list = Path(argv[1]) if len(argv) == 2 else DEFAULT_ALLOW_LIST
    patterns = read_allow_list(allow_list)
    found = skips(report)
    disallowed = [(test, reason) for test, reason in found if not any(p.fullmatch(reason) for p in patterns)]
    print(f"{len(found)} skipped, {len(disallowed)} for a reason not in {allow_list}")
    for test, reason in found:
        print(f"  {'NOT ALLOWED' if (test, reason) in disallowed else 'allowed'}: {test}: {reason}")
    if disallowed:
        print(
            f"\nskips not on the allow-list ({allow_list}); make the test run, or allow its reason there with why:",
            file=sys.stderr,
        )
        for test, reason in disallowed:
            print(f"  {test}: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
