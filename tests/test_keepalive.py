"""Streams stay alive while a long prompt prefills (issue 51): an agent CLI's first request carries tens of
thousands of prompt tokens, and on a CPU the prefill outlasts its read timeout. From the moment a streamed
request is admitted, a stream that has written nothing for `keepalive_seconds` gets a keep-alive: Anthropic's
`ping` event on /v1/messages, an SSE comment line (`: keep-alive`) on the OpenAI streams.

The bundled pocket-tiny, served by the real engine with a small prefill budget, so that a ~2000-token prompt
prefills in many steps (seconds on one CPU thread). Each test checks its own premise: the prefill took longer
than the client's read timeout, so without keep-alives the client would have given up.
"""

import http.client
import json
import socket
import threading
import time

import anthropic
import openai
import pytest

import pocketllm

KEEPALIVE_S = 0.25             # the server's keep-alive period here
READ_TIMEOUT_S = 1.0           # the clients' read timeout: shorter than every prefill below
PROMPT_WORDS = 660             # ~2000 prompt tokens: 250 prefill steps of 8 tokens


@pytest.fixture(scope="module")
def llm():
    llm = pocketllm.LLM(None, backend="torch", quiet=True, max_context=4096, prefill_token_budget=8)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm):
    srv = llm.serve(port=0, block=False, log_requests=False, keepalive_seconds=KEEPALIVE_S)
    yield srv
    srv.shutdown()


def long_prompt(seed: str) -> str:
    """A prompt of ~2000 tokens that shares no prefix with another seed's (so nothing comes from the cache)."""
    words = ["alpha", "river", "stone", "cloud", "seven", "green", "table", "north", "quiet", "paper"]
    return seed + " " + " ".join(words[(i * 7 + len(seed)) % len(words)] for i in range(PROMPT_WORDS))


BODIES = {
    "/v1/chat/completions": lambda prompt: {"model": "pocket-tiny", "messages": [{"role": "user", "content": prompt}],
                                            "max_tokens": 4, "temperature": 0, "stream": True},
    "/v1/responses": lambda prompt: {"model": "pocket-tiny", "input": prompt, "max_output_tokens": 4,
                                     "temperature": 0, "stream": True},
    "/v1/messages": lambda prompt: {"model": "pocket-tiny", "messages": [{"role": "user", "content": prompt}],
                                    "max_tokens": 4, "temperature": 0, "stream": True},
}


def timed_lines(port: int, path: str, body: dict) -> list[tuple[float, str]]:
    """(seconds since the request was sent, line) for every line of the SSE stream, as the bytes arrive."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    start = time.monotonic()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    lines = sse_lines(response.fp, start)
    conn.close()
    return lines


def sse_lines(fp, start: float, on_line=lambda line: None) -> list[tuple[float, str]]:
    """(seconds since start, line) for the chunked SSE body read from fp, to its last chunk."""
    lines = []
    while (line := fp.readline().decode().rstrip("\r\n")) != "0":              # raw chunks, to the last one
        lines.append((time.monotonic() - start, line))
        on_line(line)
    return [(t, line) for t, line in lines if not _chunk_size(line)]


def _chunk_size(line: str) -> bool:
    return bool(line) and all(c in "0123456789abcdef" for c in line)


def first_token_at(lines: list[tuple[float, str]], path: str) -> float:
    """When the first generated text or delta arrived."""
    marks = {"/v1/chat/completions": '"delta": {"', "/v1/responses": "output_text.delta",
             "/v1/messages": "content_block_delta"}
    for t, line in lines:
        if line.startswith("data:") and marks[path] in line and '"role"' not in line:
            return t
    return lines[-1][0]


def check_kept_alive(lines: list[tuple[float, str]], path: str) -> None:
    """Keep-alives every KEEPALIVE_S while the prompt prefilled, which took longer than a client's read timeout."""
    first = first_token_at(lines, path)
    assert first > READ_TIMEOUT_S, f"the prefill took {first:.2f} s, too short for this test's premise"
    waiting = [(t, line) for t, line in lines if t < first and line]
    keepalives = [t for t, line in waiting if line in (": keep-alive", "event: ping")]
    assert len(keepalives) >= first / KEEPALIVE_S / 2, (first, waiting)
    times = [0.0, *(t for t, _ in waiting), first]
    assert max(b - a for a, b in zip(times, times[1:])) < 4 * KEEPALIVE_S, waiting   # never silent for long
    if path == "/v1/messages":                       # a ping is a whole Anthropic event, data and all
        pings = [i for i, (_, line) in enumerate(lines) if line == "event: ping"]
        assert all(lines[i + 1][1] == 'data: {"type": "ping"}' for i in pings)
    else:
        assert "event: ping" not in [line for _, line in lines]


