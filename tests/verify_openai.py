#!/usr/bin/env python3
"""Acceptance check of pocketllm's OpenAI-compatible server: one command, honest about what it did not run.

It starts `python pocketllm.py` in its own process group, waits for /health, proves the OpenAI surface end to
end over real HTTP (refusals, stop, n, logprobs, SSE, tool calls in every form, reasoning, concurrency,
disconnects, and the published `openai` / `langchain-openai` clients), prints one line per check, and stops
the whole server group on every exit path. Only the Python standard library is imported, so it runs under
any interpreter; the published clients run in a separate interpreter (`--client-python`).

    python tests/verify_openai.py                                  # the bundled pocket-tiny, on CPU
    python tests/verify_openai.py --ckpt /models/Qwen3.5-27B-FP8 --devices 0,1,2,3 \\
        --client-python /tmp/clients/bin/python --require-tool-clients --log-dir logs/

Flags the script does not know (`--max-context 8192`, ...) are passed to the server unchanged.
Each check prints `[PASS]`, `[FAIL]` or `[NOT RUN]` and one line of detail; the last line is
`N passed, N failed` (plus `, N not run`). Exit code 0 only when nothing failed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# -----------------------------------------------------------------------------------------------
# 1. The command line. Unknown flags go to the server, so limits and engine options need no copy here.
# -----------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="Unknown flags are passed to `pocketllm.py` unchanged.")
    p.add_argument("--ckpt", help="checkpoint directory (default: the server's bundled pocket-tiny)")
    p.add_argument("--devices", help="passed to the server, e.g. 0,1,2,3")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs the server")
    p.add_argument("--client-python", default=sys.executable,
                   help="interpreter with `openai` and `langchain-openai` for the published-client checks")
    p.add_argument("--require-tool-clients", action="store_true",
                   help="a client check that cannot run (package missing) is a failure, not NOT RUN")
    p.add_argument("--pocketllm", default=str(REPO / "pocketllm.py"), help="path of pocketllm.py")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: the server picks a free port and prints its URL")
    p.add_argument("--api-key", default=os.environ.get("POCKETLLM_API_KEY"),
                   help="passed to the server and sent by every request (default: env POCKETLLM_API_KEY)")
    p.add_argument("--log-dir", help="keep the server's (and clients') logs here")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per HTTP request")
    p.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL at shutdown")
    p.add_argument("--max-tokens", type=int, default=512, help="budget of the tool and reasoning checks")
    p.add_argument("--concurrency", type=int, default=8, help="simultaneous streams in the concurrency check")
    p.add_argument("--checks", help="comma-separated subset of checks to run (default: all)")
    p.add_argument("--expect-model-name", help="the `models` check also requires this served model id")
    p.add_argument("--strict-arguments", action="store_true",
                   help="the tool_call check also requires the argument values asked for (Paris, 3 days)")
    args, server_flags = p.parse_known_args(argv)
    if args.checks:
        unknown = sorted(set(args.checks.split(",")) - set(CHECKS))
        if unknown:
            p.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return args, server_flags


# -----------------------------------------------------------------------------------------------
# 2. The server process group: start it, find its port, wait for health, and always take it down.
# -----------------------------------------------------------------------------------------------

class Interrupted(BaseException):
    """SIGTERM or SIGHUP reached the script; raised in the main thread so every `finally` runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


class ServerStartError(Exception):
    """The server exited, or never became healthy, before the checks could start."""


def die_with_parent() -> None:
    """In the child before exec: SIGTERM the server if this script is killed (Linux prctl PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG = 1


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`, read from /proc; elsewhere, probe with kill."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()     # after "pid (comm) ": state ppid pgrp ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


URL_RE = re.compile(r"https?://(\[[0-9a-fA-F:]+\]|[\w.\-]+):(\d+)")


class ServerGroup:
    """`python pocketllm.py ...` as the leader of a new process group, logging to a file."""

    def __init__(self, args: argparse.Namespace, server_flags: list[str], log_dir: Path):
        self.args = args
        self.log_path = log_dir / "server.log"
        self.cmd = [args.python, args.pocketllm, "--host", args.host, "--port", str(args.port)]
        for flag in ("ckpt", "devices", "api_key"):
            if getattr(args, flag) is not None:
                self.cmd += ["--" + flag.replace("_", "-"), getattr(args, flag)]
        self.cmd += server_flags
        self.proc: subprocess.Popen | None = None
        self.port = args.port

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=str(Path(self.args.pocketllm).resolve().parent),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        say(f"server: pid {self.proc.pid}, process group {self.proc.pid}: {' '.join(self.cmd)}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join("    | " + line for line in text.splitlines()[-lines:]) or "    | (empty server log)"

    def wait_ready(self, api: "Api") -> None:
        """Find the port (from the URL the server prints when --port 0), then poll /health until 200."""
        deadline = time.monotonic() + self.args.startup_timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(f"the server exited with code {code} before /health answered 200")
            if not self.port:
                match = URL_RE.search(self.log_path.read_text(errors="replace"))
                if match and int(match.group(2)):
                    self.port = api.port = int(match.group(2))
            if self.port:
                try:
                    status, body = api.request("GET", "/health", timeout=5)
                    if status == 200:
                        return
                    last = f"/health answered {status}: {json.dumps(body)[:200]}"
                except OSError as e:
                    last = f"/health: {e}"
            time.sleep(0.25)
        where = f"port {self.port}" if self.port else "no URL printed yet"
        raise ServerStartError(f"not healthy after {self.args.startup_timeout:.0f} s ({where}; {last})")

    def stop(self) -> list[int]:
        """SIGTERM the group, SIGKILL what is left after the grace period; returns pids still alive."""
        if self.proc is None:
            return []
        pgid = self.proc.pid
        for sig, wait_s in ((signal.SIGTERM, self.args.grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()                                  # reap the leader so it does not linger
                if not group_members(pgid):
                    break
                time.sleep(0.05)
            else:
                say(f"server: process group {pgid} still alive after {signal.Signals(sig).name}")
                continue
            break
        self.proc.poll()
        left = group_members(pgid)
        code = self.proc.returncode
        say(f"server: stopped (exit code {code})" + (f"; STILL RUNNING: {left}" if left else ", no process left"))
        return left


# -----------------------------------------------------------------------------------------------
# 3. HTTP: JSON requests and a strict reader of server-sent events.
# -----------------------------------------------------------------------------------------------

class CheckFailed(Exception):
    """A check's expectation did not hold; the message is the one-line detail."""


class NotRun(Exception):
    """A check could not run here (e.g. a client package is missing); the message says why."""


class Api:
    def __init__(self, host: str, port: int, api_key: str | None, timeout: float):
        self.host, self.port, self.api_key, self.timeout = host, port, api_key, timeout
        self.model = ""

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)

    def send(self, conn, method: str, path: str, body=None, anthropic: bool = False,
             extra: dict | None = None) -> None:
        """anthropic: the key as Anthropic's clients send it (x-api-key), with their version header; extra: more
        headers (a CLI's own)."""
        headers = {"Content-Type": "application/json", **(extra or {})}
        if anthropic:
            headers["anthropic-version"] = "2023-06-01"
        if self.api_key:
            headers["x-api-key" if anthropic else "Authorization"] = \
                self.api_key if anthropic else f"Bearer {self.api_key}"
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers)

    def request(self, method: str, path: str, body=None, timeout: float | None = None,
                anthropic: bool = False, headers: dict | None = None) -> tuple[int, object]:
        """headers: filled with the response's headers, when given."""
        conn = self.connect(timeout)
        try:
            self.send(conn, method, path, body, anthropic)
            resp = conn.getresponse()
            raw = resp.read()
            if headers is not None:
                headers.update(resp.getheaders())
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode(errors="replace")

    def chat(self, **body) -> dict:
        """POST /v1/chat/completions; anything but 200 fails the check with the server's error message."""
        status, obj = self.request("POST", "/v1/chat/completions", {"model": self.model, **body})
        if status != 200:
            raise CheckFailed(f"HTTP {status}: {error_text(obj)}")
        return obj

    def stream(self, **body) -> list[dict]:
        """Streamed chat completion: the chunks, after checking the SSE framing and the final [DONE]."""
        conn = self.connect()
        try:
            self.send(conn, "POST", "/v1/chat/completions", {"model": self.model, "stream": True, **body})
            resp = conn.getresponse()
            if resp.status != 200:
                raise CheckFailed(f"HTTP {resp.status}: {error_text(json_or_text(resp.read()))}")
            ctype = resp.getheader("Content-Type", "")
            if not ctype.startswith("text/event-stream"):
                raise CheckFailed(f"streamed answer has Content-Type {ctype!r}, not text/event-stream")
            return read_sse(resp)
        finally:
            conn.close()


