"""The cost of the vocab-parallel lm_head and embedding on CPU ranks (gloo), per step, at the 27B's shapes.

Compares, per rank and step, for R logit rows and T tokens (V = 248320, D = 5120, world ranks):
- head, gather (what pocketllm does): every rank computes its (R, V/world) columns into a zeroed (R, V) fp32
  and the group's all-reduce sums them: rank 0 has the full logits. Bytes all-reduced: R x V x 4.
- head, replicated (before): every rank computes the full (R, V); no communication, but V x D weights per rank.
- embedding, vocab-parallel (what pocketllm does): (T, D) fp32 all-reduce of the looked-up rows.
The matmul's time is the weights read; the all-reduce's time is the gather's price. One process per rank.

    OMP_NUM_THREADS=1 python3 benchmarks/vocab_parallel.py --world 2 --rows 1,16 --tokens 512
"""

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

V, D = 248320, 5120


def timed(fn, reps: int) -> float:
    fn()                                                                  # warm
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def rank_main(rank: int, world: int, store_path: str, rows: list[int], tokens: int, reps: int, vocab: int):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(minutes=5)
    group = dist.ProcessGroupGloo(store, rank, world, options)
    reduce = lambda x: group.allreduce([x]).wait()                        # noqa: E731
    per = -(-vocab // world)
    v0, v1 = min(rank * per, vocab), min((rank + 1) * per, vocab)
    head = torch.randn(v1 - v0, D, dtype=torch.bfloat16)                  # (V', D) this rank's slice
    full_head = torch.randn(vocab, D, dtype=torch.bfloat16) if rank == 0 else None   # (V, D) the replicated one
    out = []
    for r in rows:
        h = torch.randn(r, D, dtype=torch.bfloat16)                       # (R, D)

        def gather():
            logits = torch.zeros(r, vocab)                                # (R, V) fp32
            logits[:, v0:v1] = (h @ head.T).float()
            reduce(logits)
        t_gather = timed(gather, reps)
        t_reduce = timed(lambda: reduce(torch.zeros(r, vocab)), reps)
        t_full = timed(lambda: (h @ full_head.T).float(), reps) if rank == 0 else 0.0
        out.append((r, t_gather, t_reduce, t_full))
    x = torch.zeros(tokens, D)                                            # (T, D) fp32
    t_embed = timed(lambda: reduce(x), reps)
    if rank == 0:
        print(f"world {world}, V {vocab}, D {D}, one torch thread per rank, gloo over loopback")
        print("| R rows | head, gather (slice matmul + all-reduce) | of which all-reduce | bytes all-reduced "
              "| head, replicated (full matmul) |")
        print("|---|---|---|---|---|")
        for r, tg, tr, tf in out:
            print(f"| {r} | {tg * 1e3:.1f} ms | {tr * 1e3:.1f} ms | {r * vocab * 4 / 2**20:.1f} MiB | {tf * 1e3:.1f} ms |")
        print(f"embedding all-reduce, T = {tokens} tokens: {t_embed * 1e3:.1f} ms, "
              f"{tokens * D * 4 / 2**20:.1f} MiB (one of the 2 x layers all-reduces of the same size per step)")
        sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=V)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(a.world, os.path.join(d, "store"), [int(r) for r in a.rows.split(",")],
                                  a.tokens, a.reps, a.vocab), nprocs=a.world)


if __name__ == "__main__":
    main()
