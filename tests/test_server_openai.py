"""The OpenAI-compatible server, end to end: the real engine on a tiny random checkpoint, real HTTP on port 0,
driven by the published `openai` SDK, `langchain-openai` and raw sockets.

The model is random, so answers are checked against the engine itself (the same prompt through
llm.generate / llm.logits) or for shape, never against hard-coded text.
"""

import copy
import http.client
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import jinja2
import openai
import pytest
import torch

import pocketllm
from checkpoints import CHAT_TEMPLATE

KEY = "test-key-123"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def llm(ckpt_factory):
    path, _ = ckpt_factory("qwen3_5")
    return pocketllm.LLM(str(path), quiet=True, max_context=640, max_batch_size=8)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)


def request(server, method, path, body=None, key=KEY, raw=None, headers=None):
    """One HTTP request on a fresh connection -> (status, headers, parsed JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    h = {"Authorization": f"Bearer {key}"} if key else {}
    h.update(headers or {})
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    conn.request(method, path, body=data, headers=h)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    is_json = resp.getheader("Content-Type", "").startswith("application/json")
    return resp.status, resp, json.loads(text) if is_json else text


def reference_prompt_ids(llm, messages, **kwargs):
    """The prompt rendered with plain jinja2 from the checkpoint's template: independent of our renderer."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    text = env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True, **kwargs)
    return llm.tokenizer.encode(text)