def json_or_text(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def error_text(obj) -> str:
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        err = obj["error"]
        return f"{err.get('message')} (param={err.get('param')!r})"
    return str(obj)[:300]


def read_sse(resp) -> list[dict]:
    """Parse `data: {...}` events separated by blank lines until `data: [DONE]`, then require end of body."""
    chunks, data_lines, done = [], [], False
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.decode("utf-8").rstrip("\r\n")
        if done and line:
            raise CheckFailed(f"data after [DONE]: {line[:80]!r}")
        if line.startswith(":"):                                  # an SSE comment (keep-alive)
            continue
        if line.startswith("data:"):
            data_lines.append(line[5:].removeprefix(" "))
            continue
        if line:
            raise CheckFailed(f"malformed SSE line {line[:80]!r}")
        if data_lines:                                            # blank line: the event is complete
            data = "\n".join(data_lines)
            data_lines = []
            if data == "[DONE]":
                done = True
                continue
            try:
                chunks.append(json.loads(data))
            except ValueError:
                raise CheckFailed(f"SSE event is not JSON: {data[:80]!r}") from None
    if data_lines:
        raise CheckFailed("the stream ended inside an event (no blank line after the last data line)")
    if not done:
        raise CheckFailed(f"the stream ended without data: [DONE] after {len(chunks)} chunks")
    for chunk in chunks:
        if "error" in chunk:
            raise CheckFailed(f"error event in the stream: {error_text(chunk)}")
    return chunks


def named_events(api: Api, path: str, body: dict, anthropic: bool = False, send_headers: dict | None = None,
                 headers: dict | None = None) -> list[dict]:
    """A Responses or Messages stream: `event: TYPE` + `data: {"type": TYPE, ...}` pairs, no [DONE], and SSE
    comments (keep-alives); the datas. send_headers: extra request headers; headers: filled with the response's."""
    conn = api.connect()
    try:
        api.send(conn, "POST", path, {**body, "stream": True}, anthropic, send_headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise CheckFailed(f"HTTP {resp.status}: {error_text(json_or_text(resp.read()))}")
        text = resp.read().decode("utf-8")
        if headers is not None:
            headers.update(resp.getheaders())
    finally:
        conn.close()
    events = []
    for block in text.split("\n\n"):
        if not block or block.startswith(":"):
            continue
        lines = block.split("\n")
        if len(lines) != 2 or not lines[0].startswith("event: ") or not lines[1].startswith("data: "):
            raise CheckFailed(f"malformed named event {block[:120]!r}")
        data = json.loads(lines[1][6:])
        if data.get("type") != lines[0][7:]:
            raise CheckFailed(f"event {lines[0][7:]!r} carries data of type {data.get('type')!r}")
        if data["type"] == "error":
            raise CheckFailed(f"error event in the stream: {data}")
        events.append(data)
    return events


def assemble(chunks: list[dict]) -> dict:
    """Fold chat.completion.chunk deltas into {index: {"content", "reasoning", "tool_calls", ...}}."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for ch in chunk.get("choices", []):
            c = choices.setdefault(ch["index"], {"role": None, "content": "", "reasoning": "", "calls": {},
                                                 "finish_reason": None, "content_deltas": []})
            delta = ch.get("delta") or {}
            c["role"] = c["role"] or delta.get("role")
            if delta.get("content"):
                c["content"] += delta["content"]
                c["content_deltas"].append(delta["content"])
            c["reasoning"] += delta.get("reasoning_content") or ""
            for tc in delta.get("tool_calls") or []:
                call = c["calls"].setdefault(tc["index"], {"id": None, "type": None, "name": None,
                                                           "arguments": "", "fragments": 0})
                call["id"] = call["id"] or tc.get("id")
                call["type"] = call["type"] or tc.get("type")
                fn = tc.get("function") or {}
                call["name"] = call["name"] or fn.get("name")
                if fn.get("arguments"):
                    call["arguments"] += fn["arguments"]
                    call["fragments"] += 1
            if ch.get("finish_reason"):
                if c["finish_reason"]:
                    raise CheckFailed(f"choice {ch['index']} got a second finish_reason")
                c["finish_reason"] = ch["finish_reason"]
    return choices


def check_chunk_envelope(chunks: list[dict]) -> dict | None:
    """Every chunk shares id/model/created and says chat.completion.chunk; returns the usage chunk if any."""
    if not chunks:
        raise CheckFailed("the stream held no chunk")
    first, usage = chunks[0], None
    for i, chunk in enumerate(chunks):
        if chunk.get("object") != "chat.completion.chunk":
            raise CheckFailed(f"chunk {i} has object {chunk.get('object')!r}")
        for key in ("id", "model", "created"):
            if chunk.get(key) != first.get(key):
                raise CheckFailed(f"chunk {i} has {key} {chunk.get(key)!r}, the first had {first.get(key)!r}")
        if chunk.get("usage"):
            if i != len(chunks) - 1 or chunk.get("choices"):
                raise CheckFailed(f"usage arrived in chunk {i} of {len(chunks)}, not as a final choice-less chunk")
            usage = chunk["usage"]
    return usage


# -----------------------------------------------------------------------------------------------
# 4. The tools. They match what pocket-tiny was trained on (tests/fixtures/train_pocket_tiny.py), so the
#    "model decides to call" checks pass against it; any real tool-calling model handles them too.
# -----------------------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "days": {"type": "integer", "description": "Number of days, 1 to 10"}},
            "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "convert_currency",
        "description": "Convert an amount of money between currencies.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"},
            "from_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR"]},
            "to_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR"]}},
            "required": ["amount", "from_currency", "to_currency"]}}},
    {"type": "function", "function": {
        "name": "get_time",
        "description": "Get the current local time in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"}},
            "required": ["city"]}}},
]

# Several phrasings: the model decides whether to call, so the check passes when any of them yields the call.
WEATHER_PROMPTS = ["What's the weather in Paris for the next 3 days?",
                   "Give me a 3-day forecast for Paris.",
                   "Find the forecast for Paris for 3 days."]
WEATHER_EXPECT = {"city": "Paris", "days": 3}
WEATHER_REPORT = {"forecast": "sunny", "high_c": 21}          # what the "tool" answers, after the call's arguments
TWO_CITY_PROMPT = "What's the weather in Paris and in Tokyo for the next 2 days?"
NO_TOOL_PROMPT = "Tell me a joke."
OTHER_TOOL = "convert_currency"
NO_THINK = {"enable_thinking": False}
THINK = {"enable_thinking": True}
CALL_ID_RE = re.compile(r"^call_[0-9a-f]{24}$")
MARKUP = ("<tool_call>", "</tool_call>", "<function=", "<parameter=", "<think>", "</think>")


def tool_named(name: str) -> dict:
    return next(t for t in TOOLS if t["function"]["name"] == name)


def check_call_shape(call: dict, where: str) -> dict:
    """An OpenAI tool call: id call_+24 hex, type function, a known name, arguments a JSON-object string.
    Returns the parsed arguments."""
    if not CALL_ID_RE.match(str(call.get("id"))):
        raise CheckFailed(f"{where}: tool call id {call.get('id')!r} is not call_ + 24 hex digits")
    if call.get("type") != "function":
        raise CheckFailed(f"{where}: tool call type {call.get('type')!r}")
    fn = call.get("function") or {}
    if fn.get("name") not in [t["function"]["name"] for t in TOOLS]:
        raise CheckFailed(f"{where}: unknown function name {fn.get('name')!r}")
    if not isinstance(fn.get("arguments"), str):
        raise CheckFailed(f"{where}: arguments is {type(fn.get('arguments')).__name__}, not a JSON string")
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        raise CheckFailed(f"{where}: arguments is not JSON: {fn['arguments'][:80]!r}") from None
    if not isinstance(args, dict):
        raise CheckFailed(f"{where}: arguments is not a JSON object: {fn['arguments'][:80]!r}")
    return args


def schema_mismatch(tool: dict, args: dict) -> str | None:
    """Why `args` does not fit the tool's schema (required keys, declared types), or None. Enums are not
    required: tool_choice shapes values by their JSON type, as OpenAI does without `strict`."""
    params = tool["function"]["parameters"]
    for key in params.get("required", []):
        if key not in args:
            return f"required parameter {key!r} missing"
    types = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,)}
    for key, value in args.items():
        spec = params["properties"].get(key)
        if spec is None:
            return f"parameter {key!r} is not in the schema"
        ok = isinstance(value, types[spec["type"]]) and not (spec["type"] != "boolean" and isinstance(value, bool))
        if not ok:
            return f"{key}={value!r} is not of type {spec['type']}"
    return None


def no_markup(text: str | None, where: str) -> None:
    for mark in MARKUP:
        if text and mark in text:
            raise CheckFailed(f"{where} contains {mark!r}: {text[:80]!r}")


def is_weather_call(call: dict) -> bool:
    """A get_weather call whose arguments fit its schema (the model chose the tool and filled it in)."""
    return (call["function"]["name"] == "get_weather"
            and schema_mismatch(TOOLS[0], json.loads(call["function"]["arguments"])) is None)


def as_asked(call: dict) -> bool:
    """The call's values are the ones the prompt asked for (Paris, 3 days)."""
    args = json.loads(call["function"]["arguments"])
    return str(args.get("city", "")).strip().lower() == WEATHER_EXPECT["city"].lower() \
        and args.get("days") == WEATHER_EXPECT["days"]


def weather_result(call: dict) -> str:
    """The tool's answer to this call: its own arguments plus a forecast."""
    return json.dumps({**json.loads(call["function"]["arguments"]), **WEATHER_REPORT})


# -----------------------------------------------------------------------------------------------
# 5. The checks. Each returns its PASS detail or raises CheckFailed / NotRun; `ctx` carries what one
#    check found for the next (the tool call the multi-turn and streaming checks replay).
# -----------------------------------------------------------------------------------------------

class Context:
    def __init__(self, args: argparse.Namespace, api: Api, log_dir: Path):
        self.args, self.api, self.log_dir = args, api, log_dir
        self.weather: tuple[str, dict] | None = None     # (prompt, response) that called get_weather
        self.missing_clients: list[str] = []
        self.max_model_len = 4096                          # from the model card, once the server is up

    def weather_call(self) -> tuple[str, dict]:
        """(prompt, response) of the first phrasing answered with a get_weather call; memoized."""
        if self.weather is None:
            for prompt in WEATHER_PROMPTS:
                resp = self.api.chat(messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                                     temperature=0, max_tokens=self.args.max_tokens)
                calls = resp["choices"][0]["message"].get("tool_calls") or []
                for call in calls:
                    check_call_shape(call, "tool call")
                if calls and is_weather_call(calls[0]):
                    self.weather = (prompt, resp)
                    break
            else:
                raise CheckFailed("no phrasing produced a get_weather call to build on")
        return self.weather


def check_models(ctx: Context) -> str:
    status, body = ctx.api.request("GET", "/v1/models")
    if status != 200 or not isinstance(body, dict) or body.get("object") != "list" or not body.get("data"):
        raise CheckFailed(f"GET /v1/models: HTTP {status} {str(body)[:120]}")
    ids = [m.get("id") for m in body["data"]]
    expected = ctx.args.expect_model_name
    if expected and expected not in ids:
        raise CheckFailed(f"served models {ids}, expected {expected!r}")
    status, one = ctx.api.request("GET", f"/v1/models/{ctx.api.model}")
    if status != 200 or one.get("id") != ctx.api.model:
        raise CheckFailed(f"GET /v1/models/{ctx.api.model}: HTTP {status} {str(one)[:120]}")
    status, _ = ctx.api.request("GET", "/v1/models/no-such-model")
    if status != 404:
        raise CheckFailed(f"GET /v1/models/no-such-model answered {status}, not 404")
    return f"serves {ids}; unknown model id -> 404"


# (what is wrong, the request fields that make it so, the `param` the 400 must name: one name or a tuple of
# acceptable names, where a trailing * accepts any path below, e.g. messages[0].role)
REFUSALS = [
    ("typo field", {"temprature": 0.5}, "temprature"),
    ("out of range temperature", {"temperature": 7.0}, "temperature"),
    ("negative max_tokens", {"max_tokens": -1}, "max_tokens"),
    ("n = 0", {"n": 0}, "n"),
    ("wrong type", {"top_p": "high"}, "top_p"),
    ("top_logprobs > 20", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("unsupported field (audio output)", {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
     ("modalities", "audio")),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, ("messages*",)),
    ("named tool not in tools", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice"),
]


def check_refusals(ctx: Context) -> str:
    base = {"model": ctx.api.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for label, change, params in REFUSALS:
        status, body = ctx.api.request("POST", "/v1/chat/completions", {**base, **change})
        err = body.get("error") if isinstance(body, dict) else None
        if status != 400 or not isinstance(err, dict):
            raise CheckFailed(f"{label}: HTTP {status} {str(body)[:120]}, expected 400 with an OpenAI error")
        if not all(k in err for k in ("message", "type", "param", "code")) or not err["message"]:
            raise CheckFailed(f"{label}: error object {err} lacks message/type/param/code")
        wanted = params if isinstance(params, tuple) else (params,)
        if not any(err["param"] == w or (w.endswith("*") and str(err["param"]).startswith(w[:-1])) for w in wanted):
            raise CheckFailed(f"{label}: param {err['param']!r}, expected {' or '.join(map(repr, wanted))}")
    status, body = ctx.api.request("POST", "/v1/chat/completions", b'{"model": "x", "messages": [')
    if status != 400:
        raise CheckFailed(f"malformed JSON body: HTTP {status}, expected 400")
    status, _ = ctx.api.request("GET", "/health")
    if status != 200:
        raise CheckFailed(f"/health answered {status} after the refusals")
    return f"{len(REFUSALS) + 1} bad requests -> 400 naming the field; server still healthy"


def plain_answer(ctx: Context, prompt: str, **extra) -> dict:
    return ctx.api.chat(messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=32,
                        chat_template_kwargs=NO_THINK, **extra)


def check_stop_sequences(ctx: Context) -> str:
    """Take a greedy answer, pick a 3-character piece of it as the stop string: the rerun must end right before
    its first occurrence, with finish_reason stop and the stop string not returned."""
    prompt = "Tell me a joke."
    full = plain_answer(ctx, prompt)["choices"][0]["message"]
    text = (full.get("content") or "").rstrip()
    if len(text) < 6:
        raise CheckFailed(f"the greedy answer is too short to cut: {text!r}")
    start = len(text) // 2
    while start < len(text) - 3 and not text[start:start + 3].strip():
        start += 1
    stop = text[start:start + 3]
    expected = text[:text.index(stop)]
    cut = plain_answer(ctx, prompt, stop=[stop, "NEVER-APPEARS"])["choices"][0]
    got = cut["message"].get("content") or ""
    if cut["finish_reason"] != "stop" or got.rstrip() != expected.rstrip():
        raise CheckFailed(f"stop={stop!r}: got {got!r} ({cut['finish_reason']}), expected {expected!r} (stop)")
    return f"stop={stop!r} cut {text!r} to {got!r}"


def check_max_tokens(ctx: Context) -> str:
    for field in ("max_tokens", "max_completion_tokens"):
        resp = ctx.api.chat(messages=[{"role": "user", "content": "Count from one to twenty in words."}],
                            temperature=0, chat_template_kwargs=NO_THINK, **{field: 3})
        used, finish = resp["usage"]["completion_tokens"], resp["choices"][0]["finish_reason"]
        if used > 3 or (used == 3 and finish != "length"):
            raise CheckFailed(f"{field}=3: {used} completion tokens, finish_reason {finish!r}")
    return "max_tokens=3 and max_completion_tokens=3 both cap the answer (finish_reason length)"


def check_n_choices(ctx: Context) -> str:
    n = 3
    resp = ctx.api.chat(messages=[{"role": "user", "content": "Name a color."}], n=n, temperature=1.0, seed=7,
                        max_tokens=16, chat_template_kwargs=NO_THINK)
    choices = resp.get("choices") or []
    if sorted(c.get("index") for c in choices) != list(range(n)):
        raise CheckFailed(f"n={n}: choice indices {[c.get('index') for c in choices]}")
    for c in choices:
        if not isinstance(c["message"].get("content"), str) or c.get("finish_reason") not in ("stop", "length"):
            raise CheckFailed(f"choice {c['index']}: content {c['message'].get('content')!r}, "
                              f"finish_reason {c.get('finish_reason')!r}")
    if resp["usage"]["completion_tokens"] < n:
        raise CheckFailed(f"usage.completion_tokens {resp['usage']['completion_tokens']} < {n} choices")
    distinct = len({c["message"]["content"] for c in choices})
    return f"{n} choices, indices 0..{n - 1}, {distinct} distinct texts, usage {resp['usage']['completion_tokens']} tokens"


def check_logprobs(ctx: Context) -> str:
    k = 3
    resp = plain_answer(ctx, "Say hello.", logprobs=True, top_logprobs=k)
    choice = resp["choices"][0]
    entries = (choice.get("logprobs") or {}).get("content")
    if not entries:
        raise CheckFailed(f"no logprobs.content in {str(choice.get('logprobs'))[:120]}")
    used = resp["usage"]["completion_tokens"]
    if not used - 1 <= len(entries) <= used:                      # the final EOS token may carry no entry
        raise CheckFailed(f"{len(entries)} logprob entries for {used} completion tokens")
    for i, e in enumerate(entries):
        top = e.get("top_logprobs") or []
        if not isinstance(e.get("token"), str) or not e.get("logprob", 1) <= 0 or len(top) != k:
            raise CheckFailed(f"entry {i}: {str(e)[:160]}")
        if e.get("bytes") is not None and not all(isinstance(b, int) and 0 <= b < 256 for b in e["bytes"]):
            raise CheckFailed(f"entry {i}: bytes {e['bytes']} is not a list of byte values")
        lps = [t["logprob"] for t in top]
        if lps != sorted(lps, reverse=True):
            raise CheckFailed(f"entry {i}: top_logprobs not sorted best first: {lps}")
        if top[0]["token"] != e["token"] or abs(top[0]["logprob"] - e["logprob"]) > 1e-4:  # greedy picks the best
            raise CheckFailed(f"entry {i}: greedy token {e['token']!r} ({e['logprob']:.4f}) is not the best "
                              f"alternative {top[0]['token']!r} ({top[0]['logprob']:.4f})")
    return f"{len(entries)} tokens, each with {k} sorted alternatives; greedy token = best alternative"


def check_streaming(ctx: Context) -> str:
    prompt = "Who wrote Romeo and Juliet?"
    whole = plain_answer(ctx, prompt)
    chunks = ctx.api.stream(messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=32,
                            chat_template_kwargs=NO_THINK, stream_options={"include_usage": True})
    usage = check_chunk_envelope(chunks)
    choice = assemble(chunks).get(0)
    if choice is None or choice["role"] != "assistant":
        raise CheckFailed("the first delta does not carry role assistant")
    expected = whole["choices"][0]
    if choice["content"] != (expected["message"].get("content") or ""):
        raise CheckFailed(f"streamed {choice['content']!r} != non-streamed {expected['message'].get('content')!r}")
    if choice["finish_reason"] != expected["finish_reason"]:
        raise CheckFailed(f"finish_reason {choice['finish_reason']!r} != {expected['finish_reason']!r}")
    if not usage:
        raise CheckFailed("include_usage: no final usage chunk")
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    if [usage.get(k) for k in keys] != [whole["usage"].get(k) for k in keys]:
        raise CheckFailed(f"stream usage {usage} != non-streamed usage {whole['usage']}")
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        raise CheckFailed(f"usage does not add up: {usage}")
    return (f"{len(chunks)} chunks + [DONE], {len(choice['content_deltas'])} content deltas equal the "
            f"non-streamed text, usage chunk {usage['prompt_tokens']}+{usage['completion_tokens']}")


def check_tool_call(ctx: Context) -> str:
    """Every phrasing's answer must be well-formed; at least one must call get_weather with schema-valid
    arguments (the model decides). The values asked for (Paris, 3) are reported, and required with
    --strict-arguments: a tiny model may call the right tool yet copy a value wrongly."""
    right, exact = [], []
    for prompt in WEATHER_PROMPTS:
        resp = ctx.api.chat(messages=[{"role": "user", "content": prompt}], tools=TOOLS, temperature=0,
                            max_tokens=ctx.args.max_tokens)
        choice = resp["choices"][0]
        msg = choice["message"]
        no_markup(msg.get("content"), "content")
        calls = msg.get("tool_calls") or []
        if calls and choice["finish_reason"] != "tool_calls":
            raise CheckFailed(f"{prompt!r}: finish_reason {choice['finish_reason']!r} with tool calls")
        for call in calls:
            check_call_shape(call, prompt)
        if calls and is_weather_call(calls[0]):
            right.append(calls[0]["function"]["arguments"])
            exact += [prompt] if as_asked(calls[0]) else []
            ctx.weather = ctx.weather or (prompt, resp)
    n = len(WEATHER_PROMPTS)
    if not right:
        raise CheckFailed(f"none of {n} phrasings produced a schema-valid get_weather call")
    if ctx.args.strict_arguments and not exact:
        raise CheckFailed(f"no phrasing called get_weather(city='Paris', days=3): {'; '.join(right)}")
    return f"{len(right)}/{n} phrasings -> get_weather ({right[0]}); {len(exact)}/{n} with the values asked for"


def check_tool_call_multi_turn(ctx: Context) -> str:
    """Replay the assistant message exactly as received, then the tool result: prompt_tokens must grow and
    the model must answer in content."""
    prompt, first = ctx.weather_call()
    assistant = first["choices"][0]["message"]                     # untouched: content null/"", string arguments
    call = assistant["tool_calls"][0]
    messages = [{"role": "user", "content": prompt}, assistant,
                {"role": "tool", "tool_call_id": call["id"], "content": weather_result(call)}]
    resp = ctx.api.chat(messages=messages, tools=TOOLS, temperature=0, max_tokens=ctx.args.max_tokens)
    answer = resp["choices"][0]["message"]
    before, after = first["usage"]["prompt_tokens"], resp["usage"]["prompt_tokens"]
    if after <= before:
        raise CheckFailed(f"prompt_tokens {before} -> {after}: the replayed history did not reach the prompt")
    if not (answer.get("content") or "").strip():
        raise CheckFailed(f"no content after the tool result; tool_calls={answer.get('tool_calls')}")
    no_markup(answer["content"], "content")
    facts = [f for f in map(str, WEATHER_REPORT.values()) if f in answer["content"]]
    return (f"prompt_tokens {before} -> {after}; answer {answer['content'][:60]!r} "
            f"(restates {len(facts)}/{len(WEATHER_REPORT)} facts of the result)")


def check_tool_call_streaming(ctx: Context) -> str:
    prompt, first = ctx.weather_call()
    expected = first["choices"][0]["message"]["tool_calls"]
    chunks = ctx.api.stream(messages=[{"role": "user", "content": prompt}], tools=TOOLS, temperature=0,
                            max_tokens=ctx.args.max_tokens)
    check_chunk_envelope(chunks)
    choice = assemble(chunks)[0]
    for text in choice["content_deltas"]:
        no_markup(text, "a content delta")
    calls = [choice["calls"][i] for i in sorted(choice["calls"])]
    if choice["finish_reason"] != "tool_calls":
        raise CheckFailed(f"finish_reason {choice['finish_reason']!r}, expected tool_calls")
    if len(calls) != len(expected):
        raise CheckFailed(f"{len(calls)} streamed calls, {len(expected)} non-streamed")
    for got, want in zip(calls, expected):
        check_call_shape({"id": got["id"], "type": got["type"],
                          "function": {"name": got["name"], "arguments": got["arguments"]}}, "streamed call")
        if (got["name"], got["arguments"]) != (want["function"]["name"], want["function"]["arguments"]):
            raise CheckFailed(f"streamed {got['name']}({got['arguments']}) != "
                              f"{want['function']['name']}({want['function']['arguments']})")
        n_params = len(json.loads(got["arguments"]))
        if n_params > 1 and got["fragments"] < 2:
            raise CheckFailed(f"{n_params} arguments arrived in one fragment, not as each value arrived")
    return (f"deltas assemble to {calls[0]['name']}({calls[0]['arguments']}) in "
            f"{calls[0]['fragments']} argument fragments; no markup in content")


def forced_call(ctx: Context, prompt: str, tool_choice) -> tuple[dict, dict]:
    """(the first call, its parsed arguments) for a request with this tool_choice; checks the shape."""
    resp = ctx.api.chat(messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice=tool_choice,
                        temperature=0, max_tokens=ctx.args.max_tokens)
    msg = resp["choices"][0]["message"]
    if not msg.get("tool_calls"):
        raise CheckFailed(f"tool_choice={json.dumps(tool_choice)}: no tool call; content {msg.get('content')!r:.80}")
    no_markup(msg.get("content"), "content")
    call = msg["tool_calls"][0]
    args = check_call_shape(call, "forced call")
    why = schema_mismatch(tool_named(call["function"]["name"]), args)
    if why:
        raise CheckFailed(f"{call['function']['name']}({call['function']['arguments']}): {why}")
    return call, args


def calls_on_its_own(ctx: Context, prompt: str) -> int:
    resp = ctx.api.chat(messages=[{"role": "user", "content": prompt}], tools=TOOLS, temperature=0,
                        max_tokens=ctx.args.max_tokens)
    return len(resp["choices"][0]["message"].get("tool_calls") or [])


def check_tool_choice_required(ctx: Context) -> str:
    call, _ = forced_call(ctx, NO_TOOL_PROMPT, "required")
    alone = calls_on_its_own(ctx, NO_TOOL_PROMPT)
    return (f"{NO_TOOL_PROMPT!r} -> {call['function']['name']}({call['function']['arguments']}) "
            f"(with tool_choice auto the model made {alone} calls)")


def check_tool_choice_named(ctx: Context) -> str:
    name = OTHER_TOOL
    call, _ = forced_call(ctx, WEATHER_PROMPTS[0], {"type": "function", "function": {"name": name}})
    if call["function"]["name"] != name:
        raise CheckFailed(f"named {name}, got a call to {call['function']['name']}")
    return f"weather question forced to {name}({call['function']['arguments']})"


def check_tool_choice_none(ctx: Context) -> str:
    resp = ctx.api.chat(messages=[{"role": "user", "content": WEATHER_PROMPTS[0]}], tools=TOOLS,
                        tool_choice="none", temperature=0, max_tokens=ctx.args.max_tokens)
    choice = resp["choices"][0]
    if choice["message"].get("tool_calls") or choice["finish_reason"] == "tool_calls":
        raise CheckFailed(f"tool_choice none produced calls: {choice['message'].get('tool_calls')}")
    no_markup(choice["message"].get("content"), "content")
    return f"no call, finish_reason {choice['finish_reason']}, no markup in content"


def check_parallel_tool_calls(ctx: Context) -> str:
    resp = ctx.api.chat(messages=[{"role": "user", "content": TWO_CITY_PROMPT}], tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False, temperature=0, max_tokens=ctx.args.max_tokens)
    calls = resp["choices"][0]["message"].get("tool_calls") or []
    if len(calls) != 1:
        raise CheckFailed(f"parallel_tool_calls=false with tool_choice required gave {len(calls)} calls")
    check_call_shape(calls[0], "the call")
    allowed = calls_on_its_own(ctx, TWO_CITY_PROMPT)
    return f"exactly 1 call ({calls[0]['function']['arguments']}); {allowed} when parallel calls are allowed"


def check_reasoning(ctx: Context) -> str:
    """With thinking on, the thinking text comes back as reasoning_content, never in content, in both the
    whole answer and the stream, and the two agree."""
    body = dict(messages=[{"role": "user", "content": WEATHER_PROMPTS[0]}], tools=TOOLS, temperature=0,
                max_tokens=ctx.args.max_tokens, chat_template_kwargs=THINK)
    msg = ctx.api.chat(**body)["choices"][0]["message"]
    reasoning = msg.get("reasoning_content") or ""
    if not reasoning.strip():
        raise CheckFailed(f"no reasoning_content with enable_thinking; content {msg.get('content')!r:.80}")
    no_markup(reasoning, "reasoning_content")
    no_markup(msg.get("content"), "content")
    streamed = assemble(ctx.api.stream(**body))[0]
    if streamed["reasoning"] != reasoning or streamed["content"] != (msg.get("content") or ""):
        raise CheckFailed(f"streamed reasoning/content {streamed['reasoning'][:40]!r}/{streamed['content'][:40]!r} "
                          f"!= non-streamed {reasoning[:40]!r}/{(msg.get('content') or '')[:40]!r}")
    return f"reasoning_content {reasoning.strip()[:50]!r} separate from content, same when streamed"


def check_concurrency(ctx: Context) -> str:
    n = ctx.args.concurrency
    results: list[object] = [None] * n
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            chunks = ctx.api.stream(messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
                                    temperature=0, max_tokens=24, chat_template_kwargs=NO_THINK,
                                    stream_options={"include_usage": True})
            usage = check_chunk_envelope(chunks)
            choice = assemble(chunks).get(0)
            if not usage or not choice or not choice["finish_reason"]:
                raise CheckFailed("no finish_reason or usage chunk")
            results[i] = usage["completion_tokens"]
        except Exception as e:                                    # reported by the main thread below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [(i, r) for i, r in enumerate(results) if not isinstance(r, int)]
    if errors:
        i, e = errors[0]
        raise CheckFailed(f"{len(errors)}/{n} streams failed; stream {i}: {type(e).__name__}: {e}")
    return f"{n} simultaneous streams all ended in [DONE] with usage ({sum(results)} tokens)"


def metric(text: str, name: str) -> float | None:
    """Sum of a Prometheus sample over its label sets (None when the server does not export it)."""
    values = [float(line.split()[-1]) for line in text.splitlines()
              if line.split("{")[0].split(" ")[0] == name]
    return sum(values) if values else None


def read_metrics(ctx: Context) -> str:
    status, body = ctx.api.request("GET", "/metrics")
    return body if status == 200 and isinstance(body, str) else ""


def cut_request(ctx: Context, body: dict, events_first: int) -> None:
    """Send a chat request, read `events_first` SSE data lines of its answer, then drop the connection."""
    conn = ctx.api.connect()
    ctx.api.send(conn, "POST", "/v1/chat/completions", {"model": ctx.api.model, **body})
    if events_first:
        resp = conn.getresponse()
        if resp.status != 200:
            raise CheckFailed(f"the stream to cut answered HTTP {resp.status}: {error_text(json_or_text(resp.read()))}")
        seen = 0
        while seen < events_first:
            line = resp.readline()
            if not line:
                raise CheckFailed("the stream ended before it could be cut")
            seen += line.startswith(b"data:")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def check_disconnect(ctx: Context) -> str:
    """Cut a long stream after two events and a long non-streamed request right after sending it. The server
    must abort both (pocketllm_requests_running back to 0 long before they could finish, where /metrics
    exports it), then answer /health and a normal request."""
    budget = max(16, min(2000, ctx.max_model_len - 64))
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": budget,
            "ignore_eos": True, "chat_template_kwargs": NO_THINK}
    before = metric(read_metrics(ctx), "pocketllm_generation_tokens_total")
    cut_request(ctx, {**body, "stream": True}, events_first=2)
    cut_request(ctx, body, events_first=0)
    detail = ""
    if before is not None:
        deadline = time.monotonic() + 30
        while True:
            text = read_metrics(ctx)
            running = metric(text, "pocketllm_requests_running")
            if running == 0:
                break
            if time.monotonic() > deadline:
                raise CheckFailed(f"{running:.0f} requests still running 30 s after their clients left")
            time.sleep(0.1)
        generated = metric(text, "pocketllm_generation_tokens_total") - before
        if generated >= budget:
            raise CheckFailed(f"{generated:.0f} tokens generated for 2 cut requests of max_tokens {budget}: not aborted")
        detail = f"both aborted after {generated:.0f} of 2x{budget} tokens, "
    else:
        detail = "abort not verified (no /metrics), "
    status, health = ctx.api.request("GET", "/health", timeout=30)
    if status != 200:
        raise CheckFailed(f"/health answered {status} after the disconnects: {str(health)[:120]}")
    resp = plain_answer(ctx, "Say hello.")
    if not resp["choices"][0]["finish_reason"]:
        raise CheckFailed("the request after the disconnects has no finish_reason")
    return f"2 cut connections (streamed, not streamed): {detail}then /health 200 and an answer"


# The other protocols agents speak: OpenAI's Responses API and Anthropic's Messages API, over raw HTTP.

RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
OMITTED = "X-Pocketllm-Omitted-Tools"          # the response header naming the hosted tools left out
MESSAGES_TOOLS = [{"name": tool["function"]["name"], "description": tool["function"]["description"],
                   "input_schema": tool["function"]["parameters"]} for tool in TOOLS]


def responses(ctx: Context, **body) -> dict:
    status, obj = ctx.api.request("POST", "/v1/responses", {"model": ctx.api.model, **body})
    if status != 200:
        raise CheckFailed(f"/v1/responses HTTP {status}: {error_text(obj)}")
    return obj


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def check_responses(ctx: Context) -> str:
    """Plain and streamed (the events must build the same response), then a forced tool call answered through
    previous_response_id, and the stored response read and deleted."""
    body = {"input": "Who wrote Romeo and Juliet?", "temperature": 0, "max_output_tokens": 32,
            "reasoning": {"effort": "none"}}
    whole = responses(ctx, **body, store=False)
    events = named_events(ctx.api, "/v1/responses", {"model": ctx.api.model, **body, "store": False})
    if [e["sequence_number"] for e in events] != list(range(len(events))):
        raise CheckFailed("sequence_number is not 0, 1, 2, ...")
    if [e["type"] for e in events[:2]] != ["response.created", "response.in_progress"] or \
            events[-1]["type"] not in ("response.completed", "response.incomplete"):
        raise CheckFailed(f"event order: {[e['type'] for e in events][:3]} ... {events[-1]['type']}")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    if not (deltas == output_text(events[-1]["response"]) == output_text(whole)):
        raise CheckFailed(f"streamed {deltas!r} != non-streamed {output_text(whole)!r}")
    usage = whole["usage"]
    if usage["total_tokens"] != usage["input_tokens"] + usage["output_tokens"]:
        raise CheckFailed(f"usage does not add up: {usage}")
    first = responses(ctx, input=WEATHER_PROMPTS[0], tools=RESPONSES_TOOLS, tool_choice="required",
                      temperature=0, max_output_tokens=ctx.args.max_tokens)
    calls = [item for item in first["output"] if item["type"] == "function_call"]
    if not calls or not calls[0]["call_id"] or calls[0]["name"] not in {t["name"] for t in RESPONSES_TOOLS}:
        raise CheckFailed(f"tool_choice required gave no function_call item: {first['output']}")
    json.loads(calls[0]["arguments"])
    result = {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": weather_result(
        {"function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}})}
    second = responses(ctx, previous_response_id=first["id"], input=[result], tools=RESPONSES_TOOLS,
                       temperature=0, max_output_tokens=ctx.args.max_tokens)
    if second["usage"]["input_tokens"] <= first["usage"]["input_tokens"]:
        raise CheckFailed("previous_response_id did not carry the conversation (input_tokens did not grow)")
    status, stored = ctx.api.request("GET", f"/v1/responses/{first['id']}")
    if status != 200 or stored["output"] != first["output"]:
        raise CheckFailed(f"GET /v1/responses/{{id}}: HTTP {status}")
    deleted = [ctx.api.request("DELETE", f"/v1/responses/{r['id']}")[0] for r in (first, second)]
    if deleted != [200, 200] or ctx.api.request("GET", f"/v1/responses/{first['id']}")[0] != 404:
        raise CheckFailed(f"DELETE /v1/responses/{{id}}: {deleted}, then GET is not 404")
    headers = {}
    status, obj = ctx.api.request("POST", "/v1/responses", {"model": ctx.api.model, "input": "Hi", "max_output_tokens":
                                  4, "tools": [{"type": "web_search"}], "store": False}, headers=headers)
    if status != 200 or obj["tools"] != [] or headers.get(OMITTED) != "web_search":
        raise CheckFailed(f"a web_search tool: HTTP {status} {error_text(obj)}, {OMITTED}: {headers.get(OMITTED)}; "
                          "not left out and named")
    return (f"{len(events)} events, sequence 0..{len(events) - 1}, stream = non-stream; {calls[0]['name']} call "
            f"answered via previous_response_id ({second['usage']['input_tokens']} input tokens); stored, read, "
            f"deleted; web_search left out and named")


def messages(ctx: Context, path: str = "/v1/messages?beta=true", **body) -> dict:
    status, obj = ctx.api.request("POST", path, {"model": ctx.api.model, **body}, anthropic=True)
    if status != 200:
        raise CheckFailed(f"{path} HTTP {status}: {obj}")
    return obj


def check_messages(ctx: Context) -> str:
    """Plain and streamed (the same text), a forced tool_use answered with a tool_result, count_tokens, and
    Anthropic's error shape."""
    ask = [{"role": "user", "content": "Who wrote Romeo and Juliet?"}]
    whole = messages(ctx, messages=ask, max_tokens=32, temperature=0)
    events = named_events(ctx.api, "/v1/messages?beta=true", {"model": ctx.api.model, "messages": ask,
                                                              "max_tokens": 32, "temperature": 0}, anthropic=True)
    names = [e["type"] for e in events]
    if names[0] != "message_start" or names[-2:] != ["message_delta", "message_stop"] or "ping" not in names:
        raise CheckFailed(f"event order: {names[:3]} ... {names[-2:]}")
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    expected = "".join(block["text"] for block in whole["content"] if block["type"] == "text")
    if text != expected or events[-2]["delta"]["stop_reason"] != whole["stop_reason"]:
        raise CheckFailed(f"streamed {text!r} != non-streamed {expected!r}")
    ask = [{"role": "user", "content": WEATHER_PROMPTS[0]}]
    first = messages(ctx, messages=ask, tools=MESSAGES_TOOLS, tool_choice={"type": "any"}, temperature=0,
                     max_tokens=ctx.args.max_tokens)
    uses = [block for block in first["content"] if block["type"] == "tool_use"]
    if first["stop_reason"] != "tool_use" or not uses or not uses[0]["id"].startswith("toolu_"):
        raise CheckFailed(f"tool_choice any gave no tool_use: {first['content']} ({first['stop_reason']})")
    result = weather_result({"function": {"name": uses[0]["name"], "arguments": json.dumps(uses[0]["input"])}})
    conversation = ask + [{"role": "assistant", "content": first["content"]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0]["id"],
                                                        "content": result}]}]
    second = messages(ctx, messages=conversation, tools=MESSAGES_TOOLS, temperature=0,
                      max_tokens=ctx.args.max_tokens)
    counted = messages(ctx, "/v1/messages/count_tokens", messages=conversation, tools=MESSAGES_TOOLS)
    used = second["usage"]["input_tokens"] + second["usage"]["cache_read_input_tokens"]
    if counted.get("input_tokens") != used:
        raise CheckFailed(f"count_tokens {counted} != the request's input tokens {used}")
    status, obj = ctx.api.request("POST", "/v1/messages", {"messages": ask}, anthropic=True)
    if status != 400 or obj.get("type") != "error" or obj["error"].get("type") != "invalid_request_error":
        raise CheckFailed(f"no max_tokens: HTTP {status} {obj}, not Anthropic's 400 error shape")
    conn = ctx.api.connect()
    try:
        conn.request("HEAD", "/")
        head = conn.getresponse()
        head.read()
    finally:
        conn.close()
    if head.status != 200:
        raise CheckFailed(f"HEAD / answered {head.status}")
    return (f"{len(events)} events, stream = non-stream; {uses[0]['name']} tool_use answered with a tool_result "
            f"({used} input tokens = count_tokens); Anthropic error shape; HEAD / 200")


# The agent CLIs' requests (docs/api.md, "Agent CLIs, headless"): the shapes Codex CLI 0.171, Claude Code 2.1
# and Qwen Code 0.24 send, fields, item and block kinds, tool kinds and headers as recorded, their long system
# prompts and tool lists cut short to fit any context, and max tokens bounded. Each CLI's first request, and
# the request that returns its shell tool's result.

CLI_SHELL_OUTPUT = "Process exited with code 0\nOutput:\nhello\n"
CODEX_HEADERS = {"originator": "codex_exec", "accept": "text/event-stream", "session-id": "s-1",
                 "x-codex-turn-metadata": '{"turn_id": "t-1", "sandbox": "seccomp"}'}
CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string", "description": "Shell command."},
                                                     "workdir": {"type": "string"}, "login": {"type": "boolean"},
                                                     "yield_time_ms": {"type": "number"}},
                    "required": ["cmd"], "additionalProperties": False}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.", "tools": [
        {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"],
                        "additionalProperties": False}}]},
    {"type": "web_search", "external_web_access": False}]
