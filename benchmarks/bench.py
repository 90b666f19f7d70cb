"""Benchmark pocketllm's engine, and optionally the transformers reference, on one checkpoint in one process.

    python benchmarks/bench.py --ckpt DIR [--reference] [--batches 1,4,16] [--prompt-len 256] [--decode 32]
    python benchmarks/bench.py --synthetic /tmp/bench-100m [--fp8] --reference    # writes a ~100M-param
                                                                                  # Qwen3.5-shaped checkpoint first

Reports prefill tokens/s, time to first token, decode tokens/s at each batch size, and peak memory; with
--reference, transformers' generate() at batch 1 on the same weights (dequantised when FP8), and the ratio.
Ratios from one run are what to compare: these machines are shared and noisy.

The serving report, in vLLM's terms, each figure with speculative decoding off and on (--report):

    python benchmarks/bench.py --report --ckpt /tmp/q27 --make-config 27b --load-format dummy
    python benchmarks/bench.py --report --ckpt /tmp/q27-tp4 --make-config 27b-tp4 --load-format dummy

batch-1 time per output token (TPOT), time to first token (TTFT) at --ttft-lens prompts, output tokens/s while
--report-batches sequences decode together, GPU time vs wall time per decode step (torch.profiler), peak memory.
--make-config writes DIR/config.json (Qwen3.5-27B FP8's, or one tensor-parallel rank's shapes of it at TP4:
heads, MLP rows and vocabulary divided by 4, run on one device without the all-reduces) and --load-format dummy
serves it with random weights, so no checkpoint download is needed. Random weights reject every MTP draft: the
report gives the cost of a speculative step (K draft passes + the K+1-token verify window) relative to a plain
step, and the speed-up that implies at per-draft acceptance 0.6 and 0.8.

Async scheduling (--overlap): ms per decode step and output tokens/s at each --report-batches size, with
--async-scheduling off and on (speculation off: verify windows run one at a time), the two engines side by side
in one process and measured in turns:

    python benchmarks/bench.py --overlap --ckpt models/pocket-tiny --report-batches 1,8
"""

import argparse
import gc
import json
import os
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


def reference_model(ckpt_dir: Path, load_format: str = "auto", seed: int = 0):
    """transformers' model on the checkpoint's weights (FP8 dequantised), float32; with --load-format dummy the
    same random weights the engine draws (seeded by name). Tied embeddings: lm_head is the embedding."""
    import transformers
    ckpt = pocketllm.open_checkpoint(ckpt_dir, load_format, seed=seed)
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
        if name == "lm_head.weight" and ckpt.config.tie_word_embeddings:
            stored = prefix + "embed_tokens.weight"
        if name.endswith(".weight") and ckpt.has(stored[:-len(".weight")] + ".weight_scale_inv"):
            w = pocketllm.load_linear(ckpt, stored[:-len(".weight")], tuple(ckpt.shape(stored)))
            state[name] = pocketllm.dequantize(w, torch.float32)
        else:
            state[name] = ckpt.read(stored).float()
    model.load_state_dict(state)
    return model.float().eval()


def bench_reference(model, decode: int, prompt_len: int = 16, clock=time.perf_counter) -> float:
    ids = torch.tensor([prompt_ids(prompt_len, model.config.vocab_size, 100)])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, **kw)                        # warm-up
        t0 = clock()
        model.generate(ids, max_new_tokens=1, **kw)
        t1 = clock()
        model.generate(ids, max_new_tokens=decode, **kw)
        t2 = clock()
    return (decode - 1) / ((t2 - t1) - (t1 - t0))


def bench_ours(llm, decode: int, prompt_len: int = 16, clock=time.perf_counter) -> float:
    """bench_reference's measure on the engine: batch 1, a decode-token and a one-token generation of the same
    prompt length (fresh prompts: no prefix-cache hit), the difference's tokens/s. With clock=time.process_time
    the CPU time of every thread of the process (the engine's and this one): on a shared, loaded machine the
    cost of the work itself, where wall time also counts the waits for a core."""
    def run(n: int, seed: int) -> float:
        t0 = clock()
        llm.generate(prompt_ids(prompt_len, llm.config.vocab_size, seed), max_tokens=n, temperature=0,
                     ignore_eos=True)
        return clock() - t0
    run(2, 90)                                                              # warm-up
    return (decode - 1) / (run(decode, 92) - run(1, 91))


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


