"""The package's import structure, read from the source with ``ast``: no two modules of
dartcore import each other (directly or round a longer circle, lazy imports inside
functions counted), and no module imports another's ``_private`` name.

``dartcore._native`` (the compiled bindings, private by design and wrapped by the public
modules) is the one private module others may import; ``if TYPE_CHECKING:`` imports do not
run and are not counted.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "dartcore"
ALLOWED_PRIVATE_MODULES = {"dartcore._native"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, tree: ast.Module):
    """(imported module, imported name or None, node) for every import that runs."""
    package = name if _is_package(name) else name.rpartition(".")[0]

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    yield from walk_one(sub)
                continue
            yield from walk_one(child)

    def walk_one(node):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node, alias.asname
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield base, alias.name, node, alias.asname
        yield from walk(node)

    yield from walk(tree)


def _graph():
    """module -> {imported dartcore modules}, and the private-name imports across modules."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    private: list[str] = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        module_aliases: dict[str, str] = {}
        for module, imported, node, asname in _imports(name, tree):
            if not module.startswith("dartcore"):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            if imported is None:  # import a.b.c
                if module in MODULES:
                    edges[name].add(module)
                    if asname:
                        module_aliases[asname] = module
                continue
            full = f"{module}.{imported}"
            if full in ALLOWED_PRIVATE_MODULES:
                continue
            if full in MODULES:  # from package import submodule
                edges[name].add(full)
                module_aliases[asname or imported] = full
                if _private(imported) and full not in ALLOWED_PRIVATE_MODULES and module != name:
                    private.append(f"{where}: imports the private module {full}")
                continue
            if module in MODULES and module != name:
                edges[name].add(module)
                if _private(imported):
                    private.append(f"{where}: imports {module}'s private name {imported}")
        # module._private through a module imported by name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases
                and _private(node.attr)
            ):
                target = module_aliases[node.value.id]
                if target not in ALLOWED_PRIVATE_MODULES and target != name:
                    private.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: reads {target}'s private "
                        f"name {node.attr}"
                    )
    for name in edges:
        edges[name].discard(name)
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_the_package():
    edges, _ = _graph()
    assert "dartcore.decoder" in edges and "dartcore.rounds" in edges["dartcore.decoder"]
    assert "dartcore.rounds" in edges["dartcore.engine"]


def test_the_cycle_finder_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(edges) == [["a", "b", "c"]]


def test_no_import_cycles():
    edges, _ = _graph()
    cycles = _cycles(edges)
    assert not cycles, "modules that import each other (directly or round a circle): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_private_names_across_modules():
    _, private = _graph()
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_the_engine_never_imports_the_decoder():
    edges, _ = _graph()
    seen, todo = set(), ["dartcore.engine"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges.get(m, ()))
    assert "dartcore.decoder" not in seen


def test_old_module_names_still_import_with_a_warning():
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    import dartcore.builders, dartcore.verify, dartcore.build.map\n"
        "for w in seen:\n"
        "    print(w.category.__name__, w.message)\n"
        "import dartcore.acceptance, dartcore.ngram_build.map, dartcore.trees\n"
        "from dartcore.builders import BeamBuilder, make_tree_builder\n"
        "assert make_tree_builder is dartcore.trees.make_tree_builder and BeamBuilder is dartcore.trees.BeamBuilder\n"
        "assert dartcore.verify.accept is dartcore.acceptance.accept\n"
        "assert dartcore.build.map.MapOptions is dartcore.ngram_build.map.MapOptions\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"DeprecationWarning {old} is now {new}: import it from there (the old name goes in the next release)"
        for old, new in (
            ("dartcore.builders", "dartcore.trees"),
            ("dartcore.verify", "dartcore.acceptance"),
            ("dartcore.build", "dartcore.ngram_build"),
            ("dartcore.build.map", "dartcore.ngram_build.map"),
        )
    ]
