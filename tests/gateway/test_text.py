"""The gateway's text handling on the tiny model's real vocabulary: tokens, UTF-8, stops, chat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llama_cpp import llama_vocab_get_text
from structlog.testing import capture_logs

from loomserve.gateway.api.errors import APIError
from loomserve.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from loomserve.gateway.request.params import max_new_tokens, sampling_params, stop_strings
from loomserve.gateway.text.chat_template import (
    CHATML_TEMPLATE,
    BuiltinChatTemplate,
    ChatTemplate,
    ChatTemplateError,
    builtin_templates,
    choose_template,
    load_override,
)
from loomserve.gateway.text.stop import StopMatcher
from loomserve.gateway.text.tokenizer import IncrementalDetokenizer, Vocab
from loomserve.gateway.tools.template import TemplateTools
from tests.grammars import grammar_accepts


@pytest.fixture(scope="module")
def vocab(tiny_model_path: Path) -> Vocab:
    vocab = Vocab(tiny_model_path)
    yield vocab
    vocab.close()


def byte_token(vocab: Vocab, byte: int) -> int:
    """The id of the SentencePiece byte token <0xNN>."""
    name = f"<0x{byte:02X}>".encode()
    token = next(t for t in range(vocab.n_tokens) if llama_vocab_get_text(vocab.vocab, t) == name)
    assert vocab.piece(token) == bytes([byte])
    return token


def test_vocab_basics(vocab: Vocab) -> None:
    assert vocab.n_tokens > 500
    assert (vocab.bos_id, vocab.eos_id) == (1, 2)
    assert (vocab.bos_text, vocab.eos_text) == ("<s>", "</s>")
    assert vocab.chat_template is None  # the tiny model ships none
    tokens = vocab.tokenize("hello world", add_special=True)
    assert tokens[0] == vocab.bos_id
    assert vocab.detokenize(tokens) == "<s> hello world"
    assert vocab.tokenize("hello world", add_special=False) == tokens[1:]
    # EOS renders as nothing in generated text, and as itself in /detokenize.
    assert vocab.piece(vocab.eos_id) == b""
    assert vocab.text_of(vocab.eos_id) == "</s>"


def test_llama_cpps_lines_go_through_structlog_not_raw_to_stderr(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """llama-cpp-python's own log callback prints llama.cpp's warnings and errors raw on
    stderr (each start printed the default model's token-type warnings so); the gateway's
    goes through structlog: errors as errors, the rest at debug (the worker reports the same
    file's load at its proper levels)."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    with capture_logs() as logs, pytest.raises(ValueError, match="cannot load the vocabulary"):
        Vocab(broken)
    assert capfd.readouterr().err == ""
    llama = [log for log in logs if log["log_level"] == "error"]
    assert llama and all(log["event"] and "\n" not in log["event"] for log in llama)


def test_long_text_tokenizes(vocab: Vocab) -> None:
    text = "once upon a time " * 2000
    tokens = vocab.tokenize(text, add_special=False)
    assert len(tokens) > 4000
    assert vocab.detokenize(tokens).strip() == text.strip()


def test_detokenizer_holds_back_split_characters(vocab: Vocab) -> None:
    """'é' (2 bytes) and '日' (3 bytes) sent byte by byte appear only once complete."""
    detok = IncrementalDetokenizer(vocab)
    encoded = "é日".encode()
    outputs = [detok.push([byte_token(vocab, b)]) for b in encoded]
    assert outputs == ["", "é", "", "", "日"]
    assert detok.flush() == ""


def test_detokenizer_mixes_words_and_bytes(vocab: Vocab) -> None:
    detok = IncrementalDetokenizer(vocab)
    words = vocab.tokenize("hello", add_special=False)  # SentencePiece adds the space
    snow = [byte_token(vocab, b) for b in "☃".encode()]
    text = detok.push(words + snow[:1]) + detok.push(snow[1:2])
    assert text == " hello"
    assert detok.push(snow[2:]) == "☃"


def test_detokenizer_flush_replaces_an_unfinished_character(vocab: Vocab) -> None:
    detok = IncrementalDetokenizer(vocab)
    assert detok.push([byte_token(vocab, 0xE6)]) == ""
    assert detok.flush() == "\ufffd"


def test_stop_matcher_splits_across_chunks() -> None:
    matcher = StopMatcher(("STOP", "\n\n"))
    out = [matcher.push(t) for t in ["Hello S", "T", "OP! more"]]
    assert [m.text for m in out] == ["Hello ", "", ""]
    assert [m.matched for m in out] == [False, False, True]


def test_stop_matcher_releases_false_starts() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.push("a ST").text == "a "
    assert matcher.push("ART").text == "START"  # "ST" was not a stop after all
    assert matcher.push("S").text == ""
    assert matcher.flush() == "S"


def test_stop_matcher_earliest_match_wins() -> None:
    matcher = StopMatcher(("world", "lo"))
    match = matcher.push("hello world")
    assert (match.text, match.matched) == ("hel", True)


def test_stop_matcher_without_stops_passes_through() -> None:
    matcher = StopMatcher(("",))
    assert matcher.push("abc").text == "abc"
    assert matcher.flush() == ""


def test_chatml_fallback_renders() -> None:
    chosen = choose_template(None, None, "llama", "<s>", "</s>")
    assert chosen.fallback and chosen.origin == "ChatML"
    template = chosen.renderer
    assert isinstance(template, ChatTemplate)
    text = template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.source == CHATML_TEMPLATE


def test_model_template_with_hf_variables() -> None:
    own = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    chosen = choose_template(None, own, "gemma3", "<s>", "</s>")
    assert not chosen.fallback and chosen.origin == "the model's"
    template = chosen.renderer
    text = template.render([{"role": "user", "content": "héllo"}])
    assert text == '<s>[user] "héllo"\n[assistant]'
    with pytest.raises(ChatTemplateError, match="no system role"):
        template.render([{"role": "system", "content": "x"}])
    override = choose_template("{{ messages[0]['content'] }}!", own, "llama", "<s>", "</s>")
    assert override.renderer.render([{"role": "user", "content": "hey"}]) == "hey!"


def test_architecture_without_template_gets_llama_cpps_builtin() -> None:
    """Gemma 3 base ships no template: Gemma's turns, whose <end_of_turn> is end-of-generation."""
    chosen = choose_template(None, None, "gemma3", "<bos>", "<eos>")
    assert chosen.fallback and "gemma" in chosen.origin
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert chosen.renderer.render(messages) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    long = [{"role": "user", "content": "é" * 5000}]  # more than the first buffer guess
    assert "é" * 5000 in chosen.renderer.render(long)


def test_tools_through_a_builtin_template_are_written_as_text() -> None:
    template = BuiltinChatTemplate("gemma")
    tools = TemplateTools.probe(template)
    assert not tools.renders_tools
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    messages, left = tools.prepare([{"role": "user", "content": "Weather?"}], [tool])
    assert left is None
    assert "get_weather" in template.render(messages, tools=left)


def test_builtin_template_by_name() -> None:
    assert {"gemma", "llama3", "chatml"} <= set(builtin_templates())
    chosen = choose_template("llama3", "{{ 'own' }}", "llama", "<s>", "</s>")
    assert isinstance(chosen.renderer, BuiltinChatTemplate) and not chosen.fallback
    text = chosen.renderer.render([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(ValueError, match="no built-in"):
        BuiltinChatTemplate("no-such-template")


def test_chat_template_override_is_a_name_a_file_or_jinja(tmp_path: Path) -> None:
    assert load_override("chatml") == "chatml"
    jinja = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert load_override(jinja) == jinja
    saved = tmp_path / "template.jinja"
    saved.write_text(jinja)
    assert load_override(str(saved)) == jinja


@pytest.mark.parametrize("value", ["chatgpt", "templates/missing.jinja", "Gemma"])
def test_a_mistyped_chat_template_is_refused_with_the_builtin_names(value: str) -> None:
    """Taken as text, each of these would have become every chat's whole prompt."""
    with pytest.raises(ValueError) as refused:
        load_override(value)
    message = str(refused.value)
    assert repr(value) in message and "\n" not in message
    assert all(name in message for name in builtin_templates())


def test_a_chat_template_that_does_not_compile_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not compile"):
        load_override("{% for m in messages %}{{ m }}")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ messages[0]['content'] }")
    with pytest.raises(ValueError, match=f"{broken}: the chat template does not compile"):
        load_override(str(broken))


def test_template_sandbox_blocks_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", "<s>", "</s>")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_stop_strings_limits() -> None:
    assert stop_strings("x") == ("x",)
    assert stop_strings(["a", "", "b"]) == ("a", "b")
    assert stop_strings(None) == ()
    with pytest.raises(APIError) as error:
        stop_strings(["1", "2", "3", "4", "5"])
    assert error.value.status == 400 and error.value.param == "stop"


def test_max_new_tokens() -> None:
    assert max_new_tokens(None, 16, prompt_len=10, ctx=100) == 16
    assert max_new_tokens(None, None, prompt_len=10, ctx=100) == 90
    assert max_new_tokens(None, 16, prompt_len=90, ctx=100) == 10  # a default is capped
    assert max_new_tokens(90, 16, prompt_len=10, ctx=100) == 90
    with pytest.raises(APIError) as beyond:
        max_new_tokens(91, 16, prompt_len=10, ctx=100)  # asked for: 400, as vLLM
    assert (beyond.value.code, beyond.value.param) == ("context_length_exceeded", "max_tokens")
    with pytest.raises(APIError) as error:
        max_new_tokens(5, 16, prompt_len=100, ctx=100)
    assert error.value.code == "context_length_exceeded"
    with pytest.raises(APIError):
        max_new_tokens(0, 16, prompt_len=10, ctx=100)


def test_sampling_params_mapping(vocab: Vocab) -> None:
    request = CompletionRequest(
        prompt="hi",
        temperature=0,
        top_k=5,
        min_p=0.1,
        seed=7,
        logit_bias={"42": -100, "7": 2.5},
        ignore_eos=True,
    )
    params = sampling_params(request, 3, vocab)
    assert (params.max_tokens, params.temperature, params.top_k, params.min_p) == (3, 0, 5, 0.1)
    assert params.logit_bias == {42: -100.0, 7: 2.5}
    assert params.seed == 7 and params.ignore_eos and params.grammar is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, None),
        ({"top_p": 0}, None),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"grammar": "root ::= undefined-rule"}, "grammar"),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "x"}}}},
            "response_format",
        ),
    ],
)
def test_sampling_params_rejects(vocab: Vocab, fields: dict, param: str | None) -> None:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    with pytest.raises(APIError) as error:
        sampling_params(request, 4, vocab)
    assert error.value.status == 400
    if param:
        assert error.value.param == param


def test_response_formats_become_grammars(vocab: Vocab) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    messages = [{"role": "user", "content": "x"}]
    request = ChatCompletionRequest(messages=messages, response_format=fmt)
    grammar = sampling_params(request, 4, vocab).grammar
    assert grammar is not None
    assert grammar_accepts(vocab, grammar, '{"n": 12}')
    assert not grammar_accepts(vocab, grammar, '{"n": "twelve"}')
    plain = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"}
    )
    any_object = sampling_params(plain, 4, vocab).grammar
    assert any_object is not None
    assert grammar_accepts(vocab, any_object, '{"a": [1, {"b": null}]}')
    assert not grammar_accepts(vocab, any_object, "[1]")
    text = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], response_format={"type": "text"}
    )
    assert sampling_params(text, 4, vocab).grammar is None
    json.dumps(schema)  # the schema itself is untouched
