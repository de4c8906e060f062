"""Engine throughput on W64, side by side with HF baselines and the machine's ceiling, in one run.

W64 (benchmarks/workload.py): 64 requests, prompts uniform in [64, 512], outputs uniform in
[64, 128], random ids, greedy, EOS ignored, all submitted at once. SmolLM2-135M fp32, 2 threads.
Rows: pdserve's engine (colocated, chunked prefill), HF ``generate`` over left-padded static
batches of 16, transformers' continuous batching (``generate_batch``), and the ceiling computed
from this machine's measured fp32 GEMM throughput and memory bandwidth. Also: pdserve's decode
step at batch 64 against its GEMM-bound time, and the engine's own per-step overhead
(scheduling, input preparation, sampling = step time outside the model forward).

    python -m benchmarks.bench_engine [--num-requests 64] [--skip-generate-batch] [--skip-static] [--out FILE]

``--skip-generate-batch`` leaves out the slowest row (~10 min): pdserve, HF static and the
ceiling then take ~5 min. Also reported: the split of the engine's step time between steps with
prompt tokens and decode-only steps, and one 512-token prompt's prefill alone against its
ceiling (the TTFT floor).

On a GPU (``--device cuda [--dtype bfloat16] [--model DIR]``) the rows are the same but the
ceiling (a CPU model of this machine) is left out; CUDA timings synchronize at every step,
since each step reads its sampled tokens back to the host. ``--decode-graphs both`` runs the
engine with decode steps replayed as CUDA graphs and eager, interleaved over ``--rounds`` (best
of each), and checks the issue's targets on the graphs' row: W64 >= 5,000 output tok/s and the
decode step at batch 64 <= 5 ms (``--decode-graphs auto``: graphs only; ``eager``: none).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from dataclasses import dataclass, field

import torch

from benchmarks.baselines import hf_generate_batch, hf_static_batches
from benchmarks.ceiling import ModelShape, decode_step_bound, measure_machine, prefill_flops, w64_ceiling
from benchmarks.results_file import write_run
from benchmarks.workload import make_w64, summarize
from engine.config import EngineConfig, GraphMode, default_token_budget
from engine.engine import LLMEngine
from engine.model_loader import load_model
from engine.types import RequestSpec, SamplingParams


@dataclass(slots=True)
class EngineRun:
    wall_s: float
    output_tokens: int
    forward_s: float
    step_s: float
    decode64_ms: float | None     # median decode-only step with 64 sequences
    decode64_kv: int              # its KV tokens (for the bound)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    graphs: str = "eager"         # decode graphs: captured count and time, replays, fallbacks
    prefill_steps_s: float = 0.0  # steps that ran prompt tokens (decodes may ride along)
    decode_steps_s: float = 0.0   # decode-only steps

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_engine(loaded, workload, budget: int | None, device: str = "cpu", dtype: str = "float32",
               decode_graphs: GraphMode = GraphMode.AUTO) -> EngineRun:
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=3 << 30, max_num_seqs=64, max_num_batched_tokens=budget,
                                            device=device, dtype=dtype, decode_graphs=decode_graphs))
    forward = _time_forward(engine)
    specs = [RequestSpec(f"w{i}", tuple(r.prompt_token_ids), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
             for i, r in enumerate(workload)]
    start = time.perf_counter()
    outputs = engine.generate(specs)
    wall = time.perf_counter() - start
    steps = _all_steps(engine)
    full = sorted((s.duration_s, s.num_kv_tokens) for s in steps if s.num_seqs == 64 and s.num_prefill_tokens == 0)
    mid = full[len(full) // 2] if full else (None, 0)
    prefill_s = sum(s.duration_s for s in steps if s.num_prefill_tokens)
    return EngineRun(wall, sum(len(o) for o in outputs.values()), forward[0], sum(s.duration_s for s in steps),
                     mid[0] * 1e3 if mid[0] else None, mid[1], outputs, _graphs_summary(engine),
                     prefill_s, sum(s.duration_s for s in steps) - prefill_s)


def _graphs_summary(engine: LLMEngine) -> str:
    g = engine.runner.graphs
    if g is None:
        return "eager"
    fallbacks = ", ".join(f"{f.value} {n}" for f, n in g.fallbacks.items()) or "none"
    return (f"{g.num_graphs} graphs captured in {g.capture_s:.1f} s; {g.num_replays} decode steps replayed; "
            f"eager fallbacks: {fallbacks}")


def engine_rows(loaded, workload, args) -> list[tuple[str, EngineRun]]:
    """The engine's rows: one run, or graphs and eager interleaved over rounds (best wall of each)."""
    modes = {"auto": [GraphMode.AUTO], "eager": [GraphMode.EAGER], "both": [GraphMode.AUTO, GraphMode.EAGER]}
    chosen = modes[args.decode_graphs]
    best: dict[GraphMode, EngineRun] = {}
    for _ in range(args.rounds if len(chosen) > 1 else 1):
        for mode in chosen:
            run = run_engine(loaded, workload, args.budget, args.device, args.dtype, mode)
            if mode not in best or run.wall_s < best[mode].wall_s:
                best[mode] = run
    if len(chosen) == 1:
        return [("pdserve engine", best[chosen[0]])]
    return [("pdserve engine, CUDA graphs", best[GraphMode.AUTO]), ("pdserve engine, eager", best[GraphMode.EAGER])]


