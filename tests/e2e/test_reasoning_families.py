"""Each reasoning family end to end: the tiny model served with a real template of the
family (llama.cpp's models/templates), its reply forced by a grammar to the family's output
(thinking, then the answer), split into reasoning_content and content, whole and streamed.
(Command R7B's template alone is longer than the tiny model's context: its family is tested
on text, in tests/gateway/test_reasoning.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import Proc, start_gateway, start_worker

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "templates"
THOUGHT, ANSWER = "Think here: a < b.", "Hi there."
# template, the request's chat_template_kwargs, the forced reply
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt_oss": (
        "openai-gpt-oss-120b.jinja",
        {"reasoning_effort": "low"},
        f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{ANSWER}",
    ),
    "mistral": (
        "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
        {},
        f"[THINK]{THOUGHT}[/THINK]{ANSWER}",
    ),
    "seed_oss": ("ByteDance-Seed-OSS.jinja", {}, f"<seed:think>{THOUGHT}</seed:think>{ANSWER}"),
    # These two open the block in the prompt: the reply starts inside it.
    "minimax_m2": ("MiniMax-M2.jinja", {}, f"{THOUGHT}\n</think>\n\n{ANSWER}"),
    "deepseek_v3_1": (
        "deepseek-ai-DeepSeek-V3.1.jinja",
        {"thinking": True},
        f"{THOUGHT}</think>{ANSWER}",
    ),
}


@pytest.fixture(scope="module")
def gateways(tiny_model_path: Path) -> Iterator[dict[str, Proc]]:
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(tiny_model_path, slots=2, ctx_size=2048))
        yield {
            name: stack.enter_context(
                start_gateway(tiny_model_path, worker.endpoint, chat_template=TEMPLATES / template)
            )
            for name, (template, _, _) in FAMILIES.items()
        }


def body(name: str, **fields: Any) -> dict[str, Any]:
    _, kwargs, output = FAMILIES[name]
    return {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 256,
        "temperature": 0,
        "grammar": f"root ::= {json.dumps(output)}",
        "chat_template_kwargs": kwargs,
        **fields,
    }


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_family_splits_whole_and_streamed(gateways: dict[str, Proc], name: str) -> None:
    url = gateways[name].url + "/v1/chat/completions"
    reply = httpx.post(url, json=body(name), timeout=30)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    reasoning = content = ""
    with httpx.stream("POST", url, json=body(name, stream=True), timeout=30) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)
