"""Decode attention: the paged C++ kernel against the torch path (index_select gather + SDPA), one run.

Shapes of SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head dim 64, block size 16, fp32.
Batch 64, context lengths uniform in [64, 640] (seeded), blocks of each request scattered over a
shuffled pool. One "pass" calls ``engine.attention.paged_attention`` (the function the model
calls: writes the step's K/V, then attends) once per layer, layers in turn, so each layer's KV
comes from memory as in a real step (the 30 layers' KV, ~1 GB, does not fit in cache). Decode
groups are built as ``ModelRunner`` builds them: sorted by context, ``decode_attention_group``
(16) requests per group for the torch path, one group of all 64 for the kernel (also timed in
groups of 16). Passes alternate kernel / torch / read-roofline so every ratio compares
numbers taken in the same seconds of a shared machine; medians are reported.

Effective GB/s = K and V bytes the step must read (sum of context lengths x 2 x kv_heads x
head_dim x 4 B) / time. The read roofline is ``sum()`` over each layer's whole K/V pool (the
pool holds exactly the requests' blocks), same threads.

Then, unless --skip-model: one full decode step of the real model (``load_model()``) at batch
64 in a decode-role ``LLMEngine`` (requests arrive with their KV "computed", so no prefill is
needed; the pool is filled with random values so its pages are real memory), alternating
``PDSERVE_ATTENTION`` step by step; once with each request's blocks scattered over the pool (as
after a server has run a while) and once consecutive (a fresh pool: the gather copies long runs).

    python -m benchmarks.bench_attention [--passes 7] [--steps 6] [--threads 2] [--skip-model]

Writes benchmarks/results/attention.txt.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import kernel_bench  # noqa: E402
from engine import attention, cpu_kernels, freed_memory, paged_kernel  # noqa: E402
from engine.attention import AttentionMetadata, DecodeGroup  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
BATCH, CTX_MIN, CTX_MAX = 64, 64, 640
GROUP = 16   # EngineConfig.decode_attention_group default
RESULTS = ROOT / "benchmarks" / "results" / "attention.txt"


class _Layer(torch.nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.layer_idx = idx


def _setup(seed: int = 0):
    """Context lengths, a pool holding exactly the requests' blocks (shuffled), tables, inputs."""
    rng = random.Random(seed)
    ctx = [rng.randint(CTX_MIN, CTX_MAX) for _ in range(BATCH)]
    nblocks = [-(-c // BLOCK) for c in ctx]
    pool = list(range(sum(nblocks)))
    rng.shuffle(pool)
    tables, at = [], 0
    for nb in nblocks:
        tables.append(pool[at : at + nb])
        at += nb
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(LAYERS, 2, len(pool), BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    # Layouts as transformers hands them over: [1, heads, tokens, head_dim] views of [tokens, heads*d].
    q = torch.randn(1, BATCH, HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    k = torch.randn(1, BATCH, KV_HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    v = torch.randn(1, BATCH, KV_HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    return ctx, tables, cache, q, k, v


def _metadata(ctx, tables, cache, group: int) -> AttentionMetadata:
    """As ModelRunner builds it: decode tokens sorted by context, groups of `group`, tables
    padded with block 0 to the group's longest."""
    order = sorted(range(BATCH), key=lambda i: ctx[i])
    groups = []
    for s in range(0, BATCH, group):
        members = order[s : s + group]
        mb = max(len(tables[i]) for i in members)
        cl = torch.tensor([ctx[i] for i in members])
        key_mask = torch.arange(mb * BLOCK)[None, :] < cl[:, None]
        groups.append(
            DecodeGroup(
                q_index=torch.tensor(members),
                block_tables=torch.tensor([tables[i] + [0] * (mb - len(tables[i])) for i in members]),
                key_mask=key_mask[:, None, None, :],
                context_lens=cl,
            )
        )
    last = [tables[i][(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for i, c in enumerate(ctx)]
    return AttentionMetadata(kv_cache=cache, slot_mapping=torch.tensor(last), prefills=[], decode_groups=groups)


def _attention_pass(meta, q, k, v, layers) -> float:
    t = time.perf_counter()
    for layer in layers:
        attention.paged_attention(layer, q, k, v, None, scaling=HEAD_DIM**-0.5, pdserve_attn=meta)
    return time.perf_counter() - t


def _read_pass(cache) -> float:
    t = time.perf_counter()
    for i in range(LAYERS):
        cache[i].sum()
    return time.perf_counter() - t


def _set_path(path: str) -> None:
    if path == "torch":
        os.environ[paged_kernel.ENV_VAR] = "torch"
    else:
        os.environ.pop(paged_kernel.ENV_VAR, None)


def bench_layers(passes: int) -> tuple[list[str], dict]:
    ctx, tables, cache, q, k, v = _setup()
    meta = _metadata(ctx, tables, cache, GROUP)
    meta64 = _metadata(ctx, tables, cache, BATCH)
    layers = [_Layer(i) for i in range(LAYERS)]
    kv_bytes = sum(ctx) * 2 * KV_HEADS * HEAD_DIM * 4          # per layer
    pool_bytes = cache[0].numel() * 4
    # Exactness on the benchmark's own data (layer 0) before timing.
    outs = {}
    for path in ("kernel", "torch"):
        _set_path(path)
        m = meta64 if path == "kernel" else meta
        outs[path] = attention.paged_attention(layers[0], q, k, v, None, scaling=HEAD_DIM**-0.5, pdserve_attn=m)[0]
    rel = ((outs["kernel"] - outs["torch"]).abs().max() / outs["torch"].abs().max()).item()

    runs = {"kernel": [], "kernel, 1 group of 64": [], "torch": [], "read": []}
    for _ in range(passes + 1):   # the first round warms up and is dropped
        _set_path("kernel")
        runs["kernel"].append(_attention_pass(meta, q, k, v, layers))
        runs["kernel, 1 group of 64"].append(_attention_pass(meta64, q, k, v, layers))
        _set_path("torch")
        runs["torch"].append(_attention_pass(meta, q, k, v, layers))
        runs["read"].append(_read_pass(cache))
    _set_path("kernel")
    med = {name: statistics.median(ts[1:]) / LAYERS for name, ts in runs.items()}
    lines = [
        f"per-layer decode attention, batch {BATCH}, contexts uniform [{CTX_MIN}, {CTX_MAX}] "
        f"(sum {sum(ctx)} tokens, mean {sum(ctx) / BATCH:.0f})",
        f"  the engine runs the torch path (index_select gather + SDPA) in groups of {GROUP} similar-length "
        "requests and the kernel in one call for all",
        f"  KV read per layer: {kv_bytes / 1e6:.1f} MB (pool per layer {pool_bytes / 1e6:.1f} MB; all layers "
        f"{pool_bytes * LAYERS / 1e9:.2f} GB); median of {passes} passes over the {LAYERS} layers",
        f"  kernel vs torch output, layer 0: max |diff| / max |torch| = {rel:.1e}",
        "",
        f"  {'path':<34}{'ms/layer':>10}{'GB/s KV':>10}{'vs torch':>10}",
    ]
    for name, label in (
        ("torch", "torch path, groups of 16"),
        ("kernel, 1 group of 64", "kernel, one call for all 64"),
        ("kernel", "kernel, groups of 16"),
    ):
        s = med[name]
        lines.append(f"  {label:<34}{s * 1e3:>10.3f}{kv_bytes / s / 1e9:>10.1f}{med['torch'] / s:>9.2f}x")
    lines.append(f"  {'read roofline (sum over pool)':<34}{med['read'] * 1e3:>10.3f}{pool_bytes / med['read'] / 1e9:>10.1f}")
    del cache, meta, meta64
    return lines, med


def bench_model(loaded, steps: int, shuffled: bool) -> list[str]:
    from engine.config import EngineConfig, EngineRole
    from engine.engine import LLMEngine
    from engine.types import RequestSpec, SamplingParams

    # Time the attention calls inside the step too (registered when the engine is built).
    spent = [0.0]
    plain = attention.paged_attention

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return plain(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    attention.paged_attention = timed
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 10000) for _ in range(rng.randint(CTX_MIN, CTX_MAX) - 1)] for _ in range(BATCH)]
    blocks = sum(-(-(len(p) + 2 * steps + 8) // BLOCK) for p in prompts) + 8
    try:
        engine = LLMEngine(loaded, EngineConfig(role=EngineRole.DECODE, num_kv_blocks=blocks, max_num_seqs=BATCH))
    finally:
        attention.paged_attention = plain
    if shuffled:   # a long-running server's pool: each request's blocks scattered, not consecutive
        free = list(engine.kv.pool._free)
        rng.shuffle(free)
        engine.kv.pool._free = OrderedDict.fromkeys(free)
    for i, p in enumerate(prompts):
        spec = RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=4 * steps + 16, ignore_eos=True))
        engine.reserve(spec)
        engine.commit_kv(spec.req_id, 42)
    # Random KV: a never-written zero cache maps every page to the kernel's shared zero page, which
    # reads from cache and would hide the memory traffic this benchmark is about.
    engine.cache.normal_()
    times = {"kernel": [], "torch": []}
    attn = {"kernel": [], "torch": []}
    for s in range(2 * steps + 2):            # two warm-up steps, then alternate
        path = ("kernel", "torch")[s % 2]
        _set_path(path)
        spent[0] = 0.0
        t = time.perf_counter()
        engine.step()
        if s >= 2:
            times[path].append(time.perf_counter() - t)
            attn[path].append(spent[0])
    _set_path("kernel")
    ctx = sum(len(p) + 1 for p in prompts) / BATCH
    med = {p: statistics.median(ts) for p, ts in times.items()}
    att = {p: statistics.median(ts) for p, ts in attn.items()}
    return [
        f"full decode step, {loaded.name} fp32, batch {BATCH}, mean context ~{ctx:.0f}+, "
        f"{'shuffled' if shuffled else 'consecutive (fresh pool)'} blocks (median of {steps} steps each, alternating)",
        f"  {'':<12}{'step ms':>10}{'attention ms':>14}{'rest ms':>10}",
        *(
            f"  {p:<12}{med[p] * 1e3:>10.1f}{att[p] * 1e3:>14.1f}{(med[p] - att[p]) * 1e3:>10.1f}"
            for p in ("torch", "kernel")
        ),
        f"  speed-up: step {med['torch'] / med['kernel']:.2f}x, attention {att['torch'] / att['kernel']:.2f}x",
    ]


def main() -> None:
    args = kernel_bench.parse_args(__doc__, threads=2, results=RESULTS)
    kept = freed_memory.keep()   # as the engine's process does (engine.freed_memory)
    t0 = time.perf_counter()
    built = paged_kernel.available()
    build_s = time.perf_counter() - t0
    if not built:
        sys.exit(f"kernel unavailable: {paged_kernel.unavailable_reason()}")
    lines = [
        *kernel_bench.header("bench_attention"),
        f"kernel: {paged_kernel.SOURCE.relative_to(ROOT)} {' '.join(cpu_kernels.CFLAGS)}, SIMD width "
        f"{paged_kernel.simd_width()} floats, loaded in {build_s:.1f} s (build cache {cpu_kernels.build_directory()})",
        f"shapes: SmolLM2-135M ({LAYERS} layers, {HEADS} heads, {KV_HEADS} KV heads, head dim {HEAD_DIM}), "
        f"block {BLOCK}, fp32; glibc keeps freed memory mapped: {kept} (engine.freed_memory)",
        "",
    ]
    layer_lines, _ = bench_layers(args.passes)
    lines += layer_lines
    print("\n".join(lines), flush=True)
    if not args.skip_model:
        from engine.model_loader import load_model

        loaded = load_model()
        model_lines = ["", *bench_model(loaded, args.steps, shuffled=True), *bench_model(loaded, args.steps, shuffled=False)]
        print("\n".join(model_lines), flush=True)
        lines += model_lines
    kernel_bench.write(args.out, lines)


if __name__ == "__main__":
    main()
