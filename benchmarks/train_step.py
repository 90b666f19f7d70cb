"""Time one training step of pocket-tiny's training script: transformers' own path against the script's.

    python benchmarks/train_step.py [--threads 2] [--rounds 3] [--batch 4] [--tokens 900] [--learned 0.24]

The architecture of tests/fixtures/train_pocket_tiny.py (text_config_dict) with random weights, a batch of --batch
(the script's default: 4) random conversations of --tokens tokens of which a --learned share carries loss weight,
forward and backward (no optimizer step). Each round runs each path once, each in a fresh process (alternating),
because the denormal mode is per thread and torch's worker threads take the mode of the thread that starts them:

- "transformers": model(...).logits over every position, transformers' torch_chunk_gated_delta_rule, denormals kept;
- "script": what the script runs: learned_loss (the lm_head at learned positions), chunk_delta_rule
  (fast_chunk_delta_rule), denormals flushed from the process' start.

Prints each round's process CPU time (the figure to compare on a shared machine) and wall time per step.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fixtures"))
import train_pocket_tiny as script  # noqa: E402

PATHS = ("transformers", "script")


def one_path(args) -> str:
    """Warm up, then time one step of args.path in this process: 'CPU WALL'."""
    torch.set_flush_denormal(args.path == "script")        # before any parallel region: the workers inherit it
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = script.build_model(script.text_config_dict(2048, {"<|im_end|>": 2, "<|endoftext|>": 0}), tied=True)
    ids = torch.randint(0, 2048, (args.batch, args.tokens))                            # (B, T)
    weights = (torch.rand(args.batch, args.tokens) < args.learned).float()             # (B, T)

    def step():
        if args.path == "script":
            with script.fast_chunk_delta_rule():
                script.learned_loss(model, ids, weights)[0].backward()
            return
        logits = model(input_ids=ids, use_cache=False).logits                          # (B, T, V)
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        w = weights[:, 1:].flatten()
        ((nll * w).sum() / (w > 0).sum()).backward()

    step()
    model.zero_grad(set_to_none=True)
    cpu, wall = time.process_time(), time.perf_counter()
    step()
    return f"{time.process_time() - cpu:.2f} {time.perf_counter() - wall:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the script trains with 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="conversations per step (the script's --batch-size)")
    ap.add_argument("--tokens", type=int, default=900, help="tokens per conversation (the corpus averages ~900)")
    ap.add_argument("--learned", type=float, default=0.24, help="share of positions with loss weight")
    ap.add_argument("--path", choices=PATHS, help="time this path once in this process and print 'CPU WALL'")
    args = ap.parse_args()
    if args.path:
        print(one_path(args))
        return
    times = {path: [] for path in PATHS}
    for _ in range(args.rounds):
        for path in PATHS:
            out = subprocess.run([sys.executable, __file__, "--path", path] + sys.argv[1:], check=True,
                                 capture_output=True, text=True).stdout
            times[path].append([float(x) for x in out.split()[-2:]])
    for path, rounds in times.items():
        print(f"{path:13s} CPU s/step " + " ".join(f"{c:.2f}" for c, _ in rounds)
              + "   wall " + " ".join(f"{w:.2f}" for _, w in rounds))


if __name__ == "__main__":
    main()