@pytest.mark.parametrize("path", list(BODIES))
def test_keepalives_while_the_prompt_prefills(server, path):
    check_kept_alive(timed_lines(server.port, path, BODIES[path](long_prompt(path))), path)


def _head(fp) -> tuple[int, dict]:
    status = int(fp.readline().split()[1])
    headers = {}
    while line := fp.readline().decode().strip():
        name, _, value = line.partition(":")
        headers[name.lower()] = value.strip()
    return status, headers


def test_one_watcher_keeps_a_pipelined_stream_alive(server):
    """One thread per stream both watches for the hang-up and keeps the stream alive. A client that sends its
    next request on the connection before the stream ends (HTTP/1.1 pipelining) is no hang-up: its stream still
    gets keep-alives, then both answers come in order."""
    path = "/v1/chat/completions"
    requests = b""
    for body in (BODIES[path](long_prompt("pipelined")), {**BODIES[path]("Hi"), "stream": False}):
        data = json.dumps(body).encode()
        requests += (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % (path.encode(), len(data)) + data)
    watchers = []                           # at the latest keep-alive: the server's watcher threads

    def count_watchers(line: str) -> None:
        if line == ": keep-alive":
            watchers[:] = [[thread.name for thread in threading.enumerate()].count("pocketllm-client-watch")]
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        fp = sock.makefile("rb")
        start = time.monotonic()
        sock.sendall(requests)              # both at once: the second waits in the socket while the first streams
        assert _head(fp)[0] == 200
        check_kept_alive(sse_lines(fp, start, count_watchers), path)
        assert fp.readline() == b"\r\n"
        status, headers = _head(fp)
        answer = json.loads(fp.read(int(headers["content-length"])))
    assert status == 200 and answer["object"] == "chat.completion"
    assert watchers == [1], watchers                      # the stream's one watcher, no second thread


def test_openai_sdk_parses_kept_alive_streams(server):
    """The openai SDK, with a read timeout shorter than the prefill, reads both streams to the end; the text is
    the non-streamed answer's (computed afterwards, from the prefix cache)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0,
                           timeout=READ_TIMEOUT_S)
    prompt = long_prompt("chat sdk")
    start, text = time.monotonic(), ""
    for chunk in client.chat.completions.create(model="pocket-tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=4, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert time.monotonic() - start > READ_TIMEOUT_S
    slow = openai.OpenAI(base_url=client.base_url, api_key="x", max_retries=0, timeout=60)
    whole = slow.chat.completions.create(model="pocket-tiny", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=4, temperature=0)
    assert text == (whole.choices[0].message.content or "")

    prompt = long_prompt("responses sdk")
    start = time.monotonic()
    events = list(client.responses.create(model="pocket-tiny", input=prompt, max_output_tokens=4, temperature=0,
                                          stream=True))
    assert time.monotonic() - start > READ_TIMEOUT_S
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    whole = slow.responses.create(model="pocket-tiny", input=prompt, max_output_tokens=4, temperature=0)
    assert events[-1].response.output_text == whole.output_text


def test_anthropic_sdk_parses_kept_alive_streams(server):
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x", max_retries=0,
                                 timeout=READ_TIMEOUT_S)
    request = dict(model="pocket-tiny", max_tokens=4, messages=[{"role": "user", "content": long_prompt("sdk")}],
                   extra_body={"temperature": 0})
    start = time.monotonic()
    events = list(client.messages.create(**request, stream=True))
    assert time.monotonic() - start > READ_TIMEOUT_S
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert "ping" not in [event.type for event in events]           # the SDK skips pings, as Anthropic's
    text = "".join(event.delta.text for event in events
                   if event.type == "content_block_delta" and event.delta.type == "text_delta")
    slow = anthropic.Anthropic(base_url=client.base_url, api_key="x", max_retries=0, timeout=60)
    whole = slow.messages.create(**request)
    assert text == "".join(block.text for block in whole.content if block.type == "text")
