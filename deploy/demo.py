"""``pdserve demo``: the engine in-process on a short workload, outputs streamed to the
terminal as they are produced, then throughput. A smoke test of the model and engine with no
Ray and no gRPC."""

from __future__ import annotations

import time

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain continuous batching in one sentence.",
    "List three prime numbers.",
    "What does a KV cache store?",
    "Translate 'good morning' into Spanish.",
    "Name a planet with rings.",
    "What is 12 times 12?",
)


def run_demo(model: str | None, num_requests: int) -> int:
    import torch

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.model_loader import load_model
    from engine.types import RequestSpec, SamplingParams

    torch.set_num_threads(max(1, torch.get_num_threads()))
    loaded = load_model(model)
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=1 << 30))
    tok = loaded.tokenizer
    texts: dict[str, list[int]] = {}
    for i in range(num_requests):
        prompt = DEMO_PROMPTS[i % len(DEMO_PROMPTS)]
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        engine.add_request(RequestSpec(f"demo-{i}", tuple(ids), SamplingParams(max_tokens=48)))
        texts[f"demo-{i}"] = []
    start, num_tokens = time.perf_counter(), 0
    while engine.has_work():
        for delta in engine.step().deltas:
            texts[delta.req_id].extend(delta.token_ids)
            num_tokens += len(delta.token_ids)
            if delta.finished:
                print(f"[{delta.req_id}] {tok.decode(texts[delta.req_id], skip_special_tokens=True)!r}", flush=True)
    elapsed = time.perf_counter() - start
    print(f"{num_requests} requests, {num_tokens} tokens in {elapsed:.1f} s: {num_tokens / elapsed:.1f} output tok/s")
    return 0
