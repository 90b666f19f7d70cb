"""The chat page at `/` (issue 26) in a real browser: headless Chromium (Debian's `chromium` package, which
`.ci/run` installs) driven by playwright's Python package, against pocket-tiny served by the real engine on
port 0. Answers at temperature 0 are compared with the same request body sent to the engine without a browser;
the stop button is checked on the server's side (running count, KV blocks, tokens generated).

The tool conversation's screenshot is saved as build/chat.png (docs/chat.png is a copy of one).
"""

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from playwright.sync_api import sync_playwright

import pocketllm

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
KEY = "page-key"
WEATHER = "What is the weather in Paris for the next 3 days?"


@pytest.fixture(scope="module")
def llm():
    return pocketllm.LLM(None, backend="torch", quiet=True, max_batch_size=8, max_context=4096)


@pytest.fixture(scope="module")
def server(llm):
    srv = pocketllm.serve(llm, port=0, block=False, log_requests=False)
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def keyed_server(llm):
    srv = pocketllm.serve(llm, port=0, block=False, api_key=KEY, log_requests=False)
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium package (apt-get install -y chromium; .ci/run installs it)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM))
        yield chromium
        chromium.close()


class Tab:
    """One browser page on the chat page, recording console errors, every URL asked for and each chat body."""

    def __init__(self, browser, server):
        self.base = f"http://127.0.0.1:{server.port}"
        self.page = browser.new_page(viewport={"width": 1200, "height": 780}, accept_downloads=True)
        self.page.set_default_timeout(60_000)
        self.errors, self.urls, self.chats = [], [], []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", self._request)
        self.page.goto(self.base + "/")
        # Every text node put into the conversation, in order: the states a streamed answer went through.
        self.page.evaluate("""() => { window.shown = [];
            new MutationObserver(records => records.forEach(r => r.addedNodes.forEach(n => {
                if (n.nodeType === Node.TEXT_NODE) window.shown.push([n.parentNode.className, n.data]); })))
              .observe(document.getElementById("log"), {subtree: true, childList: true}); }""")

    def _request(self, request) -> None:
        self.urls.append(request.url)
        if request.url.endswith("/v1/chat/completions"):
            self.chats.append((request.post_data_json, request.headers.get("authorization")))

    def set(self, selector: str, value: str) -> None:
        self.page.fill(selector, value)

    def send(self, text: str) -> None:
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")
        self.wait_idle()

    def wait_idle(self) -> None:
        self.page.wait_for_selector("#send", state="visible")

    def last_answer(self):
        return self.page.locator(".turn.assistant").last

    def text(self, selector: str) -> str:
        return self.page.locator(selector).last.text_content()

    def export(self) -> list[dict]:
        with self.page.expect_download() as download:
            self.page.click("#export")
        return json.loads(Path(download.value.path()).read_text())

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def open_tab(browser):
    tabs = []

    def open_(server) -> Tab:
        tabs.append(Tab(browser, server))
        return tabs[-1]
    yield open_
    for tab in tabs:
        tab.close()


def reference(llm, body: dict) -> dict:
    """The message the engine gives for the page's request body, asked without a browser or a stream."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return pocketllm.chat_completions(llm, body)["choices"][0]["message"]


def server_error(server, body: dict, key: str | None = None) -> str:
    """The error the server writes for a chat body, in the page's words: 'status type: message (param: p)'."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=60)
    e = json.loads(error.value.read())["error"]
    return f"{error.value.code} {e['type']}: {e['message']}" + (f" (param: {e['param']})" if e["param"] else "")


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_page_is_one_self_contained_document_served_without_the_key(keyed_server):
    """GET / needs no key (every API endpoint still does), is HTML with no address of anything elsewhere, and
    carries a policy that lets it reach its own server only."""
    base = f"http://127.0.0.1:{keyed_server.port}"
    with urllib.request.urlopen(base + "/", timeout=30) as response:
        page = response.read().decode()
        assert response.headers["Content-Type"] == "text/html; charset=utf-8"
        assert response.headers["Content-Security-Policy"].startswith("default-src 'self';")
    assert page == pocketllm.CHAT_PAGE and page.startswith("<!doctype html>")
    assert "http:" not in page and "https:" not in page and "//" not in page.replace("// ", "")
    assert len(page) < 20_000
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(base + "/v1/models", timeout=30)
    assert error.value.code == 401


