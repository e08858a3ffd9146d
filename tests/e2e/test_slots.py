"""GET /slots on the real engine: a slot busy with a long request shows its id, tenant and
tokens as they grow, the API key guards it, and no prompt text appears anywhere in it. A key
sees only its own tenant's requests (an admin key all), and the worker's metrics name tenants
only as --metrics-tenants says.

The generation is long (ignore_eos over a 16k context, seconds on the tiny model), so it is
still running while the slots are read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import LONG_CTX
from tests.procs import Proc, free_port, scrape_metrics, start_gateway, start_worker

CTX = LONG_CTX
# Words the slots view must never echo: the prompt's text.
PROMPT = "zebra quokka marmalade"
KEY = "sk-slots-test"


def long_request(user: str) -> dict[str, Any]:
    return {
        "prompt": PROMPT,
        "max_tokens": CTX - 64,
        "ignore_eos": True,
        "stream": True,
        "user": user,
        "priority": 3,
    }


@contextmanager
def streaming(gateway: Proc, request_id: str, user: str, key: str | None = None) -> Iterator[None]:
    """A long generation under way (its first tokens read) for the `with` block."""
    headers = {"X-Request-Id": request_id}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = long_request(user)
    url = gateway.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as stream:
        lines = stream.iter_lines()  # kept: a collected iterator closes the stream
        assert next(lines).startswith("data: ")
        yield


def wait_for(get: Callable[[], Any], check: Callable[[Any], bool], timeout: float, what: str):
    """get()'s first value that passes check, within timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if check(value):
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {value}"
        time.sleep(0.05)


def busy_slot(body: dict, request_id: str) -> dict | None:
    for worker in body["workers"]:
        for slot in worker.get("slots", []):
            if slot["request_id"] and request_id in slot["request_id"]:
                return slot
    return None


def test_slots_show_a_busy_slot_and_no_prompt_text(long_model_path: Path) -> None:
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=2, ctx_size=CTX))
        gateway = stack.enter_context(start_gateway(long_model_path, worker.endpoint, api_key=KEY))
        auth = {"Authorization": f"Bearer {KEY}"}

        denied = httpx.get(gateway.url + "/slots", timeout=10)
        assert denied.status_code == 401, denied.text
        assert denied.json()["error"]["code"] == "invalid_api_key"

        def slots() -> httpx.Response:
            response = httpx.get(gateway.url + "/slots", headers=auth, timeout=10)
            assert response.status_code == 200, response.text
            return response

        idle = slots().json()
        (only,) = idle["workers"]
        assert only["status"] == "ok" and only["endpoint"] == worker.endpoint
        assert only["model"] and only["slots_total"] == 2 and only["error"] is None
        assert [s["state"] for s in only["slots"]] == ["idle", "idle"]
        assert all(s["request_id"] is None for s in only["slots"])

        with streaming(gateway, "slots-probe-1", user="tenant-a", key=KEY):
            first = wait_for(
                lambda: slots().json(),
                lambda body: (
                    (busy_slot(body, "slots-probe-1") or {}).get("generated_tokens", 0) > 0
                ),
                10,
                "the busy slot's first tokens",
            )
            slot = busy_slot(first, "slots-probe-1")
            assert slot is not None
            assert slot["state"] == "generating" and slot["is_processing"] is True
            # The key's tenant wins over `user` (the key names none: its own hash-like name).
            assert slot["tenant"] and slot["priority"] == 3
            assert slot["prompt_tokens"] > 0
            assert slot["cached_tokens"] + slot["computed_tokens"] == slot["prompt_tokens"]
            assert slot["age_seconds"] > 0
            others = [s for s in first["workers"][0]["slots"] if s is not slot]
            assert [s["state"] for s in others] == ["idle"]
            tenants = first["workers"][0]["tenants"]
            assert [(t["tenant"], t["running"]) for t in tenants] == [(slot["tenant"], 1)]

            later = wait_for(
                lambda: slots().json(),
                lambda body: (
                    (busy_slot(body, "slots-probe-1") or {}).get("generated_tokens", 0)
                    > slot["generated_tokens"]
                ),
                10,
                "more generated tokens",
            )
            grown = busy_slot(later, "slots-probe-1")
            assert grown is not None and grown["tokens_per_second"] > 0
            assert grown["age_seconds"] >= slot["age_seconds"]
            assert later["workers"][0]["tokens_per_second"] > 0
            raw = slots().text
            for word in PROMPT.split():
                assert word not in raw, f"prompt text {word!r} in /slots"
            print(f"busy slot: {grown}")

        # The client left: its slot is freed and shows idle again.
        wait_for(
            lambda: slots().json(),
            lambda body: busy_slot(body, "slots-probe-1") is None,
            10,
            "the slot freed",
        )


