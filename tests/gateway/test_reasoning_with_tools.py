"""Reasoning and tool calls together, through the request path (a scripted worker, the one
split of generate/assembly.py, the stream's chunks and the whole body): for each family that
thinks and calls, fixtures of its real output (thinking and an answer, thinking and one call,
two parallel calls, a call with nested JSON and text outside ASCII, a reply cut inside the
think block and one cut inside a call) give the same reasoning, content and calls whole and
streamed one character per token, and a call written inside the think block is no call."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from loomserve.gateway.api.schemas import ChatCompletionRequest
from loomserve.gateway.generate.group import GenerationGroup
from loomserve.gateway.generate.render import StreamChunks, response_body
from loomserve.gateway.generate.streaming import collect, event_stream
from loomserve.gateway.request.generation_request import ReplyReasoning
from loomserve.gateway.text.reasoning import family_named
from loomserve.gateway.tools.checks import ToolRequest
from loomserve.gateway.tools.format import FAMILIES
from loomserve.protocol.messages import Finish, FinishReason, Generate, TokenChunk
from tests.gateway.scripted import Script, ScriptedPool, request
from tests.gateway.test_reply_split import TextVocab, cuts
from tests.gateway.test_tool_families import NESTED_ARGS, WEATHER

DEFINITIONS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
PARIS: tuple[str, Any] = ("get_weather", {"city": "Paris"})
TIME: tuple[str, Any] = ("get_time", {})

# (reasoning family, starts inside, tool family)
SERVED = {
    "qwen3": ("deepseek_r1", False, "hermes"),
    "qwen3.5": ("deepseek_r1", True, "qwen3_coder"),
    "glm": ("deepseek_r1", False, "glm"),
    "kimi_k2_thinking": ("deepseek_r1", False, "kimi_k2"),
    "minimax_m2": ("deepseek_r1", True, "minimax_m2"),
    "deepseek_v3_1": ("deepseek_r1", True, "deepseek_v3_1"),
    "gpt_oss": ("gpt_oss", False, "harmony"),
    "magistral": ("mistral", False, "mistral_args"),
}


def _think(served: str, thought: str) -> str:
    """The think block as the served family writes it (the start left out where the prompt
    opened it)."""
    name, inside, _ = SERVED[served]
    family = family_named(name)
    if name == "gpt_oss":
        return f"{family.start}{thought}{family.end}<|start|>assistant"
    return ("" if inside else family.start) + thought + family.end


def _calls(served: str, calls: list[tuple[str, Any]]) -> str:
    return FAMILIES[SERVED[served][2]].write_calls(calls)


# (served, reply, reasoning, content, calls, finish reason, cut by max_tokens)
CASES: list[tuple[str, str, str, str, list[tuple[str, Any]], str, bool]] = []
for served in SERVED:
    parallel = FAMILIES[SERVED[served][2]].parallel
    two = [PARIS, TIME] if parallel else [PARIS]
    answer = "<|channel|>final<|message|>Sunny." if served == "gpt_oss" else "Sunny."
    nested = [("get_weather", NESTED_ARGS)]
    CASES += [
        (served, _think(served, "Easy.") + answer, "Easy.", "Sunny.", [], "stop", False),
        (served, _think(served, "Look.") + _calls(served, [PARIS]), "Look.", "", [PARIS],
         "tool_calls", False),
        (served, _think(served, "Both.") + _calls(served, two), "Both.", "", two, "tool_calls",
         False),
        (served, _think(served, "Zürich?") + _calls(served, nested), "Zürich?", "", nested,
         "tool_calls", False),
    ]  # fmt: skip
    # Cut by max_tokens inside the think block: all of it is thinking, no content.
    cut_thought = _think(served, "Still thinking about it")
    cut_thought = cut_thought[: cut_thought.index("about") + 2]
    CASES.append((served, cut_thought, "Still thinking ab", "", [], "length", True))


Reply = tuple[str, str, list[tuple[str, str]], str]


def _run(served: str, pieces: list[str], stream: bool, cut: bool) -> Reply:
    """(reasoning, content, calls with their arguments' text, finish reason) of the reply,
    fed a piece per token."""
    reasoning_name, inside, tools = SERVED[served]
    vocab = TextVocab()
    ids = [vocab.add(piece) for piece in pieces]
    reason = FinishReason.LENGTH if cut else FinishReason.STOP

    def answer(generate: Generate) -> Script:
        rid = generate.request_id
        script: Script = [TokenChunk(rid, [t], seq=i) for i, t in enumerate(ids)]
        return [*script, Finish(rid, reason, 3, len(ids), 0, queue_seconds=0.0)]

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], stream=stream)
    generation = request(body)
    generation.reasoning = ReplyReasoning(family_named(reasoning_name), inside)
    generation.tools = ToolRequest(FAMILIES[tools], DEFINITIONS, "auto", True, None)

    async def scenario() -> Any:
        group = await GenerationGroup.start(ScriptedPool(answer), vocab, generation, None)
        if stream:
            return [e async for e in event_stream(group, StreamChunks(generation))]
        texts, dones, logprobs, thoughts = await collect(group)
        usage = group.usage()
        return response_body(generation, texts, dones, logprobs, usage, thoughts).model_dump()

    result = asyncio.run(scenario())
    if not stream:
        choice = result["choices"][0]
        message = choice["message"]
        calls = [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []
        ]
        thought = message.get("reasoning_content") or ""
        return thought, message["content"] or "", calls, choice["finish_reason"]
    parts = "".join(result).split("data: ")
    bodies = [json.loads(p) for p in parts if p.strip() and p.strip() != "[DONE]"]
    choices = [b["choices"][0] for b in bodies if b.get("choices")]
    deltas = [c["delta"] for c in choices]
    thought = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    arguments: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for delta in deltas:
        for call in delta.get("tool_calls") or []:
            if call["function"].get("name"):
                names[call["index"]] = call["function"]["name"]
            arguments.setdefault(call["index"], []).append(call["function"].get("arguments", ""))
    calls = [(names[i], "".join(arguments[i])) for i in sorted(names)]
    return thought, content, calls, choices[-1]["finish_reason"]


@pytest.mark.parametrize(
    ("served", "reply", "reasoning", "content", "calls", "reason", "cut"), CASES
)
def test_whole_and_streamed_a_character_per_token_agree(
    served: str,
    reply: str,
    reasoning: str,
    content: str,
    calls: list[tuple[str, Any]],
    reason: str,
    cut: bool,
) -> None:
    whole = _run(served, [reply], stream=False, cut=cut)
    thought, answer, got, finish = whole
    assert (thought, answer, finish) == (reasoning, content, reason)
    assert [(name, json.loads(arguments)) for name, arguments in got] == calls
    assert _run(served, cuts(reply, 1), stream=False, cut=cut) == whole
    assert _run(served, cuts(reply, 1), stream=True, cut=cut) == whole


@pytest.mark.parametrize("served", sorted(SERVED))
def test_a_reply_cut_inside_a_call_reads_the_same_whole_and_streamed(served: str) -> None:
    """Cut by max_tokens inside its call's arguments: the thinking, and the call by its name
    (with what each family sends of cut arguments), the same every way."""
    call = _calls(served, [("get_weather", {"city": "Paris", "days": 3})])
    reply = _think(served, "Look.") + call[: call.index("Paris") + 3]
    whole = _run(served, [reply], stream=False, cut=True)
    assert whole[0] == "Look." and [name for name, _ in whole[2]] == ["get_weather"]
    assert _run(served, cuts(reply, 1), stream=False, cut=True) == whole
    assert _run(served, cuts(reply, 1), stream=True, cut=True) == whole


@pytest.mark.parametrize("served", ["qwen3", "glm", "kimi_k2_thinking"])
def test_a_call_written_inside_the_think_block_is_no_call(served: str) -> None:
    thought = "I could write " + _calls(served, [PARIS]) + " but no."
    reply = _think(served, thought) + "It is sunny."
    for stream in (False, True):
        got = _run(served, cuts(reply, 1), stream=stream, cut=False)
        assert got == (thought, "It is sunny.", [], "stop")
