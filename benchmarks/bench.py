"""Benchmark pocketllm's engine, and optionally the transformers reference, on one checkpoint in one process.

    python benchmarks/bench.py --ckpt DIR [--reference] [--batches 1,4,16] [--prompt-len 256] [--decode 32]
    python benchmarks/bench.py --synthetic /tmp/bench-100m [--fp8] --reference    # writes a ~100M-param
                                                                                  # Qwen3.5-shaped checkpoint first

Reports prefill tokens/s, time to first token, decode tokens/s at each batch size, and peak memory; with
--reference, transformers' generate() at batch 1 on the same weights (dequantised when FP8), and the ratio.
Ratios from one run are what to compare: these machines are shared and noisy.
"""

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import pocketllm  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, min(vocab, 390), (n,), generator=g).tolist()


def bench_prefill(llm, n: int, repeats: int = 3) -> tuple[float, float]:
    """Best-of-N time to first token for an n-token prompt; returns (ttft seconds, prefill tokens/s)."""
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        llm.generate(prompt_ids(n, llm.config.vocab_size, r), max_tokens=1, temperature=0)
        times.append(time.perf_counter() - t0)
    best = min(times)
    return best, n / best


def bench_decode(llm, batch: int, decode: int, prompt_len: int = 16) -> float:
    """Tokens/s while `batch` sequences decode together (after every first token, until the last token)."""
    import threading
    streams = [llm.submit(prompt_ids(prompt_len, llm.config.vocab_size, 100 + i),
                          pocketllm.SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True))
               for i in range(batch)]
    stamps = [[] for _ in streams]           # arrival time of every token, read concurrently per stream

    def read(i):
        for ev in streams[i]:
            stamps[i] += [time.perf_counter()] * len(ev.token_ids)
    threads = [threading.Thread(target=read, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(s[0] for s in stamps)       # every sequence is decoding from here on
    later = sum(1 for s in stamps for t in s if t > start)
    end = max(s[-1] for s in stamps)
    return later / (end - start) if end > start else float("nan")


def reference_model(ckpt_dir: Path):
    """transformers' model on the checkpoint's weights (FP8 dequantised), float32."""
    import transformers
    ckpt = pocketllm.Checkpoint(ckpt_dir)
    raw = ckpt.raw_config
    text = dict(raw.get("text_config", raw))
    text.pop("quantization_config", None)
    text["model_type"] = "qwen3" if raw["model_type"] == "qwen3" else "qwen3_5_text"
    if raw["model_type"] == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**text))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    prefix = ckpt.config.weight_prefix
    state = {}
    for name in model.state_dict():
        stored = prefix + name[len("model."):] if name.startswith("model.") else name
        if name.endswith(".weight") and ckpt.has(stored[:-len(".weight")] + ".weight_scale_inv"):
            w = pocketllm.load_linear(ckpt, stored[:-len(".weight")], tuple(ckpt.shape(stored)))
            state[name] = pocketllm.dequantize(w, torch.float32)
        else:
            state[name] = ckpt.read(stored).float()
    model.load_state_dict(state)
    return model.float().eval()


def bench_reference(model, decode: int, prompt_len: int = 16) -> float:
    ids = torch.tensor([prompt_ids(prompt_len, model.config.vocab_size, 100)])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, **kw)                        # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=decode, **kw)
        t2 = time.perf_counter()
    return (decode - 1) / ((t2 - t1) - (t1 - t0))


def make_synthetic(path: Path, fp8: bool):
    """A ~100M-parameter Qwen3.5-shaped checkpoint (random weights, tiny tokenizer, 32k-row vocabulary)."""
    import checkpoints
    if (path / "config.json").exists():
        return
    checkpoints.make_checkpoint(path, "qwen3_5", fp8=fp8, extra_tensors=False, vocab_size=32000, hidden_size=768,
                                intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
                                linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt")
    ap.add_argument("--synthetic", help="write (once) and use a ~100M-param synthetic checkpoint at this path")
    ap.add_argument("--fp8", action="store_true", help="with --synthetic: FP8 block-quantised weights")
    ap.add_argument("--reference", action="store_true", help="also run transformers at batch 1")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.synthetic:
        make_synthetic(Path(args.synthetic), args.fp8)
    ckpt = Path(args.ckpt or args.synthetic)
    batches = [int(b) for b in args.batches.split(",")]
    llm = pocketllm.LLM(ckpt, backend=args.backend, device=args.device, quiet=True, max_batch_size=max(batches),
                        max_context=args.prompt_len + args.decode + 16)
    params = sum((w.weight if isinstance(w, pocketllm.Linear) else w).numel()
                 for L in llm.model.layers for _, w in pocketllm.named_weights(L)) + \
        llm.model.embed_tokens.numel() + llm.model.lm_head.weight.numel()
    result = {"checkpoint": str(ckpt), "params_M": round(params / 1e6, 1), "threads": torch.get_num_threads(),
              "backend": args.backend}
    bench_decode(llm, 1, 4)                                                 # warm-up
    ttft, prefill = bench_prefill(llm, args.prompt_len)
    result.update(ttft_s=round(ttft, 3), prefill_tok_s=round(prefill, 1))
    for b in batches:
        result[f"decode_tok_s_batch{b}"] = round(bench_decode(llm, b, args.decode), 1)
    result["peak_rss_mb_after_pocketllm"] = round(peak_rss_mb())
    if args.reference:
        del llm
        ref = reference_model(ckpt)
        result["transformers_decode_tok_s_batch1"] = round(bench_reference(ref, args.decode), 1)
        result["ratio_batch1"] = round(result["decode_tok_s_batch1"] / result["transformers_decode_tok_s_batch1"], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
