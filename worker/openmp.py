"""How llama.cpp's OpenMP threads wait: a setting for workers that share their cores.

llama.cpp's CPU backend runs each llama_decode on OpenMP threads (GNU libgomp), and ggml's
barriers between a pass's operations are OpenMP barriers: hundreds a pass. A thread that
reaches one (or finishes the decode) spins for GOMP_SPINCOUNT turns of a busy loop before it
sleeps: unset, 300,000 turns, about 4.5 ms on this project's 2-core VM. The next barrier or
decode finds it awake; a thread that slept must be woken, and on a VM a sleeping vCPU wakes
slowly.

- A worker with the cores to itself (one model, one worker, or workers that split the cores
  as serve's --workers does) keeps libgomp's default: its tick's host work (sampling,
  bookkeeping: 1-3 ms at 4-16 slots) fits inside the spin, so the threads never sleep
  between decodes, and its barriers pass within microseconds.
- Workers whose threads together outnumber the cores (several models loaded at once, or
  --threads above each worker's share, or above a CPU quota) get OMP_WAIT_POLICY=PASSIVE:
  a thread that waits sleeps at once. A thread that spins at a barrier while the thread it
  waits for has lost its core to another process holds its own core for the whole spin, at
  every barrier, and the pass collapses. Measured on that VM, with the other developers'
  work beside it (load 4-5 on 2 cores), 20 decode ticks of 4 sequences with 2 threads,
  medians of each run: the tiny test model's tick took 0.55-630 ms with libgomp's default
  spin, 0.5-52 ms with a 10,000-turn spin (which this module set before) and 1.0-2.3 ms
  passive in every run; Gemma 3 270M's, 359-962 ms, 166-464 ms and 256-274 ms. Passive
  waiting has its price where nothing competes (each barrier wakes a sleeper: the tiny
  model's tick, 0.55-0.9 ms with the default spin when it did not collapse, against
  1.0-2.3 ms), which is why a worker with the cores to itself keeps the spin.

libgomp reads the setting once, when llama.cpp's libraries load it, so it goes into the
environment a worker process starts with (cli/serve.py). A user's own GOMP_SPINCOUNT or
OMP_WAIT_POLICY is left as it is: on a host whose cores are busy with other work (a laptop,
a CI runner), OMP_WAIT_POLICY=PASSIVE is the user's choice to make (docs/options.md).
"""

from __future__ import annotations

from collections.abc import Mapping

SHARED_CORES_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}


def wait_environment(environ: Mapping[str, str], shared_cores: bool) -> dict[str, str]:
    """The OpenMP settings to add to a worker's environment `environ`: passive waiting where
    its threads share the cores with other workers', unless the user chose how OpenMP threads
    wait; nothing otherwise."""
    if not shared_cores or "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return dict(SHARED_CORES_WAIT)
