"""Greedy output is the same whether a prompt's prefix came from the cache or was evaluated.

The second audit found Gemma's greedy answer to a 355-token prompt change once its first 354
tokens came from the cache: ggml's CPU flash attention computed the last prompt token alone
(after the hit) on another path than inside its whole prompt (64 query rows and up go in
tiles, fewer another way). Not fixed yet: the Gemma cases that still differ are strict
xfails (they fail the day they hold). Turning flash attention off fixes them but breaks the
alone-and-batched invariant (tests/worker/test_default_model.py); evaluating again the tail
the kernels saw when the prompt ran whole (its last chunk, or 64 tokens) fixed all 20 Gemma
cases here but changes how much of every prefix is reused, so it waits for its own change.
These run many prompts, in
several scripts and lengths on both sides of those thresholds, once cold and once after a
hit, on the real engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loomserve.protocol import TokenChunk
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine import Engine
from tests.worker.test_engine import drain, greedy, new_loop

SCRIPTS = {
    "latin": "The old market by the river sold bread, figs and copper pots to travellers. ",
    "arabic": "مرحبا بكم في هذا النص الطويل الذي يتحدث عن تاريخ المدينة القديمة وأسواقها وناسها ",
    "hebrew": "שלום לכולם, זהו טקסט ארוך על ההיסטוריה של העיר העתיקה והשווקים שלה. ",
    "cjk": "古い市場では川のそばでパンと銅の鍋を売っていた。旅人は毎朝そこに集まった。",
    "code": "def area(radius: float) -> float:\n    return 3.14159 * radius ** 2\n\n",
}
LENGTHS = (70, 180, 500)  # below and above the tile's 64 rows; the split over 512 cells


@pytest.fixture(scope="module")
def engine(long_model_path: Path):
    config = WorkerConfig(
        model_path=long_model_path,
        slots=2,
        ctx_size=1024,
        threads=2,  # the split across threads needs more than one
    )
    engine = Engine(config)
    yield engine, config
    engine.close()


def prompt_of(engine: Engine, text: str, length: int) -> list[int]:
    """The text repeated whole until its tokens reach `length` (a prompt as a client sends
    it: cut mid-word, the audit's prompt no longer showed the difference)."""
    repeats = 1
    while len(engine.tokenize(text * repeats)) < length:
        repeats += 1
    return engine.tokenize(text * repeats)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_greedy_output_is_the_same_after_a_prefix_hit(engine, script: str, length: int) -> None:
    engine, config = engine
    prompt = prompt_of(engine, SCRIPTS[script], length)
    length = len(prompt)
    loop, collector = new_loop(engine, config)
    for attempt in ("cold", "hit", "hit-again"):
        loop.inbox.submit(b"gw", greedy(attempt, prompt, 24, logprobs=5))
        drain(loop)
    tokens = collector.tokens(b"gw")
    finishes = collector.finishes(b"gw")
    assert finishes["cold"].cached_tokens == 0
    # All but the tail the worker evaluates again (worker/prefix_cache.py).
    assert finishes["hit"].cached_tokens == length - 1  # all but the last prompt token
    assert tokens["hit"] == tokens["cold"] and tokens["hit-again"] == tokens["cold"]
    # Bit for bit, not just the argmax: the tiny model's wide logit gaps would hide a path
    # that sums in another order, which a real model's close calls turn into other text.
    assert logprobs(collector, "hit") == logprobs(collector, "cold")
    assert logprobs(collector, "hit-again") == logprobs(collector, "cold")


def logprobs(collector, request_id: str) -> list[tuple[float, list[float]]]:
    """Each generated position's logprob and top alternatives' logprobs, as sent."""
    return [
        (position.logprob, position.top_logprobs)
        for chunk in collector.of_type(TokenChunk, b"gw")
        if chunk.request_id == request_id and chunk.logprobs
        for position in chunk.logprobs
    ]


@pytest.fixture(scope="module")
def gemma():
    from loomserve.cli.default_model import default_model_path

    config = WorkerConfig(
        model_path=default_model_path(),
        slots=2,
        ctx_size=2048,
        threads=2,
    )
    engine = Engine(config)
    yield engine, config
    engine.close()


STILL_DIFFERENT = {("arabic", 267), ("arabic", 500), ("hebrew", 355), ("latin", 355)}


def gemma_case(script: str, length: int):
    if (script, length) not in STILL_DIFFERENT:
        return pytest.param(script, length)
    reason = "flash attention's kernels by batch shape (issue 21, item 3)"
    return pytest.param(script, length, marks=pytest.mark.xfail(strict=True, reason=reason))


@pytest.mark.default_model
@pytest.mark.parametrize(
    ("script", "length"),
    [gemma_case(script, length) for script in sorted(SCRIPTS) for length in (267, 355, 500)],
)
def test_gemma_greedy_output_is_the_same_after_a_prefix_hit(
    gemma, script: str, length: int
) -> None:
    """The audit's case: a long prompt sent again, its prefix from the cache."""
    test_greedy_output_is_the_same_after_a_prefix_hit(gemma, script, length)
