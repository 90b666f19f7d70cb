"""The library's NCCL failure paths on the CPU test build, against tests/fake_nccl.c (one rank, a scripted
fault): the communicator is made non-blocking and polled, an initialisation that never completes and a step
whose collectives never complete end at their timeout, NCCL's asynchronous error (a peer gone) at once, each
with the communicator aborted and the reason in the error. The real NCCL runs in tests/gpu/gpu_check.py's
`nccl` step. A child process runs the checks: a loaded NCCL stays loaded, and other tests need the CPU build
without one."""

import subprocess
import sys
from pathlib import Path

import pytest

import build


@pytest.fixture(scope="module")
def cpu_build() -> Path:
    return build.build(cpu=True, quiet=True)

CHECKS = r"""
import ctypes, sys, time
import torch
import pocketllm

FAKE, (OK, INIT_HANGS, STEP_HANGS, PEER_DIES) = sys.argv[1], range(4)
fake = ctypes.CDLL(FAKE)
lib = pocketllm.load_native(cpu_build=True)
lib.call("pl_nccl_load", FAKE.encode())
ops = pocketllm.NativeOps("cpu")
assert ops.nccl_available()
uid = ops.nccl_unique_id()


def fails(match, call):
    t0 = time.monotonic()
    try:
        call()
    except pocketllm.NativeError as e:
        assert match in str(e), f"{match!r} not in {e}"
        return time.monotonic() - t0
    raise AssertionError(f"no error (expected {match!r})")


fake.fake_nccl_script(OK)                                   # a healthy step: queued, waited for, destroyed
comm = ops.nccl_init(uid, 1, 0, 0, 1.0)
assert fake.fake_nccl_last_blocking() == 0                  # non-blocking, so init can be polled and abandoned
x = torch.arange(6, dtype=torch.float32)
ops.all_reduce(x, comm)
ops.nccl_wait(comm, 1.0)
assert fake.fake_nccl_reduced() == 1 and x.tolist() == list(range(6)) and fake.fake_nccl_aborted() == 0
ops.lib.call("pl_nccl_destroy", comm)
assert fake.fake_nccl_destroyed() == 1

fake.fake_nccl_script(INIT_HANGS)                           # a rank that never joins
took = fails("ncclCommInitRank did not complete within 0.5 s (a rank is dead or hung); the communicator is "
             "aborted", lambda: ops.nccl_init(uid, 1, 0, 0, 0.5))
assert 0.5 <= took < 3.0 and fake.fake_nccl_aborted() == 1, took

fake.fake_nccl_script(STEP_HANGS)                           # a peer hung inside the step's all-reduce
comm = ops.nccl_init(uid, 1, 0, 0, 1.0)
ops.all_reduce(x, comm)
took = fails("did not complete within 0.5 s (a rank is dead or hung); the communicator is aborted",
             lambda: ops.nccl_wait(comm, 0.5))
assert 0.5 <= took < 3.0 and fake.fake_nccl_aborted() == 1, took
fails("null or aborted NCCL communicator", lambda: ops.all_reduce(x, comm))   # aborted: refused, not reused
ops.lib.call("pl_nccl_destroy", comm)
assert fake.fake_nccl_destroyed() == 0                      # ncclCommAbort freed it; destroy frees ours only

fake.fake_nccl_script(PEER_DIES)                            # NCCL reports the peer gone: at once, with its text
comm = ops.nccl_init(uid, 1, 0, 0, 1.0)
ops.all_reduce(x, comm)
took = fails("failed: fake: peer rank 1 gone; the communicator is aborted", lambda: ops.nccl_wait(comm, 30.0))
assert took < 1.0 and fake.fake_nccl_aborted() == 1, took
ops.lib.call("pl_nccl_destroy", comm)

fake.fake_nccl_script(OK)                                   # abort on request (a peer known dead)
comm = ops.nccl_init(uid, 1, 0, 0, 1.0)
ops.lib.call("pl_nccl_abort", comm)
assert fake.fake_nccl_aborted() == 1
fails("null or aborted NCCL communicator", lambda: ops.nccl_wait(comm, 1.0))
ops.lib.call("pl_nccl_destroy", comm)
print("checked")
"""


def test_nccl_timeouts_and_errors_abort_the_communicator(cpu_build, tmp_path):
    fake = tmp_path / "libfake_nccl.so"
    subprocess.run([build.find_cxx(), "-x", "c", "-shared", "-fPIC", "-O1", str(build.ROOT / "tests" / "fake_nccl.c"),
                    "-o", str(fake)], check=True)
    run = subprocess.run([sys.executable, "-c", CHECKS, str(fake)], capture_output=True, text=True, timeout=300,
                         env=build.asan_env(), cwd=build.ROOT)
    assert run.returncode == 0 and run.stdout.strip() == "checked", run.stdout + run.stderr


def test_cpu_build_loads_no_other_nccl(cpu_build, tmp_path):
    """The CPU build refuses a real (or any other) NCCL: its kernels run on the host."""
    other = tmp_path / "libother.so"
    (tmp_path / "other.c").write_text("int ncclGetVersion(int* v) { *v = 22803; return 0; }\n")
    subprocess.run([build.find_cxx(), "-x", "c", "-shared", "-fPIC", str(tmp_path / "other.c"), "-o", str(other)],
                   check=True)
    code = ("import sys, pocketllm\nlib = pocketllm.load_native(cpu_build=True)\n"
            "try:\n    lib.call('pl_nccl_load', sys.argv[1].encode())\n"
            "except pocketllm.NativeError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code, str(other)], capture_output=True, text=True, timeout=300,
                         env=build.asan_env(), cwd=build.ROOT)
    assert "is not the test NCCL" in run.stdout, run.stdout + run.stderr
