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
        context = {**self.special_tokens, **template_kwargs, "messages": messages, "tools": tools or None,
                   "add_generation_prompt": bool(add_generation_prompt)}
        try:
            text = self._pick(tools).render(**context)
        except Exception as exc:   # the template is untrusted code: whatever it raises is reported, not a 500
            message = str(exc).replace("\n", " ").strip() or type(exc).__name__
            raise RequestError(f"chat template error: {message}", param="messages") from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
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


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """continue_final_message (as HF): end the prompt right after the final message's content."""
    final = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise RequestError("continue_final_message: the final message's content does not appear in the rendered "
                           "prompt", param="messages")
    at = text.rindex(final.strip())
    if text[at:at + len(final.lstrip())] == final.lstrip():
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


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

import select
import urllib.parse

# -----------------------------------------------------------------------------------------------
# 12. The OpenAI protocol: request bodies checked field by field into SamplingParams and prompt ids,
#     engine events shaped into OpenAI responses and stream chunks. No sockets here.
# -----------------------------------------------------------------------------------------------

SYSTEM_FINGERPRINT = f"pocketllm-{__version__}"
MAX_N = 16                     # choices per request
MAX_STOP = 16                  # stop strings per request
MAX_TOP_LOGPROBS = 20          # alternatives per token (OpenAI's chat limit)
LOGPROB_FLOOR = -9999.0        # JSON has no -inf: a masked token reports this instead

# The fields each endpoint knows; any other field is refused as unknown (a typo such as `temprature`).
# Accepted and ignored because they cannot change the answer (bookkeeping on OpenAI's side).
NO_EFFECT_FIELDS = {"user", "metadata", "store", "service_tier", "prompt_cache_key",
                    "prompt_cache_retention", "safety_identifier"}
# OpenAI fields we do not implement: accepted only at the values that leave the answer unchanged.
CHAT_DEFAULT_ONLY = {"audio": [None], "modalities": [None, ["text"]], "prediction": [None],
                     "functions": [None, []], "function_call": [None, "none", "auto"],
                     "web_search_options": [None], "verbosity": [None], "reasoning_effort": [None]}
