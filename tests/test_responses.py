"""OpenAI's Responses API (/v1/responses, issue 23) end to end: the bundled pocket-tiny served over real HTTP,
driven by the published `openai` SDK and the OpenAI Agents SDK with its default model class.

The reference is the chat endpoint: a Responses request is translated into a chat body, so at temperature 0 its
answer must be the chat completion's answer for the same conversation, token for token.
"""

import asyncio
import json

import openai
from openai.types.shared import Reasoning
import pytest

import fuzzing
import pocketllm
from fixtures.train_pocket_tiny import TOOLS

KEY = "responses-key"
WEATHER = {"type": "function", **TOOLS[0]["function"]}                      # get_weather(city, days)
ASK = "What is the weather in Paris for 3 days?"


@pytest.fixture(scope="module")
def llm(pocket_tiny):
    return pocket_tiny


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=120)


def raw(server, method, path):
    status, data = fuzzing.request(server.port, method, path, key=KEY)
    return status, json.loads(data)


def chat_answer(client, messages, **extra):
    return client.chat.completions.create(model="pocket-tiny", messages=messages, temperature=0, **extra)


def test_plain_answer_is_the_chat_answer(client, llm):
    r = client.responses.create(model=llm.model_name, input="Hello, who are you?", instructions="Be brief.",
                                max_output_tokens=24, temperature=0)
    chat = chat_answer(client, [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hello, who are you?"}], max_tokens=24)
    message = chat.choices[0].message
    reasoning = [item for item in r.output if item.type == "reasoning"]
    assert r.object == "response" and r.id.startswith("resp_") and r.model == llm.model_name
    assert r.output_text == (message.content or "")
    assert (reasoning[0].summary[0].text if reasoning else None) == message.reasoning_content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (r.usage.output_tokens_details.reasoning_tokens > 0) == bool(reasoning)


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model="pocket-tiny", input="Tell me a long story.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_stream_events_build_the_same_response(client):
    kwargs = dict(model="pocket-tiny", input=ASK, tools=[WEATHER], max_output_tokens=50, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert [item.type for item in final.output] == [item.type for item in whole.output]
    assert final.output_text == whole.output_text
    for index, item in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[-1].type == "response.output_item.done"
        assert mine[-1].item == item
        if item.type == "function_call":
            deltas = "".join(e.delta for e in mine if e.type == "response.function_call_arguments.delta")
            assert deltas == item.arguments == whole.output[index].arguments
            assert len([e for e in mine if e.type == "response.function_call_arguments.delta"]) > 1  # per parameter
        elif item.type == "message":
            assert "".join(e.delta for e in mine if e.type == "response.output_text.delta") == item.content[0].text
            assert "response.content_part.added" in [e.type for e in mine]
        else:
            assert "".join(e.delta for e in mine if e.type == "response.reasoning_summary_text.delta") == \
                item.summary[0].text


def test_tool_round_trip_with_function_call_output(client):
    """Sampled as users send it (temperature 1), the call forced by tool_choice so it is certain."""
    first = client.responses.create(model="pocket-tiny", input=ASK, tools=[WEATHER], tool_choice="required",
                                    temperature=1.0, max_output_tokens=96, reasoning={"effort": "none"})
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) <= {"city", "days"} and "city" in arguments
    history = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": json.dumps({"city": arguments["city"], "forecast": "sunny", "high_c": 21})}]
    second = client.responses.create(model="pocket-tiny", input=history, tools=[WEATHER], temperature=0,
                                     max_output_tokens=16, reasoning={"effort": "none"})
    assert second.output and second.usage.input_tokens > first.usage.input_tokens


def test_previous_response_id_continues_the_stored_conversation(client, server):
    first = client.responses.create(model="pocket-tiny", input=ASK, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=96, temperature=0)
    call = next(item for item in first.output if item.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}
    continued = client.responses.create(model="pocket-tiny", previous_response_id=first.id, input=[result],
                                        tools=[WEATHER], max_output_tokens=12, temperature=0)
    replayed = client.responses.create(
        model="pocket-tiny", input=[{"role": "user", "content": ASK},
                                    *[item.model_dump(exclude_none=True) for item in first.output], result],
        tools=[WEATHER], max_output_tokens=12, temperature=0, store=False)
    assert continued.previous_response_id == first.id
    assert continued.usage.input_tokens == replayed.usage.input_tokens          # the same prompt
    assert continued.output_text == replayed.output_text
    assert client.responses.retrieve(first.id).output == first.output
    status, body = raw(server, "DELETE", f"/v1/responses/{continued.id}")
    assert (status, body) == (200, {"id": continued.id, "object": "response.deleted", "deleted": True})
    assert raw(server, "GET", f"/v1/responses/{continued.id}")[0] == 404
    with pytest.raises(openai.BadRequestError) as e:                             # store: false kept nothing
        client.responses.create(model="pocket-tiny", previous_response_id=replayed.id, input="and?")
    assert e.value.body["param"] == "previous_response_id"


def test_reasoning_items_carry_the_thinking_when_asked(client):
    r = client.responses.create(model="pocket-tiny", input="Hi!", include=["reasoning.encrypted_content"],
                                reasoning={"effort": "high", "summary": "auto"}, max_output_tokens=12, store=False)
    reasoning = [item for item in r.output if item.type == "reasoning"]
    assert reasoning and reasoning[0].encrypted_content == reasoning[0].summary[0].text
    off = client.responses.create(model="pocket-tiny", input="Hi!", reasoning={"effort": "none"},
                                  max_output_tokens=4, store=False)
    assert not [item for item in off.output if item.type == "reasoning"]


@pytest.mark.parametrize("field,value,param", [
    ("tools", [{"type": "web_search"}, {"type": "function", "name": "f", "parameters": {"required": 5}}],
     "tools[1].parameters.required"),
    ("tools", [{"type": "function", "name": "f", "parameters": {"type": "object", "required": 5}}],
     "tools[0].parameters.required"),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0].type"),
    ("input", [{"type": "item_reference", "id": "x"}], "input[0].type"),
    ("tool_choice", {"type": "web_search_preview"}, "tool_choice.type"),
    ("include", ["message.output_text.logprobs"], "include[0]"),
    ("background", True, "background"),
    ("temprature", 1, "temprature"),
    ("max_output_tokens", 5000, "max_output_tokens"),
    ("metadata", {"k": None}, "metadata.k"),                   # inside a map or an array: named by its path
    ("include", ["reasoning.encrypted_content", None], "include[1]"),
    ("input", [{"role": "user", "content": [{"type": "input_text", "text": None}]}], "input[0].content[0].text"),
])
def test_refusals_name_the_field(client, field, value, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="pocket-tiny", input="Hi", extra_body={field: value})
    assert e.value.body["param"] == param, e.value.body


def test_json_schema_text_format_answers_json(client):
    """text.format goes to the chat's response_format: valid JSON once the structured-output decoder is merged."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model="pocket-tiny", input="Name a city.", max_output_tokens=60, temperature=1.0,
                                reasoning={"effort": "none"},
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["city"], str)


def test_agents_sdk_default_model_runs_a_function_tool(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city."""
        seen.append(city)
        return json.dumps({"city": city, "days": days, "forecast": "sunny", "high_c": 21})

    def agent():
        """A fresh client per event loop: run_sync and asyncio.run each run their own."""
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)
        model = agents.OpenAIProvider(openai_client=client).get_model("pocket-tiny")
        assert type(model).__name__ == "OpenAIResponsesModel"                  # the default model class
        return agents.Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather], model=model,
                            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48,
                                                                reasoning=Reasoning(effort="none")))

    result = agents.Runner.run_sync(agent(), ASK, max_turns=4)
    assert seen and isinstance(result.final_output, str)
    assert any(item.type == "tool_call_output_item" for item in result.new_items)

    async def streamed():
        run = agents.Runner.run_streamed(agent(), ASK, max_turns=4)
        kinds = [event.type async for event in run.stream_events()]
        return run, kinds
    run, kinds = asyncio.run(streamed())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert len(seen) >= 2 and isinstance(run.final_output, str)


def test_response_store_is_bounded():
    store = pocketllm.ResponseStore(max_count=2, max_bytes=10_000)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and store.get("r2")[0] == {"id": "r2"}
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 6000}])
    store.put({"id": "big2"}, [{"role": "user", "content": "x" * 6000}])
    assert store.get("big") is None and store.get("big2") and store.bytes <= 10_000
    assert store.delete("big2") and not store.delete("big2") and store.get("r2") is None
