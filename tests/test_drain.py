"""Graceful drain and probes (issue 52): SIGTERM to `python pocketllm.py` stops admitting, lets the requests in flight finish
(streams included) within --drain-timeout, then exits 0; a second SIGTERM stops at once. Readiness (/health) and
liveness (/live) as Kubernetes probes read them; LLM.close(drain=True) for embedding users.

Every server here is the CLI on the bundled pocket-tiny (CPU, torch backend) on real sockets (port 0); requests
are raw http.client connections, so a refused request is seen exactly as a load balancer sees it.
"""

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import pocketllm

ROOT = Path(__file__).resolve().parent.parent
LONG = 160            # tokens an in-flight request generates (ignore_eos): long enough to SIGTERM in the middle


def start_cli(*flags):
    """`python pocketllm.py --port 0 ...` on pocket-tiny -> (process, port), once it prints its address."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "pocketllm.py"), "--port", "0", "--device", "cpu",
                             "--max-context", "512", "--max-batch-size", "8", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    if "http://127.0.0.1:" not in line:
        proc.kill()
        pytest.fail(f"the server did not start: {line} {proc.stderr.read()}")
    return proc, int(line.strip().rsplit(":", 1)[1])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port, method, path, body=None, timeout=120):
    """One request on a fresh connection -> (status, headers dict, body text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode()
    finally:
        conn.close()


def chat(content, max_tokens=LONG, stream=False):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream, "stream_options": {"include_usage": True} if stream else None}


def stream_usage(text):
    """The usage of a complete SSE chat stream (it must end with [DONE] and carry no error)."""
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), text[-300:]
    return chunks[-1]["usage"]


def running(port):
    """pocketllm_requests_running from /metrics."""
    metrics = call(port, "GET", "/metrics")[2]
    return int(float(next(line.split()[1] for line in metrics.splitlines()
                          if line.startswith("pocketllm_requests_running "))))


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sigterm_finishes_requests_in_flight_and_refuses_new_ones_with_503():
    proc, port = start_cli("--drain-timeout", "120")
    try:
        assert call(port, "GET", "/health")[:1] == (200,) and call(port, "GET", "/live")[0] == 200
        results = {}

        def send(name, body):
            results[name] = call(port, "POST", "/v1/chat/completions", body)

        flights = [threading.Thread(target=send, args=(f"plain{i}", chat(f"Tell me about city {i}")))
                   for i in range(3)]
        flights += [threading.Thread(target=send, args=(f"stream{i}", chat(f"Weather in town {i}?", stream=True)))
                    for i in range(3)]
        for t in flights:
            t.start()
        wait_until(lambda: running(port) == 6)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: call(port, "GET", "/health")[0] == 503, timeout=10)
        assert running(port) > 0, "the requests finished before the drain could be seen: raise LONG"

        status, headers, body = call(port, "GET", "/health")
        assert (status, json.loads(body)) == (503, {"status": "draining"}) and headers["retry-after"] == "1"
        assert call(port, "GET", "/live")[0] == 200                     # draining is alive: no restart wanted
        refused = [call(port, "POST", "/v1/chat/completions", chat("Hi", 4)),
                   call(port, "POST", "/v1/chat/completions", chat("Hi", 4, stream=True)),
                   call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
                   call(port, "GET", "/v1/models")]
        for status, headers, body in refused:
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close", body
            assert json.loads(body)["error"]["code"] == "draining"

        for t in flights:
            t.join(120)
        assert proc.wait(60) == 0
        for i in range(3):
            status, headers, body = results[f"plain{i}"]
            answer = json.loads(body)
            assert status == 200 and answer["usage"]["completion_tokens"] == LONG, body[-300:]
            assert answer["choices"][0]["finish_reason"] == "length"
            status, headers, body = results[f"stream{i}"]
            assert status == 200 and stream_usage(body)["completion_tokens"] == LONG
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stderr.read()
    assert "draining: 6 request(s) in flight" in log and "drained, stopping" in log, log[-2000:]


def start_a_long_request(port) -> dict:
    """A long request that the server stops before it ends; returns once the engine runs it. The dict gets
    "answer" (status, headers, body) once the request ends, or "error" if its connection broke."""
    result = {}

    def send():
        try:
            result["answer"] = call(port, "POST", "/v1/chat/completions", chat("Tell me everything", max_tokens=480))
        except (OSError, http.client.HTTPException) as e:
            result["error"] = repr(e)
    threading.Thread(target=send, daemon=True).start()
    wait_until(lambda: running(port) == 1)
    return result


def assert_cut_with_an_error(result):
    """A request the stopping server cut short got a whole error answer (never a half-written one)."""
    wait_until(lambda: result, timeout=10)
    assert "error" not in result, result
    status, _, body = result["answer"]
    assert status >= 500 and "the engine was closed" in json.loads(body)["error"]["message"], (status, body)


def test_a_second_sigterm_stops_at_once():
    proc, port = start_cli("--drain-timeout", "600")
    try:
        result = start_a_long_request(port)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: call(port, "GET", "/health")[0] == 503, timeout=10)
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)                     # far before 480 tokens, or the 600 s drain
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_cut_with_an_error(result)


