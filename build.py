"""Build libpocketllm from csrc/*.cu.

    python build.py                    # CUDA build: build/libpocketllm.so for sm_75 and sm_90 (nvcc)
    python build.py --arch 75,80,86,89,90
    python build.py --cpu              # CPU test build: build/libpocketllm_cpu.so (g++ + AddressSanitizer)
    python build.py --nvcc /usr/local/cuda-12.8/bin/nvcc    # another toolkit (or env NVCC), e.g. CUDA 12
    python build.py --nvcc PATH --cudart DIR   # a toolkit without its own static runtime: DIR/include,
                                               # DIR/lib/libcudart_static.a (the nvidia-cuda-runtime-cu12 wheel's
                                               # site-packages/nvidia/cuda_runtime has exactly that layout)

The CUDA runtime is linked statically, so the library runs on any driver that supports the toolkit's CUDA major
version: CUDA 13.x needs driver 580.65.06 or newer, CUDA 12.x 525.60.13 or newer (docs/abi.md, "Drivers").

Both builds compile the same sources; the CPU build runs the kernels through the execution layer in
csrc/runtime.cuh (docs/native.md). Each source compiles to a cached object (keyed by a hash of its
text, the headers and the flags), so only changed files recompile; the link is skipped when nothing changed.
The exact compiler commands are printed.

Loading the CPU build: it is compiled with -fsanitize=address against the shared libasan. Best is to start the
process with `LD_PRELOAD=$(g++ -print-file-name=libasan.so)` (see asan_env()); then ASan also checks heap memory
such as torch's tensors. Loaded into a process without the preload, pocketllm.py sets
ASAN_OPTIONS=verify_asan_link_order=0 first: stack, global and shared-memory checks still work, heap checks do not.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
BUILD = ROOT / "build"
DEFAULT_ARCH = "75,90"
NVCC_CANDIDATES = ("nvcc", "/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc")


class BuildError(RuntimeError):
    """A compiler is missing or a compile failed; the message holds the command and the compiler's output."""


def find_nvcc(nvcc: str | None = None) -> str | None:
    """The nvcc to use: `nvcc` if given, else $NVCC, then PATH, then the usual install places."""
    for cand in (nvcc or os.environ.get("NVCC") or "",) + NVCC_CANDIDATES:
        path = shutil.which(cand) if cand else None
        if path:
            return path
        if cand and cand == nvcc:
            return None            # an explicit choice that does not exist is not replaced by another
    return None


def toolkit_version(nvcc: str) -> str:
    """"cuda 12.8" from `nvcc --version`: part of the objects' cache key, so switching toolkits rebuilds."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    if not found:
        raise BuildError(f"{nvcc} --version names no CUDA release:\n{out}")
    return f"cuda {found.group(1)}"


def find_cxx() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def asan_runtime() -> str | None:
    """Path of the shared AddressSanitizer runtime that the CPU build links against (None if unknown)."""
    cxx = find_cxx()
    if not cxx:
        return None
    out = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return out if out and os.path.isabs(out) and os.path.exists(out) else None


def asan_env(base: dict | None = None) -> dict:
    """Environment for a subprocess that loads the CPU build with full ASan checking (heap included)."""
    env = dict(os.environ if base is None else base)
    runtime = asan_runtime()
    if runtime:
        env["LD_PRELOAD"] = runtime
    # Python itself "leaks" by design, and torch installs its own signal handlers.
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0:verify_asan_link_order=0")
    return env


def gencode_flags(arch: str) -> list[str]:
    """SASS for every listed arch, plus PTX of the lowest so that newer GPUs (e.g. sm_86) can JIT it."""
    archs = sorted({int(a) for a in arch.replace(" ", "").split(",") if a})
    if not archs:
        raise BuildError(f"--arch {arch!r} names no architecture (expected e.g. 75,90)")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[0]},code=compute_{archs[0]}")
    return flags


def compiler(cpu: bool, nvcc: str | None = None) -> str:
    """The compiler's path; BuildError when it is missing."""
    found = find_cxx() if cpu else find_nvcc(nvcc)
    if not found:
        raise BuildError("no host C++ compiler found (set CXX or install g++)" if cpu else
                         f"nvcc not found{f' at {nvcc}' if nvcc else ''} (install the CUDA toolkit, put nvcc on "
                         f"PATH, set NVCC or pass --nvcc)")
    return found


