"""The KV group's rendezvous store, hosted by rank 0 from the moment the router asks it for the
group's address, before any member is asked to join.

Why: with torch's own rendezvous (``init_method="tcp://..."``) rank 0 binds the store only when
it joins, so the others cannot tell "not up yet" from "gone": a member that connects after rank
0 died retries the connect for the whole timeout, twice, with a random pause between (63-72 s
measured at a 30 s timeout), and the router's forming waits for every join (probe: rank 0
SIGKILLed as a forming's joins went out; the group was back 84-96 s after). Hosted first, the
store is there when the joins go out, or rank 0 is gone: a member whose connect is refused
fails its join at once, and one already connected fails as the store's connection drops.

Life cycle (in a worker process): ``host(hostname)`` on rank 0 (the actor's ``kv_group_address``)
-> the address goes to every member -> each member's join takes ``store_for(address, ...)``:
rank 0 its hosted server, the others a client once a connect finds it listening -> the process
group holds its store from then on. A newer ``host`` drops an older one no join took.
"""

from __future__ import annotations

import datetime
import socket
import threading

import torch.distributed as dist

from engine.errors import KVTransferError

PREFIX = "pdserve-kv"       # the keys of every member's group, whatever else shares the store
CONNECT_CHECK_S = 2.0       # a connect that hears nothing this long is left to the store's own tries
# The client's connect: the store listened before any join was asked for, so one not reached by
# then is gone (rank 0 died as the joins went out: its socket still took connects for a few ms).
# torch's client retries a failed connect until this timeout, pauses at random, then tries once
# more: at the join's 30 s that was 50-71 s; its operations get the join's timeout after.
CONNECT_S = 5.0


class _Hosted:
    """The store this process hosts for a forming it is rank 0 of (at most one), by address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()   # the actor's loop hosts, a join's thread takes
        self._address: str | None = None
        self._store: dist.TCPStore | None = None

    def host(self, hostname: str, timeout_s: float) -> str:
        store = dist.TCPStore(hostname, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        with self._lock:   # an older one no join took is dropped: its forming was given up
            self._address, self._store = f"tcp://{hostname}:{store.port}", store
            return self._address

    def take(self, address: str) -> dist.TCPStore | None:
        with self._lock:
            if address != self._address:
                return None
            store, self._address, self._store = self._store, None, None
            return store


_HOSTED = _Hosted()


def host(hostname: str, timeout_s: float) -> str:
    """Bind a store on ``hostname`` (a free port) for the next forming; its ``tcp://`` address."""
    return _HOSTED.host(hostname, timeout_s)


def store_for(address: str, world_size: int, rank: int, timeout_s: float) -> dist.Store:
    """The store a member of the forming at ``address`` joins over. Rank 0: the one it hosts (or,
    if it hosts none for this address, a new server there); the others: a client, once a connect
    finds the store listening (refused: rank 0 is gone, KVTransferError at once)."""
    host_name, port = _split(address)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = _HOSTED.take(address) or dist.TCPStore(host_name, port, world_size, is_master=True,
                                                       wait_for_workers=False, timeout=timeout)
    else:
        _check_listening(host_name, port)
        store = dist.TCPStore(host_name, port, world_size, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=min(CONNECT_S, timeout_s)))
        store.set_timeout(timeout)
    return dist.PrefixStore(PREFIX, store)


def _check_listening(host_name: str, port: int) -> None:
    try:
        socket.create_connection((host_name, port), timeout=CONNECT_CHECK_S).close()
    except ConnectionRefusedError:
        raise KVTransferError(f"the KV group's rendezvous store at {host_name}:{port} is gone: rank 0, which "
                              "hosted it before any join was asked for, was lost") from None
    except OSError:   # slow or unreachable for now: the store's own connect tries, to its timeout
        pass


def _split(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise ValueError(f"a KV group address is tcp://host:port, got {address!r}")
    host_name, _, port = address[len("tcp://"):].rpartition(":")
    return host_name.strip("[]"), int(port)
