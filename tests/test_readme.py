"""README's examples, run against a live ``kvblend serve``, so that README cannot drift.

Which blocks run:

- Every fenced block in ``sh``, ``bash`` or ``python`` runs, unless the line directly before its
  opening fence is ``<!-- not run by tests: <reason> -->`` with a reason that is not empty.
- Blocks in ``json``, or with no language (a diagram), are shown, never run, and take no marker.
- Anything else fails the test: a block in another language, a marker with an empty reason, a
  marker that is not directly before a fence or sits before a block that never runs anyway, an
  unterminated fence. So a new example is run unless its author says why not.

How they run, in README order, against one ``kvblend serve --backend cpu`` on a fresh prefix and
a free port, started before the first block and stopped with SIGTERM after the last:

- README is run as a user types it. The test rewrites one thing only: the address
  ``127.0.0.1:8780`` becomes the live service's (a block learns the service's shm prefix from
  ``/v1/status``, as an engine does). A block that still names ``8780`` after that fails rather
  than reach a service of the developer's own.
- Each shell block runs alone in ``bash`` under ``set -euo pipefail``, the venv's ``bin`` first
  on ``PATH``, no ``KVBLEND_*`` variable of the caller, and a curl configuration with
  ``--fail-with-body``: an HTTP error fails the block like any other command. Ahead of the venv on
  ``PATH`` stand stubs of ``GUARDED`` (``pip``, ``make``, ``docker``...) that fail the block: an
  install example that lost its marker fails instead of changing the developer's venv.
- The Python blocks are one session, as if typed into one interpreter: each block runs in what
  the blocks before it left (``client``, ``prompt``, ``res``...), in one process of the venv's
  python, so README may split an example across sections and prose. Each block is compiled under
  its own README line numbers: a traceback points into README.
- A block fails the test when it exits non-zero (raises, for Python); the message names its
  README line and gives its stderr.

Claims: a comment ``# -> <literal>`` (prose may follow the literal) says what the line prints. In
Python the literal must equal one line the block printed (compared as Python literals); in a
shell block it is JSON that must match a JSON value in the block's output, where a string
``"<32 hex>"`` stands for 32 lowercase hex digits and any other ``"<...>"`` for any value.
README's error sample (the ``json`` block of ``"about:blank"``) must be exactly what the live
service answers to an invalid lookup.
"""

from __future__ import annotations

import ast
import json
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvblend.shm.names import destroy
from tests.harness import Service, remove_prefix, serve_env, unique_prefix

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN = {"sh": "shell", "bash": "shell", "python": "python"}
SHOWN = {"", "json"}
FENCE = re.compile(r"^(```+|~~~+)\s*([^\s`]*)")
MARKER = re.compile(r"^\s*<!--\s*not run by tests:(.*)-->\s*$")
README_ADDRESS = "127.0.0.1:8780"
CLAIM = "# -> "
HEX = re.compile(r"<(\d+) hex>")
BLOCK_DEADLINE = 300.0  # seconds one block may take: a deadline, never a wait
# commands that change the machine: an example that runs one was meant to carry a marker
GUARDED = ("pip", "pip3", "make", "docker", "apt-get", "apt", "sudo", "vllm")


@dataclass(frozen=True)
class Block:
    """One fenced block of README."""

    line: int  # README line of the opening fence; the body starts on the next
    lang: str
    source: str
    excuse: str | None  # the marker's reason, None when the block runs or is only shown

    @property
    def runs(self) -> bool:
        return self.lang in RUN and self.excuse is None


