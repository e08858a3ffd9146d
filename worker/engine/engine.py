"""The engine: one llama.cpp model and context, driven through llama-cpp-python's C API.

One llama_context serves every slot: n_seq_max = slots, n_ctx = slots * slot context, and
n_batch = n_ubatch = the tick's token budget, so each tick is one llama_decode.

Batch invariance (the default) decides how the KV cache and the CPU kernels are set up.
With it each slot has its own KV stream (kv_unified off, as llama-server runs), so a
sequence's cells sit at the same indices, and its attention sums in the same order, as when
it runs alone; weights are not repacked (ggml's repacked K-quant kernels take another path
for one row than for four), and the K-quant matmul is one kernel for every pass (--cpu-matmul:
a dot product a row, or the tiled matmul even for one row). A prefix copied from a busy slot
then costs a copy of that slot's stream, as llama.cpp copies between streams only whole.
Without it all slots share one cache, and a copied prefix shares the source's cells.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as llama
import numpy as np
import structlog

from ...protocol import SamplingParams
from ..config import WorkerConfig
from ..sampling import rowscan
from ..sampling.backend_sampling import (
    BackendSampler,
    GraphChains,
    backend_sampling_available,
)
from ..sampling.graph_draw import GraphDraws
from ..sampling.guidance import GrammarState, GrammarVocab
from ..sampling.samplers import HostSampler, build_sampler
from ..sched.media import MediaSpan, rope_position
from ..sched.slots import Run
from ..sched.ubatches import SplitRules
from .batch import TokenBatch
from .kernels import graph_native
from .llama_logs import LoadProgress, route_llama_logs
from .threads import ThreadGovernor
from .token_rows import TokenRows

log = structlog.get_logger(__name__)


def amx_kernels() -> bool:
    """Whether this llama.cpp build holds ggml's AMX kernels (built for a CPU that has AMX):
    then they, not the AVX kernels, run a quantized weight put in an extra buffer type."""
    return b"AMX_INT8 = 1" in llama.llama_print_system_info()


MIN_STREAM_COPY_TOKENS = 16
# llama.cpp's file types whose weight matrices are floats (general.file_type; gguf's
# LlamaFileType): on an x86 CPU their matmuls take llamafile's sgemm from two rows on.
FLOAT_FILE_TYPES = {0: "F32", 1: "F16", 32: "BF16"}
KV_TYPES = {"f16": llama.GGML_TYPE_F16, "q8_0": llama.GGML_TYPE_Q8_0}
FLASH_ATTN_TYPES = {
    "auto": getattr(llama, "LLAMA_FLASH_ATTN_TYPE_AUTO", -1),
    "on": getattr(llama, "LLAMA_FLASH_ATTN_TYPE_ENABLED", 1),
    "off": getattr(llama, "LLAMA_FLASH_ATTN_TYPE_DISABLED", 0),
}


def cpu_matmul_environment(config: WorkerConfig) -> dict[str, str]:
    """The environment that picks ggml's CPU kernel for K-quant weights (--cpu-matmul). The
    ggml of llama-cpp-python 0.3.36 reads it once per process, at its first matmul
    (ggml-cpu/tiled/tiled.cpp), so it must be set before the first decode.

    On its own ggml takes its tiled matmul from 8 rows of a pass up and a dot product a row
    below, and the two sum in different orders: a sequence's numbers would depend on how many
    others share its pass. Either kernel alone computes a row the same whatever else the pass
    holds. The dot product is the faster for one row; the tiled matmul for many (on this
    project's 2-core Xeon, Gemma 3 270M: prefill 16-27 % faster, 16 sequences' decode 6 %,
    one sequence's 17 % slower; docs/scheduling.md). Where passes draw on an AVX-512 VNNI
    CPU, q0swap.c runs the dot product's arithmetic for Q4_K, Q5_K and Q6_K on qkmatmul.c,
    faster than either; it swaps them only with "dot"."""
    mode = config.cpu_matmul
    if mode == "auto":
        mode = "dot" if config.batch_invariant else "ggml"
    if mode == "dot":
        return {"GGML_CPU_TILED_MM": "0"}
    if mode == "tiled":
        return {"GGML_CPU_TILED_MM": "1", "GGML_CPU_TILED_MM_FORCE": "1"}
    return {}


def cpu_matmul_in_force() -> str:
    """The K-quant kernel the environment gives ggml: "dot", "tiled" or "ggml" (its own),
    read as ggml reads it (C's atoi: "abc" is 0)."""

    def atoi(name: str) -> int | None:
        text = os.environ.get(name)
        if text is None:
            return None
        digits = re.match(r"\s*([+-]?\d+)", text)
        return int(digits.group(1)) if digits else 0

    if atoi("GGML_CPU_TILED_MM") == 0:
        return "dot"
    return "tiled" if atoi("GGML_CPU_TILED_MM_FORCE") == 1 else "ggml"


class EngineError(RuntimeError):
    """The model or its context could not be set up."""


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What the loaded model is and where it runs; logged at start-up, sent in ModelInfo."""

    name: str
    architecture: str
    description: str  # llama.cpp's one-line summary, e.g. "gemma3 270M Q4_K - Medium"
    n_params: int
    size_bytes: int
    n_layers: int
    n_vocab: int
    context_train: int
    gpu_layers: int  # layers offloaded to a GPU; 0 on a CPU-only build

    @property
    def runs_on(self) -> str:
        if self.gpu_layers == 0:
            return "CPU"
        return f"GPU ({min(self.gpu_layers, self.n_layers)}/{self.n_layers} layers)"


class Engine:
    """The model, its one context, and the few llama.cpp calls the loop needs."""

    def __init__(self, config: WorkerConfig, eval_callback=None) -> None:
        """eval_callback: a ggml_backend_sched_eval_callback that sees every graph node (for
        tests that count forward passes); it slows every decode, so never in serving."""
        llama.llama_backend_init()
        route_llama_logs()
        for name, value in cpu_matmul_environment(config).items():
            os.environ.setdefault(name, value)  # a user's own setting wins
        # What ggml will run (logged at start-up): "dot", "tiled" or "ggml" (its own choice).
        self.cpu_matmul = cpu_matmul_in_force()
        if config.batch_invariant and self.cpu_matmul == "ggml":
            log.warning(
                "GGML_CPU_TILED_MM in the environment lets ggml pick its K-quant kernel by the "
                "rows of a pass: greedy outputs can differ alone and batched",
            )
        self.config = config
        self.model: llama.llama_model_p | None = self._load_model(config)
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.description = describe(self.model, config.model_path, self._gpu_layers(config))
        float_type = float_weights(self.model)
        if config.batch_invariant and float_type and self._gpu_layers(config) == 0:
            log.warning(
                f"batch invariance is exact for quantized weights; these are {float_type}, "
                "which llama.cpp multiplies by ggml's dot product for one row and by "
                "llamafile's sgemm for two or more, summing in another order: a sequence's "
                "logits alone and batched differ in their last bits, and a greedy output "
                "where two tokens nearly tie",
                model=config.model_path.name,
            )
        self.n_vocab = self.description.n_vocab
        self._eog: dict[int, bool] = {}
        self.slot_context = min(config.ctx_size, self.description.context_train)
        self.n_slots = config.slots
        self._eval_callback = eval_callback  # held: the C side keeps only a pointer
        if rowscan.library() is None:
            raise EngineError(
                "loomserve's sampling library (csrc/sampling) is not built beside "
                "worker/sampling/: install loomserve with pip, which builds it"
            )
        self.sampling = self._sampling_place(config, self.description)
        self.ctx = self._new_context(config, self.sampling != "host")
        # Which sampler chain each sequence has in the graph (llama.cpp's chains).
        self.graph_chains = GraphChains(self.ctx) if self.sampling == "graph" else None
        # Or the C draw in the graph: each sequence's sampler and state (graph_draw.py).
        native = graph_native() if self.sampling == "draw" else None
        self.graph_draws = None
        if native is not None:
            self.graph_draws = GraphDraws(self.ctx, native.draw, config.slots, self.n_vocab)
            if native.kernels is not None:
                # Its passes' K-quant matmuls repeat ggml's dot product (qkmatmul.c):
                # swapped only where ggml would run that product at every row count.
                native.kernels.ls_q0_swap_kquants(self.cpu_matmul == "dot")
                native.kernels.ls_q0_swap(config.cpu_kernels == "loomserve")
        # Whose kernels the passes that draw multiply with (logged at start-up).
        self.cpu_kernels = (
            "loomserve"
            if native is not None and config.cpu_kernels == "loomserve" and native.swaps()
            else "ggml"
        )
        self.memory = llama.llama_get_memory(self.ctx)
        # Sharing cells in one cache is free; copying a whole KV stream pays for itself only
        # from about a dozen prompt tokens that need not be evaluated again.
        self.min_copy_tokens = MIN_STREAM_COPY_TOKENS if config.batch_invariant else 1
        # A stream per slot makes llama.cpp cut batches by sequence (worker/sched/ubatches.py).
        recurrent = llama.llama_model_is_recurrent(self.model) or llama.llama_model_is_hybrid(
            self.model
        )
        self.split_rules = SplitRules(
            per_slot_streams=config.batch_invariant and config.slots > 1,
            padding=not recurrent,
            pad_cached_slots=llama.llama_model_n_swa(self.model) == 0,
            # A lone prompt runs in chunks of this many tokens (strategies.py): a prefix hit
            # evaluates again what keeps its tail on those chunks' kernel paths.
            prompt_chunk=min(config.prefill_chunk, config.batch_tokens)
            if config.batch_invariant
            else 0,
        )
        self.batch = TokenBatch(config.batch_tokens)
        self.last_outputs = 0  # rows of logits the last decode made (output_logits)
        self._passes_threads = config.n_threads  # what llama_decode runs on now
        self._lent_threads = 0  # held by the image encoder while it encodes (lend_threads)
        # Fewer threads while other processes take the CPUs; none to govern on a GPU.
        self.threads = (
            ThreadGovernor.for_this_process(config.n_threads)
            if config.adaptive_threads and self._gpu_layers(config) == 0
            else None
        )
        # llguidance's tokenizer builds on a thread from here (seconds for a large vocabulary);
        # the first grammar waits for it.
        self.grammars = GrammarVocab(self.vocab, self.n_vocab)
        # With a vision projector: tokens as embedding rows, so an image's rows share the
        # streams' pass (token_rows.py); None where they would not give the same logits.
        self.token_rows = self._token_rows(config) if config.mmproj is not None else None

    # --- set-up -------------------------------------------------------------------

    @staticmethod
    def _gpu_layers(config: WorkerConfig) -> int:
        if not llama.llama_supports_gpu_offload():
            return 0
        return 999 if config.gpu_layers < 0 else config.gpu_layers

    @staticmethod
    def _sampling_place(config: WorkerConfig, model: ModelDescription) -> str:
        """Where eligible requests are sampled: "host" (sampling/samplers.py), "graph" (llama.cpp's
        chains inside llama_decode, backend_sampling.py) or "draw" (the host's C draw inside
        llama_decode, graph_draw.py).

        auto: "draw" where the output layer runs on the CPU (its logits are in host memory)
        and slots do not draft: the same tokens as the host sampler's, without llama.cpp's
        copy of every row's logits (docs/sampling.md); drafts are verified row by row on the
        host, so a drafting worker keeps the host sampler. Where the whole model runs on a
        GPU, the host too: on an H100 at 64 slots the host's C draw beat llama.cpp's chains in
        the graph at every mix (docs/gpu.md)."""
        mode = config.backend_sampling
        output_on_gpu = model.gpu_layers > model.n_layers
        if mode == "draw":
            if output_on_gpu:
                raise EngineError(
                    "--backend-sampling draw reads the logits in host memory; this model's "
                    "output layer runs on a GPU (use on or auto there)"
                )
            if graph_native() is None:
                raise EngineError(
                    "this build cannot draw inside llama_decode: it needs llama.cpp's "
                    "backend sampling and a llama.cpp whose layout loomserve has verified "
                    "(the warning above says which part is missing; docs/sampling.md)"
                )
            return "draw"
        if mode == "off":
            return "host"
        if mode == "auto" and not output_on_gpu:
            drawable = graph_native() is not None
            return "draw" if drawable and not config.speculates else "host"
        if mode == "auto":
            return "host"
        if not backend_sampling_available():
            if mode == "on":
                raise EngineError("this llama.cpp build has no backend sampling")
            return "host"
        return "graph"

    def _token_rows(self, config: WorkerConfig) -> TokenRows | None:
        assert self.model is not None  # loaded a moment ago, in __init__
        rows = TokenRows.load(config.model_path, self.model, self.description.architecture)
        if rows is None:
            return None
        self.batch.carry_embeddings(rows.n_embd)
        if not self.embeds_exactly(rows):
            log.info(
                "tokens written as embeddings do not give the tokens' logits: images go in "
                "passes of their own",
                model=config.model_path.name,
            )
            return None
        return rows

    def embeds_exactly(self, rows: TokenRows) -> bool:
        """Decode a few tokens as tokens, then as their rows, in sequence 0 (empty at start):
        whether the logits are the same, bit for bit."""
        tokens = [min(token, self.n_vocab - 1) for token in (1, 2, 30, 300, 3_000, 30_000)]
        logits = []
        for embedded in (False, True):
            self.batch.clear()
            self.batch.add_run(tokens, 0, 0, False, logits_on_all=True)
            if embedded:
                assert self.batch.embd is not None
                self.batch.embd[: len(tokens)] = rows.rows(np.array(tokens))
                self.batch.embedded = True
            code = self.decode(self.batch)
            if code == 0:
                logits.append(self.output_logits(len(tokens)).copy())
            self.keep_prefix(0, 0)
            if code != 0:
                break
        self.batch.clear()
        self.last_outputs = 0
        return len(logits) == 2 and bool(
            np.array_equal(logits[0].view(np.uint32), logits[1].view(np.uint32))
        )

    def _load_model(self, config: WorkerConfig) -> llama.llama_model_p:
        params = llama.llama_model_default_params()
        params.n_gpu_layers = self._gpu_layers(config)
        # Repacked weights compute one row (gemv) differently from blocks of four (gemm).
        params.use_extra_bufts = not config.batch_invariant
        if params.use_extra_bufts and amx_kernels():
            # Where llama.cpp was built for a CPU with AMX (pip builds it for the machine),
            # its AMX buffer type takes the quantized weights first, and its matmul crashes
            # the process on a Q4_K_M model (ggml_backend_amx_mul_mat, llama.cpp issue
            # #20824, open; seen with llama-cpp-python 0.3.36 on a Sapphire Rapids VM).
            # Without extra buffer types the weights stay as loaded: slower, never a crash.
            params.use_extra_bufts = False
            log.warning(
                "llama.cpp's AMX kernels crash on quantized weights (llama.cpp #20824): "
                "weights are not repacked, as with --batch-invariant",
                model=config.model_path.name,
            )
        progress = LoadProgress(config.model_path)
        params.progress_callback = progress.callback
        model = llama.llama_model_load_from_file(str(config.model_path).encode(), params)
        if not model:
            raise EngineError(f"llama.cpp could not load the model at {config.model_path}")
        return model

    def _new_context(self, config: WorkerConfig, backend_sampling: bool):
        params = llama.llama_context_default_params()
        fields = {entry[0] for entry in llama.llama_context_params._fields_}
        params.n_ctx = self.slot_context * config.slots
        params.n_batch = config.batch_tokens
        params.n_ubatch = config.batch_tokens
        params.n_seq_max = config.slots
        params.n_threads = config.n_threads
        params.n_threads_batch = config.n_threads
        params.no_perf = True
        if self._eval_callback is not None:
            params.cb_eval = self._eval_callback
        if backend_sampling and "n_outputs_max_per_seq" in fields:
            # One sampled token per sequence and pass (backend-sampled requests do not
            # draft), which keeps llama.cpp's random draws out of its transactional mode.
            params.n_outputs_max_per_seq = 1
        if "kv_unified" in fields:
            params.kv_unified = not config.batch_invariant
        if config.kv_cache_type != "f16" and config.flash_attn == "off":
            raise EngineError(
                "a quantized KV cache (--kv-cache-type q8_0) needs --flash-attn on or auto"
            )
        if "flash_attn_type" in fields:
            params.flash_attn_type = FLASH_ATTN_TYPES[config.flash_attn]
        else:  # llama-cpp-python before flash_attn_type: a plain switch, no "auto"
            params.flash_attn = config.flash_attn != "off"
        params.type_k = params.type_v = KV_TYPES[config.kv_cache_type]
        ctx = llama.llama_init_from_model(self.model, params)
        if not ctx:
            raise EngineError(
                f"llama.cpp could not create a context of {params.n_ctx} tokens for "
                f"{config.slots} slots with a {config.kv_cache_type} KV cache; its log above "
                f"says why (memory, or a head size the cache type cannot hold)"
            )
        return ctx

    @property
    def backend_sampling(self) -> bool:
        """Whether eligible requests sample inside llama_decode."""
        return self.sampling != "host"

    # --- per request ----------------------------------------------------------------

    def new_sampler(
        self, params: SamplingParams, grammar: GrammarState | None = None
    ) -> HostSampler | BackendSampler:
        """A fresh sampler for one request, with its grammar if it was compiled already;
        raises InvalidSampling on a bad grammar or bias."""
        return build_sampler(
            params,
            self.grammars,
            self.n_vocab,
            self.slot_context,
            self.graph_chains,
            self.graph_draws is not None,
            grammar,
        )

    def bind_graph_samplers(self, runs: list[Run]) -> None:
        """Before a pass: the backend samplers of the runs with outputs onto their
        sequences (nothing to do when backend sampling is off)."""
        if self.graph_chains is not None:
            self.graph_chains.bind(runs)
        if self.graph_draws is not None:
            self.graph_draws.bind(runs)

    def output_logits(self, n_outputs: int) -> np.ndarray:
        """The last decode's logits, one row per token that asked for them, in batch order:
        a view of llama.cpp's buffer, which holds a row for each output of the last
        successful decode (llama.h: llama_get_logits), so no more rows are ever read."""
        if not 0 <= n_outputs <= self.last_outputs:
            raise ValueError(
                f"{n_outputs} rows of logits asked; the last decode made {self.last_outputs}"
            )
        if n_outputs == 0:  # the buffer may not exist yet: read nothing
            return np.empty((0, self.n_vocab), dtype=np.float32)
        pointer = llama.llama_get_logits(self.ctx)
        if not pointer:
            raise RuntimeError("llama.cpp returned no logits for the last decode")
        return np.ctypeslib.as_array(pointer, shape=(n_outputs, self.n_vocab))

    def vocab_tokens(self) -> list[tuple[bytes, int]]:
        """Every token's (text, attribute bits) in id order, for protocol.vocab_fingerprint."""
        get_text, get_attr = llama.llama_vocab_get_text, llama.llama_vocab_get_attr
        return [
            (get_text(self.vocab, token) or b"", get_attr(self.vocab, token))
            for token in range(llama.llama_vocab_n_tokens(self.vocab))
        ]

    def is_eog(self, token: int) -> bool:
        # Asked once per sampled token: a dict lookup is a tenth of the C call through ctypes.
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(llama.llama_vocab_is_eog(self.vocab, token))
        return eog

    # --- per tick -----------------------------------------------------------------------

    def lend_threads(self, n: int) -> None:
        """The worker's own other work (the image encoder, media.py) runs on n threads from
        now on (0: it is done): the passes leave it that many, at least one for themselves.
        Called from that work's thread; the next pass applies it."""
        self._lent_threads = n

    def _govern_threads(self) -> None:
        """The passes' threads as the governor (threads.py) says, fewer while other processes
        take the worker's CPUs, and fewer by those lent to the image encoder."""
        most = self.config.n_threads
        wanted = self.threads.update() if self.threads is not None else most
        if self._lent_threads:
            wanted = max(1, min(wanted, most - self._lent_threads))
        if wanted != self._passes_threads:
            llama.llama_set_n_threads(self.ctx, wanted, wanted)
            self._passes_threads = wanted

    @contextlib.contextmanager
    def pass_running(self) -> Iterator[None]:
        """Around every llama_decode on the context, of tokens or of an image's embeddings:
        the governor reads from the passes whether the worker is idle (threads.py)."""
        if self.threads is None:
            yield
            return
        self.threads.pass_started()
        try:
            yield
        finally:
            self.threads.pass_ended()

    def decode(self, batch: TokenBatch) -> int:
        """One forward pass over the batch; llama_decode's return code (0 is success)."""
        self.last_outputs = 0
        self._govern_threads()
        with self.pass_running():
            code = llama.llama_decode(self.ctx, batch.active)
        if code == 0:  # the rows of logits output_logits may read
            self.last_outputs = int(np.count_nonzero(batch.logits[: batch.n_tokens]))
        return code

    # --- the KV cache -------------------------------------------------------------------

    def clear_cache(self) -> None:
        """Empty every sequence of the KV cache."""
        llama.llama_memory_clear(self.memory, True)

    def keep_prefix(self, seq: int, n_tokens: int, media: tuple[MediaSpan, ...] = ()) -> bool:
        """Drop a sequence's cells from prompt index n_tokens on; keep the prefix before it.
        media: the sequence's images, whose M-RoPE positions are fewer than their tokens
        (sched/media.py's rope_position; an index inside such an image drops all of it).

        False when the cache cannot cut the sequence there (some recurrent or sliding-window
        caches); the caller then drops the whole sequence.
        """
        return llama.llama_memory_seq_rm(self.memory, seq, rope_position(media, n_tokens), -1)

    def copy_prefix(
        self, source: int, target: int, n_tokens: int, media: tuple[MediaSpan, ...] = ()
    ) -> None:
        """Give `target` the source sequence's cells for prompt indices 0..n_tokens-1 (media:
        the images of that prefix, as keep_prefix's)."""
        end = rope_position(media, n_tokens)
        if self.config.batch_invariant:
            # Between KV streams llama.cpp copies only a whole stream (on the next decode);
            # the target then drops what lies past the prefix. A memory copy of one slot's
            # cache is far cheaper than evaluating the prefix again.
            llama.llama_memory_seq_cp(self.memory, source, target, -1, -1)
            llama.llama_memory_seq_rm(self.memory, target, end, -1)
        else:  # one cache: the cells are shared, nothing is copied
            llama.llama_memory_seq_cp(self.memory, source, target, 0, end)

    def drop_sequence(self, seq: int) -> None:
        llama.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def state_size(self, seq: int) -> int:
        """Bytes that save_sequence would take for this sequence."""
        return llama.llama_state_seq_get_size(self.ctx, seq)

    def save_sequence(self, seq: int) -> bytearray | None:
        """A copy of one sequence's cells in host memory (llama_state_seq_get_data); None when
        the sequence holds none or llama.cpp cannot save it."""
        size = self.state_size(seq)
        if size <= 0:
            return None
        # llama.cpp writes straight into the bytes we keep: no second copy, and no slicing
        # of a ctypes array (which builds a Python int per byte).
        state = bytearray(size)
        buffer = (ctypes.c_uint8 * size).from_buffer(state)
        written = llama.llama_state_seq_get_data(self.ctx, buffer, size, seq)
        del buffer  # the bytearray cannot shrink while a ctypes view of it lives
        if not written:
            return None
        del state[written:]
        return state

    def restore_sequence(self, seq: int, state: bytes | bytearray) -> bool:
        """Load a saved sequence into `seq`, which must hold no cells; False when it failed."""
        size = len(state)
        if isinstance(state, bytearray):  # read in place, not copied
            buffer = (ctypes.c_uint8 * size).from_buffer(state)
        else:
            buffer = (ctypes.c_uint8 * size).from_buffer_copy(state)
        return llama.llama_state_seq_set_data(self.ctx, buffer, size, seq) == size

    def seq_pos_max(self, seq: int) -> int:
        """The highest position the sequence holds in the cache; -1 when it holds none."""
        return llama.llama_memory_seq_pos_max(self.memory, seq)

    def kv_cells_total(self) -> int:
        return self.slot_context * self.n_slots

    def close(self) -> None:
        """Free the context and the model. The engine is unusable afterwards."""
        if self.graph_chains is not None:
            self.graph_chains.close()
        if self.graph_draws is not None:
            self.graph_draws.close()
        self.grammars.close()
        if self.threads is not None:
            self.threads.close()
        if self.ctx:
            llama.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama.llama_model_free(self.model)
            self.model = None


def describe(model, path: Path, gpu_layers: int) -> ModelDescription:
    """The model's identity, read from its metadata."""
    vocab = llama.llama_model_get_vocab(model)
    n_layers = llama.llama_model_n_layer(model)
    return ModelDescription(
        name=_meta(model, "general.name") or path.stem,
        architecture=_meta(model, "general.architecture") or "unknown",
        description=_desc(model),
        n_params=llama.llama_model_n_params(model),
        size_bytes=llama.llama_model_size(model),
        n_layers=n_layers,
        n_vocab=llama.llama_vocab_n_tokens(vocab),
        context_train=llama.llama_model_n_ctx_train(model),
        gpu_layers=min(gpu_layers, n_layers + 1),
    )


def float_weights(model) -> str | None:
    """The float type of the model's weight matrices (F32, F16, BF16), or None where they
    are quantized (or the file does not say)."""
    file_type = _meta(model, "general.file_type")
    return FLOAT_FILE_TYPES.get(int(file_type)) if file_type.isdigit() else None


def _meta(model, key: str) -> str:
    buffer = ctypes.create_string_buffer(256)
    n = llama.llama_model_meta_val_str(model, key.encode(), buffer, len(buffer))
    return buffer.value.decode(errors="replace") if n >= 0 else ""


def _desc(model) -> str:
    buffer = ctypes.create_string_buffer(256)
    llama.llama_model_desc(model, buffer, len(buffer))
    return buffer.value.decode(errors="replace")
