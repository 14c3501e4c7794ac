"""The rooms of ARCHITECTURE.md, checked on the source: hplan's imports form no cycle and point one way.

Imports are read with `ast` from every module of the distribution (pyproject's package-dir), function-local ones
included, so a cycle hidden in a function body is found too. Imports under `if TYPE_CHECKING:` are left out:
they never run, and annotations may name a type of the module that imports this one.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOUNDATION = ("artifacts", "errors", "sizes", "options", "precision", "blame", "probe", "grads", "hooks", "optimizers", "checkpoint_policy",
              "training", "workload", "specs", "models")
"""hplan's shared modules: the artifact types and the Workload contract every room reads."""
ROOMS_MAY_IMPORT = {
    "foundation": set(),
    "tracer": set(),
    "planner": set(),
    "executor": set(),
    "reports": {"planner"},  # torch-free both: a report scores baselines for plans made without --compare
    "integrations": {"tracer", "top"},
    "cli": {"tracer", "planner", "executor", "reports", "top"},
    "top": {"executor"},  # hplan.attach loads the executor when called
}
"""Which rooms each room may import besides the foundation (and itself): cli → {tracer, planner, executor,
reports} → artifacts and the foundation, never back."""
SUB_ROOM_ENTRIES = {
    ("hplan.executor", "hplan.executor.ranks.distributed"),
    ("hplan.executor.runtime", "hplan.executor.activations.run"),
    ("hplan.executor.runtime", "hplan.executor.tiers.host"),
    ("hplan.executor.train", "hplan.executor.tiers.host"),
    ("hplan.executor.train", "hplan.executor.checkpoints.checkpoint"),
    ("hplan.executor.train", "hplan.executor.checkpoints.checkpoint_dir"),
    ("hplan.planner", "hplan.planner.baselines.sweep"),
    ("hplan.planner.make", "hplan.planner.baselines"),
    ("hplan.planner.core", "hplan.planner.tiers.host"),
}
"""The only places where a package's root imports one of its sub-rooms (the sub-rooms import the root freely):
the entry points that run a tiered plan, its activations, its checkpoints, a many-rank plan and the baselines.
A new one is a design decision: add it here and to ARCHITECTURE.md."""
SUB_ROOMS = {"hplan.executor": ("ranks", "tiers", "checkpoints", "activations"),
             "hplan.planner": ("baselines", "ranks", "tiers")}


def modules() -> dict[str, Path]:
    """Every module of the distribution, by dotted name, from pyproject's package-dir."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    out: dict[str, Path] = {}
    for package, folder in config["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join((package, *parts)).removesuffix(".__init__")] = path
    return out


def imports(path: Path, known: dict[str, Path], name: str = "") -> set[str]:
    """hplan modules `path` (module `name`) imports anywhere in its body, except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(module)
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known, name) - {name} for name, path in known.items()}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "top"
    return "foundation" if parts[1] in FOUNDATION else parts[1]


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None: depth-first search, iterative."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for start in sorted(edges):
        if start in state:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, todo = stack[-1]
            nxt = next(todo, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(edges[nxt]))))
                path.append(nxt)
    return None


def test_the_module_list_is_the_installed_one():
    known = modules()
    assert len(known) > 120
    assert {"hplan.executor.ranks.launch", "hplan.executor.tiers.nvme", "hplan.executor.checkpoints.checkpoint",
            "hplan.executor.activations.run", "hplan.planner.ranks.shard", "hplan.planner.tiers.host",
            "hplan.planner.baselines.gemini", "hplan.cli.run_cmd"} <= set(known)


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one():
    """The check can fail: a hand-made three-module cycle and a function-local import are found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_function_local_imports_count(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hplan.b\n"
                      "def f():\n    from hplan.a import thing\n    from hplan import c\n")
    known = {"hplan": Path(), "hplan.a": Path(), "hplan.b": Path(), "hplan.c": Path(), "hplan.d.e": Path()}
    assert imports(source, known, "hplan.m") == {"hplan.a", "hplan.c"}
    source.write_text("from . import a\nfrom .e import f\n")
    assert imports(source, known, "hplan.d.m") == {"hplan.d.e"}


def test_rooms_import_one_way():
    wrong = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets
                   if room(a) != room(b) and room(b) != "foundation" and room(b) not in ROOMS_MAY_IMPORT[room(a)])
    assert wrong == [], "imports against ARCHITECTURE.md's rooms:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(SUB_ROOMS))
def test_a_package_root_enters_its_sub_rooms_only_at_the_known_points(package):
    subs = tuple(f"{package}.{s}" for s in SUB_ROOMS[package])

    def in_sub(m: str) -> bool:
        return any(m == s or m.startswith(s + ".") for s in subs)

    entries = {(a, b) for a, targets in graph().items() for b in targets
               if (a == package or a.startswith(package + ".")) and not in_sub(a) and in_sub(b)}
    assert entries == {e for e in SUB_ROOM_ENTRIES if e[0].startswith(package)}


def test_sub_rooms_of_a_package_do_not_import_one_another_backwards():
    """executor: ranks → checkpoints → tiers, activations alone; planner: baselines, ranks, tiers beside one another."""
    order = {"hplan.executor.ranks": 3, "hplan.executor.checkpoints": 2, "hplan.executor.tiers": 1,
             "hplan.executor.activations": 1}

    def sub(m: str) -> str | None:
        return next((s for s in (*order, "hplan.planner.baselines", "hplan.planner.ranks", "hplan.planner.tiers")
                     if m == s or m.startswith(s + ".")), None)

    wrong = []
    for a, targets in graph().items():
        for b in targets:
            sa, sb = sub(a), sub(b)
            if sa and sb and sa != sb and (sa.startswith("hplan.planner") or order[sa] <= order[sb]):
                wrong.append(f"{a} -> {b}")
    assert wrong == []


def test_planner_and_reports_never_import_torch():
    known = modules()
    for name, path in known.items():
        if room(name) not in ("planner", "reports"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{name} imports torch"


def test_every_package_is_in_pyprojects_list():
    """A non-editable install ships only the packages pyproject lists: a new sub-room must be added there."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found == set(config["packages"])
