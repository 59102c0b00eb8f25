"""Seams between the packages: facts that must have one home, checked over the source.

The process environment is read in the settings modules only (one pydantic-settings class per
process, built at the entry point and passed down); everywhere else a knob arrives as an argument.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [p for p in ("shm", "dataplane", "api", "engine") if (ROOT / p).is_dir()]

#: os functions and mappings that read or change the process environment
ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}

SETTINGS = {"api/settings.py", "dataplane/settings.py"}

#: modules that touch the environment outside the settings modules, and why that is right
EXCEPTIONS = {
    "shm/_jit.py": "sets NUMBA_CACHE_DIR (a folder per digest of shm's sources, under the given "
                   "one or XDG_CACHE_HOME) for numba, a third-party library that reads it once at "
                   "import, before any of our settings exist",
    "api/supervisor.py": "builds its children's environment: the parent's, plus the KVBLEND_* "
                         "variables of its settings (Settings.to_env)",
    "dataplane/standby.py": "reads and removes the two variables that make a process a warm spare "
                            "(its socket and configuration digest): the supervisor sets them "
                            "beside the settings, so that a spare's settings are exactly those "
                            "of the child it replaces",
    "engine/vllm_connector.py": "vLLM builds the connector from kv_connector_extra_config, which "
                                "names the variable holding the API token (api_token_env) so that "
                                "the token stays off vLLM's command line",
}


def environment_uses(source: str) -> list[int]:
    """Line numbers where ``source`` reads or changes the environment: ``os.environ`` (also under
    another name for ``os``), ``os.getenv`` and the like, or a ``from os import environ``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix"):
            if any(alias.name in ENVIRONMENT for alias in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def test_finds_every_spelling() -> None:
    assert environment_uses("import os\nos.environ.get('X')\n") == [2]
    assert environment_uses("import os as o\nv = o.environ['X']\n") == [2]
    assert environment_uses("import os\nos.getenv('X', '1')\n") == [2]
    assert environment_uses("from os import environ\nenviron['X']\n") == [1]
    assert environment_uses("'''the environment, os.environ'''\nx = 1  # os.environ\n") == []


def test_only_settings_modules_read_the_environment() -> None:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            lines = environment_uses(path.read_text())
            if lines:
                found[rel] = lines
    offenders = {rel: lines for rel, lines in found.items()
                 if rel not in SETTINGS and rel not in EXCEPTIONS}
    assert offenders == {}, ("read the environment in a settings module and pass the value down "
                             f"(or list the module in EXCEPTIONS with the reason): {offenders}")
    stale = [rel for rel in EXCEPTIONS if rel not in found]
    assert stale == [], f"listed as exceptions but no longer touch the environment: {stale}"