CLAUDE_HEADERS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14", "x-app": "cli"}
CLAUDE_TOOLS = [
    {"name": "Bash", "description": "Executes a bash command.", "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {
            "command": {"description": "The command to execute", "type": "string"},
            "timeout": {"description": "Optional timeout in milliseconds", "type": "number"}},
        "required": ["command"], "additionalProperties": False}},
    {"name": "DeferredToolPlaceholder", "description": "Reserved placeholder; never call this tool.",
     "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}]
QWEN_TOOLS = [{"type": "function", "function": {
    "name": "run_shell_command", "description": "Executes a shell command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "is_background": {"type": "boolean"}},
        "required": ["command"], "$schema": "http://json-schema.org/draft-07/schema#"}}}]


def codex_turns(ctx: Context) -> str:
    text = lambda role, *texts: {"type": "message", "role": role,  # noqa: E731
                                 "content": [{"type": "input_text", "text": t} for t in texts]}
    body = {"model": ctx.api.model, "instructions": None, "tools": CODEX_TOOLS, "tool_choice": "auto",
            "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s-1",
            "client_metadata": {"x-codex-turn-metadata": "{}"}, "max_output_tokens": ctx.args.max_tokens,
            "input": [text("developer", "You are Codex."), text("developer", "<permissions>", "<skills>"),
                      text("user", "<environment_context><cwd>/tmp</cwd></environment_context>"),
                      text("user", "Say hello.")]}
    del body["instructions"]
    headers = {}
    events = named_events(ctx.api, "/v1/responses", body, send_headers=CODEX_HEADERS, headers=headers)
    final = events[-1]["response"]
    if headers.get(OMITTED) != "web_search" or [t["name"] for t in final["tools"]] != ["exec_command", "close_agent"]:
        raise CheckFailed(f"Codex: {OMITTED} {headers.get(OMITTED)!r}, tools {[t['name'] for t in final['tools']]}")
    call = {"type": "function_call", "id": "fc_1", "status": "completed", "name": "exec_command",
            "arguments": '{"cmd": "echo hello"}', "call_id": "call_1"}
    result = {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": CLI_SHELL_OUTPUT}
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Run it."}],
                 "encrypted_content": "Run it."}
    events = named_events(ctx.api, "/v1/responses", {**body, "input": body["input"] + [reasoning, call, result]},
                          send_headers=CODEX_HEADERS)
    if events[-1]["type"] not in ("response.completed", "response.incomplete"):
        raise CheckFailed(f"Codex round trip ended with {events[-1]['type']}")
    return f"Codex {len(events)} events"


