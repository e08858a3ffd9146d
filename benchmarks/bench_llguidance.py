"""The worker's grammar step on llguidance, per token, on one model's vocabulary.

Each case drives the worker's own GrammarState (worker/sampling/guidance.py) through a valid
output, token by token (the text tokenized by the model's own tokenizer), with the grammar
the gateway writes for it, and times at every step:
  check:  whether the sampled token is allowed (the step's mask, computed once: what most
          tokens cost);
  mask:   the same mask applied to a row of the whole vocabulary (every refused token at
          -inf, what a refused token costs on top);
  accept: advancing the grammar by the token.
Cases: a JSON schema (response_format), a required tool call in Hermes syntax, and the JSON
schema after a think block (a reasoning model). Runs in process on the CPU; no server.

    python -m benchmarks.bench_llguidance --rounds 3
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomserve.cli.default_model import resolve_model
from loomserve.gateway.text.grammar import json_schema_lark
from loomserve.gateway.text.reasoning import family_named
from loomserve.gateway.text.think_grammar import after_thinking
from loomserve.gateway.text.tokenizer import Vocab
from loomserve.gateway.tools.format import HERMES
from loomserve.gateway.tools.grammar import tool_grammar
from loomserve.worker.sampling.guidance import GrammarVocab, compile_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
INSTANCE = '{"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "poetry"]}'
TOOL = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    grammar: str  # as the gateway writes it
    text: str  # a valid output


def cases() -> list[Case]:
    thinking = family_named("deepseek_r1")
    return [
        Case("json schema", json_schema_lark(SCHEMA), INSTANCE),
        Case("tool call", tool_grammar(HERMES, [("get_weather", TOOL)], parallel=False), CALL),
        Case(
            "json after thinking",
            after_thinking(json_schema_lark(SCHEMA), thinking, inside=True),
            "The user wants JSON about Ada.</think>\n" + INSTANCE,
        ),
    ]


def steps(shared: GrammarVocab, case: Case, tokens: list[int]) -> dict[str, list[float]]:
    """Seconds per step of the check, the mask and the accept."""
    state = compile_grammar(case.grammar, shared)
    logits = np.random.default_rng(0).standard_normal(shared.n_vocab).astype(np.float32)
    timed: dict[str, list[float]] = {"check": [], "mask": [], "accept": []}
    for token in tokens:
        started = time.perf_counter()
        allowed = state.allows(token)  # computes the step's mask
        timed["check"].append(time.perf_counter() - started)
        if not allowed:
            raise RuntimeError(f"the grammar of {case.name} refused token {token}")
        shared.candidates.fill(logits)  # not timed: the sampler fills it for its own chain
        started = time.perf_counter()
        state.mask(shared.candidates)  # the mask is this step's already: its application
        timed["mask"].append(time.perf_counter() - started + timed["check"][-1])
        started = time.perf_counter()
        state.accept(token)
        timed["accept"].append(time.perf_counter() - started)
    return timed


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--rounds", type=int, default=3)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(model: str | None, rounds: int, json_out: Path | None) -> None:
    vocab = Vocab(resolve_model(model))
    started = time.perf_counter()
    shared = GrammarVocab(vocab.vocab, vocab.n_tokens)
    shared.tokenizer  # noqa: B018 (waits for the build)
    built = time.perf_counter() - started
    print(f"llguidance tokenizer: {built:.2f} s, {vocab.n_tokens} tokens")
    report: dict[str, dict[str, float]] = {"tokenizer": {"seconds": built}}
    for case in cases():
        tokens = vocab.tokenize(case.text, add_special=False)
        figures: dict[str, list[float]] = {"check": [], "mask": [], "accept": []}
        for _ in range(rounds):
            for name, values in steps(shared, case, tokens).items():
                figures[name] += values
        row = {name: 1000 * statistics.median(values) for name, values in figures.items()}
        row |= {f"{name} p90": 1000 * float(np.percentile(v, 90)) for name, v in figures.items()}
        report[case.name] = row
        print(f"{case.name} ({len(tokens)} tokens), ms per token, median (p90):")
        for name in figures:
            print(f"  {name:>7}: {row[name]:7.3f} ({row[name + ' p90']:.3f})")
    shared.close()
    vocab.close()
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
