"""The real router over simulated workers: ``SimCluster`` is the launcher's ``Cluster`` with the
Ray actors replaced by ``benchmarks/sim_workers.py`` (benchmarks and fast tests only).

Everything of the router is the launcher's own, built by ``Cluster.start``: registry, admission,
supervisor, decode-stream demux, orchestrator, metrics, the grpc.aio server. What differs is only
where the workers live: on ``SimHost``, one event loop in a thread of its own (as Ray's actors
run elsewhere), reached through ``SimActor`` handles that mimic Ray's: ``actor.method.remote(...)``
returns a ``SimRef`` (awaitable on any loop, any number of times, like an ``ObjectRef``) and
``actor.stream.remote()`` an async iterator of refs, one per ``StreamBatch``. So the router's
code paths (``router.worker_calls.call``, the streaming prefill call, the stream consumer) are the ones it runs against Ray, and the simulated workers' CPU stays on their
own thread, where ``SimHost.cpu_s`` reads it apart from the router's.

Life cycle: ``start()`` (the host thread, one simulated worker per slot, then the router as the
launcher starts it) -> serve -> ``stop()`` (the launcher's stop; then the host thread ends).
No model, no tokenizer: clients send token ids.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, AsyncIterator

from benchmarks.sim_workers import SimConfig, SimDecodeWorker, SimPrefillWorker, SimSpeed
from deploy.launcher import Cluster, ClusterConfig
from router.prefix_index import PrefixIndex
from router.registry import WorkerHandle


class SimHost:
    """The simulated workers' event loop, on a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sim-workers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def cpu_s(self) -> float:
        """CPU seconds this thread has used (the simulated workers' share of the process)."""
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


class SimRef:
    """A call's result, awaitable from any event loop, as often as wanted (like Ray's ObjectRef)."""

    __slots__ = ("future",)

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()


class _Ready:
    """A stream item already here: awaiting it costs nothing."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield  # noqa: unreachable: makes this a generator, as __await__ must return an iterator


class _Method:
    __slots__ = ("host", "fn")

    def __init__(self, host: SimHost, fn) -> None:
        self.host, self.fn = host, fn

    def remote(self, *args: Any) -> SimRef:
        return SimRef(self.host.submit(_as_coroutine(self.fn, args)))


async def _as_coroutine(fn, args):
    result = fn(*args)
    return await result if asyncio.iscoroutine(result) else result


class _OneItemStream(_Method):
    """``prefill.remote(...)``: a streaming call, as the real prefill worker's is, whose only item
    is the result (the simulated worker sends no first token ahead of its hand-off)."""

    __slots__ = ()

    def remote(self, *args: Any) -> AsyncIterator[SimRef]:
        return _one_item(super().remote(*args))


async def _one_item(ref: SimRef) -> AsyncIterator[SimRef]:
    yield ref


class _StreamMethod:
    """``stream.remote()``: the worker's batches, pumped from its loop into the caller's."""

    __slots__ = ("host", "worker")

    def __init__(self, host: SimHost, worker: SimDecodeWorker) -> None:
        self.host, self.worker = host, worker

    def remote(self) -> AsyncIterator[_Ready]:
        return _stream(self.host, self.worker)


async def _stream(host: SimHost, worker: SimDecodeWorker) -> AsyncIterator[_Ready]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        async for batch in worker.stream():
            loop.call_soon_threadsafe(queue.put_nowait, batch)

    pumping = host.submit(pump())
    try:
        while True:
            yield _Ready(await queue.get())
    finally:
        pumping.cancel()


class SimActor:
    """A simulated worker behind a Ray-like handle: ``actor.<method>.remote(*args)``."""

    def __init__(self, worker: SimPrefillWorker | SimDecodeWorker, host: SimHost) -> None:
        self.worker = worker
        self._host = host
        self._methods: dict[str, Any] = {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        methods = self.__dict__["_methods"]
        if name not in methods:
            fn = getattr(self.worker, name)
            if name == "stream":
                methods[name] = _StreamMethod(self._host, self.worker)
            else:
                methods[name] = (_OneItemStream if name == "prefill" else _Method)(self._host, fn)
        return methods[name]


class SimCluster(Cluster):
    """The launcher's cluster with simulated workers (see the module docstring)."""

    def __init__(self, config: ClusterConfig, speed: SimSpeed, sim: SimConfig | None = None) -> None:
        config.random_model = config.random_model or {"simulated": True}   # no model, no tokenizer
        config.standby_workers = False
        super().__init__(config)
        self.speed = speed
        self.sim = sim or SimConfig()
        self.host = SimHost()

    def _init_ray(self) -> None:
        """No Ray: the workers are in this process."""

    async def _start_workers(self, model_dir: str | None) -> list[dict]:
        self.host.start()
        cfg = self.config
        colocated = cfg.mode == "colocated"
        workers: list[tuple[str, Any]] = [("prefill", SimPrefillWorker(f"prefill-{i}", self.speed, self.sim))
                                          for i in range(0 if colocated else cfg.num_prefill)]
        workers += [("colocated" if colocated else "decode",
                     SimDecodeWorker(f"decode-{i}", self.speed, self.sim, colocated)) for i in range(cfg.num_decode)]
        infos = []
        for role, worker in workers:
            actor = SimActor(worker, self.host)
            info = await actor.start.remote()
            self.registry.add(WorkerHandle(info["worker_id"], role, actor, info["node_id"], info["device"],
                                           prefix=PrefixIndex(info["block_size"], info["prefix_caching"])))
            infos.append(info)
        return infos

    async def _spawn(self, worker: WorkerHandle) -> tuple[Any, dict]:
        raise RuntimeError("simulated workers are not replaced")

    def _kill(self, worker: WorkerHandle) -> None:
        """Nothing to kill: ``shutdown`` ended the worker's loop; the host thread ends in ``stop``."""

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            self.host.stop()

    def sim_workers(self) -> list[SimPrefillWorker | SimDecodeWorker]:
        return [w.actor.worker for w in self.registry.all]
