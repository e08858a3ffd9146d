"""Images in: a Generate's images tokenized and encoded by libmtmd, on a thread of its own.

A vision model's projector (--mmproj) turns each image into a run of embeddings that take
prompt positions like tokens. The MediaEncoder owns its own mtmd context (never the loop's),
and one thread that, per Generate with images, reads each image (stb_image, in libmtmd),
tokenizes it with mtmd_tokenize (how many positions it takes, and any begin/end tokens the
projector wraps it in, depend on the projector and the image) and encodes it. The loop hears
of the result through its Inbox, so decode ticks go on while an image is encoded. An image
file seen lately (a follow-up turn's) is taken from an LRU cache of encoded images instead.

The result is an EncodedPrompt: the prompt as the scheduler sees it, where every position of
an image holds a placeholder (sched/media.py: a negative id made from its content hash,
never a real token), and a MediaSpan per image with its embeddings. EmbeddingBatch
puts those in the KV cache, in passes of their own.
"""

from __future__ import annotations

import ctypes
import hashlib
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import llama_cpp as llama
import numpy as np
import structlog
from llama_cpp import mtmd_cpp as mtmd

from ...protocol import Generate, ImageTokens, ImageTokensQuery, Message
from ..sched.media import MediaSpan, placeholders

log = structlog.get_logger(__name__)

# Encoded images kept for a follow-up turn that sends the same file again (by its bytes'
# hash), least recently used dropped first: embeddings take n_tokens * n_embd * 4 bytes.
ENCODED_CACHE_BYTES = 256 * 1024 * 1024

Piece = list[int] | MediaSpan  # text tokens, or an image (its span placed at start 0)


class MediaError(Exception):
    """An image that cannot be read or encoded: the request is refused, nothing else."""


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    """A Generate's prompt with its images in place: placeholders in `tokens`, embeddings in
    `media` (in prompt order)."""

    tokens: list[int]
    media: tuple[MediaSpan, ...]
    encode_seconds: float  # on the encoder's thread, reading and tokenizing included
    cached_images: int = 0  # images found in the encoded cache, not encoded again


Done = Callable[[bytes, Generate, EncodedPrompt | None, str], None]
Answer = Callable[[bytes, Message], None]  # a reply to a gateway, from the encoder's thread


