"""What this machine could do at best on a workload: a roofline ceiling to judge the engine against.

``measure_machine`` times fp32 GEMMs on the model's own shapes and a large read/copy, best of
several, at a fixed thread count. ``w64_ceiling`` then assumes a perfect engine:

- prefill: every prompt token goes through large GEMMs at peak FLOP/s. FLOPs = 2 x non-embedding
  params per token + causal attention (QK^T and AV over the lower triangle only) + one LM-head
  GEMV per request (only the last prompt position needs logits);
- decode: all requests decode together; the batch shrinks as requests finish. Each step costs
  max(GEMM time, bytes / bandwidth), where bytes = every weight once (LM head included) + the KV
  of every running request. The first output token comes from prefill, so request i decodes
  ``max_tokens - 1`` steps.

No overheads at all (Python, sampling, scheduling, padding), so a real engine stays below it.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from benchmarks.workload import WorkloadRequest, make_w64, summarize

BYTES_PER_ELEMENT = 4   # fp32 weights and KV


@dataclass(frozen=True, slots=True)
class MachinePeaks:
    gemm_flops: float                 # best fp32 FLOP/s over the model-shaped GEMMs
    read_bytes_s: float               # streaming read (sum of a large tensor)
    copy_bytes_s: float               # read + write bytes of a large copy
    num_threads: int
    gemm_by_shape: tuple[tuple[tuple[int, int, int], float], ...] = ()   # ((M, K, N), FLOP/s)


@dataclass(frozen=True, slots=True)
class StepBound:
    gemm_s: float     # FLOPs / peak FLOP/s
    memory_s: float   # bytes / read bandwidth

    @property
    def bound_s(self) -> float:
        return max(self.gemm_s, self.memory_s)


@dataclass(frozen=True, slots=True)
class CeilingResult:
    prefill_s: float
    decode_s: float
    num_decode_steps: int
    prompt_tokens: int
    output_tokens: int
    memory_bound_steps: int   # decode steps where bandwidth, not FLOPs, sets the time

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.total_s


# ---------------------------------------------------------------- model arithmetic


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    hidden: int
    q_dim: int            # heads x head_dim
    kv_dim: int           # kv heads x head_dim
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers, hidden=config.hidden_size,
            q_dim=config.num_attention_heads * head_dim,
            kv_dim=config.num_key_value_heads * head_dim,
            intermediate=config.intermediate_size, vocab=config.vocab_size,
        )

    @property
    def layer_params(self) -> int:
        attn = self.hidden * (2 * self.q_dim + 2 * self.kv_dim)   # q, o, k, v projections
        return attn + 3 * self.hidden * self.intermediate         # gate, up, down

    @property
    def non_embedding_params(self) -> int:
        return self.num_layers * self.layer_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_dim * BYTES_PER_ELEMENT

    def gemm_shapes(self, num_tokens: int) -> list[tuple[int, int, int]]:
        """(M, K, N) of the projections for ``num_tokens`` rows."""
        h, m = self.hidden, num_tokens
        return [(m, h, self.q_dim), (m, h, self.kv_dim), (m, h, self.intermediate), (m, self.intermediate, h)]


def prefill_flops(shape: ModelShape, prompt_len: int) -> float:
    linear = 2.0 * shape.non_embedding_params * prompt_len
    # QK^T and AV over the causal lower triangle: 2 GEMMs x 2 FLOPs x q_dim x L^2/2 per layer.
    attention = 2.0 * shape.num_layers * shape.q_dim * prompt_len * prompt_len
    return linear + attention + 2.0 * shape.lm_head_params


def decode_step_bound(config: Any, batch_size: int, peaks: MachinePeaks, context_tokens: int = 0) -> StepBound:
    """Ideal time of one decode step of ``batch_size`` requests holding ``context_tokens`` KV in total.

    With ``context_tokens=0`` the GEMM term is the pure weight-GEMM time of the batch.
    """
    shape = ModelShape.from_config(config)
    params = shape.non_embedding_params + shape.lm_head_params
    flops = 2.0 * params * batch_size + 4.0 * shape.num_layers * shape.q_dim * context_tokens
    bytes_moved = params * BYTES_PER_ELEMENT + context_tokens * shape.kv_bytes_per_token()
    return StepBound(flops / peaks.gemm_flops, bytes_moved / peaks.read_bytes_s)


def w64_ceiling(model_config: Any, workload: list[WorkloadRequest], peaks: MachinePeaks) -> CeilingResult:
    shape = ModelShape.from_config(model_config)
    prompt_lens = [len(r.prompt_token_ids) for r in workload]
    prefill_s = sum(prefill_flops(shape, n) for n in prompt_lens) / peaks.gemm_flops
    steps_left = [r.max_tokens - 1 for r in workload]   # first token comes out of prefill
    decode_s, memory_bound, step = 0.0, 0, 0
    while True:
        step += 1
        running = [i for i, left in enumerate(steps_left) if left >= step]
        if not running:
            break
        # The step's new token attends over its prompt and every earlier output (step tokens).
        context = sum(prompt_lens[i] + step for i in running)
        bound = decode_step_bound(model_config, len(running), peaks, context)
        decode_s += bound.bound_s
        memory_bound += bound.memory_s > bound.gemm_s
    return CeilingResult(
        prefill_s=prefill_s, decode_s=decode_s, num_decode_steps=step - 1,
        prompt_tokens=sum(prompt_lens), output_tokens=sum(r.max_tokens for r in workload),
        memory_bound_steps=memory_bound,
    )


# ---------------------------------------------------------------- measurement


def _best_times(fns: list[Callable[[], Any]], rounds: int) -> list[float]:
    """Best wall time of each fn over interleaved rounds, so a burst of foreign load hits all alike."""
    for fn in fns:
        fn()   # warm-up: first call pays allocation and thread-pool start
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def measure_gemm(shapes: list[tuple[int, int, int]], repeats: int = 5) -> list[tuple[tuple[int, int, int], float]]:
    operands = [(torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)) for m, k, n in shapes]
    fns = [lambda a=a, b=b, out=out: torch.mm(a, b, out=out) for a, b, out in operands]
    seconds = _best_times(fns, repeats)
    return [((m, k, n), 2.0 * m * k * n / s) for (m, k, n), s in zip(shapes, seconds)]


def measure_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> tuple[float, float]:
    """(read, copy) bytes/s on tensors far larger than the caches."""
    src = torch.ones(num_bytes // BYTES_PER_ELEMENT)
    dst = torch.empty_like(src)
    read_s, copy_s = _best_times([src.sum, lambda: dst.copy_(src)], repeats)
    return num_bytes / read_s, 2 * num_bytes / copy_s


def measure_machine(
    model_config: Any | None = None, num_threads: int = 2, repeats: int = 5, bandwidth_bytes: int = 512 << 20
) -> MachinePeaks:
    """Peak fp32 GEMM FLOP/s (on the model's shapes, or SmolLM2's) and memory bandwidth."""
    shape = ModelShape.from_config(model_config) if model_config is not None else _SMOLLM2_SHAPE
    shapes = [s for m in (64, 512) for s in shape.gemm_shapes(m)]
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with torch.inference_mode():
            gemm = measure_gemm(shapes, repeats)
            read_bytes_s, copy_bytes_s = measure_bandwidth(bandwidth_bytes, repeats)
    finally:
        torch.set_num_threads(previous)
    return MachinePeaks(
        gemm_flops=max(f for _, f in gemm), read_bytes_s=read_bytes_s, copy_bytes_s=copy_bytes_s,
        num_threads=num_threads, gemm_by_shape=tuple(gemm),
    )


_SMOLLM2_SHAPE = ModelShape(num_layers=30, hidden=576, q_dim=576, kv_dim=192, intermediate=1536, vocab=49152)


# ---------------------------------------------------------------- CLI


def _load_config(source: str | None) -> Any:
    from transformers import AutoConfig

    from engine.model_loader import ensure_converted, resolve_source

    path, is_gguf = resolve_source(source)
    return AutoConfig.from_pretrained(ensure_converted(path) if is_gguf else path, local_files_only=True)


def report(config: Any, workload: list[WorkloadRequest], peaks: MachinePeaks) -> str:
    ceiling = w64_ceiling(config, workload, peaks)
    lines = [f"machine ({peaks.num_threads} threads): gemm {peaks.gemm_flops / 1e9:.1f} GFLOP/s, "
             f"read {peaks.read_bytes_s / 1e9:.1f} GB/s, copy {peaks.copy_bytes_s / 1e9:.1f} GB/s"]
    lines += [f"  mm {m}x{k}x{n}: {f / 1e9:.1f} GFLOP/s" for (m, k, n), f in peaks.gemm_by_shape]
    lines.append(f"workload: {summarize(workload)}")
    lines.append(f"{'prefill_s':>10} {'decode_s':>9} {'total_s':>8} {'out_tok/s':>10} {'mem-bound steps':>16}")
    lines.append(f"{ceiling.prefill_s:>10.2f} {ceiling.decode_s:>9.2f} {ceiling.total_s:>8.2f} "
                 f"{ceiling.output_tok_s:>10.1f} {ceiling.memory_bound_steps:>7}/{ceiling.num_decode_steps}")
    for batch in (1, 16, 64):
        bound = decode_step_bound(config, batch, peaks)
        lines.append(f"decode step B={batch:<3} weights only: gemm {bound.gemm_s * 1e3:.1f} ms, "
                     f"memory {bound.memory_s * 1e3:.1f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model source (default: embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="8 requests, fewer repeats")
    args = parser.parse_args()
    config = _load_config(args.model)
    print(f"load avg before measuring {os.getloadavg()[0]:.2f} (foreign load lowers the peaks)")
    workload = make_w64(num_requests=8 if args.quick else 64)
    peaks = measure_machine(config, num_threads=args.threads, repeats=5 if args.quick else 20)
    print(report(config, workload, peaks))


if __name__ == "__main__":
    main()