def time_prefill(loaded, prompt_len: int, repeats: int = 3, device: str = "cpu", dtype: str = "float32") -> float:
    """Best-of-``repeats`` time to first token of one ``prompt_len``-token prompt alone in the engine
    (one prefill step: the budget holds the whole prompt; no prefix cache, so every run computes it)."""
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=max(prompt_len, 512),
                                            device=device, dtype=dtype, enable_prefix_caching=False))
    prompt = tuple(make_w64(1, seed=99, prompt_range=(prompt_len, prompt_len))[0].prompt_token_ids)
    best = float("inf")
    for i in range(repeats + 1):   # the first run warms up
        spec = RequestSpec(f"ttft{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        engine.generate([spec])
        best = min(best, time.perf_counter() - start) if i else best
    return best


def _time_forward(engine: LLMEngine) -> list[float]:
    """Wrap the model forward to separate it from the engine's own per-step work."""
    total = [0.0]
    execute = engine.runner.execute

    def timed(inputs):
        t = time.perf_counter()
        out = execute(inputs)
        if out.is_cuda:  # kernels run asynchronously: count them, not their launches
            torch.cuda.synchronize(out.device)
        total[0] += time.perf_counter() - t
        return out

    engine.runner.execute = timed
    engine._step_log = []
    step = engine._record_timing

    def record(out, duration_s):
        timing = step(out, duration_s)
        engine._step_log.append(timing)
        return timing

    engine._record_timing = record
    return total


def _all_steps(engine: LLMEngine):
    return engine._step_log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=int, default=None,
                        help="engine max_num_batched_tokens (default: 2048 on CPU, as in the recorded CPU runs; "
                             "on CUDA the engine's GPU default, engine.config.default_token_budget)")
    parser.add_argument("--skip-generate-batch", action="store_true")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--decode-graphs", choices=("auto", "eager", "both"), default="auto",
                        help="decode steps as CUDA graphs on a GPU (auto), never (eager), or both side by side")
    parser.add_argument("--rounds", type=int, default=2, help="with --decode-graphs both: interleaved rounds")
    parser.add_argument("--prefill-len", type=int, default=512, help="prompt of the lone-prefill (TTFT) row")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time with this process's CPU time instead of the wall clock: with --threads 1 on a "
                             "busy shared machine it leaves out the time other processes held the core (A/B only)")
    parser.add_argument("--out", default="benchmarks/results/engine_w64.txt")
    args = parser.parse_args()
    if args.budget is None and args.device == "cpu":
        args.budget = 2048
    if args.decode_graphs == "both" and not args.device.startswith("cuda"):
        parser.error("--decode-graphs both compares CUDA graphs with eager: it needs --device cuda")
    torch.set_num_threads(args.threads)
    if args.cpu_clock:
        time.perf_counter = time.process_time   # every timer below (engine steps, peaks, baselines) reads it
    load = os.getloadavg()
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    workload = make_w64(num_requests=args.num_requests)
    on_cpu = args.device == "cpu"
    peaks = measure_machine(loaded.model.config, num_threads=args.threads) if on_cpu else None
    ceiling = w64_ceiling(loaded.model.config, workload, peaks) if on_cpu else None
    engines = engine_rows(loaded, workload, args)
    ours = engines[0][1]
    ttft = time_prefill(loaded, args.prefill_len, device=args.device, dtype=args.dtype)
    rows = [(name, run.output_tok_s, run.wall_s) for name, run in engines]
    if not args.skip_static:
        static = hf_static_batches(loaded.model, workload, batch_size=16)
        rows.append(("HF generate, static batches of 16", static.output_tok_s, static.wall_s))
    if not args.skip_generate_batch:
        cb = hf_generate_batch(loaded.model, workload)
        rows.append(("transformers generate_batch", cb.output_tok_s, cb.wall_s))
    if ceiling is not None:
        rows.append(("machine ceiling (GEMM + bandwidth)", ceiling.output_tok_s, ceiling.total_s))
    text = report(args, workload, peaks, ceiling, ours, rows, loaded, ttft, load)
    if len(engines) > 1 or ours.graphs != "eager":
        text += "\n" + graphs_report(engines)
    print(text)
    write_run(args.out, text)


