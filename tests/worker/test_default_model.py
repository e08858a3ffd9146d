"""The worker on the default model, Gemma 3 270M (Q4_K_M), in a process and in-process.

The continuous-batching invariant on a real quantized model: with greedy sampling a request's
tokens are the same alone and batched. It holds because of the worker's batch-invariant
set-up (one KV stream per slot, per-row K-quant kernels; see worker/engine/engine.py): with one
shared KV cache or repacked weights, Gemma's near-ties flip within a few dozen tokens.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from loomserve.cli.default_model import default_model_path
from loomserve.protocol import Generate, Hello, ModelInfo, Outputs, SamplingParams
from loomserve.worker.cache.prefix_cache import usable_prefix
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.engine.kernels import graph_native
from loomserve.worker.tick.loop import TickLoop
from tests.procs import start_worker
from tests.worker.engine.test_engine import Collector, drain, run_alone, run_staggered
from tests.worker.test_server import Gateway
from tests.worker.text import detokenize, tokenize

pytestmark = pytest.mark.default_model

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the river, there lived an old",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
]
# Same token counts as PROMPTS' neighbours, different words.
OTHER_NEIGHBOURS = [
    "The history of the printing press in Europe begins in the fifteenth century "
    "with a German monk",
    "import numpy as np\nx = ",
    "A good breakfast starts with",
]


@pytest.fixture(scope="module")
def model_path() -> Path:
    return default_model_path()


def test_the_default_model_starts_and_serves(model_path: Path):
    with start_worker(model_path, slots=2, ctx_size=512, threads=1) as proc:
        gateway = Gateway(proc.endpoint, "gw-default-model")
        try:
            gateway.send(Hello("gw-default-model"))
            info = gateway.wait_for(lambda m: isinstance(m, ModelInfo))
            assert "gemma" in info.model_name.lower() and info.ready
            assert info.vocab_size == 262_144 and info.context_train == 32_768
            assert info.slot_context == 512 and info.slots == 2
            assert len(info.vocab_fingerprint) == 64
            prompt = [2, 818, 5279, 529, 7001, 563]  # <bos>The capital of France is
            tokens, finish = gateway.run(
                Generate("capital", prompt, SamplingParams(max_tokens=8, temperature=0.0))
            )
            assert finish.reason == "length" and len(tokens) == 8
        finally:
            gateway.close()
        logs = proc.logs()
    assert '"model loaded"' in logs and "gemma3" in logs and '"runs_on": "CPU"' in logs


@pytest.fixture(scope="module")
def engine(model_path: Path):
    engine = Engine(
        WorkerConfig(model_path=model_path, slots=4, ctx_size=256, batch_tokens=128, threads=1)
    )
    yield engine
    engine.close()


def run_together(engine: Engine, texts: list[str], max_tokens: int = 16) -> dict[str, list[int]]:
    """All requests submitted before the first tick, so every run has the same batches."""
    collector = Collector()
    loop = TickLoop(engine, engine.config, collector)
    for i, text in enumerate(texts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        loop.inbox.submit(b"gw", Generate(f"r{i}", tokenize(engine, text), params))
    drain(loop)
    return collector.tokens(b"gw")


def test_batched_greedy_is_isolated_and_repeatable(engine: Engine):
    for mine, theirs in zip(PROMPTS[1:], OTHER_NEIGHBOURS, strict=True):
        assert len(tokenize(engine, mine)) == len(tokenize(engine, theirs))

    started = time.monotonic()
    first = run_together(engine, PROMPTS)
    again = run_together(engine, PROMPTS)
    other_neighbours = run_together(engine, [PROMPTS[0], *OTHER_NEIGHBOURS])

    assert first == again
    assert other_neighbours["r0"] == first["r0"]
    assert all(len(tokens) == 16 for tokens in first.values())
    assert detokenize(engine, first["r0"]).strip()
    assert time.monotonic() - started < 60


def test_greedy_tokens_are_the_same_alone_and_batched(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
):
    # The last two share a long start: one copies it from the other's busy slot.
    story = f"{PROMPTS[1]} fisherman and his wife, who lived in a small house"
    texts = [*PROMPTS, *OTHER_NEIGHBOURS, f"{story} and", f"{story} with"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = [Generate(f"r{i}", tokenize(engine, t), params) for i, t in enumerate(texts)]
    # Small prompt chunks: prompts are prefilled over several ticks beside others' decodes.
    config = replace(engine.config, prefill_chunk=8)
    alone = {r.request_id: run_alone(engine, config, r) for r in requests}
    copied: list[int] = []  # prefix lengths copied from a busy slot's KV stream
    copy_prefix = engine.copy_prefix
    monkeypatch.setattr(
        engine, "copy_prefix", lambda *args: (copied.append(args[2]), copy_prefix(*args))
    )
    collector = Collector()
    loop = TickLoop(engine, config, collector)
    run_staggered(loop, requests, seed=3)  # 9 requests in waves through 4 slots
    assert collector.tokens() == alone
    # All they share but the tail whose kernels must run as they did cold (usable_prefix).
    shared = len(tokenize(engine, story))
    last = requests[-1].prompt_tokens
    reused = usable_prefix(shared, len(last), engine.split_rules.prompt_chunk)
    assert copied == [reused] and collector.finishes()["r8"].cached_tokens == reused


def test_the_draw_in_the_graph_gives_the_host_samplers_tokens_alone_and_batched(
    engine: Engine,
):
    """--backend-sampling draw (graph_draw.py) on Gemma's 262,144-token rows: each seeded
    request's tokens, drawn inside llama_decode beside host-sampled requests, are those the
    host sampler draws for it alone (Gemma's logits are batch-invariant to the bit)."""
    mixes = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.95},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
        {"temperature": 1.0, "min_p": 0.1},
        {"temperature": 0.0},
    ]
    on_host = [{"temperature": 1.0, "logprobs": 1}, {"temperature": 1.0, "presence_penalty": 1.0}]
    texts = [*PROMPTS, *OTHER_NEIGHBOURS]
    requests = [
        Generate(
            f"r{i}",
            tokenize(engine, texts[i % len(texts)]),
            SamplingParams(max_tokens=12, ignore_eos=True, seed=40 + i, **fields),
        )
        for i, fields in enumerate(mixes + on_host)
    ]
    alone = {r.request_id: run_alone(engine, engine.config, r) for r in requests[: len(mixes)]}
    config = replace(engine.config, backend_sampling="draw")
    drawing = Engine(config)
    try:
        collector = Collector()
        run_staggered(TickLoop(drawing, config, collector), requests, seed=5)
        tokens = collector.tokens()
        assert drawing.graph_draws is not None
        assert drawing.graph_draws.prepared == 12 * len(mixes)
    finally:
        drawing.close()
    assert {rid: tokens[rid] for rid in alone} == alone
    assert all(len(tokens[r.request_id]) == 12 for r in requests)