def compile_command(cpu: bool, arch: str, source: Path, obj: Path, cc: str | None = None,
                    cudart: Path | str | None = None) -> list[str]:
    """The exact command that compiles one source file into an object file (cc: the compiler to name; cudart:
    a CUDA runtime directory whose include/ comes first)."""
    cc = cc or compiler(cpu)
    if cpu:
        return [cc, "-std=c++17", "-O1", "-g", "-fPIC", "-fsanitize=address", "-fno-omit-frame-pointer",
                "-fvisibility=hidden", "-fno-gnu-unique", "-Wall",
                "-Wno-unknown-pragmas", "-Wno-unused-function", "-x", "c++", "-c", str(source), "-o", str(obj)]
    include = ["-I", str(Path(cudart) / "include")] if cudart else []
    # --threads 0: the archs of one file compile in parallel (linear.cu's templates dominate the build's time).
    return [cc, "-O3", "-std=c++17", "--threads", "0", "-Xcompiler", "-fPIC,-fvisibility=hidden",
            *gencode_flags(arch), *include, "-c", str(source), "-o", str(obj)]


def link_command(cpu: bool, objects: list[Path], out: Path, cc: str | None = None,
                 cudart: Path | str | None = None) -> list[str]:
    """The exact command that links the objects into the shared library (cudart: link that directory's
    lib/libcudart_static.a instead of the toolkit's own)."""
    objs, cc = [str(o) for o in objects], cc or compiler(cpu)
    # -z nodelete: the library (and the ASan runtime it pulls in) stays loaded when cffi's handle is collected;
    # a second load of ASan in one process cannot map its shadow memory again.
    if cpu:
        return [cc, "-shared", "-fsanitize=address", "-Wl,-z,nodelete", *objs, "-o", str(out), "-ldl"]
    # A static runtime: no libcudart needed at run time; --exclude-libs keeps it private next to torch's.
    runtime = (["-cudart", "none", str(Path(cudart) / "lib" / "libcudart_static.a"), "-lrt", "-lpthread"]
               if cudart else ["-cudart", "static"])
    return [cc, "-shared", *runtime, "-Xlinker", "--exclude-libs,ALL", "-Xlinker", "-z,nodelete",
            *objs, "-o", str(out), "-ldl"]


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part + b"\0")
    return h.hexdigest()


