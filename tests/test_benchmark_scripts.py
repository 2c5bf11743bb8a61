"""Every benchmark script still imports: each `benchmarks/*.py` is loaded as a module from its path (its
`main()` is not run), and every `mtp` name it imports — at the top or inside a function — still exists, so
moving or renaming code under `mtp/` cannot silently break a measurement script. A script keeps its work
under `main()` and `if __name__ == "__main__":`, so importing it runs nothing."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_imports_without_running(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # scripts import their siblings (heads_compare, heads_scaling)
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])  # a script that parsed arguments on import would exit
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path.name}: its work belongs in main()"


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_mtp_name_a_script_imports_exists(path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mtp":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):  # a submodule not yet imported by its package
                    importlib.import_module(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mtp":
                    importlib.import_module(alias.name)
