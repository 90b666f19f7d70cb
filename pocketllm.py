"""pocketllm: serve a Qwen FP8 checkpoint behind an OpenAI-compatible API, from one file.

Quickstart:

    pip install -r requirements.txt && python pocketllm.py            # serves the bundled pocket-tiny
    python pocketllm.py --ckpt /models/Qwen3.5-27B-FP8 --port 8000       # your checkpoint

    import pocketllm
    llm = pocketllm.LLM("/models/Qwen3.5-27B-FP8")
    print(llm.generate("The capital of France is", max_tokens=8)["text"])

Sections, in dependency order (each name is defined above its first use):

     0. Header: imports, version, the error hierarchy.
     1. Configuration: the model config from config.json, engine options, sampling parameters.
     2. Checkpoint loading: safetensors, HF names, FP8 block scales, shard helpers.
     3. Backends: the op list; the torch reference ops, then the native (cffi) ops.
     4. The model: norms, RoPE, gated DeltaNet, gated attention, MLP, layers, forward over a batch.
     5. Memory: paged KV blocks and recurrent-state slots.
     6. Scheduler: sequences, continuous batching, chunked prefill, preemption.
     7. Sampler.
     8. Runner and tensor parallelism.
     9. Engine: step = schedule, run, postprocess; request queues; abort. Token ids only.
    10. Text: tokenizer, incremental UTF-8-safe detokenizer, stop strings, sandboxed chat templates.
    11. Output parsing: reasoning and tool calls, streaming by partial re-parse and diff; tool_choice.
    12. OpenAI protocol: request validation into native types; response and chunk builders.
    13. HTTP server: ThreadingHTTPServer, route table, error translator, SSE.
    14. The LLM object (the Python API) and the CLI.
"""

from __future__ import annotations

__version__ = "0.1.0"
__license__ = "Apache-2.0"

import argparse
import dataclasses
import hmac
import http.server
import itertools
import json
import math
import os
import queue
import random
import re
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


# -----------------------------------------------------------------------------------------------
# 0. Errors. User mistakes are PocketError subclasses with one clear line; anything else is a bug.
# -----------------------------------------------------------------------------------------------

class PocketError(Exception):
    """A user-facing error: the message is one line that names the file, flag, tensor or field."""


class CheckpointError(PocketError):
    """The checkpoint directory is missing something or holds something we cannot load."""


class RequestError(PocketError):
    """A request is invalid. `param` names the offending field; `status` is the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


# ===== SECTION 1: configuration (owner: core) =====


# ===== SECTION 2: checkpoint loading (owner: core) =====


# ===== SECTION 3: torch backend ops (owner: core) =====


# ===== SECTION 3b: native backend ops (owner: native) =====


# ===== SECTION 4: the model (owner: core) =====


# ===== SECTION 5-9: memory, scheduler, sampler, runner, engine (owner: core) =====


# ===== SECTION 10: text (owner: core: tokenizer + detokenizer; text: chat templates) =====


# ===== SECTION 11: output parsing and tool_choice (owner: text) =====
import ast
import copy
import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils


# -----------------------------------------------------------------------------------------------
# Chat templates: the checkpoint's jinja2 template is untrusted code, so it runs in an immutable
# sandbox with the globals and filters HF templates expect.
# -----------------------------------------------------------------------------------------------

def _template_raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _template_strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _template_tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """HF's tojson: keeps non-ASCII and key order, no HTML escaping (jinja2's own tojson does both)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace() refusing underscore names, which could shadow its internals (as HF does)."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.sandbox.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _TemplateSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Refuses unsafe attribute access at once; the stock sandbox renders it as an empty Undefined."""

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.sandbox.SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _named_templates(source) -> dict[str, str]:
    """tokenizer_config.json's chat_template is a string or a list of {"name", "template"}."""
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, dict):
        return {str(k): v for k, v in source.items() if isinstance(v, str)}
    if isinstance(source, list):
        return {t["name"]: t["template"] for t in source
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_fn", "description": "probe", "parameters": {
    "type": "object", "properties": {"probe_arg": {"type": "string"}}, "required": ["probe_arg"]}}}]
