"""Images through the tick loop on the real engine: the tiny model and the tiny vision
projectors (tests/tiny_vision_model.py: LLaVA's causal "mlp" and Gemma 3's, whose images
attend both ways and come wrapped in begin and end markers), libmtmd encoding on its own
thread, embeddings in passes of their own. No mocks."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import llama_cpp as llama
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as mtmd

from loomserve.protocol import ErrorCode, Generate, ImageTokens, ImageTokensQuery, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.engine.media import MediaEncoder
from loomserve.worker.sched.media import MediaSpan, outside_image, rope_position
from loomserve.worker.stats import MediaRecord
from loomserve.worker.tick.loop import TickLoop
from tests.tiny_vision_model import (
    TINY_GEMMA3,
    TINY_VISION,
    VisionShape,
    png_bytes,
    write_tiny_mmproj,
    write_tiny_qwen2vl,
)
from tests.worker.engine.test_engine import GW, Collector
from tests.worker.text import tokenize


@pytest.fixture(params=["mlp", "gemma3"])
def config(
    request: pytest.FixtureRequest,
    tiny_model_path: Path,
    tiny_mmproj_path: Path,
    tiny_gemma3_mmproj_path: Path,
) -> WorkerConfig:
    mmproj = tiny_mmproj_path if request.param == "mlp" else tiny_gemma3_mmproj_path
    return vision_config(tiny_model_path, mmproj)


def vision_config(model_path: Path, mmproj: Path) -> WorkerConfig:
    """The tests' worker settings for a model and its projector."""
    return WorkerConfig(
        model_path=model_path,
        mmproj=mmproj,
        slots=6,
        ctx_size=256,
        max_queue=32,
        batch_tokens=32,
        prefill_chunk=7,
        threads=1,
    )


@pytest.fixture
def engine(config: WorkerConfig) -> Iterator[Engine]:
    engine = Engine(config)
    yield engine
    engine.close()


@pytest.fixture
def loop(engine: Engine, config: WorkerConfig) -> Iterator[tuple[TickLoop, Collector]]:
    made: list[MediaEncoder] = []
    yield new_loop(engine, config, made)
    for media in made:
        media.close()


def new_loop(
    engine: Engine,
    config: WorkerConfig,
    made: list[MediaEncoder],
    on_media: Callable[[MediaRecord], None] | None = None,
) -> tuple[TickLoop, Collector]:
    collector = Collector()
    loop: TickLoop | None = None

    def done(gateway, generate, encoded, why):
        assert loop is not None
        loop.inbox.encoded(gateway, generate, encoded, why)

    media = MediaEncoder(config.mmproj, engine.model, 1, False, done)
    made.append(media)
    loop = TickLoop(engine, config, collector, media=media, on_media=on_media)
    return loop, collector


def drain(loop: TickLoop, max_ticks: int = 5_000) -> None:
    """Tick until every request has finished, waiting for the encoder when only it works."""
    for _ in range(max_ticks):
        busy = loop.scheduler.has_work() or not loop.inbox.empty()
        if not busy and not loop.images_pending:
            return
        loop.tick(block=not busy)  # only the encoder's answer can come: wait for it
    raise AssertionError("the worker did not finish its requests")


def image_request(
    engine: Engine, request_id: str, images: list[bytes], max_tokens: int = 12, text: str = ""
) -> Generate:
    """A prompt "look: <image> ... what is it?" with the images one after another."""
    before = tokenize(engine, "look at this" + text)
    after = tokenize(engine, " what is it? tell me", add_special=False)
    at = [len(before)] * len(images)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Generate(request_id, before + after, params, images=images, image_at=at)


def text_request(engine: Engine, request_id: str, text: str, max_tokens: int = 30) -> Generate:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Generate(request_id, tokenize(engine, text), params)


def run(loop: TickLoop, collector: Collector, *requests: Generate) -> dict[str, list[int]]:
    for request in requests:
        loop.inbox.submit(GW, request)
    drain(loop)
    return collector.tokens()