def graphs_report(engines: list[tuple[str, EngineRun]]) -> str:
    """Decode graphs vs eager, same run; the issue's targets on the graphs' row."""
    lines = ["", f"{'engine':<30}{'out tok/s':>10}{'decode@64 ms':>14}  decode graphs"]
    for name, run in engines:
        step = f"{run.decode64_ms:.2f}" if run.decode64_ms else "-"
        lines.append(f"{name:<30}{run.output_tok_s:>10.1f}{step:>14}  {run.graphs}")
    graphs = engines[0][1]
    if len(engines) > 1:
        eager = engines[1][1]
        same = sum(graphs.outputs[k] == eager.outputs[k] for k in graphs.outputs)
        lines.append(f"graphs / eager: {graphs.output_tok_s / eager.output_tok_s:.2f}x tok/s"
                     + (f", decode step {eager.decode64_ms / graphs.decode64_ms:.2f}x faster"
                        if graphs.decode64_ms and eager.decode64_ms else "")
                     + f"; requests with tokens equal to eager: {same}/{len(graphs.outputs)}")
    tok_ok = graphs.output_tok_s >= 5000
    step_ok = graphs.decode64_ms is not None and graphs.decode64_ms <= 5.0
    lines.append(f"target W64 >= 5,000 out tok/s: {graphs.output_tok_s:.0f}  {'PASS' if tok_ok else 'MISS'}")
    lines.append(f"target decode step at batch 64 <= 5 ms: "
                 f"{graphs.decode64_ms if graphs.decode64_ms else float('nan'):.2f}  {'PASS' if step_ok else 'MISS'}")
    return "\n".join(lines)


def report(args, workload, peaks, ceiling, ours: EngineRun, rows, loaded, ttft_s: float, load) -> str:
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine()
    end_load = os.getloadavg()
    clock = "CPU time of this process (--cpu-clock)" if args.cpu_clock else "wall"
    lines = [f"bench_engine  {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"machine: {device}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; clock: {clock}",
             f"load avg (1, 5, 15 min) at start {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; "
             f"at end {end_load[0]:.2f}, {end_load[1]:.2f}, {end_load[2]:.2f}",
             f"model: {loaded.name} {args.dtype} on {args.device}; workload: {summarize(workload)}",
             f"engine: {args.budget or default_token_budget(args.device)} tokens a step, 64 sequences at most"]
    if peaks is not None:
        lines.append(f"peaks: GEMM {peaks.gemm_flops / 1e9:.1f} GFLOP/s, read {peaks.read_bytes_s / 1e9:.1f} GB/s")
    lines += ["", f"{'system':<38}{'out tok/s':>10}{'wall s':>9}{'vs HF static':>14}{'vs ceiling':>12}"]
    static = next((r[1] for r in rows if r[0].startswith("HF generate")), None)
    for name, tok_s, wall in rows:
        vs_static = f"{tok_s / static:.2f}x" if static else "-"
        vs_ceiling = f"{tok_s / ceiling.output_tok_s:>11.0%}" if ceiling else f"{'-':>11}"
        lines.append(f"{name:<38}{tok_s:>10.1f}{wall:>9.1f}{vs_static:>14}{vs_ceiling}")
    overhead = 1 - ours.forward_s / ours.step_s
    lines.append(f"\nengine step time: {ours.prefill_steps_s:.1f} s in steps with prompt tokens, "
                 f"{ours.decode_steps_s:.1f} s in decode-only steps")
    if ceiling is None:
        lines.append(f"\nengine per-step overhead (scheduling, inputs, sampling): {overhead:.1%} of step time")
        if ours.decode64_ms:
            lines.append(f"decode step at batch 64 (KV {ours.decode64_kv} tokens): {ours.decode64_ms:.2f} ms")
        return "\n".join(lines)
    lines.append(f"ceiling breakdown: prefill {ceiling.prefill_s:.1f} s + decode {ceiling.decode_s:.1f} s")
    if ours.decode64_ms:
        bound_ms = decode_step_bound(loaded.model.config, 64, peaks).gemm_s * 1e3
        ratio = ours.decode64_ms / bound_ms
        lines.append(f"decode step at batch 64 (KV {ours.decode64_kv} tokens): {ours.decode64_ms:.2f} ms vs GEMM-bound "
                     f"{bound_ms:.2f} ms = {ratio:.3f}x (target <= 1.5x: {'PASS' if ratio <= 1.5 else 'MISS'})")
    floor = prefill_flops(ModelShape.from_config(loaded.model.config), args.prefill_len) / peaks.gemm_flops
    lines.append(f"prefill of one {args.prefill_len}-token prompt (TTFT, best of 3): {ttft_s * 1e3:.0f} ms vs ceiling "
                 f"{floor * 1e3:.0f} ms = {floor / ttft_s:.0%} of the ceiling (target >= 80%)")
    lines.append(f"engine per-step overhead (scheduling, inputs, sampling): {overhead:.1%} of step time (target < 10%)")
    lines.append(f"target: pdserve >= 70% of ceiling: {'PASS' if ours.output_tok_s >= 0.7 * ceiling.output_tok_s else 'MISS'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
