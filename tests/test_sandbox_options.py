"""How the python tool's sandbox is chosen: its limits from a tool spec, and a clear refusal where
the OS cannot isolate it, unless the weaker sandbox is asked for."""

import os
import tempfile

import pytest

from archon.agents import sandbox
from archon.agents.sandbox import SandboxLimits, SandboxUnavailable, builtin_tool, resolve_tool, run_python
from archon.agents.tools import ToolCall, ToolRunner


def test_a_tool_spec_sets_the_sandbox_limits():
    tool = resolve_tool("python?timeout_s=2.5&scratch_mb=128&isolation=process")
    assert tool.name == "python" and tool.parameters["required"] == ["code"]
    assert tool.function.keywords["limits"] == SandboxLimits(timeout_s=2.5, scratch_mb=128, isolation="process")
    assert resolve_tool("python").function.keywords["limits"] == SandboxLimits()


@pytest.mark.parametrize(
    "spec, culprit",
    [
        ("python?disk=1", "'disk=1' is not key=value of a sandbox limit"),
        ("python?cpu_s", "'cpu_s' is not key=value"),
        ("python?cpu_s=ten", "cpu_s must be int, got 'ten'"),
        ("python?scratch_mb=0", "SandboxLimits.scratch_mb must be positive, got 0"),
        ("python?isolation=none", "SandboxLimits.isolation must be 'namespaces' or 'process', got 'none'"),
    ],
)
def test_a_bad_tool_spec_names_its_key(spec, culprit):
    with pytest.raises(ValueError, match=f"tool '{spec.replace('?', '[?]')}': .*{culprit}"):
        resolve_tool(spec)


REFUSED = "OSError: [Errno 1] unshare(CLONE_NEWUSER | ...): Operation not permitted"


@pytest.fixture
def no_namespaces(monkeypatch):
    """A sandbox whose first process fails as unshare(2) does where user namespaces are refused."""
    monkeypatch.setattr(sandbox, "_INIT_SOURCE", f"import sys\nsys.exit({REFUSED!r})")
    sandbox._namespaces_problem.cache_clear()
    yield
    sandbox._namespaces_problem.cache_clear()


def test_without_namespaces_the_python_tool_refuses_to_start(no_namespaces):
    for make in (lambda: builtin_tool("python"), lambda: resolve_tool("python"), lambda: run_python("print(1)")):
        with pytest.raises(SandboxUnavailable) as caught:
            make()
        message = str(caught.value)
        assert REFUSED in message
        assert "isolation='process'" in message and "docs/agents.md" in message


def test_without_namespaces_the_weaker_sandbox_runs_when_asked_for(no_namespaces):
    tool = resolve_tool("python?isolation=process")
    assert tool.function(code="print(6 * 7)") == "42\n"


def test_the_namespace_sandbox_runs_here():
    sandbox._namespaces_problem.cache_clear()
    builtin_tool("python")  # does not raise on this machine
    assert run_python("import os\nprint(os.getpid(), os.getcwd())") == "2 /scratch\n"


def test_the_weaker_sandbox_also_stops_a_call_before_the_runner_and_removes_its_scratch():
    before = set(os.listdir(tempfile.gettempdir()))
    code = "open('big', 'wb').write(b'x' * 2**20 * 8)\nimport time\ntime.sleep(60)"
    with ToolRunner([resolve_tool("python?isolation=process")], timeout_s=3.0, num_workers=1) as runner:
        result = runner.call(ToolCall("python", {"code": code}))
    assert result.status == "ok" and result.content == "[stopped: over the wall-clock limit of 2.0 s]", result
    assert not {name for name in set(os.listdir(tempfile.gettempdir())) - before if name.startswith("archon-sandbox-")}
