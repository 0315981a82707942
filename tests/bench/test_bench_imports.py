"""Every bench/ script imports: a bench that imports a renamed, moved or removed name of the package
fails the suite instead of the next person who runs it.

Each script is imported as a module (its `if __name__ == "__main__"` block does not run). Benches
also import inside their functions and reach names through module aliases (``kernel.x``,
``S.y``); those are read from the source and resolved too, since importing the script alone runs
only its top-level imports.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))
OURS = ("resserve_export", "planners")


def _ours(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in OURS


def _package_references(tree: ast.Module) -> tuple[list[tuple[int, str, str | None]], list[tuple[int, str, str]]]:
    """(line, module, name or None) for every import of the package anywhere in the script, and
    (line, alias, attribute) for every attribute read through an alias bound to a package module."""
    imports: list[tuple[int, str, str | None]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module):
            for a in node.names:
                imports.append((node.lineno, node.module, a.name))
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name):
                    imports.append((node.lineno, a.name, None))
                    if a.asname:
                        aliases[a.asname] = a.name
    attrs = [
        (node.lineno, node.value.id, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
    ]
    return imports, [(line, aliases[alias], attr) for line, alias, attr in attrs]


def test_every_bench_script_is_found():
    names = {p.stem for p in SCRIPTS}
    assert {"awq", "calibrate", "kernel", "kv_cache", "pack", "plan", "quantize"} <= names, names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_imports(script: Path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # scripts put the repository root first
    monkeypatch.setattr(sys, "argv", [str(script)])
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"

    imports, attrs = _package_references(ast.parse(script.read_text()))
    missing = []
    for line, mod, name in imports:
        target = importlib.import_module(mod)
        if name is not None and not hasattr(target, name):
            try:  # `from package import submodule`
                importlib.import_module(f"{mod}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{script.name}:{line}: from {mod} import {name}")
    for line, qual, attr in attrs:
        mod, _, name = qual.rpartition(".")
        try:
            obj = importlib.import_module(qual)
        except ModuleNotFoundError:
            obj = getattr(importlib.import_module(mod), name)
        if isinstance(obj, types.ModuleType) and not hasattr(obj, attr):
            missing.append(f"{script.name}:{line}: {qual}.{attr}")
    assert not missing, "bench scripts use names the package no longer has:\n" + "\n".join(missing)