COMPLETION_DEFAULT_ONLY = {"echo": [None, False], "suffix": [None, ""]}      # best_of is checked against n
SAMPLING_FIELDS = {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "seed",
                   "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                   "top_k", "min_p", "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos"}
CHAT_FIELDS = (SAMPLING_FIELDS | NO_EFFECT_FIELDS | set(CHAT_DEFAULT_ONLY) |
               {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                "parallel_tool_calls", "response_format", "chat_template_kwargs", "add_generation_prompt",
                "continue_final_message"})
COMPLETION_FIELDS = SAMPLING_FIELDS | NO_EFFECT_FIELDS | set(COMPLETION_DEFAULT_ONLY) | {"prompt", "best_of"}

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
# Keys a message may carry. The null-only ones appear when a client replays an SDK message object as a dict.
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
MESSAGE_NULL_ONLY_KEYS = {"refusal", "annotations", "audio", "function_call", "reasoning"}
RENDER_ARGUMENTS = {"messages", "tools", "add_generation_prompt", "continue_final_message"}


# The field readers: each checks one JSON value's type and range and names it in the error.

def _json_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _check_type(value, kind: type, param: str):
    """value as `kind` (bool, int, float, str, list, dict); an int is a valid float, a bool is neither."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise RequestError(f"'{param}' must be {_json_type(kind())}, got {_json_type(value)}", param=param)
    if kind is float and not math.isfinite(value):
        raise RequestError(f"'{param}' must be a finite number", param=param)
    return value


def _field(body: dict, name: str, kind: type, default=None, lo=None, hi=None, param: str | None = None):
    """body[name] checked for type and inclusive range [lo, hi]; absent or null -> default."""
    raw = body.get(name)
    if raw is None:
        return default
    param = param or name
    value = _check_type(raw, kind, param)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{param}' must be between {lo} and {hi}, got {raw}", param=param)
    return value


def _check_fields(body: dict, known: set[str], default_only: dict[str, list]) -> None:
    """Refuse unknown fields (typos) and unimplemented fields set to a value that would change the answer."""
    for name in body:
        if name not in known:
            raise RequestError(f"unknown field '{name}'", param=name, code="unknown_field")
    for name, allowed in default_only.items():
        if name in body and body[name] not in allowed:
            raise RequestError(f"'{name}' is not supported by this server (accepted only as "
                               f"{' or '.join(json.dumps(a) for a in allowed)})", param=name, code="unsupported_field")


def _check_model(llm, body: dict) -> None:
    model = _field(body, "model", str)
    if model is not None and model != llm.model_name:
        raise RequestError(f"model '{model}' does not exist; this server serves '{llm.model_name}'",
                           param="model", status=404, code="model_not_found")


def _token_id(value, param: str, vocab_size: int) -> int:
    value = _check_type(value, int, param)
    if not 0 <= value < vocab_size:
        raise RequestError(f"'{param}' must be a token id between 0 and {vocab_size - 1}, got {value}", param=param)
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else _check_type(stop, list, "stop")
    if len(stop) > MAX_STOP:
        raise RequestError(f"'stop' holds at most {MAX_STOP} strings, got {len(stop)}", param="stop")
    for s in stop:
        if not _check_type(s, str, "stop"):
            raise RequestError("'stop' strings must not be empty", param="stop")
    return stop


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    bias = _field(body, "logit_bias", dict, {})
    out = {}
    for key in bias:
        if not re.fullmatch(r"\d+", key):
            raise RequestError(f"'logit_bias' keys must be token ids as strings, got {key!r}", param="logit_bias")
        out[_token_id(int(key), "logit_bias", vocab_size)] = _field(bias, key, float, lo=-100, hi=100,
                                                                    param="logit_bias")
    return out


def _request_sampling_params(llm, body: dict, prompt_len: int, max_tokens_field: str | None) -> SamplingParams:
    """The sampling fields common to both endpoints, range-checked, with max_tokens resolved."""
    vocab = llm.config.vocab_size
    room = llm.options.max_context - prompt_len
    if room <= 0:
        raise RequestError(f"the prompt is {prompt_len} tokens; the context holds {llm.options.max_context}",
                           param="messages" if "messages" in body else "prompt", code="context_length_exceeded")
    max_tokens = room
    if max_tokens_field is not None:
        max_tokens = _field(body, max_tokens_field, int, lo=1)
    n = _field(body, "n", int, 1, lo=1, hi=MAX_N)
    top_k = _field(body, "top_k", int, 0, lo=-1)
    top_p = _field(body, "top_p", float, 1.0, lo=0, hi=1)
    if top_p == 0:
        raise RequestError("'top_p' must be greater than 0 and at most 1, got 0", param="top_p")
    repetition_penalty = _field(body, "repetition_penalty", float, 1.0, lo=0, hi=10)
    if repetition_penalty == 0:
        raise RequestError("'repetition_penalty' must be greater than 0 and at most 10, got 0",
                           param="repetition_penalty")
    min_tokens = _field(body, "min_tokens", int, 0, lo=0)
    if min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({min_tokens}) must not exceed the max tokens ({max_tokens})",
                           param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens, n=n, top_k=0 if top_k == -1 else top_k, top_p=top_p,
        temperature=_field(body, "temperature", float, 1.0, lo=0, hi=2),
        min_p=_field(body, "min_p", float, 0.0, lo=0, hi=1),
        seed=_field(body, "seed", int, lo=-2 ** 63, hi=2 ** 64 - 1),
        presence_penalty=_field(body, "presence_penalty", float, 0.0, lo=-2, hi=2),
        frequency_penalty=_field(body, "frequency_penalty", float, 0.0, lo=-2, hi=2),
        repetition_penalty=repetition_penalty, logit_bias=_logit_bias(body, vocab), min_tokens=min_tokens,
        stop=_stop_strings(body),
        stop_token_ids=[_token_id(t, "stop_token_ids", vocab)
                        for t in _field(body, "stop_token_ids", list, [])],
        ignore_eos=_field(body, "ignore_eos", bool, False))


def _max_tokens_field(body: dict, names: tuple[str, ...]) -> str | None:
    """Which of the max-tokens fields the client set (both set to different values is an error)."""
    given = [name for name in names if body.get(name) is not None]
    if len(given) == 2 and body[given[0]] != body[given[1]]:
        raise RequestError(f"'{given[0]}' and '{given[1]}' disagree; send one of them", param=given[0])
    return given[0] if given else None


def _stream_options(body: dict, stream: bool) -> bool:
    """include_usage; stream_options is only meaningful on a stream."""
    options = _field(body, "stream_options", dict)
    if options is None:
        return False
    if not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    for key in options:
        if key not in ("include_usage", "include_obfuscation"):      # obfuscation: we never pad chunks
            raise RequestError(f"unknown field 'stream_options.{key}'", param=f"stream_options.{key}")
    _field(options, "include_obfuscation", bool, param="stream_options.include_obfuscation")
    return _field(options, "include_usage", bool, False, param="stream_options.include_usage")


def _check_alive(llm) -> None:
    if getattr(llm, "dead_reason", None):
        raise RequestError(f"the engine is down: {llm.dead_reason}", status=503, code="engine_dead")


def _submit(llm, prompt_ids: list[int], params: SamplingParams, body: dict, max_tokens_field: str | None):
    """llm.submit, with engine errors renamed to the field this client actually sent."""
    _check_alive(llm)
    try:
        return llm.submit(prompt_ids, params)
    except RequestError as e:
        if e.param == "max_tokens" and max_tokens_field:
            e.param = max_tokens_field
        elif e.param in ("messages", "prompt") or (e.param == "max_tokens" and not max_tokens_field):
            e.param = "messages" if "messages" in body else "prompt"
        raise


# Chat requests: messages and tools checked, the template rendered on a converted copy.

def _check_content(content, param: str, role: str) -> None:
    if content is None:
        if role != "assistant":
            raise RequestError(f"'{param}' must not be null for a {role} message", param=param)
        return
    if isinstance(content, str):
        return
    for j, part in enumerate(_check_type(content, list, param)):
        part = _check_type(part, dict, f"{param}[{j}]")
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"'{param}[{j}]': only text content parts are supported "
                               f"(got type {part.get('type')!r})", param=f"{param}[{j}]")


def _check_tool_calls(calls, param: str) -> None:
    for j, call in enumerate(_check_type(calls, list, param)):
        where = f"{param}[{j}]"
        call = _check_type(call, dict, where)
        if call.get("type", "function") != "function":
            raise RequestError(f"'{where}.type' must be \"function\"", param=f"{where}.type")
        function = _check_type(call.get("function"), dict, f"{where}.function")
        _check_type(function.get("name"), str, f"{where}.function.name")
        if not isinstance(function.get("arguments"), (str, dict)):
            raise RequestError(f"'{where}.function.arguments' must be a JSON string",
                               param=f"{where}.function.arguments")


def _check_messages(messages) -> list[dict]:
    messages = _check_type(messages, list, "messages")
    if not messages:
        raise RequestError("'messages' must not be empty", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        message = _check_type(message, dict, where)
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
                               param=f"{where}.role")
        for key, value in message.items():
            if key not in MESSAGE_KEYS and not (key in MESSAGE_NULL_ONLY_KEYS and value in (None, [])):
                raise RequestError(f"'{where}.{key}' is not supported", param=f"{where}.{key}")
        _check_content(message.get("content"), f"{where}.content", role)
        for key in ("name", "tool_call_id", "reasoning_content"):
            _field(message, key, str, param=f"{where}.{key}")
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise RequestError(f"'{where}.tool_calls' is only allowed on assistant messages",
                                   param=f"{where}.tool_calls")
            _check_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return messages


def _check_tools(body: dict) -> list[dict] | None:
    tools = _field(body, "tools", list)
    if not tools:
        return None
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        tool = _check_type(tool, dict, where)
        if tool.get("type") != "function":
            raise RequestError(f"'{where}.type' must be \"function\" (only function tools are supported)",
                               param=f"{where}.type")
        for key in tool:
            if key not in ("type", "function"):
                raise RequestError(f"'{where}.{key}' is not supported", param=f"{where}.{key}")
        function = _check_type(tool.get("function"), dict, f"{where}.function")
        for key in function:
            if key not in ("name", "description", "parameters", "strict"):
                raise RequestError(f"'{where}.function.{key}' is not supported", param=f"{where}.function.{key}")
        name = _check_type(function.get("name"), str, f"{where}.function.name")
        if not name or name in names:
            raise RequestError(f"'{where}.function.name' must be a unique non-empty name",
                               param=f"{where}.function.name")
        names.add(name)
        _field(function, "description", str, param=f"{where}.function.description")
        _field(function, "parameters", dict, param=f"{where}.function.parameters")
        _field(function, "strict", bool, param=f"{where}.function.strict")
    return tools


def _check_tool_choice(body: dict, tools: list[dict] | None):
    """'none' | 'auto' | 'required' | {"type": "function", "function": {"name": X}}."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise RequestError(f"'tool_choice' must be none, auto, required or a function, got {choice!r}",
                               param="tool_choice")
    else:
        choice = _check_type(choice, dict, "tool_choice")
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str):
            raise RequestError('\'tool_choice\' object must be {"type": "function", "function": {"name": ...}}',
                               param="tool_choice")
        if function["name"] not in {t["function"]["name"] for t in tools or []}:
            raise RequestError(f"'tool_choice' names '{function['name']}', which is not in 'tools'",
                               param="tool_choice")
    if choice != "none" and not tools:
        raise RequestError(f"'tool_choice' {json.dumps(choice)} needs 'tools'", param="tool_choice")
    return choice