_PROBE_MESSAGES = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_probe", "type": "function", "function": {
        "name": "probe_fn", "arguments": {"probe_arg": "probe_value"}}}]},
    {"role": "tool", "tool_call_id": "call_probe", "content": "probe result"},
]


class ChatTemplate:
    """The checkpoint's chat template: messages (+ tools) -> prompt text.

    `source` is a template string or tokenizer_config.json's list of named templates ("tool_use" is used
    when tools are given, else "default"). `tool_parser` is the tool-call format the template teaches the
    model ("qwen_xml" or "hermes"), found by rendering a probe conversation; callers may override it.
    """

    def __init__(self, source, tokenizer=None):
        env = _TemplateSandbox(trim_blocks=True, lstrip_blocks=True,
                               extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        env.filters["tojson"] = _template_tojson
        env.globals["raise_exception"] = _template_raise_exception
        env.globals["strftime_now"] = _template_strftime_now
        env.globals["namespace"] = _TemplateNamespace
        self.sources = _named_templates(source)
        if not self.sources:
            raise CheckpointError("chat template: expected a string or a list of {name, template} objects")
        self.templates = {}
        for name, text in self.sources.items():
            try:
                self.templates[name] = env.from_string(text)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(f"chat template {name!r}: syntax error at line {exc.lineno}: {exc.message}") from None
        self.special_tokens = {key: getattr(tokenizer, key, None) for key in ("bos_token", "eos_token", "pad_token")}
        self.tool_parser = self._detect_tool_parser()

    def _pick(self, tools):
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default") or next(iter(self.templates.values()))

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt=True,
               continue_final_message=False, **template_kwargs) -> str:
        """Render in the sandbox. Any template failure is the request's fault: RequestError(param="messages")."""
        if add_generation_prompt and continue_final_message:
            raise RequestError("add_generation_prompt and continue_final_message cannot both be true",
                               param="continue_final_message")
        messages = messages_for_template(messages)
        if continue_final_message:
            _tag_final_message(messages)
        context = {**self.special_tokens, **template_kwargs, "messages": messages, "tools": tools or None,
                   "add_generation_prompt": bool(add_generation_prompt)}
        try:
            text = self._pick(tools).render(**context)
        except Exception as exc:   # the template is untrusted code: whatever it raises is reported, not a 500
            message = str(exc).replace("\n", " ").strip() or type(exc).__name__
            raise RequestError(f"chat template error: {message}", param="messages") from None
        if continue_final_message:
            text = _cut_at_continue_tag(text)
        return text

    def _detect_tool_parser(self) -> str:
        try:
            text = self.render(_PROBE_MESSAGES, tools=_PROBE_TOOLS, add_generation_prompt=True)
        except RequestError:
            text = ""
        if "<function=probe_fn>" in text:
            return "qwen_xml"
        if re.search(r'<tool_call>\s*\{\s*"name"\s*:\s*"probe_fn"', text):
            return "hermes"
        sources = "\n".join(self.sources.values())
        if "<function=" not in sources and "<tool_call>" in sources:
            return "hermes"
        return "qwen_xml"


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "   # trailing space: shows whether the template trimmed the content


def _tag_final_message(messages: list[dict]) -> None:
    """continue_final_message (as HF): mark where the final message's content ends, then cut the prompt there."""
    if not messages or not isinstance(messages[-1], dict) or not isinstance(messages[-1].get("content"), str):
        raise RequestError("continue_final_message needs a final message with text content", param="messages")
    messages[-1]["content"] += _CONTINUE_TAG


def _cut_at_continue_tag(text: str) -> str:
    at = text.rfind(_CONTINUE_TAG.strip())
    if at == -1:
        raise RequestError("continue_final_message: the chat template does not render the final message's content",
                           param="messages")
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


