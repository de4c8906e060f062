"""Baselines the engine benchmark beats or explains: plain transformers on the same workload and model.

- ``hf_static_batches``: ``model.generate`` on left-padded static batches, in arrival order. A
  batch runs until its longest request is done, so each batch generates its max ``max_tokens``
  for every member; only each request's own ``max_tokens`` count as useful output (the rest is
  the waste static batching is known for).
- ``hf_generate_batch``: transformers' own continuous batching (paged cache, per-step
  scheduling). ``generate_batch`` takes a single ``max_new_tokens`` for all prompts, so we drive
  the same manager through its public ``continuous_batching_context_manager`` + ``add_request``,
  which do take a per-request ``max_new_tokens`` and ``eos_token_id`` (-1: EOS ignored): no
  wasted tokens, the same work the engine does.

Both are greedy with EOS ignored, and both run under SDPA attention whatever the model was last
set to (the engine swaps in its paged attention on the same model object), restoring it after. Times exclude model loading and one-off warm-up; the output
rate is useful output tokens / wall seconds. Note the continuous-batching loop runs in its own
thread, which gets torch's default thread count rather than the caller's ``set_num_threads``
(OpenMP settings are per thread); on a 2-core machine both are 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import GenerationConfig, PreTrainedModel

from benchmarks.workload import WorkloadRequest, make_w64, summarize

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BaselineResult:
    name: str
    num_requests: int
    output_tokens: int      # useful: sum of each request's max_tokens
    generated_tokens: int   # everything the model produced, padding-waste included
    wall_s: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def hf_static_batches(model: PreTrainedModel, workload: list[WorkloadRequest], batch_size: int = 16) -> BaselineResult:
    """HF ``generate`` over static left-padded batches of ``batch_size``, in workload order."""
    with _sdpa(model):
        return _static_batches(model, workload, batch_size)


def hf_generate_batch(model: PreTrainedModel, workload: list[WorkloadRequest]) -> BaselineResult:
    """transformers' continuous batching, each request with its own ``max_new_tokens``, EOS ignored."""
    with _sdpa(model):
        return _generate_batch(model, workload)


def _static_batches(model: PreTrainedModel, workload: list[WorkloadRequest], batch_size: int) -> BaselineResult:
    pad_id = _pad_token_id(model)
    _warm_up(model)
    generated, start = 0, time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        input_ids, attention_mask = _left_pad([r.prompt_token_ids for r in batch], pad_id, model.device)
        max_new = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            # min_new_tokens = max_new_tokens: EOS can never end a row early, i.e. EOS ignored.
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id,
            )
        generated += (out.shape[1] - input_ids.shape[1]) * len(batch)
        logger.info("static batch %d: %d requests x %d new tokens, %.1f s elapsed",
                    first // batch_size, len(batch), max_new, time.perf_counter() - start)
    wall_s = time.perf_counter() - start
    return BaselineResult(f"hf_static_b{batch_size}", len(workload), _useful(workload), generated, wall_s)


def _generate_batch(model: PreTrainedModel, workload: list[WorkloadRequest]) -> BaselineResult:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in workload), eos_token_id=-1)
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in workload),
        max_generated_length=config.max_new_tokens, num_requests=len(workload),
    )
    results = {}
    with model.continuous_batching_context_manager(generation_config=config, workload_hints=hints) as manager:
        start = time.perf_counter()
        for i, r in enumerate(workload):
            manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
        while len(results) < len(workload):
            out = manager.get_result(timeout=5)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop died; see its log")
        wall_s = time.perf_counter() - start
    errors = [out.error for out in results.values() if out.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed in generate_batch: {errors[0]}")
    generated = sum(len(out.generated_tokens) for out in results.values())
    return BaselineResult("hf_generate_batch", len(workload), _useful(workload), generated, wall_s)


@contextlib.contextmanager
def _sdpa(model: PreTrainedModel) -> Iterator[None]:
    """Run HF code under SDPA, then give the model back with the attention it came with.

    Every layer reads the shared config's ``_attn_implementation`` at each forward, so setting the
    attribute is enough (and is what the engine's model runner does too).
    """
    previous = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        model.config._attn_implementation = previous


def _useful(workload: list[WorkloadRequest]) -> int:
    return sum(r.max_tokens for r in workload)


def _pad_token_id(model: PreTrainedModel) -> int:
    pad = model.generation_config.pad_token_id
    pad = model.config.pad_token_id if pad is None else pad
    return 0 if pad is None else int(pad)


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids.to(device), attention_mask.to(device)


def _warm_up(model: PreTrainedModel) -> None:
    with torch.inference_mode():
        model.generate(input_ids=torch.tensor([[1000, 1001]], device=model.device), max_new_tokens=2, do_sample=False,
                       pad_token_id=_pad_token_id(model))


def format_table(results: list[BaselineResult]) -> str:
    lines = [f"{'baseline':<20} {'requests':>8} {'out_tokens':>10} {'generated':>10} {'wall_s':>8} {'out_tok/s':>10}"]
    lines += [f"{r.name:<20} {r.num_requests:>8} {r.output_tokens:>10} {r.generated_tokens:>10} "
              f"{r.wall_s:>8.1f} {r.output_tok_s:>10.1f}" for r in results]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model source (default: embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="first 8 requests of W64")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--only", choices=["static", "cb"], default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)

    from engine.model_loader import load_model

    model = load_model(args.model, dtype="float32").model
    workload = make_w64(num_requests=args.num_requests or (8 if args.quick else 64))
    print(f"workload {summarize(workload)}; threads {args.threads}; load avg {os.getloadavg()[0]:.2f}")
    results = []
    if args.only in (None, "static"):
        results.append(hf_static_batches(model, workload))
    if args.only in (None, "cb"):
        results.append(hf_generate_batch(model, workload))
    print(format_table(results))


if __name__ == "__main__":
    main()
