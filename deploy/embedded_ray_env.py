"""What an embedded Ray (one `pdserve serve` starts itself, bound to loopback) needs in the
environment before ``ray`` is imported: Ray reads its C++ settings from ``RAY_<name>`` variables
once, as the library loads, and its processes inherit them.

``RAY_gcs_rpc_server_reconnect_timeout_s``: how long a process waits for an unreachable GCS to
come back before it exits. Ray's 60 s is meant for a GCS that fault tolerance restarts; an
embedded GCS is this process's child, kept in no store, so once unreachable it is gone for good
and the wait only delays the exit. It did: a SIGTERM to the process group as Ray started took
the GCS down while the driver connected, and `pdserve serve` sat 60 s before it exited (found
by a CI run; 2 of 7 signal moments tried here). An operator's own value stands.

Life cycle: `pdserve serve` calls ``prepare`` first, before anything imports ray;
``deploy.ray_init`` asks ``is_embedded`` whether it starts Ray or joins one.
"""

from __future__ import annotations

import os

GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
EMBEDDED_GCS_RECONNECT_S = 10


def is_embedded(address: str | None) -> bool:
    """Whether the cluster starts its own Ray (no ``--address``, no ``RAY_ADDRESS``)."""
    return address is None and not os.environ.get("RAY_ADDRESS")


def prepare(address: str | None) -> None:
    if is_embedded(address):
        os.environ.setdefault(GCS_RECONNECT_ENV, str(EMBEDDED_GCS_RECONNECT_S))