def load_chat_template(tokenizer, override_path: str | None = None, ckpt_dir=None) -> ChatTemplate | None:
    """The chat template: --chat-template FILE (a .jinja text, or a .json with "chat_template"), else the
    tokenizer's (chat_template.jinja before tokenizer_config.json), else those files in ckpt_dir. None if none."""
    source = None
    if override_path:
        path = Path(override_path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PocketError(f"--chat-template {path}: cannot read it ({exc.strerror})") from None
        source = text
        if path.suffix == ".json":
            try:
                source = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError):
                raise PocketError(f"--chat-template {path}: a .json file must hold a \"chat_template\" key") from None
    else:
        source = getattr(tokenizer, "chat_template_source", None)
        if source is None and ckpt_dir is not None:
            source = _chat_template_from_dir(Path(ckpt_dir))
    return ChatTemplate(source, tokenizer) if source else None


def _chat_template_from_dir(ckpt_dir: Path):
    if (ckpt_dir / "chat_template.jinja").is_file():
        return (ckpt_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (ckpt_dir / "tokenizer_config.json").is_file():
        try:
            return json.loads((ckpt_dir / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError):
            raise CheckpointError(f"{ckpt_dir / 'tokenizer_config.json'}: not a JSON object") from None
    return None


def messages_for_template(messages: list[dict]) -> list[dict]:
    """A converted deep copy of OpenAI messages for the template; the request's own objects are untouched.

    - tool_calls[].function.arguments: a JSON string holding an object becomes that object (key order kept),
      as templates iterate it with `|items`; any other string (invalid JSON, or JSON that is not an object)
      is left as the string, so the template decides (a template that needs a mapping then fails with a 400).
    - content parts [{"type": "text", "text": ...}, ...] become their texts joined with "\\n"; other part
      types are refused. None content becomes "".

    >>> messages_for_template([{"role": "assistant", "content": None, "tool_calls": [
    ...     {"function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]}])[0]["tool_calls"][0]["function"]
    {'name': 'f', 'arguments': {'b': 1, 'a': 2}}
    """
    converted = copy.deepcopy(messages)
    for i, message in enumerate(converted if isinstance(converted, list) else []):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list):
            message["content"] = _flatten_content(content, f"messages[{i}].content")
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    arguments = json.loads(function["arguments"])
                except ValueError:
                    continue
                if isinstance(arguments, dict):
                    function["arguments"] = arguments
    return converted


def _flatten_content(parts: list, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{where}[{j}]: content parts of type {kind!r} are not supported (text only)",
                               param="messages")
    return "\n".join(texts)


def prompt_ends_in_reasoning(prompt_text: str) -> bool:
    """True when the prompt's last turn opened <think> and did not close it (the model starts in reasoning)."""
    turn = prompt_text[prompt_text.rfind("<|im_start|>"):] if "<|im_start|>" in prompt_text else prompt_text
    return turn.rfind("<think>") > turn.rfind("</think>")


# -----------------------------------------------------------------------------------------------
# Output parsing: generated text -> reasoning_content, content and tool_calls. One scanner reads the
# text left to right and commits only what more text cannot change. Streaming re-runs it over the
# accumulated text (resuming where it last committed) and sends the difference, so a stream always
# assembles to exactly the non-streamed parse.
# -----------------------------------------------------------------------------------------------

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNC_OPEN, _FUNC_CLOSE = "<function=", "</function>"
_PARAM_OPEN, _PARAM_CLOSE = "<parameter=", "</parameter>"
_VALUE_ENDS = (_PARAM_CLOSE, _PARAM_OPEN, _FUNC_CLOSE, _CALL_CLOSE)   # an XML value ends at the first of these
_VALUE_END_RE = re.compile("|".join(map(re.escape, _VALUE_ENDS)))
_CALL_MARKERS = (_PARAM_OPEN, _PARAM_CLOSE, _FUNC_CLOSE, _CALL_CLOSE, _CALL_OPEN, _FUNC_OPEN)
_MAX_NAME = 256                       # a "name" longer than this is prose, not markup
_HERMES_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.)*)"')
_HERMES_HEAD_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*(?::\s*(?:"(?:[^"\\\n]|\\.)*\\?)?)?)?)?)?)?)?)?\Z')
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_DECODER = json.JSONDecoder(strict=False)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _is_partial(text: str, i: int, marker: str) -> bool:
    """text[i:] is a proper prefix of marker: more text could complete it."""
    return len(text) - i < len(marker) and marker.startswith(text[i:])


