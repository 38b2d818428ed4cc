import json
import os
import socket
import tempfile
import time

import agent_tool_fixtures as fixtures
import pytest

from archon.agents.sandbox import PYTHON_TOOL, SandboxLimits, builtin_tool, python_tool, resolve_tool, run_python
from archon.agents.tools import Tool, ToolCall, ToolRunner

TIMEOUT_S = 4.0
MEMORY_MB = 512
MAX_OUTPUT_CHARS = 1000

FAILING_TOOLS = [
    fixtures.fail,
    fixtures.sleep,
    fixtures.print_megabytes,
    fixtures.write_to_stdout_descriptor,
    fixtures.allocate_gigabytes,
    fixtures.grow_list,
    fixtures.exhaust_memory_in_c,
    fixtures.segfault,
    fixtures.exit_worker,
    fixtures.return_a_set,
]


@pytest.fixture(scope="module")
def runner():
    tools = [
        Tool.from_function(fixtures.lookup),
        Tool.from_function(fixtures.rendezvous),
        *map(Tool.from_function, FAILING_TOOLS),
        PYTHON_TOOL,
    ]
    with ToolRunner(tools, timeout_s=TIMEOUT_S, max_output_chars=MAX_OUTPUT_CHARS, memory_mb=MEMORY_MB) as runner:
        yield runner


def normal_call_works(runner: ToolRunner) -> None:
    result = runner.call(ToolCall("lookup", {"word": "after"}))
    assert result.status == "ok", result
    assert json.loads(result.content)["word"] == "after"


def test_schema_from_a_documented_function():
    expected = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up in a dictionary.",
            "parameters": {
                "type": "object",
                "properties": {
                    "word": {"type": "string", "description": "The word to look up."},
                    "limit": {
                        "type": "integer",
                        "description": "The most senses to return; a longer description goes on here.",
                    },
                    "tags": {
                        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                        "description": "Only senses with these tags.",
                    },
                    "mode": {"type": "string", "enum": ["exact", "prefix"], "description": "How the word is matched."},
                    "weights": {
                        "anyOf": [{"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}],
                        "description": "A weight per tag.",
                    },
                    "scale": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                    "verbose": {"type": "boolean", "description": "Whether to print what it does."},
                },
                "required": ["word"],
            },
        },
    }
    assert Tool.from_function(fixtures.lookup).schema() == expected
    by_spec = Tool.from_function("agent_tool_fixtures:lookup", name="define")
    assert by_spec.name == "define" and by_spec.function == "agent_tool_fixtures:lookup"
    assert by_spec.parameters == expected["function"]["parameters"]


@pytest.mark.parametrize(
    "fn, message",
    [
        (fixtures.untyped, r"agent_tool_fixtures\.untyped, parameter 'word' has no type hint"),
        (fixtures.star_args, r"agent_tool_fixtures\.star_args, parameter 'words': \*args and \*\*kwargs"),
        (fixtures.star_kwargs, r"agent_tool_fixtures\.star_kwargs, parameter 'options': \*args and \*\*kwargs"),
        (fixtures.unsupported, r"fixtures\.unsupported, parameter 'words': unsupported type hint set\[str\]"),
    ],
)
def test_functions_that_cannot_be_described(fn, message):
    with pytest.raises(ValueError, match=message):
        Tool.from_function(fn)


def test_tools_that_cannot_be_loaded():
    with pytest.raises(ValueError, match="must be 'module:function'"):
        Tool.from_function("agent_tool_fixtures.lookup")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_tool("agent_tool_fixtures:missing")
    with pytest.raises(ValueError, match=r"no built-in tool 'shell'; the built-in tools are: python"):
        builtin_tool("shell")
    with pytest.raises(ValueError, match="must be a built-in tool"):
        resolve_tool("shell")
    lookup = Tool.from_function(fixtures.lookup)
    local = Tool("local", "a local function", {"type": "object", "properties": {}}, lambda: "x")
    with pytest.raises(ValueError, match="tool 'local': its function .*<lambda> cannot be sent to a worker"):
        ToolRunner([lookup, local])
    with pytest.raises(ValueError, match="two tools are named 'lookup'"):
        ToolRunner([lookup, lookup])
    gone = Tool("gone", "", {"type": "object", "properties": {}}, "agent_tool_fixtures:gone")
    with pytest.raises(RuntimeError, match="could not be loaded: ValueError: tool 'gone': .*has no attribute 'gone'"):
        ToolRunner([gone], num_workers=1)
    assert resolve_tool("python").schema() == PYTHON_TOOL.schema()
    assert resolve_tool("agent_tool_fixtures:lookup").schema() == lookup.schema()