def test_an_image_request_runs_and_counts_its_image_tokens(engine, loop):
    tick_loop, collector = loop
    request = image_request(engine, "img", [png_bytes(40, 24, seed=1)])
    tokens = run(tick_loop, collector, request)["img"]
    finish = collector.finishes()["img"]
    assert len(tokens) == 12 and finish.reason == "length"
    encoded = tick_loop.media.encode(request)
    shape = TINY_GEMMA3 if tick_loop.media.non_causal else TINY_VISION
    assert [span.n_tokens for span in encoded.media] == [shape.image_tokens]
    # The image's positions, and for Gemma 3 its begin and end markers' tokens.
    assert finish.prompt_tokens == len(encoded.tokens) >= len(request.prompt_tokens) + 4


class CountedPasses:
    """A stand-in for the thread governor that counts the passes it is told of."""

    def __init__(self, most: int) -> None:
        self.most, self.started, self.ended, self.running = most, 0, 0, False

    def update(self) -> int:
        return self.most

    def pass_started(self) -> None:
        assert not self.running
        self.started, self.running = self.started + 1, True

    def pass_ended(self) -> None:
        assert self.running
        self.ended, self.running = self.ended + 1, False

    def close(self) -> None:
        """Nothing to stop."""


def test_an_images_passes_are_passes_to_the_thread_governor(engine, loop, monkeypatch):
    """An image's embedding passes tell the governor a pass runs, as token passes do: a
    long one is not an idle worker (threads.py)."""
    tick_loop, collector = loop
    calls = {"tokens": 0, "image": 0}

    def counting(method, kind):
        def call(*args, **kwargs):
            calls[kind] += 1
            return method(*args, **kwargs)

        return call

    monkeypatch.setattr(engine, "decode", counting(engine.decode, "tokens"))
    media_batch = tick_loop.media_batch
    monkeypatch.setattr(media_batch, "decode", counting(media_batch.decode, "image"))
    counted = CountedPasses(engine.config.n_threads)
    monkeypatch.setattr(engine, "threads", counted)
    run(tick_loop, collector, image_request(engine, "img", [png_bytes(40, 24, seed=3)]))
    # A causal image's rows ride in the token passes (token_rows.py); Gemma 3's go in
    # passes of their own.
    assert tick_loop.images_in_token_passes == (
        engine.config.mmproj.name != "mmproj-tiny-gemma3.gguf"
    )
    assert calls["image"] == (0 if tick_loop.images_in_token_passes else 1)
    assert calls["tokens"] >= 12
    assert counted.started == counted.ended == calls["tokens"] + calls["image"]
    assert not counted.running


def test_two_images_give_two_answers_and_no_prefix_hit_across_them(engine, loop):
    tick_loop, collector = loop
    first = image_request(engine, "a", [png_bytes(32, 32, seed=1)])
    other = image_request(engine, "b", [png_bytes(32, 32, seed=2)])
    same = image_request(engine, "c", [png_bytes(32, 32, seed=1)])
    run(tick_loop, collector, first)
    run(tick_loop, collector, same)  # into the slot that holds the first image
    out = run(tick_loop, collector, other)  # and then there too: the longest shared prefix
    finishes = collector.finishes()
    assert out["a"] != out["b"]
    assert out["c"] == out["a"]
    (span,) = tick_loop.media.encode(first).media
    # Another image: the cache may serve the text before it, never the image or beyond.
    assert finishes["b"].cached_tokens <= span.start
    # The same image again: its cells are reused past the image.
    assert finishes["c"].cached_tokens > span.end