def _held_start(text: str, start: int, markers) -> int:
    """Where an unfinished marker may begin at the end of text (len(text) if none). Markers start with '<'."""
    i = text.find("<", max(start, len(text) - max(map(len, markers)) + 1))
    while i != -1:
        if any(_is_partial(text, i, marker) for marker in markers):
            return i
        i = text.find("<", i + 1)
    return len(text)


def _strip_format_newlines(raw: str) -> str:
    """An XML value sits on its own lines: drop the one newline after <parameter=P> and the one before </parameter>."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _member_json(key: str, value) -> str:
    return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


# Argument values by JSON-schema type. A string parameter keeps the model's raw text; anything else is parsed,
# and a value that does not parse as its declared type stays the raw string (never an exception).

def _no_json_constant(name):
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str):
    return json.loads(text, parse_constant=_no_json_constant)


def _json_or_literal(text: str):
    """JSON, else a Python literal (models sometimes write {'a': 1}); must serialize back to JSON."""
    try:
        return _strict_json(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)
        return value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _as_type(text: str, kind: str):
    """(True, value) when text reads as a value of JSON-schema type `kind`, else (False, None)."""
    if kind == "string":
        return True, text
    word = text.strip()
    if kind == "boolean" and word.lower() in ("true", "false"):
        return True, word.lower() == "true"
    if kind == "null" and word.lower() in ("null", "none"):
        return True, None
    if kind in ("integer", "number"):
        try:
            value = _strict_json(word)
        except ValueError:
            return False, None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False, None
        if kind == "integer" and isinstance(value, float):
            return (True, int(value)) if value.is_integer() else (False, None)
        return True, value
    if kind in ("object", "array"):
        value = _json_or_literal(word)
        return (True, value) if isinstance(value, dict if kind == "object" else list) else (False, None)
    return False, None


def _json_or_text(text: str):
    try:
        return _strict_json(text.strip())
    except ValueError:
        return text


def _convert_value(text: str, types: list[str] | None):
    """The value of a parameter whose schema accepts `types` (tried in order); None = not in the schema."""
    if not types:
        return _json_or_text(text)
    for kind in types:
        ok, value = _as_type(text, kind)
        if ok:
            return value
    return text


def _json_type_name(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", dict: "object", list: "array"}.get(type(value), "null")


def _schema_types(schema) -> list[str]:
    """The JSON-schema types a parameter accepts, in the order to try them: type / type lists / anyOf / oneOf,
    else the types of its enum or const values."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        kinds = [kind]
    elif isinstance(kind, list):
        kinds = [k for k in kind if isinstance(k, str)]
    elif isinstance(schema.get("anyOf"), list) or isinstance(schema.get("oneOf"), list):
        kinds = [k for sub in (schema.get("anyOf") or schema.get("oneOf")) for k in _schema_types(sub)]
    elif isinstance(schema.get("enum"), list) or "const" in schema:
        kinds = [_json_type_name(v) for v in schema.get("enum") or [schema.get("const")]]
    else:
        kinds = ["object"] if "properties" in schema else ["array"] if "items" in schema else []
    return list(dict.fromkeys(kinds))


def _tool_schemas(tools) -> dict[str, dict]:
    """function name -> its parameters' "properties" (empty when it declares none)."""
    schemas = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


