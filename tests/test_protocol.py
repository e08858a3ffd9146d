"""Every wire message round-trips, and bad bytes end as DecodeError, never a crash."""

import math

import msgpack
import pytest

from loomserve.protocol import (
    Accepted,
    Cancel,
    DecodeError,
    Embed,
    Embeddings,
    Finish,
    Generate,
    Heartbeat,
    Hello,
    ModelInfo,
    Outputs,
    Ping,
    Rejected,
    SamplingParams,
    TokenChunk,
    TokenLogprobs,
    WorkerError,
    decode,
    encode,
)

EVERY_MESSAGE = [
    Hello(gateway_id="gw-1"),
    Generate(
        request_id="r1",
        prompt_tokens=[1, 2, 3],
        params=SamplingParams(
            max_tokens=5,
            temperature=0.0,
            seed=7,
            logit_bias={5: -math.inf, 9: 2.5},
            grammar='root ::= "a"',
            ignore_eos=True,
            logprobs=3,
        ),
    ),
    Embed(request_id="e1", inputs=[[1, 2], [3]]),
    Cancel(request_id="r1"),
    Ping(sent_at=12.5),
    ModelInfo(
        protocol_version=1,
        model_name="tiny",
        vocab_size=300,
        context_train=256,
        slot_context=256,
        slots=4,
        vocab_fingerprint="ab" * 32,
        ready=True,
    ),
    Accepted(request_id="r1", queue_depth=3),
    Rejected(request_id="r1", code="queue_full", message="the queue is full"),
    Outputs(
        tokens=[
            TokenChunk(request_id="r1", token_ids=[4, 5]),
            TokenChunk(
                request_id="r3",
                token_ids=[6],
                logprobs=[TokenLogprobs(-0.5, top_ids=[6, 2], top_logprobs=[-0.5, -1.25])],
            ),
        ],
        finishes=[Finish("r2", "length", 3, 5, 1, 0.25)],
    ),
    Heartbeat(sent_at=1.0, ping_sent_at=0.5, ready=True, queue_depth=0, free_slots=4, running=0),
    WorkerError(code="decode_failed", message="boom"),
    Embeddings(request_id="e1", size=2, vectors=b"\x00\x00\x80?" * 4, prompt_tokens=3),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips(message):
    frames = encode(message)
    assert len(frames[0]) == 1
    assert decode(frames) == message


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x02"],  # no body
        [b"\x7f", msgpack.packb([])],  # unknown type
        [b"\x03", b"\xc1"],  # msgpack's never-used byte
        [b"\x03", msgpack.packb(["r1", "extra"])],  # too many fields
        [b"\x03", msgpack.packb([5])],  # wrong type
        [b"\x02", msgpack.packb(["r1", "not a list", []])],
        [b"\x02", msgpack.packb(["r1", [1, True], list(SamplingParams().__slots__)])],
        [
            b"\x02",
            msgpack.packb(
                ["r1", [], [16, 1.0, 0, 1.0, 0.0, 1.0, 64, 0.0, 0.0, None, {}, None, False]]
            ),
        ],
        [
            b"\x02",
            msgpack.packb(
                ["r1", [1], [0, 1.0, 0, 1.0, 0.0, 1.0, 64, 0.0, 0.0, None, {}, None, False]]
            ),
        ],
        [b"\x04", b"\x91" + b"\xdd\xff\xff\xff\xff"],  # claims a 4-billion-item array
    ],
)
def test_malformed_frames_raise_decode_error(frames):
    with pytest.raises(DecodeError):
        decode(frames)


def test_invalid_sampling_params_are_refused():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_a_chunk_without_logprobs_costs_one_byte() -> None:
    """Requests that do not ask for logprobs pay one msgpack nil per chunk on the wire."""
    body = encode(Outputs(tokens=[TokenChunk("r1", [4])], finishes=[]))[1]
    assert body == msgpack.packb([[["r1", [4], None]], []])
    assert len(body) == len(msgpack.packb([[["r1", [4]]], []])) + 1