def test_the_swapped_matmuls_give_ggmls_tokens(engine: Engine):
    """Gemma's tied output matrix is Q8_0, many of its layers' matrices Q5_0 and the rest
    Q4_K and Q6_K: passes built with a draw sampler run q0matmul.c's and qkmatmul.c's matmuls
    in their place (q0swap.c), whose outputs are ggml's to the bit (test_q0matmul.py,
    test_qkmatmul.py). Batched requests, greedy and seeded, get the same tokens with ggml's
    own matmuls."""
    native = graph_native()
    lib = native.kernels if native is not None else None
    if lib is None or not lib.ls_q0_matmul_supported():
        pytest.skip("neither AVX2 nor AVX-512 VNNI: ggml's matmul runs")
    mixes = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.95}]
    texts = [*PROMPTS, *OTHER_NEIGHBOURS]
    requests = [
        Generate(
            f"r{i}",
            tokenize(engine, texts[i % len(texts)]),
            SamplingParams(max_tokens=12, ignore_eos=True, seed=60 + i, **mixes[i % 3]),
        )
        for i in range(7)
    ]
    config = replace(engine.config, backend_sampling="draw")
    tokens, swapped = {}, {}
    # Every kernel swapped; the Q8_0 and Q5_0 ones alone (q0matmul.c); none.
    for kinds in ("all", "q0", "none"):
        # Engine sets the swap (--cpu-kernels) and the K-quants' (on, with ggml's dot product).
        drawing = Engine(replace(config, cpu_kernels="ggml" if kinds == "none" else "loomserve"))
        assert drawing.cpu_matmul == "dot"
        assert drawing.cpu_kernels == ("ggml" if kinds == "none" else "loomserve")
        if kinds == "q0":
            lib.ls_q0_swap_kquants(0)
        try:
            collector = Collector()
            before = lib.ls_q0_swapped()
            run_staggered(TickLoop(drawing, config, collector), requests, seed=8)
            tokens[kinds], swapped[kinds] = collector.tokens(), lib.ls_q0_swapped() - before
        finally:
            drawing.close()
            lib.ls_q0_swap(1)
    # The K-quants' kernels run with AVX-512 VNNI; without it they are ggml's.
    kquants_swapped = swapped["all"] > swapped["q0"]
    assert kquants_swapped == bool(lib.ls_qk_matmul_supported())
    assert swapped["q0"] > 0 and swapped["none"] == 0
    assert tokens["all"] == tokens["q0"] == tokens["none"]
    assert all(len(tokens["all"][r.request_id]) == 12 for r in requests)


