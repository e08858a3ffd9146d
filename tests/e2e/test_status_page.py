"""The gateway's /status page in a real browser (Debian's Chromium, driven by Playwright) over
a worker on the real engine: it shows the live figures of /slots and /health (a busy slot's
request id, tokens/s), fetches nothing from anywhere else, and logs no console error. Slots
are grouped under their worker, whose long endpoint is written once; a tenant's key shows
another tenant's busy slot without its details.

The screenshot is kept under the test's tmp_path; its path is printed. Without Chromium
(`apt-get install chromium`) or Playwright the test skips and says which is missing.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.conftest import LONG_CTX
from tests.procs import start_gateway, start_worker

CTX = LONG_CTX
LONG = {"prompt": "once upon a time", "max_tokens": CTX - 64, "ignore_eos": True, "stream": True}


def test_status_page_shows_live_slots(browser, long_model_path: Path, tmp_path: Path) -> None:
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=2, ctx_size=CTX))
        gateway = stack.enter_context(start_gateway(long_model_path, worker.endpoint))
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        requests: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("request", lambda r: requests.append(r.url))

        page.goto(gateway.url + "/status")
        page.wait_for_selector("#health.ok", timeout=15_000)
        page.wait_for_function(
            "document.querySelectorAll('#slots tr.slot').length === 2", timeout=15_000
        )
        assert worker.endpoint in page.inner_text("#workers")

        url = gateway.url + "/v1/completions"
        headers = {"X-Request-Id": "status-probe-7"}
        with httpx.stream("POST", url, json=LONG, headers=headers, timeout=30) as stream:
            lines = stream.iter_lines()  # kept: a collected iterator closes the stream
            assert next(lines).startswith("data: ")
            # The page polls by itself: the busy slot appears without a reload.
            page.wait_for_function(
                "document.querySelector('#slots').innerText.includes('cmpl-status-probe-7')",
                timeout=15_000,
            )
            page.wait_for_function(
                "parseFloat(document.querySelector('#tps').firstChild.textContent) > 0",
                timeout=15_000,
            )
            slots_text = page.inner_text("#slots")
            assert "generating" in slots_text
            assert page.inner_text("#busy").startswith("1 / 2")
            assert "default" in page.inner_text("#tenants")  # the request's tenant
            screenshot = tmp_path / "status.png"
            page.screenshot(path=str(screenshot), full_page=True)
            print(f"status page screenshot: {screenshot}")
        page.wait_for_function(
            "!document.querySelector('#slots').innerText.includes('cmpl-status-probe-7')",
            timeout=15_000,
        )
        page.close()

    assert screenshot.stat().st_size > 0
    assert errors == []
    origin = urlsplit(gateway.url).netloc
    outside = [u for u in requests if urlsplit(u).netloc != origin]
    assert outside == [], f"the page fetched from elsewhere: {outside}"
    assert {urlsplit(u).path for u in requests} == {"/status", "/health", "/slots"}


def test_status_page_asks_for_the_api_key(browser, long_model_path: Path) -> None:
    """With API keys set the page is still served, and /slots answers it once given a key."""
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=2, ctx_size=CTX))
        gateway = stack.enter_context(
            start_gateway(long_model_path, worker.endpoint, api_key="sk-status")
        )
        page = browser.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(gateway.url + "/status")
        page.wait_for_selector("#keyform", state="visible", timeout=15_000)
        assert "needs the API key" in page.inner_text("#problem")
        assert page.locator("#slots tbody tr").count() == 0
        page.fill("#key", "sk-status")
        page.click("#keyform button")
        page.wait_for_function(
            "document.querySelectorAll('#slots tr.slot').length === 2", timeout=15_000
        )
        page.wait_for_function("document.querySelector('#problem').textContent === ''")
        assert page.is_hidden("#keyform")
        page.close()
    # Only the browser's own line for each refused /slots, before the key was given.
    assert errors and all("401" in error for error in errors), errors


def test_slots_are_grouped_under_their_worker(
    browser, long_model_path: Path, tmp_path: Path
) -> None:
    """Each worker's endpoint heads its slots once (it was repeated on every slot row: 1,700
    px for 16 slots); seen with bob's key, alice's busy slot shows only that it is busy."""
    keys = tmp_path / "keys"
    keys.write_text("alice:sk-alice\nbob:sk-bob\n")
    with ExitStack() as stack:
        workers = [
            stack.enter_context(start_worker(long_model_path, slots=2, ctx_size=CTX))
            for _ in range(2)
        ]
        endpoints = [worker.endpoint for worker in workers]
        gateway = stack.enter_context(start_gateway(long_model_path, endpoints, api_key_file=keys))
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(gateway.url + "/status")
        page.fill("#key", "sk-bob")
        page.click("#keyform button")
        page.wait_for_function(
            "document.querySelectorAll('#slots tr.slot').length === 4", timeout=15_000
        )
        groups = page.eval_on_selector_all(
            "#slots tbody",
            "bs => bs.map(b => [b.rows[0].innerText, b.querySelectorAll('tr.slot').length])",
        )
        assert sorted(title.split()[0] for title, _ in groups) == sorted(endpoints)
        assert [count for _, count in groups] == [2, 2]
        slots_text = page.inner_text("#slots")
        for endpoint in endpoints:
            assert slots_text.count(endpoint) == 1
        slot_rows = page.eval_on_selector_all(
            "#slots tr.slot", "rows => rows.map(r => r.innerText)"
        )
        assert not any("ipc://" in row or "tcp://" in row for row in slot_rows)

        url = gateway.url + "/v1/completions"
        headers = {"X-Request-Id": "alice-secret-req", "Authorization": "Bearer sk-alice"}
        with httpx.stream("POST", url, json=LONG, headers=headers, timeout=30) as stream:
            lines = stream.iter_lines()  # kept: a collected iterator closes the stream
            assert next(lines).startswith("data: ")
            page.wait_for_function(
                "document.querySelector('#slots').innerText.includes('generating')",
                timeout=15_000,
            )
            page.wait_for_function(
                "document.querySelector('#tenants').innerText.includes('other tenants')",
                timeout=15_000,
            )
            assert "alice" not in page.inner_text("body")
            screenshot = tmp_path / "status-groups.png"
            page.screenshot(path=str(screenshot), full_page=True)
            print(f"status page screenshot: {screenshot}")
        page.close()
    assert errors == []
