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
                                           "model27b", "synth", "serve_tiny", "serve_synthetic", "verify", "bench", "decode",
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


def test_the_27b_dummy_weight_step_runs_on_the_cpu_with_a_small_config(tmp_path):
    """check.sh's model27b step (gpu_check.py model27b) with --cpu: pocket-tiny's config with dummy weights at TP1
    and at its TP2 rank's shapes, through benchmarks/bench.py's report; every figure the GPU run prints."""
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_check.py"), "model27b", str(tmp_path),
                        "--cpu"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "model27b.json").read_text())
    assert set(result) == {"copy_GBps", "tp1", "tp2_rank"}
    tp1, rank = result["tp1"], result["tp2_rank"]
    assert tp1["on"]["speculative_tokens"] == 2 and rank["on"] is None
    for run in (tp1["off"], tp1["on"], rank["off"]):
        assert run["batch1"]["tpot_ms"] > 0 and run["batch4"]["tok_s"] > 0 and run["ttft_ms"]["256"] > 0
        assert run["profile"]["wall_ms_per_step"] > 0 and run["peak_memory_mb"] > 0
    assert set(tp1["speculative"]) == {"batch1", "batch4"}
    # a rank holds half the layers' bytes (the hidden-size norms whole): TP2's shapes are really one rank's
    assert 0.45 < rank["off"]["decode_bytes_per_step"] / tp1["off"]["decode_bytes_per_step"] < 0.55
    text = (tmp_path / "model27b.txt").read_text()
    assert "| TPOT, batch 1 (ms) |" in text and "implied speed-up at acceptance 0.8" in text and "roofline" in text
