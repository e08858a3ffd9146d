"""The OpenAPI schema fuzzed with schemathesis against a live gateway and worker.

Every operation gets generated bodies, valid and not: no answer may be an undocumented
status, a body its schema rejects, or a 5xx, and afterwards the worker must still serve.
Bounded: a few dozen examples per operation and mode (LOOMSERVE_FUZZ_EXAMPLES raises it for a
longer run). tests/e2e/test_schema_accepts.py checks the bodies fuzzing found refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    response_schema_conformance,
    status_code_conformance,
)

from tests.procs import Proc, start_gateway, start_worker

EXAMPLES = int(os.environ.get("LOOMSERVE_FUZZ_EXAMPLES", "12"))


@pytest.fixture(scope="module")
def fuzzed(tiny_model_path: Path) -> Iterator[tuple[Proc, Proc]]:
    with (
        start_worker(tiny_model_path, slots=4, ctx_size=256) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        yield worker, gateway


@pytest.fixture
def api_schema(fuzzed: tuple[Proc, Proc]) -> schemathesis.BaseSchema:
    loaded = schemathesis.openapi.from_url(fuzzed[1].url + "/openapi.json")
    # Bodies that break the schema too: each must be a documented 4xx, never a 5xx.
    loaded.config.generation.update(modes=list(schemathesis.GenerationMode))
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_undocumented_status_and_no_server_error(case: schemathesis.Case) -> None:
    # Answers match their documented schema too: a streamed one's events the event schema.
    checks = [not_a_server_error, status_code_conformance, response_schema_conformance]
    case.call_and_validate(checks=checks, timeout=30)


def test_the_worker_still_serves_after_the_fuzzing(fuzzed: tuple[Proc, Proc]) -> None:
    worker, gateway = fuzzed
    answered = [
        json.loads(line)
        for line in gateway.logs().splitlines()
        if line.startswith("{") and '"http request"' in line
    ]
    statuses = {(entry["path"], entry["status"]) for entry in answered}
    print(f"{len(answered)} fuzzed requests: {sorted(statuses)}")
    # Valid and invalid bodies both reached the generation routes.
    assert {("/v1/completions", 200), ("/v1/completions", 400)} <= statuses
    assert worker.alive() and gateway.alive()
    health = httpx.get(gateway.url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["slots_idle"] == 4
    answer = httpx.post(
        gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30
    )
    assert answer.status_code == 200