def claude_turns(ctx: Context) -> str:
    ctx.api.request("HEAD", "/")
    cached = {"type": "ephemeral"}
    body = {"model": ctx.api.model, "max_tokens": ctx.args.max_tokens, "stream": True, "tools": CLAUDE_TOOLS,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                       {"type": "text", "text": "You are a Claude agent.", "cache_control": cached}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                                      {"type": "text", "text": "Say hello.", "cache_control": cached}]},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}],
            "metadata": {"user_id": '{"device_id": "d", "session_id": "s"}'},
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}}
    events = named_events(ctx.api, "/v1/messages?beta=true", body, anthropic=True, send_headers=CLAUDE_HEADERS)
    if [e["type"] for e in events[:2]] != ["message_start", "ping"] or events[-1]["type"] != "message_stop":
        raise CheckFailed(f"Claude Code: events {[e['type'] for e in events][:3]} ... {events[-1]['type']}")
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "echo hello"}}
    result = {"tool_use_id": "toolu_1", "type": "tool_result", "content": "hello", "is_error": False,
              "cache_control": cached}
    turn = body["messages"] + [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    events = named_events(ctx.api, "/v1/messages?beta=true", {**body, "messages": turn}, anthropic=True,
                          send_headers=CLAUDE_HEADERS)
    if events[-1]["type"] != "message_stop":
        raise CheckFailed(f"Claude Code round trip ended with {events[-1]['type']}")
    return f"Claude Code {len(events)} events"


def qwen_turns(ctx: Context) -> str:
    parts = [{"type": "text", "text": t} for t in ("<system-reminder>skills</system-reminder>", "Say hello.")]
    body = {"messages": [{"role": "system", "content": "You are Qwen Code."}, {"role": "user", "content": parts}],
            "max_tokens": ctx.args.max_tokens, "stream_options": {"include_usage": True}, "tools": QWEN_TOOLS}
    assemble(ctx.api.stream(**body))
    call = {"id": "call_1", "type": "function", "function": {"name": "run_shell_command",
                                                             "arguments": '{"command":"echo hello"}'}}
    turn = body["messages"] + [{"role": "assistant", "content": None, "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "call_1",
                                "content": [{"type": "text", "text": CLI_SHELL_OUTPUT}]}]
    chunks = ctx.api.stream(**{**body, "messages": turn})
    if not chunks or "usage" not in chunks[-1]:
        raise CheckFailed("Qwen Code round trip: no usage chunk at the end")
    return f"Qwen Code {len(chunks)} chunks"


def check_agent_clis(ctx: Context) -> str:
    """Each CLI's first request and its shell tool's round trip, in the CLI's shapes, answered as streams (the
    hosted web_search that Codex attaches left out and named)."""
    return "; ".join(turns(ctx) for turns in (codex_turns, claude_turns, qwen_turns))


# -----------------------------------------------------------------------------------------------
# 6. The published clients, each a small script run by --client-python: a full call-and-return tool cycle,
#    no extra_body. The configuration travels as one JSON argument.
# -----------------------------------------------------------------------------------------------

OPENAI_CLIENT = r'''
import json, sys
from openai import OpenAI
cfg = json.loads(sys.argv[1])
client = OpenAI(base_url=cfg["base_url"], api_key=cfg["api_key"], max_retries=0, timeout=cfg["timeout"])
if cfg["model"] not in [m.id for m in client.models.list()]:
    sys.exit(f"models.list() does not list {cfg['model']!r}")
messages = [{"role": "user", "content": cfg["prompt"]}]
first = client.chat.completions.create(model=cfg["model"], messages=messages, tools=cfg["tools"],
                                       temperature=0, max_tokens=cfg["max_tokens"])
message = first.choices[0].message
if not message.tool_calls:
    sys.exit(f"no tool call (finish_reason {first.choices[0].finish_reason}, content {message.content!r})")
call = message.tool_calls[0]
json.loads(call.function.arguments)
messages.append(message)                              # the SDK's own object, replayed as received
result = {**json.loads(call.function.arguments), **cfg["tool_report"]}
messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
second = client.chat.completions.create(model=cfg["model"], messages=messages, tools=cfg["tools"],
                                        temperature=0, max_tokens=cfg["max_tokens"])
answer = second.choices[0].message
if not answer.content or answer.tool_calls:
    sys.exit(f"second turn: content {answer.content!r}, tool_calls {answer.tool_calls}")
if second.usage.prompt_tokens <= first.usage.prompt_tokens:
    sys.exit(f"prompt_tokens did not grow: {first.usage.prompt_tokens} -> {second.usage.prompt_tokens}")
print(f"{call.function.name}({call.function.arguments}) -> {answer.content[:50]!r}")
'''

LANGCHAIN_CLIENT = r'''
import json, sys
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
cfg = json.loads(sys.argv[1])
llm = ChatOpenAI(model=cfg["model"], base_url=cfg["base_url"], api_key=cfg["api_key"], temperature=0,
                 max_tokens=cfg["max_tokens"], max_retries=0, timeout=cfg["timeout"])
bound = llm.bind_tools(cfg["tools"])
history = [HumanMessage(cfg["prompt"])]
ai = bound.invoke(history)
if not ai.tool_calls:
    sys.exit(f"no tool call (content {ai.content!r})")
call = ai.tool_calls[0]
history += [ai, ToolMessage(json.dumps({**call["args"], **cfg["tool_report"]}), tool_call_id=call["id"])]
final = bound.invoke(history)
if not final.content or final.tool_calls:
    sys.exit(f"second turn: content {final.content!r}, tool_calls {final.tool_calls}")
grew = final.usage_metadata["input_tokens"] > ai.usage_metadata["input_tokens"]
if not grew:
    sys.exit(f"input tokens did not grow: {ai.usage_metadata} -> {final.usage_metadata}")
print(f"{call['name']}({json.dumps(call['args'])}) -> {final.content[:50]!r}")
'''

CLIENTS = {"openai": ("openai", OPENAI_CLIENT), "langchain-openai": ("langchain_openai", LANGCHAIN_CLIENT)}


def run_client(ctx: Context, client: str) -> str:
    module, script = CLIENTS[client]
    python = ctx.args.client_python
    try:
        probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    except OSError as e:
        probe = subprocess.CompletedProcess([], 1, "", f"cannot run {python}: {e}")
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        message = f"{client} is not usable with {python}: {reason}"
        ctx.missing_clients.append(client)
        if ctx.args.require_tool_clients:
            raise CheckFailed(message + " (--require-tool-clients)")
        raise NotRun(message)
    prompt = ctx.weather[0] if ctx.weather else WEATHER_PROMPTS[0]
    cfg = {"base_url": ctx.api.base_url, "api_key": ctx.api.api_key or "not-needed", "model": ctx.api.model,
           "tools": TOOLS, "prompt": prompt, "tool_report": WEATHER_REPORT, "max_tokens": ctx.args.max_tokens,
           "timeout": ctx.args.request_timeout}
    try:
        out = subprocess.run([python, "-c", script, json.dumps(cfg)], capture_output=True, text=True,
                             timeout=4 * ctx.args.request_timeout)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"the {client} client script timed out") from None
    with open(ctx.log_dir / f"client-{client}.log", "w") as log:
        log.write(out.stdout + out.stderr)
    if out.returncode != 0:
        raise CheckFailed((out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1][:300])
    return out.stdout.strip().splitlines()[-1]


