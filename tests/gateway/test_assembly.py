"""The gateway's request path without sockets: text assembly, the worker errors' HTTP statuses,
and a request handle's event order."""

from __future__ import annotations

import asyncio
import time

import pytest

from loomserve.gateway.api.errors import worker_error
from loomserve.gateway.api.response_bodies import Usage
from loomserve.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from loomserve.gateway.generate.assembly import Done, PromptScores, TextAssembly, TokenLogprob
from loomserve.gateway.request.generation_request import GenerationRequest, Prompt
from loomserve.gateway.workers.errors import (
    WorkerBadOutput,
    WorkerFailed,
    WorkerLost,
    WorkerRejected,
    WorkerTimeout,
    WorkerUnavailable,
)
from loomserve.gateway.workers.handle import RequestHandle
from loomserve.protocol.messages import (
    ErrorCode,
    Finish,
    FinishReason,
    PromptLogprobs,
    SamplingParams,
    TokenChunk,
    TokenLogprobs,
)

# A vocabulary of byte strings: words, and the two halves of "é" (0xC3 0xA9) on their own.
PIECES = {0: b"", 1: b"Hello", 2: b" world", 3: b" ST", 4: b"OP", 5: b"\xc3", 6: b"\xa9", 7: b"!"}


class FakePieces:
    """What text assembly uses of a vocabulary."""

    n_tokens = len(PIECES)

    def piece(self, token_id: int) -> bytes:
        return PIECES[token_id]


def assembly(stops: tuple[str, ...] = (), prompt_len: int = 5) -> TextAssembly:
    return TextAssembly(FakePieces(), stops, prompt_len)


def finish(reason: FinishReason, completion: int, prompt: int = 5, cached: int = 2) -> Finish:
    return Finish("r", reason, prompt, completion, cached, queue_seconds=0.0)


def test_text_and_the_workers_usage() -> None:
    text = assembly()
    assert text.push([1]) == "Hello"
    assert text.push([2, 7]) == " world!"
    assert text.done(finish(FinishReason.LENGTH, 3)) == (
        "",
        Done("length", Usage.of(prompt_tokens=5, completion_tokens=3, cached_tokens=2)),
    )


def test_prompt_scores_come_once_whole_and_positions_sent_again_count_once() -> None:
    text = TextAssembly(FakePieces(), (), 3, scored_prompt=[0, 1, 2])
    assert text.prompt_scores() is None  # nothing scored yet
    text.push_prompt(PromptLogprobs(1, [TokenLogprobs(-1.0, [2], [-0.5])]))
    assert text.prompt_scores() is None  # token 2 has no logprob yet
    # A worker that evaluated the prompt again sends position 1 again: kept once.
    text.push_prompt(
        PromptLogprobs(1, [TokenLogprobs(-1.0, [2], [-0.5]), TokenLogprobs(-2.0, [], [])])
    )
    assert text.prompt_scores() == PromptScores(
        [
            TokenLogprob(b"", None, None),
            TokenLogprob(b"Hello", -1.0, [(b" world", -0.5)]),
            TokenLogprob(b" world", -2.0, []),
        ]
    )
    assert text.prompt_scores(final=True) is None  # once


def test_score_only_drops_the_generated_token() -> None:
    text = TextAssembly(FakePieces(), ("Hel",), 5, scored_prompt=[1], score_only=True)
    assert text.prompt_scores() == PromptScores([TokenLogprob(b"Hello", None, None)])
    assert text.push([1]) == "" and not text.stopped
    assert text.done(finish(FinishReason.STOP, 1)) == (
        "",
        Done("length", Usage.of(prompt_tokens=5, completion_tokens=0, cached_tokens=2)),
    )


def test_split_characters_wait_for_their_last_byte() -> None:
    text = assembly()
    assert text.push([5]) == ""
    assert text.push([6, 7]) == "é!"
    text.push([5])  # a character the model never finished
    tail, done = text.done(finish(FinishReason.STOP, 4))
    assert (tail, done.finish_reason) == ("\ufffd", "stop")