def test_drain_timeout_bounds_the_wait():
    proc, port = start_cli("--drain-timeout", "0.5")
    try:
        result = start_a_long_request(port)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert time.monotonic() - start < 15
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_cut_with_an_error(result)
    assert "--drain-timeout passed with 1 request(s) in flight" in proc.stderr.read()


def test_an_idle_server_exits_0_at_once_on_sigterm():
    proc, port = start_cli()
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0 and time.monotonic() - start < 10


def test_a_bad_drain_timeout_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, str(ROOT / "pocketllm.py"), "--drain-timeout", "-1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "pocketllm: error: --drain-timeout must be >= 0 seconds (got -1)"]


# In process: LLM.close(drain=True), and the probes of a dead engine.

@pytest.fixture(scope="module")
def llm():
    return pocketllm.LLM(None, backend="torch", quiet=True, max_batch_size=4, max_context=512)


def test_llm_close_drain_finishes_queued_and_running_requests_and_refuses_new_ones():
    llm = pocketllm.LLM(None, backend="torch", quiet=True, max_batch_size=2, max_context=512)
    params = lambda: pocketllm.SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)   # noqa: E731
    streams = [llm.submit(llm.tokenizer.encode(f"request {i}"), params()) for i in range(5)]   # 3 of 5 queue
    closer = threading.Thread(target=lambda: setattr(closer, "result", llm.close(drain=True, timeout=120)))
    closer.start()
    wait_until(lambda: llm.draining)
    with pytest.raises(pocketllm.RequestError, match="draining") as refused:
        llm.submit(llm.tokenizer.encode("late"), params())
    assert refused.value.status == 503 and refused.value.code == "draining"
    for stream in streams:
        assert sum(len(ev.token_ids) for ev in stream) == 40
    closer.join(120)
    assert closer.result is True


def test_llm_close_drain_timeout_cuts_what_is_left():
    llm = pocketllm.LLM(None, backend="torch", quiet=True, max_batch_size=2, max_context=2048)
    stream = llm.submit(llm.tokenizer.encode("long"), pocketllm.SamplingParams(max_tokens=2000, ignore_eos=True))
    assert llm.close(drain=True, timeout=0.2) is False
    with pytest.raises(pocketllm.PocketError, match="closed"):
        list(stream)


def test_probes_after_an_engine_fault(llm):
    server = pocketllm.serve(llm, port=0, block=False, log_requests=False)
    try:
        assert call(server.port, "GET", "/health")[:1] == (200,)
        assert json.loads(call(server.port, "GET", "/live")[2]) == {"status": "alive"}
        llm.dead_reason = "RuntimeError: a test fault"
        for path in ("/health", "/live"):
            status, _, body = call(server.port, "GET", path)
            assert status == 503 and json.loads(body)["error"]["code"] == "engine_dead", body
    finally:
        llm.dead_reason = None
        server.shutdown()


def test_an_error_answer_is_written_while_its_request_still_counts_in_flight(llm, monkeypatch):
    """A stopping server exits once no request is in flight; a request that fails (a bad field here, the engine
    closed under it in a drain past --drain-timeout) must still count until its error is written, or the process
    can exit before the client reads it (RemoteDisconnected)."""
    server = pocketllm.serve(llm, port=0, block=False, log_requests=False)
    counted, send = [], pocketllm.Handler.send_error_response
    monkeypatch.setattr(pocketllm.Handler, "send_error_response",
                        lambda self, e: (counted.append(self.server.in_flight), send(self, e))[1])
    try:
        status, _, body = call(server.port, "POST", "/v1/chat/completions", chat("Hi", -1))
        assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens", body
        assert counted == [1]
    finally:
        server.shutdown()


def test_while_loading_the_probes_answer_and_everything_else_is_503():
    """The CLI listens before the weights load (open_server): /health 503 loading, /live 200, the rest 503."""
    args = pocketllm.parse_command_line(["--port", "0"])
    server = pocketllm.open_server(args)
    try:
        status, headers, body = call(server.port, "GET", "/health")
        assert (status, json.loads(body), headers["retry-after"]) == (503, {"status": "loading"}, "1")
        assert call(server.port, "GET", "/live")[:1] == (200,)
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/metrics")):
            status, headers, body = call(server.port, method, path, {} if method == "POST" else None)
            assert status == 503 and headers["retry-after"] == "1", body
            assert json.loads(body)["error"]["code"] == "loading"
        server.phase = "warming up"
        assert json.loads(call(server.port, "GET", "/health")[2]) == {"status": "warming up"}
    finally:
        server.shutdown()


def test_the_cli_answers_probes_before_it_is_ready():
    """Polled from the start, /health says 503 (loading or warming up) or 200, never anything else, and the
    address line comes once it says 200."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "pocketllm.py"), "--port", str(port), "--device", "cpu",
                             "--max-context", "512"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=ROOT)
    try:
        seen = []
        while not seen or seen[-1] != (200, {"status": "ok"}):
            try:
                status, _, body = call(port, "GET", "/health", timeout=10)
                seen.append((status, json.loads(body)))
            except ConnectionRefusedError:
                assert proc.poll() is None
                time.sleep(0.02)
        assert all(s in ((503, {"status": "loading"}), (503, {"status": "warming up"})) for s in seen[:-1]), seen
        assert "serving 'pocket-tiny'" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
