"""The package's layout as a rule: each folder of `sailor/` is one layer, imports run down only, no
two modules import each other (directly or round a longer circle), and no layer but the runtime
imports torch. Read from the source with `ast` (every import, at the top of a module or inside a
function, counts), so nothing is imported or run."""

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sailor"

# Layers from the bottom up (README "Layout"); a module may import its own layer and those below it.
LAYERS = ("core", "catalog", "model", "specs", "perf", "plan", "simulator", "planner", "runtime", "launch",
          "testbed", "report", "elastic", "api", "cli", "sailor")
TORCH_FREE = tuple(name for name in LAYERS if name != "runtime")  # torch comes in through the runtime alone


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(sailor module -> sailor modules it imports, sailor module -> outside top-level packages it imports),
    read once per session (the tests only read it)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    inside: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        got, ext = set(), set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] != "sailor":
                    ext.add(base.split(".")[0])
                    continue
                for alias in node.names:  # `from sailor.x import y`: y is a module or a name in x
                    full = f"{base}.{alias.name}"
                    got.add(full if full in modules else base)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    (got if alias.name.split(".")[0] == "sailor" else ext).add(
                        alias.name if alias.name.split(".")[0] == "sailor" else alias.name.split(".")[0])
        inside[name] = {m for m in got if m in modules and m != name}
        outside[name] = ext
    return inside, outside


def layer(module: str) -> str:
    parts = module.split(".")
    return "sailor" if len(parts) == 1 or parts[1] in ("__main__",) else parts[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    inside, _ = import_graph()
    assert cycles(inside) == []


def test_the_cycle_finder_finds_cycles():
    # the check above cannot pass by accident: a three-module circle and a pair are both found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}) == [["a", "b", "c"],
                                                                                               ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_folder_is_a_layer():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders == set(LAYERS) - {"api", "cli", "sailor"} | {"cli"}
    loose = {p.stem for p in ROOT.glob("*.py")}
    assert loose == {"__init__", "__main__", "api"}


def test_the_readme_shows_the_layers_as_they_are():
    # README "Layout" lists one row per layer, bottom up, in the order this test enforces
    readme = (ROOT.parent / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `sailor/(\w+)(?:/|\.py)` \|", section, re.M)
    assert rows == [name for name in LAYERS if name != "sailor"]


def test_imports_run_down_only():
    inside, _ = import_graph()
    upward = sorted((a, b) for a, targets in inside.items() for b in targets
                    if LAYERS.index(layer(b)) > LAYERS.index(layer(a)))
    assert upward == []


@pytest.mark.parametrize("layer_name", TORCH_FREE)
def test_only_the_runtime_imports_torch(layer_name):
    _, outside = import_graph()
    heavy = sorted(m for m, ext in outside.items() if layer(m) == layer_name and "torch" in ext)
    assert heavy == []


def module_level_functions(*layers: str) -> set[str]:
    """Names of the functions and classes the modules of `layers` define at their top level."""
    return {node.name for name in layers for path in (ROOT / name).rglob("*.py")
            for node in ast.parse(path.read_text(), str(path)).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def computing_code(source: str, computes: set[str]) -> list[str]:
    """What in `source` computes rather than draws: an import from the planner outside an
    `if TYPE_CHECKING:` block (types for annotations only), or a call of a name in `computes`."""
    tree = ast.parse(source)
    typing_only = {id(n) for top in tree.body if isinstance(top, ast.If) and ast.unparse(top.test) == "TYPE_CHECKING"
                   for n in ast.walk(top)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sailor.planner") \
                and id(node) not in typing_only:
            found.append(f"line {node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in computes:
                found.append(f"line {node.lineno}: calls {name}")
    return found


def test_the_report_only_draws():
    """STYLE.md §4.3: figures take what the simulator and the planner computed; `report` runs no search
    and re-derives no cost (no planner or simulator function is called there)."""
    computes = module_level_functions("planner", "simulator")
    assert {"plan_job", "compare_searches", "simulate", "stage_sync", "link_transfer"} <= computes
    found = {str(path.relative_to(ROOT)): computing_code(path.read_text(), computes)
             for path in (ROOT / "report").rglob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_drawing_check_finds_searches_and_costs():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sailor.planner import PlanResult\n"
              "def draw(ctx, options):\n    from sailor.planner import plan_job\n"
              "    return plan_job(ctx, options), sim.stage_sync(ctx, [], ())\n")
    assert computing_code(source, {"plan_job", "stage_sync"}) == [
        "line 5: imports sailor.planner", "line 6: calls plan_job", "line 6: calls stage_sync"]


def test_a_unit_test_cannot_start_a_process():
    # the tiers are a rule: without the integration marker, starting a process fails the test
    import subprocess

    from conftest import ProcessInUnitTest
    with pytest.raises(ProcessInUnitTest, match="mark it @pytest.mark.integration"):
        subprocess.run(["true"], check=False)
