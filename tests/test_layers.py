"""The house rules, checked on the code itself: the import graph of `mtp` (built with `ast`, every
import, top-level or inside a function) has no circle, no module imports from a higher layer or
sideways from another package of its own layer, no module imports another's private (`_name`)
names, and the engine (core) holds no command-line parsing and no exporter.

Layers, lowest first: core (model, kernels, cache, sampling, strategy, proposers, decode, engine) <
training, interop (other engines: exports to vLLM and llama.cpp, their environments and runners) <
eval, serving, pipeline < tune < cli. A package may import itself and lower layers only (so serving
never reaches into eval); `__main__` modules are entry points and may import anything.

Core has sub-layers by role, lowest first: runtime (model, loading, gguf, weights, kernels, cache,
adapter: one forward pass) < decoding (sampling, strategies, trees, proposers, the loop, batching,
metrics) < policy (cost model, calibration, quality, deploy files) < the engine (`mtp.core.engine`),
which ties them together.
`python tests/test_layers.py [ROOT]` prints the graph's circles and back-edges.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"core": 0, "training": 1, "interop": 1, "eval": 2, "serving": 2, "pipeline": 2, "tune": 3, "cli": 4}
CORE_LAYERS = {"runtime": 0, "decoding": 1, "policy": 2, "engine": 3}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: modules of `mtp` it imports} for every module under root/mtp."""
    files = sorted((root / "mtp").rglob("*.py"))
    modules = {module_name(f, root): f for f in files}
    graph: dict[str, set[str]] = {}
    for name, f in modules.items():
        is_pkg = f.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def layer(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return parts[1], LAYERS[parts[1]]


def back_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that break the layering."""
    out = []
    for a, targets in graph.items():
        if a.endswith("__main__") or layer(a) is None:
            continue
        (pa, la) = layer(a)
        for b in targets:
            lb = layer(b)
            if lb is not None and lb[0] != pa and lb[1] >= la:
                out.append((a, b))
    return sorted(out)


def core_layer(module: str) -> tuple[str, int] | None:
    """(role, rank) of a module inside mtp.core, None outside core or for an unplaced core module."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "core" or parts[2] not in CORE_LAYERS:
        return None
    return parts[2], CORE_LAYERS[parts[2]]


def core_back_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs inside core that reach up or sideways across its roles."""
    out = []
    for a, targets in graph.items():
        ca = core_layer(a)
        if ca is None:
            continue
        for b in targets:
            cb = core_layer(b)
            if cb is not None and cb[0] != ca[0] and cb[1] >= ca[1]:
                out.append((a, b))
    return sorted(out)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_no_import_from_a_higher_layer():
    assert back_edges(import_graph()) == []


def test_every_module_sits_in_a_layer():
    graph = import_graph()
    loose = [m for m in graph if m not in ("mtp",) and layer(m) is None and m.split(".")[1] not in ("assets",)]
    assert loose == []


def test_shipped_assets_and_kernel_sources_are_found_where_their_modules_look():
    """Modules that find files beside themselves (`Path(__file__)`) still find them after a move."""
    from mtp.core.runtime import artifacts, kernels

    assert artifacts.ASSETS == ROOT / "mtp" / "assets" and (artifacts.ASSETS / "smollm2-135m").is_dir()
    assert all(p.is_file() for p in kernels.SOURCES + kernels.HEADERS)


def test_core_roles_import_downward_only():
    assert core_back_edges(import_graph()) == []


def test_every_core_module_has_a_role():
    graph = import_graph()
    assert [m for m in graph if m.startswith("mtp.core.") and core_layer(m) is None] == []


def private_imports(root: Path = ROOT) -> list[str]:
    """`from mtp.x import _name` of another module's private name (tests and entry points aside)."""
    out = []
    for f in sorted((root / "mtp").rglob("*.py")):
        name = module_name(f, root)
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mtp") and node.module != name:
                out += [
                    f"{name}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return out


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_core_holds_no_command_line_and_no_exporter():
    """argparse lives in mtp.cli; exporters to other engines in mtp.interop (core imports neither: the
    layer check keeps interop out, this keeps argparse and an exporter's own code out)."""
    for f in sorted((ROOT / "mtp" / "core").rglob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "argparse" not in mods, f
        assert "export" not in f.stem, f


def test_checker_catches_a_circle_and_a_back_edge(tmp_path):
    """The checks can fail: a core module importing the CLI, and a two-module circle."""
    pkg = tmp_path / "mtp"
    for sub in ("core", "cli"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from mtp.core import b\n")
    (pkg / "core" / "b.py").write_text("def f():\n    from mtp.core.a import x\n    import mtp.cli.main\n")
    (pkg / "cli" / "main.py").write_text("x = 1\n")
    (pkg / "core" / "c.py").write_text("from mtp.core.a import _hidden\n")
    graph = import_graph(tmp_path)
    assert circles(graph) == [["mtp.core.a", "mtp.core.b"]]
    assert back_edges(graph) == [("mtp.core.b", "mtp.cli.main")]
    assert private_imports(tmp_path) == ["mtp.core.c: mtp.core.a._hidden"]


def test_checker_catches_a_core_role_reaching_up(tmp_path):
    """Runtime importing decoding (lazily, inside a function) is caught; decoding importing runtime is not."""
    pkg = tmp_path / "mtp"
    for sub in ("core", "core/runtime", "core/decoding"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "runtime" / "model.py").write_text("def f():\n    from mtp.core.decoding import loop\n")
    (pkg / "core" / "decoding" / "loop.py").write_text("from mtp.core.runtime.model import f\n")
    assert core_back_edges(import_graph(tmp_path)) == [
        ("mtp.core.runtime.model", "mtp.core.decoding"),
        ("mtp.core.runtime.model", "mtp.core.decoding.loop"),
    ]


if __name__ == "__main__":
    g = import_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print(f"{len(g)} modules, {sum(len(v) for v in g.values())} imports")
    print("circles:", circles(g) or "none")
    print("back-edges:", back_edges(g) or "none")
    print("core back-edges:", core_back_edges(g) or "none")
