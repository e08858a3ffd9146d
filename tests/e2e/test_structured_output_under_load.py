"""Structured output on the default model with the machine loaded (issue 56).

The audit ran docs/agents.md's Agents SDK recipe, verbatim, on Gemma 3 270M at load 24-43:
3 of 3 failed with `400 the grammar is too slow`, a wall-clock budget the busy machine broke.
Grammars are bounded by work now (llguidance's limits), never by time: here the recipe and
the openai SDK's `chat.completions.parse` with a nested model run on the default model
while six CPU-bound processes share the cores, and both succeed.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from loomserve.cli.default_model import default_model_path
from tests.e2e.test_responses_api import AGENTS_DOC, recipe
from tests.procs import Proc, start_gateway, start_worker

pytestmark = pytest.mark.default_model

MODEL = "gemma-3-270m-q4_k_m"  # the recipe's name for it
BUSY_PROCESSES = 6
BUSY_SECONDS = 600  # each burner ends by itself, whatever happens to the test


@pytest.fixture(scope="module")
def gemma() -> Iterator[Proc]:
    path = default_model_path()
    with (
        start_worker(path, slots=2, ctx_size=2048) as worker,
        start_gateway(path, worker.endpoint, served_model_name=MODEL) as gateway,
    ):
        yield gateway


@pytest.fixture
def loaded_machine() -> Iterator[None]:
    """Six processes that spin until they are stopped (or BUSY_SECONDS pass)."""
    spin = (
        f"import time\nend = time.monotonic() + {BUSY_SECONDS}\nwhile time.monotonic() < end: pass"
    )
    burners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(BUSY_PROCESSES)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()


def test_the_agents_recipe_runs_on_the_default_model_on_a_busy_machine(
    gemma: Proc, loaded_machine: None
) -> None:
    code = recipe().replace("http://127.0.0.1:8000/v1", gemma.url + "/v1")
    scope: dict[str, Any] = {}
    exec(compile(code, str(AGENTS_DOC), "exec"), scope)  # our own docs
    result = scope["result"]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"], kinds
    assert result.final_output.startswith("sunny in ")


class Address(BaseModel):
    city: str
    zip_code: int


class Person(BaseModel):
    name: str
    age: int
    address: Address


def test_the_openai_sdks_parse_with_a_nested_model_on_a_busy_machine(
    gemma: Proc, loaded_machine: None
) -> None:
    client = openai.OpenAI(base_url=gemma.url + "/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Ada, 36, lives in London, 12345."}],
        response_format=Person,
        max_tokens=200,
        temperature=0,
        timeout=600,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    person = choice.message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)
