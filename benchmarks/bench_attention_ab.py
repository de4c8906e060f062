"""The paged decode-attention kernel of this checkout against the one of another git revision, A/B in one process.

The baseline revision's ``engine/csrc/paged_attention.cpp`` (and the headers beside it) is built
as a second extension with a two-line binding, so both kernels run on the same data in the same
seconds of a shared machine: passes alternate new / baseline / read roofline, and medians are
reported, in wall time and in process CPU time (the CPU figure is the one to trust when the
machine is busy; with 2 threads it sums both).

Shapes of SmolLM2-135M (9 query heads, 3 KV heads, head dim 64, block 16, fp32), batch 64,
context lengths uniform in [--ctx-min, --ctx-max] (seeded), each request's blocks scattered over a
shuffled pool holding exactly the requests' blocks; one pass calls the kernel once per layer over
--layers layers (each layer's pool ~63 MB at the defaults, larger than the L3, so K/V come from
memory as in a real step). GB/s = K and V bytes the kernel must read / wall time; the read
roofline is ``sum()`` over each layer's whole pool with the same threads.

    python -m benchmarks.bench_attention_ab [--baseline 558baf5] [--threads-list 1,2] [--passes 9]

Writes benchmarks/results/attention_ab.txt.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import kernel_bench  # noqa: E402
from engine import cpu_kernels, paged_kernel  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BATCH = 9, 3, 64, 16, 64
RESULTS = ROOT / "benchmarks" / "results" / "attention_ab.txt"
BINDING = """
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale, bool portable);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, py::call_guard<py::gil_scoped_release>());
}
"""


def build_baseline(rev: str):
    """The kernel of git revision `rev`, built once into its own cache directory."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    src_dir = Path.home() / ".cache" / "pdserve" / "attention_baseline" / sha[:12]
    src_dir.mkdir(parents=True, exist_ok=True)
    names = subprocess.run(["git", "ls-tree", "--name-only", sha, "engine/csrc/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in [n for n in names if n.endswith((".h", "paged_attention.cpp"))]:
        text = subprocess.run(["git", "show", f"{sha}:{name}"], cwd=ROOT, check=True, capture_output=True).stdout
        (src_dir / Path(name).name).write_bytes(text)
    (src_dir / "binding.cpp").write_text(BINDING)
    from torch.utils.cpp_extension import load

    cpu_kernels._find_ninja()
    tag = hashlib.sha256(str(cpu_kernels.build_directory()).encode()).hexdigest()[:8]  # machine + torch
    build = src_dir / f"build-{tag}"
    build.mkdir(exist_ok=True)
    return sha, load(name=f"pdserve_attn_base_{sha[:12]}", sources=[str(src_dir / "paged_attention.cpp"),
                     str(src_dir / "binding.cpp")], extra_cflags=cpu_kernels.CFLAGS,
                     extra_ldflags=cpu_kernels.LDFLAGS, build_directory=str(build), verbose=False)


def setup(layers: int, ctx_min: int, ctx_max: int, seed: int = 0):
    rng = random.Random(seed)
    ctx = [rng.randint(ctx_min, ctx_max) for _ in range(BATCH)]
    nblocks = [-(-c // BLOCK) for c in ctx]
    pool = list(range(sum(nblocks)))
    rng.shuffle(pool)
    tables = torch.zeros(BATCH, max(nblocks), dtype=torch.long)
    at = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = torch.tensor(pool[at : at + nb])
        at += nb
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(2, len(pool), BLOCK, KV_HEADS, HEAD_DIM, generator=g) for _ in range(layers)]
    q = torch.randn(BATCH, HEADS, HEAD_DIM, generator=g)
    return torch.tensor(ctx), tables, caches, q


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def bench(threads: int, passes: int, baseline, data) -> list[str]:
    torch.set_num_threads(threads)
    ctx, tables, caches, q = data
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    def new_pass():
        for kv in caches:
            paged_kernel.paged_decode_attention(q, kv[0], kv[1], tables, ctx, scale, out=out)

    def old_pass():
        for kv in caches:
            baseline.paged_decode_attention(out, q, kv[0], kv[1], tables, ctx, scale, False)

    def read_pass():
        for kv in caches:
            kv.sum()

    runs = {"new": [], "baseline": [], "read": []}
    for p in range(passes + 1):   # the first round warms up and is dropped
        for name, fn in (("new", new_pass), ("baseline", old_pass), ("read", read_pass)):
            if p:
                runs[name].append(timed(fn))
            else:
                fn()
    n = len(caches)
    kv_bytes = int(ctx.sum()) * 2 * KV_HEADS * HEAD_DIM * 4
    pool_bytes = caches[0].numel() * 4
    wall = {k: statistics.median(t[0] for t in v) / n for k, v in runs.items()}
    cpu = {k: statistics.median(t[1] for t in v) / n for k, v in runs.items()}
    lines = [f"  {threads} thread(s)"]
    for name in ("baseline", "new"):
        lines.append(f"    {name:<10}{wall[name] * 1e3:>9.3f}{cpu[name] * 1e3:>9.3f}{kv_bytes / wall[name] / 1e9:>9.1f}"
                     f"{cpu['baseline'] / cpu[name]:>10.2f}x")
    lines.append(f"    {'read':<10}{wall['read'] * 1e3:>9.3f}{cpu['read'] * 1e3:>9.3f}{pool_bytes / wall['read'] / 1e9:>9.1f}")
    return lines


def main() -> None:
    def options(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--baseline", default="558baf5", help="git revision of the kernel to compare with")
        ap.add_argument("--threads-list", default="1,2")
        ap.add_argument("--layers", type=int, default=8)
        ap.add_argument("--ctx-min", type=int, default=256)
        ap.add_argument("--ctx-max", type=int, default=1024)

    args = kernel_bench.parse_args(__doc__, threads=1, results=RESULTS, extra=options)
    if not paged_kernel.available():
        sys.exit(f"kernel unavailable: {paged_kernel.unavailable_reason()}")
    sha, baseline = build_baseline(args.baseline)
    data = setup(args.layers, args.ctx_min, args.ctx_max)
    ctx, tables, caches, q = data
    new = paged_kernel.paged_decode_attention(q, caches[0][0], caches[0][1], tables, ctx, HEAD_DIM**-0.5)
    old = torch.empty_like(q)
    baseline.paged_decode_attention(old, q, caches[0][0], caches[0][1], tables, ctx, HEAD_DIM**-0.5, False)
    rel = ((new - old).abs().max() / old.abs().max()).item()
    lines = [
        *kernel_bench.header("bench_attention_ab"),
        f"new: this checkout's kernel, SIMD width {paged_kernel.simd_width()}; baseline: {sha[:12]} ({args.baseline})",
        f"batch {BATCH}, contexts uniform [{args.ctx_min}, {args.ctx_max}] (sum {int(ctx.sum())}), {HEADS} heads, "
        f"{KV_HEADS} KV heads, head dim {HEAD_DIM}, block {BLOCK}, {args.layers} layers; median of {args.passes} "
        f"alternating passes; new vs baseline, layer 0: max |diff| / max |old| = {rel:.1e}",
        f"    {'kernel':<10}{'ms/layer':>9}{'cpu ms':>9}{'GB/s':>9}{'cpu vs base':>11}",
    ]
    print("\n".join(lines), flush=True)
    for threads in (int(t) for t in args.threads_list.split(",")):
        block = bench(threads, args.passes, baseline, data)
        print("\n".join(block), flush=True)
        lines += block
    kernel_bench.write(args.out, lines)


if __name__ == "__main__":
    main()
