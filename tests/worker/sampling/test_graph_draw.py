"""The C draw inside llama_decode (worker/sampling/graph_draw.py, graphdraw.c) on the real
llama.cpp and the tiny model: every request gets the tokens the host path gives it, seeded
or greedy, beside host-sampled requests and after a restart (across preemption:
test_backend_sampling.py), on any instruction set; the engine refuses the mode where it
cannot run."""

from __future__ import annotations

import shutil
from dataclasses import replace

import gguf
import numpy as np
import pytest

from loomserve.protocol import Generate, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine, EngineError, ModelDescription
from loomserve.worker.sampling import rowscan
from loomserve.worker.sampling.graph_draw import graph_draw_library
from loomserve.worker.sampling.samplers import HostSampler
from tests.tiny_model import ModelShape, write_tiny_model
from tests.worker.engine.test_engine import GW, drain, new_loop, run_staggered
from tests.worker.sampling.test_backend_sampling import graph_config

PROMPT = [1, 40, 41, 42, 43]
# Every mix the C draw serves, and the host-path requests that share its passes.
DRAWN = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.95},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 1.2, "top_k": 50},
]
ON_HOST = [
    {"temperature": 1.0, "logprobs": 2},
    {"temperature": 1.0, "presence_penalty": 0.5},
    {"temperature": 0.0, "logit_bias": {7: 5.0}},
    {"temperature": 0.9, "grammar": 'start: "ab" /[a-c]*/'},
    {"temperature": 1.0, "prompt_logprobs": 1},  # its prompt scored: a pass of many outputs
]


def graph_drawn(sampler: object) -> bool:
    """Whether the request's sampler is one graphdraw.c draws for."""
    return isinstance(sampler, HostSampler) and sampler.graph_draw


def test_the_draw_binds_on_any_cpu():
    """ggml's calls are found and its tensor is laid out as graphdraw.c declares it, for the
    llama.cpp this project pins: a llama.cpp that moved them fails here, not in a skip."""
    assert graph_draw_library() is not None


@pytest.fixture
def config(tiny_model_path) -> WorkerConfig:
    # Two threads: the draw's threads share each row's scan.
    return replace(graph_config(tiny_model_path, "draw"), threads=2)


def request(request_id: str, seed: int | None, prompt=PROMPT, **fields) -> Generate:
    params = SamplingParams(max_tokens=24, ignore_eos=True, seed=seed, **fields)
    return Generate(request_id, prompt, params)


def mixed_requests() -> list[Generate]:
    drawn = [request(f"drawn{i}", 100 + i, **f) for i, f in enumerate(DRAWN * 2)]
    host = [request(f"host{i}", 200 + i, **f) for i, f in enumerate(ON_HOST)]
    longer = [request("long", 7, prompt=PROMPT * 9, temperature=1.0)]  # chunked prefill
    return drawn[:6] + host[:2] + drawn[6:] + host[2:] + longer


def run(config: WorkerConfig, requests: list[Generate], seed: int = 3):
    engine = Engine(config)
    samplers: list = []
    build = engine.new_sampler

    def keep(params, grammar=None):
        sampler = build(params, grammar)
        samplers.append(sampler)
        return sampler

    engine.new_sampler = keep  # type: ignore[method-assign]
    try:
        loop, collector = new_loop(engine, config)
        run_staggered(loop, requests, seed=seed)
        prepared = engine.graph_draws.prepared if engine.graph_draws is not None else 0
        return collector.tokens(), samplers, prepared
    finally:
        engine.close()


def test_drawn_requests_get_the_host_paths_tokens_beside_host_sampled_ones(config):
    requests = mixed_requests()
    on_host, _, _ = run(replace(config, backend_sampling="off"), requests)
    drawn, samplers, prepared = run(config, requests)
    assert drawn == on_host
    assert all(len(drawn[r.request_id]) == 24 for r in requests)
    # Which path each took, and that the graph drew every token of the drawn ones.
    in_graph = [s for s in samplers if graph_drawn(s)]
    assert len(in_graph) == 13  # the 12 drawn and the long prompt
    assert sum(not graph_drawn(s) for s in samplers) == 5  # the grammar's among them
    # The graph drew all but the drawn rows of the passes that scored a prompt.
    assert 12 * 24 < prepared < 13 * 24


def test_samplers_of_idle_sequences_draw_nothing(config):
    """llama.cpp builds every attached sampler into every pass, one whose sequence has no
    output there on the pass's first row, but computes only the others
    (ggml_build_forward_select): a request alone among attached samplers costs one draw a
    token, not one for each sequence. Samplers stay on their sequences on that count."""
    lib = graph_draw_library()
    engine = Engine(config)
    try:
        loop, collector = new_loop(engine, config)
        for i in range(config.slots):  # a sampler on every sequence
            loop.inbox.submit(GW, request(f"w{i}", i, temperature=1.0))
        drain(loop)
        assert engine.graph_draws is not None and engine.graph_draws.attached == config.slots
        before = lib.ls_graph_rows_drawn()
        loop.inbox.submit(GW, request("alone", 5, temperature=0.7, top_p=0.95))
        drain(loop)
        drawn = lib.ls_graph_rows_drawn() - before
    finally:
        engine.close()
    assert len(collector.tokens()["alone"]) == 24
    # Its first token comes from the pass that ends its prompt; each later one from a pass
    # of its own.
    assert drawn == 24


