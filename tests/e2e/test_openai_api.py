"""What applications send beyond one prompt and one answer, through the official `openai` client
against a real worker on the tiny model: `n`, prompt lists, and the HTTP extras."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from loomserve.worker.cache.prefix_cache import usable_prefix
from tests.procs import Proc, Samples, free_port, scrape_metrics, start_gateway, start_worker

SLOTS = 4
MAX_QUEUE = 2
MODEL = "tiny-llama"
ORIGIN = "https://app.example"
LONG_PROMPT = " ".join(["the cat and the dog sat by a small house"] * 5)  # 50 words


@pytest.fixture(scope="module")
def worker_metrics_url() -> str:
    return f"http://127.0.0.1:{free_port()}/metrics"


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path, worker_metrics_url: str) -> Iterator[Proc]:
    port = int(worker_metrics_url.split(":")[-1].split("/")[0])
    with (
        start_worker(
            tiny_model_path, slots=SLOTS, max_queue=MAX_QUEUE, ctx_size=512, metrics_port=port
        ) as worker,
        start_gateway(tiny_model_path, worker.endpoint, allowed_origins=[ORIGIN]) as proc,
    ):
        print("logs:", worker.log_path, proc.log_path)
        yield proc


def client(gateway: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def complete(gateway: Proc, prompt: object, **fields: object):
    fields = {"max_tokens": 12, "temperature": 0, **fields}
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}  # type: ignore[dict-item]
    return client(gateway).completions.create(
        model=MODEL, prompt=prompt, extra_body=extra, **fields
    )


def wait_all_slots_free(gateway: Proc, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(gateway.url + "/health").json()
        if health.get("slots_idle") == SLOTS and health.get("queue_depth") == 0:
            return
        assert time.monotonic() < deadline, f"slots still busy: {health}"
        time.sleep(0.05)


def moved(before: Samples, after: Samples, name: str) -> float:
    return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)


# --- n and prompt lists -----------------------------------------------------------------


def test_greedy_n_choices_equal_the_single_request(gateway: Proc) -> None:
    single = complete(gateway, "once upon a time")
    result = complete(gateway, "once upon a time", n=3)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert {c.text for c in result.choices} == {single.choices[0].text}
    usage, one = result.usage, single.usage
    assert usage.prompt_tokens == one.prompt_tokens  # the prompt counts once, as OpenAI's
    assert usage.completion_tokens == 3 * one.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_sampled_n_choices_differ_and_repeat_with_a_seed(gateway: Proc) -> None:
    def texts() -> list[str]:
        result = complete(gateway, "hello world", n=4, temperature=1.0, seed=5, max_tokens=16)
        return [c.text for c in result.choices]

    first = texts()
    assert len(set(first)) > 1
    assert texts() == first


def test_prompt_list_choices_are_prompt_major(gateway: Proc) -> None:
    prompts = ["hello world", "what is the answer"]
    singles = [complete(gateway, p).choices[0].text for p in prompts]
    result = complete(gateway, prompts, n=2)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == [singles[0]] * 2 + [singles[1]] * 2
    ids = [[5, 6, 7], [8, 9]]
    by_ids = complete(gateway, ids)
    assert len(by_ids.choices) == 2
    assert by_ids.usage.prompt_tokens == 5
    assert [c.text for c in by_ids.choices] == [complete(gateway, t).choices[0].text for t in ids]


def test_streamed_choices_carry_their_index(gateway: Proc) -> None:
    whole = complete(gateway, ["tell me a story", "one two three four"], n=2)
    stream = complete(
        gateway,
        ["tell me a story", "one two three four"],
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes = ["", "", "", ""], [None, None, None, None]
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert finishes == ["length"] * 4
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 4 * 12


def test_chat_n_choices_stream_their_roles(gateway: Proc) -> None:
    messages = [{"role": "user", "content": "hello"}]
    chat = client(gateway).chat.completions
    whole = chat.create(model=MODEL, messages=messages, n=2, max_tokens=8, temperature=0)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].message.content == whole.choices[1].message.content
    stream = chat.create(
        model=MODEL, messages=messages, n=2, max_tokens=8, temperature=0, stream=True
    )
    roles, texts = set(), ["", ""]
    for chunk in stream:
        (choice,) = chunk.choices
        if choice.delta.role:
            roles.add(choice.index)
        texts[choice.index] += choice.delta.content or ""
    assert roles == {0, 1}
    assert texts == [c.message.content for c in whole.choices]


def test_copies_of_a_prompt_share_its_prefill(gateway: Proc, worker_metrics_url: str) -> None:
    """The n copies take the first one's cached prompt instead of evaluating it again."""
    wait_all_slots_free(gateway)
    before = scrape_metrics(worker_metrics_url)
    result = complete(gateway, LONG_PROMPT, n=3, max_tokens=4)
    after = scrape_metrics(worker_metrics_url)
    prompt_len = result.usage.prompt_tokens
    assert prompt_len > 40
    hits = moved(before, after, "loomserve:prefix_cache_hits_total")
    # Each copy reuses all but the tail whose kernels must run as they did for the first
    # (usable_prefix; the worker's default chunk of 512 tokens): the last 2 or 64 tokens.
    assert hits >= 2 * usable_prefix(prompt_len, prompt_len, 512) >= 2 * (prompt_len - 64)
    assert moved(before, after, "loomserve:prefix_cache_queries_total") == 3 * prompt_len