def test_stop_string_across_tokens_drops_it_and_what_follows() -> None:
    text = assembly(stops=(" STOP",))
    assert text.push([1, 3]) == "Hello"  # " ST" may start the stop string: held back
    assert not text.stopped
    assert text.push([4, 2, 7]) == ""  # " STOP" matched; " world!" is never seen
    assert (text.stopped, text.generated) == (True, 3)
    assert text.push([2]) == ""
    # The worker's Finish never came (cancelled too late): count what the gateway saw.
    assert text.done(None) == ("", Done("stop", Usage.of(5, 3, 0)))


def test_stop_usage_takes_prompt_and_cache_from_the_workers_finish() -> None:
    text = assembly(stops=("world",))
    assert text.push([1, 2, 7]) == "Hello "
    # The worker counted the token after the stop too; the client only got two.
    _, done = text.done(finish(FinishReason.CANCELLED, 3, prompt=9, cached=4))
    assert done == Done("stop", Usage.of(9, 2, 4))


def test_a_false_start_of_a_stop_string_is_released_at_the_end() -> None:
    text = assembly(stops=(" STOP",))
    assert text.push([1, 3]) == "Hello"
    assert text.done(finish(FinishReason.LENGTH, 2)) == (" ST", Done("length", Usage.of(5, 2, 2)))


def test_cancelled_reads_as_stop_and_an_engine_error_raises() -> None:
    _, done = assembly().done(finish(FinishReason.CANCELLED, 0))
    assert done.finish_reason == "stop"
    failed = Finish("r", FinishReason.ERROR, 5, 1, 0, 0.0, message="decode failed")
    with pytest.raises(WorkerFailed, match="decode failed"):
        assembly().done(failed)
    with pytest.raises(ValueError):
        assembly().done(None)  # only a stopped sequence may end without the Finish
    shutdown = Finish("r", FinishReason.CANCELLED, 5, 1, 0, 0.0, message="worker shutting down")
    with pytest.raises(WorkerLost, match="worker shutting down"):
        assembly().done(shutdown)  # cancelled by the worker itself: cut short, not ended


def test_chunks_in_sequence_become_text() -> None:
    text = assembly()
    assert text.take(TokenChunk("r", [1], seq=0)) == "Hello"
    assert text.take(TokenChunk("r", [2, 7], seq=1)) == " world!"
    assert text.done(finish(FinishReason.LENGTH, 3))[1].finish_reason == "length"


@pytest.mark.parametrize(
    ("chunks", "error"),
    [
        ([([1], 0), ([1], 0)], "repeated"),  # the same chunk twice: "HelloHello"
        ([([1], 0), ([2], 2)], "skipped"),  # a gap
        ([([2], 1), ([1], 0)], "skipped"),  # out of order: the later one first
        ([([1], 0), ([len(PIECES)], 1)], "outside the vocabulary"),
        ([([-1], 0)], "outside the vocabulary"),
    ],
)
def test_bad_worker_output_fails_the_request_before_it_becomes_text(
    chunks: list[tuple[list[int], int]], error: str
) -> None:
    text = assembly()
    with pytest.raises(WorkerBadOutput, match=error):
        for tokens, seq in chunks:
            assert text.take(TokenChunk("r", tokens, seq=seq)) in ("Hello", "")


def test_a_finish_that_counts_fewer_tokens_than_were_sent_fails() -> None:
    text = assembly()
    text.take(TokenChunk("r", [1, 2], seq=0))
    with pytest.raises(WorkerBadOutput, match="finished the request after 1"):
        text.done(finish(FinishReason.LENGTH, 1))
    eos_not_sent = assembly()
    eos_not_sent.take(TokenChunk("r", [1], seq=0))
    assert eos_not_sent.done(finish(FinishReason.STOP, 2))[1].finish_reason == "stop"