class MediaEncoder:
    """The projector and its thread: submit() a Generate with images, and `done` is called
    on that thread with its EncodedPrompt, or None and why it failed."""

    def __init__(
        self,
        mmproj: Path,
        model: llama.llama_model_p,
        threads: int,
        use_gpu: bool,
        done: Done,
        lend: Callable[[int], None] | None = None,
    ) -> None:
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        # On the CPU an image's encoding takes half the worker's threads, lent to it by the
        # passes (`lend`) while it runs: the streams' passes go on, on the other half. With
        # all of them both sides' threads outnumbered the cores, and a pass's threads spun at
        # every barrier for a partner the encoder had displaced.
        self.threads = max(1, threads if use_gpu else threads // 2)
        params.n_threads = self.threads
        self._lend = lend
        params.print_timings = False
        params.warmup = True
        self.ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), model, params)
        if not self.ctx:
            raise ValueError(f"libmtmd cannot load the projector {mmproj} for this model")
        if not mtmd.mtmd_support_vision(self.ctx):
            self.close()
            raise ValueError(f"{mmproj} is no vision projector (audio only)")
        # Qwen-VL's images: four positions a row, and fewer positions than rows (sched/media.py).
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self.ctx))
        # Gemma 3's images attend both ways: each goes whole into one pass (the loop's part).
        self.non_causal = bool(mtmd.mtmd_decode_use_non_causal(self.ctx, None))
        self.n_embd = llama.llama_model_n_embd_inp(model)  # the width of one embedding row
        self.marker = (mtmd.mtmd_default_marker() or b"<__media__>").decode()
        self._done = done
        self._encoded: OrderedDict[bytes, list[Piece]] = OrderedDict()  # the thread's only
        self._encoded_bytes = 0
        # Where counts go (the IO's outbox; set once the IO exists: worker/server.py).
        self.answer: Answer | None = None
        self._queue: queue.SimpleQueue[tuple[bytes, Generate | ImageTokensQuery] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="media-encoder", daemon=True)
        self._thread.start()

    def submit(self, gateway: bytes, generate: Generate) -> None:
        self._queue.put((gateway, generate))

    def submit_count(self, gateway: bytes, query: ImageTokensQuery) -> None:
        """Count the query's images on the thread (after the work before it); the ImageTokens
        goes to `answer`."""
        self._queue.put((gateway, query))

    def close(self) -> None:
        """Stop the thread (after the work it has) and free the context."""
        thread = getattr(self, "_thread", None)
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout=30)
        if self.ctx:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None

    # --- the encoder's thread -----------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            gateway, generate = item
            if isinstance(generate, ImageTokensQuery):
                self._answer_count(gateway, generate)
                continue
            if self._lend is not None:
                self._lend(self.threads)
            try:
                encoded, why = self.encode(generate), ""
            except MediaError as exc:
                encoded, why = None, str(exc)
            except Exception as exc:  # a bug must cost this request only
                log.exception("image encoding failed", request_id=generate.request_id)
                encoded, why = None, f"the image could not be encoded: {exc}"
            finally:
                if self._lend is not None:
                    self._lend(0)
            self._done(gateway, generate, encoded, why)

    def _answer_count(self, gateway: bytes, query: ImageTokensQuery) -> None:
        try:
            answer = ImageTokens(query.query_id, self.count(query.images))
        except MediaError as exc:
            answer = ImageTokens(query.query_id, [], str(exc))
        except Exception as exc:  # a bug must cost this query only
            log.exception("image counting failed", query_id=query.query_id)
            answer = ImageTokens(query.query_id, [], f"the images could not be counted: {exc}")
        if self.answer is not None:
            self.answer(gateway, answer)

    def count(self, images: list[bytes]) -> list[int]:
        """How many prompt positions each image takes, as encode() places it (its tokens and
        the projector's begin and end tokens), read and tokenized but not encoded."""
        counts = []
        for index, image in enumerate(images):
            pieces = self._encoded.get(hashlib.sha256(image).digest())
            if pieces is not None:
                counts.append(sum(_positions(piece) for piece in pieces))
                continue
            chunks, bitmap = self._tokenized(index, image)
            try:
                counts.append(
                    sum(
                        mtmd.mtmd_input_chunk_get_n_tokens(mtmd.mtmd_input_chunks_get(chunks, i))
                        for i in range(mtmd.mtmd_input_chunks_size(chunks))
                    )
                )
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                mtmd.mtmd_bitmap_free(bitmap)
        return counts

    def encode(self, generate: Generate) -> EncodedPrompt:
        """The Generate's prompt with its images read, tokenized and encoded in place."""
        started = time.perf_counter()
        tokens: list[int] = []
        media: list[MediaSpan] = []
        taken = cached = 0
        for index, (image, at) in enumerate(zip(generate.images, generate.image_at, strict=True)):
            tokens += generate.prompt_tokens[taken:at]
            taken = at
            pieces, hit = self._cached_pieces(index, image)
            cached += hit
            for piece in pieces:
                if isinstance(piece, list):
                    tokens += piece
                else:
                    media.append(replace(piece, start=len(tokens)))
                    tokens += placeholders(piece.image_hash, piece.n_tokens)
        tokens += generate.prompt_tokens[taken:]
        seconds = time.perf_counter() - started
        return EncodedPrompt(tokens, tuple(media), seconds, cached)

    def _cached_pieces(self, index: int, image: bytes) -> tuple[list[Piece], bool]:
        """The image's pieces, from the encoded cache when the same file was seen lately."""
        key = hashlib.sha256(image).digest()
        pieces = self._encoded.get(key)
        if pieces is not None:
            self._encoded.move_to_end(key)
            return pieces, True
        pieces = self._pieces(index, image)
        size = sum(_nbytes(piece) for piece in pieces)
        if size <= ENCODED_CACHE_BYTES:
            self._encoded[key] = pieces
            self._encoded_bytes += size
            while self._encoded_bytes > ENCODED_CACHE_BYTES:
                _, dropped = self._encoded.popitem(last=False)
                self._encoded_bytes -= sum(_nbytes(p) for p in dropped)
        return pieces, False

    def _pieces(self, index: int, image: bytes) -> list[Piece]:
        """One image as mtmd_tokenize cuts it: text tokens around it (the projector's begin
        and end markers, if any), and its embeddings with its hash."""
        chunks, bitmap = self._tokenized(index, image)
        try:
            return [
                self._piece(index, chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))
            ]
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def _tokenized(self, index: int, image: bytes) -> tuple[int, int]:
        """The image read (stb_image) and cut by mtmd_tokenize: its chunks and its bitmap,
        both the caller's to free."""
        buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(image), False)
        if not bitmap:
            raise MediaError(f"image {index} is not an image this server can read")
        chunks = mtmd.mtmd_input_chunks_init()
        marker = self.marker.encode()
        text = mtmd.mtmd_input_text(marker, len(marker), False, True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        if mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)
            raise MediaError(f"image {index} could not be preprocessed")
        return chunks, bitmap

    def _piece(self, index: int, chunks: int, i: int) -> Piece:
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t(0)
            ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            return [int(ids[j]) for j in range(n.value)]
        if kind != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            raise MediaError(f"image {index}: the projector made a chunk of kind {kind}")
        n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        if mtmd.mtmd_encode_chunk(self.ctx, chunk) != 0:
            raise MediaError(f"image {index} could not be encoded")
        out = mtmd.mtmd_get_output_embd(self.ctx)
        rows = np.ctypeslib.as_array(out, shape=(n_tokens * self.n_embd,)).copy()
        image_hash = (mtmd.mtmd_input_chunk_get_id(chunk) or b"").decode()
        if not image_hash:
            raise MediaError(f"image {index} has no content hash")
        embeddings = rows.reshape(n_tokens, self.n_embd)
        if not self.mrope:
            return MediaSpan(0, embeddings, image_hash)
        n_pos = mtmd.mtmd_input_chunk_get_n_pos(chunk)
        return MediaSpan(0, embeddings, image_hash, n_pos, self._rope_rows(chunk, n_tokens))

    def _rope_rows(self, chunk: int, n_tokens: int) -> np.ndarray:
        """Each row's M-RoPE positions (t, y, x, z), as mtmd_helper_decode_image_chunk lays
        them out (libmtmd's decoder positions): [0] for the image at rope position 0, [1]
        what one position further adds (z, for one, stays put)."""
        image = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
        rows = np.zeros((2, n_tokens, 4), dtype=np.int32)
        for i in range(n_tokens):
            at0 = mtmd.mtmd_image_tokens_get_decoder_pos(image, 0, i)
            at1 = mtmd.mtmd_image_tokens_get_decoder_pos(image, 1, i)
            rows[0, i] = (at0.t, at0.y, at0.x, at0.z)
            rows[1, i] = (at1.t - at0.t, at1.y - at0.y, at1.x - at0.x, at1.z - at0.z)
        return rows


