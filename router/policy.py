"""Choosing the (prefill, decode) pair for a request.

``LeastLoadedPolicy``: the prefill worker with the fewest prompt tokens in flight and the
decode worker with the most free capacity (fewest requests in flight, then most free KV
blocks). In colocated mode there are no prefill workers and the pair is (None, decode).
"""

from __future__ import annotations

from typing import Protocol

from engine.errors import WorkerFailedError
from engine.types import RequestSpec
from router.registry import WorkerHandle, WorkerRegistry


class PairPolicy(Protocol):
    def pick(self, registry: WorkerRegistry, spec: RequestSpec) -> tuple[WorkerHandle | None, WorkerHandle]: ...


class LeastLoadedPolicy:
    def pick(self, registry: WorkerRegistry, spec: RequestSpec) -> tuple[WorkerHandle | None, WorkerHandle]:
        decodes = registry.alive("decode")
        if not decodes:
            raise WorkerFailedError("no decode worker is alive")
        decode = min(decodes, key=_decode_load)
        if not registry.prefill:
            return None, decode
        prefills = registry.alive("prefill")
        if not prefills:
            raise WorkerFailedError("no prefill worker is alive")
        return min(prefills, key=lambda w: w.num_inflight_tokens), decode


def _decode_load(w: WorkerHandle) -> tuple[int, int]:
    free = w.stats.num_free_blocks if w.stats else 0
    return (w.num_inflight, -free)
