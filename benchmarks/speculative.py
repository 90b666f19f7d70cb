"""Speculative decoding with the MTP layer (--speculative-tokens K) on the CPU: decode tokens/s and tokens per
target forward for K = 0..4 at batch 1 and 8, on pocket-tiny (its trained MTP layer) and on a model-shaped
checkpoint (~100M parameters, Qwen3.5 shape, random weights and a random MTP layer), in one run:

    OMP_NUM_THREADS=1 python benchmarks/speculative.py [--synthetic /tmp/bench-100m-mtp] [--decode 48]

A random MTP layer almost never guesses the target's token, so on the model-shaped checkpoint its rows show the
cost of drafting and verifying with nothing accepted; the "oracle" rows replace its drafts (after the real MTP
passes ran) by the target's own greedy continuation, every draft accepted: the most speculation can give at
that shape. Greedy decoding throughout; every run's output is checked equal to K = 0's.
"""

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import pocketllm  # noqa: E402
from bench import prompt_ids  # noqa: E402
from test_speculative import oracle  # noqa: E402


QUESTIONS = ["What is the weather in Paris for 3 days?", "Convert 120 euros to USD.", "What time is it in Tokyo?",
             "What is the capital of Italy?", "Weather in New York tomorrow?", "How much is 50 GBP in yen?",
             "Tell me the local time in Cape Town.", "Say hello."]
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}
         for name, props in [("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}),
                             ("convert_currency", {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                                                   "to_currency": {"type": "string"}}),
                             ("get_time", {"city": {"type": "string"}})]]


def prompts_for(llm, batch: int, chat: bool) -> list[list[int]]:
    """Chat prompts with tools (pocket-tiny: what it was trained on), or random ids (random checkpoints)."""
    if not chat:
        return [prompt_ids(24, llm.config.vocab_size, 200 + i) for i in range(batch)]
    return [llm.tokenizer.encode(pocketllm.render_chat_prompt(llm, {"messages": [{"role": "user", "content": q}]},
                                                              TOOLS)) for q in QUESTIONS[:batch]]


def decode_run(llm, prompts: list[list[int]], decode: int, ignore_eos: bool) -> tuple[float, list[list[int]]]:
    """The prompts' greedy sequences decoding together: (tokens/s from the last first token to the last token,
    every sequence's tokens)."""
    batch = len(prompts)
    streams = [llm.submit(p, pocketllm.SamplingParams(max_tokens=decode, temperature=0, ignore_eos=ignore_eos))
               for p in prompts]
    stamps, tokens = [[] for _ in streams], [[] for _ in streams]

    def read(i):
        for ev in streams[i]:
            stamps[i] += [time.perf_counter()] * len(ev.token_ids)
            tokens[i] += ev.token_ids
    threads = [threading.Thread(target=read, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start, end = max(s[0] for s in stamps), max(s[-1] for s in stamps)
    counted = sum(sum(1 for x in s if x > start) for s in stamps)
    return counted / (end - start), tokens


def bench(name: str, ckpt, batches, decode: int, with_oracle: bool) -> list[str]:
    rows, truth = [], {}
    for K in range(5):
        kinds = ["mtp"] + (["oracle"] if with_oracle and K else [])
        for kind in kinds:
            llm = pocketllm.LLM(ckpt, speculative_tokens=K, quiet=True, dtype="float32", max_batch_size=8,
                                gpu_memory_utilization=0.2)                    # one engine per K on a GPU
            llm.generate([5, 6, 7], max_tokens=4, temperature=0)           # warm-up
            for b in batches:
                prompts = prompts_for(llm, b, ckpt is None)
                if kind == "oracle":
                    oracle(llm, {(tuple(p), 0): truth[b][i] for i, p in enumerate(prompts)}, wrong_every=10 ** 9)
                before = llm.stats()
                rate, tokens = decode_run(llm, prompts, decode, ckpt is not None)
                after = llm.stats()
                if K == 0:
                    truth[b] = tokens
                assert tokens == truth[b], f"{name} K={K} {kind} batch {b}: output differs from K=0"
                d = {k: after[k] - before[k] for k in ("draft_tokens_total", "accepted_tokens_total",
                                                        "generation_tokens_total", "target_forwards_total")}
                accept = d["accepted_tokens_total"] / d["draft_tokens_total"] if d["draft_tokens_total"] else 0
                per = d["generation_tokens_total"] / d["target_forwards_total"]
                label = "off" if K == 0 else kind
                rows.append(f"| {name} | {K} | {label} | {b} | {rate:.1f} | {per:.2f} | {accept:.0%} |")
                print(rows[-1], flush=True)
            llm.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", default="/tmp/bench-100m-mtp", help="the model-shaped checkpoint (written once)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--decode", type=int, default=48, help="tokens per sequence")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on shared machines)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    import checkpoints
    path = Path(args.synthetic)
    if not (path / "config.json").exists():
        checkpoints.make_checkpoint(path, "qwen3_5", extra_tensors=False, mtp=True, vocab_size=32000, hidden_size=768,
                                    intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
                                    linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3)
    batches = [int(b) for b in args.batches.split(",")]
    print("| checkpoint | K | drafts | batch | decode tokens/s | tokens per target forward | accepted |")
    print("|---|---|---|---|---|---|---|")
    bench("pocket-tiny", None, batches, args.decode, False)
    bench("100M-shaped", path, batches, args.decode, True)


if __name__ == "__main__":
    main()
