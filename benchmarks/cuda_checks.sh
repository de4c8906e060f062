#!/usr/bin/env bash
# The CUDA path on one GPU, checked then measured: the GPU tests (engine on cuda vs HF generate
# with decode steps as CUDA graphs and eager, graph replay vs eager logits, a one-GPU cluster
# handing KV over by CUDA IPC, the IPC round trip, the Triton paged decode-attention kernel vs
# attention over each request's own context) and the decode-graph CPU-side tests, then
# bench_attention_cuda (the Triton kernel vs the torch path, 30 layers replayed as a graph),
# profile_decode_cuda (the kernels of a graph-replayed decode step at batch 64, bf16, with and
# without engine.triton_fused's kernels), then
# bench_engine (W64 throughput vs HF, fp32 and bf16, CUDA graphs vs eager interleaved in the same
# run, with the issue's targets: >= 5,000 out tok/s, decode step at batch 64 <= 5 ms) and
# bench_disagg_overhead (in-process vs disaggregated vs colocated, one request at a time) on the
# GPU, and bench_engine bf16 once more with PDSERVE_TRITON_FUSED=off (the fused kernels' A/B).
# Results land in OUT_DIR.
#
#   bash benchmarks/cuda_checks.sh [OUT_DIR] [MODEL]
#
# OUT_DIR defaults to benchmarks/results/cuda; MODEL (an HF directory) to the embedded SmolLM2.
# On the lent machine (no Ray, no model hub): `bash benchmarks/device_bundle.sh` here, carry .dev,
# there `source benchmarks/device_setup.sh && bash benchmarks/cuda_checks.sh "$OUT/cuda" /tmp/twin`; back
# here `python -m benchmarks.results_file <fetched>/cuda benchmarks/results/cuda` puts each file on top
# of its namesake, the earlier runs kept below.
# STAGE_TIMEOUT_S bounds each stage (default 1800 s; 240 with QUICK=1). QUICK=1 fits a short loan (~5 min on an H100
# after set-up): the engine's GPU tests, the bf16 profile with and without the fused kernels, and
# bench_engine bf16 (graphs vs eager, best of two rounds, HF static batches as the peer) with and without
# them. Two rounds, not one: a fresh machine's first round in a process likely pays Triton's compiles in
# its prompt steps (session 21, fresh H100, one round: 3,955 out tok/s, prompt steps 1.2 s vs 0.9 s with
# the kernels off; the H200, its Triton cache warmed by the tests: 6,175 and 0.7 s).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/cuda}
model=${2:-}
mkdir -p "$out"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # Ray workers import the project too
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

status=0   # a failed test still lets the benchmarks run; the script's exit status reports it
quick=${QUICK:-0}
# A stage past its bound is cut (a quick run must fit one call of the lent machine: 10 min at most).
if [ "$quick" = 1 ]; then t="timeout ${STAGE_TIMEOUT_S:-240}"; else t="timeout ${STAGE_TIMEOUT_S:-1800}"; fi
tests=(tests/test_cuda.py tests/test_cuda_graphs.py tests/test_triton_attention.py tests/test_triton_prefill.py
       tests/test_triton_fused.py)
[ "$quick" = 1 ] || tests+=(tests/test_gpu_placement.py "tests/test_kvtransfer.py::test_cuda_ipc_round_trip_between_processes")
$t python3 -m pytest -q -p no:cacheprovider --timeout 300 "${tests[@]}" 2>&1 | tee "$out/tests.txt" || status=1
[ "$quick" = 1 ] || $t python3 -m benchmarks.bench_attention_cuda --out "$out/attention.txt"
$t python3 -m benchmarks.profile_decode_cuda ${model:+--model "$model"} --dtype bfloat16 | tee "$out/profile_decode_bfloat16.txt"
# The same step without engine.triton_fused's kernels (the model's own norms, rotary, KV write, SiLU).
PDSERVE_TRITON_FUSED=off $t python3 -m benchmarks.profile_decode_cuda ${model:+--model "$model"} --dtype bfloat16 \
  | tee "$out/profile_decode_bfloat16_unfused.txt"
if [ "$quick" = 1 ]; then dtypes=(bfloat16); extra=(--rounds 2 --skip-generate-batch); else dtypes=(float32 bfloat16); extra=(--rounds 2); fi
for dtype in "${dtypes[@]}"; do
  $t python3 -m benchmarks.bench_engine --device cuda --dtype "$dtype" --threads 4 ${model:+--model "$model"} \
    --decode-graphs both "${extra[@]}" --out "$out/engine_w64_$dtype.txt"
done
# bf16 decode graphs at the 2,048-token budget of the runs before session 28 (the GPU default is now
# 8,192): the budget's share of the difference, apart from the one-launch prefill kernel's.
$t python3 -m benchmarks.bench_engine --device cuda --dtype bfloat16 --threads 4 ${model:+--model "$model"} \
  --budget 2048 --decode-graphs auto --skip-static --skip-generate-batch --out "$out/engine_w64_bfloat16_budget2048.txt"
# bf16 decode graphs without the fused kernels, right after the run with them (same warm machine).
PDSERVE_TRITON_FUSED=off $t python3 -m benchmarks.bench_engine --device cuda --dtype bfloat16 --threads 4 \
  ${model:+--model "$model"} --decode-graphs auto --skip-static --skip-generate-batch --out "$out/engine_w64_bfloat16_unfused.txt"
[ "$quick" = 1 ] || $t python3 benchmarks/bench_disagg_overhead.py --device cuda ${model:+--model "$model"} --out "$out/disagg_overhead.txt"
exit $status