def check_client_openai(ctx: Context) -> str:
    return run_client(ctx, "openai")


def check_client_langchain(ctx: Context) -> str:
    return run_client(ctx, "langchain-openai")


CHECKS = {
    "models": check_models,
    "refusals": check_refusals,
    "stop_sequences": check_stop_sequences,
    "max_tokens": check_max_tokens,
    "n_choices": check_n_choices,
    "logprobs": check_logprobs,
    "streaming": check_streaming,
    "tool_call": check_tool_call,
    "tool_call_multi_turn": check_tool_call_multi_turn,
    "tool_call_streaming": check_tool_call_streaming,
    "tool_choice_required": check_tool_choice_required,
    "tool_choice_named": check_tool_choice_named,
    "tool_choice_none": check_tool_choice_none,
    "parallel_tool_calls": check_parallel_tool_calls,
    "reasoning": check_reasoning,
    "concurrency": check_concurrency,
    "disconnect": check_disconnect,
    "responses": check_responses,
    "messages": check_messages,
    "agent_clis": check_agent_clis,
    "client_openai": check_client_openai,
    "client_langchain": check_client_langchain,
}
CLIENT_CHECKS = {"client_openai": "openai", "client_langchain": "langchain-openai"}


# -----------------------------------------------------------------------------------------------
# 7. Main: start, check, report, and stop the server group whatever happens.
# -----------------------------------------------------------------------------------------------

