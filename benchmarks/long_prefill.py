"""Time one long prefill (issue 50: a 47k-token agent prompt) on the torch backend, and where its CPU time goes.

    python benchmarks/long_prefill.py --ckpt models/pocket-tiny --tokens 47000 --threads 2
    python benchmarks/long_prefill.py --ckpt benchmarks/pocket-tiny-64k --load-format dummy --tokens 47000
    python benchmarks/long_prefill.py ... --profile           # + process CPU time inside the torch ops
    python benchmarks/long_prefill.py ... --source /other/checkout   # that checkout's pocketllm.py (before/after)
    python benchmarks/long_prefill.py ... --decode 32          # + decode behind the prompt, ms per output token

LLM(max_context=65536, max_batch_size=2) with POCKETLLM_ALLOW_LONG_MAX_MODEL_LEN=1, a 600-token warm-up, then
generate(N random ids, max_tokens=1): wall time, process CPU time (all threads; on a shared machine the figure to
compare), peak RSS. benchmarks/pocket-tiny-64k/config.json is the shape pocket-tiny is being retrained to (one
full-attention layer of 2 q heads / 1 KV head, five Gated DeltaNet layers, 65,536 positions), run with random
weights. --decode N then generates N tokens behind the same prompt (the prefix cache resumes it within a block)
and reports the wall time per output token at that context.
"""

import argparse
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = ("attention", "gated_delta", "linear", "mlp", "conv1d", "qk_norm_rope_kv", "gated_rmsnorm")


def time_ops(pocketllm, totals: dict) -> None:
    """Wrap TorchOps' prefill-heavy ops to add their process CPU time to totals (an op's own re-entry, e.g. the
    gated attention calling attention, is counted once)."""
    depth = {}

    def wrap(name, f):
        def timed(*args, **kwargs):
            depth[name] = depth.get(name, 0) + 1
            t = time.process_time()
            try:
                return f(*args, **kwargs)
            finally:
                depth[name] -= 1
                if not depth[name]:
                    totals[name] = totals.get(name, 0.0) + time.process_time() - t
        return timed
    for name in OPS:
        setattr(pocketllm.TorchOps, name, wrap(name, getattr(pocketllm.TorchOps, name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=str(ROOT / "models" / "pocket-tiny"))
    ap.add_argument("--tokens", type=int, default=47000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--prefill-token-budget", type=int, default=512)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--decode", type=int, default=0, help="then decode this many tokens behind the prompt")
    ap.add_argument("--source", default=str(ROOT), help="the checkout whose pocketllm.py to import")
    args = ap.parse_args()
    os.environ["POCKETLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    sys.path.insert(0, args.source)
    import torch
    import pocketllm
    torch.set_num_threads(args.threads)
    llm = pocketllm.LLM(args.ckpt, max_context=65536, max_batch_size=2,   # 2 snapshots: --decode resumes
                        kv_dtype=args.kv_dtype, quiet=True,
                        prefill_token_budget=args.prefill_token_budget, load_format=args.load_format)
    ids = torch.randint(5, 390, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate(ids[:600], max_tokens=1, temperature=0)
    totals = {}
    if args.profile:
        time_ops(pocketllm, totals)
    cpu, wall = time.process_time(), time.perf_counter()
    llm.generate(ids, max_tokens=1, temperature=0)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"{Path(args.ckpt).name} from {args.source}: {args.tokens} tokens, kv {args.kv_dtype}, chunks of "
          f"{args.prefill_token_budget}, {args.threads} threads: wall {wall:.1f} s, CPU {cpu:.1f} s, peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, load average {os.getloadavg()[0]:.1f}")
    if totals:
        print("CPU s in ops (mlp includes its linears): " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items()))
    if args.decode:
        wall = time.perf_counter()
        n = len(llm.generate(ids, max_tokens=args.decode, temperature=0, ignore_eos=True)["token_ids"])
        wall = time.perf_counter() - wall
        print(f"decode behind {args.tokens} tokens: {n} tokens in {wall:.2f} s, "
              f"{1000 * wall / n:.1f} ms per token (its short prefill from the prefix cache included)")
    llm.close()


if __name__ == "__main__":
    main()