def _check_response_format(body: dict) -> None:
    fmt = _field(body, "response_format", dict)
    if fmt is not None and fmt.get("type") != "text":
        raise RequestError(f"'response_format' type {fmt.get('type')!r} is not supported yet; only \"text\"",
                           param="response_format", code="unsupported_field")


def _chat_template(llm):
    """The llm's chat template, loaded on first use (run_server may have set an override)."""
    template = getattr(llm, "chat_template", None)
    if template is None:
        template = llm.chat_template = load_chat_template(llm.tokenizer)
    if template is None:
        raise RequestError("this checkpoint has no chat template; start the server with --chat-template FILE "
                           "or use /v1/completions", param="messages")
    return template


def render_chat_prompt(llm, body: dict, tools: list[dict] | None) -> str:
    """The prompt text for a chat body: the template rendered on a converted copy of the messages."""
    messages = _check_messages(body.get("messages"))
    template_kwargs = _field(body, "chat_template_kwargs", dict, {})
    for key in template_kwargs:
        if key in RENDER_ARGUMENTS:
            raise RequestError(f"'chat_template_kwargs.{key}' must be given as a top-level field",
                               param="chat_template_kwargs")
    continue_final = _field(body, "continue_final_message", bool, False)
    add_generation_prompt = _field(body, "add_generation_prompt", bool, not continue_final)
    if continue_final and (add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise RequestError("'continue_final_message' needs a final assistant message and "
                           "'add_generation_prompt' false", param="continue_final_message")
    copy = messages_for_template(messages)
    for message in copy:                     # OpenAI's developer role is the system role of older templates
        if message["role"] == "developer":
            message["role"] = "system"
    return _chat_template(llm).render(copy, tools=tools, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final, **template_kwargs)


# The response shapes: logprobs in both formats, usage.

def _logprob(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def _chat_logprobs(logprobs: list) -> list[dict]:
    return [{"token": lp.token, "logprob": _logprob(lp.logprob), "bytes": lp.bytes,
             "top_logprobs": [{"token": t, "logprob": _logprob(v), "bytes": b} for _, t, b, v in lp.top]}
            for lp in logprobs]


def _completion_logprobs(logprobs: list, text_offset: int) -> dict:
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [{t: _logprob(v) for _, t, _, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, a sum and a count, thread-safe."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts = buckets, [0] * (len(buckets) + 1)
        self.sum, self.lock = 0.0, threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            self.counts[next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))] += 1
            self.sum += value

    def lines(self, name: str) -> list[str]:
        with self.lock:
            counts, total = list(itertools.accumulate(self.counts)), self.sum
        edges = [repr(b) for b in self.buckets] + ["+Inf"]
        return ([f'{name}_bucket{{le="{e}"}} {c}' for e, c in zip(edges, counts)] +
                [f"{name}_sum {total}", f"{name}_count {counts[-1]}"])


class ServerMetrics:
    """What /metrics reports beyond llm.stats(): responses by endpoint and status, latency histograms."""

    def __init__(self):
        self.lock = threading.Lock()
        self.responses: dict[tuple[str, int], int] = {}
        self.time_to_first_token = Histogram((0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.inter_token_latency = Histogram((0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1, 2.5))

    def count(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.responses[endpoint, status] = self.responses.get((endpoint, status), 0) + 1


# A submitted request: its engine stream plus what shapes the answer, consumed once as chunks or a response.

class Completion:
    """One validated, submitted request. `chunks()` streams it, `response()` waits for it; `abort()` cancels."""

    def __init__(self, llm, stream, kind: str, stream_mode: bool, include_usage: bool, logprobs: int | None,
                 parsers: list | None = None, metrics: ServerMetrics | None = None):
        self.llm, self.stream, self.kind, self.stream_mode = llm, stream, kind, stream_mode
        self.include_usage, self.logprobs, self.parsers, self.metrics = include_usage, logprobs, parsers, metrics
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.created, self.submitted = int(time.time()), time.monotonic()
        self.completion_tokens = 0
        self.text_offsets: dict[int, int] = {}     # choice -> characters of logprob tokens streamed so far

    def abort(self) -> None:
        self.stream.abort()

    def events(self) -> Iterator:
        """The engine's events, timed for the latency histograms; an engine-side abort is an error."""
        last: dict[int, float] = {}
        for event in self._engine_events():
            now = time.monotonic()
            if event.token_ids:
                self.completion_tokens += len(event.token_ids)
                if self.metrics:
                    if not last:
                        self.metrics.time_to_first_token.observe(now - self.submitted)
                    elif event.index in last:
                        self.metrics.inter_token_latency.observe((now - last[event.index]) / len(event.token_ids))
                last[event.index] = now
            if event.finish_reason == "abort":             # we aborted it (client gone) or the engine died
                _check_alive(self.llm)
                raise RequestError("the request was aborted", status=503, code="aborted")
            yield event

    def _engine_events(self) -> Iterator:
        """The stream's events; a fatal engine error while waiting becomes a 503."""
        try:
            yield from self.stream
        except RequestError:
            raise
        except PocketError as e:
            _check_alive(self.llm)
            raise RequestError(str(e), status=503, code="engine_dead") from None

    def _finish_reason(self, index: int, reason: str) -> str:
        if self.parsers and self.parsers[index].has_tool_calls and reason == "stop":
            return "tool_calls"
        return reason

    def _envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.object + (".chunk" if self.kind == "chat" and self.stream_mode else ""),
                "created": self.created, "model": self.llm.model_name, "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices}

    def _usage(self) -> dict:
        return _usage(self.stream.prompt_tokens, self.completion_tokens)

    def chunks(self) -> Iterator[dict]:
        """OpenAI stream chunks; closing the iterator early aborts the request."""
        n = len(self.parsers) if self.parsers is not None else None
        try:
            pending = {}                      # choice -> logprobs not yet attached to a chunk
            if self.kind == "chat":
                for i in range(n):
                    yield self._chunk(i, {"role": "assistant", "content": ""})
            for event in self.events():
                i = event.index
                if self.logprobs is not None and event.logprobs:
                    pending.setdefault(i, []).extend(event.logprobs)
                if self.kind == "chat":
                    deltas = self.parsers[i].feed(event.text) if event.text else []
                    if event.finish_reason:
                        deltas += self.parsers[i].finish()
                    for delta in deltas:
                        yield self._chunk(i, delta, pending.pop(i, None))
                elif event.text:
                    yield self._chunk(i, event.text, pending.pop(i, None))
                if event.finish_reason:
                    yield self._chunk(i, {} if self.kind == "chat" else "", pending.pop(i, None),
                                      self._finish_reason(i, event.finish_reason), event.stop_reason)
            if self.include_usage:
                yield {**self._envelope([]), "usage": self._usage()}
        finally:
            self.abort()                      # a no-op once finished; frees the request if the client left

    def _chunk(self, index: int, delta, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        choice = {"index": index}
        if self.kind == "chat":
            choice.update(delta=delta, logprobs={"content": _chat_logprobs(logprobs)} if logprobs else None)
        elif logprobs:
            start = self.text_offsets.get(index, 0)
            self.text_offsets[index] = start + sum(len(lp.token) for lp in logprobs)
            choice.update(text=delta, logprobs=_completion_logprobs(logprobs, start))
        else:
            choice.update(text=delta, logprobs=None)
        choice.update(finish_reason=finish_reason)
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        chunk = self._envelope([choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def response(self) -> dict:
        """The whole answer, once every choice has finished."""
        texts, logprobs, finish = {}, {}, {}
        try:
            for event in self.events():
                texts[event.index] = texts.get(event.index, "") + event.text
                logprobs.setdefault(event.index, []).extend(event.logprobs or [])
                if event.finish_reason:
                    finish[event.index] = (event.finish_reason, event.stop_reason)
        finally:
            self.abort()
        choices = []
        for i in sorted(finish):
            reason, stop_reason = finish[i]
            choice = {"index": i}
            if self.kind == "chat":
                parser = self.parsers[i]
                parser.feed(texts.get(i, ""))
                parser.finish()
                message = {"role": "assistant", **{k: v for k, v in parser.message().items()
                                                    if k == "content" or v is not None}}
                choice.update(message=message, logprobs={"content": _chat_logprobs(logprobs[i])}
                              if self.logprobs is not None else None)
            else:
                choice.update(text=texts.get(i, ""), logprobs=_completion_logprobs(logprobs[i], 0)
                              if self.logprobs is not None else None)
            choice.update(finish_reason=self._finish_reason(i, reason), stop_reason=stop_reason)
            choices.append(choice)
        return {**self._envelope(choices), "usage": self._usage()}


def start_chat_completion(llm, body, metrics: ServerMetrics | None = None) -> Completion:
    """Validate a /v1/chat/completions body, render the prompt and submit it."""
    body = _check_type(body, dict, "body")
    _check_fields(body, CHAT_FIELDS, CHAT_DEFAULT_ONLY)
    _check_model(llm, body)
    stream = _field(body, "stream", bool, False)
    include_usage = _stream_options(body, stream)
    tools = _check_tools(body)
    tool_choice = _check_tool_choice(body, tools)
    parallel_tool_calls = _field(body, "parallel_tool_calls", bool, True)
    _check_response_format(body)
    if tool_choice == "none":
        tools = None                      # the model is not shown tools it may not call
    want_logprobs = _field(body, "logprobs", bool, False)
    top_logprobs = _field(body, "top_logprobs", int, lo=0, hi=MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not want_logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    prompt_text = render_chat_prompt(llm, body, tools)
    prompt_ids = llm.tokenizer.encode(prompt_text)
    max_tokens_field = _max_tokens_field(body, ("max_completion_tokens", "max_tokens"))
    params = _request_sampling_params(llm, body, len(prompt_ids), max_tokens_field)
    params.logprobs = (top_logprobs or 0) if want_logprobs else None
    template = _chat_template(llm)
    in_reasoning = prompt_ends_in_reasoning(prompt_text)
    if tools:
        processor = tool_choice_processor(llm.tokenizer, tools, tool_choice, template.tool_parser,
                                          parallel_tool_calls, in_reasoning, params.max_tokens)
        if processor is not None:
            params.logits_processors = [*params.logits_processors, processor]
    parsers = [ChatOutputParser(tools, template.tool_parser, in_reasoning, parse_tools=tools is not None)
               for _ in range(params.n)]
    return Completion(llm, _submit(llm, prompt_ids, params, body, max_tokens_field), "chat", stream,
                      include_usage, params.logprobs, parsers, metrics)


def _prompt_ids(llm, prompt) -> list[int]:
    """A completions prompt: a string or token ids, alone or as a one-element batch."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = llm.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = [_token_id(t, "prompt", llm.config.vocab_size) for t in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("'prompt' batches of more than one prompt are not supported; send one request each",
                           param="prompt", code="unsupported_field")
    else:
        raise RequestError(f"'prompt' must be a string or an array of token ids, got {_json_type(prompt)}",
                           param="prompt")
    if not ids:
        raise RequestError("'prompt' must not be empty", param="prompt")
    return ids


def start_completion(llm, body, metrics: ServerMetrics | None = None) -> Completion:
    """Validate a /v1/completions body and submit it."""
    body = _check_type(body, dict, "body")
    _check_fields(body, COMPLETION_FIELDS, COMPLETION_DEFAULT_ONLY)
    _check_model(llm, body)
    stream = _field(body, "stream", bool, False)
    include_usage = _stream_options(body, stream)
    prompt_ids = _prompt_ids(llm, body.get("prompt"))
    max_tokens_field = "max_tokens" if body.get("max_tokens") is not None else None
    params = _request_sampling_params(llm, body, len(prompt_ids), max_tokens_field)
    best_of = _field(body, "best_of", int)
    if best_of not in (None, 1, params.n):
        raise RequestError("'best_of' is not supported by this server (accepted only when equal to 'n')",
                           param="best_of", code="unsupported_field")
    params.logprobs = _field(body, "logprobs", int, lo=0, hi=MAX_TOP_LOGPROBS)
    return Completion(llm, _submit(llm, prompt_ids, params, body, max_tokens_field), "text", stream,
                      include_usage, params.logprobs, None, metrics)


def chat_completions(llm, body: dict) -> dict | Iterator[dict]:
    """An OpenAI /v1/chat/completions body -> the response dict, or an iterator of chunks when streaming."""
    completion = start_chat_completion(llm, body)
    return completion.chunks() if completion.stream_mode else completion.response()


def completions(llm, body: dict) -> dict | Iterator[dict]:
    """An OpenAI /v1/completions body -> the response dict, or an iterator of chunks when streaming."""
    completion = start_completion(llm, body)
    return completion.chunks() if completion.stream_mode else completion.response()


def llm_chat(llm, messages: list[dict], tools: list[dict] | None = None, stream: bool = False, **params):
    """LLM.chat: the same OpenAI-shaped dict (or chunk iterator) the HTTP endpoint sends."""
    body = {**params, "messages": messages, "stream": stream}
    if tools is not None:
        body["tools"] = tools
    return chat_completions(llm, body)


# -----------------------------------------------------------------------------------------------
# 13. The HTTP server: ThreadingHTTPServer with one route table and one translator from exceptions to
#     OpenAI errors. Each request runs on its own thread and blocks on its RequestStream; SSE for streams.
# -----------------------------------------------------------------------------------------------

DEFAULT_MAX_REQUEST_BYTES = 16 * 2 ** 20
DEFAULT_SOCKET_TIMEOUT = 60.0      # seconds a client may stay silent (idle keep-alive, a slow body or read)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 411: "invalid_request_error", 413: "invalid_request_error",
               500: "internal_server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def translate_error(error: Exception) -> tuple[int, dict]:
    """Any exception -> (HTTP status, OpenAI error body). Only our own bugs are 500, logged with a traceback."""
    if isinstance(error, RequestError):
        return error.status, error_body(error.status, str(error), error.param, error.code)
    if isinstance(error, PocketError):
        return 400, error_body(400, str(error))
    if isinstance(error, RecursionError):          # JSON nested deeper than Python will walk
        return 400, error_body(400, "the request is nested too deeply", code="invalid_json")
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    return 500, error_body(500, "internal server error (logged on the server)", code="internal_error")


def _client_gone(error: Exception) -> bool:
    """A failed read or write on the client's socket (reset, broken pipe, timeout)."""
    return isinstance(error, (ConnectionError, TimeoutError))


class DisconnectWatch:
    """While a non-streamed request waits on the engine, call on_disconnect if the client closes its socket."""

    def __init__(self, sock: socket.socket, on_disconnect: Callable[[], None]):
        self.sock, self.on_disconnect, self.done = sock, on_disconnect, threading.Event()

    def __enter__(self):
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()

    def _watch(self) -> None:
        while not self.done.is_set():
            try:
                if not select.select([self.sock], [], [], 0.05)[0]:
                    continue
                if self.sock.recv(1, socket.MSG_PEEK):
                    return                       # a pipelined next request: the client is still there
            except (OSError, ValueError):
                pass                             # reset or closed: gone as well
            if not self.done.is_set():
                self.on_disconnect()
            return


# The endpoints. Each takes the handler, the path match and the raw body, and sends one response.

def _json_body(raw: bytes) -> dict:
    def refuse_constant(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    return body


def _health(handler, match, raw) -> None:
    _check_alive(handler.server.llm)
    handler.send_json(200, {"status": "ok"})


def _model_card(server) -> dict:
    return {"id": server.llm.model_name, "object": "model", "created": server.started, "owned_by": "pocketllm",
            "root": str(server.llm.ckpt_dir), "max_model_len": server.llm.options.max_context}


def _models(handler, match, raw) -> None:
    handler.send_json(200, {"object": "list", "data": [_model_card(handler.server)]})


def _model(handler, match, raw) -> None:
    _check_model(handler.server.llm, {"model": urllib.parse.unquote(match["model"])})
    handler.send_json(200, _model_card(handler.server))


def _chat(handler, match, raw) -> None:
    handler.send_completion(start_chat_completion(handler.server.llm, _json_body(raw), handler.server.metrics))


def _completions(handler, match, raw) -> None:
    handler.send_completion(start_completion(handler.server.llm, _json_body(raw), handler.server.metrics))


TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "chat_template_kwargs", "tools", "return_token_strs"}


def _tokenize(handler, match, raw) -> None:
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template -> token ids."""
    llm, body = handler.server.llm, _json_body(raw)
    _check_fields(body, TOKENIZE_FIELDS, {})
    _check_model(llm, body)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("send exactly one of 'prompt' and 'messages'", param="prompt")
    _field(body, "add_special_tokens", bool)     # our tokenizers add no special tokens either way
    if "prompt" in body:
        ids = llm.tokenizer.encode(_check_type(body["prompt"], str, "prompt"))
    else:
        ids = llm.tokenizer.encode(render_chat_prompt(llm, body, _check_tools(body)))
    strs = [llm.tokenizer.id_to_token(t) for t in ids] if _field(body, "return_token_strs", bool, False) else None
    handler.send_json(200, {"count": len(ids), "max_model_len": llm.options.max_context, "tokens": ids,
                            "token_strs": strs})


def _detokenize(handler, match, raw) -> None:
    """vLLM's /detokenize: token ids -> text."""
    llm, body = handler.server.llm, _json_body(raw)
    _check_fields(body, {"model", "tokens"}, {})
    _check_model(llm, body)
    ids = [_token_id(t, "tokens", llm.config.vocab_size) for t in _check_type(body.get("tokens"), list, "tokens")]
    handler.send_json(200, {"prompt": llm.tokenizer.decode(ids)})


def metrics_text(llm, metrics: ServerMetrics) -> str:
    """The Prometheus text exposition of the engine's counters and the server's."""
    stats = llm.stats()
    lines = []

    def family(name: str, kind: str, help: str, samples: list[str]) -> None:
        lines.extend([f"# HELP pocketllm_{name} {help}", f"# TYPE pocketllm_{name} {kind}"] +
                     [f"pocketllm_{name}{s}" for s in samples])

    with metrics.lock:
        responses = sorted(metrics.responses.items())
    family("requests_total", "counter", "HTTP responses by endpoint and status code.",
           [f'{{endpoint="{e}",status="{s}"}} {c}' for (e, s), c in responses])
    family("prompt_tokens_total", "counter", "Prompt tokens processed.", [f" {stats['prompt_tokens_total']}"])
    family("generation_tokens_total", "counter", "Tokens generated.", [f" {stats['generation_tokens_total']}"])
    family("requests_running", "gauge", "Requests being generated.", [f" {stats['running']}"])
    family("requests_waiting", "gauge", "Requests queued for a slot.", [f" {stats['waiting']}"])
    family("kv_blocks_used", "gauge", "Paged KV-cache blocks in use.", [f" {stats['kv_blocks_used']}"])
    family("kv_blocks_total", "gauge", "Paged KV-cache blocks in all.", [f" {stats['kv_blocks_total']}"])
    family("kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use.",
           [f" {stats['kv_blocks_used'] / max(1, stats['kv_blocks_total'])}"])
    family("slots_used", "gauge", "Recurrent-state slots in use.", [f" {stats['slots_used']}"])
    family("slots_total", "gauge", "Recurrent-state slots in all.", [f" {stats['slots_total']}"])
    for name, histogram, help in (
            ("time_to_first_token_seconds", metrics.time_to_first_token, "Time from submission to the first token."),
            ("inter_token_latency_seconds", metrics.inter_token_latency, "Time between tokens of one choice.")):
        family(name, "histogram", help, [s[len(name):] for s in histogram.lines(name)])
    return "\n".join(lines) + "\n"


def _metrics(handler, match, raw) -> None:
    data = metrics_text(handler.server.llm, handler.server.metrics).encode()
    handler.send_bytes(200, data, "text/plain; version=0.0.4; charset=utf-8")


# The route table: (method, path pattern, endpoint). The pattern doubles as the metrics label.
ROUTES = [
    ("GET", "/health", _health),
    ("GET", "/v1/models", _models),
    ("GET", "/v1/models/{model}", _model),
    ("POST", "/v1/chat/completions", _chat),
    ("POST", "/v1/completions", _completions),
    ("POST", "/tokenize", _tokenize),
    ("POST", "/detokenize", _detokenize),
    ("GET", "/metrics", _metrics),
]
ROUTE_PATTERNS = [(method, re.compile(re.sub(r"\{(\w+)\}", r"(?P<\1>.+)", path) + "$"), path, endpoint)
                  for method, path, endpoint in ROUTES]


def find_route(method: str, path: str):
    """(label, match, endpoint) for the request; 404 for an unknown path, 405 for a known path's wrong method."""
    allowed = []
    for route_method, pattern, label, endpoint in ROUTE_PATTERNS:
        match = pattern.match(path)
        if match and route_method == method:
            return label, match, endpoint
        if match:
            allowed.append(route_method)
    if allowed:
        raise RequestError(f"method {method} not allowed on {path}; use {', '.join(allowed)}", status=405,
                           code="method_not_allowed")
    raise RequestError(f"no such endpoint: {path}", status=404, code="unknown_url")


class Handler(http.server.BaseHTTPRequestHandler):
    """One connection: HTTP/1.1 keep-alive, each request read, authorised, routed and answered."""

    protocol_version = "HTTP/1.1"
    server_version = f"pocketllm/{__version__}"
    endpoint = "other"                    # the route label for metrics, set once routed

    def setup(self) -> None:
        self.timeout = self.server.socket_timeout      # applied to the socket by StreamRequestHandler
        super().setup()

    def do_GET(self): self.handle_request("GET")
    def do_POST(self): self.handle_request("POST")
    def do_PUT(self): self.handle_request("PUT")
    def do_DELETE(self): self.handle_request("DELETE")
    def do_PATCH(self): self.handle_request("PATCH")
    def do_HEAD(self): self.handle_request("HEAD")
    def do_OPTIONS(self): self.handle_request("OPTIONS")

    def handle_request(self, method: str) -> None:
        self.endpoint = "other"
        try:
            path = urllib.parse.urlsplit(self.path).path
            raw = self.read_body()
            if path != "/health":
                self.check_auth()
            self.endpoint, match, endpoint = find_route(method, path)
            endpoint(self, match, raw)
        except Exception as e:
            if _client_gone(e):
                self.close_connection = True
                return
            self.send_error_response(e)

    def read_body(self) -> bytes:
        """The request body, bounded by the server's limit; a body we do not read closes the connection."""
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise RequestError("chunked request bodies are not supported; send Content-Length", status=411)
        try:
            length = int(self.headers.get("Content-Length", 0))
            assert length >= 0
        except (ValueError, AssertionError):
            self.close_connection = True
            raise RequestError("invalid Content-Length header") from None
        if length > self.server.max_request_bytes:
            self.close_connection = True
            raise RequestError(f"request body of {length} bytes is over the limit of "
                               f"{self.server.max_request_bytes} bytes", status=413, code="request_too_large")
        raw = self.rfile.read(length)
        if len(raw) < length:
            raise ConnectionResetError("client closed the connection while sending the body")
        return raw

    def check_auth(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        if not given:
            raise RequestError("missing API key: send 'Authorization: Bearer <key>'", status=401,
                               code="invalid_api_key")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise RequestError("invalid API key", status=401, code="invalid_api_key")

    # Answers: JSON, errors, and server-sent events.

    def send_bytes(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.server.metrics.count(self.endpoint, status)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self.send_bytes(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    def send_error_response(self, error: Exception) -> None:
        status, body = translate_error(error)
        headers = {}
        if status == 405:
            allowed = [m for m, pattern, _, _ in ROUTE_PATTERNS if pattern.match(urllib.parse.urlsplit(self.path).path)]
            headers["Allow"] = ", ".join(allowed)
        try:
            self.send_json(status, body, headers)
        except Exception as e:             # the client left while we answered
            if not _client_gone(e):
                raise
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (malformed request line, oversized headers) in the OpenAI shape."""
        self.close_connection = True
        self.send_json(int(code), error_body(int(code), message or explain or "bad request"))

    def send_completion(self, completion: Completion) -> None:
        if completion.stream_mode:
            self.send_stream(completion.chunks())
            return
        with DisconnectWatch(self.connection, completion.abort):
            response = completion.response()
        self.send_json(200, response)

    def send_stream(self, chunks: Iterator[dict]) -> None:
        """SSE over chunked transfer encoding, so the connection stays alive for the next request."""
        self.server.metrics.count(self.endpoint, 200)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while True:
                try:
                    chunk = next(chunks)
                except StopIteration:
                    break
                except Exception as e:            # after the headers an error can only travel as an event
                    self.send_event(translate_error(e)[1])
                    break
                self.send_event(chunk)
            self.send_event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        except Exception as e:
            if not _client_gone(e):
                raise
            self.close_connection = True
        finally:
            chunks.close()                        # aborts the request if the client left

    def send_event(self, data: dict | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        payload = b"data: " + text.encode() + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))

    def log_message(self, format: str, *args) -> None:
        if self.server.log_requests:
            sys.stderr.write(f"pocketllm: {self.address_string()} {format % args}\n")


class PocketServer(http.server.ThreadingHTTPServer):
    """The HTTP server for one LLM. `.port` is the bound port; `.shutdown()` stops and closes it."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
                 log_requests: bool = True):
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), Handler)
        self.llm, self.api_key, self.max_request_bytes = llm, api_key, max_request_bytes
        self.socket_timeout, self.log_requests = socket_timeout, log_requests
        self.metrics, self.started, self.serving = ServerMetrics(), int(time.time()), False

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> "PocketServer":
        """Serve on a background thread."""
        self.serving = True
        threading.Thread(target=self.serve_forever, name="pocketllm-http", daemon=True).start()
        return self

    def run(self) -> None:
        """Serve on this thread until Ctrl-C or SIGTERM."""
        self.serving = True
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main else None
        try:
            self.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.serving = False
            if in_main:
                signal.signal(signal.SIGTERM, previous)
            self.server_close()

    def shutdown(self) -> None:
        if self.serving:
            super().shutdown()
            self.serving = False
        self.server_close()


def serve(llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, block: bool = True,
          **options) -> PocketServer:
    """Serve llm over HTTP: blocking until interrupted, or (block=False) on a background thread."""
    server = PocketServer(llm, host, port, api_key, **options)
    if block:
        server.run()
        return server
    return server.start()


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free port and prints it)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                            "(default: env POCKETLLM_API_KEY)")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: the checkpoint directory name)")
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a jinja chat template to use instead of the checkpoint's")
    group.add_argument("--tool-parser", choices=("qwen_xml", "hermes"), default=None,
                       help="tool-call format (default: detected from the chat template)")
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help=f"largest request body accepted (default {DEFAULT_MAX_REQUEST_BYTES}); larger is 413")
    group.add_argument("--socket-timeout", type=float, default=DEFAULT_SOCKET_TIMEOUT,
                       help=f"seconds a silent client may hold a connection (default {DEFAULT_SOCKET_TIMEOUT:g})")


def run_server(llm, args: argparse.Namespace) -> int:
    """Apply the server flags to llm, print the address, serve until interrupted; the exit code."""
    if args.served_model_name:
        llm.model_name = args.served_model_name
    if args.chat_template:
        llm.chat_template = load_chat_template(llm.tokenizer, args.chat_template)
    if args.tool_parser:
        _chat_template(llm).tool_parser = args.tool_parser
    server = PocketServer(llm, args.host, args.port, args.api_key or os.environ.get("POCKETLLM_API_KEY") or None,
                          max_request_bytes=args.max_request_bytes, socket_timeout=args.socket_timeout)
    print(f"pocketllm: serving '{llm.model_name}' on http://{args.host}:{server.port}", flush=True)
    server.run()
    return 0



# ===== SECTION 14: the LLM object and the CLI (owner: core; server adds chat/serve) =====
