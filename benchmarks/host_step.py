"""Host time per decode step outside the model forward: scheduling, batch construction, sampling and
postprocessing, at several batch sizes, for this pocketllm.py and a baseline revision, in one run.

    OMP_NUM_THREADS=1 python benchmarks/host_step.py [--baseline 4fbe869] [--batches 1,16,64] [--steps 40]

Each engine runs the bundled pocket-tiny with the sampling users send ("users": temperature 1, top_p
0.95, presence 0.5 and frequency 0.3 penalties) or temperature 1 alone ("plain"). "stub" replaces the forward
by fixed random logits, so the whole step is host work; "real" runs the torch forward and subtracts its time
(measured around run_batch). The engine is stepped on this thread, every sequence decoding (prefill done
before timing). On the CPU the sampler's tensor work is host work too; on a GPU it is queued on the device
and only its launches cost host time, so these figures bound the GPU's host time from above.
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import pocketllm  # noqa: E402


def load_revision(rev: str):
    """pocketllm.py as it was at git revision `rev`, imported as its own module."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pocketllm.py"], check=True, capture_output=True,
                          text=True).stdout
    path = Path(tempfile.mkdtemp()) / "pocketllm_baseline.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("pocketllm_baseline", path)
    module = sys.modules["pocketllm_baseline"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TimedForward:
    """run_batch wrapper: the real forward, or fixed logits (stub), with the time spent inside it."""

    def __init__(self, engine, stub: bool):
        self.forward, self.seconds = engine.run_batch, 0.0
        V = engine.model.cfg.vocab_size
        self.logits = torch.randn(512, V, generator=torch.Generator().manual_seed(0)) if stub else None
        engine.run_batch = self

    def __call__(self, batch):
        t0 = time.perf_counter()
        out = self.logits[:batch.logit_rows.numel()] if self.logits is not None else self.forward(batch)
        self.seconds += time.perf_counter() - t0
        return out


SAMPLING = {"users": dict(temperature=1.0, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3),
            "plain": dict(temperature=1.0)}


def host_us_per_step(module, batch: int, steps: int, stub: bool, sampling: str = "users") -> float:
    llm = module.LLM(str(pocketllm.DEFAULT_CKPT), backend="torch", quiet=True, max_batch_size=batch,
                     max_context=32 + steps + 16, prefill_token_budget=max(512, 16 * batch))
    engine = llm.engine
    forward = TimedForward(engine, stub)
    params = dict(max_tokens=steps + 16, ignore_eos=True, **SAMPLING[sampling])
    for i in range(batch):
        prompt = [5 + (i * 7 + j * 13) % 1000 for j in range(16)]
        engine.add(module.Request(f"b{i}", prompt, module.SamplingParams(**params), i))
    while any(not s.output_ids for s in engine.scheduler.running) or engine.scheduler.waiting or \
            not engine.scheduler.running:
        engine.step()                                    # prefill, first tokens
    for _ in range(3):
        engine.step()                                    # warm
    host = []
    for _ in range(steps):
        forward.seconds, t0 = 0.0, time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - t0 - forward.seconds)
    llm.close()
    return statistics.median(host) * 1e6                 # the median step: these machines are shared


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="4fbe869", help="git revision to compare with (default: before the "
                                                          "batched sampler)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    versions = {f"baseline {args.baseline}": load_revision(args.baseline), "this tree": pocketllm}
    batches = [int(b) for b in args.batches.split(",")]
    print("| forward | sampling | version | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|---|---|" + "---|" * len(batches))
    for stub, sampling in ((True, "users"), (True, "plain"), (False, "users")):
        for name, module in versions.items():
            cells = []
            for b in batches:
                us = host_us_per_step(module, b, args.steps, stub, sampling)
                cells.append(f"{us / 1000:.2f} ms ({us / b:.0f} us/seq)")
            print(f"| {'stub' if stub else 'real'} | {sampling} | {name} | " + " | ".join(cells) + " |", flush=True)
    print("\ngoal: under 20 us per sequence + 1 ms per step, i.e. " +
          ", ".join(f"batch {b}: {(1000 + 20 * b) / 1000:.2f} ms" for b in batches))


if __name__ == "__main__":
    main()
