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
    if cpu or not kwargs.get("nvcc"):                        # another nvcc shares nothing with the background one
        _wait_for_background_build("cpu" if cpu else "cuda")
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


# The two builds start in the background as collection ends, each only if a collected test needs it, so the
# tests that need neither run meanwhile; build.build waits for its own, then finds the library up to date (or, if
# that build failed, builds again in the foreground and reports the compiler's error).
# - The CPU test build (g++ with ASan, ~2.5 minutes of CPU): at nice 10, below the tests (the chat page's timing
#   checks run first) and above the CUDA build, since tests need it within minutes.
# - The CUDA build (`python build.py`: sm_75, sm_90 and PTX, ~12 minutes of CPU, nearly what all the tests take):
#   at the lowest priority (nice 19), so it takes only the CPU the tests leave on CI's two cores instead of slowing
#   every test; the tests that need it (tests/test_with_nvcc.py) sort last by name. On a clean clone here the suite
#   took 862-1,110 s this way (four runs), against ~1,230 s with the CUDA build at normal priority.
_background: dict[str, subprocess.Popen] = {}
_CPU_BUILD_USERS = ("cpu=True", "native_cpu_ops_or_skip", "use_native_cpu_build")   # how a test module asks for it


@functools.cache
def _module_needs_cpu_build(path: str) -> bool:
    return any(mark in Path(path).read_text() for mark in _CPU_BUILD_USERS)


def _start_background_build(kind: str, args: list[str], nice: int) -> None:
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {}
    lower = ["nice", "-n", str(nice)] if shutil.which("nice") else []
    _background[kind] = subprocess.Popen([*lower, sys.executable, str(ROOT / "build.py"), *args],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **group)


def pytest_collection_finish(session):
    if any(_module_needs_cpu_build(str(item.path)) for item in session.items) and not asan_missing():
        _start_background_build("cpu", ["--cpu"], nice=10)
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
