"""The package's shape: no import circle between its modules counting every import, imports at the top (a
function-local one says why), short functions with short signatures, one complete engine protocol."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_cli"
LIGHT_PATH_NOTE = "not at the top"  # how a function-local grpo_cli import says why it is there


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement of `module` names (relative ones resolved), or []."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # from . import x, from ..y import z
        parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports: at module level, inside a function, or under TYPE_CHECKING
    (an annotation's import is an edge of the graph too)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = _imported(node, name, path.name == "__init__.py")
            graph[name] |= {t for t in targets if t in modules and t != name and t != "grpo_cli"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_find_cycle_sees_a_circle_through_a_function_level_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_counts_annotation_and_relative_imports():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo_cli.step.state import RunState\n"
                     "from . import base\n")
    names = [t for node in ast.walk(tree) for t in _imported(node, "grpo_cli.engines.vllm", False)]
    assert "grpo_cli.step.state.RunState" in names and "grpo_cli.engines.base" in names


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "grpo_cli.algorithm.schedules" in graph["grpo_cli.config.trainer"]  # the lr schedule names: the real table
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_run_state_sits_below_the_stages_and_the_composition_root_above_them():
    graph = import_graph()
    stages = {"grpo_cli.step.collect", "grpo_cli.step.batch", "grpo_cli.step.update", "grpo_cli.step.sync", "grpo_cli.step.ahead",
              "grpo_cli.step.rollout", "grpo_cli.step.metrics"}
    assert not reaches(graph, "grpo_cli.step.state") & (stages | {"grpo_cli.step.setup", "grpo_cli.train"})
    assert not reaches(graph, "grpo_cli.engines.base") - {"grpo_cli.engines"}  # the protocol imports no module
    built = {"grpo_cli.step.state", "grpo_cli.engines.vllm", "grpo_cli.engines.hf", "grpo_cli.engines.sharded",
             "grpo_cli.engines.remote", "grpo_cli.engines.tools", "grpo_cli.step.heldout", "grpo_cli.step.optim", "grpo_cli.step.sync"}
    assert built <= reaches(graph, "grpo_cli.step.setup")  # the composition root: every piece of a RunState below it
    assert stages | built | {"grpo_cli.step.setup"} <= reaches(graph, "grpo_cli.train")
    importers = {m for m, targets in graph.items() if "grpo_cli.step.setup" in targets}
    assert importers <= {"grpo_cli.train", "grpo_cli.evaluate"}, importers  # only the commands build a run


def test_imports_between_package_modules_are_at_the_top_or_say_why():
    """A function-local import of a package module is there only to keep torch (or another heavy package) off
    the torch-free path of `--cfg job` and `grpo check`, and its comment says so."""
    unexplained = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                local = [t for t in _imported(node, _module_name(path), path.name == "__init__.py")
                         if t.startswith("grpo_cli")]
                note = " ".join(lines[max(0, node.lineno - 3):node.lineno]) if local else ""
                if local and LIGHT_PATH_NOTE not in note:
                    unexplained.append(f"{path.name}:{node.lineno} {local[0]}")
    assert not unexplained, unexplained


def test_no_function_over_80_lines_or_8_parameters():
    long, wide = [], []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            count = len(names) + (args.vararg is not None) + (args.kwarg is not None) - (names[:1] in (["self"], ["cls"]))
            if count > 8:
                wide.append(f"{path.name}:{node.lineno} {node.name} ({count} parameters)")
    assert not long, long
    assert not wide, wide


def test_rollout_keeps_only_a_steps_sampling():
    assert len((PACKAGE / "step" / "rollout.py").read_text().splitlines()) <= 400


def test_every_engine_implements_the_whole_protocol():
    """No engine is asked what it can do: each one (and the wrappers' base) defines every method of the protocol,
    and the loop holds no isinstance or hasattr test of an engine."""
    from grpo_cli.engines.base import DelegatingEngine, Engine
    from grpo_cli.engines.hf import HFEngine
    from grpo_cli.engines.remote import RemoteEngine
    from grpo_cli.engines.sharded import ShardedEngine
    from grpo_cli.engines.tools import ToolEngine
    from grpo_cli.engines.vllm import VLLMEngine

    methods = {n for n, v in vars(Engine).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert set(Engine.__annotations__) == {"tokenizer", "adapters", "in_process"}  # the first two set per instance
    assert {"generate", "generate_each", "start_generate", "read_weights", "load_adapter", "close"} <= methods
    for cls in (VLLMEngine, HFEngine, RemoteEngine, DelegatingEngine, ShardedEngine, ToolEngine):
        missing = {m for m in methods if not callable(getattr(cls, m, None))}
        assert not missing, f"{cls.__name__} lacks {sorted(missing)}"
        assert hasattr(cls, "in_process"), cls.__name__
    probes = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "isinstance"):
                text = ast.unparse(node)
                if "engine" in text.lower():
                    probes.append(f"{path.name}:{node.lineno} {text}")
    assert not probes, probes


def test_every_subpackage_ships_in_the_wheel():
    """pyproject.toml lists the packages by hand: a subpackage missing there is missing from the wheel."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
    folders = {p.parent for p in PACKAGE.rglob("*.py")}  # a folder of modules without __init__.py is no package
    assert all((f / "__init__.py").is_file() for f in folders), sorted(str(f) for f in folders
                                                                      if not (f / "__init__.py").is_file())


def test_one_worker_protocol():
    """A worker's call protocol (start and call limits, the kill on a timeout, the failure kinds) is written once,
    in tools.worker.Worker; the process-launching classes supply a transport only (issue 66: RewardWorker and
    the sandbox's worker were two implementations of it)."""
    from grpo_cli.tools.sandbox_worker import SandboxedWorker
    from grpo_cli.tools.worker import RewardWorker, Worker

    transports = {RewardWorker, SandboxedWorker}
    assert all(issubclass(cls, Worker) for cls in transports)
    for cls in transports:
        assert "call" not in vars(cls) and {"_launch", "_exchange", "alive", "_stop"} <= set(vars(cls)), cls
    launching = [cls.name for path in PACKAGE.rglob("*.py") for cls in ast.walk(ast.parse(path.read_text()))
                 if isinstance(cls, ast.ClassDef) and cls.name != "Worker"
                 and any(isinstance(f, ast.FunctionDef) and f.name == "_launch" for f in cls.body)]
    assert sorted(launching) == ["RewardWorker", "SandboxedWorker"]  # no third worker beside them


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
MAX_MODULE_LINES = 500
MAX_TOP_LEVEL_MODULES = 12  # .py files directly in grpo_cli/, __init__ and __main__ not counted


def box(module: str) -> str:
    """The part of the layout a module belongs to: its top-level package (`step/`) or its top-level module
    (`train.py`)."""
    top = module.split(".")[1] if "." in module else "__init__"
    return f"{top}/" if (PACKAGE / top).is_dir() else f"{top}.py"


def floors() -> dict[str, int]:
    """docs/architecture.md's floor table: each package or top-level module -> its floor."""
    found = {}
    for row in ARCHITECTURE.read_text().splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].lstrip("-").isdigit():
            for name in cells[1].replace("`", "").split(","):
                found[name.strip()] = int(cells[0])
    return found


def test_floors_reads_the_page_and_box_names_a_module_by_its_top():
    table = floors()
    assert table["cli/"] > table["step/"] > table["algorithm/"] and table["errors.py"] == table["algorithm/"]
    assert box("grpo_cli.step.update") == "step/" and box("grpo_cli.train") == "train.py"


def test_imports_run_down_the_floors_of_docs_architecture():
    """Every import between two parts of the layout runs from a higher floor to a lower one, and the page names
    every part there is (issue 66: the flat package had 18 floors and no rule)."""
    table, graph = floors(), import_graph()
    parts = {box(m) for m in graph if m != "grpo_cli" and box(m) != "__main__.py"}
    assert parts == set(table), (sorted(parts - set(table)), sorted(set(table) - parts))
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets
              if box(a) != box(b) and box(a) in table and table[box(a)] <= table[box(b)]]
    assert not upward, upward


def test_a_small_top_level_and_no_long_module():
    top = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(top)
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long
