"""tool_choice by constrained decoding, on a real byte-level BPE tokenizer with Qwen's added tokens.

The "model" is random logits: it would never call a tool on its own, so every call in these tests is
the processor's doing. Each produced text is decoded and parsed by ChatOutputParser.
"""

import json
import re
import time

import jsonschema
import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

import pocketllm as P

ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
CORPUS = [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "The weather in Paris is sunny with 21 degrees. Numbers: 0 1 2 3 4 5 6 7 8 9 10 -3.5e+2 true false null",
    '{"a": [1, 2], "b": {"c": "d"}} [1, 2, 3] Let me think about it.\n</think>\n\n',
    "def f(x):\n    return x * 2\n", "Zürich, Köln, 東京, café — ok!",
] * 20

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "detailed": {"type": "boolean"}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "set_rate", "parameters": {"type": "object", "properties": {
        "rate": {"type": "number"}, "note": {"type": ["null", "string"]}, "mode": {"enum": [1, 2, 3]},
        "tags": {"type": "array"}, "nothing": {"type": "null"}},
        "required": ["rate", "mode", "nothing", "tags"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=ADDED, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return P.Tokenizer(path)


def run(processor, tokenizer, max_tokens, seed, scale=4.0, vocab_pad=16, device="cpu"):
    """Sample max_tokens tokens from random logits through the processor; stop at an end-of-sequence id."""
    gen = torch.Generator().manual_seed(seed)
    eos = {tokenizer.token_to_id("<|im_end|>")}
    ids = []
    while len(ids) < max_tokens:
        logits = torch.randn(tokenizer.vocab_size + vocab_pad, generator=gen) * scale   # padded vocab, as checkpoints
        out = processor(list(ids), logits.to(device)).cpu()
        token = int(torch.multinomial(out.softmax(-1), 1, generator=gen))
        ids.append(token)
        if token in eos:
            break
    return ids


def parse(tokenizer, ids, in_reasoning, fmt="qwen_xml"):
    text = tokenizer.decode([i for i in ids if i != tokenizer.token_to_id("<|im_end|>")])
    parser = P.ChatOutputParser(TOOLS, fmt, in_reasoning)
    parser.feed(text)
    return parser.message(), text


def check_value(schema, value):
    """The value validates against its parameter's schema (the jsonschema package is the reference), typed as
    JSON, never a raw string standing in for another type; a string argument is never blank."""
    jsonschema.validate(value, schema)
    kinds = P._schema_types(schema)
    if "enum" in schema:
        assert value in schema["enum"]
    elif kinds == ["integer"]:
        assert type(value) is int
    elif kinds == ["number"]:
        assert type(value) in (int, float)
    elif kinds == ["boolean"]:
        assert type(value) is bool
    elif kinds == ["null"]:
        assert value is None
    elif kinds == ["array"]:
        assert isinstance(value, list)           # every array is closed validly now, even from random logits
    elif kinds == ["string"]:
        assert isinstance(value, str) and value.strip()
    else:
        assert value is None or isinstance(value, str) and value.strip()   # ["null", "string"]


def check_call(tokenizer, ids, max_tokens, in_reasoning, names, fmt="qwen_xml"):
    assert len(ids) <= max_tokens and ids[-1] == tokenizer.token_to_id("<|im_end|>"), "call not closed in budget"
    message, text = parse(tokenizer, ids, in_reasoning, fmt)
    assert ('"arguments": {' in text) == (fmt == "hermes") and ("<function=" in text) == (fmt == "qwen_xml"), text
    if fmt == "hermes":      # the body is JSON a Hermes model knows, not just something our parser tolerates
        for body in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S):
            assert set(json.loads(body)) == {"name", "arguments"}, body
    assert message["tool_calls"], text
    for call in message["tool_calls"]:
        name = call["function"]["name"]
        assert name in names, text
        args = json.loads(call["function"]["arguments"])
        params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        assert set(params.get("required", [])) <= set(args), text
        assert set(args) <= set(params["properties"]), text
        for key, value in args.items():
            check_value(params["properties"][key], value)
    assert "<" not in (message["content"] or ""), text
    return message, text


@pytest.mark.parametrize("fmt", ["qwen_xml", "hermes"])
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_rate"}},
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_from_random_logits(tokenizer, choice, seed, fmt):
    max_tokens = 200
    processor = P.tool_choice_processor(tokenizer, TOOLS, choice, fmt, parallel_tool_calls=False,
                                        in_reasoning=False, max_tokens=max_tokens)
    ids = run(processor, tokenizer, max_tokens, seed)
    names = [t["function"]["name"] for t in TOOLS] if choice == "required" else [choice["function"]["name"]]
    message, _ = check_call(tokenizer, ids, max_tokens, False, names, fmt)
    assert len(message["tool_calls"]) == 1 and message["content"] is None


@pytest.mark.parametrize("fmt", ["qwen_xml", "hermes"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("extra", [0, 4, 70, 350])
def test_forced_call_with_reasoning_and_small_budgets(tokenizer, seed, extra, fmt):
    named = {"type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(P.RequestError) as err:
        P.tool_choice_processor(tokenizer, TOOLS, named, fmt, True, True, max_tokens=10)
    smallest = int(re.search(r"at least (\d+)", str(err.value)).group(1))
    max_tokens = smallest + extra
    processor = P.tool_choice_processor(tokenizer, TOOLS, named, fmt, parallel_tool_calls=True, in_reasoning=True,
                                        max_tokens=max_tokens)
    ids = run(processor, tokenizer, max_tokens, seed)
    message, text = check_call(tokenizer, ids, max_tokens, True, ["get_weather"], fmt)
    assert "</think>" in text and len(message["tool_calls"]) == 1
    assert bool(message["reasoning_content"]) == (extra > 0)     # at the bare minimum, no room to think


def test_reasoning_closed_by_the_model_is_respected(tokenizer):
    """A model that closes its reasoning itself: the call follows its </think>."""
    close = tokenizer.token_to_id("</think>")
    processor = P.tool_choice_processor(tokenizer, TOOLS, "required", "qwen_xml", False, True, 300)
    gen, ids = torch.Generator().manual_seed(1), []
    while not ids or ids[-1] != tokenizer.token_to_id("<|im_end|>"):
        logits = torch.randn(tokenizer.vocab_size, generator=gen)
        if len(ids) == 5:
            logits[close] = 100.0
        ids.append(int(processor(list(ids), logits).argmax()))
    message, text = check_call(tokenizer, ids, 300, True, ["get_weather", "set_rate", "ping"])
    assert text.count("</think>") == 1 and text.index("</think>") < text.index("<tool_call>")


@pytest.mark.parametrize("fmt", ["qwen_xml", "hermes"])
def test_required_with_parallel_calls_may_add_calls(tokenizer, fmt):
    counts = set()
    for seed in range(8):
        processor = P.tool_choice_processor(tokenizer, TOOLS, "required", fmt, True, False, 400)
        ids = run(processor, tokenizer, 400, seed)
        message, _ = check_call(tokenizer, ids, 400, False, ["get_weather", "set_rate", "ping"], fmt)
        counts.add(len(message["tool_calls"]))
    assert 1 in counts and max(counts) > 1


def test_choices_sharing_one_processor(tokenizer):
    """n > 1: the engine calls one processor with each choice's ids, interleaved, and choices may share prefixes."""
    processor = P.tool_choice_processor(tokenizer, TOOLS, "required", "qwen_xml", False, False, 150)
    gens = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
    choices = [[], [], []]
    eos = tokenizer.token_to_id("<|im_end|>")
    while any(not c or c[-1] != eos for c in choices):
        for c, g in zip(choices, gens):
            if not c or c[-1] != eos:
                out = processor(list(c), torch.randn(tokenizer.vocab_size, generator=g) * 4)
                c.append(int(torch.multinomial(out.softmax(-1), 1, generator=g)))
    for c in choices:
        check_call(tokenizer, c, 150, False, ["get_weather", "set_rate", "ping"])


def test_named_tool_missing_or_bad_tool_choice_is_400(tokenizer):
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes", {"type": "tool", "function": {"name": "ping"}},
                {"type": "function"}, 7):
        with pytest.raises(P.RequestError) as err:
            P.tool_choice_processor(tokenizer, TOOLS, bad, "qwen_xml", True, False, 100)
        assert err.value.param == "tool_choice"
    with pytest.raises(P.RequestError) as err:
        P.tool_choice_processor(tokenizer, [], "required", "qwen_xml", True, False, 100)
    assert err.value.param == "tool_choice"


def test_budget_too_small_is_400(tokenizer):
    with pytest.raises(P.RequestError) as err:
        P.tool_choice_processor(tokenizer, TOOLS, {"type": "function", "function": {"name": "set_rate"}}, "qwen_xml",
                                True, False, 10)
    assert err.value.param == "max_tokens"


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_leaves_prose_free(tokenizer, choice):
    """Auto mode (issue 21 item 3: it used to need no processor): until the model opens a call every token is
    allowed but those that would open one with markup the call grammar cannot continue, and the end."""
    processor = P.tool_choice_processor(tokenizer, TOOLS, choice, "qwen_xml", True, False, 100)
    mask = processor.token_mask([], tokenizer.vocab_size, "cpu")
    texts = tokenizer.token_texts()
    free = [i for i, t in enumerate(texts) if t and "<" not in t]
    assert bool(mask[free].all()) and bool(mask[tokenizer.token_to_id("<|im_end|>")])
    assert bool(mask[tokenizer.token_to_id("<tool_call>")])       # the model may call


def test_auto_calls_only_offered_functions(tokenizer):
    """A model that calls a function the request did not offer writes a call to an offered one instead."""
    script = "Sure.\n\n<tool_call>\n<function=delete_all>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    unconstrained, _ = parse(tokenizer, scripted(tokenizer, lambda ids, logits: logits, script), False)
    assert [c["function"]["name"] for c in unconstrained["tool_calls"]] == ["delete_all"]     # the control
    processor = P.tool_choice_processor(tokenizer, TOOLS, "auto", "qwen_xml", True, False, 300)
    message, text = check_call(tokenizer, scripted(tokenizer, processor, script), 300, False,
                               ["get_weather", "set_rate", "ping"])
    assert message["content"] == "Sure." and "delete_all" not in text


def test_none_bans_tool_call_token(tokenizer):
    processor = P.tool_choice_processor(tokenizer, TOOLS, "none", "qwen_xml", True, False, 100)
    logits = torch.zeros(tokenizer.vocab_size)
    logits[tokenizer.token_to_id("<tool_call>")] = 50.0
    out = processor([], logits)
    assert out[tokenizer.token_to_id("<tool_call>")] == float("-inf") and int(out.argmax()) != tokenizer.token_to_id("<tool_call>")


def scripted(tokenizer, processor, script, limit=400):
    """A 'model' that wants to write `script`: it prefers the longest token continuing the script from the text
    so far (whatever tokens were forced before), and the end of sequence once the script is written."""
    pieces, eos = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)], tokenizer.token_to_id("<|im_end|>")
    goal, ids = script.encode(), []
    while len(ids) < limit and (not ids or ids[-1] != eos):
        done = b"".join(pieces[i] for i in ids)
        rest = goal[len(done):] if goal.startswith(done) else b""
        logits = torch.zeros(tokenizer.vocab_size)
        for i, piece in enumerate(pieces):
            if piece and rest.startswith(piece) and i != eos:
                logits[i] = 30.0 + len(piece)
        if goal == done:
            logits[eos] = 30.0
        ids.append(int(processor(list(ids), logits).argmax()))
    return ids


def test_parallel_false_stops_after_first_call(tokenizer):
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")        # both required parameters: auto mode enforces the schema
    script = "Let me look.\n\n" + call + "\n" + call.replace("Paris", "Rome")
    processor = P.tool_choice_processor(tokenizer, TOOLS, "auto", "qwen_xml", False, False, 400)
    ids = scripted(tokenizer, processor, script)
    message, text = parse(tokenizer, ids, False)
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris", "days": 3}]
    assert message["content"] == "Let me look." and "Rome" not in text
    unconstrained = scripted(tokenizer, lambda ids, logits: logits, script)
    assert len(parse(tokenizer, unconstrained, False)[0]["tool_calls"]) == 2      # the script really has two


def test_auto_after_a_call_only_another_call_or_the_end(tokenizer):
    """A model steered to another function than the one it was writing goes on with its own call's markup (seen
    with pocket-tiny: "18\\n</parameter>\\n</function>\\n</tool_call>" in the content); after a call closes, auto
    mode allows whitespace, another call or the end, so neither that nor prose lands in the content."""
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
    for tail in ["\n18\n</parameter>\n</function>\n</tool_call>", "\nThat is all, enjoy Paris."]:
        script = "Let me look.\n\n" + call + tail
        unconstrained, _ = parse(tokenizer, scripted(tokenizer, lambda ids, logits: logits, script), False)
        assert unconstrained["content"].strip() != "Let me look."                # the control: the tail is content
        processor = P.tool_choice_processor(tokenizer, TOOLS, "auto", "qwen_xml", True, False, 400)
        message, text = parse(tokenizer, scripted(tokenizer, processor, script), False)
        assert message["content"] == "Let me look." and text.startswith("Let me look.\n\n" + call), text
        assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris", "days": 3}]
        assert text[len("Let me look.\n\n" + call):].strip() == "", text
    script = "Let me look.\n\n" + call + "\n" + call.replace("Paris", "Rome")      # parallel calls still may follow
    processor = P.tool_choice_processor(tokenizer, TOOLS, "auto", "qwen_xml", True, False, 400)
    message, _ = parse(tokenizer, scripted(tokenizer, processor, script), False)
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == ["Paris", "Rome"]


@pytest.mark.parametrize("fmt, script", [
    ("qwen_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nKöln am Rhein\n</parameter>\n<parameter=days>\n"
                 "10\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln am Rhein", "days": 10, '
               '"unit": "fahrenheit"}}\n</tool_call>'),
])
def test_forced_call_follows_a_willing_model(tokenizer, fmt, script):
    """A model that writes a good call on its own is not disturbed: the values are its own."""
    processor = P.tool_choice_processor(tokenizer, TOOLS, "required", fmt, False, False, 300)
    message, text = parse(tokenizer, scripted(tokenizer, processor, script), False, fmt)
    assert text == script
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == \
        {"city": "Köln am Rhein", "days": 10, "unit": "fahrenheit"}


def test_processor_step_is_cheap(tokenizer):
    processor = P.tool_choice_processor(tokenizer, TOOLS, "required", "hermes", False, True, 3000)
    start = time.perf_counter()
    ids = run(processor, tokenizer, 3000, seed=3)
    per_step = (time.perf_counter() - start) / len(ids)
    check_call(tokenizer, ids, 3000, True, ["get_weather", "set_rate", "ping"], "hermes")
    assert per_step < 0.005, f"{per_step * 1e3:.2f} ms per token"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the engine's logits live there)")
@pytest.mark.parametrize("fmt", ["qwen_xml", "hermes"])
def test_forced_call_with_logits_on_gpu(tokenizer, fmt):
    processor = P.tool_choice_processor(tokenizer, TOOLS, "required", fmt, False, True, 300)
    ids = run(processor, tokenizer, 300, seed=2, device="cuda")
    check_call(tokenizer, ids, 300, True, ["get_weather", "set_rate", "ping"], fmt)


@pytest.fixture(scope="module")
def tiny_llm(ckpt_factory):
    return P.LLM(ckpt_factory("qwen3_5")[0], backend="torch", quiet=True, max_context=1024, max_batch_size=4)


@pytest.mark.parametrize("fmt", ["qwen_xml", "hermes"])
def test_forced_call_through_the_engine(tiny_llm, fmt):
    """A random tiny checkpoint (which never calls on its own) served by the real engine and sampler, n=2:
    the processor rides in SamplingParams.logits_processors and every choice is a call to the named tool."""
    llm = tiny_llm
    template = P.load_chat_template(llm.tokenizer)
    tools = TOOLS[:1]
    prompt = template.render([{"role": "user", "content": "Weather in Paris?"}], tools=tools)
    in_reasoning = P.prompt_ends_in_reasoning(prompt)
    processor = P.tool_choice_processor(llm.tokenizer, tools, {"type": "function", "function": {"name": "get_weather"}},
                                        fmt, False, in_reasoning, max_tokens=120, eos_token_ids=llm.eos_token_ids)
    out = llm.generate(prompt, max_tokens=120, temperature=1.0, seed=3, n=2, logits_processors=[processor])
    assert in_reasoning                              # the template opens <think>: reasoning first, then the call
    for choice in out["choices"]:
        parser = P.ChatOutputParser(tools, fmt, in_reasoning)
        parser.feed(choice["text"])
        message = parser.message()
        assert choice["finish_reason"] == "stop" and choice["completion_tokens"] <= 120, choice
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"], choice["text"]
        args = json.loads(message["tool_calls"][0]["function"]["arguments"])
        assert isinstance(args["city"], str) and type(args["days"]) is int, choice["text"]


def test_tiny_model_does_not_call_on_its_own(tiny_llm):
    """The control for the test above: the same prompt and seed without the processor give no call."""
    prompt = P.load_chat_template(tiny_llm.tokenizer).render([{"role": "user", "content": "Weather in Paris?"}],
                                                             tools=TOOLS[:1])
    for choice in tiny_llm.generate(prompt, max_tokens=120, temperature=1.0, seed=3, n=2)["choices"]:
        parser = P.ChatOutputParser(TOOLS[:1], "qwen_xml", True)
        parser.feed(choice["text"])
        assert parser.message()["tool_calls"] is None