# ---- The serving report (--report): vLLM's figures, speculative decoding off and on ----

TINY = ROOT / "models" / "pocket-tiny"
ACCEPTANCE = (0.6, 0.8)        # per-draft acceptance rates the speculative speed-up is stated at


def qwen35_27b_config() -> dict:
    """Qwen3.5-27B FP8's config.json (docs/qwen-facts.md sections 2-4): pocket-tiny's (same family, FP8, one MTP
    layer) with the 27B's shapes."""
    return qwen35_config(64, vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                         num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                         linear_key_head_dim=128, linear_value_head_dim=128)


def qwen35_config(layers: int, tied: bool = False, **shape) -> dict:
    """pocket-tiny's config.json (Qwen3.5, FP8, one MTP layer) with these shapes and `layers` layers in the real
    pattern (three Gated DeltaNet layers, then one full attention); the GDN's conv1d, a and b, the embedding, the
    lm_head and mtp.fc stay unquantised, as in Qwen's FP8 checkpoints."""
    raw = json.loads((TINY / "config.json").read_text())
    layer_types = ((["linear_attention"] * 3 + ["full_attention"]) * 16)[:layers]
    raw["text_config"].update(shape, num_hidden_layers=layers, layer_types=layer_types, full_attention_interval=4,
                              max_position_embeddings=262144, eos_token_id=248046, pad_token_id=248044,
                              tie_word_embeddings=tied, mtp_num_hidden_layers=1)
    raw["tie_word_embeddings"] = tied
    raw["text_config"]["rope_parameters"].update(rope_theta=10000000.0, mrope_section=[11, 11, 10])
    gdn = [f"model.language_model.layers.{i}.linear_attn.{m}" for i, t in enumerate(layer_types)
           if t == "linear_attention" for m in ("conv1d", "in_proj_b", "in_proj_a")]
    raw["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.language_model.embed_tokens"] + gdn + \
        ["mtp.fc"]
    return raw


def rank_shapes(raw: dict, world: int) -> dict:
    """The config of one tensor-parallel rank's shapes at degree `world`: attention, GDN heads, MLP rows and the
    vocabulary (vocab-parallel embedding and lm_head) divided by world, the hidden size whole (section 8b's
    split). One device runs it as a whole model: a rank's compute and memory, without the all-reduces."""
    raw = json.loads(json.dumps(raw))
    text = raw.get("text_config", raw)
    for key in ("vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "linear_num_key_heads", "linear_num_value_heads"):
        if key in text:
            assert text[key] % world == 0, f"{key} {text[key]} does not split {world} ways"
            text[key] //= world
    return raw


SHAPE_0_8B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128)   # benchmarks/prefix_cache.py's 0.8B class


def qwen35_08b_config(layers: int, tied: bool) -> dict:
    """A 0.8B-class Qwen3.5 config (SHAPE_0_8B: Qwen3.5-0.8B's widths and 248,320-row vocabulary), FP8 like
    pocket-tiny, with one MTP layer, `layers` of its 24 layers, the embedding tied to the lm_head or not."""
    return qwen35_config(layers, tied, **SHAPE_0_8B)


CONFIGS = ("27b", "27b-tp4", "0.8b", "0.8b-untied")


def write_config(path: Path, name: str, layers: int = 24):
    """--make-config 27b | 27b-tp4 | 0.8b | 0.8b-untied: DIR/config.json (and nothing else: --load-format dummy
    makes the weights); the 0.8B class with --layers of its 24."""
    path.mkdir(parents=True, exist_ok=True)
    raw = qwen35_08b_config(layers, name == "0.8b") if name.startswith("0.8b") else \
        rank_shapes(qwen35_27b_config(), {"27b": 1, "27b-tp4": 4}[name])
    (path / "config.json").write_text(json.dumps(raw, indent=1) + "\n")


