"""The input-grounded benchmark load: each prompt holds a passage and asks for it back, edited.

Summaries, edits, code changes and answers that quote their sources repeat much of their
input; this load is their simplest form, so it shows what self-speculative (n-gram) decoding
gains. The passages are random words (as the random dataset's prompts) so that the load
works against any OpenAI-compatible server and any vocabulary; the edit (one word replaced
by another wherever it occurs) keeps the answer from being a plain copy.
"""

from __future__ import annotations

import random

from .datasets import (
    BenchRequest,
    TokenCounter,
    sample_lengths,
    word_prompts,
)

# (word, replacement): the passage is built from datasets.WORDS, which holds the first ones.
EDITS = (
    ("river", "lake"),
    ("house", "cabin"),
    ("morning", "evening"),
    ("winter", "summer"),
    ("city", "town"),
    ("horse", "camel"),
    ("garden", "orchard"),
    ("music", "poetry"),
)
INSTRUCTION = (
    "Copy the passage below word for word, except that every {old!r} becomes {new!r}. "
    "Answer with the edited passage only.\n\nPassage:\n"
)


def input_grounded_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int | None,
    range_ratio: float,
    seed: int,
    count: TokenCounter,
) -> list[BenchRequest]:
    """Prompts that each hold a passage of about input_len tokens and ask for it back with one
    word replaced. The answer may be as long as the passage (output_len: fixed instead)."""
    rng = random.Random(seed)
    lengths = sample_lengths(rng, num_prompts, input_len, range_ratio)
    passages = word_prompts(rng, lengths, count)
    instruction_tokens = max(count([INSTRUCTION.format(old="river", new="lake")])[0], 1)
    requests = []
    for text, tokens in passages:
        words = text.split()
        old, new = rng.choice(EDITS)
        # Make sure the edit has something to change: put its word in a few places.
        for _ in range(3):
            words.insert(rng.randrange(len(words) + 1), old)
        passage = " ".join(words)
        requests.append(
            BenchRequest(
                prompt=INSTRUCTION.format(old=old, new=new) + passage,
                prompt_len=instruction_tokens + tokens + 3,
                output_len=output_len or tokens + 8,
            )
        )
    return requests