def _run(cmd: list[str], quiet: bool) -> None:
    if not quiet:
        print(shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"build failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.stderr.strip() and not quiet:
        print(proc.stderr, file=sys.stderr, end="")


def build(arch: str = DEFAULT_ARCH, cpu: bool = False, src_dir: Path | str = CSRC, out_dir: Path | str = BUILD,
          obj_dir: Path | str | None = None, force: bool = False, quiet: bool = False, nvcc: str | None = None,
          cudart: Path | str | None = None) -> Path:
    """Compile src_dir/*.cu into out_dir/libpocketllm.so (or libpocketllm_cpu.so) and return its path.

    Each source compiles to an object cached in obj_dir (default out_dir/obj) by a hash of its text, every
    header in src_dir, the flags and the CUDA toolkit's version, so a change to one kernel file recompiles that
    file only (in parallel). The up-to-date check names neither paths nor the compiler's location, so a library
    built on one machine and copied with its .stamp counts as built on another (even one without a compiler);
    where an nvcc is found, the stamp's toolkit version must also be its version. nvcc: the compiler (default
    find_nvcc()); cudart: a CUDA runtime directory to link statically instead of the toolkit's (see the module
    docstring). Raises BuildError with the command and the compiler output.
    """
    src_dir, out_dir = Path(src_dir).resolve(), Path(out_dir).resolve()
    sources = sorted(src_dir.glob("*.cu"))
    if not sources:
        raise BuildError(f"no .cu sources in {src_dir}")
    out = out_dir / ("libpocketllm_cpu.so" if cpu else "libpocketllm.so")
    obj_dir = Path(obj_dir).resolve() if obj_dir else out_dir / "obj"
    headers = b"".join(p.name.encode() + p.read_bytes() for p in sorted(src_dir.iterdir())
                       if p.suffix in (".cuh", ".h"))
    cc_name, rt_name = ("c++", None) if cpu else ("nvcc", "CUDART" if cudart else None)
    flags = " ".join(compile_command(cpu, arch, Path("SRC"), Path("OBJ"), cc_name, rt_name)).encode()
    keys = [_digest(flags, headers, s.read_bytes())[:20] for s in sources]
    link_flags = " ".join(link_command(cpu, [], Path("OUT"), cc_name, rt_name)).encode()
    stamp = out.with_name(out.name + ".stamp")
    digest = _digest(link_flags, *(f"{s.stem}.{k}".encode() for s, k in zip(sources, keys)))
    found = None if cpu else find_nvcc(nvcc)
    toolkit = "host c++" if cpu else toolkit_version(found) if found else None
    out_dir.mkdir(parents=True, exist_ok=True)
    header = out_dir / f"pocketllm.h.{os.getpid()}.tmp"        # pocketllm.py reads the ABI from build/pocketllm.h:
    shutil.copyfile(src_dir / "pocketllm.h", header)             # replaced whole, never seen half-written by a
    header.replace(out_dir / "pocketllm.h")                       # test while a background build starts
    built = stamp.read_text().split("\n") if out.exists() and stamp.exists() else []
    if not force and built[:1] == [digest] and (toolkit is None or built[1:2] == [toolkit]):
        return out
    cc = compiler(cpu, nvcc)
    objects = [obj_dir / f"{s.stem}.{_digest(k.encode(), toolkit.encode())[:20]}.o" for s, k in zip(sources, keys)]
    obj_dir.mkdir(parents=True, exist_ok=True)
    todo = [(s, o) for s, o in zip(sources, objects) if force or not o.exists()]
    todo.sort(key=lambda job: -job[0].stat().st_size)         # the longest compiles start first

    def compile_one(job):
        src, obj = job
        tmp = obj.with_name(f"{obj.name}.{os.getpid()}.tmp")   # written aside, renamed when complete
        _run(compile_command(cpu, arch, src, tmp, cc, cudart), quiet)
        tmp.replace(obj)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for f in [pool.submit(compile_one, job) for job in todo]:
            f.result()
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")   # concurrent builds never see half a file
    _run(link_command(cpu, objects, tmp, cc, cudart), quiet)
    tmp.replace(out)
    stamp.write_text(f"{digest}\n{toolkit}\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=DEFAULT_ARCH, help="comma-separated SM versions (default %(default)s)")
    ap.add_argument("--cpu", action="store_true", help="the CPU test build with g++ and AddressSanitizer")
    ap.add_argument("--force", action="store_true", help="rebuild even when nothing changed")
    ap.add_argument("--nvcc", help="the nvcc to use (default: $NVCC, PATH, /usr/local/cuda/bin/nvcc)")
    ap.add_argument("--cudart", help="a CUDA runtime dir (include/, lib/libcudart_static.a) to link statically "
                                     "instead of the toolkit's own")
    args = ap.parse_args(argv)
    try:
        out = build(arch=args.arch, cpu=args.cpu, force=args.force, nvcc=args.nvcc, cudart=args.cudart)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
