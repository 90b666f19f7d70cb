"""One failing request fails alone; an engine-wide fault fails every request at once, queued ones included.
Faults are injected into the real engine on a real (random tiny) checkpoint; afterwards every KV block and
state slot must be free."""

import http.client
import json
import threading
import time

import pytest

import pocketllm

PROMPTS = [[5 + (i * 7 + j * 13) % 380 for j in range(3 + 4 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def path(ckpt_factory):
    return ckpt_factory("qwen3_5")[0]


def make(path, **opts):
    return pocketllm.LLM(path, **{"backend": "torch", "quiet": True, "max_context": 128, "max_batch_size": 4,
                                  **opts})


def tokens(stream):
    return [t for ev in stream for t in ev.token_ids]


def assert_all_free(llm, timeout=10.0):
    deadline = time.monotonic() + timeout
    while llm.stats()["running"] or llm.stats()["waiting"] or llm.engine.requests:
        assert time.monotonic() < deadline, llm.stats()
        time.sleep(0.02)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and set(llm.engine.blocks.refs) <= {0}
    assert stats["slots_used"] == 0 and sorted(llm.engine.slots.free) == list(range(stats["slots_total"]))


def raising_after(calls):
    seen = []

    def proc(ids, logits):
        seen.append(len(ids))
        if len(seen) > calls:
            raise ValueError("injected processor fault")
        return logits
    return proc


def test_a_raising_logits_processor_fails_only_its_request(path):
    llm = make(path)
    try:
        kw = dict(max_tokens=10, temperature=0, ignore_eos=True)
        alone = [tokens(llm.submit(p, pocketllm.SamplingParams(**kw))) for p in PROMPTS]
        streams = [llm.submit(p, pocketllm.SamplingParams(**kw, n=2 if i == 1 else 1,
                                                          logits_processors=[raising_after(3)] if i == 1 else []))
                   for i, p in enumerate(PROMPTS)]
        for i, s in enumerate(streams):
            if i == 1:
                with pytest.raises(pocketllm.RequestFailed, match="injected processor fault") as e:
                    tokens(s)
                assert s.request_id in str(e.value) and "logits processor" in str(e.value)
            else:
                assert tokens(s) == alone[i]             # the batch went on, undisturbed
        assert llm.dead_reason is None
        assert_all_free(llm)
        assert tokens(llm.submit(PROMPTS[0], pocketllm.SamplingParams(**kw))) == alone[0]
    finally:
        llm.close()


def test_a_request_the_validators_let_through_fails_alone(path):
    llm = make(path)
    try:
        bad = pocketllm.Request("bad", PROMPTS[0], pocketllm.SamplingParams(logit_bias={10 ** 9: 1.0}), 0)
        llm.submit(PROMPTS[1], pocketllm.SamplingParams(max_tokens=2))     # starts the engine thread
        llm.engine.add(bad)
        llm.wake()
        with pytest.raises(pocketllm.RequestFailed, match="logit_bias"):
            tokens(pocketllm.RequestStream(llm, bad))
        assert llm.dead_reason is None
        assert len(tokens(llm.submit(PROMPTS[2], pocketllm.SamplingParams(max_tokens=3)))) == 3
        assert_all_free(llm)
    finally:
        llm.close()


class ForwardFault:
    """run_batch that holds its first call until released, then raises as a sticky CUDA error would."""

    def __init__(self, engine):
        self.entered, self.release = threading.Event(), threading.Event()
        engine.run_batch = self

    def __call__(self, batch):
        self.entered.set()
        assert self.release.wait(30)
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


def test_a_forward_fault_fails_every_request_including_queued_ones(path):
    llm = make(path)
    server = llm.serve(port=0, block=False, log_requests=False)
    try:
        fault = ForwardFault(llm.engine)
        running = llm.submit(PROMPTS[0], pocketllm.SamplingParams(max_tokens=5))
        assert fault.entered.wait(30)
        queued = [llm.submit(p, pocketllm.SamplingParams(max_tokens=5, n=2)) for p in PROMPTS[1:]]   # in the inbox
        answers = {}

        def post(name, body):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps(body))
            resp = conn.getresponse()
            answers[name] = (resp.status, resp.read().decode())
        threads = [threading.Thread(target=post, args=("plain", {"prompt": "hi", "max_tokens": 4})),
                   threading.Thread(target=post, args=("stream", {"prompt": "hi", "max_tokens": 4, "stream": True}))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while llm.engine.inbox.qsize() < len(queued) + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        fault.release.set()
        for s in [running, *queued]:
            with pytest.raises(pocketllm.PocketError, match="illegal memory access"):
                tokens(s)
        for t in threads:
            t.join(30)
        status, body = answers["plain"]
        assert status == 503 and "illegal memory access" in json.loads(body)["error"]["message"]
        status, body = answers["stream"]
        events = [e[e.index("data: ") + 6:] for e in body.split("\n\n") if "data: " in e]
        assert status == 200 and events[-1] == "[DONE]"         # the error as an SSE event, then [DONE]
        assert "illegal memory access" in json.loads(events[-2])["error"]["message"]
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 503 and "illegal memory access" in resp.read().decode()
        with pytest.raises(pocketllm.PocketError, match="illegal memory access"):
            llm.submit(PROMPTS[0], pocketllm.SamplingParams(max_tokens=2))
        assert_all_free(llm)
    finally:
        server.shutdown()
        llm.close()


def test_the_engine_thread_starts_once(path):
    llm = make(path)
    try:
        started = []
        original = threading.Thread.start

        def spy(self):
            if self.name == "pocketllm-engine":
                started.append(self)
            original(self)
        threading.Thread.start = spy
        try:
            barrier = threading.Barrier(8)

            def submit():
                barrier.wait()
                tokens(llm.submit(PROMPTS[0], pocketllm.SamplingParams(max_tokens=2)))
            threads = [threading.Thread(target=submit) for _ in range(8)]
            for t in threads:
                original(t)
            for t in threads:
                t.join(60)
        finally:
            threading.Thread.start = original
        assert len(started) == 1
    finally:
        llm.close()


def test_over_http_a_parsing_fault_is_a_500_for_that_request_only(path, monkeypatch):
    """The chat output parser raises (injected) for chat requests; completions requests, which have none,
    run beside them. The chat ones end with a 500 naming their id (a stream: an error event, then [DONE]);
    the server stays healthy and every block and slot comes back."""
    llm = make(path, max_context=256)
    server = llm.serve(port=0, block=False, log_requests=False)

    def broken_feed(self, text):
        raise KeyError("injected parser fault")
    monkeypatch.setattr(pocketllm.ChatOutputParser, "feed", broken_feed)
    answers = {}

    def post(name, route, body):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", route, json.dumps(body))
        resp = conn.getresponse()
        answers[name] = (resp.status, resp.read().decode())
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 1.0}
    jobs = {"chat": ("/v1/chat/completions", chat), "chat_stream": ("/v1/chat/completions", {**chat, "stream": True}),
            "plain": ("/v1/completions", {"prompt": "hello", "max_tokens": 6, "temperature": 1.0,
                                          "ignore_eos": True})}
    try:
        threads = [threading.Thread(target=post, args=(name, *job)) for name, job in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        status, body = answers["chat"]
        error = json.loads(body)["error"]
        assert status == 500 and error["code"] == "request_failed" and "chatcmpl-" in error["message"]
        assert "injected" not in error["message"]                     # the cause is in the server log only
        status, body = answers["chat_stream"]
        events = [e[e.index("data: ") + 6:] for e in body.split("\n\n") if "data: " in e]
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_failed"
        status, body = answers["plain"]
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 6
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200 and llm.dead_reason is None
        assert_all_free(llm)
    finally:
        server.shutdown()
        llm.close()


def test_a_fault_in_the_mtp_pass_fails_the_requests_that_finished_in_its_step_and_frees_them(ckpt_factory):
    """With speculation a sequence that finishes in a step keeps what it holds until the step's MTP pass, and the
    step's copies wait for it (Engine.finishing, Engine.held): a fault in that pass still ends every request, those
    finished in the step included, with the error, and frees every block and slot."""
    llm = make(ckpt_factory("qwen3_5", mtp=True)[0], speculative_tokens=2, dtype="float32")
    try:
        assert llm.engine.draft_tokens == 2

        def draft(plan, kept):
            raise RuntimeError("injected fault in the MTP pass")
        llm.engine._draft = draft
        streams = [llm.submit(PROMPTS[1], pocketllm.SamplingParams(max_tokens=1)),      # finishes in the step
                   llm.submit(PROMPTS[2], pocketllm.SamplingParams(max_tokens=5, n=2))]  # forks in the step
        for s in streams:
            with pytest.raises(pocketllm.PocketError, match="injected fault in the MTP pass"):
                tokens(s)
        assert llm.engine.held is None and not llm.engine.finishing
        assert_all_free(llm)
    finally:
        llm.close()
