"""Joining or starting Ray for the launcher: an embedded Ray listens on loopback only, and
``ray.init`` does not take over SIGTERM.

Loopback: Ray's own services (GCS, raylet, object manager, workers' gRPC servers) run no auth
of their own beyond Ray's token mode and would accept anyone who can reach them. A single-node
pdserve has no peer to talk to, so its embedded Ray binds 127.0.0.1. Ray 2.60 rewrites
``ray.init(_node_ip_address="127.0.0.1")`` into the machine's routable address
(``services.resolve_ip_for_localhost``), so that argument alone binds everything to every
interface; what makes Ray take 127.0.0.1 as the node address, and bind there, is its single-host
switch ``ray_constants.ENABLE_RAY_CLUSTER`` (what ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets at
import). It is read only while the node's address is decided, so it is switched for the
``ray.init`` call alone. Joining a cluster (``address``, or ``RAY_ADDRESS``) leaves Ray as it is.

Leaving: ``shutdown_ray`` waits (bounded) until the processes of an embedded Ray are gone, so
that what they left behind (a worker killed mid-start keeps its /dev/shm pool) can be reclaimed
at once rather than at the next start. Unless Ray's GCS no longer answers (``gcs_answers``): a
SIGTERM to the router's whole process group (systemd's default ``KillMode=control-group``,
``kill -TERM -PGID``, supervisord's ``stopasgroup``) reaches the embedded GCS too, which stops
answering at once, and every later call to it (a placement group's removal, ``ray.shutdown``,
Ray's own shutdown at exit) waits out Ray's 60 s reconnect timeout before the process dies with
status 1. ``abandon_ray`` then kills what is left of the embedded Ray (our descendants) instead,
and the caller ends the process with ``os._exit`` once its own cleanup is done (``abandoned``).

SIGTERM: ``ray.init`` installs a SIGTERM handler that calls ``sys.exit(15)`` wherever the main
thread happens to be, first thing, for the whole start (seconds); the caller's handler
(``pdserve serve``: a graceful stop, or a cancelled start exiting 143) stays in place instead:
Ray's installer is a no-op for the call. The driver's C++ core worker would also install absl's
failure-signal handler (SIGTERM included) as it connects: it is switched off for the driver (a
SIGTERM then aborted the process), and the caller's handler is installed again after the call in
any case.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

import psutil
import ray
from ray._private import ray_constants
from ray._private import utils as ray_utils

from deploy.embedded_ray_env import is_embedded
from deploy.start_failure import RayUnreachableError, first_line

logger = logging.getLogger(__name__)


def shutdown_ray(wait_s: float = 10.0) -> None:
    """``ray.shutdown()``, then wait up to ``wait_s`` for the processes of the Ray this one started
    (its GCS, raylet and the rest, and their descendants: agents, workers) to exit. Only those:
    another child of this process (``multiprocessing``'s resource tracker lives as long as its
    parent) is not Ray's to wait for."""
    processes = _ray_processes()
    ray.shutdown()
    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    if alive:
        logger.warning("%d Ray processes still running %.0f s after shutdown: %s", len(alive), wait_s,
                       ", ".join(_describe(proc) for proc in alive))


def _ray_processes() -> list[psutil.Process]:
    """The processes of the Ray this process started and their descendants (none when it joined
    a cluster: a joining node starts none)."""
    node = ray._private.worker._global_node
    started = [info.process.pid for infos in (node.all_processes.values() if node else ()) for info in infos]
    processes = []
    for pid in started:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            processes += [process, *process.children(recursive=True)]
    return processes


def _describe(proc: psutil.Process) -> str:
    """``pid command line (status)`` of a process, for a log line."""
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:120] or proc.name()} ({proc.status()})"
    except psutil.Error:
        return f"{proc.pid} (gone)"


def gcs_answers(timeout_s: float = 1.0) -> bool:
    """Whether Ray's GCS answers a small call within ``timeout_s`` (False too when Ray is not
    connected)."""
    try:
        ray._private.worker.global_worker.gcs_client.internal_kv_keys(b"", None, timeout=timeout_s)
    except Exception:   # noqa: BLE001 - an RpcError (no answer), or no client: either way it does not answer
        return False
    return True