def wait_idle(llm, timeout=10.0):
    """Poll until the engine holds no request, block or slot; return the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.stats()
        if not (stats["running"] or stats["waiting"] or stats["kv_blocks_used"] or stats["slots_used"]):
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body (already de-chunked)."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(block[len("data: "):])
    return events


# -----------------------------------------------------------------------------------------------
# The openai SDK: models, chat, streaming, n, logprobs, stop, both max-tokens fields, errors.
# -----------------------------------------------------------------------------------------------

def test_models(client, llm):
    assert [m.id for m in client.models.list()] == [llm.model_name]
    assert client.models.retrieve(llm.model_name).id == llm.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_matches_the_engine(client, llm):
    """Greedy chat equals llm.generate on the independently rendered prompt."""
    out = client.chat.completions.create(model=llm.model_name, messages=USER, max_tokens=8, temperature=0,
                                         extra_body=NO_THINK)
    ids = reference_prompt_ids(llm, USER, enable_thinking=False)
    ref = llm.generate(ids, max_tokens=8, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == llm.model_name
    assert out.system_fingerprint and out.created > 0
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == ref["completion_tokens"]
    assert out.usage.total_tokens == len(ids) + ref["completion_tokens"]
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == ref["finish_reason"]
    assert (choice.message.content or "") == ref["text"].strip()     # the parser trims content


def counts(usage) -> tuple[int, int, int]:
    """A usage's token counts. Its prompt_tokens_details.cached_tokens is left out: the same prompt sent twice
    resumes more of itself from the prefix cache the second time (tests/test_prefix_cache.py checks it)."""
    usage = usage if isinstance(usage, dict) else usage.model_dump()
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def test_stream_equals_non_stream_with_usage(client, llm):
    kwargs = dict(model=llm.model_name, messages=USER, max_completion_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    body = [c for c in chunks if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in body)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in body)
    message = whole.choices[0].message
    assert content == (message.content or "")
    assert reasoning == (getattr(message, "reasoning_content", None) or "")
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(whole.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_n2(client, llm):
    out = client.chat.completions.create(model=llm.model_name, messages=USER, max_tokens=4, n=2, seed=7,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=llm.model_name, messages=USER, max_tokens=4, n=2, seed=7,
                                            stream=True, extra_body={"ignore_eos": True})
    finished = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_chat_logprobs_top3(client, llm):
    out = client.chat.completions.create(model=llm.model_name, messages=USER, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert item.logprob == pytest.approx(tops[0], abs=1e-5)      # greedy takes the most likely token
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token


def test_completion_logprobs_match_the_model(server, llm):
    """/v1/completions logprobs (completions format) against log_softmax of llm.logits at each position."""
    prompt = llm.tokenizer.encode("The quick brown fox")
    status, _, out = request(server, "POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3, "ignore_eos": True})
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    generated = llm.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True)["token_ids"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(generated) == 4
    ref = torch.log_softmax(llm.logits(prompt + generated[:-1]).double(), dim=-1)[len(prompt) - 1:]   # (4, V)
    for i, token in enumerate(generated):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i, token].item(), abs=2e-3)
        top_ref = sorted(ref[i].topk(3).values.tolist(), reverse=True)
        assert sorted(lp["top_logprobs"][i].values(), reverse=True) == pytest.approx(top_ref, abs=2e-3)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert out["choices"][0]["text"] == llm.tokenizer.decode(generated, skip_special_tokens=True)


def test_stop_string(client, llm):
    kwargs = dict(model=llm.model_name, messages=USER, temperature=0, extra_body={**NO_THINK, "ignore_eos": True})
    text = client.chat.completions.create(max_tokens=16, **kwargs).choices[0].message.content
    at = next(i for i in range(1, len(text) - 2) if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    out = client.chat.completions.create(max_tokens=16, stop=[text[at:at + 2], "never-there"], **kwargs)
    assert out.choices[0].message.content == text[:at]
    assert out.choices[0].finish_reason == "stop"


def test_max_tokens_and_max_completion_tokens(client, llm):
    for field, n in (("max_tokens", 3), ("max_completion_tokens", 5)):
        out = client.chat.completions.create(model=llm.model_name, messages=USER, extra_body={"ignore_eos": True},
                                             **{field: n})
        assert out.usage.completion_tokens == n and out.choices[0].finish_reason == "length"
    # Neither: the rest of the context (a long prompt keeps that short).
    long = [{"role": "user", "content": "Paris " * 290}]
    out = client.chat.completions.create(model=llm.model_name, messages=long, extra_body={"ignore_eos": True})
    assert out.usage.total_tokens == llm.options.max_context and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens < 100


def test_sdk_exception_classes(client, server, llm):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=llm.model_name, messages=USER, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:       # prompt + max tokens over the context
        client.chat.completions.create(model=llm.model_name, messages=USER, max_completion_tokens=10_000)
    assert e.value.body["param"] == "max_completion_tokens"


def test_langchain(server, llm):
    from langchain_openai import ChatOpenAI
    chat = ChatOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, model=llm.model_name,
                      max_tokens=4, temperature=0, max_retries=0, extra_body={"ignore_eos": True})
    answer = chat.invoke("Hello")
    assert answer.usage_metadata["output_tokens"] == 4            # max_completion_tokens honoured
    chunks = list(chat.stream("Hello", stream_usage=True))            # sends stream_options.include_usage
    assert "".join(str(c.content) for c in chunks) == answer.content
    assert sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata) == 4


def test_langchain_tool_loop(server, llm):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    chat = ChatOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, model=llm.model_name,
                      max_tokens=56, temperature=0, max_retries=0)
    # bind_tools -> forced call -> ToolMessage -> answer (a template that iterates arguments|items).
    bound = chat.bind_tools([WEATHER], tool_choice="get_weather")
    first = bound.invoke([HumanMessage("Weather in Paris for two days?")])
    assert [c["name"] for c in first.tool_calls] == ["get_weather"]
    history = [HumanMessage("Weather in Paris for two days?"), first,
               ToolMessage("sunny, 21 C", tool_call_id=first.tool_calls[0]["id"])]
    second = chat.bind_tools([WEATHER]).bind(max_tokens=4).invoke(history)
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]


# -----------------------------------------------------------------------------------------------
# Refusals: every unsupported field, out-of-range value and wrong type is a 400 naming its param.
# -----------------------------------------------------------------------------------------------

CHAT_REFUSALS = [
    ({"temprature": 0.5}, "temprature"),
    ({"temperature": 2.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"), ({"temperature": 10 ** 400}, "temperature"),
    ({"logit_bias": {"5": -10 ** 400}}, "logit_bias.5"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": "2"}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias.99999999"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {"5": None}}, "logit_bias.5"), ({"logit_bias": {"5": 1, "7": "x"}}, "logit_bias.7"),
    ({"stop": [""]}, "stop[0]"), ({"stop": 5}, "stop"), ({"stop": ["a"] * 17}, "stop"), ({"stop": [1]}, "stop[0]"),
    ({"stop": ["a", None]}, "stop[1]"), ({"stop": ""}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"), ({"stop_token_ids": "x"}, "stop_token_ids"),
    ({"stop_token_ids": [1, None]}, "stop_token_ids[1]"), ({"stop_token_ids": [2 ** 70]}, "stop_token_ids[0]"),
    ({"metadata": {"k": None}}, "metadata.k"), ({"metadata": {"k": "v", "n": 5}}, "metadata.n"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"seed": "x"}, "seed"), ({"seed": 1.5}, "seed"),
    ({"logprobs": 1}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"colour": 1}}, "stream_options.colour"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema.type"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"), ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": {"name": "f"}}, "function_call"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"), ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"tools": "x"}, "tools"), ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "tools[0].function.params"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "colour": 1}]}, "messages[0].colour"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": 5}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"add_generation_prompt": "x"}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"model": 5}, "model"),
]

COMPLETION_REFUSALS = [
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": [99_999_999]}, "prompt[0]"), ({"prompt": [1, None]}, "prompt[1]"),
    ({"prompt": [[1, -2]]}, "prompt[0][1]"), ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"max_completion_tokens": 5}, "max_completion_tokens"), ({"messages": USER}, "messages"),
    ({"temperature": -1}, "temperature"), ({"max_tokens": 1000}, "max_tokens"),
]


@pytest.mark.parametrize("fields,param", CHAT_REFUSALS, ids=[p for _, p in CHAT_REFUSALS])
def test_chat_refusals(server, fields, param):
    status, _, body = request(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] and "\n" not in body["error"]["message"]


@pytest.mark.parametrize("fields,param", COMPLETION_REFUSALS, ids=[p for _, p in COMPLETION_REFUSALS])
def test_completion_refusals(server, fields, param):
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param


def test_no_effect_fields_are_accepted(server):
    fields = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "modalities": ["text"],
              "response_format": {"type": "text"}, "function_call": None, "prompt_cache_key": "k",
              "safety_identifier": "s", "stream_options": None, "logprobs": False, "n": 1}
    status, _, body = request(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **fields})
    assert status == 200, body
    status, _, body = request(server, "POST", "/v1/completions",
                              {"prompt": "Hi", "max_tokens": 2, "best_of": 1, "echo": False, "user": "u"})
    assert status == 200, body


def test_reasoning_effort_reaches_a_template_that_reads_it(llm):
    """Top-level reasoning_effort is passed to a template that reads it (the SDK tests below cover the others)."""
    original = pocketllm.render_chat_prompt(llm, {"messages": USER}, None) and llm.chat_template
    source = CHAT_TEMPLATE.replace("{%- for m in messages %}", "effort={{ reasoning_effort }}\n{%- for m in messages %}")
    llm.chat_template = pocketllm.ChatTemplate(source, llm.tokenizer)
    try:
        assert "effort=low" in pocketllm.render_chat_prompt(llm, {"messages": USER, "reasoning_effort": "low"}, None)
        with pytest.raises(pocketllm.RequestError) as e:
            pocketllm.render_chat_prompt(llm, {"messages": USER, "reasoning_effort": "extreme"}, None)
        assert e.value.param == "reasoning_effort"
    finally:
        llm.chat_template = original


# Newer client fields (issue 20 item 4), sent the way the openai SDK sends them.

@pytest.fixture
def template_reading(llm):
    """template_reading(*names): the server's chat template becomes the test template extended to print those
    fields (or with thinking removed, for "no-thinking"); restored afterwards."""
    original = pocketllm.render_chat_prompt(llm, {"messages": USER}, None) and llm.chat_template

    def use(*names):
        source = CHAT_TEMPLATE
        if "no-thinking" in names:
            source = source.replace("enable_thinking is defined and enable_thinking is false", "false")
        shown = "".join(f"{name}={{{{ {name} }}}}\n" for name in names if name != "no-thinking")
        source = source.replace("{%- for m in messages %}", shown + "{%- for m in messages %}", 1)
        llm.chat_template = pocketllm.ChatTemplate(source, llm.tokenizer)
        return source
    yield use
    llm.chat_template = original


def _greedy(client, llm, **kwargs):
    return client.chat.completions.create(model=llm.model_name, messages=USER, max_tokens=6, temperature=0,
                                          **kwargs)


def test_prompt_cache_options_and_moderation_change_nothing(client, llm):
    """The SDK's own parameters: accepted, and the answer (seeded sampling, penalties) is the one without them."""
    kwargs = dict(model=llm.model_name, messages=USER, max_tokens=8, temperature=1.0, presence_penalty=0.5,
                  seed=11)
    plain = client.chat.completions.create(**kwargs)
    dressed = client.chat.completions.create(
        **kwargs, prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        moderation={"model": "omni-moderation-latest", "policy": {"input": {"mode": "block"}}})
    assert dressed.choices[0].message == plain.choices[0].message and counts(dressed.usage) == counts(plain.usage)
    completion = client.completions.create(model=llm.model_name, prompt="Hi", max_tokens=3, seed=3,
                                           extra_body={"prompt_cache_options": {"mode": "implicit"},
                                                       "moderation": {"model": "m"}})
    assert completion.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs, extra_body={"moderation": "on"})
    assert e.value.body["param"] == "moderation"


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_puts_usage_on_every_chunk(client, llm, include_usage):
    kwargs = dict(model=llm.model_name, messages=USER, max_tokens=6, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={
        "include_usage": include_usage, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == whole.usage.completion_tokens == 6
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert (chunks[-1].choices == []) == include_usage             # the final usage chunk: include_usage's
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.choices[0].message.content or "")


def test_reasoning_effort_without_a_template_that_reads_it_is_enable_thinking(client, llm):
    """none/minimal render the prompt of enable_thinking=false, low/medium/high that of enable_thinking=true (over
    chat_template_kwargs): the same prompt tokens and the same greedy answer as the independent jinja2 render."""
    for effort, thinking in (("none", False), ("minimal", False), ("low", True), ("medium", True), ("high", True)):
        out = _greedy(client, llm, reasoning_effort=effort,
                      extra_body={"chat_template_kwargs": {"enable_thinking": not thinking}})
        ids = reference_prompt_ids(llm, USER, enable_thinking=thinking)
        assert out.usage.prompt_tokens == len(ids), effort
        ref = llm.generate(ids, max_tokens=6, temperature=0)
        assert out.usage.completion_tokens == ref["completion_tokens"], effort
    assert len(reference_prompt_ids(llm, USER, enable_thinking=False)) != len(reference_prompt_ids(llm, USER))


def test_reasoning_effort_and_verbosity_reach_a_template_that_reads_them(client, llm, template_reading):
    source = template_reading("reasoning_effort", "verbosity")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    for effort, verbosity in (("none", "low"), ("medium", "high")):
        out = _greedy(client, llm, reasoning_effort=effort, verbosity=verbosity)
        text = env.from_string(source).render(messages=USER, add_generation_prompt=True, reasoning_effort=effort,
                                              verbosity=verbosity)
        assert f"reasoning_effort={effort}\nverbosity={verbosity}<|im_start|>" in text
        ids = llm.tokenizer.encode(text)
        assert out.usage.prompt_tokens == len(ids)
        assert out.usage.completion_tokens == llm.generate(ids, max_tokens=6, temperature=0)["completion_tokens"]


def test_reasoning_effort_and_verbosity_refused_by_a_template_that_reads_neither(client, llm, template_reading):
    template_reading("no-thinking")
    for fields, param in (({"reasoning_effort": "low"}, "reasoning_effort"), ({"verbosity": "low"}, "verbosity")):
        with pytest.raises(openai.BadRequestError) as e:
            _greedy(client, llm, **fields)
        assert e.value.body["param"] == param and e.value.body["code"] == "unsupported_field"
    assert wait_idle(llm)["kv_blocks_used"] == 0


ODD_VALUES = [True, -1, 2.5, 1e308, "", "\u0000", [1], ["x"], {}, {"a": 1}, [{"type": "function"}], [[[]]]]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_no_value_of_any_field_crashes(llm, endpoint):
    """Every known field set to each odd JSON value: an answer or a RequestError (400/404), never anything else."""
    fields = sorted(pocketllm.CHAT_FIELDS if endpoint == "chat" else pocketllm.COMPLETION_FIELDS)
    base = {"messages": USER} if endpoint == "chat" else {"prompt": "Hi"}
    run = pocketllm.chat_completions if endpoint == "chat" else pocketllm.completions
    statuses = set()
    for name in fields:
        for value in ODD_VALUES:
            body = {**base, "max_tokens": 1, name: value}
            try:
                out = run(llm, body)
                if not isinstance(out, dict):
                    out = list(out)
                statuses.add(200)
            except pocketllm.RequestError as e:
                assert e.status in (400, 404) and e.param, (name, value, e)
                statuses.add(e.status)
    assert statuses == {200, 400, 404}
    message_keys = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal"]
    if endpoint == "chat":
        for key in message_keys:
            for value in ODD_VALUES:
                body = {"messages": [{"role": "user", "content": "x", key: value}], "max_tokens": 1}
                try:
                    pocketllm.chat_completions(llm, body)
                except pocketllm.RequestError as e:
                    assert e.status == 400 and e.param.startswith("messages"), (key, value, e)


# -----------------------------------------------------------------------------------------------
# Multi-turn replay and tool_choice (the tool-call parser and constraints belong to the text part).
# -----------------------------------------------------------------------------------------------

REPLAYED_CALL = {"id": "call_0123456789abcdef01234567", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}


@pytest.mark.parametrize("content", ["", None])
def test_replay_of_a_tool_conversation(server, llm, content):
    """An assistant message as we return it (content "" or null, arguments a JSON string) and a tool message
    render through a template that iterates arguments|items, and are answered; the body is not modified."""
    body = {"messages": USER + [{"role": "assistant", "content": content, "tool_calls": [REPLAYED_CALL]},
                                {"role": "tool", "tool_call_id": REPLAYED_CALL["id"], "content": "sunny, 21 C"}],
            "tools": [WEATHER], "max_tokens": 3}
    before = copy.deepcopy(body)
    out = pocketllm.chat_completions(llm, body)
    assert body == before
    status, _, rendered = request(server, "POST", "/tokenize", {"messages": body["messages"], "tools": [WEATHER]})
    assert status == 200, rendered
    text = llm.tokenizer.decode(rendered["tokens"])
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n" in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert out["usage"]["prompt_tokens"] == rendered["count"]
    status, _, second = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and second["usage"]["prompt_tokens"] == rendered["count"]


def test_replay_of_an_sdk_message_object(client, llm):
    """A client that appends `message.model_dump()` (refusal, audio, annotations, function_call all null)."""
    first = client.chat.completions.create(model=llm.model_name, messages=USER, max_tokens=3)
    history = USER + [first.choices[0].message.model_dump(), {"role": "user", "content": "And tomorrow?"}]
    second = client.chat.completions.create(model=llm.model_name, messages=history, max_tokens=3)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_forced_tool_call_then_replay(server, llm):
    """A named tool_choice yields a call even from a random model; the assistant message exactly as returned,
    then a tool message, renders and is answered; the request objects are not modified."""
    first_body = {"messages": USER, "tools": [WEATHER, TIME], "max_tokens": 56, "temperature": 0,
                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    status, _, first = request(server, "POST", "/v1/chat/completions", first_body)
    assert status == 200, first
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert set(json.loads(calls[0]["function"]["arguments"])) >= {"city", "days"}
    history = USER + [choice["message"], {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
    for content in (choice["message"].get("content"), "", None):
        body = {"messages": copy.deepcopy(history), "tools": [WEATHER, TIME], "max_tokens": 4}
        body["messages"][1]["content"] = content
        before = copy.deepcopy(body)
        out = pocketllm.chat_completions(llm, body)
        assert body == before                               # the request's own objects are untouched
        assert out["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
        status, _, second = request(server, "POST", "/v1/chat/completions", body)
        assert status == 200, second
        assert second["usage"]["prompt_tokens"] == out["usage"]["prompt_tokens"]


def test_required_and_parallel_false(client, llm):
    out = client.chat.completions.create(model=llm.model_name, messages=USER, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=False, max_tokens=56, seed=1)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")
    json.loads(calls[0].function.arguments)


def test_streamed_tool_call_with_sdk_helper(client, llm):
    kwargs = dict(model=llm.model_name, messages=USER, tools=[WEATHER], temperature=0, max_tokens=56,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content.delta":
                assert "<tool_call>" not in event.delta and "<function=" not in event.delta
        final = stream.get_final_completion()
    got, want = final.choices[0].message.tool_calls, whole.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == \
        [(c.function.name, c.function.arguments) for c in want]
    assert final.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_parses_no_calls(client, llm):
    out = client.chat.completions.create(model=llm.model_name, messages=USER, tools=[WEATHER], tool_choice="none",
                                         max_tokens=8)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason != "tool_calls"


def test_python_api_chat(llm):
    """LLM.chat returns what the endpoint sends; closing a stream early aborts it."""
    out = llm.chat(USER, max_tokens=3, ignore_eos=True)
    assert out["object"] == "chat.completion" and out["usage"]["completion_tokens"] == 3
    chunks = list(llm.chat(USER, stream=True, max_tokens=3, ignore_eos=True, stream_options={"include_usage": True}))
    assert chunks[0]["object"] == "chat.completion.chunk" and counts(chunks[-1]["usage"]) == counts(out["usage"])
    stream = llm.chat(USER, stream=True, max_tokens=300, ignore_eos=True)
    next(stream), next(stream)
    stream.close()
    stats = wait_idle(llm)
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"], stats["slots_used"]) == (0, 0, 0, 0)


# -----------------------------------------------------------------------------------------------
# HTTP: endpoints, errors, auth, keep-alive, limits, timeouts, metrics, disconnects, concurrency.
# -----------------------------------------------------------------------------------------------

def test_health_auth_and_routing(server, llm):
    assert request(server, "GET", "/health", key=None)[0] == 200
    status, _, body = request(server, "GET", "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert request(server, "GET", "/metrics", key="nope")[0] == 401
    status, resp, body = request(server, "DELETE", "/v1/models")
    assert status == 405 and resp.getheader("Allow") == "GET"
    status, _, body = request(server, "GET", "/v2/anything")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, _, body = request(server, "POST", "/v1/chat/completions", raw="{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, _, body = request(server, "POST", "/v1/chat/completions", raw='{"messages": NaN}')
    assert status == 400
    status, _, body = request(server, "POST", "/v1/chat/completions", raw="[1, 2]")
    assert status == 400
    status, _, body = request(server, "POST", "/v1/chat/completions", raw="[" * 50_000 + "]" * 50_000)
    assert status == 400
    llm.dead_reason = "CUDA error: an illegal memory access"             # as the engine sets it
    try:
        status, _, body = request(server, "GET", "/health", key=None)
        assert status == 503 and "illegal memory access" in body["error"]["message"]
    finally:
        llm.dead_reason = None


def test_a_bug_is_a_logged_500_and_the_server_goes_on(server, llm, capfd):
    llm.stats = lambda: 1 / 0                                # a bug inside /metrics
    try:
        status, _, body = request(server, "GET", "/metrics")
    finally:
        del llm.stats
    assert status == 500 and body["error"]["type"] == "internal_server_error"
    assert "ZeroDivisionError" not in body["error"]["message"]            # the client gets a generic message
    assert "ZeroDivisionError" in capfd.readouterr().err                  # the server log gets the traceback
    assert request(server, "GET", "/metrics")[0] == 200


def test_keep_alive_tokenize_detokenize(server, llm):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    auth = {"Authorization": f"Bearer {KEY}"}
    results = []
    for path, body in (("/tokenize", {"prompt": "Bonjour, ça va? 🙂", "return_token_strs": True}),
                       ("/tokenize", {"messages": USER}),
                       ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream": True})):
        conn.request("POST", path, body=json.dumps(body), headers=auth)
        resp = conn.getresponse()
        assert resp.status == 200
        results.append(resp.read())
    tok = json.loads(results[0])
    assert tok["tokens"] == llm.tokenizer.encode("Bonjour, ça va? 🙂") and tok["count"] == len(tok["tokens"])
    assert len(tok["token_strs"]) == tok["count"] and tok["max_model_len"] == llm.options.max_context
    assert json.loads(results[1])["tokens"] == reference_prompt_ids(llm, USER)
    assert sse_events(results[2])[-1] == "[DONE]"
    conn.request("POST", "/detokenize", body=json.dumps({"tokens": tok["tokens"]}), headers=auth)
    assert json.loads(conn.getresponse().read()) == {"prompt": "Bonjour, ça va? 🙂"}
    conn.close()


def test_body_limit_and_socket_timeout(llm):
    srv = pocketllm.serve(llm, port=0, block=False, max_request_bytes=1000, socket_timeout=0.5, log_requests=False)
    try:
        status, _, body = request(srv, "POST", "/v1/chat/completions", raw=json.dumps({"messages": USER * 100}))
        assert status == 413 and body["error"]["code"] == "request_too_large"
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 50\r\n\r\n{")   # then silence
        sock.settimeout(5)
        start = time.monotonic()
        while sock.recv(4096):
            pass
        assert time.monotonic() - start < 4                     # the server hung up on the silent client
        sock.close()
        assert request(srv, "GET", "/health")[0] == 200         # and kept serving
    finally:
        srv.shutdown()


def test_a_reset_idle_connection_is_not_an_error(server, capfd):
    """SDKs keep connections alive in a pool; one reset when its process exits is routine, not a traceback."""
    capfd.readouterr()
    status, _, _ = request(server, "GET", "/health")
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")          # kept alive: the server waits for the next request
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()                                                 # RST instead of FIN
    time.sleep(0.3)
    assert status == 200 and request(server, "GET", "/health")[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err


def test_metrics(server, client, llm):
    client.chat.completions.create(model=llm.model_name, messages=USER, max_tokens=3, stream=True).close()
    client.chat.completions.create(model=llm.model_name, messages=USER, max_tokens=3)
    status, _, text = request(server, "GET", "/metrics")
    assert status == 200
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    stats = llm.stats()
    assert samples['pocketllm_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 2
    assert samples["pocketllm_generation_tokens_total"] == stats["generation_tokens_total"] > 0
    assert samples["pocketllm_prompt_tokens_total"] > 0
    assert samples["pocketllm_slots_total"] == stats["slots_total"]
    assert samples["pocketllm_time_to_first_token_seconds_count"] >= 1
    assert samples['pocketllm_inter_token_latency_seconds_bucket{le="+Inf"}'] >= 1
    for family in ("requests_running", "requests_waiting", "kv_cache_usage_ratio", "kv_blocks_used"):
        assert f"# TYPE pocketllm_{family} gauge" in text


def _raw_post(port, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def test_disconnects_free_every_block_and_slot(server, llm):
    wait_idle(llm)
    long = {"messages": USER, "max_tokens": 300, "ignore_eos": True}
    socks = [_raw_post(server.port, {**long, "stream": True}) for _ in range(20)]
    for sock in socks:                                   # wait for a first token, then hang up mid-stream
        sock.settimeout(60)
        got = b""
        while got.count(b"data: ") < 2:                 # the role chunk and a first token's chunk
            got += sock.recv(4096)
        sock.close()
    stats = wait_idle(llm)
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"], stats["slots_used"]) == (0, 0, 0, 0)
    # A non-streamed request whose client leaves before the answer is aborted as well.
    before = llm.stats()["generation_tokens_total"]
    sock = _raw_post(server.port, long)
    while llm.stats()["generation_tokens_total"] == before:
        time.sleep(0.01)
    sock.close()
    stats = wait_idle(llm)
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"], stats["slots_used"]) == (0, 0, 0, 0)
    assert stats["generation_tokens_total"] - before < 300
    assert request(server, "GET", "/health")[0] == 200


def test_32_concurrent_streams(server, llm):
    results = [None] * 32

    def run(i):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = {"messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        results[i] = (resp.status, resp.getheader("Content-Type"), resp.read())
        conn.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for status, content_type, raw in results:
        assert status == 200 and content_type.startswith("text/event-stream")
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and
                c["choices"][0]["finish_reason"]] == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == 6
    stats = wait_idle(llm)
    assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0


def test_cli_port_0_env_key_and_sigterm(llm):
    """`python pocketllm.py --port 0` prints the address it picked, takes its key from the environment,
    and exits 0 on SIGTERM."""
    script = Path(__file__).resolve().parents[1] / "pocketllm.py"
    env = {**os.environ, "POCKETLLM_API_KEY": "env-key"}
    proc = subprocess.Popen([sys.executable, str(script), "--ckpt", str(llm.ckpt_dir), "--port", "0", "--quiet",
                             "--served-model-name", "pocket-test", "--max-context", "128"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "pocket-test" in line and "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() else "")
        port = int(line.strip().rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models", headers={"Authorization": "Bearer env-key"})
        assert json.loads(conn.getresponse().read())["data"][0]["id"] == "pocket-test"
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 401
        conn.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
