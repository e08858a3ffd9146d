"""Counting the forward passes llama.cpp really makes, through ggml's graph callback."""

from __future__ import annotations

import llama_cpp as llama
from llama_cpp._ggml import libggml

from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine

libggml.ggml_get_name.restype = llama.ctypes.c_char_p
libggml.ggml_get_name.argtypes = [llama.ctypes.c_void_p]
# Every forward pass computes the first layer's attention norm exactly once.
FIRST_NODE = b"attn_norm-0"


class PassCounter:
    """An Engine whose every graph computation is counted: `passes` grows by one per ubatch."""

    def __init__(self) -> None:
        self.passes = 0
        self.callback = llama.ggml_backend_sched_eval_callback(self._on_node)

    def _on_node(self, tensor, ask: bool, _user_data) -> bool:
        if ask and libggml.ggml_get_name(tensor) == FIRST_NODE:
            self.passes += 1
        return False  # no tensor data wanted: each graph still runs in one go

    def engine(self, config: WorkerConfig) -> Engine:
        return Engine(config, eval_callback=self.callback)
