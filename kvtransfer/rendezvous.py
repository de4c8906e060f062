"""Free TCP ports, and rendezvous addresses for torch.distributed groups torch itself sets up
(torch-free).

A cluster's KV group does not use these: its rank 0 hosts the store before any join
(kvtransfer/group_store.py). Tests and benchmarks that form groups of their own with
``init_kv_group(rendezvous_address(), ...)`` take their addresses, and free ports, from here: one
rule for "a port free right now".
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (nothing holds it for the caller: bind it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rendezvous_address(host: str = "127.0.0.1") -> str:
    """``tcp://host:port`` with a free port, for ``init_kv_group``'s ``init_method``."""
    return f"tcp://{host}:{free_port(host)}"