def test_the_queue_bound_takes_a_group_whole(gateway: Proc, worker_metrics_url: str) -> None:
    """More choices than slots and queue hold: 503, and none of them is left running."""
    wait_all_slots_free(gateway)
    # The copies follow the first choice: even with its slot free again, one too many.
    # Nearly the whole context each, so no choice ends while a busy gateway still sends the
    # others (with 200 tokens, one CI run saw all 8 served one after another).
    too_many = SLOTS + MAX_QUEUE + 2
    response = httpx.post(
        gateway.url + "/v1/completions",
        json={"prompt": "hello", "n": too_many, "max_tokens": 500, "ignore_eos": True},
        timeout=30,
    )
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "queue_full"
    wait_all_slots_free(gateway)
    # The worker counts a gateway's requests open until their finishes go out, a moment
    # after its slots read free, so a group that just fits may still meet the rejected one's
    # last (a 503 with Retry-After, which a client retries). Left running, they would hold
    # the count for good.
    deadline = time.monotonic() + 3.0
    while True:
        try:
            fits = complete(gateway, "hello", n=SLOTS + MAX_QUEUE, max_tokens=4)
            break
        except openai.InternalServerError as error:
            assert "queue_full" in str(error) and time.monotonic() < deadline, error
            time.sleep(0.1)
    assert len(fits.choices) == SLOTS + MAX_QUEUE


