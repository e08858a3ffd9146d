"""Every chat template llama.cpp ships (tests/data/templates, Apache/MIT-licensed model files),
through the gateway's own renderer as a request reaches it (prompts.chat_text, the probed
TemplateTools, the thinking switches of chat_template_kwargs): a conversation with a system
message, tools, an assistant's tool call and the tool's result renders with thinking on and
off; each template's reasoning and tool-call families are the ones in the table; and for the
main families the end of the prompt (the call in the model's own syntax, the result, the
generation prompt with its think block present or absent) is a fixture written from the
model's documented format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loomserve.gateway.api.schemas import ChatCompletionRequest
from loomserve.gateway.request import prompts, thinking
from loomserve.gateway.text.chat_template import ChatTemplate
from loomserve.gateway.text.reasoning import detect_family
from loomserve.gateway.tools.template import TemplateTools

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"

# The parameter has a description: Command R+'s template writes it unguarded.
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city."}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather.", "parameters": WEATHER},
    }
]
CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        # Nine letters and digits: the id Mistral's templates insist on.
        "tool_calls": [{"id": "abc123XYZ", "type": "function", "function": CALL}],
    },
    {"role": "tool", "tool_call_id": "abc123XYZ", "content": "sunny"},
]

# Each template: (the reasoning family detected, the tool-call family probed). "json" is a
# call written as a bare JSON object; "generic" a template that shows no tools, which the
# gateway then describes in the system message (Hermes's <tool_call> syntax).
FAMILIES = {
    "Apertus-8B-Instruct": (None, "json"),
    "Apriel-1.6-15b-Thinker-fixed": ("apriel", "json"),
    "Bielik-11B-v3.0-Instruct": ("deepseek_r1", "hermes"),
    "ByteDance-Seed-OSS": ("seed_oss", "qwen3_coder"),
    "Cohere2MoE": ("command_r7b", "command_r7b"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("command_r7b", "command_r7b"),
    # It loops over the tools even when there are none: rendered with an empty list then.
    "CohereForAI-c4ai-command-r-plus-tool_use": (None, "command_r_plus"),
    "GLM-4.6": ("deepseek_r1", "glm"),
    "GLM-4.7-Flash": ("deepseek_r1", "glm"),
    "GigaChat3-10B-A1.8B": (None, "json"),
    "GigaChat3.1-10B-A1.8B": (None, "json"),
    "HuggingFaceTB-SmolLM3-3B": ("deepseek_r1", "generic"),
    "Kimi-K2-Instruct": (None, "kimi_k2"),
    "Kimi-K2-Thinking": ("deepseek_r1", "kimi_k2"),
    "Kimi-K3": (None, "json"),
    "LFM2-8B-A1B": (None, "lfm2"),
    "LFM2.5-8B-A1B": ("deepseek_r1", "lfm2"),
    "LFM2.5-Instruct": ("deepseek_r1", "lfm2"),
    "MiMo-VL": (None, "hermes"),
    "MiniMax-M1": (None, "json"),
    "MiniMax-M2": ("deepseek_r1", "minimax_m2"),
    "MiniMax-M3": (None, "hermes"),
    "Mistral-Small-3.2-24B-Instruct-2506": (None, "mistral_args"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("deepseek_r1", "qwen3_coder"),
    "NVIDIA-Nemotron-Nano-v2": ("deepseek_r1", "json"),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": (None, "hermes"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": (None, "hermes"),
    "Qwen-QwQ-32B": ("deepseek_r1", "hermes"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "hermes"),
    "Qwen-Qwen3-0.6B": ("deepseek_r1", "hermes"),
    "Qwen3-Coder": (None, "qwen3_coder"),
    "Qwen3.5-4B": ("deepseek_r1", "qwen3_coder"),
    "Reka-Edge": ("deepseek_r1", "hermes"),
    "Spark2.5": ("deepseek_r1", "glm"),
    "StepFun3.5-Flash": ("deepseek_r1", "qwen3_coder"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("deepseek_r1", "deepseek_r1"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("deepseek_r1", "deepseek_r1"),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek_r1", "deepseek_v3_1"),
    "deepseek-ai-DeepSeek-V3.2": ("deepseek_r1", "deepseek_v3_2"),
    "deepseek-ai-DeepSeek-V4": ("deepseek_r1", "deepseek_v4"),
    "deepseek-ai-DeepSeek-V4-Flash-0731": ("deepseek_r1", "deepseek_v4"),
    "fireworks-ai-llama-3-firefunction-v2": (None, "firefunction"),
    "google-gemma-2-2b-it": (None, "generic"),
    "google-gemma-4-31B-it": ("gemma4", "gemma4"),
    "google-gemma-4-31B-it-interleaved": ("gemma4", "gemma4"),
    "ibm-granite-granite-3.3-2B-Instruct": ("deepseek_r1", "granite"),
    "ibm-granite-granite-4.0": (None, "hermes"),
    "ibm-granite-granite-4.1": (None, "hermes"),
    "inclusionai-ling-3.0-flash": ("deepseek_r1", "glm"),
    "llama-cpp-deepseek-r1": ("deepseek_r1", "deepseek_r1"),
    "llama-cpp-rwkv-world": ("deepseek_r1", "generic"),
    "meetkai-functionary-medium-v3.1": (None, "functionary_v3_1"),
    "meetkai-functionary-medium-v3.2": (None, "functionary_v3_2"),
    "meta-llama-Llama-3.1-8B-Instruct": (None, "llama3"),
    "meta-llama-Llama-3.2-3B-Instruct": (None, "llama3"),
    "meta-llama-Llama-3.3-70B-Instruct": (None, "llama3"),
    "microsoft-Phi-3.5-mini-instruct": (None, "generic"),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("mistral", "mistral_args"),
    "mistralai-Mistral-Nemo-Instruct-2407": (None, "mistral"),
    "moonshotai-Kimi-K2": (None, "kimi_k2"),
    "muse-glimmer": (None, "json"),
    "openai-gpt-oss-120b": ("gpt_oss", "harmony"),
    "openbmb-MiniCPM5-1B": ("deepseek_r1", "json"),
    "poolside-Laguna-S-2.1": ("deepseek_r1", "glm"),
    "poolside-Laguna-XS-2.1": ("deepseek_r1", "glm"),
    "poolside-Laguna-XS.2": ("deepseek_r1", "glm"),
    "tencent-Hy3": (None, "json"),
    "unsloth-Apriel-1.5": ("apriel", "hermes"),
    "unsloth-mistral-Devstral-Small-2507": (None, "mistral_args"),
    "upstage-Solar-Open-100B": ("solar_open", "json"),
}

# Templates that render the conversation but leave part of it out, and why.
LOSES = {
    # Mistral Nemo writes the system message into the last message only when that message
    # is the user's: once a tool has answered, the model no longer sees it.
    "mistralai-Mistral-Nemo-Instruct-2407": ("Be brief.",),
}

# Firefunction's template reads the tools as a JSON string in `functions`, and the date: the
# variables llama.cpp passes it (a server sets them with --chat-template-kwargs).
EXTRA_KWARGS = {
    "fireworks-ai-llama-3-firefunction-v2": {
        "functions": json.dumps(TOOLS),
        "datetime": "2026-11-28",
    }
}


def render(name: str, on: bool) -> tuple[str, TemplateTools]:
    """The prompt as the gateway renders it for a request with thinking on or off (the
    switches reasoning_effort sets, sent as chat_template_kwargs)."""
    template = ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), "<s>", "</s>")
    probe = TemplateTools.probe(template)
    switches = thinking.effort_kwargs("high" if on else "none")
    body = ChatCompletionRequest(
        messages=MESSAGES,
        tools=TOOLS,
        chat_template_kwargs={**switches, **EXTRA_KWARGS.get(name, {})},
    )
    kwargs = thinking.template_kwargs(body, {})
    return prompts.chat_text(template, body.messages, probe, TOOLS, kwargs), probe


def test_the_tables_cover_every_template() -> None:
    names = {path.stem for path in TEMPLATES.glob("*.jinja")}
    assert len(names) == 70
    assert names == set(FAMILIES)  # every one renders the conversation


@pytest.mark.parametrize("on", [True, False], ids=["thinking", "not-thinking"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_template_renders_the_conversation(name: str, on: bool) -> None:
    prompt, probe = render(name, on)
    reasoning, tools = FAMILIES[name]
    found = detect_family((TEMPLATES / f"{name}.jinja").read_text())
    assert (found.name if found else None, probe.format.name) == (reasoning, tools)
    # What each message said is in the prompt (templates that show no system message or
    # tools get them written into the first message by the gateway).
    for text in ("Be brief.", "Weather in Paris?", "get_weather", "Paris", "sunny"):
        if text in LOSES.get(name, ()):
            assert text not in prompt, text  # still lost: the list must stay true
        else:
            assert text in prompt, text


# The prompt from the user's question on, as each model's documentation writes a tool call,
# its result and the turn that follows: {template: (thinking on, thinking off)}.
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>"
)
R1_CALL = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
)
KIMI_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
)
DSML_CALL = (
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
)
LLAMA3 = (
    "Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
    '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>'
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
QWEN3 = (
    f"Weather in Paris?<|im_end|>\n<|im_start|>assistant\n{QWEN_CALL}<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
HERMES_2_PRO = (
    f"Weather in Paris?<|im_end|>\n<|im_start|>assistant\n{QWEN_CALL}<|im_end|>\n"
    "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>"
    "<|im_start|>assistant\n"
)
MIXED = "<think>\n\n</think>\n\n"  # the closed, empty block of a turn without thinking
GLM = (
    "<|assistant|>\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
    "<arg_value>Paris</arg_value>\n</tool_call><|observation|>\n<tool_response>\nsunny\n"
    "</tool_response><|assistant|>"
)
FIXTURES = {
    # Qwen3: Hermes calls; the results come back as a user turn; it opens its own block when
    # thinking, and with thinking off the prompt closes an empty one.
    "Qwen-Qwen3-0.6B": (QWEN3, QWEN3 + MIXED),
    # Hermes 2 Pro and Qwen2.5: the same syntax, no thinking switch; Hermes 2 Pro's template
    # writes a result as a turn of the `tool` role (its function-calling format's).
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": (HERMES_2_PRO, HERMES_2_PRO),
    "Qwen-Qwen2.5-7B-Instruct": (QWEN3, QWEN3),
    # Qwen3-Coder: the XML-ish calls, the result followed by a newline.
    "Qwen3-Coder": (
        f"Weather in Paris?<|im_end|>\n<|im_start|>assistant\n{XML_CALL}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>assistant\n",
    )
    * 2,
    # Qwen3.5: the same calls after an empty block; the prompt opens the block (thinking) or
    # closes it empty.
    "Qwen3.5-4B": tuple(
        f"Weather in Paris?<|im_end|>\n<|im_start|>assistant\n{MIXED}{XML_CALL}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n{tail}"
        for tail in ("<think>\n", MIXED)
    ),
    # DeepSeek-R1 (the distills' own template): the call in its fenced JSON; after a tool
    # result the template writes no generation prompt: the model goes on from the outputs.
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (
        f"Weather in Paris?<｜Assistant｜>{R1_CALL}<｜Assistant｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>",
    )
    * 2,
    # llama.cpp's fixed R1 template: a generation prompt that opens the think block.
    "llama-cpp-deepseek-r1": (
        f"Weather in Paris?<｜end▁of▁sentence｜><｜Assistant｜>{R1_CALL}"
        "<｜tool▁outputs▁begin｜>\n<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜><｜end▁of▁sentence｜><｜Assistant｜><think>\n",
    )
    * 2,
    # DeepSeek-V3.1: name<｜tool▁sep｜>JSON, no fence; after the output the model goes on.
    "deepseek-ai-DeepSeek-V3.1": (
        "Weather in Paris?<｜Assistant｜><think></think><｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁output▁begin｜>sunny"
        "<｜tool▁output▁end｜>",
    )
    * 2,
    # DeepSeek V3.2 (DSML): each parameter with its `string` attribute; the results in
    # <function_results>; the prompt opens the think block (thinking) or closes it empty.
    # V4: the same calls in <｜DSML｜tool_calls>, the result in a user turn's <tool_result>.
    "deepseek-ai-DeepSeek-V3.2": tuple(
        f"Weather in Paris?<｜Assistant｜>{block}\n\n<｜DSML｜function_calls>\n{DSML_CALL}"
        "</｜DSML｜function_calls><｜end▁of▁sentence｜>\n\n<function_results>\n"
        f"<result>sunny</result>\n</function_results>\n\n{tail}"
        for block, tail in (("<think></think>", "<think>"), ("</think>", "<think></think>"))
    ),
    "deepseek-ai-DeepSeek-V4": tuple(
        f"Weather in Paris?<｜Assistant｜>{block}\n\n<｜DSML｜tool_calls>\n{DSML_CALL}"
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>sunny</tool_result>"
        f"<｜Assistant｜>{tail}"
        for block, tail in (("<think></think>", "<think>"), ("</think>", "</think>"))
    ),
    # gpt-oss (Harmony): the call on the commentary channel to functions.NAME, ended by
    # <|call|>; the result from the tool to the assistant; the reply's channel is the model's.
    "openai-gpt-oss-120b": (
        "Weather in Paris?<|end|><|start|>assistant to=functions.get_weather<|channel|>"
        'commentary json<|message|>{"city": "Paris"}<|call|><|start|>functions.get_weather '
        'to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant',
    )
    * 2,
    # GLM-4.6: <arg_key>/<arg_value> pairs; thinking off is `/nothink` on the user's turn and
    # an empty block opened for the reply.
    "GLM-4.6": (
        f"Weather in Paris?{GLM}",
        f"Weather in Paris?/nothink{GLM}\n<think></think>",
    ),
    # Kimi-K2: functions.NAME:INDEX ids, the result as a tool message under "## Return of"
    # (the template as shipped writes its newline as the two characters `\\n`).
    "moonshotai-Kimi-K2": (
        "Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|>"
        f"{KIMI_CALL}<|im_system|>tool<|im_middle|>## Return of abc123XYZ\\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>",
    )
    * 2,
    # Kimi-K2-Thinking: an empty block before an earlier turn's calls; the results as
    # <tool_response> in a user turn.
    "Kimi-K2-Thinking": (
        "Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"
        f"{KIMI_CALL}<|im_user|>user<|im_middle|><tool_response>\nsunny\n</tool_response>"
        "<|im_end|><|im_assistant|>assistant<|im_middle|>",
    )
    * 2,
    # Llama 3.1 and 3.3: a JSON call with `parameters`, the result in an ipython turn.
    "meta-llama-Llama-3.1-8B-Instruct": (LLAMA3, LLAMA3),
    "meta-llama-Llama-3.3-70B-Instruct": (LLAMA3, LLAMA3),
    # Mistral Small 3.2: [TOOL_CALLS]name[CALL_ID]id[ARGS]json, results keyed by the id.
    "Mistral-Small-3.2-24B-Instruct-2506": (
        '[/INST][TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris"}</s>'
        "[TOOL_RESULTS]abc123XYZ[TOOL_CONTENT]sunny[/TOOL_RESULTS]",
    )
    * 2,
    # Mistral Nemo: [TOOL_CALLS] and a JSON list with the ids (the template writes the
    # content as it is, unquoted).
    "mistralai-Mistral-Nemo-Instruct-2407": (
        '[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": '
        '"abc123XYZ"}]</s>[TOOL_RESULTS]{"content": sunny, "call_id": "abc123XYZ"}'
        "[/TOOL_RESULTS]",
    )
    * 2,
    # Ministral 3 Reasoning (Magistral's [THINK] family): [TOOL_CALLS]name[ARGS]json.
    "mistralai-Ministral-3-14B-Reasoning-2512": (
        '[/INST][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>[TOOL_RESULTS]sunny'
        "[/TOOL_RESULTS]",
    )
    * 2,
    # Gemma 4: call:NAME{key:<|"|>value<|"|>} and the response the same way; after a tool
    # response the model's turn goes on, with no new header.
    "google-gemma-4-31B-it": (
        'Weather in Paris?<turn|>\n<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris'
        '<|"|>}<tool_call|><|tool_response>response:get_weather{value:<|"|>sunny<|"|>}'
        "<tool_response|>",
    )
    * 2,
}
# Where thinking shows at the start of the prompt instead: Gemma 4's system turn opens with
# <|think|>; gpt-oss's system message names its reasoning effort (medium unless asked).
HEADS = {
    "google-gemma-4-31B-it": ("<|turn>system\n<|think|>\nBe brief.", "<|turn>system\nBe brief."),
    "openai-gpt-oss-120b": ("\n\nReasoning: high\n\n", "\n\nReasoning: medium\n\n"),
}


@pytest.mark.parametrize("on", [True, False], ids=["thinking", "not-thinking"])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_main_families_render_their_documented_format(name: str, on: bool) -> None:
    prompt, _ = render(name, on)
    expected = FIXTURES[name][0 if on else 1]
    assert prompt.endswith(expected), (expected, prompt[-len(expected) - 40 :])
    if name in HEADS:
        assert HEADS[name][0 if on else 1] in prompt
