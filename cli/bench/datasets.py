"""Benchmark prompts: random words, groups sharing a long prefix, or a ShareGPT file.

Prompts are built from words, not token ids, so they work against any server. When the server
can count tokens (`/tokenize`) the builders use it to land near the requested length; otherwise
they estimate, and the report uses the server's own `usage.prompt_tokens` as the truth.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Common English words; a plain word with a leading space is one token in most vocabularies.
WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an "
    "they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might "
    "us great old year off come since against go came right used take three place around "
    "however home small found house again part every general high school upon city number "
    "water light river story garden window morning evening music letter table market field "
    "question answer system model server token request stream value result reason moment "
    "country family friend mother father child road stone paper color sound voice power money "
    "wood fire earth summer winter spring autumn north south east west bread apple horse bird"
).split()

FILLER = "a"  # tops a prompt up to its exact length

TokenCounter = Callable[[Sequence[str]], list[int]]
"""Counts the tokens of each text, as the server's tokenizer would."""


def approximate_token_counts(texts: Sequence[str]) -> list[int]:
    """The usual rule of thumb for English: about four characters per token."""
    return [max(1, round(len(text) / 4)) for text in texts]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One prompt to send: its text, an optional system prompt, and how long the answer is."""

    prompt: str
    prompt_len: int  # estimated prompt tokens (system prompt included); the server may differ
    output_len: int  # max_tokens for this request
    system_prompt: str | None = None  # sent as a system message (chat) or prepended (completions)
    label: str | None = None  # its request class (--class), for the per-class report
    priority: int | None = None  # the body's `priority`, when its class sets one
    user: str | None = None  # the body's `user`, when its class sets one
    # Multi-turn: the (role, content) messages sent before this prompt, the index of the
    # request it must wait for (its conversation's previous turn), and its turn (0 first).
    history: tuple[tuple[str, str], ...] = ()
    follows: int | None = None
    turn: int = 0
    due_s: float | None = None  # a replayed trace's own arrival time, seconds from the start


def sample_lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    """n lengths drawn uniformly from [mean·(1−r), mean·(1+r)], as vLLM's random dataset does."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean * (1.0 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def tokens_per_word(count: TokenCounter, rng: random.Random) -> float:
    """How many tokens one of our words costs on average, measured on a sample sentence."""
    sample = " ".join(rng.choice(WORDS) for _ in range(400))
    return max(count([sample])[0], 1) / 400


def word_prompts(
    rng: random.Random, targets: Sequence[int], count: TokenCounter, rounds: int = 4
) -> list[tuple[str, int]]:
    """Texts of random words whose token counts are near targets; returns (text, tokens) pairs.

    After a first guess from the average cost of a word, each text is measured: one too long
    loses whole words until it is short, one too short gains words, and the last few tokens
    are one-letter words, which cost a token each in any vocabulary we know.
    """
    ratio = tokens_per_word(count, rng)
    words = [[rng.choice(WORDS) for _ in range(max(1, round(t / ratio)))] for t in targets]
    texts = [" ".join(w) for w in words]
    counts = count(texts)
    for _ in range(rounds):
        wrong = [i for i, (c, t) in enumerate(zip(counts, targets, strict=True)) if c != t]
        if not wrong:
            break
        for i in wrong:
            error = targets[i] - counts[i]
            if error < 0:
                del words[i][max(1, len(words[i]) - math.ceil(-error / ratio)) :]
            elif error >= 2 * ratio:
                words[i].extend(rng.choice(WORDS) for _ in range(int(error / ratio)))
            else:
                words[i].extend([FILLER] * error)
            texts[i] = " ".join(words[i])
        remeasured = count([texts[i] for i in wrong])
        for i, c in zip(wrong, remeasured, strict=True):
            counts[i] = c
    return list(zip(texts, counts, strict=True))


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    count: TokenCounter,
) -> list[BenchRequest]:
    """Prompts of random words, input and output lengths spread by range_ratio."""
    rng = random.Random(seed)
    inputs = sample_lengths(rng, num_prompts, input_len, range_ratio)
    outputs = sample_lengths(rng, num_prompts, output_len, range_ratio)
    prompts = word_prompts(rng, inputs, count)
    return [
        BenchRequest(prompt=text, prompt_len=tokens, output_len=out)
        for (text, tokens), out in zip(prompts, outputs, strict=True)
    ]


