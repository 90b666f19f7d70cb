"""`pip install .` (pyproject.toml) into a fresh virtualenv: the module, the `pocketllm` command, and the bundled
pocket-tiny found from the installed copy, away from the repository. Offline: --no-deps, --no-build-isolation and
the system site-packages provide torch and setuptools."""

import os
import re
import shutil
import subprocess
import sys
import venv

import pytest

import pocketllm

ROOT = pocketllm.HERE


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")               # a copy, so the build leaves nothing in the repository
    for name in ("pyproject.toml", "pocketllm.py", "README.md", "LICENSE", "requirements.txt"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "models" / "pocket-tiny", src / "models" / "pocket-tiny")
    env_dir = tmp_path_factory.mktemp("venv")
    try:
        venv.create(env_dir, system_site_packages=True, with_pip=False)
    except Exception as e:  # noqa: BLE001  (any failure to make a virtualenv here)
        pytest.skip(f"cannot create a virtualenv: {e}")
    python = env_dir / "bin" / "python"
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(src)],
                         capture_output=True, text=True, timeout=600, cwd=env_dir)
    if pip.returncode != 0 and "No module named pip" in pip.stderr + pip.stdout:
        pytest.skip("the system Python has no pip to install with")
    assert pip.returncode == 0, pip.stderr[-3000:]
    return env_dir, python


def test_the_installed_module_finds_its_bundled_model(installed):
    env_dir, python = installed
    code = ("import pocketllm; print(pocketllm.__file__); print(pocketllm.DEFAULT_CKPT); "
            "llm = pocketllm.LLM(quiet=True, max_context=64, max_batch_size=1); "
            "print(llm.generate('Hello', max_tokens=2, temperature=0)['completion_tokens'])")
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd=env_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    module, ckpt, tokens = r.stdout.split()
    assert module.startswith(str(env_dir)) and ckpt.startswith(str(env_dir)), r.stdout
    assert ckpt.endswith("share/pocketllm/models/pocket-tiny") and tokens == "2"


def test_the_pocketllm_command(installed):
    env_dir, _ = installed
    r = subprocess.run([str(env_dir / "bin" / "pocketllm"), "--help"], capture_output=True, text=True, timeout=120,
                       cwd=env_dir)
    assert r.returncode == 0 and "--max-model-len" in r.stdout, r.stderr
    r = subprocess.run([str(env_dir / "bin" / "pocketllm"), "--port", "70000"], capture_output=True, text=True,
                       timeout=120, cwd=env_dir)
    assert (r.returncode, r.stderr.strip()) == (2, "pocketllm: error: --port 70000: must be in [0, 65535] (0 picks a "
                                                   "free port)")


def readme_setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Set up"):text.index("\n## ", text.index("## Set up") + 1)]
    return re.findall(r"^    (\S.*)$", section, re.M)


def test_the_readme_has_two_set_up_commands_and_ci_runs_the_second():
    commands = readme_setup_commands()
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == commands[1] == "python3 -m pip install -r requirements-test.txt && python3 -m pytest -q tests"


def test_the_first_command_picks_the_cpu_torch_without_a_gpu(tmp_path):
    """The install command's torch index, with and without an nvidia-smi that lists a GPU on PATH."""
    index = re.search(r"\$\((.*)\)", readme_setup_commands()[0]).group(1)
    for gpu in (False, True):
        bin_dir = tmp_path / f"bin-{gpu}"
        bin_dir.mkdir()
        if gpu:
            (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
            (bin_dir / "nvidia-smi").chmod(0o755)
        r = subprocess.run(["/bin/sh", "-c", index], capture_output=True, text=True,
                           env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"})
        assert r.stdout.strip() == ("" if gpu else "--extra-index-url https://download.pytorch.org/whl/cpu"), r
