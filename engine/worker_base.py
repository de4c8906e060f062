"""What prefill and decode workers share: loading the model, the engine loop, and an asyncio
bridge so actor coroutines can await calls that run on the loop thread.

Life cycle: construct (loads the model, sizes the KV pool) -> ``start()`` inside the actor's
event loop -> serve -> ``shutdown()``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Callable, TypeVar

import torch

from engine import kv_cache, tracing
from engine.dtypes import torch_dtype
from engine.engine import LLMEngine, StepResult
from engine.loop import EngineLoop
from engine.types import KVEvent, KVLayout, WorkerStats
from engine.worker_spec import WorkerSpec  # noqa: F401  (workers and tests take it from here too)

logger = logging.getLogger(__name__)
T = TypeVar("T")


def load_for(spec: WorkerSpec):
    from engine.model_loader import load_model, random_model

    if spec.random_model is not None:
        loaded = random_model(**spec.random_model)
        loaded.model.to(device=spec.engine.device, dtype=torch_dtype(spec.engine.dtype))
        return loaded
    return load_model(spec.model, dtype=spec.engine.dtype, device=spec.engine.device)


def _process_start_time() -> float:
    """Wall-clock start of this process (Linux: /proc/self/stat field 22, in clock ticks since boot)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def device_identity(device: str) -> str:
    """The physical device behind ``device``, comparable across processes: Ray gives each GPU
    actor its own CUDA_VISIBLE_DEVICES, so every one of them calls its GPU cuda:0; the UUID
    tells whether two workers share a GPU (CUDA IPC) or not (NCCL)."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{torch.cuda.get_device_properties(torch.device(device)).uuid}"


class WorkerBase:
    shm_path: str | None = None   # the KV pool's /dev/shm file (decode workers on CPU set it)
    _hang_on_shutdown = False     # fault injection's "hang_shutdown" (tests only)

    def __init__(self, spec: WorkerSpec, role, standby: bool = False) -> None:
        """Loads the model and builds the engine (KV pool, scheduler); unless ``standby``, also
        its loop under ``spec.worker_id``. A standby worker is a warm spare: everything is ready
        but the loop, which ``activate`` starts under the id of the worker it replaces, in a
        fraction of a cold start (process, imports, weights and KV pool are all ready)."""
        # What a start costs (the supervisor logs it: a replacement's time to serve).
        self.startup_s = {"process_to_init": time.time() - _process_start_time()}
        begin = time.perf_counter()
        torch.set_num_threads(spec.num_threads)  # deliberate: oversubscribed threads cost 3-5x
        tracing.configure(spec.tracing, f"pdserve-{role.value}-worker")
        self.spec = spec
        self.worker_id = spec.worker_id
        self.loaded = load_for(spec)
        self.startup_s["load_model"] = time.perf_counter() - begin
        begin = time.perf_counter()
        config = replace(spec.engine, role=role)
        layout = kv_cache.layout_for(self.loaded.model.config, config)
        cache = self.allocate_cache(layout, kv_cache.num_blocks_for(layout, config))
        try:
            self.engine = LLMEngine(self.loaded, config, cache)
        except BaseException:   # e.g. a model the engine refuses: the pool must not outlive the failed start
            self.release_cache()
            raise
        self.startup_s["kv_cache_and_engine"] = time.perf_counter() - begin
        self.aio: asyncio.AbstractEventLoop | None = None
        self.closed = asyncio.Event()   # set at shutdown; a spare's lifeline waits on it before it starts
        self._kv_events: list[KVEvent] = []    # taken by the next message to the router
        self.loop: EngineLoop | None = None   # a standby spare has none until ``activate``
        if not standby:
            self.activate(spec.worker_id)

    def activate(self, worker_id: str) -> None:
        """Serve as ``worker_id``: the engine loop (named after it: its stats carry the id)."""
        self.spec = replace(self.spec, worker_id=worker_id)
        self.worker_id = worker_id
        self.loop = EngineLoop(self.engine, self._on_step_thread, name=worker_id)

    def info(self, node_id: str) -> dict:
        """What the launcher registers: who, where, on which physical device, the model's limits."""
        engine = self.engine
        return {"worker_id": self.worker_id, "node_id": node_id, "device": device_identity(self.spec.engine.device),
                "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                "eos_token_ids": sorted(engine.eos_token_ids),
                "block_size": engine.config.block_size, "model": self.loaded.name,
                "prefix_caching": engine.config.enable_prefix_caching,
                "shm_path": self.shm_path, "pid": os.getpid(), "startup_s": self.startup_s}

    def allocate_cache(self, layout: KVLayout, num_blocks: int) -> torch.Tensor | None:
        """Override to place the KV pool somewhere special; None lets the engine allocate it."""
        return None

    def release_cache(self) -> None:
        """Override with ``allocate_cache``: free what it placed outside the process (a /dev/shm file)."""

    def start(self) -> None:
        """Call from the event loop the worker's coroutines will run on."""
        self.aio = asyncio.get_running_loop()
        self.loop.start()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.loop.call(fn))

    def _on_step_thread(self, result: StepResult) -> None:
        """Loop thread -> event loop: the worker handles step results on its own loop."""
        if self.aio is not None and (result.deltas or result.prefilled or result.between_steps or result.kv_events):
            self.aio.call_soon_threadsafe(self._on_step, result)

    def _on_step(self, result: StepResult) -> None:
        self._kv_events.extend(result.kv_events)
        self.on_step(result)

    def on_step(self, result: StepResult) -> None:
        raise NotImplementedError

    def take_kv_events(self) -> tuple[KVEvent, ...]:
        """Prefix-cache events not yet reported: each message to the router (a stream batch, a
        prefill result) takes them, so each goes out once; the router notices a lost one by
        its number."""
        events, self._kv_events = tuple(self._kv_events), []
        return events

    def stats(self) -> WorkerStats:
        return self.loop.latest_stats

    async def settled_stats(self) -> WorkerStats:
        """The stats once every call queued on the engine so far has run (the loop refreshes
        them after each batch of calls): at most one step later than ``stats``."""
        await self.call(lambda e: None)
        return self.loop.latest_stats

    async def leak_report(self) -> dict:
        """What the engine still holds: tests end with none, every block free."""
        return await self.call(lambda e: {
            "requests": e.scheduler.num_unfinished + len(e.scheduler.held),
            "free_blocks": e.kv.num_free_blocks,
            "total_blocks": e.kv.num_total_blocks,
        })

    async def inject_fault(self, kind: str) -> None:
        if not self.spec.allow_fault_injection:
            raise PermissionError("fault injection is disabled on this worker")
        from engine import faults

        kind = faults.FaultKind(kind)
        if kind is faults.FaultKind.HANG_SHUTDOWN:
            self._hang_on_shutdown = True
            return
        await self.call(lambda e: faults.inject(e, kind))

    async def heartbeat(self) -> float:
        """How long the engine loop's current turn has run (0 while it waits for work): the
        router's stall watchdog (``router.stall_watch``) takes a long one, or no answer, as hung."""
        return self.loop.turn_s() if self.loop is not None else 0.0

    async def lifeline(self) -> None:
        """Returns only at shutdown: the router awaits it to learn at once that this process
        died (the call fails then), without polling."""
        await self.closed.wait()

    def shutdown(self) -> None:
        if self._hang_on_shutdown:
            from engine import faults

            faults.wedge()
        if self.loop is not None:
            self.loop.stop()
        tracing.reset()   # flushes spans still batched for export
        self.closed.set()
