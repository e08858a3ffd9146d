"""The one split of a chat reply's thinking from its answer (text/reasoning.py's ReplySplit,
run by generate/assembly.py): the stream's chunks and the whole response read its parts,
and usage's reasoning_tokens counts the tokens that fell in the think block, exactly.

Each reply is fed as tokens of a test vocabulary: one token for all of it, one character
per token (every marker cut across tokens), and cuts every few characters; each way gives
the same reasoning, answer and count.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from loomserve.gateway.api.schemas import ChatCompletionRequest
from loomserve.gateway.generate.assembly import TextAssembly
from loomserve.gateway.generate.group import GenerationGroup
from loomserve.gateway.generate.render import StreamChunks, response_body
from loomserve.gateway.generate.streaming import collect, event_stream
from loomserve.gateway.request.generation_request import ReplyReasoning
from loomserve.gateway.text.reasoning import ReasoningSplitter, ReplySplit, family_named
from loomserve.gateway.text.stop import StopMatch, StopMatcher
from loomserve.protocol.messages import Finish, FinishReason, Generate, TokenChunk
from tests.gateway.scripted import Script, ScriptedPool, request
from tests.gateway.test_reasoning import CASES


@dataclass(slots=True)
class TextVocab:
    """A vocabulary made of the given pieces of text, one token each (id = position)."""

    texts: list[str] = field(default_factory=list)

    def add(self, text: str) -> int:
        self.texts.append(text)
        return len(self.texts) - 1

    @property
    def n_tokens(self) -> int:
        return len(self.texts)

    def piece(self, token_id: int) -> bytes:
        return self.texts[token_id].encode()


def cuts(text: str, step: int) -> list[str]:
    """text in pieces of `step` characters (all of it in one when step is 0)."""
    if step == 0:
        return [text]
    return [text[i : i + step] for i in range(0, len(text), step)]


def think_tokens(name: str, inside: bool, pieces: list[str], reasoning: str) -> int:
    """The oracle: the pieces up to the one that completes the end marker (every piece when
    the block never closes), if the reply had a think block at all."""
    family = family_named(name)
    text = "".join(pieces)
    start = text.lstrip()
    if not (inside or start.startswith(family.start)):
        return 0
    skip = len(text) - len(start) + (len(family.start) if start.startswith(family.start) else 0)
    end = text.find(family.end, skip)
    if end < 0:
        return len(pieces)
    done, count = end + len(family.end), 0
    for piece in pieces:
        if done <= 0:
            break
        count, done = count + 1, done - len(piece)
    return count


def assemble(
    name: str, inside: bool, pieces: list[str], stops: tuple[str, ...] = ()
) -> tuple[str, str, int]:
    """The pieces as tokens through TextAssembly with a ReplySplit: (reasoning, answer,
    reasoning_tokens)."""
    vocab = TextVocab()
    ids = [vocab.add(piece) for piece in pieces]
    split = ReplySplit(ReasoningSplitter(family_named(name), inside))
    assembly = TextAssembly(vocab, stops, prompt_len=3, split=split)
    answer = reasoning = ""
    for seq, token in enumerate(ids):
        answer += assembly.take(TokenChunk("r", [token], seq=seq))
        reasoning += assembly.take_reasoning()
        if assembly.stopped:
            break
    finish = (
        None
        if assembly.stopped
        else Finish("r", FinishReason.LENGTH, 3, len(ids), 0, queue_seconds=0.0)
    )
    tail, done = assembly.done(finish)
    details = done.usage.completion_tokens_details
    assert details is not None
    return reasoning + assembly.take_reasoning(), answer + tail, details.reasoning_tokens


@pytest.mark.parametrize(("name", "inside", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("step", [0, 1, 2, 3, 5])
def test_whole_and_cut_replies_split_and_count_the_same(
    name: str, inside: bool, text: str, reasoning: str, content: str, step: int
) -> None:
    pieces = cuts(text, step)
    got = assemble(name, inside, pieces)
    assert got[:2] == (reasoning, content)
    assert got[2] == think_tokens(name, inside, pieces, reasoning), pieces


def test_reasoning_tokens_count_the_block_markers_and_all() -> None:
    pieces = ["<th", "ink>", "\nabc", " def", "\n</", "think", ">\n\n", "Ans", "wer"]
    assert assemble("deepseek_r1", False, pieces) == ("abc def", "Answer", 7)
    # Opened by the prompt: the first token is already thinking.
    assert assemble("deepseek_r1", True, ["abc", " </think>", "x"]) == ("abc", "x", 2)
    # No block: no reasoning tokens, however many tokens looked like one's start.
    assert assemble("deepseek_r1", False, ["<th", "in", "g>"]) == ("", "<thing>", 0)


def test_stop_strings_read_the_raw_text_and_the_split_what_they_let_through() -> None:
    reasoning, answer, count = assemble(
        "deepseek_r1", False, ["<think>", "plan", "</think>", "Yes", " STOP", " no"], ("STOP",)
    )
    assert (reasoning, answer, count) == ("plan", "Yes ", 3)
    # A stop string inside the block ends the reply there: its thinking is all there is.
    assert assemble("mistral", False, ["[THINK]", "x ST", "OP y"], ("STOP",)) == (
        "x",
        "",
        3,
    )


class _Ends:
    """A matcher that ends the reply once it reads CALL (a test double for ToolCallEnd)."""

    def __init__(self) -> None:
        self.read = ""

    def push(self, text: str) -> StopMatch:
        self.read += text
        return StopMatch(text, "CALL" in self.read)

    def flush(self) -> str:
        return ""


def test_the_answers_end_reads_the_answer_only() -> None:
    ends = _Ends()
    split = ReplySplit(ReasoningSplitter(family_named("deepseek_r1")), ends)
    vocab = TextVocab()
    ids = [vocab.add(p) for p in ["<think>I could CALL", " it</think>", "So: CA", "LL now"]]
    assembly = TextAssembly(vocab, StopMatcher(()), prompt_len=3, split=split)
    assert assembly.push(ids[:2]) == "" and not assembly.stopped
    assert assembly.take_reasoning() == "I could CALL it"
    assert assembly.push(ids[2:3]) == "So: CA" and not assembly.stopped
    assert ends.read == "So: CA"
    assert assembly.push(ids[3:]) == "LL now" and assembly.stopped


# --- through the request path: a scripted worker, the stream and the whole body -----------

OUTPUT = ["<th", "ink", ">\n", "abc", " d", "ef\n</", "thi", "nk>", "\n\n", "Ans", "wer"]
CHAT = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
STREAM = ChatCompletionRequest(
    messages=[{"role": "user", "content": "Hi"}],
    stream=True,
    stream_options={"include_usage": True},
)


def _run(body: ChatCompletionRequest, pieces: list[str], n: int = 1) -> Any:
    """The response's JSON (a dict) or its stream's events (a list of str), the worker
    scripted to send each piece as a token of its own."""
    vocab = TextVocab()
    ids = [vocab.add(piece) for piece in pieces]

    def answer(generate: Generate) -> Script:
        rid = generate.request_id
        script: Script = [TokenChunk(rid, [t], seq=i) for i, t in enumerate(ids)]
        return [*script, Finish(rid, FinishReason.STOP, 3, len(ids), 0, queue_seconds=0.0)]

    pool = ScriptedPool(answer)
    generation = request(body, n=n)
    generation.reasoning = ReplyReasoning(family_named("deepseek_r1"), False)

    async def scenario() -> Any:
        group = await GenerationGroup.start(pool, vocab, generation, None)
        if body.stream:
            return [e async for e in event_stream(group, StreamChunks(generation))]
        texts, dones, logprobs, thoughts = await collect(group)
        usage = group.usage()
        return response_body(generation, texts, dones, logprobs, usage, thoughts).model_dump()

    return asyncio.run(scenario())


def _bodies(events: list[str]) -> list[dict]:
    """The JSON bodies of a stream's events (an event string may hold several)."""
    parts = "".join(events).split("data: ")
    return [json.loads(p) for p in parts if p.strip() and p.strip() != "[DONE]"]


def test_the_stream_and_the_whole_body_read_one_split() -> None:
    whole = _run(CHAT, OUTPUT, n=2)
    for choice in whole["choices"]:
        message = choice["message"]
        assert (message["reasoning_content"], message["content"]) == ("abc def", "Answer")
    # Both choices' think blocks: 8 tokens each, up to the one that ends `</think>`.
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 16}
    events = _run(STREAM, OUTPUT)
    bodies = _bodies(events)
    deltas = [b["choices"][0]["delta"] for b in bodies if b["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "abc def"
    assert "".join(d.get("reasoning", "") for d in deltas) == "abc def"
    assert "".join(d.get("content") or "" for d in deltas) == "Answer"
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any("reasoning" in d for d in deltas[first_content:])
    assert bodies[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}


def test_a_reply_cut_inside_its_block_is_all_thinking_streamed_or_not() -> None:
    cut = ["<think>", "partial", " </thi"]
    message = _run(CHAT, cut)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("partial </thi", "")
    events = _run(STREAM, cut)
    bodies = _bodies(events)
    deltas = [b["choices"][0]["delta"] for b in bodies if b["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "partial </thi"
    assert bodies[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