class _ParsedCall:
    """One tool call as parsed so far: its name and its arguments as JSON members in generation order."""

    def __init__(self, name: str):
        self.name = name
        self.members: list[str] = []   # '"key": value' JSON texts
        self.keys: set[str] = set()
        self.open_member = ""           # the member whose string value is still arriving (not committed)
        self.closed = False

    def add(self, key: str, value) -> None:
        if key not in self.keys:        # a repeated parameter keeps its first value (it may be streamed already)
            self.keys.add(key)
            self.members.append(_member_json(key, value))

    def arguments(self) -> str:
        """The arguments JSON text so far: "" before the first member, closed with "}" once the call ends."""
        parts = self.members + ([self.open_member] if self.open_member and not self.closed else [])
        if not parts and not self.closed:
            return ""
        return "{" + ", ".join(parts) + ("}" if self.closed else "")


class _OutputScan:
    """The scanner. `run(text, final)` continues from `pos`; every step either commits text it has fully
    understood (and advances) or returns False to wait for more. With final=True nothing waits: unfinished
    markup is resolved the forgiving way (a truncated call is closed with what it has, an unconfirmed
    <tool_call> is text). Modes: start, think, text (prose); xml, call_end, hermes_keys, hermes_args,
    call_junk (inside a call)."""

    def __init__(self, schemas: dict, tool_parser: str, in_reasoning: bool, parse_tools: bool):
        self.schemas, self.tool_parser = schemas, tool_parser
        self.pos, self.mode = 0, "think" if in_reasoning else "start"
        self.reasoning, self.content = "", ""      # raw; shown stripped of surrounding whitespace
        self.calls: list[_ParsedCall] = []
        markers = [_THINK_CLOSE]
        if parse_tools:
            markers += [_CALL_OPEN] + ([_FUNC_OPEN] if tool_parser == "qwen_xml" else [])
        self.markers = markers
        self.marker_re = re.compile("|".join(map(re.escape, markers)))

    def run(self, text: str, final: bool) -> None:
        if self.calls:
            self.calls[-1].open_member = ""
        while self.pos < len(text) and getattr(self, "_" + self.mode)(text, final):
            pass
        if final and self.mode not in ("start", "think", "text"):
            self.calls[-1].closed = True
            self.mode = "text"

    # Prose: reasoning and content, and the call headers that end them.

    def _start(self, text, final):
        rest = text[self.pos:].lstrip()
        if rest.startswith(_THINK_OPEN):         # the template did not pre-fill <think>: the model opens it
            self.pos, self.mode = len(text) - len(rest) + len(_THINK_OPEN), "think"
            return True
        if not final and _THINK_OPEN.startswith(rest):
            return False
        self.mode = "text"
        return True

    def _think(self, text, final):
        return self._prose(text, final, "reasoning")

    def _text(self, text, final):
        return self._prose(text, final, "content")

    def _prose(self, text, final, field):
        match = self.marker_re.search(text, self.pos)
        end = match.start() if match else len(text) if final else _held_start(text, self.pos, self.markers)
        setattr(self, field, getattr(self, field) + text[self.pos:end])
        self.pos = end
        if not match:
            return False
        if match.group() == _THINK_CLOSE:        # ends reasoning; a stray one in content is dropped
            self.pos += len(_THINK_CLOSE)
            self.mode = "text"
            return True
        header = self._call_header(text, self.pos, final)
        if header is None:                        # could still become a call: hold it back
            return False
        if header is False:                       # a literal <tool_call> in prose stays text
            setattr(self, field, getattr(self, field) + match.group())
            self.pos += len(match.group())
            return True
        self.pos, name, self.mode = header       # a call also ends reasoning
        self.calls.append(_ParsedCall(name))
        return True

    def _call_header(self, text, at, final):
        """(end, name, mode) for a confirmed call header at `at`, None while undecided, False if not a call."""
        if not text.startswith(_CALL_OPEN, at):
            return self._xml_header(text, at, final, bare=True)
        j = _skip_ws(text, at + len(_CALL_OPEN))
        if text.startswith(_FUNC_OPEN, j):
            return self._xml_header(text, j, final, bare=False)
        if text.startswith("{", j):
            head = _HERMES_HEAD.match(text, j)
            if head:
                try:
                    return head.end(), json.loads('"' + head.group(1) + '"'), "hermes_keys"
                except ValueError:
                    return False
            return None if not final and _HERMES_HEAD_PREFIX.match(text, j) else False
        return None if not final and (j == len(text) or _is_partial(text, j, _FUNC_OPEN)) else False

    def _xml_header(self, text, at, final, bare):
        start = at + len(_FUNC_OPEN)
        close = text.find(">", start, start + _MAX_NAME + 1)
        if close == -1:
            seen = text[start:start + _MAX_NAME + 1]
            return None if not (final or len(seen) > _MAX_NAME or "\n" in seen or "<" in seen) else False
        name = text[start:close].strip()
        if not name or "\n" in name or "<" in name:
            return False
        if bare and self.schemas and name not in self.schemas:   # a bare <function=X> only for a known tool
            return False
        return close + 1, name, "xml"

    # Qwen XML calls: <parameter=P>\nVALUE\n</parameter> ... </function> </tool_call>.

    def _xml(self, text, final):
        call = self.calls[-1]
        j = _skip_ws(text, self.pos)
        if j == len(text):
            return False
        if text.startswith(_PARAM_OPEN, j):
            return self._xml_parameter(text, j, final, call)
        if text.startswith(_PARAM_CLOSE, j):                   # a duplicate </parameter>
            self.pos = j + len(_PARAM_CLOSE)
            return True
        if text.startswith(_FUNC_CLOSE, j):
            call.closed, self.pos, self.mode = True, j + len(_FUNC_CLOSE), "call_end"
            return True
        if text.startswith(_CALL_CLOSE, j):                    # </function> missing
            call.closed, self.pos, self.mode = True, j + len(_CALL_CLOSE), "text"
            return True
        if text.startswith(_CALL_OPEN, j) or text.startswith(_FUNC_OPEN, j):   # the next call: this one ended
            call.closed, self.pos, self.mode = True, j, "text"
            return True
        if not final and any(_is_partial(text, j, marker) for marker in _CALL_MARKERS):
            self.pos = j
            return False
        after = text.find("<", j + 1)                           # stray text inside a call is dropped
        self.pos = len(text) if after == -1 else after
        return True

    def _xml_parameter(self, text, j, final, call):
        start = j + len(_PARAM_OPEN)
        close = text.find(">", start, start + _MAX_NAME + 1)
        if close == -1:
            seen = text[start:start + _MAX_NAME + 1]
            if final or len(seen) > _MAX_NAME or "\n" in seen:   # not a parameter header
                self.pos = start
                return True
            self.pos = j
            return False
        key, start = text[start:close].strip(), close + 1
        types = self._param_types(call.name, key)
        end = _VALUE_END_RE.search(text, start)
        if end:
            call.add(key, _convert_value(_strip_format_newlines(text[start:end.start()]), types))
            self.pos = end.end() if end.group() == _PARAM_CLOSE else end.start()
            return True
        value = _strip_format_newlines(text[start:_held_start(text, start, _VALUE_ENDS)])
        if final:                                              # truncated: keep what arrived
            call.add(key, _convert_value(value, types))
            self.pos = len(text)
            return True
        if types and types[0] == "string" and key not in call.keys:   # stream a string as it grows
            call.open_member = _member_json(key, value)[:-1]
        self.pos = j
        return False

    def _param_types(self, function, key):
        properties = self.schemas.get(function)
        return _schema_types(properties[key]) if properties is not None and key in properties else None

    def _call_end(self, text, final):
        j = _skip_ws(text, self.pos)
        if text.startswith(_CALL_CLOSE, j):
            self.pos, self.mode = j + len(_CALL_CLOSE), "text"
            return True
        if j == len(text) or not final and _is_partial(text, j, _CALL_CLOSE):
            return False
        self.mode = "text"                                      # </tool_call> missing
        return True

    # Hermes JSON calls: {"name": ..., "arguments": {...}}, the arguments streamed member by member.

    def _hermes_keys(self, text, final):
        call = self.calls[-1]
        j = _skip_ws(text, self.pos)
        if j == len(text):
            return False
        if text[j] == ",":
            self.pos = j + 1
            return True
        if text[j] == "}":
            call.closed, self.pos, self.mode = True, j + 1, "call_end"
            return True
        member = self._json_member(text, j, final)
        if member is None:
            return False
        if member is False:
            return self._junk(call)
        key, v = member
        if key in ("arguments", "parameters") and text[v] == "{" and not call.closed:
            self.pos, self.mode = v + 1, "hermes_args"
            return True
        value = self._json_value(text, v, final)
        if value is None:
            return False
        if value is False:
            return self._junk(call)
        if key in ("arguments", "parameters") and isinstance(value[0], str):   # arguments sent as a JSON string
            inner = _json_or_text(value[0])
            for name, item in (inner.items() if isinstance(inner, dict) else ()):
                call.add(name, item)
        self.pos = value[1]
        return True

    def _hermes_args(self, text, final):
        call = self.calls[-1]
        j = _skip_ws(text, self.pos)
        if j == len(text):
            return False
        if text[j] == ",":
            self.pos = j + 1
            return True
        if text[j] == "}":
            call.closed, self.pos, self.mode = True, j + 1, "hermes_keys"
            return True
        member = self._json_member(text, j, final)
        if member is None:
            return False
        if member is False:
            return self._junk(call)
        key, v = member
        if text[v] == '"' and not _JSON_STRING.match(text, v):  # a string value still arriving: stream it
            value = _json_string_prefix(text, v + 1)
            if final:
                call.add(key, value)
                self.pos = len(text)
                return True
            if key not in call.keys:
                call.open_member = _member_json(key, value)[:-1]
            return False
        value = self._json_value(text, v, final)
        if value is None:
            return False
        if value is False:
            return self._junk(call)
        call.add(key, value[0])
        self.pos = value[1]
        return True

    def _json_member(self, text, j, final):
        """('key', value start) for '"key" :' at j; None while incomplete, False if malformed."""
        key = _JSON_STRING.match(text, j) if text[j] == '"' else None
        if key is None:
            return None if text[j] == '"' and not final else False
        colon = _skip_ws(text, key.end())
        if colon == len(text) or text[colon] == ":" and _skip_ws(text, colon + 1) == len(text):
            return None if not final else False
        if text[colon] != ":":
            return False
        try:
            return _JSON_DECODER.decode(key.group()), _skip_ws(text, colon + 1)
        except ValueError:
            return False

    def _json_value(self, text, v, final):
        """(value, end) for the JSON value at v; None while it may still be arriving, False if malformed."""
        try:
            value, end = _JSON_DECODER.raw_decode(text, v)
        except ValueError:
            # unfinished, unless the call's closing tag has already arrived
            return None if not final and text.find(_CALL_CLOSE, v) == -1 else False
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not final and \
                (end == len(text) or text[end] in "0123456789.eE+-"):
            return None                                         # a number may go on: 1 -> 12, 0 -> 0.5
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return value, end

    def _junk(self, call):
        call.closed, self.mode = True, "call_junk"
        return True

    def _call_junk(self, text, final):
        """After malformed call JSON: drop text up to </tool_call>."""
        end = text.find(_CALL_CLOSE, self.pos)
        if end != -1:
            self.pos, self.mode = end + len(_CALL_CLOSE), "text"
            return True
        self.pos = len(text) if final else _held_start(text, self.pos, (_CALL_CLOSE,))
        return False


