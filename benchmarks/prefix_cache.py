"""The prefix cache on an agent session: prefilled tokens and time to first token per turn, cache on against
cache off, in one run.

    OMP_NUM_THREADS=2 python benchmarks/prefix_cache.py [--layers 4] [--turns 8] [--thinking on,off]
                                                        [--off-turns 1,2,8]

The model: a 0.8B-class Qwen3.5 shape (hidden 1024, MLP 3584, vocabulary 248320, attention 8 heads x 256
with 2 KV heads, Gated DeltaNet 16 x 128 key and value heads, conv 4), random bf16 weights (tests/checkpoints.py),
with --layers of its 24 layers in the real pattern (three linear-attention layers, then one full attention; fewer
than four: linear-attention layers and one full attention last), run by the torch backend in float32 on the CPU.

The session, rendered with pocket-tiny's Qwen3.5-format chat template and tokenizer (models/pocket-tiny), as the
server renders it (render_chat_prompt, and chat_snapshot_point for the snapshot at the end of the last message):
a system prompt with four tools (~2,000 tokens), then --turns turns, each adding a user message, the assistant's
tool call replayed as the openai SDK sends it (content null, arguments a JSON string, no reasoning_content) and a
~300-token tool result. Each turn is one request, generating 4 tokens; the engine is stepped on this thread and
the time to first token is from adding the request to its first token. "new" is the turn's tokens past the
longest common prefix with the previous turn's prompt: what any cache must prefill. The cache-off engine keeps
nothing between requests, so its turns are independent: --off-turns times only those (all by default), and only
in the first --thinking session.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import checkpoints  # noqa: E402
import pocketllm  # noqa: E402

SHAPE_0_8B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
TINY = ROOT / "models" / "pocket-tiny"

WORDS = ("the river flows past an old mill where the workers keep ledgers of grain, weather and prices; each "
         "entry names a city, a date and a figure in degrees or tonnes ").split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] + ("." if i % 13 == 12 else "") for i in range(n_words))


def tool(name: str, seed: int) -> dict:
    return {"type": "function", "function": {"name": name, "description": text(60, seed), "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": text(20, seed + 1)},
                                         "days": {"type": "integer", "description": text(12, seed + 2)}},
        "required": ["city"]}}}


def session(turns: int) -> tuple[list[dict], list[list[dict]]]:
    """(tools, the messages of each turn's request)."""
    tools = [tool(name, i) for i, name in enumerate(("get_weather", "get_prices", "find_ledger", "send_note"))]
    messages = [{"role": "system", "content": "You are an agent that keeps the mill's books. " + text(150, 5)}]
    requests = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Turn {t + 1}: " + text(25, t)})
        requests.append(list(messages))
        call_id = f"call_{t}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": f"City {t}", "days": t + 1})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text(97, 100 + t)})
    return tools, requests


def make_checkpoint(layers: int) -> Path:
    """The random checkpoint, written once per layer count (a minute or two) and reused from the temp dir."""
    path = Path(tempfile.gettempdir()) / f"pocketllm-bench-qwen3_5-0.8b-shape-{layers}"
    if (path / "chat_template.jinja").is_file():
        return path
    kinds = ((["linear_attention"] * 3 + ["full_attention"]) * 6)[:layers] if layers >= 4 else \
        ["linear_attention"] * (layers - 1) + ["full_attention"]
    checkpoints.make_checkpoint(path, "qwen3_5", num_hidden_layers=layers, layer_types=kinds,
                                extra_tensors=False, **SHAPE_0_8B)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):   # pocket-tiny's text side
        shutil.copy(TINY / name, path / name)
    return path


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_session(llm, tools, requests, thinking: bool, tag: str, turns: set[int] | None = None) -> list[dict]:
    rows, previous = [], []
    for t, messages in enumerate(requests):
        if turns is not None and t + 1 not in turns:
            rows.append(None)
            continue
        body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": thinking}}
        ids = llm.tokenizer.encode(pocketllm.render_chat_prompt(llm, body, tools))
        req = pocketllm.Request(f"{tag}-{t}", ids, pocketllm.SamplingParams(max_tokens=4, temperature=0,
                                                                             ignore_eos=True), default_seed=0)
        req.snapshot_at = pocketllm.chat_snapshot_point(llm, body, tools, ids)
        req.params.validate(llm.config.vocab_size)
        start, first = time.perf_counter(), None
        llm.engine.add(req)
        while llm.engine.has_work():
            llm.engine.step()
            if first is None and not req.events.empty():
                first = time.perf_counter() - start
        rows.append({"turn": t + 1, "prompt": len(ids), "new": len(ids) - common(ids, previous),
                     "prefilled": len(ids) - (req.cached_tokens or 0), "ttft": first})
        print(f"  ({tag} turn {t + 1}: {rows[-1]})", file=sys.stderr, flush=True)
        previous = ids
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 24 (default: %(default)s)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--thinking", default="on,off", help="enable_thinking per session: on, off or on,off")
    ap.add_argument("--off-turns", default="all", help="turns the cache-off engine runs: all, or e.g. 1,2,8")
    args = ap.parse_args()
    off_turns = None if args.off_turns == "all" else {int(t) for t in args.off_turns.split(",")}
    path = make_checkpoint(args.layers)
    opts = dict(backend="torch", quiet=True, max_context=8192, max_batch_size=4)
    engines = {"on": pocketllm.LLM(path, **opts), "off": pocketllm.LLM(path, prefix_cache=False, **opts)}
    tools, requests = session(args.turns)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.layers} of 24 layers; "
          f"snapshot {engines['on'].engine.snapshot_bytes / 2**20:.1f} MiB")
    for s, thinking in enumerate(args.thinking.split(",")):
        on = run_session(engines["on"], tools, requests, thinking == "on", f"{thinking}-on")
        off = run_session(engines["off"], tools, requests, thinking == "on", f"{thinking}-off",
                          off_turns if s == 0 else set())
        print(f"\nthinking {thinking}: turn | prompt | new | prefilled with the cache | TTFT on / off (s) | speed-up",
              flush=True)
        for r, o in zip(on, off):
            timed = f"{r['ttft']:6.2f} / {o['ttft']:6.2f} | {o['ttft'] / r['ttft']:5.1f}x" if o else f"{r['ttft']:6.2f} / -"
            print(f"{r['turn']:4d} | {r['prompt']:6d} | {r['new']:4d} | {r['prefilled']:5d} | {timed}")
        hit = sum(r["prompt"] - r["prefilled"] for r in on[1:]) / sum(r["prompt"] for r in on[1:])
        extra = max(r["prefilled"] - r["new"] for r in on[1:])
        print(f"turns 2-{len(on)}: {100 * hit:.1f}% of prompt tokens resumed from the cache; prefilled beyond "
              f"the new tokens: at most {extra}", flush=True)
    stats = engines["on"].stats()
    print("\ncache-on engine:", {k: v for k, v in stats.items() if k.startswith("prefix_cache") or "cached" in k})
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
