"""The drawing held: every import between kvblend's modules is one that the rules table of
docs/architecture.md allows (read from the doc here, so the rules are written once), and no
module imports one that imports it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
ROOMS = ("shm", "dataplane", "api", "engine")


def rules(text: str) -> dict[str, list[str]]:
    """The rules table of the doc: module pattern -> allowed patterns (``room.*`` or a module)."""
    table = text.split("## The rules", 1)[1]
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            out[cells[0].strip("`")] = re.findall(r"`([^`]+)`", cells[1])
    return out


def modules(root: Path) -> dict[str, Path]:
    """Every module of the rooms, by its name under ``kvblend.`` (without the prefix)."""
    found = {}
    for room in ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(source: str, known: set[str]) -> set[str]:
    """The kvblend modules ``source`` imports anywhere (module level or inside a function), without
    the ``kvblend.`` prefix: ``from kvblend.x import y`` is ``x.y`` when that is a module."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}"[8:] in known
                     else node.module for a in node.names]
        else:
            continue
        out |= {n[len("kvblend."):] for n in names if n.startswith("kvblend.")}
    return out


def matches(pattern: str, module: str) -> bool:
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def row_of(module: str, table: dict[str, list[str]]) -> list[str] | None:
    """The allowed patterns of the most specific row naming ``module``."""
    exact = table.get(module)
    if exact is not None:
        return exact
    rooms = [p for p in table if p.endswith(".*") and matches(p, module)]
    return table[max(rooms, key=len)] if rooms else None


def offences(root: Path, table: dict[str, list[str]]) -> list[str]:
    found = modules(root)
    out = []
    for name, path in found.items():
        allowed = row_of(name, table)
        if allowed is None:
            out.append(f"{name}: no row of the rules names it")
            continue
        for target in sorted(imports(path.read_text(), set(found))):
            if not any(matches(p, target) for p in allowed):
                out.append(f"{name} imports {target}")
    return out


def cycles(root: Path) -> list[list[str]]:
    """Import circles among the modules (``a`` imports ``b`` which imports ``a``, at any depth;
    imports inside functions and for type checking count too), each as a path back to its
    start."""
    found = modules(root)
    graph = {name: imports(path.read_text(), set(found)) - {name} for name, path in found.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    out: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name] & set(graph)):
            if state.get(target) == 1:
                out.append(path[path.index(target):] + [name, target])
            elif target not in state:
                visit(target, path + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return out


def test_no_module_imports_one_that_imports_it() -> None:
    assert cycles(ROOT) == []


def test_a_circle_is_found(tmp_path: Path) -> None:
    for room in ROOMS:
        (tmp_path / room).mkdir()
        (tmp_path / room / "__init__.py").write_text("")
    (tmp_path / "shm" / "store.py").write_text("from kvblend.shm.records import Pin\n")
    (tmp_path / "shm" / "records.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvblend.shm.store import Store\n")
    assert cycles(tmp_path) == [["shm.records", "shm.store", "shm.records"]]


def test_every_import_is_one_the_rules_allow() -> None:
    table = rules(DOC.read_text())
    assert set(table) >= {f"{room}.*" for room in ROOMS}
    assert offences(ROOT, table) == []


def test_the_rules_name_only_modules_that_exist() -> None:
    table = rules(DOC.read_text())
    known = set(modules(ROOT))
    named = {p for key, allowed in table.items() for p in [key, *allowed]}
    assert sorted(p for p in named if not p.endswith(".*") and p not in known) == []


def test_a_broken_rule_is_found(tmp_path: Path) -> None:
    """The check itself: a storage module reaching up, an engine module reaching into storage
    (inside a function too) and a module no row names are each reported."""
    for room in ROOMS:
        (tmp_path / room).mkdir()
        (tmp_path / room / "__init__.py").write_text("")
    (tmp_path / "shm" / "store.py").write_text("from kvblend.dataplane import client\n")
    (tmp_path / "dataplane" / "client.py").write_text("from kvblend.shm.store import Store\n")
    (tmp_path / "engine" / "blend.py").write_text(
        "def f():\n    from kvblend.shm import store\n    import kvblend.dataplane.client\n")
    (tmp_path / "api" / "app.py").write_text("import kvblend.dataplane.client\n")
    table = rules(DOC.read_text())
    assert sorted(offences(tmp_path, table)) == ["api.app imports dataplane.client",
                                                 "engine.blend imports shm.store",
                                                 "shm.store imports dataplane.client"]
    assert "dataplane: no row of the rules names it" in offences(tmp_path, {"shm.*": ["shm.*"]})