def say(line: str) -> None:
    print(line, flush=True)


def report(results: dict, name: str, outcome: str, detail: str, seconds: float | None = None) -> None:
    """One line per check: the detail flattened and cut to a readable length."""
    detail = " ".join(str(detail).split("\n"))
    detail = detail if len(detail) <= 300 else detail[:297] + "..."
    results[name] = (outcome, detail)
    say(f"[{outcome}] {name}: {detail}" + (f" ({seconds:.1f} s)" if seconds is not None else ""))


def run_checks(ctx: Context, names: list[str], results: dict) -> None:
    for name in names:
        start = time.monotonic()
        try:
            outcome, detail = "PASS", CHECKS[name](ctx)
        except CheckFailed as e:
            outcome, detail = "FAIL", str(e)
        except NotRun as e:
            outcome, detail = "NOT RUN", str(e)
        except (OSError, http.client.HTTPException) as e:
            outcome, detail = "FAIL", f"connection: {type(e).__name__}: {e}"
        except Exception as e:                                    # a malformed answer (missing key, wrong type)
            outcome, detail = "FAIL", f"unexpected answer: {type(e).__name__}: {e}"
        report(results, name, outcome, detail, time.monotonic() - start)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def summarize(results: dict, missing_clients: list[str]) -> int:
    """Print the clients' outcomes and the count line; returns the number of failures."""
    counts = {o: sum(1 for r, _ in results.values() if r == o) for o in ("PASS", "FAIL", "NOT RUN")}
    clients = [f"{label} {results[name][0]}" for name, label in CLIENT_CHECKS.items() if name in results]
    if clients:
        say("clients: " + ", ".join(clients))
    if missing_clients:
        say(f"missing tool clients: {', '.join(missing_clients)} "
            "(install openai and langchain-openai into the --client-python interpreter)")
    line = f"{counts['PASS']} passed, {counts['FAIL']} failed"
    say(line + (f", {counts['NOT RUN']} not run" if counts["NOT RUN"] else ""))
    return counts["FAIL"]


