"""Launches per decoded token and host microseconds per op, for the 27B layer shapes, this tree against a
baseline revision, in one run on the native library's CPU build.

    OMP_NUM_THREADS=1 python benchmarks/host_ops.py [--baseline main] [--batch 1] [--world 1,4] [--reps 20]

A synthetic checkpoint with the 27B's layer shapes (hidden 5120, intermediate 17408, 24/4 attention heads of
256, 16/48 GDN heads of 128; FP8 layers, a 1024-row vocabulary since the head's size does not change its
launches) and 4 layers (3 Gated DeltaNet, 1 attention) is written once (zeros: values do not matter here).
For each version the model is loaded as rank 0 of `world` (TP shapes) with the native backend on the CPU build
in fp16, and decode forwards of `batch` sequences are run with the library's skip-kernels switch on
(pl_set_skip_kernels): every op checks its arguments, allocates its outputs and counts its launches, and no
kernel runs, so the time left is the host's: Python, torch allocations and cffi.

A version with LaunchRecording (section 3b) also reports the forward replayed from its recorded launch list
(what DecodeGraphs runs for a decode bucket off CUDA): host time per native call when every op of the forward is
native; a forward with a torch op that launches a kernel cannot be recorded ("refused", named).

Counted per forward of n = 1..4 layers, then scaled to the 27B's 64 layers (48 GDN + 16 attention):
  native: kernel launches the library counted (pl_launch_count);
  torch:  torch ops that launch a kernel on a GPU (every aten op but views and allocations, seen through a
          TorchDispatchMode: copies for a split, zero fills, the logit-row gather);
  nccl:   the all-reduces (two per layer, two per step for the vocab-parallel embedding and head at TP > 1).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import pocketllm  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from host_step import load_revision  # noqa: E402

DIMS = dict(vocab_size=1024, hidden_size=5120, intermediate_size=17408, num_hidden_layers=4,
            num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
            linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"], rms_norm_eps=1e-6,
            rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25}, max_position_embeddings=4096)
LAYERS_27B = {"linear_attention": 48, "full_attention": 16}


def write_checkpoint(path: Path) -> Path:
    """The 4-layer 27B-shaped FP8 checkpoint (zeros), written once."""
    if (path / "config.json").exists():
        return path
    from safetensors.torch import save_file
    sys.path.insert(0, str(ROOT / "tests"))
    import checkpoints
    path.mkdir(parents=True, exist_ok=True)
    checkpoints.make_tokenizer(path)
    d = DIMS
    D, I, Dh, Hq, Hk = d["hidden_size"], d["intermediate_size"], d["head_dim"], d["num_attention_heads"], \
        d["num_key_value_heads"]
    nk, nv, hv = d["linear_num_key_heads"] * 128, d["linear_num_value_heads"] * 128, d["linear_num_value_heads"]
    bf16 = lambda *shape: torch.zeros(*shape, dtype=torch.bfloat16)  # noqa: E731
    state = {"model.embed_tokens.weight": bf16(d["vocab_size"], D), "lm_head.weight": bf16(d["vocab_size"], D),
             "model.norm.weight": bf16(D)}

    def fp8(name, n, k):
        state[name + ".weight"] = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        state[name + ".weight_scale_inv"] = torch.full((-(-n // 128), -(-k // 128)), 0.002)
    for i, kind in enumerate(d["layer_types"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = state[p + "post_attention_layernorm.weight"] = bf16(D)
        fp8(p + "mlp.gate_proj", I, D), fp8(p + "mlp.up_proj", I, D), fp8(p + "mlp.down_proj", D, I)
        if kind == "full_attention":
            a = p + "self_attn."
            fp8(a + "q_proj", Hq * Dh * 2, D), fp8(a + "k_proj", Hk * Dh, D), fp8(a + "v_proj", Hk * Dh, D)
            fp8(a + "o_proj", D, Hq * Dh)
            state[a + "q_norm.weight"] = state[a + "k_norm.weight"] = bf16(Dh)
        else:
            a = p + "linear_attn."
            fp8(a + "in_proj_qkv", 2 * nk + nv, D), fp8(a + "in_proj_z", nv, D), fp8(a + "out_proj", D, nv)
            state[a + "in_proj_a.weight"] = state[a + "in_proj_b.weight"] = bf16(hv, D)
            state[a + "conv1d.weight"] = bf16(2 * nk + nv, 1, 4)
            state[a + "A_log"] = state[a + "dt_bias"] = bf16(hv)
            state[a + "norm.weight"] = bf16(128)
    save_file({k: v.clone().contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    config = dict(DIMS, model_type="qwen3_5_text", tie_word_embeddings=False,
                  quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    (path / "config.json").write_text(json.dumps(config))
    return path


class TorchLaunches(TorchDispatchMode):
    """Counts the aten ops that would launch a GPU kernel: all but views, allocations and metadata."""
    FREE = {"detach", "alias", "_unsafe_view", "scalar_tensor", "lift_fresh", "split", "split_with_sizes", "unbind", "chunk", "is_contiguous",
            "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_same_size"}

    def __init__(self):
        super().__init__()
        self.count, self.names = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in self.FREE or name.startswith("empty")):
            self.count += 1
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def decode_batch(module, B: int, ctx: int, block_size: int):
    """B sequences decoding their token at position ctx - 1, blocks laid out one sequence after another."""
    nblk = -(-ctx // block_size)
    tables = torch.arange(B * nblk, dtype=torch.int32).view(B, nblk)
    pos = torch.full((B,), ctx - 1, dtype=torch.long)
    slots = tables[:, (ctx - 1) // block_size].long() * block_size + (ctx - 1) % block_size
    return module.Batch(token_ids=torch.arange(B) % 7 + 3, positions=pos,
                        query_start=torch.arange(B + 1, dtype=torch.int32),
                        context_lens=torch.full((B,), ctx, dtype=torch.int32), block_tables=tables,
                        slot_mapping=slots, state_slots=torch.arange(B, dtype=torch.int32),
                        logit_rows=torch.arange(B), fresh_slots=torch.zeros(0, dtype=torch.long)), B * nblk


def launch_count(lib) -> int:
    count = lib.ffi.new("uint64_t*")
    lib.call("pl_launch_count", count)
    return int(count[0])


def measure(module, ckpt_path: Path, world: int, layers: int, B: int, reps: int) -> dict:
    """Launch counts and host seconds of one decode forward of `layers` layers at rank 0 of `world`."""
    ops = module.NativeOps("cpu", lib=module.NativeLibrary(ROOT / "build" / "libpocketllm_cpu.so"))
    ckpt = module.Checkpoint(ckpt_path)
    reduces = [0]

    def all_reduce(x):
        reduces[0] += 1
        return x
    model = module.Model(ckpt, ops, torch.float16, torch.device("cpu"), module.Shard(0, world, whole_blocks=True),
                         num_layers=layers, all_reduce=all_reduce if world > 1 else None, progress=False)
    batch, nblocks = decode_batch(module, B, 1024, 16)
    cache = module.allocate_cache(model.cfg, model.layers, nblocks, 16, B, torch.float16, torch.device("cpu"))
    calls, call = [0], ops.lib.call

    def counted(name, *args):
        calls[0] += 1
        return call(name, *args)
    ops.lib.call("pl_set_skip_kernels", 1)   # the baseline's NativeOps predates the switch
    try:
        with torch.no_grad():       # not inference_mode: there, .contiguous() would not decompose into a copy
            model.forward(batch, cache)                                # warm
            reduces[0], before, mode = 0, launch_count(ops.lib), TorchLaunches()
            ops.lib.call = counted
            with mode:
                model.forward(batch, cache)
            ops.lib.call = call
            native, nccl = launch_count(ops.lib) - before, reduces[0]
            if layers == 4 and "--verbose" in sys.argv:
                print(mode.names)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                model.forward(batch, cache)
                times.append(time.perf_counter() - t0)
            replay = replayed(module, ops, model, batch, cache, reps)
    finally:
        ops.lib.call = call
        ops.lib.call("pl_set_skip_kernels", 0)
    return dict(native=native, torch=mode.count, nccl=nccl, calls=calls[0], seconds=statistics.median(times),
                replay=replay)


def replayed(module, ops, model, batch, cache, reps: int) -> float | str | None:
    """Host seconds (median) of replaying the forward's recorded launch list (LaunchRecording, as DecodeGraphs
    does for a decode bucket); the torch op that refused the recording; None for a version without replay."""
    if not hasattr(module, "LaunchRecording"):
        return None
    recording = module.LaunchRecording(ops.lib)
    with recording:
        model.forward(batch, cache)
    if recording.refused:
        return recording.refused
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        recording.replay()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_token(rows: list[dict]) -> dict:
    """Scale forwards of 1..4 layers (GDN, GDN, GDN, attention) to the 27B's 48 GDN + 16 attention layers."""
    out = {}
    for key in rows[0]:
        gdn = rows[1][key] - rows[0][key]
        attn = rows[3][key] - rows[2][key]
        base = rows[0][key] - gdn
        out[key] = base + LAYERS_27B["linear_attention"] * gdn + LAYERS_27B["full_attention"] * attn
        out[key + "/gdn"], out[key + "/attn"] = gdn, attn
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="main", help="git revision to compare with (default: main)")
    ap.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "pocketllm-27b-shapes"),
                    help="where the synthetic 27B-shaped checkpoint is written (once)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--world", default="1,4")
    ap.add_argument("--reps", type=int, default=50, help="timed forwards of the 4-layer model (the median)")
    ap.add_argument("--verbose", action="store_true", help="print the counts of each forward of 1..4 layers")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import build
    build.build(cpu=True, quiet=True)
    path = write_checkpoint(Path(args.checkpoint))
    versions = {f"baseline {args.baseline}": load_revision(args.baseline), "this tree": pocketllm}
    print(f"decode, batch {args.batch}, 27B shapes (48 GDN + 16 attention layers), fp16, CPU build, kernels skipped")
    print("| TP | version | launches/token (native + torch + nccl) | per GDN layer | per attention layer | "
          "host ms/token | native calls/token | host us/op |")
    print("|---|---|---|---|---|---|---|---|")
    for world in (int(w) for w in args.world.split(",")):
        for name, module in versions.items():
            rows = [measure(module, path, world, n, args.batch, args.reps if n == 4 else 1) for n in range(1, 5)]
            if args.verbose:
                print(rows)
            t = per_token([{k: v for k, v in r.items() if k not in ("seconds", "replay")} for r in rows])
            total = t["native"] + t["torch"] + t["nccl"]
            layer = lambda k: t[f"native/{k}"] + t[f"torch/{k}"] + t[f"nccl/{k}"]  # noqa: E731
            us_per_op = rows[3]["seconds"] * 1e6 / (rows[3]["calls"] + rows[3]["torch"])   # the 4-layer forward
            ms = us_per_op * (t["calls"] + t["torch"]) / 1e3
            print(f"| {world} | {name} | {total} ({t['native']} + {t['torch']} + {t['nccl']}) | {layer('gdn')} | "
                  f"{layer('attn')} | {ms:.2f} | {t['calls']} | {us_per_op:.1f} |", flush=True)
            replay = rows[3]["replay"]
            if isinstance(replay, float):                            # every op native: the launch list alone
                us_per_op = replay * 1e6 / rows[3]["calls"]
                print(f"| {world} | {name}, replayed | {total} ({t['native']} + {t['torch']} + {t['nccl']}) | "
                      f"{layer('gdn')} | {layer('attn')} | {us_per_op * t['calls'] / 1e3:.2f} | {t['calls']} | "
                      f"{us_per_op:.1f} |", flush=True)
            elif replay is not None:
                print(f"| {world} | {name}, replayed | refused: the forward runs torch op `{replay}` | | | | | |",
                      flush=True)


if __name__ == "__main__":
    main()
