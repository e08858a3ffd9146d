"""Tokens written as embedding rows (worker/engine/token_rows.py): exactly llama.cpp's own,
or not used; and a pass that carries an image's rows beside tokens (engine/batch.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.batch import TokenBatch, embed_rows, fill_batch, holds_image_rows
from loomserve.worker.engine.engine import Engine
from loomserve.worker.engine.token_rows import TokenRows
from loomserve.worker.sched.media import MediaSpan, placeholders
from loomserve.worker.sched.slots import Run, Slot, Step
from loomserve.worker.sched.strategies import BatchPlan

from .test_images import vision_config


def test_a_worker_with_a_projector_writes_tokens_as_exact_rows(
    tiny_model_path: Path, tiny_mmproj_path: Path
) -> None:
    engine = Engine(vision_config(tiny_model_path, tiny_mmproj_path))
    try:
        rows = engine.token_rows
        assert rows is not None and rows.n_embd == 64
        assert engine.embeds_exactly(rows)  # what start-up checked, again
        # Rows that are not the graph's: another scale, or another token's row.
        wrong_scale = TokenRows(rows._table, rows.n_embd, rows._to_float, 2.0)
        assert not engine.embeds_exactly(wrong_scale)
        shifted = TokenRows(np.roll(np.asarray(rows._table), 1, axis=0), 64, rows._to_float, 1.0)
        assert not engine.embeds_exactly(shifted)
    finally:
        engine.close()


def test_a_worker_without_a_projector_reads_no_rows(tiny_model_path: Path) -> None:
    config = WorkerConfig(model_path=tiny_model_path, slots=2, ctx_size=128, threads=1)
    engine = Engine(config)
    try:
        assert engine.token_rows is None and engine.batch.embd is None
    finally:
        engine.close()


@pytest.mark.default_model
def test_gemma_3_token_rows_carry_its_input_scale(tiny_mmproj_path: Path) -> None:
    """Gemma scales token input by sqrt(n_embd) in its graph, embeddings by 1: its rows
    carry the scale, and without it they are not exact."""
    from loomserve.cli.default_model import default_model_path

    config = replace(
        vision_config(default_model_path(), tiny_mmproj_path), ctx_size=128, batch_tokens=16
    )
    engine = Engine(replace(config, mmproj=None))
    try:
        rows = TokenRows.load(config.model_path, engine.model, engine.description.architecture)
        assert rows is not None and rows._scale == np.float32(np.sqrt(np.float32(640)))
        engine.batch.carry_embeddings(rows.n_embd)
        assert engine.embeds_exactly(rows)
        assert not engine.embeds_exactly(TokenRows(rows._table, 640, rows._to_float, 1.0))
    finally:
        engine.close()


class Rows:
    """Token rows for the fill's unit test: token t's row is all t."""

    def rows(self, tokens: np.ndarray) -> np.ndarray:
        return np.repeat(tokens.astype(np.float32)[:, None], 4, axis=1)


def request_with(media: tuple[MediaSpan, ...]) -> SimpleNamespace:
    return SimpleNamespace(media=media)  # the fill reads a slot's request for its images only


def test_the_fill_puts_each_row_where_its_run_put_its_position() -> None:
    image = np.arange(5 * 4, dtype=np.float32).reshape(5, 4) + 1000
    span = MediaSpan(2, image, "h", in_token_pass=True)
    prompt = [7, 8, *placeholders("h", 5), 9]
    reader = Slot(0, request=request_with((span,)), tokens=prompt)  # type: ignore[arg-type]
    other = Slot(1, request=request_with(()))  # type: ignore[arg-type]
    step = Step(BatchPlan())
    step.runs = [Run(other, [42], 10, True), Run(reader, prompt[1:5], 1, False)]
    batch = TokenBatch(8)
    batch.carry_embeddings(4)
    fill_batch(batch, step)
    assert holds_image_rows(step)
    assert embed_rows(batch, step, Rows()) == (3, 0)  # type: ignore[arg-type]
    assert batch.embedded and batch.active is batch.embd_struct
    assert batch.embd is not None
    assert batch.embd[:2].tolist() == [[42.0] * 4, [8.0] * 4]
    assert np.array_equal(batch.embd[2:5], image[:3])  # positions 2, 3, 4: the image's first
    assert list(batch.pos[:5]) == [10, 1, 2, 3, 4]
    batch.clear()
    assert batch.active is batch.struct  # the next pass is of tokens again


def test_a_placeholder_outside_the_requests_images_is_an_error() -> None:
    stray = Slot(0, request=request_with(()))  # type: ignore[arg-type]
    step = Step(BatchPlan())
    step.runs = [Run(stray, [5, -3], 0, True)]
    batch = TokenBatch(4)
    batch.carry_embeddings(4)
    fill_batch(batch, step)
    with pytest.raises(RuntimeError, match="placeholder"):
        embed_rows(batch, step, Rows())  # type: ignore[arg-type]