def _json_string_prefix(text: str, start: int) -> str:
    """The decoded part of an unterminated JSON string body text[start:], cut before an unfinished escape."""
    body = text[start:]
    for cut in range(len(body), max(len(body) - 7, -1), -1):
        try:
            value = _JSON_DECODER.decode('"' + body[:cut] + '"')
        except ValueError:
            continue
        return value[:-1] if value and "\ud800" <= value[-1] <= "\udbff" else value   # half a surrogate pair
    return ""


class ChatOutputParser:
    """Splits one choice's generated text into reasoning_content, content and tool_calls, streaming or not.

    feed(text) -> OpenAI delta fragments; finish() flushes what was held back; message() is the non-streamed
    parse of everything fed. Text is held back only while it could still be markup (a partial <tool_call>,
    a header not yet confirmed by <function=NAME> or {"name": ...}) or whitespace that is trimmed around
    content. tool_parser ("qwen_xml" | "hermes") picks the form tool_choice forces and whether a bare
    <function=NAME> (no <tool_call>) counts; calls in either form are recognised after <tool_call>.

    >>> p = ChatOutputParser(None, "qwen_xml", in_reasoning=True)
    >>> p.feed("Paris?\\n</think>\\n\\nIt is ") + p.feed("Paris.") + p.finish()
    [{'reasoning_content': 'Paris?'}, {'content': 'It is'}, {'content': ' Paris.'}]
    """

    def __init__(self, tools: list[dict] | None, tool_parser: str, in_reasoning: bool, parse_tools: bool = True):
        if tool_parser not in ("qwen_xml", "hermes"):
            raise PocketError(f"unknown tool parser {tool_parser!r}: use qwen_xml or hermes")
        self._options = (_tool_schemas(tools), tool_parser, in_reasoning, parse_tools)
        self._scan = _OutputScan(*self._options)
        self._text = ""
        self._ids: list[str] = []
        self._sent_reasoning = self._sent_content = ""
        self._sent_arguments: list[str] = []

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._scan.calls)

    def feed(self, text: str) -> list[dict]:
        self._text += text
        self._scan.run(self._text, final=False)
        return self._deltas()

    def finish(self) -> list[dict]:
        self._scan.run(self._text, final=True)
        return self._deltas()

    def message(self) -> dict:
        scan = _OutputScan(*self._options)
        scan.run(self._text, final=True)
        calls = [{"id": self._id(i), "type": "function", "function": {"name": call.name, "arguments": call.arguments()}}
                 for i, call in enumerate(scan.calls)]
        content = scan.content.strip()
        return {"content": content or (None if calls else ""), "reasoning_content": scan.reasoning.strip() or None,
                "tool_calls": calls or None}

    def _id(self, index: int) -> str:
        while len(self._ids) <= index:
            self._ids.append("call_" + uuid.uuid4().hex[:24])
        return self._ids[index]

    def _deltas(self) -> list[dict]:
        """What the scan shows now minus what was already sent. Everything shown only ever grows."""
        deltas = []
        reasoning, content = self._scan.reasoning.strip(), self._scan.content.strip()
        if len(reasoning) > len(self._sent_reasoning) and reasoning.startswith(self._sent_reasoning):
            deltas.append({"reasoning_content": reasoning[len(self._sent_reasoning):]})
            self._sent_reasoning = reasoning
        if len(content) > len(self._sent_content) and content.startswith(self._sent_content):
            deltas.append({"content": content[len(self._sent_content):]})
            self._sent_content = content
        for index, call in enumerate(self._scan.calls):
            if index == len(self._sent_arguments):
                deltas.append({"tool_calls": [{"index": index, "id": self._id(index), "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
                self._sent_arguments.append("")
            arguments, sent = call.arguments(), self._sent_arguments[index]
            if len(arguments) > len(sent) and arguments.startswith(sent):
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": arguments[len(sent):]}}]})
                self._sent_arguments[index] = arguments
        return deltas



# ===== SECTION 12-13: OpenAI protocol and HTTP server (owner: server) =====


# ===== SECTION 14: the LLM object and the CLI (owner: core; server adds chat/serve) =====
