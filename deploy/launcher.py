"""Starts and stops a pdserve cluster: Ray, workers, the gRPC router.

Life cycle: ``Cluster.start()`` joins Ray (an embedded local instance by default, or
``address``), resolves the model once, places N prefill and M decode actors in a placement
group (PACK: KV moves within a node where possible) with the cores divided among them
(``torch.set_num_threads`` per worker) and, when the engines run on "cuda", the GPUs too
(fractions when workers outnumber GPUs: a pair on one GPU moves KV by CUDA IPC), joins
them into a torch.distributed group when a pair needs it (across nodes or GPUs: ``router/kv_group.py``,
which forms it again after a member's replacement), then starts
the router's gRPC server and, when ``http_port`` is set, the OpenAI-compatible HTTP API in the
same event loop (``router/openai_api``). While it serves, the router's ``Supervisor`` replaces a worker whose
actor dies: ``_spawn`` activates a warm spare (``deploy/standby.py``) or starts a fresh actor
from the worker's own recipe (same spec, same placement group), and the health service follows
whether a serving path exists. ``stop()`` stops the supervisor, the spares and the server,
shuts every worker down (each unlinks its /dev/shm pool; one that hangs past
``stop_timeout_s`` is killed) and leaves Ray. First thing in ``start()``, before Ray: each door
(gRPC, HTTP, metrics) is bound once and released (``router/listen.py``: a port in use fails in
a second, not after the workers' start), and pools that a crashed run left on this node are reclaimed.
``ClusterThread`` runs a cluster on its own event loop in a background thread (tests, CLI).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deploy.standby import StandbyPool
from deploy.start_failure import WorkerStartError, cause_line, first_line
from deploy.ray_init import abandon_ray, abandoned, gcs_answers, init_ray, shutdown_ray, valid_address, wait_reachable
from engine import tracing
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.unix_push import UnixPusher
from engine.worker_spec import WorkerSpec
from kvtransfer.select import TRANSPORTS
from kvtransfer.shm_reclaim import reclaim_stale_segments
from router import event_loop, listen
from router.convert import ServerDefaults
from router.limits import ServerLimits
from router.openai_api.tool_parsers import PARSERS
from router.admission import Admission
from router.first_token_inbox import FirstTokenInbox
from router.health import ServingHealth
from router.kv_group import KVGroup
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.prefix_index import PrefixIndex
from router.registry import WorkerHandle, WorkerRegistry
from router.security import ServerSecurity
from router.server import PdserveServicer, ServerInfo, start_server
from router.streams import DecodeStreams
from router.supervisor import Supervisor
from router.task_ending import cancel_and_wait
from router.worker_calls import call

logger = logging.getLogger(__name__)

END_TASKS_S = 5.0   # for the cluster's own tasks to end once cancelled, before Ray shuts down


@dataclass(slots=True)
class ClusterConfig:
    mode: str = "disaggregated"          # or "colocated": decode workers also prefill
    num_prefill: int = 1
    num_decode: int = 1
    model: str | None = None             # None: the embedded SmolLM2-135M-Instruct
    random_model: dict | None = None     # tests: tiny random Llama
    # Engine device "auto": "cuda" when the Ray cluster has GPUs, else "cpu".
    prefill_engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_num_batched_tokens=512))
    decode_engine: EngineConfig = field(default_factory=EngineConfig)
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None  # GPU workers' share; None: see gpu_share()
    threads_per_worker: int | None = None  # None: the node's cores divided among the workers
    address: str | None = None           # a Ray cluster to join; None starts one here
    host: str = "127.0.0.1"
    port: int = 50051
    kv_transport: str | None = None      # force shm / torch_dist / object_store / cuda_ipc
    prefill_resources: dict | None = None  # custom Ray resources pinning workers to nodes
    decode_resources: dict | None = None
    use_placement_group: bool = True
    defaults: dict = field(default_factory=dict)  # ServerDefaults overrides (max_tokens, ttft_s, ...)
    ray_init: dict = field(default_factory=dict)  # extra ray.init arguments (num_cpus, ...)
    allow_fault_injection: bool = False  # tests only
    metrics_port: int | None = None      # Prometheus exposition on the router; None: off, 0: any free port
    admission: bool = True               # SLO-aware admission (off: admit everything, least loaded)
    conditional_disagg: bool = True      # let admission prefill on a decode worker when the prefill side misses TTFT
    migration_limit: int = 3             # times one request may move to another worker after one died
    max_worker_restarts: int | None = None  # per worker slot; None: keep replacing (with backoff)
    worker_start_timeout_s: float = 300.0   # a replacement that takes longer counts as a failed start
    # A worker whose engine step runs this long, or that answers no heartbeat this long, is hung:
    # killed and replaced, its requests migrated (router/stall_watch.py). 0: never (vLLM's engine
    # iteration timeout is 60 s too). Far above any step: a token budget bounds each.
    worker_stall_timeout_s: float = 60.0
    standby_workers: bool = True         # keep a warm spare per worker kind (CPU engines): ~1 s replacements
    security: ServerSecurity | None = None  # TLS / mTLS / bearer token on the gRPC port; None: plaintext, open
    metrics_host: str = "127.0.0.1"      # the metrics port's own bind address (not ``host``: scrapes stay local)
    stop_timeout_s: float = 30.0         # stop()'s graceful phases share this; then workers are killed regardless
    drain_timeout_s: float = 30.0        # `pdserve serve`'s stop first lets live requests finish this long (0: cut them)
    http_port: int | None = None         # the OpenAI-compatible HTTP API; None: off, 0: any free port
    http_host: str | None = None         # its bind address; None: ``host``
    served_model_name: str | None = None  # the model's name (HTTP API, ServerInfo); None: its clean name (model_name)
    tool_call_parser: str | None = None  # the model's tool-call syntax: chat's tool_choice "auto" (tool_parsers.PARSERS)
    tracing: tracing.TracingConfig | None = None  # OpenTelemetry export of router and workers; None: off (no-op)
    event_loop: str | None = None        # the router's loop (router/event_loop.py): auto, uvloop, asyncio; None: $PDSERVE_EVENT_LOOP or auto

    def __post_init__(self) -> None:
        """A configuration no cluster could serve with is refused here (ConfigError), naming the
        field, before Ray or any worker starts (`pdserve serve` reports it as a usage error, naming
        the flag)."""
        _require(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        _require(self.num_decode >= 1, "num_decode", f"must be >= 1, got {self.num_decode}")
        minimum = 1 if self.mode == "disaggregated" else 0
        _require(self.num_prefill >= minimum, "num_prefill", f"must be >= {minimum} in {self.mode} mode, "
                                                               f"got {self.num_prefill}")
        _require(self.cpus_per_worker > 0, "cpus_per_worker", f"must be > 0, got {self.cpus_per_worker}")
        _require(self.gpus_per_worker is None or self.gpus_per_worker > 0, "gpus_per_worker",
                 f"must be > 0, got {self.gpus_per_worker}")
        _require(self.threads_per_worker is None or self.threads_per_worker >= 1, "threads_per_worker",
                 f"must be >= 1, got {self.threads_per_worker}")
        for name in ("port", "metrics_port", "http_port"):
            port = getattr(self, name)
            _require(port is None or 0 <= port <= 65535, name, f"must be in [0, 65535] (0: any free port), got {port}")
        _require(valid_address(self.address), "address",
                 f"must be auto, local or [ray://]host:port with a port in 1-65535, got {self.address!r}")
        if self.model is not None and self.random_model is not None:
            raise ConfigError("{model} and {random_model} are two models: give one")
        _require(self.kv_transport is None or self.kv_transport in TRANSPORTS, "kv_transport",
                 f"must be one of {', '.join(TRANSPORTS)}, got {self.kv_transport!r}")
        _require(self.kv_transport is None or self.mode != "colocated", "kv_transport",
                 "applies to disaggregated mode only (colocated workers hand no KV over)")
        _require(self.migration_limit >= 0, "migration_limit", f"must be >= 0, got {self.migration_limit}")
        _require(self.max_worker_restarts is None or self.max_worker_restarts >= 0, "max_worker_restarts",
                 f"must be >= 0, got {self.max_worker_restarts}")
        _require(self.worker_start_timeout_s > 0, "worker_start_timeout_s", f"must be > 0, got {self.worker_start_timeout_s}")
        _require(self.worker_stall_timeout_s >= 0, "worker_stall_timeout_s",
                 f"must be >= 0 (0: off), got {self.worker_stall_timeout_s}")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
        _require(self.stop_timeout_s >= 0, "stop_timeout_s", f"must be >= 0, got {self.stop_timeout_s}")
        _require(self.tool_call_parser is None or self.tool_call_parser in PARSERS, "tool_call_parser",
                 f"must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        for name in ("ttft_s", "tpot_s"):
            target = self.defaults.get(name)
            _require(target is None or target > 0, name, f"(a default SLO target) must be > 0, got {target}")
        _require(self.defaults.get("max_tokens", 1) >= 1, "max_tokens",
                 f"(the default) must be >= 1, got {self.defaults.get('max_tokens')}")
        _require(self.served_model_name is None or self.served_model_name.strip(), "served_model_name",
                 f"must not be empty, got {self.served_model_name!r}")
        _check_distinct_ports(self.doors())

    def doors(self) -> list[tuple[str, str, int]]:
        """Where the router listens: (the port's field, host, port) of gRPC, the HTTP API and metrics."""
        doors = [("port", self.host, self.port), ("http_port", self.http_host or self.host, self.http_port),
                 ("metrics_port", self.metrics_host, self.metrics_port)]
        return [(field, host, port) for field, host, port in doors if port is not None]


MODES = ("disaggregated", "colocated")
WILDCARDS = ("", "0.0.0.0", "::", "[::]")   # a bind to these takes the port on every address


def _check_distinct_ports(doors: list[tuple[str, str, int]]) -> None:
    """Two doors on one port and one address: the second bind would fail after the cluster started,
    blamed on that door alone. Port 0 (any free port) never collides."""
    for i, (field, host, port) in enumerate(doors):
        for earlier, other_host, other_port in doors[:i]:
            if port and port == other_port and _same_address(host, other_host):
                raise ConfigError(f"{{{field}}} {port} is the same port as {{{earlier}}}")


def _same_address(a: str, b: str) -> bool:
    """Whether binds to ``a`` and ``b`` take one address (a wildcard takes them all; ``localhost``
    and ``127.0.0.1`` share one). A name that does not resolve is compared as written: the probe
    says it, naming its flag."""
    if a == b or a in WILDCARDS or b in WILDCARDS:
        return True
    try:
        return bool(_bound(a) & _bound(b))
    except OSError:
        return False


def _bound(host: str) -> set[tuple]:
    return {address[0] for _, address in listen.addresses(host, 0)}


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError.on(name, message)   # `pdserve serve` says the field as its flag


class Cluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.registry = WorkerRegistry(forced_transport=config.kv_transport)
        self.kv_group = KVGroup(self.registry)
        self.server = None
        self.port: int | None = None
        self.tokenizer = None
        self._pg = None
        self._started_ray = False   # this cluster called ray.init (joined or embedded): it shuts Ray down
        self._embedded_ray = False  # ... and that Ray is embedded: its GCS and raylet are our descendants
        self.metrics_port: int | None = None
        self.http = None                    # router.openai_api.server.HttpServer while it serves
        self.http_port: int | None = None
        self._recipes: dict[str, tuple[Any, tuple]] = {}   # worker id -> (actor class options, args)
        self.health = ServingHealth()
        self.supervisor: Supervisor | None = None
        self.standby: StandbyPool | None = None
        self._standby_recipes: dict[str, tuple[Any, tuple]] = {}   # worker kind -> (options, args)
        self._callers_tasks: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()   # start()'s snapshot

    async def start(self) -> int:
        cfg = self.config
        self._callers_tasks.update(asyncio.all_tasks())   # what runs now is the caller's, not this cluster's
        for door, host, port in cfg.doors():   # a port in use fails now, not after Ray and the workers started
            listen.probe(door, host, port)
        reclaim_stale_segments()  # pools a crashed run left on this node (workers reclaim on theirs)
        tracing.configure(cfg.tracing, "pdserve-router")
        if not ray.is_initialized():
            await wait_reachable(cfg.address)
        self._init_ray()
        model_dir, name = None, None
        if cfg.random_model is None:
            try:
                prepared = await _prepare_model_remote(cfg.model)
            except ray.exceptions.RayTaskError as exc:   # Ray's text is the task's traceback: its last line says why
                raise ValueError(f"--model {cfg.model}: {cause_line(exc)}") from exc
            model_dir, name = prepared.path, prepared.name
            if prepared.converted_s is not None:   # the conversion's own bars are for terminals only
                logger.info("converted the GGUF of %s in %.1f s into %s (later starts load that)", name,
                            prepared.converted_s, model_dir)
            from deploy.model_prep import load_tokenizer

            self.tokenizer = load_tokenizer(model_dir)
        infos = await self._start_workers(model_dir)
        await self.kv_group.form_if_needed()
        self.metrics = RouterMetrics(mode=cfg.mode, kv_transport=cfg.kv_transport or "auto")
        if self.kv_group.wanted:
            self.metrics.kv_group(lambda: self.registry.dist_ready)
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.start_http_server(cfg.metrics_port, cfg.metrics_host)
        limits = cfg.defaults.get("limits") or ServerLimits()
        self.admission = Admission(self.registry, enabled=cfg.admission, conditional=cfg.conditional_disagg,
                                   max_queued=limits.max_queued_requests)
        if cfg.admission:
            self.metrics.watch_admission(self.admission.learned)
        self.supervisor = Supervisor(self.registry, self._spawn, on_down=self._on_worker_down,
                                     on_ready=self._on_worker_ready, max_restarts=cfg.max_worker_restarts,
                                     stall_timeout_s=cfg.worker_stall_timeout_s or None,
                                     local_node_id=_this_node_id(),
                                     on_stalled=lambda w: self.metrics.worker_stalled(w.worker_id, w.role))
        self.streams = DecodeStreams(self.registry, on_stats=self._on_worker_stats, on_lost=self.supervisor.worker_lost)
        self.streams.start()
        self.supervisor.start()
        for w in self.registry.all:
            self.metrics.worker_state(w.worker_id, w.role, up=True)
        # Admission's view of each decode pool from the first request on (a burst at start would
        # otherwise meet no report, and every reservation past the pool would be refused).
        await asyncio.gather(*(self._first_report(w, w.generation) for w in self.registry.all))
        self.inbox = FirstTokenInbox()
        await self.inbox.start()
        self.orchestrator = Orchestrator(self.registry, self.streams, self.admission, self.metrics,
                                         on_lost=self.supervisor.worker_lost, migration_limit=cfg.migration_limit,
                                         inbox=self.inbox, node_id=_this_node_id(),
                                         submitter=UnixPusher(), on_stats=self._on_worker_stats)
        info = infos[0]
        name = cfg.served_model_name or name or info["model"]   # what gRPC's ServerInfo and /v1/models say
        # The longest request every worker can hold (each caps it to its KV pool).
        max_model_len = min(i["max_model_len"] for i in infos)
        defaults = ServerDefaults(max_model_len=max_model_len, vocab_size=info["vocab_size"],
                                  eos_token_ids=tuple(info.get("eos_token_ids", ())), **cfg.defaults)
        servicer = PdserveServicer(self.orchestrator, self.tokenizer, defaults,
                                   ServerInfo(name, cfg.mode, info["block_size"]), self.metrics)
        self.servicer = servicer
        self.server, self.port = await start_server(servicer, cfg.host, cfg.port, cfg.security, self.health,
                                                    serving=self.registry.can_serve)
        if cfg.http_port is not None:
            await self._start_http(servicer, name, max_model_len)
        if self._standby_recipes:
            self.standby = StandbyPool(self._make_standby)
            self.standby.fill(set(self._standby_recipes))
        return self.port

    async def _start_http(self, servicer: PdserveServicer, model: str, max_model_len: int) -> None:
        """The OpenAI-compatible API over the gRPC servicer's own request path (same limits,
        identity, admission, metrics, token and TLS). Imported here: FastAPI only when served."""
        from router.openai_api.server import openai_server

        cfg = self.config
        self.http = openai_server(servicer.core, self.health, model, max_model_len, cfg.http_host or cfg.host,
                                  cfg.http_port, cfg.security, tool_call_parser=cfg.tool_call_parser)
        self.http_port = await self.http.start()

    def _on_worker_stats(self, worker: WorkerHandle) -> None:
        """A worker's report (a decode worker's step batch, a prefill worker's result) reached
        its handle: the one place it goes on to the metrics and admission's step models. A
        slot that is down reports nothing (a late report is its dead process's)."""
        if not worker.alive:
            return
        self.metrics.update_worker(worker.stats)
        self.admission.observe_stats(worker)
        if self.admission.num_queued:
            self.admission.notify(worker)

    def _on_worker_down(self, worker: WorkerHandle) -> None:
        self.metrics.worker_state(worker.worker_id, worker.role, up=False)
        # Its load gauges showed the dead process's last report (running requests, KV in use):
        # nobody's load now. The replacement's first report brings them back.
        self.metrics.remove_worker(worker.worker_id)
        asyncio.get_running_loop().create_task(self.health.update(self.registry.can_serve))

    def _on_worker_ready(self, worker: WorkerHandle) -> None:
        if worker.role != "prefill":
            self.streams.watch(worker)
        self.metrics.worker_state(worker.worker_id, worker.role, up=True, restarted=True)
        loop = asyncio.get_running_loop()
        loop.create_task(self.health.update(self.registry.can_serve))
        loop.create_task(self._first_report(worker, worker.generation))
        self.admission.notify()   # requests queued for a worker to come back
        self.kv_group.member_ready(worker)

    async def _first_report(self, worker: WorkerHandle, generation: int) -> None:
        """A worker's stats as it starts (the cluster's start, or a replacement's): an idle
        worker reports nothing on its own (a prefill worker reports only with results), and its
        gauges and admission's view of its pool must not stay blank."""
        try:
            stats = await call(worker, "stats", generation=generation)
        except Exception as exc:   # lost again meanwhile: its next replacement reports
            logger.debug("first report of %s: %s", worker.worker_id, exc)
            return
        if worker.generation == generation and worker.stats is None:   # no fresher report came first
            worker.observe_stats(stats)
            self._on_worker_stats(worker)

    async def _spawn(self, worker: WorkerHandle) -> tuple[Any, dict]:
        """A fresh actor for ``worker``'s slot, with a fresh engine and KV pool (a new /dev/shm
        file): a warm spare when there is one, else a new process from the slot's recipe."""
        spare = await self.standby.take(worker.role) if self.standby else None
        if self.standby is not None and worker.role in self._standby_recipes:
            # The next loss's spare, whatever became of this one (taken, dead idle, or failed to
            # load: without a refill then, every later replacement would be a cold start).
            self.standby.refill(worker.role)
        if spare is not None:
            try:
                await spare.activate.remote(worker.worker_id)
                return spare, {**await spare.start.remote(), "standby": True}   # the supervisor's log says so
            except Exception as exc:
                logger.warning("standby for %s failed (%s); cold start", worker.worker_id, first_line(exc))
                ray.kill(spare, no_restart=True)
        opts, args = self._recipes[worker.worker_id]
        actor = opts.remote(*args)
        try:
            info = await asyncio.wait_for(actor.start.remote(), self.config.worker_start_timeout_s)
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        return actor, info

    def _kill(self, worker: WorkerHandle) -> None:
        """What is left of ``worker``'s actor, and its pool (a worker that died never unlinked it)."""
        ray.kill(worker.actor)
        _unlink(worker.shm_path)

    def _make_standby(self, kind: str):
        opts, args = self._standby_recipes[kind]
        return opts.remote(*args, standby=True)

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        kwargs = {"include_dashboard": False, "log_to_driver": True, **self.config.ray_init}
        self._embedded_ray = init_ray(self.config.address, **kwargs)  # embedded: loopback only (deploy/ray_init.py)
        self._started_ray = True

    async def _start_workers(self, model_dir: str | None) -> list[dict]:
        cfg = self.config
        colocated = cfg.mode == "colocated"
        num_prefill = 0 if colocated else cfg.num_prefill
        total = num_prefill + cfg.num_decode
        threads = cfg.threads_per_worker or max(1, int(ray.available_resources().get("CPU", 1)) // total)
        engines, gpus_of = self._devices(num_prefill)
        strategy = self._placement([gpus_of["prefill"]] * num_prefill + [gpus_of["decode"]] * cfg.num_decode)
        actors = []   # (kind, worker id, actor)
        for i in range(num_prefill):
            spec = self._spec(f"prefill-{i}", model_dir, engines["prefill"], threads)
            opts = self._actor("prefill", strategy, cfg.prefill_resources, gpus_of["prefill"])
            self._recipes[spec.worker_id] = (opts, (spec,))
            self._add_standby_recipe("prefill", spec, (), cfg.prefill_resources, gpus_of["prefill"])
            actors.append(("prefill", spec.worker_id, opts.remote(spec)))
        decode_kind = "colocated" if colocated else "decode"
        for i in range(cfg.num_decode):
            spec = self._spec(f"decode-{i}", model_dir, engines["decode"], threads)
            opts = self._actor("decode", strategy, cfg.decode_resources, gpus_of["decode"])
            self._recipes[spec.worker_id] = (opts, (spec, colocated))
            self._add_standby_recipe(decode_kind, spec, (colocated,), cfg.decode_resources, gpus_of["decode"])
            actors.append((decode_kind, spec.worker_id, opts.remote(spec, colocated)))
        infos = await asyncio.gather(*(a.start.remote() for _, _, a in actors), return_exceptions=True)
        failed = [(worker_id, info) for (_, worker_id, _), info in zip(actors, infos) if isinstance(info, BaseException)]
        if failed:
            # Not in the registry yet, so ``stop`` would not find them (a placement group's removal
            # kills its actors, but a cluster may run without one): none may outlive the failed start.
            for _, _, actor in actors:
                ray.kill(actor, no_restart=True)
            worker_id, exc = failed[0]
            if isinstance(exc, Exception):   # a cancel (a signal during start-up) stays what it is
                raise WorkerStartError(worker_id, cause_line(exc)) from exc
            raise exc
        for (role, _, actor), info in zip(actors, infos):
            self.registry.add(WorkerHandle(info["worker_id"], role, actor, info["node_id"], info["device"],
                                           shm_path=info.get("shm_path"), pid=info.get("pid"),
                                           submit_path=info.get("submit_path"),
                                           prefix=PrefixIndex(info["block_size"], info.get("prefix_caching", False))))
        return list(infos)

    def _add_standby_recipe(self, kind: str, spec: WorkerSpec, args: tuple, resources: dict | None,
                            num_gpus: float) -> None:
        """A spare idles: no CPU reservation, outside the placement group. None for GPU workers."""
        if not self.config.standby_workers or num_gpus or kind in self._standby_recipes:
            return
        opts = self._actor("prefill" if kind == "prefill" else "decode", None, resources, 0.0, num_cpus=0)
        self._standby_recipes[kind] = (opts, (dataclasses.replace(spec, worker_id=f"{kind}-standby"), *args))

    def _devices(self, num_prefill: int) -> tuple[dict[str, EngineConfig], dict[str, float]]:
        """Per role: the engine config with its device decided, and each worker's GPU share."""
        cfg = self.config
        gpus = ray.cluster_resources().get("GPU", 0.0)
        engines = {"prefill": resolve_device(cfg.prefill_engine, gpus, self._embedded_ray),
                   "decode": resolve_device(cfg.decode_engine, gpus, self._embedded_ray)}
        counts = {"prefill": num_prefill, "decode": cfg.num_decode}
        share = cfg.gpus_per_worker or gpu_share(gpus, sum(counts[r] for r, e in engines.items() if _on_gpu(e)))
        return engines, {r: share if _on_gpu(e) else 0.0 for r, e in engines.items()}

    def _spec(self, worker_id: str, model_dir: str | None, engine: EngineConfig, threads: int) -> WorkerSpec:
        return WorkerSpec(worker_id=worker_id, model=model_dir, random_model=self.config.random_model,
                          engine=dataclasses.replace(engine), num_threads=threads,
                          allow_fault_injection=self.config.allow_fault_injection, tracing=self.config.tracing)

    def _placement(self, gpus_per_bundle: list[float]):
        """One bundle per worker, PACKed so that KV moves within a node (and a GPU) where it can."""
        cfg = self.config
        if not cfg.use_placement_group or cfg.prefill_resources or cfg.decode_resources:
            return None
        bundles = [{"CPU": cfg.cpus_per_worker, **({"GPU": g} if g else {})} for g in gpus_per_bundle]
        check_cpus(len(bundles), cfg.cpus_per_worker, ray.cluster_resources().get("CPU", 0.0), embedded=self._embedded_ray)
        self._pg = placement_group(bundles, strategy="PACK")
        return self._pg

    def _actor(self, role: str, pg, resources: dict | None, num_gpus: float, num_cpus: float | None = None):
        from decode_worker.actor import DecodeActor
        from prefill_worker.actor import PrefillActor

        cls = PrefillActor if role == "prefill" else DecodeActor
        num_cpus = self.config.cpus_per_worker if num_cpus is None else num_cpus
        opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_concurrency": 1000}
        if resources:
            opts["resources"] = resources
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=pg)
        return cls.options(**opts)

    async def leak_reports(self) -> dict[str, dict]:
        """Per worker: what it still holds, and what the router still counts against it (see
        ``holds_anything``)."""
        alive = [w for w in self.registry.all if w.alive]
        reports = await asyncio.gather(*(w.actor.leak_report.remote() for w in alive))
        return {w.worker_id: r | {"router_requests": w.num_inflight, "router_prefill_tokens": w.num_prefill_tokens}
                for w, r in zip(alive, reports)}

    async def drain(self, timeout_s: float) -> int:
        """Before a stop: health goes NOT_SERVING for good, new requests are refused (UNAVAILABLE,
        HTTP 503: a load balancer retries them elsewhere) and the live ones may finish, for up to
        ``timeout_s``. Returns how many were still live when it ended (cut by ``stop``)."""
        if self.health is not None:
            await self.health.stopping()
        servicer = getattr(self, "servicer", None)
        if servicer is None:   # stopped before it served
            return 0
        try:
            await asyncio.wait_for(servicer.core.live.drained(), timeout_s)
        except TimeoutError:
            pass
        return len(servicer.core.live)

    async def _cut_live_requests(self, deadline: float) -> None:
        """Requests still live (the drain ran out, or there was none) are answered as cut by the
        shutdown (gRPC UNAVAILABLE, HTTP 503 or an SSE error event, all naming it) while both
        servers still run, rather than torn down with them; the workers, still up, free their KV."""
        servicer = getattr(self, "servicer", None)
        if servicer is not None and servicer.core.live.cut():
            await _until(deadline, servicer.core.live.drained(), "requests cut at the stop")

    async def stop(self) -> None:
        """Bounded: the graceful phases (requests still live answered as cut, server grace, request
        cleanups, streams, each worker's shutdown) share ``stop_timeout_s``; one that runs out of it is cut short, and the workers
        are killed and their pools unlinked all the same. Safe on a half-started cluster."""
        deadline = time.monotonic() + self.config.stop_timeout_s
        await self._cut_live_requests(deadline)
        if self.supervisor is not None:
            await self.supervisor.stop()
        self.kv_group.stop()
        if self.standby is not None:
            await _until(deadline, self.standby.stop(), "standby workers")
        if self.http is not None:
            await _until(deadline, self.http.stop(), "HTTP server")
        if self.server is not None:
            await self.server.stop(grace=min(2.0, self.config.stop_timeout_s))
            self.servicer.close()   # its tokenizer pool
        if getattr(self, "orchestrator", None):
            await _until(deadline, self.orchestrator.drain_cleanups(), "request cleanups")
        if getattr(self, "inbox", None):
            await self.inbox.close()
            self.orchestrator.submitter.close()
        if getattr(self, "streams", None):
            await _until(deadline, self.streams.stop(), "decode streams")
        if self._embedded_ray and not gcs_answers():
            # Signalled with us (a SIGTERM to the whole process group): every call to it would
            # wait a minute. The workers' pools are unlinked; what is left of Ray is killed.
            logger.warning("Ray's GCS does not answer (signalled with the router?): leaving Ray without its shutdown")
            for w in self.registry.all:
                _unlink(w.shm_path)
            abandon_ray()
        else:
            shutdowns = [w.actor.shutdown.remote() for w in self.registry.all if w.alive]
            await _until(deadline, asyncio.gather(*shutdowns, return_exceptions=True), "worker shutdown")
            for w in self.registry.all:
                self._kill(w)
            if self._pg is not None:
                remove_placement_group(self._pg)
        if getattr(self, "metrics", None):
            self.metrics.close()
        if self._started_ray:
            await _end_tasks(asyncio.all_tasks() - set(self._callers_tasks) - {asyncio.current_task()})
            if not abandoned():
                shutdown_ray()
        if self.config.tracing is not None:
            tracing.reset()   # flush the router's spans; back to the no-op tracer
        reclaim_stale_segments()  # pools of workers killed mid-start (never registered, never unlinked)


def check_cpus(num_workers: int, cpus_per_worker: float, have: float, embedded: bool) -> None:
    """Workers that ask for more CPUs than the Ray cluster ``have``s would wait for a placement that
    never comes, in silence: on an embedded Ray (no node will join) that is an error naming the fix;
    on a cluster an autoscaler may grow, a warning."""
    need = num_workers * cpus_per_worker
    if need <= have:
        return
    message = (f"{num_workers} workers x {cpus_per_worker:g} CPUs (--cpus-per-worker) need {need:g} CPUs; the Ray "
               f"cluster has {have:g}: lower --cpus-per-worker (e.g. {have / num_workers:.2g}) or the number of workers")
    if embedded:
        raise ValueError(message)
    logger.warning("%s; waiting for nodes to join", message)


async def _prepare_model_remote(source: str | None):
    from deploy.model_prep import prepare_model

    return await prepare_model.remote(source)


async def _until(deadline: float, aw, what: str) -> None:
    """Await ``aw`` until ``deadline`` (monotonic); past it, cancel it, log, and go on."""
    try:
        await asyncio.wait_for(aw, max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        logger.warning("stop: %s did not finish within the stop timeout; going on without it", what)


async def _end_tasks(tasks: set[asyncio.Task], timeout_s: float = END_TASKS_S) -> None:
    """Cancel the tasks this cluster's life started and wait (up to ``timeout_s``) for them to end,
    before Ray goes down. One left to unwind later (when the event loop closes) may read a Ray
    streaming call after ``ray.shutdown()``, and Ray's core worker then ends the whole process
    with status 1 and no message (``QuickExit``; caught with gdb on a stop whose phases ran out
    of time)."""
    pending = await cancel_and_wait(tasks, timeout_s)
    if pending:
        logger.warning("stop: %d task(s) still running as Ray shuts down: %s", len(pending),
                       ", ".join(sorted(t.get_name() for t in pending)))


def _unlink(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def resolve_device(engine: EngineConfig, cluster_gpus: float, embedded: bool) -> EngineConfig:
    """``engine`` with its device decided: "auto" runs on a GPU when the cluster has one now.
    An explicit "cuda" on a joined cluster without GPUs waits for the autoscaler to add GPU
    nodes; on the embedded Ray it would wait forever, so it is an error."""
    device = engine.device
    if device == "auto":
        device = "cuda" if cluster_gpus > 0 else "cpu"
    if device.startswith("cuda") and cluster_gpus <= 0:
        if embedded:
            raise ValueError(f"engine device {engine.device!r} needs a GPU, but this machine has none")
        logger.warning("no GPU in the Ray cluster yet: the GPU workers wait for the autoscaler")
    return dataclasses.replace(engine, device=device)


def gpu_share(cluster_gpus: float, num_gpu_workers: int) -> float:
    """GPU per worker: a whole one each when there are enough (or none yet: the autoscaler adds
    whole GPUs), else an even split (Ray takes fractions down to 1e-4; two workers on one GPU
    get 0.5 each and move KV by CUDA IPC)."""
    if num_gpu_workers == 0:
        return 0.0
    if cluster_gpus <= 0:
        return 1.0
    return min(1.0, math.floor(cluster_gpus / num_gpu_workers * 1e4) / 1e4)


def _on_gpu(engine: EngineConfig) -> bool:
    return engine.device.startswith("cuda")


class ClusterThread:
    """A Cluster on its own event loop in a daemon thread; ``start()`` returns the port."""

    def __init__(self, config: ClusterConfig, cluster: Cluster | None = None) -> None:
        """``cluster``: one already made from ``config`` (a subclass: benchmarks/sim_cluster.py)."""
        self.cluster = cluster or Cluster(config)
        self.loop = event_loop.new_event_loop(self.cluster.config.event_loop)
        self._thread = threading.Thread(target=self.loop.run_forever, name="pdserve-cluster", daemon=True)

    def start(self, timeout_s: float = 300.0) -> int:
        self._thread.start()
        return self.run(self.cluster.start(), timeout_s)

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        try:
            self.run(self.cluster.stop(), 120.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def router_holds(cluster: Cluster) -> dict[str, int]:
    """Per-request state the router itself still holds (empty when idle): live request ids,
    first tokens awaited, decode-stream registrations, admission waiters, running cleanups,
    abandoned prefill streams still being read to their end."""
    held = {
        "live_requests": len(cluster.servicer.core.live),
        "first_token_waits": len(cluster.inbox),
        "decode_streams": cluster.streams.num_registered,
        "admission_waiters": cluster.admission.num_waiting,
        "cleanups": cluster.orchestrator.num_cleanups,
        "stream_drains": cluster.orchestrator.drains.num_draining,
    }
    return {name: n for name, n in held.items() if n}


def holds_anything(report: dict) -> bool:
    """A ``leak_reports`` entry that is not idle: requests, KV blocks or (a decode worker's)
    reservations held by the worker, or requests and prompt tokens the router still counts
    against it."""
    return bool(report["requests"] or report["free_blocks"] != report["total_blocks"] or report.get("reservations")
                or report["router_requests"] or report["router_prefill_tokens"])


def _this_node_id() -> str | None:
    """The Ray node this router runs on; None when this process has no Ray (a simulated cluster):
    asking Ray's runtime context would start a Ray instance in this process (auto-init), which
    outlives the cluster and which the next ``ray.init`` on this machine joins."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
