"""Slow and greedy clients cannot stall the others or pin engine memory (real sockets, bounded in time).

A client that sends its headers or body a byte at a time is cut off once the socket timeout has passed since
its request began; a client holding idle connections meets the connection cap (503 beyond it); a client that
opens a long stream and never reads it is cut off after its writes stall for the socket timeout, and its
request is aborted: the engine's blocks and slots come back. Meanwhile another client is served normally.
"""

import http.client
import json
import socket
import time

import pytest

import pocketllm

TIMEOUT = 2.0        # the server's socket timeout in these tests
CAP = 8              # its connection cap
CHAT = {"model": "pocket-tiny", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4,
        "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    llm = pocketllm.LLM(str(pocketllm.DEFAULT_CKPT), quiet=True, max_context=4096, max_batch_size=4)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm):
    srv = llm.serve(port=0, block=False, log_requests=False, socket_timeout=TIMEOUT, max_connections=CAP,
                    send_buffer_bytes=8192)
    yield srv
    srv.shutdown()


def chat(server, body=CHAT):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


def closed_within(sock, seconds) -> float:
    """Seconds until the server closes sock (recv gives EOF or a reset), reading whatever arrives."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except ConnectionError:
        pass
    return time.monotonic() - start


def wait_until(predicate, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_byte_a_second_is_cut_off_and_others_are_served(server, part):
    body = json.dumps(CHAT).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    start = time.monotonic()
    slow, fast = (head, b"") if part == "headers" else (body, head)
    sock.sendall(fast)
    cut = False
    for byte in slow:                      # one byte each 0.2 s: never silent for a whole socket timeout
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            cut = True
            break
        if time.monotonic() - start > TIMEOUT + 3:
            break
        time.sleep(0.2)
        if part == "headers" and byte == head[5]:
            assert chat(server)[0] == 200   # another client is served meanwhile
    if not cut:
        closed_within(sock, 5)
    assert time.monotonic() - start < TIMEOUT + 4, "the slow client held its connection past the deadline"
    sock.close()
    assert chat(server)[0] == 200


def test_idle_connections_meet_the_cap_with_503(server):
    assert wait_until(lambda: len(server.connections) == 0, 5)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(CAP)]
    assert wait_until(lambda: len(server.connections) == CAP, 5)
    extra = []
    for _ in range(40):                    # hundreds would do the same; each is answered at once
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        extra.append((resp.status, json.loads(resp.read())))
        conn.close()
    assert all(status == 503 and "too many connections" in body["error"]["message"] for status, body in extra)
    for sock in idle:
        sock.close()
    assert wait_until(lambda: len(server.connections) == 0, 5)
    assert chat(server)[0] == 200


def test_a_stream_nobody_reads_is_aborted_and_releases_the_engine(server, llm):
    # Every token writes: the special tokens are banned, since ignore_eos alone lets the model emit <|im_end|>
    # again and again, which streams nothing and so never fills the socket.
    bans = {str(i): -100 for i in llm.tokenizer.special_ids}
    body = dict(CHAT, stream=True, max_tokens=3000, ignore_eos=True, temperature=1.0, logit_bias=bans)
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    assert wait_until(lambda: llm.stats()["running"] == 1, 10)
    # Never read. The request ends long before 3000 tokens could be buffered at a reader's pace.
    assert wait_until(lambda: llm.stats()["running"] == 0, 45), "the stalled stream kept generating"
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["slots_used"] == 0
    assert llm.stats()["generation_tokens_total"] < 3000 + 100
    sock.close()
    assert chat(server)[0] == 200


def open_request(server, body) -> socket.socket:
    """A raw connection that has sent one chat request (and reads nothing yet)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_a_client_that_hangs_up_is_499_not_a_server_error(server, llm, capsys):
    """curl -m 5 giving up on a long answer: the request is aborted, and the log and /metrics say 499 (client
    closed request, as nginx logs it), never the 503 that docs/serving.md calls the alarm (issue 47)."""
    bans = {str(i): -100 for i in llm.tokenizer.special_ids}
    before = dict(server.metrics.responses)
    server.log_requests = True
    try:
        sock = open_request(server, dict(CHAT, max_tokens=3000, ignore_eos=True, temperature=1.0, logit_bias=bans))
        assert wait_until(lambda: llm.stats()["running"] == 1, 10)
        sock.close()
        assert wait_until(lambda: llm.stats()["running"] == 0, 20), "the abandoned request kept generating"
        assert wait_until(lambda: server.metrics.responses.get(("/v1/chat/completions", 499), 0) ==
                          before.get(("/v1/chat/completions", 499), 0) + 1, 5), server.metrics.responses
    finally:
        server.log_requests = False
    assert all(n == before.get(key, 0) for key, n in server.metrics.responses.items() if key[1] >= 500)
    log = capsys.readouterr().err
    assert '"POST /v1/chat/completions HTTP/1.1" 499' in log and " 503 " not in log, log
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    status, metrics = resp.status, resp.read().decode()
    conn.close()
    assert status == 200 and 'pocketllm_requests_total{endpoint="/v1/chat/completions",status="499"}' in metrics


def test_a_stream_waiting_for_text_notices_the_hang_up(server, llm):
    """The chat page's Stop under load (issue 47): a stream whose tokens add no text (here EOS, again and again,
    with ignore_eos) writes nothing after its first chunk, so no failed write can tell that the client left. The
    server watches the socket instead: the request is aborted long before its max tokens."""
    bias = {str(i): 100 for i in llm.eos_token_ids}
    before = llm.stats()["generation_tokens_total"]
    sock = open_request(server, dict(CHAT, stream=True, max_tokens=3000, ignore_eos=True, temperature=0,
                                     logit_bias=bias))
    sock.settimeout(10)
    got = b""
    while b"data: " not in got:                    # the headers and the role chunk: the stream has started
        got += sock.recv(65536)
    assert wait_until(lambda: llm.stats()["running"] == 1, 10)
    sock.close()
    assert wait_until(lambda: llm.stats()["running"] == 0, 20)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["slots_used"] == 0
    assert stats["generation_tokens_total"] - before < 3000, "the stream ran to its max tokens"
    assert chat(server)[0] == 200