def test_greedy_output_with_an_image_is_the_same_alone_and_batched(engine, config):
    made: list[MediaEncoder] = []
    try:
        request = image_request(engine, "img", [png_bytes(48, 30, seed=5)], max_tokens=20)
        alone_loop, alone = new_loop(engine, config, made)
        expected = run(alone_loop, alone, request)["img"]

        busy_loop, busy = new_loop(engine, config, made)
        texts = [text_request(engine, f"t{i}", f"once upon a time {i}") for i in range(3)]
        others = [
            image_request(engine, "o1", [png_bytes(32, 32, seed=8)], text=" the cat"),
            image_request(engine, "o2", [png_bytes(20, 50, seed=9), png_bytes(32, 32, seed=3)]),
        ]
        for text in texts:
            busy_loop.inbox.submit(GW, text)
        for _ in range(3):  # the text streams are generating when the images arrive
            busy_loop.tick(block=False)
        out = run(busy_loop, busy, request, *others)
        assert out["img"] == expected
        assert all(len(out[f"t{i}"]) == 30 for i in range(3))
        assert len(out["o2"]) == 12
    finally:
        for media in made:
            media.close()


@pytest.mark.parametrize(
    "image",
    [b"not an image at all", png_bytes(32, 32, seed=1)[:60], b""],
    ids=["not-an-image", "truncated", "empty"],
)
def test_a_bad_image_is_refused_and_other_streams_go_on(engine, loop, image):
    tick_loop, collector = loop
    text = text_request(engine, "t", "hello world", max_tokens=20)
    tick_loop.inbox.submit(GW, text)
    tick_loop.tick(block=False)
    out = run(tick_loop, collector, image_request(engine, "bad", [image]))
    assert collector.rejected() == {"bad": ErrorCode.INVALID_REQUEST.value}
    assert "bad" not in out and len(out["t"]) == 20


def test_a_worker_without_a_projector_refuses_images(engine, config):
    collector = Collector()
    tick_loop = TickLoop(engine, replace(config, mmproj=None), collector)
    run(tick_loop, collector, image_request(engine, "img", [png_bytes(32, 32)]))
    rejected = collector.of_type(type(collector.messages[0][1]))
    assert collector.rejected() == {"img": ErrorCode.INVALID_REQUEST.value}
    assert "no vision projector" in rejected[0].message


def test_an_image_that_ends_the_prompt_is_refused(engine, loop):
    tick_loop, collector = loop
    prompt = tokenize(engine, "look")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    request = Generate("end", prompt, params, images=[png_bytes(32, 32)], image_at=[len(prompt)])
    out = run(tick_loop, collector, request)
    if tick_loop.media.non_causal:  # Gemma 3's end-of-image marker follows it: text
        assert collector.rejected() == {} and len(out["end"]) == 4
    else:
        assert collector.rejected() == {"end": ErrorCode.INVALID_REQUEST.value}


def test_the_same_tokens_as_llama_cpps_own_mtmd_path(engine, config, loop, tiny_model_path):
    """Oracle: libmtmd's own helper (mtmd_helper_eval_chunks) prefills the same prompt in a
    llama_context of its own; greedy decoding from there gives the loop's tokens."""
    tick_loop, collector = loop
    image = png_bytes(36, 28, seed=11)
    request = image_request(engine, "img", [image], max_tokens=16)
    ours = run(tick_loop, collector, request)["img"]
    n_prompt = collector.finishes()["img"].prompt_tokens
    assert ours == oracle_greedy(engine, config, n_prompt, image, 16)


def oracle_greedy(
    engine: Engine, config: WorkerConfig, n_prompt: int, image: bytes, n: int
) -> list[int]:
    text_before = "look at this"
    text_after = " what is it? tell me"
    marker = mtmd.mtmd_default_marker().decode()
    prompt = (text_before + marker + text_after).encode()
    params = llama.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 256, 32, 32
    params.n_threads = params.n_threads_batch = 1
    ctx = llama.llama_init_from_model(engine.model, params)
    mparams = mtmd.mtmd_context_params_default()
    mparams.use_gpu, mparams.n_threads, mparams.print_timings = False, 1, False
    mctx = mtmd.mtmd_init_from_file(str(config.mmproj).encode(), engine.model, mparams)
    buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(mctx, buf, len(image), False)
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(mctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        assert mtmd.mtmd_helper_get_n_tokens(chunks) == n_prompt
        n_past = llama.llama_pos(0)
        assert (
            mtmd.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 32, True, ctypes.byref(n_past))
            == 0
        )
        tokens, pos = [], n_past.value
        n_vocab = engine.n_vocab
        for _ in range(n):
            logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            tokens.append(token)
            batch = llama.llama_batch_get_one((llama.llama_token * 1)(token), 1)
            assert llama.llama_decode(ctx, batch) == 0
            pos += 1
        return tokens
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(mctx)
        llama.llama_free(ctx)