_abandoned = threading.Event()   # abandon_ray ran: the process must end without Ray's shutdown


def abandon_ray(wait_s: float = 5.0) -> None:
    """Leave an embedded Ray whose GCS no longer answers without ``ray.shutdown`` (it would wait a
    minute on the GCS): kill this process's descendants (its GCS, raylet, agents, workers) and mark
    the process to end with ``os._exit`` (``abandoned``), since Ray's own shutdown at interpreter
    exit would wait as long."""
    _abandoned.set()
    kill_descendants(wait_s)


def kill_descendants(wait_s: float = 5.0) -> None:
    """SIGKILL every descendant of this process (an embedded Ray's GCS, raylet, agents, workers)."""
    descendants = psutil.Process().children(recursive=True)
    for proc in descendants:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _, alive = psutil.wait_procs(descendants, timeout=wait_s)
    if alive:
        logger.warning("%d Ray processes still running %.0f s after they were killed", len(alive), wait_s)


def abandoned() -> bool:
    """``abandon_ray`` ran: end the process with ``os._exit`` after its own cleanup."""
    return _abandoned.is_set()


def valid_address(address: str | None) -> bool:
    """What Ray can join: none (embedded), ``auto``, ``local``, ``[ray://]host:port`` with a port in
    1-65535 (anything else is refused at once, not after a minute of connection retries)."""
    if address is None or address in ("auto", "local"):
        return True
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


REACH_TIMEOUT_S = 30.0   # an explicit --address must answer within this (systemd restarts a failed start)


async def wait_reachable(address: str | None, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """A Ray address given as ``host:port`` (or ``RAY_ADDRESS``) must accept a TCP connection
    within ``timeout_s``, else ``RayUnreachableError`` naming it. ``ray.init`` would retry for
    minutes holding the event loop, where no signal is handled (found by a probe: a SIGTERM
    waited out systemd's stop timeout). Async, so a signal meanwhile cancels the start."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5.0)
            writer.close()
            return
        except (OSError, TimeoutError) as exc:
            if loop.time() >= deadline:
                raise RayUnreachableError(f"--address {address}: nothing answers there after {timeout_s:.0f} s "
                                          f"({first_line(exc)}); is Ray's head up?") from None
        await asyncio.sleep(1.0)


def init_ray(address: str | None, **kwargs) -> bool:
    """Join ``address`` (or ``RAY_ADDRESS``), or start an embedded Ray: True when embedded (this
    process started Ray's GCS and raylet: they are its descendants)."""
    embedded = is_embedded(address) and "_node_ip_address" not in kwargs
    with _keep_sigterm_handler(), (_loopback_only() if embedded else contextlib.nullcontext()):
        try:
            ray.init(address=address, **kwargs)
        except BaseException:
            if embedded:   # half started (say, its GCS signalled with us): none of it may outlive the failure
                kill_descendants()
            raise
    if embedded:
        logger.info("embedded Ray bound to %s", ray.util.get_node_ip_address())
    return embedded


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    previous = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # ray.init only touches signals from the main thread
        return
    previous = signal.getsignal(signal.SIGTERM)
    install = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None   # a SIGTERM mid-init reaches the caller's handler
    # The driver's core worker installs absl's failure-signal handler (SIGTERM included) as it
    # connects, read from this constant at that moment: a SIGTERM in the second or so before the
    # handler below is put back printed a C++ stack and aborted the process (SIGABRT, the start's
    # Ray processes left running; found by a probe). The driver's own crashes keep Python's
    # faulthandler; the workers, other processes, keep Ray's handler.
    disable_failure_handler = ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = disable_failure_handler
        ray_utils.set_sigterm_handler = install
        if previous is not None:   # None: set outside Python, nothing of ours to restore
            # Always: a C++ handler that took SIGTERM over at the OS level is invisible to
            # signal.getsignal; left there, it prints a stack on every SIGTERM and aborts.
            signal.signal(signal.SIGTERM, previous)
