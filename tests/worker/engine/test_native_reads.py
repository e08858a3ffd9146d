"""Every read of llama.cpp's memory stays inside what llama.cpp wrote (issue 54): the logits of
the last decode (llama_get_logits: one row per output of that decode), at their boundaries.
The embeddings' boundary (a reranker's n_cls_out floats) is held in tests/e2e/test_embeddings.py."""

from __future__ import annotations

import llama_cpp as llama
import numpy as np
import pytest

from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine

PROMPT = [1, 40, 41, 42, 43]


@pytest.fixture
def engine(tiny_model_path):
    engine = Engine(WorkerConfig(model_path=tiny_model_path, slots=2, ctx_size=64, threads=1))
    yield engine
    engine.close()


def row_of(engine: Engine, index: int) -> np.ndarray:
    """llama.cpp's own row for the batch's token `index` (llama_get_logits_ith)."""
    pointer = llama.llama_get_logits_ith(engine.ctx, index)
    return np.ctypeslib.as_array(pointer, shape=(engine.n_vocab,)).copy()


def test_before_any_decode_no_row_is_read(engine: Engine) -> None:
    assert engine.output_logits(0).shape == (0, engine.n_vocab)
    with pytest.raises(ValueError, match="the last decode made 0"):
        engine.output_logits(1)


def test_a_pass_with_more_outputs_than_sequences_reads_each_row_to_the_last(engine: Engine):
    """A prompt scored (an output a token) beside a decode: 6 outputs for 2 sequences; the
    last row is llama.cpp's last, and a seventh row is refused, not read."""
    batch = engine.batch
    batch.clear()
    batch.add_run(PROMPT, 0, 0, True)
    batch.logits[: len(PROMPT)] = 1  # every prompt token scored
    batch.add_run([7], 0, 1, True)
    assert engine.decode(batch) == 0
    logits = engine.output_logits(6)
    assert logits.shape == (6, engine.n_vocab) and np.isfinite(logits).all()
    assert np.array_equal(logits[0], row_of(engine, 0))
    assert np.array_equal(logits[-1], row_of(engine, 5))
    with pytest.raises(ValueError, match="the last decode made 6"):
        engine.output_logits(7)


def test_a_pass_with_no_outputs_reads_nothing(engine: Engine) -> None:
    batch = engine.batch
    batch.clear()
    batch.add_run(PROMPT, 0, 0, False)  # a prompt chunk: no logits asked
    assert engine.decode(batch) == 0
    assert engine.output_logits(0).shape == (0, engine.n_vocab)
    with pytest.raises(ValueError):
        engine.output_logits(1)


def test_a_failed_decode_leaves_no_rows_to_read(engine: Engine) -> None:
    batch = engine.batch
    batch.clear()
    batch.add_run([1, 2], 0, 0, True)
    assert engine.decode(batch) == 0 and engine.output_logits(1).shape[0] == 1
    batch.clear()
    batch.add_run([engine.n_vocab + 5], 2, 0, True)  # an id past the vocabulary: refused
    assert engine.decode(batch) != 0
    with pytest.raises(ValueError, match="the last decode made 0"):
        engine.output_logits(1)
