"""Tests of the acceptance harness tests/verify_openai.py, run against the real server and pocket-tiny on CPU.

The CI run: every check passes with the published clients installed in a throwaway virtualenv and
--require-tool-clients. The controls: missing clients are NOT RUN (exit 0) unless required (exit 1, named);
a server that fails to start, a check that fails and a SIGTERM to the script each give a non-zero exit code
and leave no process of the server group behind.
"""

import ast
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "verify_openai.py"
sys.path.insert(0, str(HERE))
import verify_openai  # noqa: E402  (the script under test, importable because main() sits behind a guard)

ALL_CHECKS = list(verify_openai.CHECKS)


# Helpers: run the script, find what it left behind.

def run_script(*flags: str, env: dict | None = None, timeout: float = 900) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True,
                          timeout=timeout, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def server_group(output: str) -> int:
    match = re.search(r"server: pid (\d+), process group (\d+)", output)
    assert match, f"the script did not report the server's process group:\n{output}"
    return int(match.group(2))


def live_processes(pgid: int, marker: str | None = None) -> list[str]:
    """Non-zombie processes in the server's group, or with `marker` on their command line (read from /proc).
    Other projects' servers may run on this machine, so the marker must be unique to the test."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, _, group = stat[stat.rindex(")") + 2:].split()[:3]
        if state != "Z" and (int(group) == pgid or (marker and marker in cmdline)):
            found.append(f"{entry}: {cmdline.strip()}")
    return found


def last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


def venv_python(path: Path) -> Path:
    return path / "bin" / "python"


def env_without_pythonpath() -> dict:
    """The harness's environment minus PYTHONPATH, so a bare client virtualenv cannot borrow packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def clients_python(tmp_path_factory) -> Path:
    """An interpreter with the published clients: this one when requirements-test.txt installed them, else a
    virtualenv made for this run in its own temporary directory (skipped, saying why, without the network)."""
    probe = "import openai, langchain_openai"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        return Path(sys.executable)
    venv = tmp_path_factory.mktemp("clients-venv")
    python = venv_python(venv)
    made = subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a virtualenv at {venv}: {made.stderr.strip()[-300:]}")
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "openai", "langchain-openai"],
                         capture_output=True, text=True, timeout=900)
    if pip.returncode != 0:
        pytest.skip(f"the clients are not installed (requirements-test.txt) and pip cannot install them "
                    f"(no network?): {pip.stderr.strip()[-300:]}")
    return python


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bare-venv")
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a virtualenv at {path}: {made.stderr.strip()[-300:]}")
    python = venv_python(path)
    for module in ("openai", "langchain_openai"):
        probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, env=env_without_pythonpath())
        assert probe.returncode != 0, f"the bare virtualenv can import {module}; the control would prove nothing"
    return python


# The script itself: standard library only, and strict about server-sent events.

def test_script_imports_only_the_standard_library():
    tree = ast.parse(SCRIPT.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            modules.add(node.module.split(".")[0])
    assert modules, "no import found: the AST walk is broken"
    assert modules <= sys.stdlib_module_names, f"not in the standard library: {modules - sys.stdlib_module_names}"


class FakeResponse(io.BytesIO):
    """What read_sse needs of an http.client response: readline()."""


@pytest.mark.parametrize("body, problem", [
    (b'data: {"a": 1}\n\ndata: [DONE]\n\n', None),
    (b': keep-alive\n\ndata: {"a": 1}\n\ndata: [DONE]\n\n', None),
    (b'data: {"a": 1}\n\n', "without data: [DONE]"),
    (b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"a": 2}\n\n', "data after [DONE]"),
    (b'data: {"a": 1}\nbogus\n\ndata: [DONE]\n\n', "malformed SSE line"),
    (b'data: {"a": \n\ndata: [DONE]\n\n', "not JSON"),
    (b'data: {"a": 1}', "inside an event"),
    (b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n', "error event"),
])
def test_sse_reader_refuses_malformed_streams(body, problem):
    if problem is None:
        assert verify_openai.read_sse(FakeResponse(body)) == [{"a": 1}]
    else:
        with pytest.raises(verify_openai.CheckFailed, match=re.escape(problem)):
            verify_openai.read_sse(FakeResponse(body))


# End to end against pocket-tiny on CPU.

def test_all_checks_pass_against_pocket_tiny_with_clients(clients_python, tmp_path):
    code, out = run_script("--client-python", str(clients_python), "--require-tool-clients", "--strict-arguments",
                           "--log-dir", str(tmp_path / "logs"))
    pgid = server_group(out)
    assert code == 0, out
    for name in ALL_CHECKS:
        assert f"[PASS] {name}:" in out, f"{name} did not pass:\n{out}"
    assert "clients: openai PASS, langchain-openai PASS" in out, out
    assert last_line(out) == f"{len(ALL_CHECKS)} passed, 0 failed", out
    assert (tmp_path / "logs" / "server.log").read_text(), "--log-dir kept no server log"
    assert not live_processes(pgid)


@pytest.mark.parametrize("require", [False, True])
def test_missing_clients_are_not_run_unless_required(bare_python, require, tmp_path):
    flags = ["--client-python", str(bare_python), "--checks", "models,client_openai,client_langchain"]
    code, out = run_script(*flags, *(["--require-tool-clients"] if require else []), env=env_without_pythonpath())
    pgid = server_group(out)
    if require:
        assert code == 1, out
        assert "[FAIL] client_openai:" in out and "[FAIL] client_langchain:" in out, out
        assert "missing tool clients: openai, langchain-openai" in out, out
        assert last_line(out) == "1 passed, 2 failed", out
    else:
        assert code == 0, out
        assert "[NOT RUN] client_openai: openai is not usable" in out, out
        assert "[NOT RUN] client_langchain: langchain-openai is not usable" in out, out
        assert "clients: openai NOT RUN, langchain-openai NOT RUN" in out, out
        assert last_line(out) == "1 passed, 0 failed, 2 not run", out
    assert not live_processes(pgid)


def test_server_that_fails_to_start_fails_and_leaves_nothing(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    code, out = run_script("--ckpt", str(missing), "--startup-timeout", "300")
    pgid = server_group(out)
    assert code == 1, out
    assert "[FAIL] server_start: the server exited" in out, out
    assert "    | " in out, f"no server log tail:\n{out}"
    assert last_line(out) == "0 passed, 1 failed", out
    assert not live_processes(pgid, marker=str(missing))


def test_failing_check_fails_the_run_and_leaves_nothing():
    code, out = run_script("--checks", "models,refusals", "--expect-model-name", "not-the-served-model")
    pgid = server_group(out)
    assert code == 1, out
    assert "[FAIL] models: served models" in out and "[PASS] refusals:" in out, out
    assert last_line(out) == "1 passed, 1 failed", out
    assert not live_processes(pgid)


def test_sigterm_to_the_script_stops_the_server_group():
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--checks", "models"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:                  # the server is still importing torch when this line appears
        lines.append(line)
        if line.startswith("server: pid"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "[FAIL] interrupted: SIGTERM" in out, out
    assert not live_processes(server_group(out))