def parse(text: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a markdown text, and what breaks the rules of the module docstring."""
    lines = text.split("\n")
    blocks: list[Block] = []
    problems: list[str] = []
    used: set[int] = set()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening.group(1), opening.group(2)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)
                    and not lines[j].strip().strip(fence[0])), None)
        if end is None:
            problems.append(f"README.md:{i + 1}: the fence never closes")
            break
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        excuse = marker.group(1).strip() if marker else None
        if marker:
            used.add(i - 1)
        if lang not in RUN and lang not in SHOWN:
            problems.append(f"README.md:{i + 1}: a ```{lang} block: run it as sh, bash or "
                            "python, or teach tests/test_readme.py the language")
        elif excuse == "":
            problems.append(f"README.md:{i + 1}: the not-run marker gives no reason")
        elif excuse is not None and lang in SHOWN:
            problems.append(f"README.md:{i + 1}: a not-run marker on a block that never runs")
        blocks.append(Block(i + 1, lang, "\n".join(lines[i + 1:end]) + "\n", excuse))
        i = end + 1
    problems += [f"README.md:{n + 1}: a not-run marker not directly before a fence"
                 for n, line in enumerate(lines) if MARKER.match(line) and n not in used]
    if any("<!--" in line and "not run" in line and not MARKER.match(line) for line in lines):
        problems.append("README.md: a not-run marker not of the form "
                        "<!-- not run by tests: <reason> -->")
    return blocks, problems


def readme_blocks() -> list[Block]:
    blocks, problems = parse(README.read_text())
    assert not problems, "\n".join(problems)
    return blocks


# ----------------------------------------------------------------------------- the rules


def test_every_block_runs_or_says_why_not() -> None:
    blocks = readme_blocks()
    assert any(b.runs and b.lang == "python" for b in blocks)
    assert any(b.runs and RUN[b.lang] == "shell" for b in blocks)


@pytest.mark.parametrize("text,problem", [
    ("```sh\ntrue\n```\n", None),
    ("<!-- not run by tests: needs Docker -->\n```sh\ndocker ps\n```\n", None),
    ("<!-- not run by tests:   -->\n```sh\ndocker ps\n```\n", "gives no reason"),
    ("<!-- not run by tests: needs Docker -->\n\n```sh\ndocker ps\n```\n", "not directly"),
    ("<!-- not run: needs Docker -->\n```sh\ndocker ps\n```\n", "not of the form"),
    ("```shell\ntrue\n```\n", "a ```shell block"),
    ("```py\npass\n```\n", "a ```py block"),
    ("<!-- not run by tests: a sample -->\n```json\n{}\n```\n", "never runs"),
    ("```python\npass\n", "never closes"),
])
def test_the_rules(text: str, problem: str | None) -> None:
    blocks, problems = parse(text)
    if problem is None:
        assert problems == [] and len(blocks) == 1
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_a_marked_block_keeps_its_reason() -> None:
    (block,), _ = parse("<!-- not run by tests: needs Docker -->\n```sh\ndocker ps\n```\n")
    assert (block.line, block.excuse, block.runs, block.source) == (2, "needs Docker", False,
                                                                     "docker ps\n")


# ----------------------------------------------------------------------------- the service


@dataclass(frozen=True)
class Live:
    """The running service and what the examples need to reach it."""

    url: str
    address: str  # host:port, in place of README's
    prefix: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("readme")
    (home / ".curlrc").write_text("fail-with-body\nshow-error\n")
    guard = home / "guard"
    guard.mkdir()
    for command in GUARDED:
        stub = guard / command
        stub.write_text(f"#!/bin/sh\necho 'README ran {command} '\"$*\"': mark its block not run"
                        " by tests' >&2\nexit 1\n")
        stub.chmod(0o755)
    venv_bin = str(Path(sys.executable).parent)
    env = serve_env()
    env.update(PATH=os.pathsep.join([str(guard), venv_bin, env.get("PATH", "")]),
               CURL_HOME=str(home))
    prefix, log_path = unique_prefix(), home / "serve.log"
    try:
        svc = Service(prefix, env=env, log=log_path)
        try:
            yield Live(svc.url, f"127.0.0.1:{svc.port}", prefix, env)
        finally:
            rc = svc.stop()
    finally:
        try:
            destroy(prefix)
        finally:
            remove_prefix(prefix)  # what a failed block left: engine buffers under the prefix
    assert rc == 0, f"kvblend serve exited with {rc} after SIGTERM:\n{log_path.read_text()}"


# ----------------------------------------------------------------------------- the blocks


def as_run(block: Block, live: Live) -> str:
    """The block's source as the test runs it (the module docstring's rewrite)."""
    source = block.source.replace(README_ADDRESS, live.address)
    assert "8780" not in source, (
        f"README.md:{block.line}: names port 8780 in a form the test does not rewrite")
    return source


def failed(block: Block, what: str, stderr: str, stdout: str = "") -> str:
    return (f"README.md:{block.line}: the {block.lang} block {what}\n--- stderr ---\n"
            f"{stderr[-6000:]}\n--- stdout ---\n{stdout[-3000:]}")


# The Python session: one interpreter that runs each block it is sent (one JSON line on stdin)
# in one namespace and answers one JSON line on the descriptor stdout had at its start; fd 1
# itself goes to stderr, so nothing a block or a library writes there can garble the answers.
SESSION = r"""
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
namespace = {"__name__": "__main__"}
for request in sys.stdin:
    block = json.loads(request)
    out, error = io.StringIO(), ""
    code = compile("\n" * block["line"] + block["source"], "README.md", "exec")
    try:
        with contextlib.redirect_stdout(out):
            exec(code, namespace)
    except BaseException:
        error = traceback.format_exc()
    answers.write(json.dumps({"stdout": out.getvalue(), "error": error}) + "\n")
    answers.flush()
