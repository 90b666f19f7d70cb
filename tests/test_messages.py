"""Anthropic's Messages API (/v1/messages and /v1/messages/count_tokens, issue 23) end to end: the bundled
pocket-tiny served over real HTTP, driven by the published `anthropic` SDK and raw sockets.

The reference is the chat endpoint: a Messages request is translated into a chat body, so at temperature 0 its
answer must be the chat completion's answer for the same conversation.
"""

import json

import anthropic
import openai
import pytest

import fuzzing
from fixtures.train_pocket_tiny import TOOLS

KEY = "messages-key"
WEATHER = {"name": "get_weather", "description": TOOLS[0]["function"]["description"],
           "input_schema": TOOLS[0]["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
GREEDY = {"extra_body": {"temperature": 0}}          # the current SDK no longer lists temperature; the API takes it


@pytest.fixture(scope="module")
def llm(pocket_tiny):
    return pocket_tiny


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=120)


def raw(server, method, path, body=None, headers=None):
    return fuzzing.request(server.port, method, path, body, headers=headers)


def test_plain_answer_is_the_chat_answer(client, chat, llm):
    m = client.messages.create(model=llm.model_name, max_tokens=40, system="Be brief.",
                               messages=[{"role": "user", "content": "Hello, who are you?"}], **GREEDY)
    reference = chat.chat.completions.create(
        model=llm.model_name, max_tokens=40, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [block.type for block in m.content] == ["text"]                     # thinking is off unless asked
    assert m.content[0].text == reference.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[reference.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == reference.usage.prompt_tokens
    assert m.usage.output_tokens == reference.usage.completion_tokens


def test_thinking_blocks_and_max_tokens(client):
    m = client.messages.create(model="pocket-tiny", max_tokens=60, messages=ASK, thinking={"type": "adaptive"})
    assert m.content[0].type == "thinking" and m.content[0].thinking and m.content[0].signature
    cut = client.messages.create(model="pocket-tiny", max_tokens=2, messages=ASK, thinking={"type": "adaptive"})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_stop_sequences(client):
    free = client.messages.create(model="pocket-tiny", max_tokens=30, messages=ASK, **GREEDY)
    word = free.content[0].text.split()[2]
    m = client.messages.create(model="pocket-tiny", max_tokens=30, messages=ASK, stop_sequences=[word], **GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert word not in m.content[0].text


def test_stream_tool_round_trip(client):
    """tool_use streamed (sampled at temperature 1, the call forced by tool_choice any), then a tool_result."""
    events = []
    with client.messages.stream(model="pocket-tiny", max_tokens=80, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body={"temperature": 1.0}) as stream:
        events = [event.type for event in stream]
        first = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(events)
    assert first.stop_reason == "tool_use"
    call = next(block for block in first.content if block.type == "tool_use")
    assert call.name == "get_weather" and call.id.startswith("toolu_") and "city" in call.input
    result = {"type": "tool_result", "tool_use_id": call.id,
              "content": json.dumps({"city": call.input["city"], "forecast": "sunny", "high_c": 21})}
    conversation = ASK + [{"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                            for block in first.content]},
                          {"role": "user", "content": [result]}]
    with client.messages.stream(model="pocket-tiny", max_tokens=60, messages=conversation, tools=[WEATHER],
                                **GREEDY) as stream:
        text = "".join(stream.text_stream)
        second = stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert text == "".join(block.text for block in second.content if block.type == "text")
    prompt = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens   # noqa: E731 (cache reads apart)
    assert prompt(second) > prompt(first)


def test_raw_stream_events(server):
    """The wire itself: `event:` lines naming each data's type, ping, input_json_delta per parameter."""
    body = {"model": "pocket-tiny", "max_tokens": 80, "messages": ASK, "tools": [WEATHER], "stream": True,
            "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 0}
    status, data = raw(server, "POST", "/v1/messages?beta=true", body,
                       {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "x-2025-01-01"})
    assert status == 200
    events = [block.split("\n") for block in data.decode().strip().split("\n\n")]
    assert all(len(e) == 2 and e[0].startswith("event: ") and e[1].startswith("data: ") for e in events)
    parsed = [(e[0][7:], json.loads(e[1][6:])) for e in events]
    assert all(name == obj["type"] for name, obj in parsed)
    names = [name for name, _ in parsed]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    partial = [obj["delta"]["partial_json"] for name, obj in parsed
               if name == "content_block_delta" and obj["delta"]["type"] == "input_json_delta"]
    assert len(partial) > 1 and "city" in json.loads("".join(partial))
    assert parsed[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_count_tokens_is_the_rendered_prompt(client, server, llm):
    counted = client.messages.count_tokens(model="pocket-tiny", messages=ASK, system="Be brief.", tools=[WEATHER])
    m = client.messages.create(model="pocket-tiny", max_tokens=1, messages=ASK, system="Be brief.", tools=[WEATHER])
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    chat_tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                    "parameters": WEATHER["input_schema"]}}]
    status, data = raw(server, "POST", "/tokenize", {
        "messages": [{"role": "system", "content": "Be brief."}, *ASK], "tools": chat_tools,
        "chat_template_kwargs": {"enable_thinking": False}}, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(data)["count"] == counted.input_tokens


@pytest.mark.parametrize("body,param", [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}, {
        "name": "f", "input_schema": {"type": "object", "required": 5}}]}, "tools[1].input_schema.required"),
    ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 50, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 50}},
     "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5000, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 5, "messages": ASK, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
     "context_management.edits[0]"),
    # A null or a wrong type inside a map or an array is named by its path (issue 47).
    ({"max_tokens": 5, "messages": ASK, "output_config": {"effort": []}}, "output_config.effort"),
    ({"max_tokens": 5, "messages": ASK, "metadata": {"user_id": 5}}, "metadata.user_id"),
    ({"max_tokens": 5, "messages": ASK, "metadata": {"colour": "red"}}, "metadata.colour"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": ["x", None]}, "stop_sequences[1]"),
    ({"max_tokens": 5, "messages": ASK, "context_management": {"edits": [{"type": None}]}},
     "context_management.edits[0].type"),
])
def test_errors_in_anthropic_shape(server, body, param):
    status, data = raw(server, "POST", "/v1/messages", {"model": "pocket-tiny", **body}, {"x-api-key": KEY})
    error = json.loads(data)
    assert status == 400 and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param, error


def test_auth_and_routes(server, client):
    assert raw(server, "POST", "/v1/messages", {"max_tokens": 1, "messages": ASK}, {"x-api-key": "wrong"})[0] == 401
    status, data = raw(server, "POST", "/v1/messages/count_tokens", {"messages": ASK})
    assert status == 401 and json.loads(data)["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=1, messages=ASK)
    assert raw(server, "HEAD", "/")[0] == 200
    assert raw(server, "HEAD", "/v1/models", headers={"x-api-key": KEY})[0] == 200


def test_tool_results_and_thinking_replay(client):
    """A replayed conversation with thinking, tool_use and an is_error tool_result renders and answers."""
    conversation = ASK + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I need the weather.", "signature": "s"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "days": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "service down"}]},
                                     {"type": "text", "text": "Sorry about that.", "cache_control": {"type": "ephemeral"}}]}]
    m = client.messages.create(model="pocket-tiny", max_tokens=20, messages=conversation, tools=[WEATHER],
                               metadata={"user_id": "u"}, **GREEDY)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use") and m.usage.input_tokens + m.usage.cache_read_input_tokens > 60
