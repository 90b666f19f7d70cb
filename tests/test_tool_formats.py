"""The tool-call format classes (TOOL_FORMATS), each checked against itself: what a format writes, its own
scanner reads back, its detection recognises, and no other format claims. A new format gets these checks by
being registered; its own parsing cases go beside the Qwen XML and Hermes ones in test_tool_parser.py.

LlamaJsonFormat below is a third format registered only while these tests run: it shows that a new format
is one class (here a small subclass), with nothing else in pocketllm.py to edit.
"""

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

import pocketllm as P


class LlamaJsonFormat(P.HermesFormat):
    """Llama 3.1's JSON calls: {"name": NAME, "parameters": {...}} with no wrapper, for a known tool only."""

    name = "llama_json"
    call_open = call_close = ""
    bare_opens = ("{",)
    call_tail = "}}"

    def header(self, text, at, final, schemas, bare):
        header = super().header(text, at, final, schemas, bare)
        return False if header and schemas and header[1] not in schemas else header

    def call_head(self, lead, name):
        return f'{lead}{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": {{'

    def renders_call(self, text, name):
        return re.search(r'\{\s*"name"\s*:\s*' + re.escape(json.dumps(name)) + r'\s*,\s*"parameters"', text) is not None

    def in_template(self, source):
        return '"parameters"' in source


@pytest.fixture(autouse=True, scope="module")
def third_format():
    P.TOOL_FORMATS[LlamaJsonFormat.name] = LlamaJsonFormat()
    yield
    del P.TOOL_FORMATS[LlamaJsonFormat.name]


FORMATS = sorted(P.TOOL_FORMATS) + [LlamaJsonFormat.name]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]},
        "rate": {"type": "number"}, "detailed": {"type": "boolean"}, "tags": {"type": "array"},
        "options": {"type": "object"}, "nothing": {"type": "null"}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
ARGS = {"city": "Köln \"am\" Rhein\nsüd", "days": 12, "unit": "f", "rate": -3.5, "detailed": False,
        "tags": ["a", 1], "options": {"k": [True, None]}, "nothing": None}


def written_call(fmt, name, args, lead=""):
    """A call as the format's forced-call pieces write it: head, each argument (strings raw unless the format
    writes JSON values), tail."""
    text = fmt.call_head(lead, name)
    for i, (key, value) in enumerate(args.items()):
        value_text = value if isinstance(value, str) and not fmt.json_values else json.dumps(value, ensure_ascii=False)
        text += fmt.param_open(key, i == 0) + value_text + fmt.value_close
    return text + fmt.call_tail