def test_slots_name_a_worker_that_is_down(long_model_path: Path) -> None:
    """A worker that is gone is listed with why, beside the one that answers."""
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=1, ctx_size=CTX))
        doomed = stack.enter_context(start_worker(long_model_path, slots=1, ctx_size=CTX))
        gateway = stack.enter_context(
            start_gateway(long_model_path, [worker.endpoint, doomed.endpoint])
        )
        wait_for(
            lambda: httpx.get(gateway.url + "/health", timeout=10).json(),
            lambda body: body.get("workers_ready") == 2,
            20,
            "both workers ready",
        )
        doomed.kill()
        body = wait_for(
            lambda: httpx.get(gateway.url + "/slots", timeout=10).json(),
            lambda body: any(w["status"] != "ok" for w in body["workers"]),
            20,
            "the dead worker out of rotation",
        )
        by_endpoint = {w["endpoint"]: w for w in body["workers"]}
        assert by_endpoint[worker.endpoint]["status"] == "ok"
        assert len(by_endpoint[worker.endpoint]["slots"]) == 1
        down = by_endpoint[doomed.endpoint]
        assert down["status"] == "unavailable" and down["reason"]
        assert "slots" not in down and down["error"]


def test_a_key_sees_its_own_tenants_slots_and_an_admin_all(
    long_model_path: Path, tmp_path: Path
) -> None:
    """bob's key once listed alice's request id, tenant and counts: now bob sees that a slot
    is busy and how many run and wait, not whose; alice sees hers; an admin key sees all."""
    keys = tmp_path / "keys"
    keys.write_text("alice:sk-alice\nbob:sk-bob\nops:sk-ops role=admin\n")
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=2, ctx_size=CTX))
        gateway = stack.enter_context(
            start_gateway(long_model_path, worker.endpoint, api_key_file=keys)
        )

        def slots(key: str) -> httpx.Response:
            auth = {"Authorization": f"Bearer {key}"}
            response = httpx.get(gateway.url + "/slots", headers=auth, timeout=10)
            assert response.status_code == 200, response.text
            return response

        with streaming(gateway, "alice-secret-req", user="x", key="sk-alice"):
            seen = wait_for(
                lambda: slots("sk-ops").json(),
                lambda body: busy_slot(body, "alice-secret-req") is not None,
                10,
                "alice's slot",
            )
            assert busy_slot(seen, "alice-secret-req")["tenant"] == "alice"  # type: ignore[index]
            assert busy_slot(slots("sk-alice").json(), "alice-secret-req") is not None
            for_bob = slots("sk-bob")
            assert "alice" not in for_bob.text  # neither her tenant nor her request id
            (only,) = for_bob.json()["workers"]
            busy = [s for s in only["slots"] if s["is_processing"]]
            assert len(busy) == 1 and busy[0]["state"] in ("prefilling", "generating")
            assert busy[0]["request_id"] is None and busy[0]["generated_tokens"] is None
            assert only["tenants"] == [{"tenant": None, "running": 1, "waiting": 0}]


def test_the_worker_metrics_name_tenants_only_as_asked(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """The worker's metrics port needs no key: --metrics-tenants hash labels a tenant by a
    hash of its name, off leaves the per-tenant series out."""
    from loomserve.worker.metrics import hashed_tenant

    keys = tmp_path / "keys"
    keys.write_text("alice:sk-alice\n")
    for mode in ("hash", "off"):
        port = free_port()
        with ExitStack() as stack:
            worker = stack.enter_context(
                start_worker(tiny_model_path, metrics_port=port, metrics_tenants=mode)
            )
            gateway = stack.enter_context(
                start_gateway(tiny_model_path, worker.endpoint, api_key_file=keys)
            )
            body = {"prompt": "hi", "max_tokens": 2}
            auth = {"Authorization": "Bearer sk-alice"}
            answer = httpx.post(gateway.url + "/v1/completions", json=body, headers=auth)
            assert answer.status_code == 200, answer.text
            url = f"http://127.0.0.1:{port}/metrics"
            text = httpx.get(url, timeout=10).text
            assert "alice" not in text
            labels = {
                dict(key)["tenant"]
                for name, key in scrape_metrics(url)
                if name == "loomserve:num_requests_running_by_tenant"
            }
            assert labels == ({hashed_tenant("alice")} if mode == "hash" else set()), mode
