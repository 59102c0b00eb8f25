"""The Grafana dashboard (``deploy/grafana/dashboards/kvblend.json``) asks only for series the
service exports, in PromQL that Prometheus parses (``promtool check rules``, where installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy/grafana/dashboards/kvblend.json").read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
EXPRS = [t["expr"] for p in PANELS for t in p["targets"]]
# the data plane's process metrics are the API's own ``process_*`` names under this prefix; a
# test app has no data plane to report them
DATAPLANE = "kvblend_dataplane_"


def series_names(text: str) -> set[str]:
    """Every series name the exposition can hold: sample names and the TYPE lines' families with
    their suffixes (a family may have no sample yet, as the per-model ones before any model)."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "info": ("_info",)}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            names.update(name.removesuffix("_total") + s for s in suffixes.get(kind, ()))
    return names


def test_panels_are_well_formed() -> None:
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)) and DASHBOARD["uid"] == "kvblend"
    for p in PANELS:
        assert p["targets"], f"panel {p['title']!r} has no query"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        assert p["datasource"]["uid"] == "${datasource}"


def test_every_queried_metric_is_exported(client: TestClient) -> None:
    exported = series_names(client.get("/metrics").text)
    queried = {m for e in EXPRS for m in re.findall(r"\b((?:kvblend|process)_[a-z_]+)\b", e)}
    assert len(queried) > 20
    missing = {m for m in queried
               if m not in exported and m.removeprefix(DATAPLANE) not in exported}
    assert not missing, f"the dashboard asks for series /metrics never has: {sorted(missing)}"
    assert any(m.startswith(DATAPLANE) for m in queried)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_parses_every_query(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(EXPRS)]}]}
    path = tmp_path / "rules.json"  # JSON is YAML
    path.write_text(json.dumps(rules))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                          timeout=60)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()