@pytest.mark.parametrize("host, url", [("127.0.0.1", "http://127.0.0.1:8000/"), ("0.0.0.0", "http://127.0.0.1:8000/"),
                                       ("::", "http://[::1]:8000/"), ("::1", "http://[::1]:8000/"),
                                       ("example.lan", "http://example.lan:8000/")])
def test_the_page_address_is_one_a_browser_opens(host, url):
    assert pocketllm._chat_page_url(host, 8000) == url


def test_the_start_up_log_prints_the_page_address():
    """`python pocketllm.py --host 0.0.0.0 --port 0`: the second line is the page's address, which serves it."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "pocketllm.py"), "--host", "0.0.0.0", "--port", "0",
                             "--quiet", "--max-context", "128"], stdout=subprocess.PIPE, text=True)
    try:
        serving, page = proc.stdout.readline(), proc.stdout.readline()
        assert serving.startswith("pocketllm: serving 'pocket-tiny' on http://0.0.0.0:"), serving
        port = serving.strip().rsplit(":", 1)[1]
        assert page == f"pocketllm: chat page at http://127.0.0.1:{port}/\n"
        with urllib.request.urlopen(page.split(" at ")[1].strip(), timeout=30) as response:
            assert response.read().decode() == pocketllm.CHAT_PAGE
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_chat_streams_turn_after_turn_with_reasoning_folded(server, llm, open_tab):
    """Two turns at temperature 0: each answer grows on the page chunk by chunk to exactly the engine's answer,
    reasoning apart and folded; the second request replays the first turn; figures and server state show; no
    console error, and the browser asked nothing of any other origin."""
    tab = open_tab(server)
    tab.set("#temperature", "0")
    tab.send("Hello!")
    tab.send("What is 4 plus 3?")
    first, second = (body for body, _ in tab.chats)
    answers = tab.page.locator(".turn.assistant")
    for i, body in enumerate((first, second)):
        want = reference(llm, body)
        answer = answers.nth(i)
        assert answer.locator(":scope > .text").text_content() == want["content"]
        reasoning = answer.locator("details.reasoning")
        assert reasoning.locator(".text").text_content() == want["reasoning_content"]
        assert reasoning.evaluate("d => d.open") is False
    first_answer = reference(llm, first)["content"]
    assert second["messages"] == [{"role": "user", "content": "Hello!"},
                                  {"role": "assistant", "content": first_answer},
                                  {"role": "user", "content": "What is 4 plus 3?"}]
    assert first["chat_template_kwargs"] == {"enable_thinking": True} and first["temperature"] == 0
    assert first["tools"][0]["function"]["name"] == "get_weather" and first["stream"] is True
    shown = [text for kind, text in tab.page.evaluate("window.shown") if kind == "text"]
    states = [t for t in shown if first_answer.startswith(t) and t]
    assert len(set(states)) >= 3 and states[-1] == first_answer, shown      # streamed in pieces, in order
    assert all(a.startswith(b) for a, b in zip(states[1:], states)), states
    tab.page.wait_for_function("() => document.getElementById('server').textContent.startsWith('running 0')")
    assert "KV blocks 0/" in tab.text("#server")
    assert tab.page.locator("#figures").text_content().startswith("first token ")
    assert " tokens/s · " in tab.text("#figures") and tab.text("#model") == llm.model_name
    answers.first.locator("summary").click()
    assert answers.first.locator("details.reasoning").evaluate("d => d.open") is True
    assert tab.errors == [] and all(url.startswith(tab.base + "/") for url in tab.urls), (tab.errors, tab.urls)


def test_thinking_off_and_a_new_chat(server, llm, open_tab):
    """The thinking switch sends enable_thinking false: no reasoning comes or shows. New chat starts clean; an
    answer cut by max tokens says so."""
    tab = open_tab(server)
    tab.set("#temperature", "0")
    tab.page.uncheck("#thinking")
    tab.send("Hello!")
    body, _ = tab.chats[-1]
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    want = reference(llm, body)
    assert "reasoning_content" not in want and tab.page.locator("details.reasoning").count() == 0
    assert tab.text(".turn.assistant > .text") == want["content"]
    tab.page.click("#new")
    assert tab.page.locator("#log > *").count() == 0 and tab.export() == []
    tab.set("#max-tokens", "3")
    tab.send("Who wrote Hamlet?")
    body, _ = tab.chats[-1]
    assert body["messages"] == [{"role": "user", "content": "Who wrote Hamlet?"}] and body["max_tokens"] == 3
    assert tab.text(".turn.assistant > .text") == reference(llm, body)["content"]
    assert tab.text(".turn.assistant .note") == "cut at the max tokens (finish_reason length)"
    assert tab.errors == []


def test_the_weather_question_gives_a_call_card_and_a_typed_result_an_answer(server, llm, open_tab):
    """The pre-filled get_weather tool: pocket-tiny calls it; the card shows the name and arguments as they
    stream; the result box is pre-filled; a typed result continues the conversation to an answer that states
    it. The export is the messages list, which an OpenAI client sends as it is."""
    tab = open_tab(server)
    tab.set("#temperature", "0")
    tab.set("#system", "You are a helpful assistant.")
    tab.send(WEATHER)
    card = tab.page.locator(".call")
    assert card.locator(".name").text_content() == "get_weather"
    assert json.loads(card.locator("pre").text_content()) == {"city": "Paris", "days": 3}
    arguments = [text for kind, text in tab.page.evaluate("window.shown") if kind == "" and text]
    assert len(arguments) >= 2 and arguments[-1] == card.locator("pre").text_content(), arguments
    prefilled = json.loads(card.locator("textarea").input_value())
    assert prefilled["city"] == "Paris" and prefilled["days"] == 3 and "forecast" in prefilled
    result = '{"city": "Paris", "days": 3, "forecast": "rainy", "high_c": 14}'
    card.locator("textarea").fill(result)
    card.locator("button").click()
    tab.wait_idle()
    body, _ = tab.chats[-1]
    call = body["messages"][2]["tool_calls"][0]
    assert body["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    assert body["messages"][3] == {"role": "tool", "tool_call_id": call["id"], "content": result}
    final = tab.text(".turn.assistant > .text")
    assert final == reference(llm, body)["content"] and "rainy" in final and "14" in final
    exported = tab.export()
    assert exported == body["messages"] + [{"role": "assistant", "content": final}]
    client = openai.OpenAI(base_url=tab.base + "/v1", api_key="none", max_retries=0, timeout=120)
    replay = client.chat.completions.create(model=llm.model_name, messages=exported, tools=body["tools"],
                                            max_tokens=40)
    assert replay.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tab.page.wait_for_function("() => document.getElementById('server').textContent.startsWith('running 0')")
    (ROOT / "build").mkdir(exist_ok=True)
    tab.page.locator("details.reasoning").first.locator("summary").click()
    tab.page.screenshot(path=str(ROOT / "build" / "chat.png"))
    assert tab.errors == [] and all(url.startswith(tab.base + "/") for url in tab.urls), (tab.errors, tab.urls)


def test_the_page_starts_from_the_servers_generation_defaults(server, llm, open_tab):
    """pocket-tiny's generation_config.json asks for greedy decoding: the page's temperature starts there, each
    default says where it comes from, and the suggested prompt, sent as the page starts, gets its call."""
    card = json.load(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=30))["data"][0]
    defaults = card["generation_defaults"]
    assert defaults["temperature"] == {"value": 0.0, "from": "generation_config.json"}
    assert defaults["top_p"] == {"value": 1.0, "from": "pocketllm"}
    tab = open_tab(server)
    tab.page.wait_for_function("() => document.getElementById('temperature').value !== ''")
    assert tab.page.input_value("#temperature") == "0"
    shown = tab.text("#defaults")
    assert "temperature 0 (generation_config.json)" in shown and "top_p 1 (pocketllm)" in shown, shown
    tab.send(WEATHER)
    body, _ = tab.chats[-1]
    assert body["temperature"] == 0
    assert tab.page.locator(".call .name").text_content() == "get_weather"
    assert tab.errors == [], tab.errors


def test_stop_aborts_a_long_answer_and_the_server_frees_it(server, llm, open_tab):
    """A long answer (ignore_eos through the extra fields, 3000 max tokens, temperature 1: seconds even at the CPU's
    fastest decode, so the click lands while it runs): stop aborts the fetch, the server sees the disconnect and
    frees the request (running 0, no KV block held) well before 3000 tokens; the page says it stopped, keeps the
    partial answer, and its server line shows running 0."""
    tab = open_tab(server)
    tab.set("#temperature", "1")
    tab.set("#max-tokens", "3000")
    tab.set("#extra", '{"ignore_eos": true}')
    tab.page.uncheck("#thinking")                    # the answer itself starts at once
    before = llm.stats()["generation_tokens_total"]
    tab.page.fill("#input", "Tell me a very long story.")
    tab.page.press("#input", "Enter")
    tab.page.wait_for_function("() => document.querySelector('.error') || "
                               "document.querySelector('.turn.assistant > .text')")
    assert tab.page.locator(".error").count() == 0 and llm.stats()["running"] == 1
    tab.page.click("#stop")
    tab.wait_idle()
    assert tab.text(".turn.assistant .note") == "stopped"
    shown = tab.text(".turn.assistant > .text")          # what came before the stop stays in the conversation
    assert tab.export() == [{"role": "user", "content": "Tell me a very long story."},
                            {"role": "assistant", "content": shown}]
    # Freed by the abort, not by running out of tokens (the next line); a loaded machine may take its time.
    wait_until(lambda: llm.stats()["running"] == 0 and llm.stats()["kv_blocks_used"] == 0, timeout=120)
    assert llm.stats()["generation_tokens_total"] - before < 3000
    assert tab.chats[-1][0]["ignore_eos"] is True and tab.chats[-1][0]["max_tokens"] == 3000
    tab.page.wait_for_function("() => document.getElementById('server').textContent.startsWith('running 0')")
    assert tab.errors == []


def test_errors_show_as_the_server_wrote_them(server, llm, open_tab):
    """A 400 shows the server's type, message and param; bad JSON in a panel is named; a server that went
    away shows a failed connection. The page never goes blank: the conversation stays."""
    tab = open_tab(server)
    tab.set("#temperature", "3")
    tab.send("Hello!")
    body, _ = tab.chats[-1]
    assert tab.text(".error") == server_error(server, body)
    assert "temperature" in tab.text(".error") and tab.text(".turn.user .text") == "Hello!"
    tab.set("#temperature", "0")
    tab.set("#extra", "{top_p: 1}")
    tab.send("Hello!")
    assert tab.text(".error").startswith("more request fields: not valid JSON")
    short_lived = pocketllm.serve(llm, port=0, block=False, socket_timeout=0.5, log_requests=False)
    gone = open_tab(short_lived)
    short_lived.shutdown()
    time.sleep(2.0)                                  # idle keep-alive connections time out and close
    gone.send("Hello!")
    assert gone.text(".error").startswith("the connection to the server failed")
    assert gone.page.locator(".turn.user").count() == 1


def test_an_error_event_mid_stream_shows_after_the_partial_answer(browser, open_tab):
    """The engine stops while an answer streams: the server's error event (the one /health then reports) shows
    under the text that came before it."""
    dying = pocketllm.LLM(None, backend="torch", quiet=True, max_batch_size=2, max_context=1024)
    srv = pocketllm.serve(dying, port=0, block=False, log_requests=False)
    try:
        tab = open_tab(srv)
        tab.page.uncheck("#thinking")
        tab.set("#max-tokens", "800")
        tab.set("#extra", '{"ignore_eos": true}')
        tab.page.fill("#input", "Tell me a very long story.")
        tab.page.press("#input", "Enter")
        tab.page.wait_for_selector(".turn.assistant > .text")
        dying.close()
        tab.wait_idle()
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(tab.base + "/health", timeout=30)
        e = json.loads(health.value.read())["error"]
        assert tab.text(".error") == f"{e['type']}: {e['message']}" and "closed" in e["message"]
        assert tab.text(".turn.assistant > .text")
    finally:
        srv.shutdown()


def test_api_key_field(keyed_server, llm, open_tab):
    """With --api-key the page loads without the key and shows the server's 401; a wrong key shows the
    server's error; the right key is sent as a Bearer token on every call and the chat works."""
    tab = open_tab(keyed_server)
    tab.page.wait_for_function("() => document.getElementById('model').textContent.startsWith('401')")
    missing = server_error(keyed_server, {"messages": [{"role": "user", "content": "Hi"}]})
    assert tab.text("#model") == missing and missing.startswith("401 authentication_error: missing API key")
    tab.set("#temperature", "0")
    tab.set("#key", "wrong")
    tab.send("Hello!")
    assert tab.text(".error") == server_error(keyed_server, tab.chats[-1][0], key="wrong")
    assert tab.text(".error") == "401 authentication_error: invalid API key"
    tab.set("#key", KEY)
    tab.send("Hello!")
    body, authorization = tab.chats[-1]
    assert authorization == f"Bearer {KEY}"
    assert tab.text(".turn.assistant > .text") == reference(llm, body)["content"]
    tab.page.wait_for_function("() => document.getElementById('server').textContent.startsWith('running')")
