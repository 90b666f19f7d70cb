"""Hosted tools (issue 51): tools that run on the provider's side (Responses' `web_search`, which Codex CLI sends
by default; Messages' `web_search_20250305`, ...). None runs here. By default the server leaves them out: the model
never sees them (the prompt is the one without them, token for token), the response says which were left out
(the X-Pocketllm-Omitted-Tools header) and the server's log names them once per distinct tool set. With
`hosted_tools="refuse"` (the CLI's --hosted-tools refuse) they are 400 naming the tool, as before.

The bundled pocket-tiny on the CPU, over real HTTP.
"""

import http.client
import json

import pytest

import pocketllm
from fixtures.train_pocket_tiny import TOOLS

FUNCTION = {"type": "function", **TOOLS[0]["function"]}                      # get_weather(city, days)
CUSTOM = {"name": "get_weather", "description": TOOLS[0]["function"]["description"],
          "input_schema": TOOLS[0]["function"]["parameters"]}
CODEX_WEB_SEARCH = {"type": "web_search", "external_web_access": False}       # as Codex CLI 0.171 sends it
ANTHROPIC_WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
ASK = "What is the weather in Paris for 3 days?"
HEADER = "X-Pocketllm-Omitted-Tools"


@pytest.fixture(scope="module")
def llm(pocket_tiny):
    return pocket_tiny


@pytest.fixture(scope="module")
def servers(llm):
    omit = llm.serve(port=0, block=False, log_requests=True)
    refuse = llm.serve(port=0, block=False, log_requests=False, hosted_tools="refuse")
    yield omit, refuse
    omit.shutdown()
    refuse.shutdown()


def post(server, path: str, body: dict) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        return response.status, dict(response.headers), json.loads(data) if not body.get("stream") else data
    finally:
        conn.close()


def responses_body(tools, **extra):
    return {"model": "pocket-tiny", "input": ASK, "tools": tools, "max_output_tokens": 2, "temperature": 0,
            "store": False, **extra}


def messages_body(tools, **extra):
    return {"model": "pocket-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": ASK}],
            "tools": tools, **extra}


def test_responses_leave_hosted_tools_out(servers):
    omit, _ = servers
    status, headers, with_hosted = post(omit, "/v1/responses", responses_body([FUNCTION, CODEX_WEB_SEARCH]))
    assert status == 200 and headers[HEADER] == "web_search", with_hosted
    status, headers, without = post(omit, "/v1/responses", responses_body([FUNCTION]))
    assert status == 200 and HEADER not in headers
    assert with_hosted["usage"]["input_tokens"] == without["usage"]["input_tokens"]      # the same prompt
    assert [tool["name"] for tool in with_hosted["tools"]] == ["get_weather"]
    status, headers, data = post(omit, "/v1/responses", responses_body([CODEX_WEB_SEARCH, FUNCTION], stream=True))
    assert status == 200 and headers[HEADER] == "web_search" and b"event: response.incomplete" in data


def test_messages_leave_server_tools_out(servers):
    omit, _ = servers
    status, headers, with_hosted = post(omit, "/v1/messages", messages_body([ANTHROPIC_WEB_SEARCH, CUSTOM]))
    assert status == 200 and headers[HEADER] == "web_search_20250305", with_hosted
    status, headers, without = post(omit, "/v1/messages", messages_body([CUSTOM]))
    assert status == 200 and HEADER not in headers
    assert with_hosted["usage"]["input_tokens"] == without["usage"]["input_tokens"]
    counted = [post(omit, "/v1/messages/count_tokens", {"model": "pocket-tiny", "messages": messages_body([])[
        "messages"], "tools": tools})[2]["input_tokens"] for tools in ([ANTHROPIC_WEB_SEARCH, CUSTOM], [CUSTOM])]
    assert counted[0] == counted[1]


def test_only_hosted_tools_is_no_tools(servers, llm):
    omit, _ = servers
    status, headers, data = post(omit, "/v1/responses", responses_body([CODEX_WEB_SEARCH]))
    assert status == 200 and headers[HEADER] == "web_search" and data["tools"] == [] and data["tool_choice"] == "none"
    plain = post(omit, "/v1/responses", responses_body(None))[2]
    assert data["usage"]["input_tokens"] == plain["usage"]["input_tokens"]


def test_logged_once_per_tool_set(servers, capfd):
    omit, _ = servers
    capfd.readouterr()
    for _ in range(3):
        post(omit, "/v1/responses", responses_body([FUNCTION, {"type": "file_search", "vector_store_ids": ["v"]}]))
    post(omit, "/v1/responses", responses_body([{"type": "file_search"}]))
    notes = [line for line in capfd.readouterr().err.splitlines() if "left out the hosted tools" in line]
    assert len(notes) == 2 and all("file_search" in line for line in notes), notes


@pytest.mark.parametrize("path,body,param", [
    ("/v1/responses", responses_body([FUNCTION, CODEX_WEB_SEARCH]), "tools[1].type"),
    ("/v1/messages", messages_body([CUSTOM, ANTHROPIC_WEB_SEARCH]), "tools[1].type"),
    ("/v1/messages/count_tokens", {"model": "pocket-tiny", "messages": [{"role": "user", "content": ASK}],
                                   "tools": [ANTHROPIC_WEB_SEARCH]}, "tools[0].type"),
])
def test_refuse_policy_is_400_naming_the_tool(servers, path, body, param):
    _, refuse = servers
    status, headers, error = post(refuse, path, body)
    error = error["error"]
    assert status == 400 and error["param"] == param and error["code"] == "unsupported_field", error
    assert "--hosted-tools" in error["message"]


def test_cli_flag():
    parser = pocketllm.argparse.ArgumentParser()
    pocketllm.add_server_args(parser)
    assert parser.parse_args([]).hosted_tools == "omit"
    assert parser.parse_args(["--hosted-tools", "refuse"]).hosted_tools == "refuse"
    with pytest.raises(SystemExit):
        parser.parse_args(["--hosted-tools", "search"])