def test_a_client_leaving_cancels_every_choice(gateway: Proc) -> None:
    wait_all_slots_free(gateway)
    body = {"prompt": "hello", "n": 3, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as response:
        events = (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data"))
        assert {next(events)["choices"][0]["index"] for _ in range(6)} <= {0, 1, 2}
    wait_all_slots_free(gateway)


# --- logprobs and echo ------------------------------------------------------------------


def test_completion_logprobs_greedy_token_tops_its_list(gateway: Proc) -> None:
    result = complete(gateway, "the cat and the dog", logprobs=3)
    choice = result.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert len(lp.token_logprobs) == result.usage.completion_tokens == 12
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and len(top) <= 3
        assert logprob == pytest.approx(max(top.values()))
        assert top[token] == pytest.approx(logprob)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    stream = complete(gateway, "the cat and the dog", logprobs=3, stream=True)
    streamed = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs]
    # A second run takes the prompt from the prefix cache: the same tokens, logits within noise.
    streamed_logprobs = [t for s in streamed for t in s.token_logprobs]
    assert streamed_logprobs == pytest.approx(lp.token_logprobs, abs=1e-3)
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    plain = complete(gateway, "the cat and the dog")
    assert plain.choices[0].logprobs is None and plain.choices[0].text == choice.text


def test_chat_logprobs_with_n_and_streaming(gateway: Proc) -> None:
    chat = client(gateway).chat.completions
    fields = {"model": MODEL, "max_tokens": 8, "temperature": 0, "logprobs": True}
    messages = [{"role": "user", "content": "hello"}]
    result = chat.create(messages=messages, n=2, top_logprobs=2, **fields)
    for choice in result.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        for entry in content:
            assert len(entry.top_logprobs) == 2
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
            assert bytes(entry.bytes).decode(errors="replace") == entry.token
    first, second = (c.logprobs.content for c in result.choices)
    assert [e.token for e in first] == [e.token for e in second]
    assert [e.logprob for e in first] == pytest.approx([e.logprob for e in second], abs=1e-3)
    stream = chat.create(messages=messages, stream=True, **fields)
    entries = [e for c in stream if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx(
        [e.logprob for e in result.choices[0].logprobs.content], abs=1e-3
    )
    assert all(e.top_logprobs == [] for e in entries)  # top_logprobs defaults to 0


def test_logprobs_follow_the_logit_bias(gateway: Proc) -> None:
    favoured = 7
    result = complete(gateway, "hello", max_tokens=3, logprobs=1, logit_bias={str(favoured): 50})
    lp = result.choices[0].logprobs
    assert all(v > -0.01 for v in lp.token_logprobs)  # the biased token is near certain


def test_echo_prepends_the_prompt(gateway: Proc) -> None:
    plain = complete(gateway, "one two three", max_tokens=6)
    echoed = complete(gateway, "one two three", max_tokens=6, echo=True)
    assert echoed.choices[0].text == "one two three" + plain.choices[0].text
    stream = complete(gateway, "one two three", max_tokens=6, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(gateway: Proc) -> None:
    prompt = "the cat and the dog"
    result = complete(gateway, prompt, max_tokens=6, echo=True, logprobs=2)
    choice = result.choices[0]
    lp = choice.logprobs
    n_prompt = result.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # texts may coincide
    assert "".join(lp.tokens[:n_prompt]).strip() == prompt
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # The generated part is what the same request without echo gives.
    plain = complete(gateway, prompt, max_tokens=6, logprobs=2).choices[0]
    assert choice.text == prompt + plain.text
    assert lp.tokens[n_prompt:] == plain.logprobs.tokens
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-3)

    stream = list(complete(gateway, prompt, max_tokens=6, echo=True, logprobs=2, stream=True))
    opening = stream[0].choices[0]
    assert opening.text == prompt and opening.logprobs.tokens == lp.tokens[:n_prompt]
    streamed = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in stream) == choice.text
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    values = [v for s in streamed for v in s.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_scoring_a_text_with_max_tokens_0_matches_generating_from_each_prefix(
    gateway: Proc,
) -> None:
    """lm-eval-harness's loglikelihood: token ids, echo, logprobs, max_tokens 0. Each prompt
    position's scores are those of the first token generated from the prompt before it."""
    text = {"content": "the cat and the dog sat by", "add_special": True}
    ids = httpx.post(gateway.url + "/tokenize", json=text).json()["tokens"]
    scored = complete(gateway, ids, max_tokens=0, echo=True, logprobs=5)
    choice = scored.choices[0]
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == scored.usage.prompt_tokens
    assert choice.text.endswith("".join(lp.tokens))  # the text writes out BOS: "<s>"
    for j in range(1, len(ids)):
        first = complete(gateway, ids[:j], max_tokens=1, logprobs=5).choices[0].logprobs
        top, expected = lp.top_logprobs[j], first.top_logprobs[0]
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-3)
        if first.tokens[0] == lp.tokens[j]:  # the prompt token is the greedy one
            assert lp.token_logprobs[j] == pytest.approx(first.token_logprobs[0], abs=1e-3)
            assert lp.token_logprobs[j] == pytest.approx(max(top.values()))
        else:
            assert lp.token_logprobs[j] < max(top.values())
    # max_tokens 1 (lm-eval sends that and drops the last token), n choices, a stream: the
    # prompt's scores are the same in each.
    stream = list(complete(gateway, ids, max_tokens=1, echo=True, logprobs=5, n=2, stream=True))
    for index in (0, 1):
        chunks = [c.choices[0] for c in stream if c.choices and c.choices[0].index == index]
        values = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
        assert len(values) == len(ids) + 1 and values[0] is None
        assert values[1 : len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
        assert chunks[-1].finish_reason == "length"
    echo_only = complete(gateway, "one two", max_tokens=0, echo=True)
    assert echo_only.choices[0].text == "one two" and echo_only.choices[0].logprobs is None
    assert echo_only.usage.completion_tokens == 0


# --- HTTP extras ------------------------------------------------------------------------


def test_request_id_is_echoed_and_names_the_response(gateway: Proc) -> None:
    body = {"prompt": "hello", "max_tokens": 2}
    response = httpx.post(
        gateway.url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-42"}
    )
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"
    fresh = httpx.post(gateway.url + "/v1/completions", json=body)
    assert fresh.json()["id"] == "cmpl-" + fresh.headers["x-request-id"]
    assert httpx.get(gateway.url + "/health").headers["x-request-id"]
    assert "trace-42" in gateway.logs()


def test_cors_preflight_and_headers(gateway: Proc) -> None:
    preflight = httpx.options(
        gateway.url + "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    models = httpx.get(gateway.url + "/v1/models", headers={"Origin": ORIGIN})
    assert models.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(gateway.url + "/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_model_by_id(gateway: Proc) -> None:
    model = client(gateway).models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client(gateway).models.retrieve("gpt-4")


def test_model_info_metric(gateway: Proc, worker_metrics_url: str) -> None:
    assert (
        scrape_metrics(gateway.url + "/metrics")[("loomserve:model_info", (("model_name", MODEL),))]
        == 1
    )
    worker = scrape_metrics(worker_metrics_url)
    (labels,) = [dict(key) for name, key in worker if name == "loomserve:worker_info"]
    assert labels["slots"] == str(SLOTS) and labels["architecture"] == "llama"
    assert labels["model_name"] == MODEL  # the name the gateways serve it under
