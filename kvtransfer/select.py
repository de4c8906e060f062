"""Which transport a (prefill, decode) pair uses, and the registry of backends. Torch-free.

The router (or launcher) calls ``choose_transport`` once per pair and puts the name in the
handle; each worker builds its side with ``make_sender`` / ``make_receiver``. Backends are
imported lazily so that choosing a transport never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.errors import KVTransferError

if TYPE_CHECKING:
    from kvtransfer.connector import KVReceiver, KVSender

# name -> (module, sender class, receiver class)
TRANSPORTS: dict[str, tuple[str, str, str]] = {
    "shm": ("kvtransfer.shm", "ShmSender", "ShmReceiver"),
    "torch_dist": ("kvtransfer.torch_dist", "TorchDistSender", "TorchDistReceiver"),
    "object_store": ("kvtransfer.object_store", "ObjectStoreSender", "ObjectStoreReceiver"),
    "cuda_ipc": ("kvtransfer.cuda_ipc", "CudaIpcSender", "CudaIpcReceiver"),
    "local": ("kvtransfer.local", "LocalSender", "LocalReceiver"),  # in-process fake for tests
}


def backend_classes(name: str) -> tuple[type, type]:
    """(sender class, receiver class) of a registered transport."""
    try:
        module_name, sender, receiver = TRANSPORTS[name]
    except KeyError:
        raise KVTransferError(f"unknown KV transport {name!r}; known: {sorted(TRANSPORTS)}") from None
    module = importlib.import_module(module_name)
    return getattr(module, sender), getattr(module, receiver)


def make_sender(name: str, **kwargs: Any) -> KVSender:
    return backend_classes(name)[0](**kwargs)


def make_receiver(name: str, **kwargs: Any) -> KVReceiver:
    """``shm`` needs ``shm_path=`` (the decode worker's cache file); the others take none."""
    return backend_classes(name)[1](**kwargs)


def choose_transport(
    prefill_node_id: str,
    decode_node_id: str,
    device: str,
    forced: str | None = None,
    *,
    decode_device: str | None = None,
    dist_ready: bool = True,
) -> str:
    """Pick the fastest transport that can work for this pair.

    ``device`` is the prefill worker's device ("cpu", "cuda:N"); ``decode_device`` defaults to
    the same. GPU names must identify physical GPUs (a UUID or the physical index), because
    Ray gives every actor its own CUDA_VISIBLE_DEVICES and each sees its GPU as cuda:0.

    - forced: that one (it must be registered); a forced "torch_dist" while the process group
      is down (``dist_ready`` false: a member was lost, it is being formed again) gives way to
      what the placement allows meanwhile;
    - same node, both CPU: "shm";
    - same node, same GPU: "cuda_ipc";
    - otherwise, both CPU or both GPU: "torch_dist" (gloo or NCCL) when the process group is
      set up (``dist_ready``), else "object_store";
    - a CPU worker paired with a GPU worker: "object_store".
    """
    if forced is not None:
        if forced not in TRANSPORTS:  # checked by name: importing the backend would pull in torch
            raise KVTransferError(f"unknown KV transport {forced!r}; known: {sorted(TRANSPORTS)}")
        if forced != "torch_dist" or dist_ready:
            return forced
    decode_device = device if decode_device is None else decode_device
    same_node = prefill_node_id == decode_node_id
    kinds = {_kind(device), _kind(decode_device)}
    if kinds == {"cpu"} and same_node:
        return "shm"
    if kinds == {"cuda"} and same_node and device == decode_device:
        return "cuda_ipc"
    if len(kinds) == 1 and dist_ready:
        return "torch_dist"
    return "object_store"


def _kind(device: str) -> str:
    return "cpu" if device.startswith("cpu") else "cuda"  # "cuda:N" or a GPU UUID