def sync(llm):
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def ttft_ms(llm, n: int, repeats: int) -> float:
    """Best-of-N time to first token of an n-token prompt (fresh ids each time: no prefix-cache hit)."""
    best = float("inf")
    for r in range(repeats):
        ids = prompt_ids(n, llm.config.vocab_size, 1000 * n + r)
        t0 = time.perf_counter()
        stream = llm.submit(ids, pocketllm.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        next(iter(stream))
        best = min(best, time.perf_counter() - t0)
        for _ in stream:
            pass
    return best * 1e3


def decode_run(llm, batch: int, tokens: int, seed: int, prompt_len: int = 64) -> tuple[float, int, int]:
    """batch sequences of `tokens` output tokens each, together: (seconds, sampled positions of the target model
    (one per sequence and step: the engine's target_forwards), tokens generated)."""
    before = llm.stats()
    sync(llm)
    t0 = time.perf_counter()
    streams = [llm.submit(prompt_ids(prompt_len, llm.config.vocab_size, seed + i),
                          pocketllm.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
               for i in range(batch)]
    for s in streams:
        for _ in s:
            pass
    sync(llm)
    after = llm.stats()
    return (time.perf_counter() - t0, after["target_forwards_total"] - before["target_forwards_total"],
            after["generation_tokens_total"] - before["generation_tokens_total"])


def decode_rates(llm, batch: int, decode: int) -> dict:
    """Decode at `batch`: a short and a long run, their difference (prefill and the first steps cancel out).
    Returns ms per engine step (every sequence one target forward), output tokens/s, TPOT (ms per token per
    sequence) and tokens per sequence and step."""
    decode_run(llm, batch, 4, seed=7)                                  # warm-up (CUDA graphs capture this size)
    shorts, longs = [], []
    for r in range(3):                      # the fastest of 3 of each length: a shared machine's load only adds time
        shorts.append(decode_run(llm, batch, 8, seed=100 + 1000 * r))
        longs.append(decode_run(llm, batch, 8 + decode, seed=200 + 1000 * r))
    (t_short, f_short, n_short), (t_long, f_long, n_long) = min(shorts), min(longs)
    seconds, forwards, tokens = t_long - t_short, max(f_long - f_short, 1), max(n_long - n_short, 1)
    if seconds <= 0:                        # jitter above the decode's own time: the long run whole (prefill
        seconds, forwards, tokens = t_long, f_long, n_long            # included) bounds the rate from below
    return {"step_ms": seconds * 1e3 * batch / forwards, "tok_s": tokens / seconds,
            "tpot_ms": seconds * 1e3 * batch / tokens, "tokens_per_step": tokens / forwards}


def profile_steps(llm, tokens: int = 16) -> dict:
    """torch.profiler over a batch-1 decode: wall time and GPU (kernel) time per target forward."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
    decode_run(llm, 1, 4, seed=9)
    with profile(activities=activities) as prof:
        seconds, steps, _ = decode_run(llm, 1, tokens, seed=10)
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages()) if llm.device.type == "cuda" else None
    return {"wall_ms_per_step": seconds * 1e3 / steps,
            "gpu_ms_per_step": None if gpu_us is None else gpu_us / 1e3 / steps}


def weight_bytes(model, embedding: bool = True, mtp: bool = True) -> int:
    """Bytes of the model's weights (FP8 scales included); without the embedding and the MTP layer, what a plain
    decode step reads at batch 1 (the embedding reads one row per token)."""
    total = model.embed_tokens.numel() * model.embed_tokens.element_size() if embedding else 0
    total += model.norm.numel() * model.norm.element_size()
    for part in model.layers + [model.mtp if mtp else None] + [model.lm_head]:
        items = [("", part)] if isinstance(part, pocketllm.Linear) else pocketllm.named_weights(part) if part else []
        for _, w in items:
            for t in ([w.weight, w.scale] if isinstance(w, pocketllm.Linear) else [w]):
                total += 0 if t is None else t.numel() * t.element_size()
    return total


def peak_memory_mb(device) -> float:
    """GPU: torch's peak allocation since the last reset; CPU: the process's peak RSS (never reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return peak_rss_mb()


def measure(args, speculative_tokens: int) -> dict:
    """One LLM with speculation off (0) or on (K): every figure of the report, then the LLM closed."""
    ttft_lens = [int(n) for n in args.ttft_lens.split(",")]
    batches = [int(b) for b in args.report_batches.split(",")]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = pocketllm.LLM(args.ckpt, backend=args.backend, device=args.device, dtype=args.dtype,
                        load_format=args.load_format, quiet=not args.verbose, seed=args.seed,
                        max_context=max(ttft_lens + [64 + 8 + args.decode]) + 16, max_batch_size=max(batches + [1]),
                        speculative_tokens=speculative_tokens)
    try:
        out = {"load_s": time.perf_counter() - t0, "speculative_tokens": speculative_tokens if llm.model.mtp else 0,
               "weights_mb": weight_bytes(llm.model) / 2 ** 20, "device": str(llm.device),
               "decode_bytes_per_step": weight_bytes(llm.model, embedding=False, mtp=False),
               "backend": llm.placement.backend}
        out["batch1"] = decode_rates(llm, 1, args.decode)
        for b in batches:
            if b != 1:
                out[f"batch{b}"] = decode_rates(llm, b, args.decode)
        out["ttft_ms"] = {n: ttft_ms(llm, n, args.ttft_repeats) for n in ttft_lens}
        out["profile"] = profile_steps(llm)
        stats = llm.stats()
        out["accepted"] = stats["accepted_tokens_total"] / max(stats["draft_tokens_total"], 1)
        out["peak_memory_mb"] = peak_memory_mb(llm.device)
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def implied_speedup(cost: float, k: int, acceptance: float) -> float:
    """Tokens per speculative step at per-draft acceptance a (drafts accepted in order, independently:
    1 + a + ... + a^K) over the step's cost relative to a plain step."""
    return sum(acceptance ** i for i in range(k + 1)) / cost


def report(args) -> dict:
    if args.make_config:
        write_config(Path(args.ckpt), args.make_config)
    k = 2 if args.speculative_tokens is None else args.speculative_tokens
    off = measure(args, 0)
    on = measure(args, k) if k else None
    result = {"checkpoint": str(args.ckpt), "load_format": args.load_format, "off": off, "on": on,
              "machine": machine()}
    k = on["speculative_tokens"] if on else 0
    if k:
        result["speculative"] = {}
        for b in (b for b in off if b.startswith("batch")):
            cost = on[b]["step_ms"] / off[b]["step_ms"]
            result["speculative"][b] = {"step_cost": cost, **{f"speedup_at_{a}": implied_speedup(cost, k, a)
                                                               for a in ACCEPTANCE}}
    return result


def overlap_report(args) -> dict:
    """Decode step time with async scheduling off and on, the two LLMs alive together and measured in turns."""
    batches = [int(b) for b in args.report_batches.split(",")]
    if args.make_config:
        write_config(Path(args.ckpt), args.make_config)
    llms = {flag: pocketllm.LLM(args.ckpt, backend=args.backend, device=args.device, dtype=args.dtype,
                                load_format=args.load_format, quiet=not args.verbose, seed=args.seed,
                                max_context=64 + 8 + args.decode + 16, max_batch_size=max(batches),
                                speculative_tokens=0, async_scheduling=flag) for flag in (False, True)}
    try:
        result = {"checkpoint": str(args.ckpt), "machine": machine(), "backend": llms[True].placement.backend,
                  "device": str(llms[True].device), "batches": {}}
        for b in batches:
            rates = {flag: decode_rates(llm, b, args.decode) for flag, llm in llms.items()}
            result["batches"][b] = {"off": rates[False], "on": rates[True],
                                    "launched": llms[True].engine.device.launches}
    finally:
        for llm in llms.values():
            llm.close()
    return result


def overlap_table(result: dict) -> str:
    lines = ["| batch | ms per step, one at a time | ms per step, overlapped | ratio | tokens/s off | tokens/s on |",
             "|---|---|---|---|---|---|"]
    for b, r in result["batches"].items():
        off, on = r["off"], r["on"]
        lines.append(f"| {b} | {off['step_ms']:.1f} | {on['step_ms']:.1f} | {on['step_ms'] / off['step_ms']:.2f} | "
                     f"{off['tok_s']:.1f} | {on['tok_s']:.1f} |")
    return "\n".join(lines)


def machine() -> str:
    import platform
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, " \
           f"torch {torch.__version__}"


def report_table(result: dict) -> str:
    """The report as a markdown table (docs/benchmarks.md); one column when speculation was not measured."""
    off, on = result["off"], result["on"] or {}
    k = on.get("speculative_tokens", 0)
    fmt = lambda v, unit="": "n/a" if v is None else f"{v:.1f}{unit}" if v >= 10 else f"{v:.2f}{unit}"  # noqa: E731

    def get(d: dict, *path):
        for key in path:
            d = d[key]
        return d
    rows = [("TPOT, batch 1 (ms)", ("batch1", "tpot_ms"))]
    rows += [(f"TTFT, {n}-token prompt (ms)", ("ttft_ms", n)) for n in off["ttft_ms"]]
    rows += [(f"output tokens/s, batch {b[5:]}", (b, "tok_s")) for b in off if b.startswith("batch") and b != "batch1"]
    rows += [("wall time per decode step, batch 1 (ms)", ("profile", "wall_ms_per_step")),
             ("GPU time per decode step, batch 1 (ms)", ("profile", "gpu_ms_per_step")),
             ("weights (MiB)", ("weights_mb",)), ("peak memory (MiB)", ("peak_memory_mb",))]
    head = f"| figure | speculation off | on (K = {k}, drafts accepted {100 * on['accepted']:.0f}%) |" if on else \
        "| figure | speculation off |"
    lines = [head, "|---|---|" + ("---|" if on else "")]
    lines += [f"| {name} | {fmt(get(off, *path))} |" + (f" {fmt(get(on, *path))} |" if on else "")
              for name, path in rows]
    if result.get("speculative"):
        lines += ["", "| batch | speculative step / plain step | " +
                  " | ".join(f"implied speed-up at acceptance {a}" for a in ACCEPTANCE) + " |",
                  "|---|---|" + "---|" * len(ACCEPTANCE)]
        for b, r in result["speculative"].items():
            lines.append(f"| {b[5:]} | {r['step_cost']:.2f} | " +
                         " | ".join(f"{r[f'speedup_at_{a}']:.2f}x" for a in ACCEPTANCE) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt")
    ap.add_argument("--synthetic", help="write (once) and use a ~100M-param synthetic checkpoint at this path")
    ap.add_argument("--fp8", action="store_true", help="with --synthetic: FP8 block-quantised weights")
    ap.add_argument("--reference", action="store_true", help="also run transformers at batch 1")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="with --reference: rounds of pocketllm then "
                    "transformers at batch 1; the medians and the median of each round's ratio")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--backend", default=None, help="default: torch; with --report, auto (what the server picks)")
    ap.add_argument("--device", default=None, help="default: cpu; with --report, auto")
    report_args = ap.add_argument_group("the serving report (--report)")
    report_args.add_argument("--report", action="store_true", help="TPOT, TTFT, output tokens/s, step time and "
                             "peak memory, speculation off and on, in vLLM's terms")
    report_args.add_argument("--make-config", choices=CONFIGS, help="write --ckpt DIR/config.json first: "
                             "Qwen3.5-27B FP8, or one TP4 rank's shapes of it, or a 0.8B-class Qwen3.5 (FP8, "
                             "tied embeddings or untied) of --layers layers; use with --load-format dummy")
    report_args.add_argument("--layers", type=int, default=24, help="with --make-config 0.8b*: decoder layers")
    report_args.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    report_args.add_argument("--dtype", default="auto")
    report_args.add_argument("--seed", type=int, default=0)
    report_args.add_argument("--speculative-tokens", type=int, default=None, help="the engine's K (default: the "
                             "engine's, by device); with --report K when speculation is on (default 2), 0: "
                             "measure with speculation off only")
    report_args.add_argument("--ttft-repeats", type=int, default=2, help="TTFT is the best of this many prompts")
    report_args.add_argument("--report-batches", default="8,32", help="batch sizes of the output tokens/s rows")
    report_args.add_argument("--ttft-lens", default="1024,8192", help="prompt lengths of the TTFT rows")
    report_args.add_argument("--json", help="also write the report's figures to this file")
    report_args.add_argument("--verbose", action="store_true", help="pocketllm's start-up lines")
    report_args.add_argument("--overlap", action="store_true", help="decode step time with --async-scheduling off "
                             "and on, side by side (--report-batches sizes)")
    args = ap.parse_args(argv)
    if args.report or args.overlap:
        args.backend, args.device = args.backend or "auto", args.device or "auto"
        if not args.ckpt:
            ap.error("--report and --overlap need --ckpt DIR")
    else:
        args.backend, args.device = args.backend or "torch", args.device or "cpu"
    return args


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.make_config:
        write_config(Path(args.ckpt), args.make_config, args.layers)
        args.make_config = None
    if args.overlap:
        result = overlap_report(args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"pocketllm {args.ckpt}, {result['machine']}, backend {result['backend']} on {result['device']}")
        print(overlap_table(result))
        return
    if args.report:
        result = report(args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"pocketllm {result['load_format']} weights, {args.ckpt}, {result['machine']}, "
              f"backend {result['off']['backend']} on {result['off']['device']}")
        print(report_table(result))
        return
    if args.synthetic:
        make_synthetic(Path(args.synthetic), args.fp8)
    ckpt = Path(args.ckpt or args.synthetic)
    batches = [int(b) for b in args.batches.split(",")]
    llm = pocketllm.LLM(ckpt, backend=args.backend, device=args.device, quiet=True, max_batch_size=max(batches),
                        max_context=args.prompt_len + args.decode + 16, load_format=args.load_format,
                        seed=args.seed, **({} if args.speculative_tokens is None else
                                           {"speculative_tokens": args.speculative_tokens}))
    params = sum((w.weight if isinstance(w, pocketllm.Linear) else w).numel()
                 for L in llm.model.layers for _, w in pocketllm.named_weights(L)) + \
        llm.model.embed_tokens.numel() + llm.model.lm_head.weight.numel()
    result = {"checkpoint": str(ckpt), "params_M": round(params / 1e6, 1), "threads": torch.get_num_threads(),
              "backend": args.backend, "speculative_tokens": llm.engine.draft_tokens,
              "fp8_dequantised_at_load": getattr(llm.model, "dense", False)}
    bench_decode(llm, 1, 4)                                                 # warm-up
    ttft, prefill = bench_prefill(llm, args.prompt_len)
    result.update(ttft_s=round(ttft, 3), prefill_tok_s=round(prefill, 1))
    for b in batches:
        result[f"decode_tok_s_batch{b}"] = round(bench_decode(llm, b, args.decode), 1)
    if args.reference:                       # rounds of ours then transformers': each round's ratio, same noise
        ref = reference_model(ckpt, args.load_format, args.seed)
        for name, clock in (("", time.perf_counter), ("cpu_time_", time.process_time)):
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(bench_ours(llm, args.decode, clock=clock))
                theirs.append(bench_reference(ref, args.decode, clock=clock))
            ratios = [a / b for a, b in zip(ours, theirs)]
            result[f"{name}decode_tok_s_batch1"] = round(statistics.median(ours), 1)
            result[f"{name}transformers_decode_tok_s_batch1"] = round(statistics.median(theirs), 1)
            result[f"{name}ratio_batch1"] = round(statistics.median(ratios), 2)
            result[f"{name}ratio_batch1_rounds"] = [round(r, 2) for r in ratios]
    result["peak_rss_mb"] = round(peak_rss_mb())
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
