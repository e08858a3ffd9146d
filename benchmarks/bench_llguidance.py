"""llguidance against llama.cpp's grammar sampler, per token, on one model's vocabulary.

Each case drives both engines through the same valid output, token by token (the text is
tokenized by the model's own tokenizer), and times at every step:
  llama.cpp mask:   llama_sampler_apply of the grammar sampler over the whole vocabulary
                    (what the worker does when the sampled token is refused);
  llama.cpp check:  the same sampler over the one sampled token (the worker's first try:
                    "grammar at plain-text speed" masks only on a refusal);
  llguidance mask:  LLMatcher's next-token bitmask over the whole vocabulary.
Cases: a JSON schema (llguidance compiles the schema itself; llama.cpp the GBNF the
gateway makes of it), and a required tool call in Hermes syntax (both engines get the
gateway's GBNF). Runs in process on the CPU; no server.

    pip install llguidance   # not a dependency of loomserve
    python -m benchmarks.bench_llguidance --rounds 3
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import llama_cpp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama_cpp.llama_grammar import json_schema_to_gbnf

from loomserve.cli.default_model import resolve_model
from loomserve.gateway.text.tokenizer import Vocab
from loomserve.gateway.tools.format import HERMES
from loomserve.gateway.tools.grammar import tool_grammar

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
    gbnf: str  # for llama.cpp
    llg_grammar: str  # for llguidance
    text: str  # a valid output


def cases() -> list[Case]:
    import llguidance

    schema_gbnf = json_schema_to_gbnf(json.dumps(SCHEMA))
    call_gbnf = tool_grammar(HERMES, [("get_weather", TOOL)], parallel=False)
    return [
        Case(
            "json schema",
            schema_gbnf,
            llguidance.grammar_from("json_schema", json.dumps(SCHEMA)),
            INSTANCE,
        ),
        Case("tool call", call_gbnf, llguidance.grammar_from("gbnf", call_gbnf), CALL),
    ]


def llama_steps(vocab: Vocab, case: Case, tokens: list[int]) -> tuple[list[float], list[float]]:
    """Seconds per step of the full mask and of the one-token check."""
    sampler = llama_cpp.llama_sampler_init_grammar(vocab.vocab, case.gbnf.encode(), b"root")
    if not sampler:
        raise RuntimeError(f"llama.cpp refused the grammar of {case.name}")
    n = vocab.n_tokens
    data = (llama_cpp.llama_token_data * n)()
    array = llama_cpp.llama_token_data_array(data, n, -1, False)
    one_data = (llama_cpp.llama_token_data * 1)()
    one = llama_cpp.llama_token_data_array(one_data, 1, -1, False)
    logits = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    masks, checks = [], []
    try:
        for token in tokens:
            for i in range(n):  # a fresh row each step (not timed)
                data[i].id, data[i].logit, data[i].p = i, float(logits[i]), 0.0
            array.size, array.selected, array.sorted = n, -1, False
            started = time.perf_counter()
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
            masks.append(time.perf_counter() - started)
            if data[token].logit == -np.inf:
                raise RuntimeError(f"llama.cpp refused token {token} of {case.name}")
            one_data[0] = llama_cpp.llama_token_data(token, 1.0, 0.0)
            one.size, one.selected, one.sorted = 1, -1, False
            started = time.perf_counter()
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(one))
            checks.append(time.perf_counter() - started)
            llama_cpp.llama_sampler_accept(sampler, token)
    finally:
        llama_cpp.llama_sampler_free(sampler)
    return masks, checks


def llguidance_steps(tokenizer: object, n_vocab: int, case: Case, tokens: list[int]) -> list[float]:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    matcher = llguidance.LLMatcher(tokenizer, case.llg_grammar)
    if matcher.is_error():
        raise RuntimeError(f"llguidance: {matcher.get_error()}")
    bitmask = allocate_token_bitmask(1, n_vocab)
    steps = []
    for token in tokens:
        started = time.perf_counter()
        fill_next_token_bitmask(matcher, bitmask)
        steps.append(time.perf_counter() - started)
        if not (bitmask[0, token // 32] >> (token % 32)) & 1:
            raise RuntimeError(f"llguidance refused token {token} of {case.name}")
        matcher.consume_token(token)
    return steps


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--rounds", type=int, default=3)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(model: str | None, rounds: int, json_out: Path | None) -> None:
    from llguidance.llamacpp import lltokenizer_from_vocab

    vocab = Vocab(resolve_model(model))
    started = time.perf_counter()
    tokenizer = lltokenizer_from_vocab(vocab.vocab)
    print(f"llguidance tokenizer: {time.perf_counter() - started:.2f} s, {vocab.n_tokens} tokens")
    report: dict[str, dict[str, float]] = {}
    for case in cases():
        tokens = vocab.tokenize(case.text, add_special=False)
        figures: dict[str, list[float]] = {"llama.cpp mask": [], "llama.cpp check": [], "llg": []}
        for _ in range(rounds):  # alternating, so the machine's moods spread over both
            masks, checks = llama_steps(vocab, case, tokens)
            figures["llama.cpp mask"] += masks
            figures["llama.cpp check"] += checks
            figures["llg"] += llguidance_steps(tokenizer, vocab.n_tokens, case, tokens)
        row = {name: 1000 * statistics.median(values) for name, values in figures.items()}
        row |= {f"{name} mean": 1000 * statistics.fmean(v) for name, v in figures.items()}
        report[case.name] = row
        print(f"{case.name} ({len(tokens)} tokens), ms per token, median (mean):")
        for name in figures:
            print(f"  {name:>16}: {row[name]:8.3f} ({row[name + ' mean']:.3f})")
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