def test_calls_run_concurrently_and_come_back_in_order(runner, tmp_path):
    meeting = str(tmp_path / "meeting")
    calls = [ToolCall("rendezvous", {"directory": meeting, "parties": 2}) for _ in range(2)]
    calls += [ToolCall("lookup", json.dumps({"word": f"w{i}", "limit": i}), id=str(i)) for i in range(4)]
    results = runner.call_many(calls)
    assert [r.status for r in results] == ["ok"] * 6
    assert [r.content for r in results[:2]] == ["met"] * 2  # the two calls ran at once, on the two workers
    assert [json.loads(r.content)["limit"] for r in results[2:]] == [0, 1, 2, 3]
    assert all(r.elapsed_s > 0 for r in results)


def test_printed_output_comes_before_the_value_and_cannot_corrupt_the_replies(runner):
    result = runner.call(ToolCall("lookup", {"word": "printed", "verbose": True}))
    assert result.status == "ok"
    printed, value = result.content.split("\n", 1)
    assert printed == "looking up printed" and json.loads(value)["word"] == "printed"
    result = runner.call(ToolCall("write_to_stdout_descriptor", {"text": "\x00" * 64}))
    assert (result.status, result.content) == ("ok", "written")
    normal_call_works(runner)


@pytest.mark.parametrize(
    "call, status, message",
    [
        (
            ToolCall("search", {"q": "x"}),
            "unknown_tool",
            "unknown tool 'search'; the tools are: lookup, rendezvous, fail",
        ),
        (ToolCall("lookup", '{"word": "x",'), "bad_arguments", "the arguments of 'lookup' are not valid JSON"),
        (ToolCall("lookup", '["x"]'), "bad_arguments", "the arguments of 'lookup' must be a JSON object, got array"),
        (ToolCall("lookup", {"limit": 2}), "bad_arguments", "'lookup' is missing required argument(s): word"),
        (ToolCall("lookup", {"word": "x", "size": 2}), "bad_arguments", "'lookup' got unexpected argument(s): size"),
        (ToolCall("lookup", {"word": 3}), "bad_arguments", "'word' of 'lookup' must be of type string, got integer"),
        (ToolCall("lookup", {"word": "x", "limit": True}), "bad_arguments", "must be of type integer, got boolean"),
        (ToolCall("lookup", {"word": "x", "tags": ["a", 1]}), "bad_arguments", "'tags' of 'lookup'[1] must be of type"),
        (ToolCall("lookup", {"word": "x", "mode": "fuzzy"}), "bad_arguments", '["exact", "prefix"], got "fuzzy"'),
        (ToolCall("lookup", {"word": "x", "weights": {"a": "heavy"}}), "bad_arguments", "['a'] must be of type number"),
    ],
    ids=[
        "unknown-tool",
        "not-json",
        "not-an-object",
        "missing",
        "unexpected",
        "wrong-type",
        "bool-for-int",
        "wrong-item",
        "not-in-enum",
        "wrong-value",
    ],
)
def test_bad_calls_are_answered_without_a_worker(runner, call, status, message):
    result = runner.call(call)
    assert result.status == status and message in result.content, result
    assert result.elapsed_s == 0.0
    normal_call_works(runner)


def test_optional_arguments_take_null_and_numbers_take_integers(runner):
    result = runner.call(ToolCall("lookup", {"word": "x", "tags": None, "scale": 2, "weights": {"a": 0.5}}))
    assert result.status == "ok" and json.loads(result.content)["scale"] == 2


