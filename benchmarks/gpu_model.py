"""Write a generated model for GPU runs: llama architecture, random F16 weights, and a real
model's vocabulary size, so that sampling costs what it would (the text is noise).

    python -m benchmarks.gpu_model /tmp/m1b262k.gguf              # Gemma 3 1B's class, 4.2 GB
    python -m benchmarks.gpu_model /tmp/m.gguf --size 8b --vocab 128256

Weights are drawn once per shape and reused across layers: about 30 s for the 1B shape.
Run from the project root (it uses tests/tiny_model.py).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tests.tiny_model as tiny_model

SHAPES = {
    "270m": tiny_model.BENCH_270M,
    "1b": tiny_model.ModelShape(
        n_embd=2048, n_head=16, n_head_kv=8, n_layer=16, n_ff=8192, context_length=8192, f16=True
    ),
    "8b": tiny_model.ModelShape(
        n_embd=4096, n_head=32, n_head_kv=8, n_layer=32, n_ff=14336, context_length=8192, f16=True
    ),
}


class ReusingRng:
    """A generator that draws each shape of weights once: the writer asks for many alike."""

    def __init__(self, make=np.random.default_rng) -> None:
        self.rng = make(7)
        self.drawn: dict[tuple[int, ...], np.ndarray] = {}

    def standard_normal(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        if shape not in self.drawn:
            self.drawn[shape] = self.rng.standard_normal(shape, dtype=dtype)
        return self.drawn[shape]


@click.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--size", type=click.Choice(sorted(SHAPES)), default="1b")
@click.option("--vocab", default=262_144, help="Tokens in the vocabulary (Gemma's: 262,144).")
def main(path: Path, size: str, vocab: int) -> None:
    started = time.monotonic()
    base = len(tiny_model.vocabulary(0)[0])
    shape = replace(SHAPES[size], extra_vocab=max(0, vocab - base))
    make = np.random.default_rng
    tiny_model.np.random.default_rng = lambda seed=None: ReusingRng(make)  # type: ignore[assignment]
    try:
        tiny_model.write_tiny_model(path, shape=shape)
    finally:
        tiny_model.np.random.default_rng = make
    click.echo(f"{path}: {size}, {vocab:,} tokens, {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
