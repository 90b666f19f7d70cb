"""Shared fixtures. Tests run on the CPU with one thread per process: the machines are small and shared,
and oversubscribed OpenMP threads make tiny ops hundreds of times slower."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


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