def _positions(piece: Piece) -> int:
    return len(piece) if isinstance(piece, list) else piece.n_tokens


def _nbytes(piece: Piece) -> int:
    return 0 if isinstance(piece, list) else int(piece.embeddings.nbytes)


class EmbeddingBatch:
    """A reusable llama_batch of embedding rows: llama.cpp takes a batch of all tokens or
    all embeddings, so images go through passes of their own (the loop's media step)."""

    def __init__(self, ctx: llama.llama_context_p, capacity: int, n_embd: int) -> None:
        self.ctx, self.capacity, self.n_embd = ctx, capacity, n_embd
        self.struct = llama.llama_batch_init(capacity, n_embd, 1)
        # M-RoPE's four positions a row, section-major (all t, all y, all x, all z), as
        # llama.cpp reads an embedding batch's pos: in place of the batch's own pos array
        # (llama_batch_init makes one a row) while such a pass runs.
        self._rope_pos = np.zeros(4 * capacity, dtype=np.int32)
        self._freed = False

    def decode(
        self,
        rows: np.ndarray,
        first_pos: int,
        seq: int,
        non_causal: bool,
        rope: np.ndarray | None = None,
    ) -> int:
        """Put rows in seq's cells from first_pos on, in passes of at most `capacity` (one
        pass for a non-causal image: the caller checks it fits); llama_decode's code. With
        rope (M-RoPE: each row's t, y, x, z, n x 4) those are the rows' positions instead."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if non_causal:
            llama.llama_set_causal_attn(self.ctx, False)
        own_pos = self.struct.pos
        try:
            for offset in range(0, rows.shape[0], self.capacity):
                part = rows[offset : offset + self.capacity]
                self._fill(part, first_pos + offset, seq)
                if rope is not None:
                    self._fill_rope(rope[offset : offset + part.shape[0]])
                code = llama.llama_decode(self.ctx, self.struct)
                if code != 0:
                    return code
            return 0
        finally:
            self.struct.pos = own_pos  # llama_batch_free frees it
            if non_causal:
                llama.llama_set_causal_attn(self.ctx, True)

    def _fill_rope(self, positions: np.ndarray) -> None:
        n = positions.shape[0]
        self._rope_pos[: 4 * n] = np.ascontiguousarray(positions.T, dtype=np.int32).ravel()
        self.struct.pos = self._rope_pos.ctypes.data_as(ctypes.POINTER(llama.llama_pos))

    def _fill(self, rows: np.ndarray, first_pos: int, seq: int) -> None:
        batch, n = self.struct, rows.shape[0]
        ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
        for i in range(n):
            batch.pos[i] = first_pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 0  # no row of an image is sampled from
        batch.n_tokens = n

    def close(self) -> None:
        if not self._freed:
            llama.llama_batch_free(self.struct)
            self._freed = True
