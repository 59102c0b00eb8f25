"""Swagger UI and ReDoc render the API's operations in a real headless browser that can reach
nothing but the service (as on an air-gapped host): their assets come from the installed package,
not a CDN. Skipped without Debian's ``chromium`` (``.ci/run`` installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import pytest

from tests.harness import Service, Services

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.heavy,
              pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium "
                                 "(apt-get install chromium); .ci/run installs it")]


@pytest.fixture
def service(services: Services) -> Service:
    return services.start()


def rendered(url: str, done: re.Pattern[str]) -> str:
    """The page's DOM after its scripts ran, offline but for the service; a few attempts with
    more virtual time each, until ``done`` matches (the browser's scheduling is not ours)."""
    dom = ""
    for budget in (20_000, 60_000, 120_000):
        out = subprocess.run([str(CHROMIUM), "--headless=new", "--no-sandbox", "--disable-gpu",
                              "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                              f"--virtual-time-budget={budget}", "--dump-dom", url],
                             capture_output=True, text=True, timeout=300)
        dom = out.stdout
        if done.search(dom):
            break
    return dom


def test_swagger_ui_and_redoc_render_every_operation_offline(service: Service) -> None:
    spec = service.http.get("/openapi.json").json()
    ops = {(path, method): op["operationId"] for path, item in spec["paths"].items()
           for method, op in item.items() if method in ("get", "post", "put", "delete", "patch")}
    assert len(ops) >= 10

    swagger = rendered(service.url + "/docs", re.compile(r"opblock-summary-path"))
    shown = re.findall(r'class="opblock-summary-path"[^>]*data-path="([^"]+)"', swagger)
    assert sorted(shown) == sorted(path for path, _ in ops), swagger[-2000:]

    redoc = rendered(service.url + "/redoc", re.compile(r"operation/"))
    assert set(re.findall(r"operation/(\w+)", redoc)) == set(ops.values()), redoc[-2000:]
