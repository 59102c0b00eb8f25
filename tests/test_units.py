"""Short units: no module of the rooms over ``MAX_MODULE_LINES`` lines and no function or method
over ``MAX_FUNCTION_LINES`` (issue 29), read from the source with ``ast``.

A module is counted by its lines, docstring and comments included; a function from its ``def``
line to its last line (decorators left out, its nested functions and classes in). A nested
function is also checked on its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("api", "dataplane", "shm", "engine")

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def sources(root: Path) -> dict[str, str]:
    """Every module of the rooms under ``root``, by its path (``shm/store.py``)."""
    return {path.relative_to(root).as_posix(): path.read_text()
            for room in ROOMS if (root / room).is_dir()
            for path in sorted((root / room).rglob("*.py"))}


def long_modules(root: Path, limit: int) -> dict[str, int]:
    """``path -> lines`` of the modules over ``limit`` lines."""
    counts = {rel: len(text.splitlines()) for rel, text in sources(root).items()}
    return {rel: n for rel, n in counts.items() if n > limit}


def functions(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """``qualified name -> lines`` of every function and method in ``tree``, nested ones too."""
    out = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            out[name] = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            out |= functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            out |= functions(node, prefix + node.name + ".")
        else:
            out |= functions(node, prefix)
    return out


def long_functions(root: Path, limit: int) -> dict[str, int]:
    """``path:qualified name -> lines`` of the functions over ``limit`` lines."""
    return {f"{rel}:{name}": n for rel, text in sources(root).items()
            for name, n in functions(ast.parse(text)).items() if n > limit}


def test_no_module_is_long() -> None:
    found = dict(sorted(long_modules(ROOT, MAX_MODULE_LINES).items()))
    assert found == {}, (f"modules over {MAX_MODULE_LINES} lines: cut each into cohesive "
                         f"modules along its seams: {found}")


def test_no_function_is_long() -> None:
    found = dict(sorted(long_functions(ROOT, MAX_FUNCTION_LINES).items()))
    assert found == {}, (f"functions over {MAX_FUNCTION_LINES} lines: cut each into named "
                         f"phases it calls: {found}")


def test_the_checks_find_long_units(tmp_path: Path) -> None:
    """The checks themselves, on a tree made here: a long module, a long method, a long function,
    a long nested one and a long async one are each named; short ones, decorators and files
    outside the rooms are not counted."""
    five = "".join(f"    x{i} = {i}\n" for i in range(5))
    for folder in ("shm", "api/routes", "benchmarks"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "shm" / "big.py").write_text("x = 1\n" * 30)
    (tmp_path / "shm" / "small.py").write_text(
        "class A:\n    @staticmethod\n    def f():\n" + five.replace("    ", "        ")
        + "\n    def short():\n        return 1\n\n"
        + "def g():\n    def h():\n" + five.replace("    ", "        ") + "    return h\n")
    (tmp_path / "api" / "routes" / "r.py").write_text("async def route():\n" + five)
    (tmp_path / "benchmarks" / "b.py").write_text("x = 1\n" * 30 + "def far():\n" + five)
    assert long_modules(tmp_path, 25) == {"shm/big.py": 30}
    assert long_functions(tmp_path, 5) == {"shm/small.py:A.f": 6, "shm/small.py:g": 8,
                                           "shm/small.py:g.h": 6, "api/routes/r.py:route": 6}
