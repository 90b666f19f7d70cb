"""Shared fixtures. Tests run on the CPU with one thread per process: the machines are small and shared,
and oversubscribed OpenMP threads make tiny ops hundreds of times slower."""

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import hypothesis  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import build  # noqa: E402

torch.set_num_threads(1)

# Property tests draw the same examples every run, so a red run is the same run again and no seed turns CI red by
# chance; HYPOTHESIS_PROFILE=explore draws new ones (and keeps failures in .hypothesis/) to look for more.
hypothesis.settings.register_profile("repeatable", derandomize=True, database=None)
hypothesis.settings.register_profile("explore")
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@functools.cache
def asan_missing() -> str | None:
    """Why the CPU test build of the native library (g++ -fsanitize=address) cannot be made here, or None."""
    cxx = build.find_cxx()
    if not cxx:
        return "no C++ compiler (g++ or $CXX): the CPU test build of csrc/ cannot be made"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cpp"
        src.write_text("int main() { return 0; }\n")
        made = subprocess.run([cxx, "-shared", "-fPIC", "-fsanitize=address", str(src), "-o", str(Path(d) / "p.so")],
                              capture_output=True, text=True)
    if made.returncode != 0:
        return f"{cxx} cannot build with AddressSanitizer (-fsanitize=address), which the CPU test build needs"
    return None


# Every test that needs the CPU test build gets it through build.build(cpu=True): without ASan it skips, saying why.
_build = build.build


def _build_or_skip(*args, cpu: bool = False, **kwargs):
    if cpu and asan_missing():
        pytest.skip(asan_missing())
    if not cpu and not kwargs.get("nvcc"):                   # another nvcc shares nothing with the background one
        _wait_for_background_build("cuda")
    return _build(*args, cpu=cpu, **kwargs)


build.build = _build_or_skip


def native_cpu_ops_or_skip():
    """pocketllm.NativeOps on the CPU test build, or a skip naming why the build cannot be made here."""
    import pocketllm
    try:
        build.build(cpu=True, quiet=True)
    except build.BuildError as e:
        pytest.skip(f"the native CPU test build does not build here: {str(e).splitlines()[0]}")
    return pocketllm.NativeOps("cpu")


def drain(req) -> tuple[list[list[int]], list]:
    """A finished engine Request's events: each choice's tokens, and every event's logprobs entries in order
    (an event carrying an error fails the test)."""
    tokens, logprobs = [[] for _ in range(req.params.n)], []
    while not req.events.empty():
        ev = req.events.get()
        assert ev.finish_reason != "error", ev.error
        tokens[ev.index] += ev.token_ids
        logprobs += ev.logprobs or []
    return tokens, logprobs


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


# The CUDA build (`python build.py`: sm_75, sm_90 and PTX, ~12 minutes of CPU, nearly what all the tests take) starts
# in the background as collection ends when a collected test needs it, at the lowest priority (nice 19), so it takes
# only the CPU the tests leave on CI's two cores instead of slowing every test; the tests that need it
# (tests/test_with_nvcc.py) sort last by name. build.build waits for it, then finds the library up to date (or, if
# it failed, builds again in the foreground and reports the compiler's error). The CPU test build (g++ with ASan,
# ~2.5 minutes of CPU) is made by the first test that needs it: run in the background beside the chat page's
# tests, it coincided with their Stop test failing (2 of 4 runs), so it stays in the foreground.
_background: dict[str, subprocess.Popen] = {}


def _start_background_build(kind: str, args: list[str], nice: int) -> None:
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {}
    lower = ["nice", "-n", str(nice)] if shutil.which("nice") else []
    _background[kind] = subprocess.Popen([*lower, sys.executable, str(ROOT / "build.py"), *args],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **group)


def pytest_collection_finish(session):
    if any("cuda_build" in getattr(item, "fixturenames", ()) for item in session.items) and build.find_nvcc():
        _start_background_build("cuda", [], nice=19)


def _wait_for_background_build(kind: str):
    proc = _background.pop(kind, None)
    if proc is not None:
        proc.wait()


def pytest_unconfigure(config):
    """A run that ends before the builds do (a subset, ^C) stops them, compilers included."""
    for proc in _background.values():
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 15) if sys.version_info >= (3, 11) else proc.terminate()
            except ProcessLookupError:
                pass
            proc.wait()


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """make(model_type, fp8=False, **kw) -> (path, reference model); cached per argument set."""
    import checkpoints
    cache = {}

    def make(model_type="qwen3_5", fp8=False, **kw):
        key = (model_type, fp8, tuple(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{model_type}_{'fp8' if fp8 else 'bf16'}")
            cache[key] = checkpoints.make_checkpoint(d, model_type, fp8=fp8, **kw)
        return cache[key]
    return make


@pytest.fixture(scope="session")
def pocket_tiny():
    """The bundled pocket-tiny (a real model that calls tools) on the CPU's torch backend, one per session."""
    import pocketllm
    llm = pocketllm.LLM(None, backend="torch", quiet=True, max_batch_size=8, max_context=1024)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(request, llm):
    """The test module's `llm` served over HTTP on port 0, protected by the module's KEY (if it has one)."""
    srv = llm.serve(port=0, api_key=getattr(request.module, "KEY", None), block=False, log_requests=False)
    yield srv
    srv.shutdown()
