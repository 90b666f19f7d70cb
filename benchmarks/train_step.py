"""Time one training step of pocket-tiny's training script: transformers' own path against the script's.

    python benchmarks/train_step.py [--threads 1] [--rounds 3] [--tokens 900] [--learned 0.24]

One process, the architecture of tests/fixtures/train_pocket_tiny.py (text_config_dict) with random weights, a
batch of 4 random conversations of --tokens tokens of which a --learned share carries loss weight, forward and
backward (no optimizer step), alternating per round:

- "transformers": model(...).logits over every position, transformers' torch_chunk_gated_delta_rule, denormals kept;
- "script": what train() runs: learned_loss (the lm_head at learned positions), chunk_delta_rule
  (fast_chunk_delta_rule), denormals flushed.

Prints each round's process CPU time (the figure to compare on a shared machine) and wall time.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fixtures"))
import train_pocket_tiny as script  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=900, help="tokens per conversation (the corpus averages ~900)")
    ap.add_argument("--learned", type=float, default=0.24, help="share of positions with loss weight")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = script.text_config_dict(2048, {"<|im_end|>": 2, "<|endoftext|>": 0})
    model = script.build_model(cfg, tied=True)
    ids = torch.randint(0, 2048, (4, args.tokens))                                     # (B, T)
    weights = (torch.rand(4, args.tokens) < args.learned).float()                      # (B, T)

    def transformers_step():
        torch.set_flush_denormal(False)
        logits = model(input_ids=ids, use_cache=False).logits                          # (B, T, V)
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        w = weights[:, 1:].flatten()
        ((nll * w).sum() / (w > 0).sum()).backward()

    def script_step():
        torch.set_flush_denormal(True)
        with script.fast_chunk_delta_rule():
            script.learned_loss(model, ids, weights)[0].backward()

    steps = {"transformers": transformers_step, "script": script_step}
    for step in steps.values():                                                        # warm-up
        step()
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            model.zero_grad(set_to_none=True)
            cpu, wall = time.process_time(), time.perf_counter()
            step()
            times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    for name, rounds in times.items():
        print(f"{name:13s} CPU s/step " + " ".join(f"{c:.2f}" for c, _ in rounds)
              + "   wall " + " ".join(f"{w:.2f}" for _, w in rounds))


if __name__ == "__main__":
    main()
