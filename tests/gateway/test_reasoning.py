"""The reasoning families and the splitter (gateway/text/reasoning.py): detection from real
chat templates (llama.cpp's models/templates, copied into tests/data/templates), and each
family's output split whole and one character at a time, with the same result."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from loomserve.gateway.api.schemas import ChatMessage
from loomserve.gateway.request import prompts
from loomserve.gateway.text.chat_template import ChatTemplate
from loomserve.gateway.text.reasoning import (
    MarkerText,
    ReasoningSplitter,
    Split,
    choose_family,
    detect_family,
    family_named,
    family_names,
    split_whole,
)
from loomserve.gateway.tools.template import TemplateTools

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "templates"

# Every template llama.cpp ships, and the family each is detected as (None: no think
# block in its text; Hunyuan 3 builds its markers at render time, Kimi-K3 writes XML-ish
# tags, MiniMax-M3 shows none: not detected).
DETECTED = {
    "Apertus-8B-Instruct.jinja": None,
    "Apriel-1.6-15b-Thinker-fixed.jinja": "apriel",
    "Bielik-11B-v3.0-Instruct.jinja": "deepseek_r1",
    "ByteDance-Seed-OSS.jinja": "seed_oss",
    "Cohere2MoE.jinja": "command_r7b",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": None,
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": "command_r7b",
    "GLM-4.6.jinja": "deepseek_r1",
    "GLM-4.7-Flash.jinja": "deepseek_r1",
    "GigaChat3-10B-A1.8B.jinja": None,
    "GigaChat3.1-10B-A1.8B.jinja": None,
    "HuggingFaceTB-SmolLM3-3B.jinja": "deepseek_r1",
    "Kimi-K2-Instruct.jinja": None,
    "Kimi-K2-Thinking.jinja": "deepseek_r1",
    "Kimi-K3.jinja": None,
    "LFM2-8B-A1B.jinja": None,
    "LFM2.5-8B-A1B.jinja": "deepseek_r1",
    "LFM2.5-Instruct.jinja": "deepseek_r1",
    "MiMo-VL.jinja": None,
    "MiniMax-M1.jinja": None,
    "MiniMax-M2.jinja": "deepseek_r1",
    "MiniMax-M3.jinja": None,
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": None,
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "deepseek_r1",
    "NVIDIA-Nemotron-Nano-v2.jinja": "deepseek_r1",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": None,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": None,
    "Qwen-QwQ-32B.jinja": "deepseek_r1",
    "Qwen-Qwen2.5-7B-Instruct.jinja": None,
    "Qwen-Qwen3-0.6B.jinja": "deepseek_r1",
    "Qwen3-Coder.jinja": None,
    "Qwen3.5-4B.jinja": "deepseek_r1",
    "Reka-Edge.jinja": "deepseek_r1",
    "Spark2.5.jinja": "deepseek_r1",
    "StepFun3.5-Flash.jinja": "deepseek_r1",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "deepseek_r1",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek_r1",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek_r1",
    "deepseek-ai-DeepSeek-V3.2.jinja": "deepseek_r1",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "deepseek_r1",
    "deepseek-ai-DeepSeek-V4.jinja": "deepseek_r1",
    "fireworks-ai-llama-3-firefunction-v2.jinja": None,
    "google-gemma-2-2b-it.jinja": None,
    "google-gemma-4-31B-it-interleaved.jinja": "gemma4",
    "google-gemma-4-31B-it.jinja": "gemma4",
    "ibm-granite-granite-3.3-2B-Instruct.jinja": "deepseek_r1",
    "ibm-granite-granite-4.0.jinja": None,
    "ibm-granite-granite-4.1.jinja": None,
    "inclusionai-ling-3.0-flash.jinja": "deepseek_r1",
    "llama-cpp-deepseek-r1.jinja": "deepseek_r1",
    "llama-cpp-rwkv-world.jinja": "deepseek_r1",
    "meetkai-functionary-medium-v3.1.jinja": None,
    "meetkai-functionary-medium-v3.2.jinja": None,
    "meta-llama-Llama-3.1-8B-Instruct.jinja": None,
    "meta-llama-Llama-3.2-3B-Instruct.jinja": None,
    "meta-llama-Llama-3.3-70B-Instruct.jinja": None,
    "microsoft-Phi-3.5-mini-instruct.jinja": None,
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": None,
    "moonshotai-Kimi-K2.jinja": None,
    "muse-glimmer.jinja": None,
    "openai-gpt-oss-120b.jinja": "gpt_oss",
    "openbmb-MiniCPM5-1B.jinja": "deepseek_r1",
    "poolside-Laguna-S-2.1.jinja": "deepseek_r1",
    "poolside-Laguna-XS-2.1.jinja": "deepseek_r1",
    "poolside-Laguna-XS.2.jinja": "deepseek_r1",
    "tencent-Hy3.jinja": None,
    "unsloth-Apriel-1.5.jinja": "apriel",
    "unsloth-mistral-Devstral-Small-2507.jinja": None,
    "upstage-Solar-Open-100B.jinja": "solar_open",
}


@pytest.mark.parametrize(("name", "family"), sorted(DETECTED.items()))
def test_family_detected_from_the_template(name: str, family: str | None) -> None:
    found = detect_family((TEMPLATES / name).read_text())
    assert (found.name if found else None) == family


def _render(name: str, **kwargs: object) -> str:
    template = ChatTemplate((TEMPLATES / name).read_text(), "<s>", "</s>")
    return template.render([{"role": "user", "content": "Hi"}], kwargs=kwargs)


def test_starts_inside_read_off_the_rendered_prompt() -> None:
    r1 = family_named("deepseek_r1")
    # DeepSeek-R1's and Qwen3.5's templates open the block in the prompt; Qwen3's leaves it
    # to the model, and with enable_thinking false closes an empty one.
    r1_distill = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
    assert r1.starts_inside(_render(r1_distill, enable_thinking=True))
    assert r1.starts_inside(_render("Qwen3.5-4B.jinja"))
    assert not r1.starts_inside(_render("Qwen3.5-4B.jinja", enable_thinking=False))
    assert r1.starts_inside(_render("deepseek-ai-DeepSeek-V3.1.jinja", thinking=True))
    assert not r1.starts_inside(_render("deepseek-ai-DeepSeek-V3.1.jinja"))
    assert not r1.starts_inside(_render("Qwen-Qwen3-0.6B.jinja"))
    off = _render("Qwen-Qwen3-0.6B.jinja", enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert not r1.starts_inside(off)


def test_names_and_choice() -> None:
    names = family_names()
    assert {"deepseek_r1", "qwen3", "gpt_oss", "mistral", "seed_oss"} <= set(names)
    assert family_named("qwen3").name == "deepseek_r1"
    with pytest.raises(ValueError, match=r"auto, none, .*deepseek_r1"):
        family_named("nope")
    assert choose_family("none", "<think>") is None
    assert choose_family("auto", "plain") is None
    family = choose_family("auto", "{{ '<think>' }}")
    assert family is not None and family.name == "deepseek_r1"
    family = choose_family("mistral", "{{ '<think>' }}")
    assert family is not None and family.name == "mistral"


# (family, starts inside, output, reasoning, content)
CASES = [
    ("deepseek_r1", False, "<think>\nabc\n</think>\n\nAnswer", "abc", "Answer"),
    ("deepseek_r1", True, "abc </think>Answer.", "abc", "Answer."),
    ("deepseek_r1", True, "<think>\nabc</think>Answer", "abc", "Answer"),
    ("deepseek_r1", False, "Plain answer, no thinking.", "", "Plain answer, no thinking."),
    ("deepseek_r1", False, "<think>\n\n</think>\n\nOnly the answer", "", "Only the answer"),
    ("deepseek_r1", False, "<think>cut inside the blo", "cut inside the blo", ""),
    (
        "deepseek_r1",
        True,
        "cut inside, then half a marker </thi",
        "cut inside, then half a marker </thi",
        "",
    ),
    ("deepseek_r1", False, "<thin", "", "<thin"),
    ("deepseek_r1", False, "<think>a<b</think>x </think> y", "a<b", "x </think> y"),
    ("deepseek_r1", False, "<think>ünïcødé 思考</think>答え", "ünïcødé 思考", "答え"),
    ("mistral", False, "[THINK]Let me see.[/THINK]42", "Let me see.", "42"),
    ("seed_oss", False, "<seed:think>hmm</seed:think>Yes", "hmm", "Yes"),
    ("kimi_vl", False, "◁think▷deep◁/think▷shallow", "deep", "shallow"),
    (
        "gpt_oss",
        False,
        "<|channel|>analysis<|message|>User says hi.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello!",
        "User says hi.",
        "Hello!",
    ),
    ("gpt_oss", False, "<|channel|>final<|message|>Hello!", "", "Hello!"),
    ("gemma4", False, "<|channel>thought\nplan<channel|>Done", "plan", "Done"),
    (
        "apriel",
        True,
        "steps [BEGIN FINAL RESPONSE]\nDone.\n[END FINAL RESPONSE]",
        "steps",
        "Done.\n",
    ),
    ("apriel", True, "steps [BEGIN FINAL RESPONSE]Done [END FIN", "steps", "Done [END FIN"),
    (
        "solar_open",
        False,
        "<|think|>hmm<|end|><|begin|>assistant<|content|>Yes",
        "hmm",
        "Yes",
    ),
    (
        "command_r7b",
        False,
        "<|START_THINKING|>plan<|END_THINKING|><|START_RESPONSE|>Done",
        "plan",
        "Done",
    ),
]


@pytest.mark.parametrize(("name", "inside", "text", "reasoning", "content"), CASES)
def test_split_whole_and_one_character_at_a_time(
    name: str, inside: bool, text: str, reasoning: str, content: str
) -> None:
    family = family_named(name)
    assert split_whole(family, inside, text) == Split(reasoning, content)
    splitter = ReasoningSplitter(family, inside)
    got = Split()
    for char in text:
        part = splitter.push(char)
        got.reasoning += part.reasoning
        got.content += part.content
        if part.content:  # the answer never comes before reasoning that follows it
            assert not splitter.push("").reasoning
    rest = splitter.finish()
    assert Split(got.reasoning + rest.reasoning, got.content + rest.content) == Split(
        reasoning, content
    )


def test_only_a_possible_marker_is_held_back() -> None:
    splitter = ReasoningSplitter(family_named("deepseek_r1"))
    assert splitter.push("<thi") == Split()  # may be the start of <think>
    assert splitter.push("nk>Some") == Split("Some", "")
    assert splitter.push(" more </th") == Split(" more", "")  # " </th" may end it
    assert splitter.push("ink>\nAns") == Split("", "Ans")
    assert splitter.push("wer") == Split("", "wer")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen3.5-4B.jinja", "<think>\nI should look it up.\n</think>"),
        ("openai-gpt-oss-120b.jinja", "<|channel|>analysis<|message|>I should look it up.<|end|>"),
    ],
)
def test_an_assistant_turns_thinking_goes_back_through_the_template(
    name: str, expected: str
) -> None:
    """In a tool loop the model sees its own thinking of the turn that called the tool."""
    template = ChatTemplate((TEMPLATES / name).read_text(), "<s>", "</s>")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        ChatMessage(role="user", content="Hi"),
        ChatMessage(
            role="assistant",
            content="",
            tool_calls=[call],
            reasoning_content="I should look it up.",
        ),
        ChatMessage(role="tool", tool_call_id="c1", content="42"),
    ]
    function = {
        "name": "f",
        "description": "F.",
        "parameters": {"type": "object", "properties": {}},
    }
    tools = [{"type": "function", "function": function}]
    text = prompts.chat_text(template, messages, TemplateTools.probe(template), tools)
    assert expected in text


def test_earlier_thinking_in_responses_and_messages_history_joins_its_turn() -> None:
    from loomserve.gateway.translate import messages, responses
    from loomserve.gateway.translate.messages_schemas import CountTokensRequest
    from loomserve.gateway.translate.responses_schemas import ResponsesRequest

    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": []}
    thought["content"] = [{"type": "reasoning_text", "text": "hmm"}]
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    body = ResponsesRequest(
        input=[
            {"role": "user", "content": "hi"},
            thought,
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            thought,  # the thinking of no turn is dropped
            {"role": "user", "content": "and?"},
        ]
    )
    chat = responses.chat_request(body).messages
    assert [(m.role, m.reasoning_content) for m in chat] == [
        ("user", None),
        ("assistant", "hmm"),
        ("tool", None),
        ("user", None),
    ]
    assert chat[1].tool_calls and chat[1].tool_calls[0].id == "c1"
    anthropic = CountTokensRequest(
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "yo"},
                ],
            },
            {"role": "user", "content": "and?"},
        ]
    )
    turn = messages.chat_request(anthropic).messages[1]
    assert (turn.content, turn.reasoning_content) == ("yo", "hmm")


class _ControlVocab:
    """A vocabulary whose gpt-oss markers are control tokens (no piece of their own)."""

    n_tokens = 10
    bos_id, eos_id = 0, 1
    _texts: ClassVar[dict[int, str]] = {
        2: "<|channel|>",
        3: "analysis",
        4: "<|message|>",
        5: "<|end|>",
        6: "hi",
        7: "<|start|>",
        8: "assistant",
        9: "final",
    }

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        ids, rest = [], text
        while rest:  # an unknown character reads as token 6, plain text
            token = next((t for t, s in self._texts.items() if rest.startswith(s)), 6)
            ids.append(token)
            rest = rest[len(self._texts[token]) if rest.startswith(self._texts[token]) else 1 :]
        return ids

    def piece(self, token_id: int) -> bytes:
        return b"" if token_id in (0, 1, 2, 4, 5, 7) else self._texts[token_id].encode()

    def text_of(self, token_id: int) -> str:
        return self._texts.get(token_id, "")


def test_control_token_markers_are_written_out() -> None:
    vocab = _ControlVocab()
    family = family_named("gpt_oss")
    pieces = MarkerText.over(vocab, vocab, family)  # type: ignore[arg-type]
    assert [pieces.piece(t) for t in (2, 3, 4, 6, 5)] == [
        b"<|channel|>",
        b"analysis",
        b"<|message|>",
        b"hi",
        b"<|end|>",
    ]
    assert pieces.piece(1) == b""  # EOS stays silent
    plain = family_named("deepseek_r1")  # its markers are not control tokens here: no change
    assert MarkerText.over(vocab, vocab, None) is vocab
    assert MarkerText.over(vocab, vocab, plain) is vocab