def test_an_image_sent_again_is_not_encoded_again(engine, config):
    made: list[MediaEncoder] = []
    try:
        _, _ = new_loop(engine, config, made)
        media = made[0]
        request = image_request(engine, "r", [png_bytes(32, 32, seed=1), png_bytes(32, 32, seed=2)])
        first = media.encode(request)
        again = media.encode(request)
        assert (first.cached_images, again.cached_images) == (0, 2)
        assert again.tokens == first.tokens
        assert all(
            np.array_equal(a.embeddings, b.embeddings)
            for a, b in zip(first.media, again.media, strict=True)
        )
    finally:
        for media in made:
            media.close()


def test_under_a_latency_target_a_generating_stream_waits_for_one_image_a_tick(engine, config):
    made: list[MediaEncoder] = []
    try:
        images = [png_bytes(32, 32, seed=30 + i) for i in range(4)]
        requests = [image_request(engine, "four", images), image_request(engine, "one", images[:1])]
        alone_records: list[MediaRecord] = []
        alone_loop, alone = new_loop(engine, config, made, alone_records.append)
        expected = run(alone_loop, alone, *requests)
        media = alone_loop.media
        if not (alone_loop.images_in_token_passes or media.non_causal):  # one tick takes all
            assert max(record.passes for record in alone_records) >= 4

        records: list[MediaRecord] = []
        target = replace(config, itl_target_ms=1000.0)
        tick_loop, collector = new_loop(engine, target, made, records.append)
        tick_loop.inbox.submit(GW, text_request(engine, "t", "once upon a time", max_tokens=200))
        for _ in range(3):  # the text stream generates when the images arrive
            tick_loop.tick(block=False)
        out = run(tick_loop, collector, *requests)
        passes = [record.passes for record in records if record.passes]
        assert len(out["t"]) == 200  # long enough to generate beside every image pass
        assert {key: out[key] for key in expected} == expected
        if tick_loop.images_in_token_passes:  # prompt rows, in the stream's passes
            encoded = [made[0].encode(request).media for request in requests]
            image_rows = sum(span.n_tokens for media in encoded for span in media)
            shared = sum(record.shared_rows for record in records)
            assert sum(passes) == 5 and shared == image_rows
            assert not any(record.pass_seconds for record in records)
        else:  # passes of their own: one image a tick
            assert sum(passes) == 5 and max(passes) == 1
    finally:
        for media in made:
            media.close()


def test_counting_images_gives_the_positions_encoding_places(engine, config):
    """The count endpoints' answer (MediaEncoder.count, via ImageTokensQuery) is what the
    prompt grows by, begin and end tokens included, before encoding and from the cache."""
    made: list[MediaEncoder] = []
    answers: list[tuple[bytes, object]] = []
    try:
        _, _ = new_loop(engine, config, made)
        media = made[0]
        media.answer = lambda gateway, message: answers.append((gateway, message))
        images = [png_bytes(40, 24, seed=5), png_bytes(24, 40, seed=6)]
        counted = media.count(images)  # nothing encoded yet
        request = image_request(engine, "r", images)
        encoded = media.encode(request)
        assert sum(counted) == len(encoded.tokens) - len(request.prompt_tokens)
        shape = TINY_VISION if config.mmproj.name == "mmproj-tiny-llama.gguf" else TINY_GEMMA3
        assert all(n >= shape.image_tokens for n in counted)
        assert media.count(images) == counted  # from the encoded cache now
        media.submit_count(GW, ImageTokensQuery("q", [images[0], b"not an image"]))
        media.submit_count(GW, ImageTokensQuery("q2", images))
        media.close()  # after the work it has: both answered
        assert answers == [
            (GW, ImageTokens("q", [], "image 1 is not an image this server can read")),
            (GW, ImageTokens("q2", counted)),
        ]
    finally:
        for media in made:
            media.close()


