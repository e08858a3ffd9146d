"""Real traffic from files: a Mooncake-style trace replayed on its schedule, or JSONL prompts.

A trace line is `{"timestamp": MS, "input_length": N, "output_length": M, "hash_ids": [..]}`
(Mooncake's format): each hash id stands for one block of `block_size` prompt tokens, and
requests that share a hash id share that block, in that place, so a prefix cache sees the
sharing the trace recorded. The text of a block is random words seeded by its id; the last
block is cut to the request's input length. Requests are due at timestamp x time_scale.

A prompts line is `{"prompt": "..."}` or `{"messages": [{"role", "content"}, ...]}`, with an
optional `max_tokens` (or `output_length`); the prompts are sent as fast as the load shape
says, in file order.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from .datasets import BenchRequest, TokenCounter, word_prompts


def _lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object per line")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no lines")
    return rows


def _positive_int(row: dict[str, Any], key: str, where: str) -> int:
    value = row.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def trace_dataset(
    path: Path,
    num_prompts: int,
    block_size: int,
    time_scale: float,
    seed: int,
    count: TokenCounter,
) -> list[BenchRequest]:
    """The first num_prompts requests of a Mooncake-style trace, due on its (scaled) clock."""
    if block_size < 1 or time_scale <= 0:
        raise ValueError("--trace-block-size and --time-scale must be positive")
    rows = _lines(path)[:num_prompts]
    specs = []
    for number, row in enumerate(rows, 1):
        where = f"{path}: request {number}"
        timestamp = row.get("timestamp", 0)
        if not isinstance(timestamp, int | float) or timestamp < 0:
            raise ValueError(f"{where}: timestamp must be a number of ms, got {timestamp!r}")
        hash_ids = row.get("hash_ids") or []
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
            raise ValueError(f"{where}: hash_ids must be a list of integers")
        specs.append(
            (
                float(timestamp),
                _positive_int(row, "input_length", where),
                _positive_int(row, "output_length", where),
                hash_ids,
            )
        )
    # One text per distinct block, seeded by its id (and the run's seed): shared ids share text.
    blocks: dict[int, str] = {}
    for hash_id in sorted({h for *_, ids in specs for h in ids}):
        rng = random.Random(f"{seed}:{hash_id}")
        blocks[hash_id] = word_prompts(rng, [block_size], count)[0][0]
    first = min(t for t, *_ in specs)
    requests = []
    for index, (timestamp, input_len, output_len, hash_ids) in enumerate(specs):
        parts = [blocks[h] for h in hash_ids[: -(-input_len // block_size)]]
        covered = block_size * len(parts)
        if covered < input_len:  # more tokens than blocks: a tail of its own
            rng = random.Random(f"{seed}:tail:{index}")
            parts.append(word_prompts(rng, [input_len - covered], count)[0][0])
        elif covered > input_len and parts:  # the last block cut to the input length
            words = parts[-1].split(" ")
            keep = max(1, round(len(words) * (input_len - covered + block_size) / block_size))
            parts[-1] = " ".join(words[:keep])
        requests.append(
            BenchRequest(
                prompt=" ".join(parts),
                prompt_len=input_len,
                output_len=output_len,
                due_s=(timestamp - first) / 1000.0 * time_scale,
            )
        )
    requests.sort(key=lambda r: r.due_s or 0.0)  # the schedule is followed in order
    return requests


def _messages(value: Any, where: str) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list")
    messages = []
    for message in value:
        if not (
            isinstance(message, dict)
            and message.get("role") in ("system", "user", "assistant")
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(f"{where}: each message needs a role and text content")
        messages.append((message["role"], message["content"]))
    if messages[-1][0] != "user":
        raise ValueError(f"{where}: the last message must be the user's")
    return messages


def prompts_dataset(
    path: Path, num_prompts: int, output_len: int, count: TokenCounter
) -> list[BenchRequest]:
    """The first num_prompts prompts (or chats) of a JSONL file, in file order."""
    rows = _lines(path)[:num_prompts]
    built: list[tuple[str, str | None, tuple[tuple[str, str], ...], int]] = []
    for number, row in enumerate(rows, 1):
        where = f"{path}: line {number}"
        tokens = row.get("max_tokens", row.get("output_length", output_len))
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise ValueError(f"{where}: max_tokens must be a positive integer")
        if isinstance(row.get("prompt"), str) and row["prompt"]:
            built.append((row["prompt"], None, (), tokens))
            continue
        if "messages" not in row:
            raise ValueError(f"{where}: needs a prompt or messages")
        messages = _messages(row["messages"], where)
        system = messages[0][1] if messages[0][0] == "system" else None
        history = tuple(messages[1 if system is not None else 0 : -1])
        built.append((messages[-1][1], system, history, tokens))
    texts = ["\n\n".join([s or "", *(t for _, t in h), p]) for p, s, h, _ in built]
    lengths = count(texts)
    return [
        BenchRequest(prompt, length, tokens, system_prompt=system, history=history)
        for (prompt, system, history, tokens), length in zip(built, lengths, strict=True)
    ]
