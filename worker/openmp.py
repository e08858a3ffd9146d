"""How long llama.cpp's OpenMP threads spin once a job is done: set before libgomp loads.

llama.cpp's CPU backend runs each llama_decode on OpenMP threads (GNU libgomp). When the
decode returns they keep spinning, waiting for the next parallel job, for GOMP_SPINCOUNT
turns of a busy loop; unset, that is 300,000 turns, on the order of a millisecond or more,
during which they hold every core the decode used. In the worker those cores are wanted at
once: the tick's rows are sampled on the host right after the decode, on the worker's
sampling threads (worker/engine/sampling.py). Measured on this project's 2-core machine
(Gemma 3 270M, 2 threads, host time per tick outside llama_decode, T 0.7 + top_p 0.95):
16 rows 15.0 ms with the default spin, 10.4-11.5 with 1,000 to 100,000 turns; 4 rows on two
threads 4.5 ms against 3.3-3.6. The forward pass itself (decode and a 512-token prefill) took
the same time with any of these. Inside a decode ggml's threads meet at a barrier after each
operation, and in an OpenMP build that is OpenMP's own (`#pragma omp barrier` in ggml-cpu.c),
which spins the same count before it sleeps; the operations are split evenly, so the threads
arrive close enough together that even 1,000 turns cost nothing measurable. What the count
decides is how long the threads hold the cores between decodes.

libgomp reads its settings once, when it is loaded (with llama.cpp's libraries), so importing
this module sets them, and every process entry imports it before llama_cpp (cli/main.py, the
in-process benchmarks). A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "10000"


def shorten_spin(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set GOMP_SPINCOUNT to SPIN_COUNT unless the user chose how OpenMP threads wait."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT


shorten_spin()
