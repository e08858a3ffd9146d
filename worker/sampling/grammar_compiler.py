"""Requests' grammars compiled on a thread of the worker's own, off the tick.

Compiling a grammar and computing its first step's mask take a millisecond for most grammars
and tens for large ones (the fifth audit's wide500 on Gemma's vocabulary: 17 ms to compile,
then 18-60 ms to find its first step over the limits); compiled in the tick, seven arriving
at once held every stream of the worker for half a second. Here the tick goes on meanwhile
(llguidance lets go of the GIL while it works), and a grammar that cannot be used, or whose
first step is over its limits, is refused before its request is queued: a 400 before any
token, never a stream cut after its first. As the media encoder does for images
(media.py), the Generate comes back to the loop through the inbox.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import structlog

from ...protocol import Generate
from .guidance import (
    GrammarFailed,
    GrammarState,
    GrammarVocab,
    request_grammar,
)

log = structlog.get_logger(__name__)

# (gateway, the Generate, what the loop carries with it, its grammar or None, why not, seconds)
Compiled = Callable[[bytes, Generate, object, GrammarState | None, str, float], None]


class GrammarCompiler:
    """A thread that compiles each submitted Generate's grammar and computes its first mask;
    `done` is called on that thread with the result."""

    def __init__(self, grammars: GrammarVocab | None, done: Compiled) -> None:
        self._grammars = grammars
        self._done = done
        self._queue: queue.SimpleQueue[tuple[bytes, Generate, object] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="grammar-compiler", daemon=True)
        self._thread.start()

    def submit(self, gateway: bytes, generate: Generate, carry: object = None) -> None:
        """Compile the Generate's grammar after those submitted before it; `carry` comes
        back to `done` as it was given."""
        self._queue.put((gateway, generate, carry))

    def close(self) -> None:
        """Stop the thread after the work it has."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            gateway, generate, carry = item
            started = time.perf_counter()
            grammar: GrammarState | None = None
            why = ""
            try:
                grammar = request_grammar(generate.params.grammar or "", self._grammars)
                grammar.prime()
            except (ValueError, GrammarFailed) as exc:
                grammar, why = None, str(exc)
            except Exception as exc:  # a bug must cost this request only
                log.exception("grammar compile failed", request_id=generate.request_id)
                grammar, why = None, f"the grammar could not be compiled: {exc}"
            self._done(gateway, generate, carry, grammar, why, time.perf_counter() - started)
