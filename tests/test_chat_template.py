"""Chat templates: sandboxed rendering with HF's globals, checked against transformers' own renderer;
messages converted for templates without touching the request; tool-parser detection; loading."""

import copy
import datetime
import json

import jinja2
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

import pocketllm as P

# A Qwen3.5-style template: tools as JSON lines, XML calls that iterate `arguments|items`, tool responses
# grouped in one user turn, a <think> generation prompt that enable_thinking=false closes at once.
QWEN35 = r"""
{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + tool | tojson }}
{%- endfor %}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format:\n\n<tool_call>\n<function=example>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>' }}
{%- if messages[0].role == 'system' %}{{- '\n\n' + messages[0].content }}{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1, multi_step=true) %}
{%- for message in messages[::-1] %}
{%- set index = messages|length - 1 - loop.index0 %}
{%- if ns.multi_step and message.role == 'user' and not (message.content.startswith('<tool_response>')) %}
{%- set ns.multi_step = false %}{%- set ns.last_query = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content | trim %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if loop.index0 > ns.last_query %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning | trim + '\n</think>\n\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\n' + content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}
{{- ('\n\n' if loop.first and content else '\n' if not loop.first else '') + '<tool_call>\n<function=' + tool_call.name + '>\n' }}
{%- for args_name, args_value in tool_call.arguments|items %}
{{- '<parameter=' + args_name + '>\n' }}
{{- args_value | tojson if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string }}
{{- '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.previtem and loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""

# A Qwen2.5-style Hermes template: calls rendered as JSON inside <tool_call>.
HERMES = r"""
{%- if tools %}
{{- '<|im_start|>system\nYou may call functions.\n<tools>' }}
{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
{{- '\n</tools>\nReturn <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\n' + message.content }}
{%- for tool_call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": ' + tool_call.function.arguments | tojson + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt — °C",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich and Oslo?"},
    {"role": "assistant", "content": None, "reasoning_content": "Two cities.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"days": 2, "city": "Zürich"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Oslo", "opts": {"u": [1, 2]}}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "3 °C"},
                                                           {"type": "text", "text": "windy"}]},
]


class FakeTokenizer:
    bos_token, eos_token, pad_token = None, "<|im_end|>", "<|endoftext|>"

    def __init__(self, source=None):
        self.chat_template_source = source


def hf_render(template, messages, **kw):
    """transformers' renderer, given the messages as HF expects them (arguments already objects)."""
    return render_jinja_template([P.messages_for_template(messages)], chat_template=template, **kw)[0][0]


@pytest.mark.parametrize("kwargs", [
    {"add_generation_prompt": True},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": False},
])
@pytest.mark.parametrize("with_tools", [True, False])
def test_render_matches_transformers(kwargs, with_tools):
    tools = TOOLS if with_tools else None
    ours = P.ChatTemplate(QWEN35, FakeTokenizer()).render(CONVERSATION, tools=tools, **kwargs)
    assert ours == hf_render(QWEN35, CONVERSATION, tools=tools, **kwargs)
    assert '"Wetter für eine Stadt — °C"' in ours if with_tools else "<tools>" not in ours   # tojson keeps non-ASCII
    assert "<parameter=days>\n2\n</parameter>\n<parameter=city>\nZürich\n</parameter>" in ours   # key order kept
    assert '<parameter=opts>\n{"u": [1, 2]}\n</parameter>' in ours
    assert "<tool_response>\n3 °C\nwindy\n</tool_response>" in ours


def test_hermes_render_matches_transformers():
    messages = [m for m in CONVERSATION if m["role"] != "system"]
    ours = P.ChatTemplate(HERMES, FakeTokenizer()).render(messages, tools=TOOLS)
    assert ours == hf_render(HERMES, messages, tools=TOOLS, add_generation_prompt=True)
    assert '{"name": "get_weather", "arguments": {"days": 2, "city": "Zürich"}}' in ours


def test_arguments_items_replay_regression():
    """The historical defect: string arguments handed to a template that iterates them with |items."""
    env = jinja2.Environment()
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in c.function.arguments|items %}" \
               "{{ k }}={{ v }};{% endfor %}{% endfor %}{% endfor %}"
    with pytest.raises(TypeError, match="Can only get item pairs from a mapping"):
        env.from_string(template).render(messages=CONVERSATION)       # what a server without conversion hits
    assert P.ChatTemplate(template).render(CONVERSATION, add_generation_prompt=False) == \
        "days=2;city=Zürich;city=Oslo;opts={'u': [1, 2]};"


def test_request_objects_never_modified():
    before = copy.deepcopy(CONVERSATION)
    tools_before = copy.deepcopy(TOOLS)
    template = P.ChatTemplate(QWEN35)
    template.render(CONVERSATION, tools=TOOLS)
    P.messages_for_template(CONVERSATION)
    assert CONVERSATION == before and TOOLS == tools_before
    assert isinstance(CONVERSATION[2]["tool_calls"][0]["function"]["arguments"], str)


def test_messages_for_template_conversions():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "f", "arguments": '{"z": 1, "a": {"y": 2, "b": 3}}'}},
            {"function": {"name": "g", "arguments": "not json"}},
            {"function": {"name": "h", "arguments": "[1, 2]"}},
            {"function": {"name": "k", "arguments": {"already": "object"}}}]},
        {"role": "tool", "content": None},
    ]
    out = P.messages_for_template(messages)
    assert out[0]["content"] == "a\nb" and out[1]["content"] == "" and out[2]["content"] == ""
    args = [c["function"]["arguments"] for c in out[1]["tool_calls"]]
    assert args == [{"z": 1, "a": {"y": 2, "b": 3}}, "not json", "[1, 2]", {"already": "object"}]
    assert list(args[0]) == ["z", "a"] and list(args[0]["a"]) == ["y", "b"]
    assert messages[1]["content"] is None and isinstance(messages[1]["tool_calls"][0]["function"]["arguments"], str)


