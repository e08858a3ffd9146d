"""The fence around the worker's native hooks into llama.cpp's graph (native_fence.py,
abiprobe.c): the probe finds each field and operation number where ggml put them, any
declaration that differs from what it finds is named, and a refused install serves every
request on the host sampler and ggml's own matmuls, with the same tokens."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest

from loomserve.worker.engine import kernels, native_fence
from loomserve.worker.engine.engine import Engine, EngineError
from loomserve.worker.engine.kernels import graph_native
from loomserve.worker.sampling import rowscan
from loomserve.worker.sampling.samplers import HostSampler
from tests.worker.sampling.test_backend_sampling import graph_config
from tests.worker.sampling.test_graph_draw import mixed_requests, run


def declared() -> dict[str, int]:
    values = (ctypes.c_int64 * len(native_fence.FACTS))()
    assert kernels.library().ls_abi_declared(values) == len(native_fence.FACTS)
    return dict(zip(native_fence.FACTS, values, strict=True))


def test_the_probe_finds_every_fact_where_the_c_code_declares_it():
    """On the pinned llama.cpp every field, length and number is found, and is the one
    ggml_abi.h declares (a llama.cpp that moved one fails here)."""
    lib = kernels.library()
    found = (ctypes.c_int64 * len(native_fence.FACTS))()
    base = native_fence.ggml_library("libggml-base.so")
    assert lib.ls_abi_probe(str(base).encode(), found) == len(native_fence.FACTS)
    facts = dict(zip(native_fence.FACTS, found, strict=True))
    assert all(value >= 0 for value in facts.values()), facts
    assert facts == declared()
    assert native_fence.layout_differences(lib) == []


@pytest.mark.parametrize("fact", native_fence.FACTS)
def test_a_declaration_that_differs_from_ggml_is_named(fact):
    """What the probe finds does not come from the declaration: each fact declared wrong is
    caught, and only that one."""
    wrong = declared()
    wrong[fact] += 4
    differences = native_fence.layout_differences(kernels.library(), wrong)
    assert len(differences) == 1 and differences[0].startswith(f"{fact} (ggml: ")


def test_a_sampler_interface_of_another_shape_is_named(monkeypatch):
    assert native_fence.interface_differences() == []
    # llama-cpp-python 0.3.30's: backend_init without n_outputs_max_per_seq, and no
    # backend_reset or copy_state.
    monkeypatch.setattr(
        native_fence,
        "SAMPLER_INTERFACE",
        (
            *native_fence.SAMPLER_INTERFACE[:6],
            ("backend_init", 2),
            *native_fence.SAMPLER_INTERFACE[7:10],
        ),
    )
    assert native_fence.interface_differences()[0].startswith("llama_sampler_i ")
    verdict = native_fence.judge(kernels.library())
    assert not verdict.allowed and "llama_sampler_i" in verdict.reason


def test_only_a_verified_install_is_allowed():
    lib = kernels.library()
    package, ggml = native_fence.installed_versions()
    assert native_fence.judge(lib, frozenset({(package, ggml)})).allowed
    refused = native_fence.judge(lib, frozenset({("0.3.99", ggml)}))
    assert not refused.allowed
    assert refused.install == f"llama-cpp-python {package}, ggml {ggml}"
    assert "not a verified install (verified: 0.3.99" in refused.reason
    # The pinned install (requirements/test.txt) is the verified one.
    assert native_fence.verdict(lib).allowed


@pytest.fixture
def refused_install(monkeypatch):
    """The probe (or the version) refuses: as on a llama.cpp whose layout differs."""
    refusal = native_fence.Verdict(False, "llama-cpp-python 0.3.30, ggml 0.15.1", "for a test")
    monkeypatch.setattr(native_fence, "verdict", lambda lib: refusal)
    graph_native.cache_clear()
    yield
    monkeypatch.undo()
    graph_native.cache_clear()


def test_a_refused_install_serves_the_same_tokens_on_the_host(
    tiny_model_path, refused_install, monkeypatch
):
    """Nothing drawn in a graph, no matmul swapped, every request's tokens as the host
    sampler gives them on the install that may draw."""
    lib, kernel_lib = rowscan.library(), kernels.library()
    config = replace(graph_config(tiny_model_path, "auto"), threads=2)
    drawn_before, swapped_before = lib.ls_graph_rows_drawn(), kernel_lib.ls_q0_swapped()
    requests = mixed_requests()
    tokens, samplers, prepared = run(config, requests)
    assert prepared == 0
    assert not any(isinstance(s, HostSampler) and s.graph_draw for s in samplers)
    assert lib.ls_graph_rows_drawn() == drawn_before
    assert kernel_lib.ls_q0_swapped() == swapped_before
    assert all(len(tokens[r.request_id]) == 24 for r in requests)
    engine = Engine(config)
    try:
        assert engine.sampling == "host" and engine.cpu_kernels == "ggml"
    finally:
        engine.close()
    with pytest.raises(EngineError, match="verified"):
        Engine(replace(config, backend_sampling="draw"))
    # The same tokens as where the draw runs in the graph (the fence lifted).
    graph_native.cache_clear()
    monkeypatch.setattr(native_fence, "verdict", native_fence.judge)
    assert graph_native() is not None
    in_graph, _, prepared = run(config, requests)
    assert prepared > 0 and in_graph == tokens