def parse_streamed(fmt_name, text, chunks, in_reasoning=False):
    """The streamed deltas assembled, and the non-streamed message, of one text."""
    parser = P.ChatOutputParser(TOOLS, fmt_name, in_reasoning)
    deltas = [d for chunk in chunks for d in parser.feed(chunk)] + parser.finish()
    calls, content = {}, ""
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"name": part["function"].get("name"), "arguments": ""})
            call["arguments"] += part["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], parser.message()


def test_registry_names_and_errors():
    assert FORMATS and all(P.TOOL_FORMATS[name].name == name for name in FORMATS)
    with pytest.raises(P.PocketError) as e:
        P.ChatOutputParser(None, "no_such_format", in_reasoning=False)
    assert all(name in str(e.value) for name in FORMATS)
    with pytest.raises(P.PocketError):
        P.tool_choice_processor(None, TOOLS, "required", "no_such_format", True, False, 100)
    cli = argparse.ArgumentParser()
    P.add_server_args(cli)
    for name in FORMATS:                                        # --tool-parser offers exactly the registry
        assert cli.parse_args(["--tool-parser", name]).tool_parser == name
    with pytest.raises(SystemExit):
        cli.parse_args(["--tool-parser", "no_such_format"])


@pytest.mark.parametrize("name", FORMATS)
def test_written_call_reads_back_at_every_split(name):
    fmt = P.TOOL_FORMATS[name]
    text = "Let me check.\n\n" + written_call(fmt, "get_weather", ARGS) + written_call(fmt, "ping", {}, lead="\n")
    for cut in range(len(text) + 1):
        content, calls, message = parse_streamed(name, text, [text[:cut], text[cut:]])
        assert content == message["content"] == "Let me check.", (cut, text)
        assert [c["name"] for c in calls] == ["get_weather", "ping"]
        assert [c["arguments"] for c in calls] == [c["function"]["arguments"] for c in message["tool_calls"]]
        parsed = json.loads(calls[0]["arguments"])
        assert parsed == ARGS and list(parsed) == list(ARGS), (cut, text)
        assert json.loads(calls[1]["arguments"]) == {}


@pytest.mark.parametrize("name", FORMATS)
def test_detection_recognises_what_the_format_writes(name):
    fmt = P.TOOL_FORMATS[name]
    for other in FORMATS:                                       # and no other format claims it
        text = written_call(P.TOOL_FORMATS[other], "probe_fn", {"probe_arg": "probe_value"})
        assert fmt.renders_call(text, "probe_fn") == (other == name), (name, text)
        assert not fmt.renders_call(text, "other_fn")
    text = written_call(fmt, "probe_fn", {"probe_arg": "probe_value"})
    template = "{% for m in messages %}{% if m.tool_calls %}" + text + "{% endif %}{% endfor %}"
    assert P.ChatTemplate(template).tool_parser == name
    assert P.detect_tool_format("", text, "probe_fn") == name   # from the source alone, the same answer


def sample_forced(processor, tokenizer, max_tokens, seed):
    """Token ids sampled from random logits (temperature 1) through the processor, up to <|im_end|>."""
    gen, eos, ids = torch.Generator().manual_seed(seed), tokenizer.token_to_id("<|im_end|>"), []
    while len(ids) < max_tokens and eos not in ids:
        logits = processor(ids, torch.randn(tokenizer.vocab_size, generator=gen) * 4)
        ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    return ids


@pytest.fixture(scope="module")
def tokenizer():
    return P.Tokenizer(Path(__file__).resolve().parents[1] / "models" / "pocket-tiny")


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("in_reasoning", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_forced_call_reads_back(tokenizer, name, in_reasoning, seed):
    """tool_choice "required" from random logits (temperature 1): the text is a call in this format's own
    markup, closed within max_tokens, that the same format's parser reads with schema-typed arguments."""
    fmt, max_tokens = P.TOOL_FORMATS[name], 160
    processor = P.tool_choice_processor(tokenizer, TOOLS, "required", name, True, in_reasoning, max_tokens)
    ids = sample_forced(processor, tokenizer, max_tokens, seed)
    assert ids[-1] == tokenizer.token_to_id("<|im_end|>"), "the forced call did not close within max_tokens"
    text = tokenizer.decode(ids[:-1])
    _, calls, message = parse_streamed(name, text, list(text), in_reasoning)
    assert calls and [c["arguments"] for c in calls] == [c["function"]["arguments"] for c in message["tool_calls"]]
    body, pos = text.split("</think>")[-1].lstrip(), 0
    assert body.endswith(fmt.call_tail), text
    for i, call in enumerate(calls):       # each call is this format's head, ..., tail (values cannot hold a head)
        head = fmt.call_head("\n" if i else "", call["name"])
        at = body.find(head, pos)
        assert at == 0 if i == 0 else at > pos and body[:at].endswith(fmt.call_tail), text
        pos = at + len(head)
        args = json.loads(call["arguments"])
        properties = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
        assert set(properties.get("required", [])) <= set(args) <= set(properties["properties"]), text
        for key, value in args.items():
            kind = P._schema_types(properties["properties"][key])[0]
            if kind in ("integer", "number", "boolean", "null"):    # typed by the masks, never a raw string
                assert P._convert_value(json.dumps(value), [kind]) == value and not isinstance(value, str), text


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("in_reasoning", [False, True])
def test_smallest_budget_still_closes_the_call(tokenizer, name, in_reasoning):
    """The format's cost pieces match what it writes: at the smallest max_tokens tool_choice accepts, the
    forced call still closes in budget; one token less is refused."""
    def processor(max_tokens):
        return P.tool_choice_processor(tokenizer, TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                                       name, False, in_reasoning, max_tokens)
    with pytest.raises(P.RequestError) as e:
        processor(1)
    smallest = int(str(e.value).split("at least ")[1].split()[0])
    with pytest.raises(P.RequestError):
        processor(smallest - 1)
    for seed in range(6):
        ids = sample_forced(processor(smallest), tokenizer, smallest, seed)
        assert ids[-1] == tokenizer.token_to_id("<|im_end|>"), (smallest, tokenizer.decode(ids))
        message = P.ChatOutputParser(TOOLS, name, in_reasoning)
        message.feed(tokenizer.decode(ids[:-1]))
        assert set(json.loads(message.message()["tool_calls"][0]["function"]["arguments"])) >= {"city", "days"}
