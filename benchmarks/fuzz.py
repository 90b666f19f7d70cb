"""The long fuzz run (issue 20 item 2): tests/fuzzing.py's generator, at random, against a real server.

    python benchmarks/fuzz.py --requests 20000 [--workers 3] [--ckpt DIR] [--seed N] [--seconds S]

Serves the checkpoint (pocket-tiny by default) in this process, then runs --workers client processes, each
drawing bodies from the served /openapi.json (valid ones from each endpoint's schema, mutated at every depth, sent
as raw bytes, sometimes as mangled text; values inside maps and arrays replaced by nulls, wrong types, huge and
negative numbers, surrogates and deep nesting) and sending them concurrently; endpoints in the default run's
proportions, in ten rounds (--seconds: no new round after that long, so a busy machine still covers every endpoint).
Reports requests, statuses, requests/s and every finding (a 5xx, an answer out of shape, a dropped connection, a
hang past the timeout); afterwards that the engine holds no KV block or state slot and a good request succeeds.
Exit status 1 if anything was found.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import pocketllm  # noqa: E402

KEY = "fuzz-bench"
GOOD = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 1.0}
ROUNDS = 10


def run_worker(port: int, requests: int, seed: int, max_context: int, seconds: float = 0) -> dict:
    """One client process: about `requests` fuzzed bodies spread over the endpoints in rounds of a tenth each
    (none started after `seconds`, when given); statuses and findings."""
    import fuzzing
    from test_fuzz import EXAMPLES

    doc = json.loads(fuzzing.get(port, "/openapi.json", KEY)[1])
    total = sum(EXAMPLES.values())
    result = {"requests": 0, "statuses": {}, "findings": []}
    deadline = time.monotonic() + seconds if seconds else None
    round_ = 0
    while result["requests"] < requests and not (deadline and time.monotonic() > deadline):
        for path, share in EXAMPLES.items():           # at least 10 a round: a few are hypothesis's simplest
            fuzz_one(port, doc, path, max(10, requests * share // total // ROUNDS), seed * 1000 + round_,
                     max_context, result)
        round_ += 1
    return result


def fuzz_one(port: int, doc: dict, path: str, examples: int, seed: int, max_context: int, result: dict) -> None:
    """`examples` fuzzed bodies to one endpoint, their statuses and findings added to result."""
    from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings

    import fuzzing
    from test_fuzz import GENERATING

    fields = list(doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"])

    @hyp_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(fuzzing.request_strategy(doc, path, max_context, path in GENERATING))
    def one(data):
        result["requests"] += 1
        try:
            status, answer = fuzzing.send(port, path, data, KEY)
        except Exception as e:                          # a dropped connection or a hang
            result["findings"].append({"path": path, "body": data[:2000].decode("utf-8", "replace"),
                                       "problem": f"{type(e).__name__}: {e}"})
            return
        key = f"{path} {status}"
        result["statuses"][key] = result["statuses"].get(key, 0) + 1
        problem = fuzzing.check_answer(path, fields, data, status, answer)
        if problem:
            result["findings"].append({"path": path, "body": data[:2000].decode("utf-8", "replace"),
                                       "problem": problem})
    one()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--ckpt", default=str(pocketllm.DEFAULT_CKPT))
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--seconds", type=float, default=0, help="start no new round after this long (0: no limit)")
    ap.add_argument("--worker", nargs=2, type=int, metavar=("PORT", "INDEX"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        port, index = args.worker
        print(json.dumps(run_worker(port, args.requests, args.seed + index, args.max_context, args.seconds)))
        return 0

    import fuzzing
    llm = pocketllm.LLM(args.ckpt, quiet=True, max_context=args.max_context, max_batch_size=8)
    server = llm.serve(port=0, api_key=KEY, block=False, log_requests=False)
    start = time.monotonic()
    share = -(-args.requests // args.workers)
    procs = [subprocess.Popen([sys.executable, __file__, "--requests", str(share), "--seed", str(args.seed),
                               "--max-context", str(args.max_context), "--seconds", str(args.seconds),
                               "--worker", str(server.port), str(i)],
                              stdout=subprocess.PIPE, text=True) for i in range(args.workers)]
    results = [json.loads(p.communicate()[0]) for p in procs]
    elapsed = time.monotonic() - start
    statuses, findings = {}, [f for r in results for f in r["findings"]]
    for r in results:
        for key, n in r["statuses"].items():
            statuses[key] = statuses.get(key, 0) + n
    requests = sum(r["requests"] for r in results)
    idle = fuzzing.wait_idle(llm)
    good = fuzzing.send(server.port, "/v1/chat/completions", json.dumps(GOOD).encode(), KEY)[0]
    server.shutdown()
    llm.close()
    print(json.dumps({"command": " ".join(sys.argv), "seed": args.seed, "requests": requests,
                      "seconds": round(elapsed, 1), "requests_per_s": round(requests / elapsed, 1),
                      "statuses": dict(sorted(statuses.items())), "findings": len(findings),
                      "idle_afterwards": idle, "good_request_afterwards": good}, indent=1))
    for finding in findings[:20]:
        print(json.dumps({"problem": finding["problem"][:600], "path": finding["path"], "body": finding["body"]}))
    return 0 if not findings and idle and good == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