@pytest.fixture
def qwen2vl_config(tmp_path: Path) -> WorkerConfig:
    """The generated Qwen2-VL pair (M-RoPE) under the tests' worker settings."""
    return vision_config(*write_tiny_qwen2vl(tmp_path))


def test_m_rope_images_give_llama_cpps_own_tokens(qwen2vl_config: WorkerConfig) -> None:
    """Qwen2-VL's layout: an image's rows get four positions each (t, y, x, z) and the text
    after it goes on from its start plus its n_pos, fewer than its tokens; greedy tokens
    equal mtmd_helper_eval_chunks', alone and beside text streams and other images (their
    images in passes of their own, their text in shared ones, at shifted positions)."""
    config = qwen2vl_config
    engine = Engine(config)
    made: list[MediaEncoder] = []
    try:
        image = png_bytes(36, 28, seed=11)
        request = image_request(engine, "img", [image], max_tokens=16)
        alone_loop, alone = new_loop(engine, config, made)
        assert made[0].mrope
        ours = run(alone_loop, alone, request)["img"]
        n_prompt = alone.finishes()["img"].prompt_tokens
        assert ours == oracle_greedy(engine, config, n_prompt, image, 16)
        # Again: its cells are reused past the image (kept at rope positions, not indices).
        again = image_request(engine, "again", [image], max_tokens=16)
        assert run(alone_loop, alone, again)["again"] == ours
        image_end = made[0].encode(again).media[0].end
        assert alone.finishes()["again"].cached_tokens > image_end

        busy_loop, busy = new_loop(engine, config, made)
        texts = [text_request(engine, f"t{i}", f"once upon a time {i}") for i in range(2)]
        other = image_request(engine, "o", [png_bytes(20, 44, seed=9)], text=" the cat")
        for text in texts:
            busy_loop.inbox.submit(GW, text)
        busy_loop.tick(block=False)
        out = run(busy_loop, busy, request, other)
        assert out["img"] == ours
        assert len(out["o"]) == 12 and all(len(out[f"t{i}"]) == 30 for i in range(2))
    finally:
        for media in made:
            media.close()
        engine.close()


def test_greedy_output_with_an_image_is_the_same_beside_8_text_streams_and_2_images(config):
    """Issue 58's batch invariance, at its size: a request's greedy tokens alone, and again
    while 8 text streams generate and 2 other image requests arrive with it."""
    wide = replace(config, slots=11, max_queue=16)
    engine = Engine(wide)
    made: list[MediaEncoder] = []
    try:
        request = image_request(engine, "img", [png_bytes(44, 28, seed=15)], max_tokens=16)
        alone_loop, alone = new_loop(engine, wide, made)
        expected = run(alone_loop, alone, request)["img"]

        busy_loop, busy = new_loop(engine, wide, made)
        texts = [text_request(engine, f"t{i}", f"tell me a story {i}", 40) for i in range(8)]
        others = [
            image_request(engine, "o1", [png_bytes(32, 32, seed=16)], text=" the dog"),
            image_request(engine, "o2", [png_bytes(28, 40, seed=17)], max_tokens=8),
        ]
        for text in texts:
            busy_loop.inbox.submit(GW, text)
        for _ in range(3):  # the text streams are generating when the images arrive
            busy_loop.tick(block=False)
        out = run(busy_loop, busy, request, *others)
        assert out["img"] == expected
        assert all(len(out[f"t{i}"]) == 40 for i in range(8))
        assert (len(out["o1"]), len(out["o2"])) == (12, 8)
    finally:
        for media in made:
            media.close()
        engine.close()