Q8_0 = 8  # ggml's number for the output matrix's type


def test_one_sequence_decodes_with_the_swapped_output_matrix_where_sooner(engine: Engine):
    """A decode of one sequence multiplies Gemma's Q8_0 output matrix by one row. Where the
    kernel is sooner there (AVX2 without AVX-512 VNNI: ls_q0_sooner), a request alone runs it
    in every pass and gets ggml's tokens, greedy and seeded; elsewhere nothing of one row is
    swapped."""
    native = graph_native()
    lib = native.kernels if native is not None else None
    if lib is None:
        pytest.skip("the swap cannot bind with this llama.cpp: ggml's matmuls run")
    config = replace(engine.config, backend_sampling="draw")
    tokens, swapped = {}, {}
    for kernels in ("loomserve", "ggml"):
        drawing = Engine(replace(config, cpu_kernels=kernels))
        try:
            before = lib.ls_q0_swapped()
            tokens[kernels] = [
                run_alone(drawing, config, Generate(f"r{i}", tokenize(drawing, text), params))
                for i, (text, params) in enumerate(
                    [
                        (PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0)),
                        (PROMPTS[2], SamplingParams(max_tokens=16, temperature=1.0, seed=4)),
                    ]
                )
            ]
            swapped[kernels] = lib.ls_q0_swapped() - before
        finally:
            drawing.close()
            lib.ls_q0_swap(1)
    assert tokens["loomserve"] == tokens["ggml"]
    assert [len(t) for t in tokens["ggml"]] == [16, 16]
    assert swapped["ggml"] == 0
    # Only the output matrix is Q8_0; passes of one row swap it where it is sooner.
    assert (swapped["loomserve"] > 0) == bool(lib.ls_q0_sooner(Q8_0, 1))


def test_the_default_model_streams_through_the_loop_in_order(engine: Engine):
    collector = Collector()
    loop = TickLoop(engine, engine.config, collector)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    loop.inbox.submit(b"gw", Generate("a", tokenize(engine, PROMPTS[0]), params))
    drain(loop)
    per_tick = [len(m.tokens) for m in collector.of_type(Outputs, b"gw") if m.tokens]
    assert per_tick == [1] * 6  # one token per tick, each in its own Outputs
    assert collector.finishes(b"gw")["a"].completion_tokens == 6


def test_a_quantized_kv_cache_with_flash_attention(model_path: Path):
    config = WorkerConfig(
        model_path=model_path,
        slots=2,
        ctx_size=128,
        threads=1,
        kv_cache_type="q8_0",
        flash_attn="on",
    )
    engine = Engine(config)
    try:
        tokens = run_together(engine, PROMPTS[:2], max_tokens=4)
        assert [len(t) for t in tokens.values()] == [4, 4]
    finally:
        engine.close()
