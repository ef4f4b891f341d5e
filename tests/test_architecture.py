"""The package's layout as a rule: each folder of `sailor/` is one layer, imports run down only, no
two modules import each other (directly or round a longer circle), and the layers below the runtime
never import torch. Read from the source with `ast` (every import, at the top of a module or inside a
function, counts), so nothing is imported or run."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sailor"

# Layers from the bottom up (README "Layout"); a module may import its own layer and those below it.
LAYERS = ("core", "catalog", "model", "specs", "perf", "plan", "simulator", "planner", "runtime", "launch",
          "report", "elastic", "api", "cli", "sailor")
TORCH_FREE = ("core", "catalog", "model", "specs", "perf", "plan", "simulator", "planner", "launch", "report", "api")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(sailor module -> sailor modules it imports, sailor module -> outside top-level packages it imports)."""
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


def test_imports_run_down_only():
    inside, _ = import_graph()
    upward = sorted((a, b) for a, targets in inside.items() for b in targets
                    if LAYERS.index(layer(b)) > LAYERS.index(layer(a)))
    assert upward == []


@pytest.mark.parametrize("layer_name", TORCH_FREE)
def test_layers_below_the_runtime_never_import_torch(layer_name):
    _, outside = import_graph()
    heavy = sorted(m for m, ext in outside.items() if layer(m) == layer_name and "torch" in ext)
    assert heavy == []


def test_a_unit_test_cannot_start_a_process():
    # the tiers are a rule: without the integration marker, starting a process fails the test
    import subprocess

    from conftest import ProcessInUnitTest
    with pytest.raises(ProcessInUnitTest, match="mark it @pytest.mark.integration"):
        subprocess.run(["true"], check=False)
