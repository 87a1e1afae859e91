"""/ui in a real browser: Debian's chromium, headless, driven by Playwright (which never
downloads a browser of its own). A live multi-agent session through the gateway and the
embedded engine: the page lists it, and its page shows the right number of agents,
rounds and requests, with the step graph drawn and a waterfall row per request. A
screenshot is kept as a test artifact (KVRELAY_TEST_ARTIFACTS, else the test's tmp dir)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.gateway.town import MODEL, TOWN_TIMEOUTS, NUM_REQUESTS, SESSION, run_town_session, town_engine

ADMIN = "admin-" + "s3cret" * 4
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Read at import: the gateway fixtures clear KVRELAY_*. CI (.ci/run) requires the browser,
# so a missing chromium or Playwright fails there instead of skipping.
ARTIFACTS = os.environ.get("KVRELAY_TEST_ARTIFACTS")
REQUIRED = os.environ.get("KVRELAY_REQUIRE_BROWSER") == "1"
try:
    from playwright import sync_api as playwright_api
except ImportError:
    playwright_api = None


@pytest.fixture
def chromium() -> str:
    missing = ("no chromium binary (apt install chromium)" if CHROMIUM is None else
               "playwright is not installed (the dev extra)" if playwright_api is None else None)
    if missing is not None:
        (pytest.fail if REQUIRED else pytest.skip)(missing)
    return CHROMIUM


@pytest.fixture(scope="module")
def srv(smollm2_dir, run_server):
    with run_server(town_engine(smollm2_dir), MODEL) as server:
        yield server


def _artifacts(tmp_path: Path) -> Path:
    folder = Path(ARTIFACTS or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_page_shows_a_live_session_s_agents_rounds_and_requests(srv, start_gateway, tmp_path, chromium):
    gw = start_gateway([srv.base_url], admin_key=ADMIN, timeouts=TOWN_TIMEOUTS)
    run_town_session(gw.v1)
    gw.rows(NUM_REQUESTS)
    shot = _artifacts(tmp_path) / "ui-session.png"
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-default-apps", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 1200})
            # Script errors, console errors (a CSP violation is one; a 401 before login is not)
            # and any page asset that failed to load.
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error"
                    and not msg.text.startswith("Failed to load resource") else None)
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400
                    and "/ui/static/" in r.url else None)
            page.goto(f"{gw.url}/ui")
            assert page.locator("input[name=key]").count() == 1  # the admin key first
            page.fill("input[name=key]", ADMIN)
            page.click("button")
            page.wait_for_url(f"{gw.url}/ui")
            assert page.locator("tr.session", has_text=SESSION).count() == 1
            page.click(f"text={SESSION}")
            page.wait_for_selector("#requests")
            page.wait_for_function("window.kvrelayGraph && window.kvrelayGraph.nodes().length > 0")
            assert page.evaluate("window.kvrelayGraph.nodes().length") == 3
            assert page.locator("tr.request").count() == NUM_REQUESTS
            assert page.locator("svg.waterfall g.request").count() == NUM_REQUESTS
            assert page.locator("tr.round").count() == 1  # the two villagers who read all outputs at once
            assert page.locator("svg.waterfall g.group[data-kind=round] g.request").count() == 2
            assert "6 requests" in page.inner_text("#totals") and "3 agents" in page.inner_text("#totals")
            # The round's members placed their shared KV in one collective copy: its colour is drawn.
            assert "collective" in page.inner_text("p.legend")
            assert page.locator("svg.waterfall rect title", has_text="KV assembly, collective").count() == 2
            page.screenshot(path=str(shot), full_page=True)
            assert errors == [], errors
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