@pytest.mark.parametrize(
    "call, statuses, message",
    [
        (ToolCall("fail", {"message": "boom"}), {"error"}, "ValueError: boom"),
        (ToolCall("sleep", {"seconds": 60.0}), {"timeout"}, f"'sleep' did not finish within {TIMEOUT_S} s"),
        (
            ToolCall("print_megabytes", {"megabytes": 10}),
            {"output_truncated"},
            f"[output truncated: {10 * 2**20 - MAX_OUTPUT_CHARS} of {10 * 2**20} characters not shown]",
        ),
        (ToolCall("allocate_gigabytes", {"gigabytes": 10}), {"memory", "error"}, "MemoryError"),
        (ToolCall("grow_list", {}), {"memory", "error"}, "MemoryError"),
        # a crash at the limit reads as out of memory where the worker's own peak is known (not when the
        # test process itself is past the limit: a child's peak then reads as its parent's)
        (ToolCall("exhaust_memory_in_c", {}), {"memory", "error"}, "it was killed by SIGSEGV"),
        (ToolCall("segfault", {}), {"error"}, "'segfault' crashed: it was killed by SIGSEGV"),
        (ToolCall("exit_worker", {"code": 3}), {"error"}, "SystemExit: 3"),
        (ToolCall("return_a_set", {}), {"error"}, "'return_a_set' returned a value that is not JSON-serializable"),
    ],
    ids=[
        "raises",
        "hangs",
        "prints-10MB",
        "allocates-10GB",
        "grows-a-list",
        "crashes-at-the-limit",
        "segfault",
        "exits",
        "not-json",
    ],
)
def test_failing_tools_are_results_and_the_runner_goes_on(runner, call, statuses, message, monkeypatch):
    if (
        call.name != "sleep"
    ):  # only the hang needs the short limit; the others end on their own (slowly on a busy machine)
        monkeypatch.setattr(runner, "timeout_s", 120.0)
    result = runner.call(call)
    assert result.status in statuses and message in result.content, result
    assert "Traceback" not in result.content
    assert len(result.content) < MAX_OUTPUT_CHARS + 100
    normal_call_works(runner)


def test_the_sandbox_computes_exactly_in_a_scratch_that_leaves_nothing_on_disk(runner):
    before = set(os.listdir(tempfile.gettempdir()))
    code = "import os\nprint(123456789 * 987654321)\nprint(os.getcwd())\nopen('notes.txt', 'w').write('x')"
    result = runner.call(ToolCall("python", {"code": code}))
    assert result.status == "ok", result
    product, scratch = result.content.split()
    assert int(product) == 123456789 * 987654321 == 121932631112635269
    assert scratch == "/scratch"  # the sandbox's own tmpfs, gone with its mount namespace
    assert not {name for name in set(os.listdir(tempfile.gettempdir())) - before if "sandbox" in name}


def test_the_process_sandbox_removes_its_scratch_directory():
    code = "import os\nprint(os.getcwd())\nopen('notes.txt', 'w').write('x')"
    scratch = run_python(code, SandboxLimits(isolation="process")).strip()
    assert os.path.basename(scratch).startswith("archon-sandbox-") and not os.path.exists(scratch)


def test_the_sandbox_refuses_the_network_and_new_programs():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))\nprint('connected')"
        output = run_python(code)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    assert "connected" not in output.replace("socket.connect", "")
    assert "PermissionError: socket.connect is refused" in output
    output = run_python("import subprocess\nsubprocess.run(['true'])")
    assert "PermissionError: subprocess.Popen is refused" in output


def test_the_sandbox_stops_a_cpu_bound_loop_and_a_sleeper():
    start = time.monotonic()
    assert run_python("while True:\n    pass", SandboxLimits(cpu_s=1)) == "[stopped: over the CPU-time limit of 1 s]"
    assert run_python("import time\ntime.sleep(60)", SandboxLimits(timeout_s=1.0)) == (
        "[stopped: over the wall-clock limit of 1.0 s]"
    )
    assert time.monotonic() - start < 15


def test_the_sandbox_shows_the_end_of_a_traceback_after_capped_output():
    code = "print('x' * 100000)\ndef f():\n    return 1 / 0\nf()"
    output = run_python(code, SandboxLimits(max_output_chars=500))
    assert output.startswith("x" * 100) and "[output truncated:" in output
    assert output.rstrip().endswith("ZeroDivisionError: division by zero") and 'File "main.py", line 3, in f' in output
    assert len(output) < 600
    output = run_python("b = bytearray(2**30)", SandboxLimits(memory_mb=256))
    assert output.rstrip().endswith("MemoryError")


def test_a_sandbox_tool_with_its_own_limits():
    tool = python_tool(timeout_s=2.0, memory_mb=128)
    assert tool.name == "python" and tool.parameters["required"] == ["code"]
    assert tool.function.keywords["limits"] == SandboxLimits(timeout_s=2.0, memory_mb=128)
    with pytest.raises(ValueError, match="SandboxLimits.cpu_s must be positive, got 0"):
        python_tool(cpu_s=0)


def test_close_is_idempotent():
    runner = ToolRunner([Tool.from_function(fixtures.lookup)], num_workers=1)
    assert runner.call(ToolCall("lookup", {"word": "x"})).status == "ok"
    runner.close()
    runner.close()
    with pytest.raises(ValueError, match="ToolRunner.timeout_s must be positive, got 0"):
        ToolRunner([], timeout_s=0)