@pytest.fixture(scope="module")
def wide_model_path(tmp_path_factory):
    """The tiny model with 40,000 more pieces: rows of 158 blocks, which a top-p alone's scan
    cuts in three parts (rowscan.c's SCAN_PART_BLOCKS) for the draw's threads to share."""
    path = tmp_path_factory.mktemp("wide") / "tiny-wide.gguf"
    return write_tiny_model(path, shape=ModelShape(extra_vocab=40_000))


def test_a_top_p_alone_scanned_in_parts_on_two_threads_draws_the_host_paths_tokens(
    wide_model_path,
):
    """A top-p alone's row is scanned and summed in parts shared by llama.cpp's threads, and
    the parts folded as the host's one pass folds them: the same tokens as the host path."""
    config = replace(graph_config(wide_model_path, "draw"), threads=2)
    assert rowscan.library().ls_scan_parts(40_000) == 3
    cuts = [{"top_p": 0.95}, {"top_p": 0.5}, {"top_p": 0.99, "min_p": 0.01}, {"top_p": 0.8}]
    requests = [request(f"p{i}", 300 + i, temperature=0.9, **cut) for i, cut in enumerate(cuts * 2)]
    on_host, _, _ = run(replace(config, backend_sampling="off"), requests)
    drawn, _, prepared = run(config, requests)
    assert drawn == on_host
    assert prepared == 8 * 24
    assert len({tuple(tokens) for tokens in drawn.values()}) == 8


# Settings at the ends of what the gateway accepts (temperature up to 100, top_p above 0):
# a temperature that scales the logits to infinities, cuts that keep one token or all.
EXTREMES = [
    {"temperature": 1e-30},
    {"temperature": 1e-3, "top_p": 0.999999},
    {"temperature": 100.0},
    {"temperature": 100.0, "min_p": 1.0},
    {"temperature": 7.0, "top_p": 1e-9},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.0, "top_k": 2**31 - 1, "min_p": 0.999},
    {"temperature": 1e-8, "top_k": 3, "top_p": 0.5, "min_p": 0.3},
]


def test_settings_at_their_extremes_draw_the_host_paths_tokens(config):
    requests = [request(f"x{i}", 60 + i, **fields) for i, fields in enumerate(EXTREMES)]
    on_host, _, _ = run(replace(config, backend_sampling="off"), requests)
    drawn, samplers, prepared = run(config, requests)
    assert drawn == on_host
    assert all(len(tokens) == 24 for tokens in drawn.values())
    assert all(graph_drawn(s) for s in samplers)
    assert prepared == len(EXTREMES) * 24


def test_seeded_requests_repeat_after_a_restart(config):
    """(Alone against batched needs batch-invariant logits, which the tiny model's float
    weights do not give: test_default_model.py checks that on Gemma.)"""
    fields = {"temperature": 0.9, "top_k": 30, "top_p": 0.95, "min_p": 0.02}
    crowd = [request("x", 1234, **fields), *mixed_requests()]
    first, _, _ = run(config, crowd, seed=9)
    again, _, _ = run(config, crowd, seed=9)
    assert again == first
    assert len(first["x"]) == 24 and first["drawn1"] != first["x"]


@pytest.mark.parametrize("level", [1, 0], ids=["AVX2", "plain C"])
def test_without_avx512_the_graph_draws_every_row_as_the_host_does(config, level):
    """Without AVX-512 the scan does not sum a top-p alone's row, so one thread draws it
    whole (ls_draw), summing a flat row by AVX2's kernel or plain C's: every row is drawn in
    the graph (none is left to the host), the host path's tokens. (On a CPU with less than
    `level`, the library runs at what it has: the same tokens all the same.)"""
    requests = [request(f"p{i}", i, temperature=1.0, top_p=0.5) for i in range(6)]
    library = rowscan.library()
    library.ls_limit_isa(level)
    try:
        on_host, _, _ = run(replace(config, backend_sampling="off"), requests)
        drawn, samplers, prepared = run(config, requests)
    finally:
        library.ls_limit_isa(2)
    assert drawn == on_host
    assert all(graph_drawn(s) for s in samplers)
    assert prepared == 6 * 24


@pytest.fixture(scope="module")
def nan_model_path(tmp_path_factory, tiny_model_path):
    """The tiny model with the output layer's rows for tokens 45 and 47 made NaN: every row of
    logits it gives holds those two NaNs (a broken forward pass, in miniature)."""
    path = tmp_path_factory.mktemp("nan") / "tiny-nan.gguf"
    shutil.copyfile(tiny_model_path, path)
    reader = gguf.GGUFReader(path, "r+")
    (output,) = [tensor for tensor in reader.tensors if tensor.name == "output.weight"]
    output.data[[45, 47]] = np.nan
    reader.data.flush()
    return path


