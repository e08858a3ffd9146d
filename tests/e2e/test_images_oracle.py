"""The oracle for images: llama.cpp's own llama-server, built from the same llama.cpp, with the
same tiny model, the same tiny projector (--mmproj, each projector type: LLaVA's, Gemma 3's,
and Qwen2-VL's with its M-RoPE text model) and the same image, answers greedily with the same
tokens as loomserve.

What makes the two comparable: the tiny model ships no chat template, and both servers then
render ChatML (llama-server's fallback, and loomserve's for an architecture without a built-in
one), each image part as the projector's media marker in the user's text, the text tokenized
around it with BOS once; both then run libmtmd's mtmd_tokenize and mtmd_encode_chunk on the
image. So the prompts are the same (usage.prompt_tokens is compared too) and temperature 0
makes both greedy. llama-server's generated token ids (its /completion on that ChatML prompt,
its own chat checked to render the same) are compared with loomserve's tokens, read from its
chat logprobs as bytes (loomserve's name no ids): token by token, each id's piece.

Skipped unless LOOMSERVE_LLAMA_SERVER names a llama-server binary (as the bench tests are).
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loomserve.gateway.text.tokenizer import Vocab
from tests.procs import (
    free_port,
    llama_server_binary,
    start_gateway,
    start_other_server,
    start_worker,
    stop_other_server,
)
from tests.tiny_vision_model import png_bytes, write_tiny_qwen2vl

MAX_TOKENS = 16
# ignore_eos differs: llama-server never samples an end-of-generation token, loomserve (as
# vLLM) may sample one and go on. The end of sequence (id 2) is kept out of both greedy runs.
NO_EOS = {"2": -100}


def start_llama_server(model: Path, mmproj: Path) -> tuple[subprocess.Popen, str, Path]:
    """llama-server on 127.0.0.1 with the projector, one thread, ready to answer."""
    port = free_port()
    args = [llama_server_binary(), "-m", str(model), "--mmproj", str(mmproj)]
    args += ["--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "1024", "-t", "1"]
    args += ["--no-webui", "--no-mmproj-offload"]
    proc, log = start_other_server(args, port, "llama-server-mmproj")
    return proc, f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module", params=["mlp", "gemma3", "qwen2vl"])
def servers(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_path: Path,
    tiny_mmproj_path: Path,
    tiny_gemma3_mmproj_path: Path,
) -> Iterator[tuple[str, str]]:
    """(loomserve's gateway URL, llama-server's URL), both with the param's projector (and
    for qwen2vl its own text model: M-RoPE)."""
    model = tiny_model_path
    if request.param == "qwen2vl":
        model, mmproj = write_tiny_qwen2vl(tmp_path_factory.mktemp("qwen2vl"))
    else:
        mmproj = tiny_mmproj_path if request.param == "mlp" else tiny_gemma3_mmproj_path
    llama_server_binary()  # skipped before anything starts
    llama, llama_url, log = start_llama_server(model, mmproj)
    try:
        with (
            start_worker(model, slots=2, ctx_size=1024, mmproj=mmproj) as worker,
            start_gateway(model, worker.endpoint) as gateway,
        ):
            yield gateway.url, llama_url
            print("logs:", worker.log_path, gateway.log_path, log)
    finally:
        stop_other_server(llama)


def greedy(url: str, content: list[dict[str, Any]]) -> tuple[list[bytes], str, int]:
    """loomserve's chat at temperature 0: each generated token's bytes (its logprobs), the
    text, and the prompt's token count."""
    body = {  # no model: the one each server serves
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": NO_EOS,
        "logprobs": True,
    }
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    tokens = [bytes(entry["bytes"]) for entry in choice["logprobs"]["content"]]
    return tokens, choice["message"]["content"], answer.json()["usage"]["prompt_tokens"]


def llama_greedy(url: str, images: list[str], text: str) -> tuple[list[int], str, int]:
    """llama-server's /completion at temperature 0 on the ChatML prompt both servers render,
    its media marker (random per process: /props names it) for each image: the generated
    token ids, the text, and the prompt's token count. (Its chat logprobs would merge the
    byte tokens of one character into one entry, so its ids come from here.)"""
    marker = httpx.get(url + "/props", timeout=10).json()["media_marker"]
    prompt = f"<|im_start|>user\n{marker * len(images)}{text}<|im_end|>\n<|im_start|>assistant\n"
    body = {
        "prompt": {"prompt_string": prompt, "multimodal_data": images},
        "n_predict": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": [[2, -100]],
        "return_tokens": True,
        "cache_prompt": False,
    }
    answer = httpx.post(url + "/completion", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    found = answer.json()
    return found["tokens"], found["content"], found["tokens_evaluated"]


def llama_chat_text(url: str, content: list[dict[str, Any]]) -> str:
    """llama-server's own chat at temperature 0: its template rendered the prompt above."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": NO_EOS,
    }
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def vocab(tiny_model_path: Path) -> Iterator[Vocab]:
    found = Vocab(tiny_model_path)  # the qwen2vl model's vocabulary is the same
    yield found
    found.close()


def image_part(image: bytes) -> dict[str, Any]:
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


CASES = {
    "one image": [(40, 24, 1)],
    "square": [(32, 32, 3)],
    "two images": [(32, 32, 5), (24, 48, 6)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_llama_servers(
    servers: tuple[str, str], vocab: Vocab, case: str
) -> None:
    loomserve, llama_server = servers
    images = [png_bytes(w, h, seed=seed) for w, h, seed in CASES[case]]
    text = "what is in the picture?"
    content = [*map(image_part, images), {"type": "text", "text": text}]
    ours = greedy(loomserve, content)
    encoded = [base64.b64encode(image).decode() for image in images]
    ids, their_text, their_prompt = llama_greedy(llama_server, encoded, text)
    assert ours[2] == their_prompt, "the prompts differ in length"
    assert len(ids) == MAX_TOKENS
    assert ours[0] == [vocab.piece(token) for token in ids]
    assert ours[1] == their_text
    # Its chat renders the same prompt (it drops the bytes of a last token that ends inside a
    # character, which its /completion and loomserve end with U+FFFD).
    chat_text = llama_chat_text(llama_server, content)
    assert chat_text.rstrip("\ufffd") == their_text.rstrip("\ufffd")


def test_the_image_changes_the_answer(servers: tuple[str, str]) -> None:
    # Otherwise the oracle above would hold for a server that dropped the image.
    loomserve, _ = servers
    text = {"type": "text", "text": "what is in the picture?"}
    one = greedy(loomserve, [image_part(png_bytes(32, 32, seed=8)), text])
    two = greedy(loomserve, [image_part(png_bytes(32, 32, seed=9)), text])
    assert one[0] != two[0]
