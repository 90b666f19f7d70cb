"""The GPU check (tests/gpu/check.sh) cannot run here; everything in it that does not need a GPU is checked:
the shell script parses, every step it runs names a script that exists, and the serving steps run for real on
the CPU (serve_check.py dry-run: the same driving code against a CPU server, pocket-tiny and a synthetic
checkpoint)."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "gpu" / "check.sh"


def test_check_sh_parses_and_its_steps_exist():
    r = subprocess.run(["bash", "-n", str(CHECK)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = CHECK.read_text()
    steps = re.findall(r"^run (\w+) \d+ (.*)$", text, re.M)
    assert [name for name, _ in steps] == ["prereqs", "library", "wrappers", "ops", "kernels", "ptx_sm75", "nccl", "parity", "graphs",
                                           "synth", "serve_tiny", "serve_synthetic", "verify", "bench", "decode",
                                           "speculative"]
    for _, command in steps:
        for script in re.findall(r"tests/[\w/]+\.py", command):
            assert (ROOT / script).is_file(), script


def test_serving_steps_dry_run_on_the_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "serve_check.py"), "dry-run", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("serve_tiny", "serve_synthetic"):
        checks = json.loads((tmp_path / f"{name}.json").read_text())["checks"]
        assert set(checks) == {"health", "default_sampling", "penalties", "n_logprobs", "streaming",
                               "forced_tool_call"}, checks
        assert all(v.startswith("PASS") for v in checks.values()), checks
        log = (tmp_path / f"{name}.server.log").read_text()
        assert "backend torch on cpu" in log and "warm-up:" in log
