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

# Fields of every generating request, in the order they are read.
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
    value = body.get(name)
    if value is None:
        return default
    param = param or name
    value = _check_type(value, kind, param)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{param}' must be between {lo} and {hi}, got {value}", param=param)
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
    for key, value in bias.items():
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
        params.validate()
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
        else:
            choice.update(text=delta, logprobs=_completion_logprobs(logprobs, 0) if logprobs else None)
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