"""


class Session:
    """One venv python running README's Python blocks in one namespace."""

    def __init__(self, env: dict[str, str], stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", SESSION], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr)

    def run(self, line: int, source: str) -> dict[str, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"line": line, "source": source}).encode() + b"\n")
        self.proc.stdin.flush()
        fd, answer = self.proc.stdout.fileno(), b""
        deadline = time.monotonic() + BLOCK_DEADLINE
        while not answer.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return {"stdout": "", "error": f"no answer within {BLOCK_DEADLINE} s"}
            piece = os.read(fd, 1 << 16)
            if not piece:
                return {"stdout": "", "error": f"the interpreter exited ({self.proc.wait()})"}
            answer += piece
        return dict(json.loads(answer))

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text()

    def close(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            return self.proc.wait(BLOCK_DEADLINE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.proc.stdout.close()
            self._stderr.close()


def run_shell(block: Block, live: Live) -> str:
    """Run a shell block; return its stdout."""
    # the ERR trap names the README line of the command that failed (the body's first line is
    # the script's second, README's block.line + 1)
    head = ("set -euo pipefail; "
            f"trap 'echo README.md:$((LINENO + {block.line - 1})) failed >&2' ERR\n")
    try:
        done = subprocess.run(["bash", "-c", head + as_run(block, live)],
                              cwd=ROOT, env=live.env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=BLOCK_DEADLINE)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(failed(block, f"took over {BLOCK_DEADLINE} s", str(exc.stderr or "")))
    if done.returncode != 0:
        pytest.fail(failed(block, f"exited with {done.returncode}", done.stderr, done.stdout))
    return done.stdout


@pytest.mark.slow
def test_the_examples_run(live: Live, tmp_path: Path) -> None:
    session: Session | None = None
    try:
        for block in readme_blocks():
            if not block.runs:
                continue
            if RUN[block.lang] == "shell":
                check_json_claims(block, run_shell(block, live))
                continue
            session = session or Session(live.env, tmp_path / "python.stderr")
            answer = session.run(block.line, as_run(block, live))
            if answer["error"]:
                pytest.fail(failed(block, "raised", answer["error"] + session.stderr(),
                                   answer["stdout"]))
            check_python_claims(block, answer["stdout"])
    finally:
        rc = session.close() if session else 0
    assert rc == 0, f"the Python session exited with {rc}:\n{session and session.stderr()}"
    # the client prints nothing a user did not ask for: no warning, no compile noise
    assert session is not None and session.stderr() == "", session and session.stderr()


@pytest.mark.slow
def test_commands_that_change_the_machine_fail(live: Live) -> None:
    for command in ("pip --version", "make --version", "docker --version"):
        done = subprocess.run(["bash", "-c", command], env=live.env, capture_output=True,
                              text=True, timeout=BLOCK_DEADLINE)
        assert done.returncode == 1 and "mark its block not run" in done.stderr, command


# ----------------------------------------------------------------------------- claims


def claims(block: Block) -> list[tuple[int, str]]:
    """``(README line, literal)`` of each ``# -> <literal>`` in the block."""
    found = []
    for n, line in enumerate(block.source.split("\n")):
        at = line.find(CLAIM)
        if at >= 0:
            found.append((block.line + 1 + n, leading_literal(line[at + len(CLAIM):])))
    return found


def leading_literal(text: str) -> str:
    """The bracketed literal that ``text`` starts with (prose may follow it)."""
    depth, quote = 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
            if depth == 0:
                return text[:i + 1]
    raise AssertionError(f"no bracketed literal after '# ->' in {text!r}")


def check_python_claims(block: Block, stdout: str) -> None:
    printed = []
    for out in stdout.splitlines():
        try:
            printed.append(ast.literal_eval(out))
        except (ValueError, SyntaxError):
            continue
    for line, claim in claims(block):
        assert ast.literal_eval(claim) in printed, (
            f"README.md:{line} claims {claim}; the block printed:\n{stdout}")


def check_json_claims(block: Block, stdout: str) -> None:
    values = json_values(stdout)
    for line, claim in claims(block):
        assert any(fits(json.loads(claim), v) for v in values), (
            f"README.md:{line} claims {claim}; the block printed:\n{stdout}")


def json_values(text: str) -> list[Any]:
    """Every JSON object or array in ``text``, outermost only (curl prints no newline)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                i += 1
                continue
            values.append(value)
            i = end
        else:
            i += 1
    return values


def fits(claimed: Any, actual: Any) -> bool:
    if isinstance(claimed, dict):
        return (isinstance(actual, dict) and claimed.keys() == actual.keys()
                and all(fits(claimed[k], actual[k]) for k in claimed))
    if isinstance(claimed, list):
        return (isinstance(actual, list) and len(claimed) == len(actual)
                and all(fits(c, a) for c, a in zip(claimed, actual)))
    if isinstance(claimed, str) and claimed.startswith("<") and claimed.endswith(">"):
        hex_digits = HEX.fullmatch(claimed)
        if hex_digits is None:
            return True
        pattern = f"[0-9a-f]{{{hex_digits.group(1)}}}"
        return isinstance(actual, str) and re.fullmatch(pattern, actual) is not None
    return bool(claimed == actual and type(claimed) is type(actual))


# ----------------------------------------------------------------------------- the error sample


@pytest.mark.slow
def test_the_error_sample_is_what_the_service_answers(live: Live) -> None:
    """README's problem+json sample, titles included (``api.errors.TITLES``): an invalid token id
    in README's own lookup."""
    (sample,) = [v for b in readme_blocks() if b.lang == "json"
                 for v in [json.loads(b.source)] if v.get("type") == "about:blank"]
    body = {"model_name": "m", "world_size": 1, "token_ids": [1, -1], "cache_salt": ""}
    r = httpx.post(live.url + sample["instance"], json=body, timeout=30)
    assert r.status_code == sample["status"]
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json() == sample
