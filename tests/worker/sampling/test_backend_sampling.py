"""Backend sampling (worker/sampling/backend_sampling.py) on the real llama.cpp and the tiny
model: the graph's draws follow the distribution, its greedy is the host's argmax, seeded
requests repeat however they are batched or preempted, and the requests it cannot serve take
the host path in the same pass."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import llama_cpp as llama
import numpy as np
import pytest

from loomserve.protocol import FinishReason, Generate, Outputs, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine, ModelDescription
from loomserve.worker.sampling.backend_sampling import BackendSampler
from loomserve.worker.sampling.draw import Truncation
from loomserve.worker.sampling.samplers import HostSampler
from loomserve.worker.sched.slots import Run
from tests.worker.engine.test_engine import (
    GW,
    drain,
    new_loop,
    random_requests,
    run_alone,
    run_staggered,
)
from tests.worker.sampling.test_draw import _chi_square_p, _expected
from tests.worker.sched import test_preemption

PROMPT = [1, 40, 41, 42, 43]


def graph_config(model_path: Path, backend_sampling: str = "on") -> WorkerConfig:
    """Eight slots, passes of 32 tokens, prompts in chunks of 7: prompts' chunks share
    passes with other slots' sampled rows."""
    return WorkerConfig(
        model_path=model_path,
        slots=8,
        ctx_size=256,
        max_queue=64,
        batch_tokens=32,
        prefill_chunk=7,
        threads=1,
        backend_sampling=backend_sampling,
    )


@pytest.fixture
def config(tiny_model_path) -> WorkerConfig:
    return graph_config(tiny_model_path)


@pytest.fixture
def engine(config: WorkerConfig):
    engine = Engine(config)
    yield engine
    engine.close()


def sampled(request_id: str, seed: int | None, **fields) -> Generate:
    fields.setdefault("temperature", 1.0)
    params = SamplingParams(max_tokens=24, ignore_eos=True, seed=seed, **fields)
    return Generate(request_id, PROMPT, params)


def test_auto_draws_inside_llama_decode_on_a_cpu_unless_slots_draft(tiny_model_path):
    """auto on a CPU: the C draw inside llama_decode (graph_draw.py), the host sampler's
    tokens without llama.cpp's copy of the logits; with drafting, whose verification samples
    on the host, the host sampler."""
    config = WorkerConfig(model_path=tiny_model_path, slots=2, ctx_size=64, threads=1)
    for spec_ngram, place, in_graph in ((None, "draw", True), (True, "host", False)):
        engine = Engine(replace(config, spec_ngram=spec_ngram))
        try:
            assert engine.sampling == place
            sampler = engine.new_sampler(SamplingParams(temperature=1.0))
            assert isinstance(sampler, HostSampler) and sampler.graph_draw == in_graph
        finally:
            engine.close()


@pytest.mark.parametrize(
    ("mode", "gpu_layers", "expected"),
    [
        ("auto", 0, "draw"),  # on a CPU: the C draw inside llama_decode
        ("auto", 3, "draw"),  # part of the model offloaded: the output stays on the CPU
        ("auto", 5, "host"),  # every layer and the output (n_layers + 1): the host's C draw,
        # faster than llama.cpp's chains in the graph
        ("on", 0, "graph"),
        ("off", 5, "host"),
        ("draw", 0, "draw"),  # the C draw in the graph (graph_draw.py)
    ],
)
def test_auto_samples_in_the_graph_only_where_the_graph_is_the_faster(
    tiny_model_path, mode, gpu_layers, expected
):
    model = ModelDescription("m", "llama", "", 0, 0, 4, 300, 256, gpu_layers)
    config = WorkerConfig(model_path=tiny_model_path, backend_sampling=mode)
    assert Engine._sampling_place(config, model) == expected


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"temperature": 0.0}, BackendSampler),
        ({"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05}, BackendSampler),
        ({"temperature": 0.7, "top_p": 0.95}, HostSampler),  # the graph would sort the vocab
        ({"temperature": 0.7, "top_k": 100_000, "top_p": 0.95}, HostSampler),  # k > n_vocab
        ({"temperature": 1.0, "logprobs": 2}, HostSampler),
        ({"temperature": 1.0, "prompt_logprobs": 0}, HostSampler),
        ({"temperature": 1.0, "logit_bias": {5: 3.0}}, HostSampler),
        ({"temperature": 1.0, "frequency_penalty": 0.5}, HostSampler),
        ({"temperature": 1.0, "grammar": 'start: "a"'}, HostSampler),
    ],
)
def test_each_request_takes_the_path_that_samples_it_exactly(engine, fields, path):
    sampler = engine.new_sampler(SamplingParams(**fields))
    try:
        assert type(sampler) is path
    finally:
        sampler.close()