def test_non_text_content_part_refused():
    with pytest.raises(P.RequestError) as err:
        P.messages_for_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert err.value.param == "messages" and "image_url" in str(err.value)


@pytest.mark.parametrize("source", [
    "{{ messages.__class__ }}",
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace(_secret=1) %}x",
    "{% set ns = namespace() %}{% set ns._x = 1 %}x",
])
def test_sandbox_refuses_unsafe_access_as_400(source):
    with pytest.raises(P.RequestError) as err:
        P.ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert err.value.param == "messages" and err.value.status == 400
    assert "unsafe" in str(err.value) or "may not start with '_'" in str(err.value)


def test_raise_exception_message_reaches_the_client():
    template = P.ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a "
                              "user message.') }}{% endif %}ok")
    with pytest.raises(P.RequestError, match="Conversation must start with a user message") as err:
        template.render([{"role": "assistant", "content": "x"}])
    assert err.value.param == "messages"
    assert template.render([{"role": "user", "content": "x"}]) == "ok"


def test_runtime_template_errors_are_400():
    for source in ("{{ messages[5].content }}", "{{ 1 / 0 }}", "{{ messages[0].content + 1 }}"):
        with pytest.raises(P.RequestError) as err:
            P.ChatTemplate(source).render([{"role": "user", "content": "x"}])
        assert err.value.param == "messages"


def test_hf_globals_and_filters():
    source = ("{{ strftime_now('%Y') }}|{{ {'b': 1, 'a': 'é'} | tojson }}|{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=true) }}"
              "|{{ ['é'] | tojson(ensure_ascii=true) }}|{{ {'a': [1]} | tojson(indent=2) }}|{{ '<&>' | tojson }}"
              "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
              "|{% generation %}gen{% endgeneration %}|{{ eos_token }}|{{ bos_token }}")
    out = P.ChatTemplate(source, FakeTokenizer()).render([])
    year = str(datetime.datetime.now().year)
    assert out == (year + '|{"b": 1, "a": "é"}|{"a": "é", "b": 1}|["\\u00e9"]|' + json.dumps({"a": [1]}, indent=2)
                   + '|"<&>"02|gen|<|im_end|>|None')


def test_trim_and_lstrip_blocks():
    source = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert P.ChatTemplate(source).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"


def test_template_kwargs_and_generation_prompt_errors():
    template = P.ChatTemplate(QWEN35)
    assert template.render([{"role": "user", "content": "hi"}], enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(P.RequestError) as err:
        template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True, continue_final_message=True)
    assert err.value.param == "continue_final_message"


def test_continue_final_message_matches_transformers():
    messages = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moonlight—"}]
    ours = P.ChatTemplate(QWEN35).render(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == hf_render(QWEN35, messages, continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nAutumn moonlight—")


def test_syntax_error_is_a_checkpoint_error():
    with pytest.raises(P.CheckpointError, match="syntax error at line 1"):
        P.ChatTemplate("{% for x in %}")


def test_tool_parser_detection():
    assert P.ChatTemplate(QWEN35).tool_parser == "qwen_xml"
    assert P.ChatTemplate(HERMES).tool_parser == "hermes"
    template = P.ChatTemplate(HERMES)
    template.tool_parser = "qwen_xml"                         # --tool-parser overrides
    assert template.tool_parser == "qwen_xml"


def test_prompt_ends_in_reasoning_on_rendered_prompts():
    template = P.ChatTemplate(QWEN35)
    user = [{"role": "user", "content": "hi"}]
    assert P.prompt_ends_in_reasoning(template.render(user))
    assert not P.prompt_ends_in_reasoning(template.render(user, enable_thinking=False))
    assert not P.prompt_ends_in_reasoning(P.ChatTemplate(HERMES).render(user))
    history = template.render(CONVERSATION[:3] + [{"role": "user", "content": "<think> literally"}], enable_thinking=False)
    assert not P.prompt_ends_in_reasoning(history)


def test_load_chat_template_sources(tmp_path):
    assert P.load_chat_template(FakeTokenizer(None)) is None
    assert P.load_chat_template(FakeTokenizer(HERMES)).tool_parser == "hermes"
    (tmp_path / "t.jinja").write_text(QWEN35)
    assert P.load_chat_template(FakeTokenizer(HERMES), str(tmp_path / "t.jinja")).tool_parser == "qwen_xml"
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": HERMES}))
    assert P.load_chat_template(FakeTokenizer(None), str(tmp_path / "t.json")).tool_parser == "hermes"
    with pytest.raises(P.PocketError, match="cannot read"):
        P.load_chat_template(FakeTokenizer(None), str(tmp_path / "missing.jinja"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": HERMES}))
    assert P.load_chat_template(FakeTokenizer(None), ckpt_dir=tmp_path).tool_parser == "hermes"
    (tmp_path / "chat_template.jinja").write_text(QWEN35)                    # chat_template.jinja comes first
    assert P.load_chat_template(FakeTokenizer(None), ckpt_dir=tmp_path).tool_parser == "qwen_xml"


def test_named_templates_pick_tool_use_with_tools():
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ tools | length }}"}]
    template = P.load_chat_template(FakeTokenizer(named))
    assert template.render([{"role": "user", "content": "x"}]) == "D"
    assert template.render([{"role": "user", "content": "x"}], tools=TOOLS) == "T1"
    assert P.ChatTemplate([{"name": "rag", "template": "R"}]).render([]) == "R"
