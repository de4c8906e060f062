"""Free TCP ports and the rendezvous address of the torch.distributed KV group (torch-free).

The launcher (a torch-free driver process) picks the address on the head node before any worker
joins; workers pass it to ``init_kv_group`` (kvtransfer/torch_dist.py). Tests and benchmarks take
free ports from here too: one rule for "a port free right now".
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