@pytest.mark.parametrize("projector", ["mlp", "qwen2vl"])
def test_under_a_tight_latency_target_a_causal_image_goes_in_over_several_ticks(
    projector: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """A 64-token causal image (LLaVA's; Qwen2-VL's, M-RoPE) beside a generating stream
    under a latency target goes in a few rows a tick (the target's prompt tokens: 16 at
    least), not whole; its request's greedy tokens are those it gets alone and whole."""
    if projector == "mlp":
        model_path = tiny_model_path
        mmproj = write_tiny_mmproj(tmp_path / "mmproj-64.gguf", shape=VisionShape(image_size=64))
    else:
        model_path, mmproj = write_tiny_qwen2vl(tmp_path)
    config = vision_config(model_path, mmproj)
    base = replace(config, slots=4, max_queue=8, batch_tokens=128, prefill_chunk=128)
    engine = Engine(base)
    made: list[MediaEncoder] = []
    try:
        image = png_bytes(64, 64, seed=21)
        request = image_request(engine, "img", [image], max_tokens=12)
        alone_loop, alone = new_loop(engine, base, made)
        expected = run(alone_loop, alone, request)["img"]
        assert made[0].encode(request).media[0].n_tokens == 64

        tight = replace(base, itl_target_ms=0.001)  # every tick over: the fewest rows
        shared: list[int] = []  # image rows in each tick's token pass
        tick_loop, collector = new_loop(
            engine, tight, made, lambda record: shared.append(record.shared_rows)
        )
        passes: list[int] = []
        decode = tick_loop.media_batch.decode

        def counted(rows, *args):  # the real pass, its rows counted
            passes.append(len(rows))
            return decode(rows, *args)

        tick_loop.media_batch.decode = counted
        stream = text_request(engine, "t", "once upon a time there lived " * 3, max_tokens=120)
        tick_loop.inbox.submit(GW, stream)
        for _ in range(20):  # the stream's prompt and tokens teach the tick cost model
            tick_loop.tick(block=False)
        # What the target leaves for prompt rows beside the stream: its floor, 16, once the
        # tick cost is known (the tiny model's own ticks are too cheap to price a token).
        for prefill in (0, 32) * 20:
            tick_loop.tick_cost.observe(1, prefill, 0.01 + 0.001 * prefill)
        assert tick_loop.scheduler.media_rows_cap() == 16
        tick_loop.scheduler.media_rows_cap = lambda: 16  # the run's ticks re-price it
        latency = tick_loop.scheduler.latency
        assert latency is not None
        latency.prefill_cap = lambda generating: 16  # the same for prompt rows
        out = run(tick_loop, collector, request)
        assert out["img"] == expected and len(out["t"]) == 120
        if projector == "mlp":  # prompt rows in the stream's passes (token_rows.py)
            assert tick_loop.images_in_token_passes and not passes
            assert sum(shared) == 64 and max(shared) == 16
        else:  # M-RoPE: passes of their own
            assert sum(passes) == 64 and max(passes) == 16
    finally:
        for media in made:
            media.close()
        engine.close()


def test_rope_positions_and_reused_prefixes_around_images() -> None:
    """sched/media.py's arithmetic: an M-RoPE image of 6 tokens and 2 positions at 3 puts
    the text after it 4 earlier; a 1-D image shifts nothing; a reused prefix that would end
    inside an image ends at its start."""
    rope = MediaSpan(3, np.zeros((6, 4), dtype=np.float32), "a", n_pos=2)
    flat = MediaSpan(12, np.zeros((5, 4), dtype=np.float32), "b")
    media = (rope, flat)
    assert [rope_position(media, i) for i in (0, 3, 5, 9, 10, 12, 14, 17, 20)] == [
        0,
        3,
        3,  # inside the M-RoPE image: its cells all sit at its start
        5,
        6,
        8,
        10,  # inside a 1-D image: as a token
        13,
        16,
    ]
    assert rope_position((), 7) == 7
    assert [outside_image(media, i) for i in (2, 3, 4, 8, 9, 13, 17)] == [2, 3, 3, 3, 9, 12, 17]
