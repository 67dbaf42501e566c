"""The package's imports run one way, down its layers, and no files import one another in a circle (docs/
ARCHITECTURE.md, "Layers"). Read from the source with `ast`: every import counts, a function's own and a type
checker's (`if TYPE_CHECKING:`) included, since each is a dependency a reader has to follow."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cbatch"

# Bottom up. A module imports only from its own layer or those below it. Within a layer, files may import each other
# (but never in a circle).
LAYERS: list[tuple[str, ...]] = [
    ("config", "fp8_kv", "tokenizer", "tools", "reasoning", "reasoning_split", "kernels", "parallel"),
    ("model",),
    ("lora",),
    ("engine",),
    ("io", "observe"),
    ("tasks",),
    ("run",),
    ("plan", "bench", "scaleout"),
    ("api",),
    ("cli", "__init__", "__main__"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The cbatch modules `path` imports anywhere in it (a name imported from a package counts as its module when
    it is one; as for `import a.b.c`, the packages above an imported module are not counted)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            found |= submodules  # `from package import module`: the module (a package's parents are never counted)
            if len(submodules) < len(node.names):
                found.add(base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for level, names in enumerate(LAYERS):
        if top in names:
            return level
    raise AssertionError(f"{module}: its folder {top!r} is in no layer of this test (add it to LAYERS and to "
                         "docs/ARCHITECTURE.md)")


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "modules that import each other in a circle: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_run_down_the_layers():
    graph = import_graph()
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))
    assert not upward, "imports from a lower layer up to a higher one: " + ", ".join(upward)


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The checks can fail: a made-up circle and an upward import are found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("cbatch.engine.runner") > layer_of("cbatch.model.decoder")
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("cbatch.nowhere.thing")