def test_greedy_in_the_graph_is_the_host_argmax_alone_and_batched(engine, config):
    requests = random_requests(12, engine.n_vocab, seed=5)
    host_config = replace(config, backend_sampling="off")
    host_engine = Engine(host_config)
    try:
        on_host = {r.request_id: run_alone(host_engine, host_config, r) for r in requests}
    finally:
        host_engine.close()
    loop, collector = new_loop(engine, config)
    run_staggered(loop, requests, seed=2)
    assert collector.tokens() == {rid: tokens for rid, tokens in on_host.items() if tokens}
    # Every token came from the graph (an end-of-generation one is read, not sent).
    sent = sum(len(tokens) for tokens in on_host.values())
    assert sent <= engine.graph_chains.tokens_read <= sent + len(requests)


def test_seeded_requests_repeat_alone_batched_and_after_a_restart(engine, config):
    fields = {"temperature": 0.9, "top_k": 30, "top_p": 0.95, "min_p": 0.02}
    alone = run_alone(engine, config, sampled("x", 1234, **fields))
    assert len(alone) == 24
    loop, collector = new_loop(engine, config)
    requests = [sampled("again", 1234, **fields), sampled("other", 99, **fields)]
    # Host-path requests in the same passes: their rows' logits are copied, theirs are not.
    requests += [sampled(f"logprobs{i}", i, logprobs=1) for i in range(2)]
    requests += [sampled("penalty", 5, presence_penalty=1.0)]
    requests += [sampled(f"greedy{i}", None, temperature=0.0) for i in range(3)]
    run_staggered(loop, requests, seed=4)
    tokens = collector.tokens()
    # The graph drew "x" (alone), "again", "other" and the three greedy requests' tokens;
    # not those of the logprobs and penalty requests.
    assert engine.graph_chains.tokens_read == 24 * 6
    assert tokens["again"] == alone
    assert tokens["other"] != alone
    assert all(len(tokens[r.request_id]) == 24 for r in requests)
    restarted = Engine(config)
    try:
        assert run_alone(restarted, config, sampled("x", 1234, **fields)) == alone
    finally:
        restarted.close()


def test_grammar_and_logprobs_requests_share_the_pass_on_the_host(engine, config):
    loop, collector = new_loop(engine, config)
    grammar = 'start: "ab" /[a-c]*/'
    loop.inbox.submit(GW, sampled("grammar", 3, grammar=grammar))
    loop.inbox.submit(GW, sampled("logprobs", 3, logprobs=2))
    for i in range(4):
        loop.inbox.submit(GW, sampled(f"graph{i}", i))
    drain(loop)
    finishes = collector.finishes()
    assert {f.reason for f in finishes.values()} <= {FinishReason.LENGTH, FinishReason.STOP}
    assert len(finishes) == 6
    chunks = [
        chunk
        for outputs in collector.of_type(Outputs)
        for chunk in outputs.tokens
        if chunk.request_id == "logprobs"
    ]
    assert sum(len(chunk.logprobs or []) for chunk in chunks) == 24


@pytest.mark.parametrize(
    "mode",
    [
        "on",  # llama.cpp's chain: the request continues on a clone
        "draw",  # the C draw (graph_draw.py): its host sampler's generator goes on
    ],
)
def test_a_preempted_request_resumes_its_draws(tiny_model_path, mode):
    config = test_preemption.preemption_config(tiny_model_path, backend_sampling=mode)
    engine = Engine(config)
    try:
        seeded = [
            test_preemption.low(0, temperature=0.9, seed=7),
            test_preemption.low(1, temperature=1.1, seed=8, top_k=40, top_p=0.9),
        ]
        expected, _ = test_preemption.run(engine, config, seeded, urgent_after=None)
        got, loop = test_preemption.run(engine, config, seeded, urgent_after=15)
        assert loop.scheduler.preemptions == 2
        assert got["low0"] == expected["low0"] and got["low1"] == expected["low1"]
        assert len(got["low0"]) == 30
    finally:
        engine.close()


