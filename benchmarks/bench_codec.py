"""What the wire codec costs per tick: one Outputs (a token for each of N running requests)
encoded, as the worker's IO thread does after each tick, and decoded, as the gateway does.

    python -m benchmarks.bench_codec [--requests 4,16,64]

Microseconds per message and per chunk, best of 5 repeats of 200 (a small, CPU-bound loop:
the best repeat is the one the machine's neighbours disturbed least).
"""

from __future__ import annotations

import timeit

import click

from loomserve.protocol import Finish, Outputs, TokenChunk, decode, encode


def one_tick(requests: int) -> Outputs:
    """A decode tick's Outputs: one new token per request, and one request finishing."""
    chunks = [TokenChunk(f"cmpl-{i:024x}", [1234], seq=17) for i in range(requests)]
    return Outputs(chunks, [Finish("cmpl-done", "stop", 40, 64, 0, 0.01)])


def best_us(work, number: int = 200, repeat: int = 5) -> float:
    return min(timeit.repeat(work, number=number, repeat=repeat)) / number * 1e6


@click.command()
@click.option("--requests", default="4,16,64", help="Running requests per tick, comma-separated.")
def main(requests: str) -> None:
    print(f"{'requests':>8} {'encode µs':>10} {'decode µs':>10} {'per chunk µs':>13}")
    for n in (int(part) for part in requests.split(",")):
        message = one_tick(n)
        frames = encode(message)
        assert decode(frames) == message
        encode_us = best_us(lambda message=message: encode(message))
        decode_us = best_us(lambda frames=frames: decode(frames))
        per_chunk = f"{encode_us / n:>6.1f} / {decode_us / n:.1f}"
        print(f"{n:>8} {encode_us:>10.0f} {decode_us:>10.0f} {per_chunk}")


if __name__ == "__main__":
    main()