def main(argv: list[str] | None = None) -> int:
    args, server_flags = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_interrupted)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="verify-openai-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    names = args.checks.split(",") if args.checks else list(CHECKS)
    results: dict[str, tuple[str, str]] = {}
    server = ServerGroup(args, server_flags, log_dir)
    api = Api(args.host, args.port, args.api_key, args.request_timeout)
    ctx = Context(args, api, log_dir)
    interrupted = None
    say(f"verify_openai: pocketllm {git_commit()}, {len(names)} checks, logs in {log_dir}")
    try:
        server.start()
        server.wait_ready(api)
        status, models = api.request("GET", "/v1/models")
        card = models["data"][0] if status == 200 and isinstance(models, dict) and models.get("data") else {}
        api.model = card.get("id", "unknown")
        ctx.max_model_len = card.get("max_model_len") or ctx.max_model_len
        say(f"server: ready at {api.base_url}, model {api.model!r}")
        run_checks(ctx, names, results)
    except ServerStartError as e:
        report(results, "server_start", "FAIL", str(e))
        say(server.log_tail())
    except (KeyboardInterrupt, Interrupted) as e:
        interrupted = getattr(e, "signum", signal.SIGINT)
        report(results, "interrupted", "FAIL", f"{signal.Signals(interrupted).name} before the checks finished")
    except Exception as e:                                        # a bug of this script: still clean up
        traceback.print_exc()
        report(results, "harness", "FAIL", f"{type(e).__name__}: {e}")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # let nothing cut the teardown short
            signal.signal(sig, signal.SIG_IGN)
        if any(r == "FAIL" for r, _ in results.values()) and not results.keys() & {"server_start", "interrupted"}:
            say("server log (last lines):\n" + server.log_tail(15))
        if server.stop():
            report(results, "server_stop", "FAIL", "processes of the server group survived SIGKILL")
        if not args.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
    failed = summarize(results, ctx.missing_clients)
    if interrupted is not None:
        return 128 + interrupted
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
