"""The layering of the package, checked on the source: imports point down the floors, never up,
and no group of modules imports itself round a cycle.

A module's floor is that of the longest prefix in FLOORS that names it. An import of `a.b.c` also
runs `a/__init__.py` and `a/b/__init__.py`, so it counts as importing those packages too (except
the importer's own packages, which are already running). Imports inside functions and under
`if TYPE_CHECKING:` count the same: a type named across floors ties them as much as a call does.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package name -> folder: models/ and recipes/ install as archon.models and archon.recipes
SOURCES = {"archon": ROOT / "archon", "archon.models": ROOT / "models", "archon.recipes": ROOT / "recipes"}

# Low to high. A module imports modules of its own floor or below.
FLOORS = {
    # 0. foundations: no archon import above this floor
    "archon": 0,
    "archon.precision": 0,
    "archon.device": 0,
    "archon.distributed": 0,
    "archon.workers": 0,
    "archon.http": 0,
    "archon.batch": 0,
    "archon.causal_attention": 0,
    "archon.grouped_mm": 0,
    "archon.packed_linear": 0,
    "archon.head": 0,
    "archon.load_balance": 0,
    "archon.routing_replay": 0,
    "archon.recurrent": 0,
    "archon.dtensor": 0,
    "archon.loss_context": 0,
    "archon.spec": 0,
    "archon.config_coverage": 0,
    "archon.secrets": 0,
    # 1. weights: LoRA, checkpoints, quantized bases, parallel layouts, the optimizer
    "archon.lora": 1,
    "archon.checkpoint": 1,
    "archon.quant": 1,
    "archon.parallel": 1,
    "archon.optim": 1,
    # 2. chat formats on token ids: the renderer contract and tool calls, which families implement
    "archon.agents": 2,
    # 3. model families
    "archon.models": 3,
    # 4. building a model and training it
    "archon.build": 4,
    "archon.trainer": 4,
    # 5. rollout engines, then weight sync to them
    "archon.rollout": 5,
    "archon.sync": 6,
    # 7. multi-turn agents: environments, tools, episodes, the OpenAI-compatible endpoint
    "archon.agents.environment": 7,
    "archon.agents.episodes": 7,
    "archon.agents.trajectory": 7,
    "archon.agents.tools": 7,
    "archon.agents.sandbox": 7,
    "archon.agents.sandbox_init": 7,
    "archon.agents.setup": 7,
    "archon.agents.openai_server": 7,
    "archon.agents.openai_engine": 7,
    "archon.agents.openai_agents": 7,
    "archon.agents.agent_episodes": 7,
    "archon.agents.environment_worker": 7,
    # 8. the RL run
    "archon.rl": 8,
    # 9. what puts it all together
    "archon.demos": 9,
    # the demos' old paths, which re-export archon.demos for one release
    "archon.rl.demo": 9,
    "archon.rl.code_tool_demo": 9,
    "archon.rl.reasoning_gym_demo": 9,
    "archon.tools": 9,
    "archon.recipes": 9,
    # the Tinker-compatible service: an application on the trainer, LoRA and the built-in engine
    "archon.serve": 9,
    "archon.serve.ranks": 9,
    "archon.serve.training": 9,
    "archon.serve.vllm_sampler": 9,
}
FLOOR_OF_RENDERER_CONTRACT = 2

# Modules that wrap an optional dependency or a separate process's entry: only these may be
# imported inside a function (elsewhere an import inside a function hides a cycle or a layering
# problem).
LAZY_IMPORT_TARGETS = {
    "archon.agents.openai_agents": "the OpenAI Agents SDK is optional",
    "archon.rl.logging.trackers": "wandb, mlflow and trackio are optional",
    "archon.rl.trackers": "wandb, mlflow and trackio are optional (the old path)",
    "archon.tools.plot": "matplotlib is optional",
    "archon.rollout.vllm": "vllm is optional",
    "archon.rollout.vllm_server": "vllm is optional",
    "archon.rollout.vllm_worker": "vllm is optional",
}
# Entry points that import their work lazily so that `--help` and argument errors come fast.
LAZY_IMPORTERS = {"archon.recipes.grpo_lora"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "archon" and parts and parts[0] in ("models", "recipes"):
                continue
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (a symbol of `a.b` resolves to `a.b`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _packages(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports() -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(imported module, line, inside a function)] over archon's own modules."""
    found = defaultdict(list)
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"
        own = set(_packages(module)) | ({module} if is_package else set())

        def add(name: str, line: int, lazy: bool) -> None:
            target = _resolve(name)
            if target is None or target == module:
                return
            for imported in [*_packages(target), target]:
                if imported in MODULES and imported not in own and imported != module:
                    found[module].append((imported, line, lazy))

        def visit(node: ast.AST, lazy: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        add(alias.name, child.lineno, inner)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        anchor = module if is_package else module.rpartition(".")[0]
                        for _ in range(child.level - 1):
                            anchor = anchor.rpartition(".")[0]
                        base = f"{anchor}.{base}" if base else anchor
                    for alias in child.names:
                        add(f"{base}.{alias.name}", child.lineno, inner)
                visit(child, inner)

        visit(ast.parse(path.read_text(), str(path)), False)
    return found


IMPORTS = _imports()


def floor(module: str) -> int:
    for prefix in sorted(FLOORS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return FLOORS[prefix]
    raise AssertionError(f"{module} has no floor in tests/test_layers.py FLOORS")


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def test_every_module_has_a_floor():
    for module in MODULES:
        floor(module)


def test_no_import_points_up():
    upward = [
        f"{_where(module, line)} {module} (floor {floor(module)}) imports {target} (floor {floor(target)})"
        for module, imports in IMPORTS.items()
        for target, line, _ in imports
        if floor(target) > floor(module)
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(set(upward)))


def test_no_import_cycles():
    graph = {module: {target for target, _, _ in imports} for module, imports in IMPORTS.items()}
    cycles = [sorted(component) for component in _strongly_connected(graph) if len(component) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in sorted(cycles))


def test_archon_learns_of_families_only_through_their_specs():
    named = [
        f"{_where(module, line)} {module} imports {target}"
        for module, imports in IMPORTS.items()
        if not module.startswith(("archon.models", "archon.recipes", "archon.tools"))
        for target, line, _ in imports
        if target.startswith("archon.models")
    ]
    assert not named, "archon/ imports a model module:\n" + "\n".join(sorted(set(named)))


def test_imports_inside_functions_are_of_optional_dependencies_only():
    lazy = [
        f"{_where(module, line)} {module} imports {target} inside a function"
        for module, imports in IMPORTS.items()
        if module not in LAZY_IMPORTERS and not module.startswith("archon.models")
        for target, line, inside in imports
        if inside and target not in LAZY_IMPORT_TARGETS and target not in _packages(module)
    ]
    assert not lazy, "move these imports to the top of the module:\n" + "\n".join(sorted(set(lazy)))


MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_files_and_functions_in_archon_stay_within_their_budgets():
    """Files in archon/ of at most 500 lines, functions of at most 80 (docstrings included)."""
    over = []
    for module, path in MODULES.items():
        if module.startswith(("archon.models", "archon.recipes")):
            continue
        text = path.read_text()
        if (lines := text.count("\n")) > MAX_FILE_LINES:
            over.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not over, "over budget:\n" + "\n".join(sorted(over))


def test_the_layering_test_sees_a_cycle_and_an_upward_import():
    """The checks above fail on the faults they look for (a graph made up here)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [sorted(c) for c in _strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]
    assert floor("archon.rl.loop") > floor("archon.trainer") > floor("archon.lora.layers")
    assert floor("archon.agents.renderer") == FLOOR_OF_RENDERER_CONTRACT < floor("archon.models.qwen3")


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components