def test_usage_shape() -> None:
    assert Usage.of(7, 3, 2).model_dump() == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (WorkerUnavailable("not connected"), 503, "worker_unavailable"),
        (WorkerLost("connection closed"), 503, "worker_unavailable"),
        (WorkerRejected(ErrorCode.QUEUE_FULL, "64 waiting"), 503, "queue_full"),
        (WorkerRejected(ErrorCode.NOT_READY, "warming up"), 503, "worker_unavailable"),
        (WorkerRejected(ErrorCode.PROMPT_TOO_LONG, "too long"), 400, "context_length_exceeded"),
        (WorkerRejected(ErrorCode.INVALID_REQUEST, "bad"), 400, "invalid_request"),
        (WorkerRejected(ErrorCode.DUPLICATE_REQUEST, "twice"), 500, "internal_error"),
        (WorkerFailed("decode failed"), 500, "internal_error"),
        (
            WorkerFailed("the grammar is too slow", ErrorCode.INVALID_REQUEST),
            400,
            "invalid_request",
        ),
        (WorkerTimeout("too slow"), 504, "timeout"),
        (WorkerBadOutput("a token twice"), 502, "bad_worker_output"),
    ],
)
def test_worker_errors_become_http_statuses(error: Exception, status: int, code: str) -> None:
    api_error = worker_error(error)
    assert (api_error.status, api_error.code) == (status, code)
    assert api_error.body()["error"]["message"].endswith(error.message)
    if status in (503, 504):
        assert api_error.headers == {"Retry-After": "1"}
    if status == 504:  # not the client's request that was wrong
        assert api_error.type == "timeout_error"


def test_a_handle_hands_out_tokens_before_the_loss_that_followed_them() -> None:
    async def scenario() -> None:
        handle = RequestHandle(
            "r", time.monotonic() + 5, asyncio.get_running_loop().create_future()
        )
        handle.events.put_nowait(TokenChunk("r", [1]))
        handle.events.put_nowait(TokenChunk("r", [2]))
        handle.events.put_nowait(WorkerLost("gone"))
        assert await handle.next_events() == [TokenChunk("r", [1]), TokenChunk("r", [2])]
        with pytest.raises(WorkerLost):
            await handle.next_events()

    asyncio.run(scenario())


def test_a_handle_times_out_at_its_deadline() -> None:
    async def scenario() -> None:
        handle = RequestHandle(
            "r", time.monotonic() + 0.05, asyncio.get_running_loop().create_future()
        )
        with pytest.raises(WorkerTimeout):
            await handle.next_event()

    asyncio.run(scenario())


def test_the_request_knows_its_api_by_the_body_type() -> None:
    params = SamplingParams(max_tokens=4)
    chat_body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chat = GenerationRequest("chatcmpl-1", chat_body, [Prompt([1, 2], params)], 1, (), "m", 0.0, 0)
    plain_body = CompletionRequest(prompt="hi")
    plain = GenerationRequest("cmpl-1", plain_body, [Prompt([1], params)], 1, (), "m", 0.0, 0)
    assert (chat.chat, chat.stream, chat.include_usage) == (True, True, True)
    assert (plain.chat, plain.stream, plain.include_usage) == (False, False, False)
    generate = chat.to_worker()
    assert (generate.request_id, generate.prompt_tokens, generate.params) == (
        "chatcmpl-1",
        [1, 2],
        params,
    )


def test_choices_are_numbered_prompt_major_and_seeds_differ_per_sample() -> None:
    seeded = SamplingParams(max_tokens=4, seed=7)
    prompts = [Prompt([1], seeded), Prompt([2, 3], SamplingParams(max_tokens=2))]
    body = CompletionRequest(prompt=["a", "b"], n=3)
    request = GenerationRequest("cmpl-x", body, prompts, 3, (), "m", 0.0, 0)
    assert request.n_choices == 6
    generates = [request.to_worker(i) for i in range(6)]
    assert [g.request_id for g in generates] == [f"cmpl-x-{i}" for i in range(6)]
    assert [g.prompt_tokens for g in generates] == [[1]] * 3 + [[2, 3]] * 3
    assert [g.params.seed for g in generates] == [7, 8, 9, None, None, None]
    assert prompts[0].params.seed == 7  # the request's own params are left as they were
