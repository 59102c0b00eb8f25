"""Every file, module, test, figure and make target that README.md and docs/*.md name exists.

A doc names a repository path (``tests/api/test_auth.py``, ``benchmarks/bench_matcher.py``,
``docs/blend_quality.png``, ``deploy/compose.yaml``, a glob such as ``tests/api/test_*.py``), a
relative Markdown link or image (``[..](remote.md)``, ``![..](blend_quality.png)``), a test as
``path::test_name`` (that function in that file) or as a bare ```test_name``` (a test function of
that name in the test files the same line names, else anywhere under ``tests/``), a module or a
name in one (```shm.slab```, ```kvblend.api.auth.role_of```), or a ```make target``` (a target of
the Makefile). Each must exist; the failure lists every one that
does not, with its doc and line.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("tests", "benchmarks", "docs", "api", "dataplane", "shm", "engine", "scripts", "deploy",
       "openapi")
# a path starts a word (not after "/" or a dot: /dev/shm/..., a URL, kvblend.api/...)
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})/[\w./*-]*)")
TEST_REF = re.compile(r"((?:tests/)[\w/]+\.py)::(\w+)")
BARE_TEST = re.compile(r"`(test_\w+)(?:\[[^`\]]*\])?`")
MAKE = re.compile(r"(?:`|^\s*(?:\$ )?)make ((?:[\w-]+ ?)+)", re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
ROOMS = ("shm", "dataplane", "api", "engine")
# a module or a name in one, in backticks: `shm.slab`, `kvblend.api.auth.role_of`
DOTTED = re.compile(rf"`(?:kvblend\.)?((?:{'|'.join(ROOMS)})(?:\.\w+)+)(?=[`(\[])")


def lines(doc: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(doc.read_text().splitlines(), 1)


@functools.cache
def defined(path: Path) -> frozenset[str]:
    """The names of the functions and classes ``path`` defines, at any depth."""
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


@functools.cache
def every_test() -> frozenset[str]:
    return frozenset().union(*(defined(p) for p in (ROOT / "tests").rglob("test_*.py")))


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([\w.-]+)\s*:(?!=)", text, re.MULTILINE))


def top_level(path: Path) -> frozenset[str]:
    """The names ``path`` binds at module level: definitions, assignments and imports."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def dotted_exists(ref: str) -> bool:
    """``room.module[.name...]``: the longest prefix that is a module, and the next part a name
    that module binds at its top (what follows that is not checked)."""
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            return i == len(parts) or parts[i] in top_level(module) or (
                base.is_dir() and (base / f"{parts[i]}.py").is_file())
    return False


def path_exists(ref: str) -> bool:
    ref = ref.rstrip(".,;:")
    if "*" in ref:
        return any(ROOT.glob(ref))
    return (ROOT / ref).exists()


def missing_in(doc: Path) -> list[str]:
    """Every claim of ``doc`` that names something that is not there."""
    name = doc.relative_to(ROOT)
    out = []
    for n, line in lines(doc):
        where = f"{name}:{n}"
        for ref in PATH.findall(line):
            if not path_exists(ref):
                out.append(f"{where}: no file {ref.rstrip('.,;:')}")
        for ref, test in TEST_REF.findall(line):
            if (ROOT / ref).exists() and test not in defined(ROOT / ref):
                out.append(f"{where}: {ref} has no {test}")
        named = [ROOT / p for p in PATH.findall(line) if p.startswith("tests/")
                 and p.endswith(".py") and (ROOT / p).exists()]
        files = ", ".join(str(p.relative_to(ROOT)) for p in named)
        for test in BARE_TEST.findall(line):
            if not any(test in defined(p) for p in named) and test not in every_test():
                out.append(f"{where}: no test {test}" + (f" in {files}" if named else ""))
        for targets in MAKE.findall(line):
            out += [f"{where}: no make target {t}" for t in targets.split()
                    if t not in make_targets() and not t.startswith("-")]
        for ref in DOTTED.findall(line):
            if not dotted_exists(ref):
                out.append(f"{where}: no module or name {ref}")
        for link in LINK.findall(line):
            target = link.split("#")[0]
            if target and "://" not in target and not target.startswith("mailto:") \
                    and not (doc.parent / target).exists():
                out.append(f"{where}: the link {link} leads nowhere")
    return out


def test_the_peer_venv_is_built_as_the_matcher_benchmark_says() -> None:
    """docs/benchmarks.md gives the commands ``bench_matcher.py`` prints when its peer is missing."""
    tree = ast.parse((ROOT / "benchmarks" / "bench_matcher.py").read_text())
    (setup,) = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "PEER_SETUP" for t in n.targets)]
    assert f"```sh\n{setup}\n```" in (ROOT / "docs" / "benchmarks.md").read_text()


def test_every_named_file_test_figure_and_target_exists() -> None:
    missing = [m for doc in DOCS for m in missing_in(doc)]
    assert not missing, "the docs name what is not there:\n" + "\n".join(missing)


@pytest.mark.parametrize("text,found", [
    ("see `tests/api/test_auth.py`", []),
    ("see `tests/api/test_nothing.py`.", ["no file tests/api/test_nothing.py"]),
    ("`tests/api/test_*.py` and `tests/api/test_zz*.py`", ["no file tests/api/test_zz*.py"]),
    ("tests/api/test_auth.py::test_no_such_test", ["has no test_no_such_test"]),
    ("`test_no_such_test` in `tests/api/test_auth.py`", ["no test test_no_such_test in"]),
    ("run `make test` or `make no-such-target`", ["no make target no-such-target"]),
    ("![a figure](no_such_figure.png)", ["the link no_such_figure.png leads nowhere"]),
    ("/dev/shm/kvblend_meta and https://example.org/docs/x.md", []),
    ("`api.errors`, `kvblend.api.errors.ErrorCode`, `api.errors.code_of()`", []),
    ("`api.no_such_module` and `kvblend.api.errors.NoSuchName`",
     ["no module or name api.no_such_module", "no module or name api.errors.NoSuchName"]),
])
def test_the_checker_finds_what_is_missing(tmp_path: Path, text: str, found: list[str]) -> None:
    doc = ROOT / "docs" / f"_probe_{tmp_path.name}.md"  # links resolve against docs/
    doc.write_text(text + "\n")
    try:
        got = missing_in(doc)
    finally:
        doc.unlink()
    assert len(got) == len(found) and all(f in g for f, g in zip(found, got)), got