# --- the graph's draws against the distribution --------------------------------------------


def draws(engine: Engine, params: SamplingParams, n_draws: int) -> tuple[np.ndarray, np.ndarray]:
    """(the logits after PROMPT, n_draws tokens the graph drew from them): every sequence
    holds the prompt but its last token, which each pass evaluates again. llama.cpp's chains
    (`on`) stay attached; the C draw's samplers (`draw`) are bound before each pass, as the
    tick loop binds them."""
    n_seq = engine.n_slots
    batch = engine.batch
    batch.clear()
    batch.add_run(PROMPT, 0, 0, logits_on_last=True)
    assert engine.decode(batch) == 0
    logits = np.array(engine.output_logits(1)[0], dtype=np.float64)
    engine.clear_cache()
    batch.clear()
    for seq in range(n_seq):
        batch.add_run(PROMPT[:-1], 0, seq, logits_on_last=False)
    assert engine.decode(batch) == 0
    samplers = [engine.new_sampler(replace(params, seed=seq)) for seq in range(n_seq)]
    runs = [
        Run(
            SimpleNamespace(index=seq, occupant=SimpleNamespace(chain=sampler)),
            PROMPT[-1:],
            0,
            True,
        )
        for seq, sampler in enumerate(samplers)
    ]
    try:
        for seq, sampler in enumerate(samplers):
            if isinstance(sampler, BackendSampler):
                assert sampler.attach(seq)
            else:
                assert isinstance(sampler, HostSampler) and sampler.graph_draw
        drawn: list[int] = []
        while len(drawn) < n_draws:
            engine.bind_graph_samplers(runs)  # type: ignore[arg-type]
            batch.clear()
            indices = [batch.add_run(PROMPT[-1:], len(PROMPT) - 1, s, True) for s in range(n_seq)]
            assert engine.decode(batch) == 0
            drawn += [s.sample(i, logits) for s, i in zip(samplers, indices, strict=True)]
            for seq in range(n_seq):
                llama.llama_memory_seq_rm(engine.memory, seq, len(PROMPT) - 1, -1)
    finally:
        for sampler in samplers:
            sampler.close()
    engine.clear_cache()
    return logits, np.array(drawn[:n_draws])


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1.0},
        {"temperature": 0.6},
        {"temperature": 1.0, "top_k": 12},
        {"temperature": 1.5, "top_k": 200, "top_p": 0.99},
        {"temperature": 2.0, "min_p": 0.01},
    ],
    ids=["T1", "T0.6", "top_k", "top_p", "min_p"],
)
@pytest.mark.parametrize(
    "mode",
    [
        "on",  # llama.cpp's chains
        "draw",  # the C draw, the default on a CPU
    ],
)
def test_the_graph_draws_from_the_requested_distribution(tiny_model_path, fields, mode):
    n_draws = 100_000 if fields == {"temperature": 1.0} else 20_000
    config = WorkerConfig(
        model_path=tiny_model_path,
        slots=64,
        ctx_size=16,
        batch_tokens=512,
        threads=1,
        backend_sampling=mode,
    )
    engine = Engine(config)
    try:
        params = SamplingParams(max_tokens=1, **fields)
        logits, drawn = draws(engine, params, n_draws)
        if mode == "draw":  # every draw was handed to the graph
            assert engine.graph_draws is not None and engine.graph_draws.prepared >= n_draws
    finally:
        engine.close()
    cut = Truncation(params.temperature, params.top_k, params.top_p, params.min_p)
    expected = _expected(logits.astype(np.float32), cut)
    counts = np.bincount(drawn, minlength=len(logits))
    assert not counts[expected == 0].any(), "a token the filters drop was drawn"
    assert counts[expected > 1 / 2_000].all()  # every kept token with a fair share shows up
    assert _chi_square_p(counts, expected * n_draws) > 1e-3