def shared_prefix_dataset(
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    count: TokenCounter,
) -> list[BenchRequest]:
    """Groups of prompts that share one long system prompt each, in shuffled order.

    Every request of a group repeats the same prefix_len-token system prompt before its own
    question, so a server that reuses cached prefixes answers the later ones faster.
    """
    if num_groups < 1:
        raise ValueError(f"need at least one group, got {num_groups}")
    rng = random.Random(seed)
    prefixes = [text for text, _ in word_prompts(rng, [prefix_len] * num_groups, count)]
    prefix_tokens = count(prefixes)
    questions = word_prompts(rng, sample_lengths(rng, num_prompts, input_len, range_ratio), count)
    outputs = sample_lengths(rng, num_prompts, output_len, range_ratio)
    requests = [
        BenchRequest(
            prompt=text,
            prompt_len=prefix_tokens[i % num_groups] + tokens,
            output_len=out,
            system_prompt=prefixes[i % num_groups],
        )
        for i, ((text, tokens), out) in enumerate(zip(questions, outputs, strict=True))
    ]
    rng.shuffle(requests)
    return requests


def multi_turn_dataset(
    num_conversations: int,
    num_turns: int,
    system_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    count: TokenCounter,
) -> list[BenchRequest]:
    """Chat conversations: each turn sends the whole history plus a new user message.

    Each conversation has its own system prompt of system_len tokens (none for 0) and
    num_turns user messages of about input_len tokens. The history holds earlier user
    messages and, as the assistant's answers, texts of output_len tokens written here: a
    benchmark cannot wait for the server's own words without timing itself, and any text
    of that length costs a server the same. Requests come turn by turn, and each waits for
    its conversation's previous turn (BenchRequest.follows): the load a chat client makes.
    """
    if num_conversations < 1 or num_turns < 1:
        raise ValueError("need at least one conversation of at least one turn")
    rng = random.Random(seed)
    systems = (
        [text for text, _ in word_prompts(rng, [system_len] * num_conversations, count)]
        if system_len > 0
        else [None] * num_conversations
    )
    system_tokens = count([s for s in systems if s]) if system_len > 0 else []
    n = num_conversations * num_turns
    users = word_prompts(rng, sample_lengths(rng, n, input_len, range_ratio), count)
    answers = word_prompts(rng, sample_lengths(rng, n, output_len, range_ratio), count)
    requests: list[BenchRequest] = []
    history: list[list[tuple[str, str]]] = [[] for _ in range(num_conversations)]
    sizes = [system_tokens[c] if system_tokens else 0 for c in range(num_conversations)]
    for turn in range(num_turns):
        for c in range(num_conversations):
            i = turn * num_conversations + c
            (user, user_tokens), (answer, answer_tokens) = users[i], answers[i]
            requests.append(
                BenchRequest(
                    prompt=user,
                    prompt_len=sizes[c] + user_tokens,
                    output_len=answer_tokens,
                    system_prompt=systems[c],
                    history=tuple(history[c]),
                    follows=i - num_conversations if turn else None,
                    turn=turn,
                )
            )
            history[c] += [("user", user), ("assistant", answer)]
            sizes[c] += user_tokens + answer_tokens
    return requests


def sharegpt_dataset(
    path: Path,
    num_prompts: int,
    output_len: int | None,
    seed: int,
    count: TokenCounter,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[BenchRequest]:
    """num_prompts conversations from a ShareGPT JSON file, filtered as vLLM filters them.

    The first turn is the prompt; the second turn's length is the output length unless
    output_len fixes it. Too short (< 4 tokens) or too long conversations are skipped.
    """
    conversations = json.loads(Path(path).read_text())
    if not isinstance(conversations, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = [
        (turns[0]["value"], turns[1]["value"])
        for entry in conversations
        if isinstance(entry, dict)
        and isinstance(turns := entry.get("conversations"), list)
        and len(turns) >= 2
        and isinstance(turns[0], dict)
        and isinstance(turns[1], dict)
        and turns[0].get("value")
        and turns[1].get("value")
    ]
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    batch = 64  # measure a few at a time: most files hold far more than we need
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        prompt_lens = count([prompt for prompt, _ in chunk])
        answer_lens = (
            [output_len] * len(chunk) if output_len else count([answer for _, answer in chunk])
        )
        for (prompt, _), prompt_len, answer_len in zip(
            chunk, prompt_lens, answer_lens, strict=True
        ):
            too_short = prompt_len < 4 or (output_len is None and answer_len < 4)
            too_long = prompt_len > max_prompt_len or prompt_len + answer_len > max_total_len
            if not (too_short or too_long):
                requests.append(BenchRequest(prompt, prompt_len, answer_len))
            if len(requests) == num_prompts:
                return requests
    if not requests:
        raise ValueError(f"{path}: no usable conversations")
    return requests