def test_rows_with_a_nan_are_drawn_in_the_graph_as_on_the_host(nan_model_path):
    """A row with a NaN gives its first NaN (numpy's argmax) for every mix, greedy or
    sampled: in the graph (graphdraw.c's own NaN branch, and ls_draw's for a top-p alone
    without AVX-512) as on the host, and no row leaves the graph."""
    config = replace(graph_config(nan_model_path, "draw"), threads=2)
    requests = [request(f"d{i}", 50 + i, **fields) for i, fields in enumerate(DRAWN)]
    on_host, _, _ = run(replace(config, backend_sampling="off"), requests)
    drawn, samplers, prepared = run(config, requests)
    assert drawn == on_host
    assert all(tokens == [45] * 24 for tokens in drawn.values())
    assert all(graph_drawn(s) for s in samplers)
    assert prepared == len(DRAWN) * 24


def test_the_engine_refuses_the_draw_where_the_logits_are_on_a_gpu(tiny_model_path):
    model = ModelDescription("m", "llama", "", 0, 0, 4, 300, 256, gpu_layers=5)
    config = WorkerConfig(model_path=tiny_model_path, backend_sampling="draw")
    with pytest.raises(EngineError, match="output layer runs on a GPU"):
        Engine._sampling_place(config, model)


def start_drawn(loop, n: int, ticks: int) -> None:
    """n drawn requests (temperature 1, seeded d0, d1, ...), run for a few ticks."""
    for i in range(n):
        loop.inbox.submit(GW, request(f"d{i}", i, temperature=1.0))
    for _ in range(ticks):
        loop.tick(block=False)


def cancel_then_host_sample(config: WorkerConfig) -> dict[str, list[int]]:
    engine = Engine(config)
    try:
        loop, collector = new_loop(engine, config)
        start_drawn(loop, 8, ticks=6)
        loop.scheduler.cancel((GW, "d0"))
        drain(loop)
        for i in range(8):
            loop.inbox.submit(GW, request(f"h{i}", i, temperature=1.0, logprobs=1))
        drain(loop)
        return collector.tokens()
    finally:
        engine.close()


def test_requests_end_cleanly_and_free_their_sequences(config):
    """A cancelled drawn request and finished ones leave nothing behind: host-sampled
    requests in the same slots after them get the host path's tokens (their sampler is off
    the sequence, so llama.cpp copies their logits again), and the engine closes with
    samplers still attached."""
    tokens = cancel_then_host_sample(config)
    assert tokens == cancel_then_host_sample(replace(config, backend_sampling="off"))
    assert all(len(tokens[f"h{i}"]) == 24 for i in range(8))
    assert all(len(tokens[f"d{i}"]) == 24 for i in range(1, 8))
    assert len(tokens.get("d0", [])) < 24


def test_a_pass_of_many_outputs_runs_with_no_sampler_attached(config):
    """A prompt scored for logprobs asks for a row per prompt token: with a sampler attached
    anywhere, llama.cpp would keep three more vocabulary-sized arrays for each."""
    engine = Engine(config)
    seen: list[tuple[int, int]] = []  # (outputs, samplers attached) of each pass
    decode = engine.decode

    def counted(batch):
        seen.append((int(batch.logits[: batch.n_tokens].sum()), engine.graph_draws.attached))
        return decode(batch)

    engine.decode = counted  # type: ignore[method-assign]
    try:
        loop, collector = new_loop(engine, config)
        start_drawn(loop, 3, ticks=4)
        loop.inbox.submit(GW, request("scored", 9, prompt=PROMPT * 4, prompt_logprobs=1))
        drain(loop)
    finally:
        engine.close()
    assert all(len(tokens) == 24 for tokens in collector.tokens().values())
    many = [attached for outputs, attached in seen if outputs > config.slots]
    assert many and not any(many)
    assert any(attached for outputs, attached in seen if outputs <= config.slots)


def test_a_pass_whose_tokens_were_all_drawn_reads_no_logits(config):
    """Where the graph drew every token of a pass, the loop reads the tokens and no row of
    logits (a view of them cost a tenth of the loop's time around a pass); a pass with a
    host-sampled request reads its rows, and the drawn tokens are the host path's."""
    engine = Engine(config)
    rows_read: list[int] = []
    output_logits = engine.output_logits

    def counted(n_outputs: int):
        rows_read.append(n_outputs)
        return output_logits(n_outputs)

    engine.output_logits = counted  # type: ignore[method-assign]
    requests = [request("drawn", 4, temperature=1.0), request("greedy", None, temperature=0.0)]
    try:
        loop, collector = new_loop(engine, config)
        for generate in requests:
            loop.inbox.submit(GW, generate)
        drain(loop)
        drawn_only = list(rows_read)
        loop.inbox.submit(GW, request("host", 5, temperature=1.0, logprobs=1))
        drain(loop)
    finally:
        engine.close()
    assert drawn_only and not any(drawn_only)
    assert any(rows_read[len(drawn_only) :])
    on_host, _, _ = run(replace(config, backend_sampling="off"), requests)
    assert {name: collector.tokens()[name] for name in on_host} == on_host
