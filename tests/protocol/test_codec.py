"""Every wire message round-trips, and bad bytes end as DecodeError, never a crash."""

import dataclasses
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
    ImageTokens,
    ImageTokensQuery,
    Load,
    ModelInfo,
    Outputs,
    Ping,
    PromptLogprobs,
    Rejected,
    SamplingParams,
    SlotsQuery,
    SlotsReport,
    SlotState,
    TenantQueue,
    TokenChunk,
    TokenLogprobs,
    WorkerError,
    decode,
    encode,
)
from loomserve.protocol.codec import TooLong, request_id_of
from loomserve.protocol.messages import DEFAULT_TENANT, MAX_TRACE_CHARS, PROTOCOL_VERSION

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
            prompt_logprobs=2,
        ),
        priority=-3,
        tenant="team-a",
        trace="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        trace_state="vendor=opaque",
    ),
    Generate("r2", [1, 2], SamplingParams(), images=[b"\x89PNG", b"\xff\xd8"], image_at=[1, 2]),
    Embed(request_id="e1", inputs=[[1, 2], [3]]),
    Embed(
        request_id="e2",
        inputs=[[1]],
        trace="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
    ),
    Cancel(request_id="r1"),
    Cancel(request_id="r2", reason="stop"),
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
    ModelInfo(1, "tiny-vision", 300, 256, 256, 4, "ab" * 32, ready=True, vision=True),
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
            TokenChunk(
                request_id="r4",
                token_ids=[],
                prompt_logprobs=PromptLogprobs(
                    first=1,
                    logprobs=[TokenLogprobs(-2.0, [3], [-0.75]), TokenLogprobs(-0.5, [], [])],
                ),
            ),
        ],
        finishes=[Finish("r2", "length", 3, 5, 1, 0.25)],
    ),
    Heartbeat(sent_at=1.0, ping_sent_at=0.5, ready=True, load=Load(0, 4, 0)),
    Heartbeat(
        sent_at=1.0,
        ping_sent_at=0.0,
        ready=True,
        load=Load(queue_depth=2, free_slots=0, running=4),
        prefixes=[7, 9],
        kv_cells_used=300,
        kv_cells_total=1024,
    ),
    WorkerError(code="decode_failed", message="boom"),
    Embeddings(request_id="e1", size=2, vectors=b"\x00\x00\x80?" * 4, prompt_tokens=3),
    SlotsQuery(query_id="q1"),
    ImageTokensQuery(query_id="i1", images=[b"\x89PNG...", b"GIF89a"]),
    ImageTokens(query_id="i1", counts=[16, 258]),
    ImageTokens(query_id="i2", counts=[], error="image 1 is not an image this server can read"),
    SlotsReport(
        query_id="q1",
        queue_depth=2,
        slots=[
            SlotState(index=0, state="idle"),
            SlotState(
                index=1,
                state="generating",
                request_id="cmpl-abc",
                gateway="gw-host-1-ab12-1",
                tenant="team-a",
                priority=-1,
                prompt_tokens=40,
                cached_tokens=32,
                computed_tokens=8,
                generated_tokens=17,
                age_seconds=1.5,
                tokens_per_second=42.0,
            ),
        ],
        tenants=[TenantQueue("team-a", running=1, waiting=2)],
    ),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips(message):
    frames = encode(message)
    assert len(frames[0]) == 1
    assert decode(frames) == message


def walked(value):
    """The wire format, spelled out: a dataclass is the array of its fields in order."""
    if dataclasses.is_dataclass(value):
        return [walked(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list):
        return [walked(v) for v in value]
    return value


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda msg: type(msg).__name__)
def test_the_built_encoders_write_the_wire_format(message):
    """The codec's per-type encoders (built once) write what walking the message writes."""
    assert encode(message)[1] == msgpack.packb(walked(message), use_bin_type=True)


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x02"],  # no body
        [b"\x7f", msgpack.packb([])],  # unknown type
        [b"\x03", b"\xc1"],  # msgpack's never-used byte
        [b"\x03", msgpack.packb(["r1", "cancelled", "extra"])],  # too many fields
        [b"\x03", msgpack.packb(["r1", "length"])],  # not a reason a gateway gives
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
        # Optional fields: not None, so the value must be what the annotation says.
        [b"\x84", msgpack.packb([[["r1", [4], "x", None, 0]], []])],
        [b"\x84", msgpack.packb([[["r1", [4], None, [1, "x"], 0]], []])],
        [b"\x84", msgpack.packb([[["r1", [4], [[-0.5, [6], ["a"]]], None, 0]], []])],
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
    with pytest.raises(ValueError):
        SamplingParams(prompt_logprobs=21)


def test_a_chunk_without_logprobs_costs_two_bytes() -> None:
    """Requests that do not ask for logprobs pay a msgpack nil per chunk on the wire for the
    tokens' logprobs, and one for the prompt's."""
    body = encode(Outputs(tokens=[TokenChunk("r1", [4])], finishes=[]))[1]
    assert body == msgpack.packb([[["r1", [4], None, None, 0]], []])
    assert len(body) == len(msgpack.packb([[["r1", [4], 0]], []])) + 2


def generate_body(prompt: object, logit_bias: object) -> bytes:
    params = [16, 1.0, 0, 1.0, 0.0, 1.0, 64, 0.0, 0.0, None, logit_bias, None, False, None, None]
    params.append(True)  # speculative
    params += [0, [], []]  # think_budget, think_start, think_end
    return msgpack.packb(["r1", prompt, params, 0, "", "", "", [], []])


def test_token_ids_and_logit_bias_are_checked_exactly():
    with pytest.raises(DecodeError):  # a bool is no token id, even in a long prompt
        decode([b"\x02", generate_body([1] * 1000 + [True], {})])
    with pytest.raises(DecodeError):
        decode([b"\x02", generate_body([1, 2.0], {})])
    with pytest.raises(DecodeError):
        decode([b"\x02", generate_body([1], {1: True})])
    message = decode([b"\x02", generate_body([1, 2], {3: 2, 4: -1.5})])
    assert message.params.logit_bias == {3: 2.0, 4: -1.5}
    assert type(message.params.logit_bias[3]) is float


def test_limits_stop_an_oversized_body_while_it_is_unpacked():
    long_prompt = [b"\x02", generate_body([1] * 5000, {})]
    assert len(decode(long_prompt, max_items=5000).prompt_tokens) == 5000
    with pytest.raises(TooLong, match="max_array_len"):
        decode(long_prompt, max_items=4999)
    assert request_id_of(long_prompt) == "r1"  # to reject it by name
    assert request_id_of([b"\x02", b"\x93\x91\x01"]) is None  # an array where the id is
    assert request_id_of(encode(Ping(1.0))) is None
    many_bias = [b"\x02", generate_body([1], {i: 1.0 for i in range(100)})]
    with pytest.raises(DecodeError, match="max_map_len"):
        decode(many_bias, max_items=99)
    # Nested empty arrays where token ids belong: 1 byte each on the wire, 56 in memory.
    bomb = [b"\x02", msgpack.packb(["r1", [[[]] * 100] * 100, []])]
    with pytest.raises(DecodeError, match="too many arrays"):
        decode(bomb, max_containers=8)
    assert decode(EVERY_MESSAGE_FRAMES["Generate"], max_items=19, max_containers=9)


EVERY_MESSAGE_FRAMES = {type(m).__name__: encode(m) for m in EVERY_MESSAGE}


def test_generate_bounds_priority_and_tenant():
    params = SamplingParams()
    assert (
        Generate("r", [1], params).priority == 0
        and Generate("r", [1], params).tenant == DEFAULT_TENANT
    )
    with pytest.raises(ValueError):
        Generate("r", [1], params, priority=2**31)
    with pytest.raises(ValueError):
        Generate("r", [1], params, tenant="x" * 129)
    frames = encode(Generate("r", [1], params, priority=2, tenant="t"))
    assert decode(frames) == Generate("r", [1], params, 2, "t")


def test_the_trace_context_is_bounded_and_a_version_12_message():
    params = SamplingParams()
    assert Generate("r", [1], params).trace == "" and Embed("e", [[1]]).trace_state == ""
    with pytest.raises(ValueError):
        Generate("r", [1], params, trace="x" * (MAX_TRACE_CHARS + 1))
    with pytest.raises(ValueError):
        Embed("e", [[1]], trace="x", trace_state="y" * MAX_TRACE_CHARS)
    assert PROTOCOL_VERSION >= 12  # an 11 peer would refuse its Generates as malformed


def test_a_heartbeat_carries_one_load_since_version_13():
    beat = Heartbeat(2.0, 0.0, True, Load(queue_depth=1, free_slots=0, running=3), [5])
    frames = encode(beat)
    # On the wire the load is one nested array, as every nested dataclass is.
    assert msgpack.unpackb(frames[1])[:4] == [2.0, 0.0, True, [1, 0, 3]]
    assert decode(frames) == beat and isinstance(decode(frames).load, Load)
    # A version-12 worker's heartbeat (three numbers where the load goes) is malformed here.
    old = msgpack.packb([2.0, 0.0, True, 1, 0, 3, [5], 0, 0, 0.0])
    with pytest.raises(DecodeError):
        decode([frames[0], old])
    bad_load = msgpack.packb([2.0, 0.0, True, [1, 0, "3"], [5], 0, 0, 0.0])
    with pytest.raises(DecodeError):
        decode([frames[0], bad_load])
    assert PROTOCOL_VERSION >= 13  # a 12 peer reads this Heartbeat as malformed


def test_a_generate_places_its_images_within_its_prompt():
    params = SamplingParams()
    assert Generate("r", [1, 2], params, images=[b"a", b"b"], image_at=[0, 2]).images
    for images, at in (([b"a"], []), ([b"a"], [3]), ([b"a", b"b"], [2, 1]), ([b"a"], [-1])):
        with pytest.raises(ValueError):
            Generate("r", [1, 2], params, images=images, image_at=at)
    assert PROTOCOL_VERSION >= 14  # a 13 peer reads a Generate with images as malformed
