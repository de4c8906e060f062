"""torch.distributed point-to-point transport: NCCL between GPUs, gloo between CPUs, one path.

Group set-up (before any transfer; again whenever a member was replaced):

1. The launcher asks rank 0 for a rendezvous address on its own node (rank 0 binds the store
   there at once, before any join: ``group_store.host``) and assigns every worker that moves KV a
   rank in ``[0, world_size)``.
2. Every worker calls ``init_kv_group(address, world_size, rank, backend=..., hosted=True)``; it blocks
   until all ``world_size`` workers have joined. ``timeout_s`` becomes the process group's
   timeout: a gloo send/recv whose peer never shows up raises after it.
3. A member died: the group is broken for everyone (a collective world cannot take a new
   rank). Once its replacement is up, every member calls ``init_kv_group`` again with a fresh
   address: this process's membership (``_Membership``, the one owner of the process-wide
   group) refuses new transfers, lets those in flight end, leaves the old group and joins the
   new one; per-peer state of the old group (a pair marked broken by the death) is not reused.

One hand-off (the handle's locator is ``DistPeers(dst_rank, src_rank)``):

1. decode: handles carry ``receiver.locator(cache)`` = ``DistPeers(dst_rank=<own rank>, group=<the
   group's address>)``; a hand-off set up in an earlier group is refused by both sides.
2. prefill: ``handle = sender.bind(handle, src_ids)`` adds ``src_rank``; it then starts the
   decode worker's ``receiver.receive(cache, handle)`` (a non-blocking Ray call) and calls
   ``sender.send(cache, handle)``. ``send`` sends a header, then gathers the blocks into a
   reusable staging tensor in 4 layer chunks, each sent as soon as it is packed; it returns
   when the payload has left (``rendezvous = True``: it cannot complete without the receiver).
3. decode: ``receive`` takes the header, checks the sender's layout, req_id and block count,
   posts the chunk receives into its staging tensor and scatters each chunk into the
   reserved blocks while the next one arrives. Packing, the wire and unpacking overlap.

Timeouts: ``timeout_s`` bounds each message (header, each chunk); without it the process
group's timeout applies. Both raise ``KVTransferError``.

Ordering: NCCL has no tags, so there are none here. Per (sender, receiver) pair, transfers
are strictly one at a time and FIFO (each side holds one lock and one staging tensor per
peer rank; transfers with different peers run concurrently): both workers must issue them
for a given peer in the same order. Simplest: the prefill worker sends one hand-off at a
time and waits for the decode side's receive before the next. The header carries a hash of
the req_id, the sender's layout and block count, so a misordered or mismatched pair raises
``KVTransferError`` on the receiver instead of landing garbage. On a mismatch the receiver
still drains the payload, and a sender whose local checks fail sends an abort header, so
the pair stays in step. A timeout or a peer failure, however, leaves the pair's framing unknown:
that peer is marked broken and later transfers with it raise until the group is re-created.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import threading
import time
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from engine.dtypes import torch_dtype
from engine.errors import KVTransferError
from engine.types import KVLayout
from kvtransfer import group_store
from kvtransfer.blocks import Staging, check_side, gather_blocks, scatter_blocks
from kvtransfer.cache_alloc import layout_of
from kvtransfer.connector import TransferResult
from kvtransfer.handle import DistPeers, KVBlocksHandle, KVGroupChangedError, check_layout

_MAGIC = 0x4B56_5844_0001  # "KVXD" v1
_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
_ABORT = -1
_NUM_CHUNKS = 4  # measured on 2 cores, 23.6 MB over gloo: 1 chunk 30.6 ms, 4 chunks 23.6 ms, 15 no better


# ---- group set-up ---------------------------------------------------------------------

def default_backend(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class _Membership:
    """This process's place in the KV group, which torch.distributed keeps process-wide: transfers
    run inside it (``transfer``); joining (again) refuses new transfers, waits for those in flight
    to end, then leaves the old group and joins the new one. ``generation`` counts the groups
    joined, so per-peer state of an earlier group is dropped rather than reused; ``group`` names
    the one joined (its rendezvous address), which a hand-off carries from its reservation on:
    one set up in an earlier group is refused on both sides (found by a probe: a hand-off whose
    reservation died with its decode worker was sent, after the group was formed again, to that
    rank's new holder, taking the receive of another hand-off: 30 s stalls, a pair broken)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._active = 0          # transfers in flight
        self._joining = False
        self.generation = 0
        self.group: str | None = None

    @contextlib.contextmanager
    def transfer(self, group: str) -> Iterator[int]:
        """One transfer of a hand-off set up in ``group`` (yields this side's generation):
        refused while the group changes, and once another group was formed."""
        with self._changed:
            self._check(group)
            self._active += 1
            generation = self.generation
        try:
            yield generation
        finally:
            with self._changed:
                self._active -= 1
                self._changed.notify_all()

    def place(self) -> tuple[int, str]:
        """This process's rank and group, for a reservation's locator."""
        with self._changed:
            self._check(None)
            return dist.get_rank(), self.group

    def rank(self, group: str) -> int:
        """This process's rank in ``group``, for a hand-off about to start (refused while the
        group changes: binding a hand-off first means no receiver is left waiting for it)."""
        with self._changed:
            self._check(group)
            return dist.get_rank()

    def _check(self, group: str | None) -> None:
        if self._joining or not dist.is_initialized():
            raise KVTransferError("this worker is not in a KV group now (it is being formed again)")
        if group is not None and group != self.group:
            raise KVGroupChangedError("the hand-off was set up in an earlier KV group, formed again since: "
                                      "its ranks may name other workers now")

    def join(self, init_method: str, world_size: int, rank: int, backend: str, timeout_s: float,
             drain_s: float, hosted: bool = False) -> None:
        with self._changed:
            self._changed.wait_for(lambda: not self._joining)   # one change at a time
            self._joining = True
            drained = self._changed.wait_for(lambda: self._active == 0, timeout=drain_s)
        try:
            if not drained:   # leaving would pull the group from under them
                raise KVTransferError(f"{self._active} KV transfers still in flight after {drain_s:.0f} s: "
                                      "the group is not joined again")
            self._leave()
            try:
                # hosted: rank 0 bound the store before the joins (kvtransfer/group_store.py)
                where = ({"store": group_store.store_for(init_method, world_size, rank, timeout_s)} if hosted
                         else {"init_method": init_method})
                dist.init_process_group(backend, world_size=world_size, rank=rank,
                                        timeout=datetime.timedelta(seconds=timeout_s), **where)
            except BaseException:
                _forget_failed_group()
                raise
            self.group = init_method
        finally:
            with self._changed:
                self._joining = False
                self._changed.notify_all()

    def leave(self) -> None:
        with self._changed:
            self._leave()

    def _leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation += 1
        self.group = None


def _forget_failed_group() -> None:
    """After a failed ``init_process_group``: torch counted the group it did not make (the
    default group's name, hence its store keys, is that count) and nothing resets the count
    but a ``destroy_process_group`` of a group that exists. A member whose join failed would
    look for another group's keys at every later join than a fresh process (its replacement)
    does, and never meet it (found by a probe). Reset as ``destroy_process_group`` does."""
    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


_membership = _Membership()


def init_kv_group(
    init_method: str, world_size: int, rank: int, *, backend: str = "gloo", timeout_s: float = 60.0,
    drain_s: float = 45.0, hosted: bool = False,
) -> None:
    """Join the process group that KV moves over (blocks until all ranks joined), leaving the one
    this process is in first, once its transfers in flight have ended (up to ``drain_s``: each
    is bounded by its own timeout). ``hosted``: rank 0 bound the rendezvous store at
    ``init_method`` before any member was asked to join (``group_store.host``), so a store
    that is not there means rank 0 was lost: the join fails at once."""
    _membership.join(init_method, world_size, rank, backend, timeout_s, drain_s, hosted)


def destroy_kv_group() -> None:
    _membership.leave()


# ---- wire format ----------------------------------------------------------------------

def _req_hash(req_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=7).digest(), "little")


def _header(req_id: str, num_blocks: int, layout: KVLayout, device: torch.device) -> torch.Tensor:
    fields = [_MAGIC, _req_hash(req_id), num_blocks, layout.num_layers, layout.num_kv_heads,
              layout.head_dim, layout.block_size, _DTYPE_CODES[layout.dtype]]
    return torch.tensor(fields, dtype=torch.int64, device=device)


def _parse_header(header: torch.Tensor) -> tuple[int, int, KVLayout]:
    magic, req_hash, num_blocks, layers, heads, head_dim, block_size, code = header.tolist()
    if magic != _MAGIC:
        raise KVTransferError(f"bad KV transfer header magic {magic:#x}: the pair is out of step")
    dtype = {v: k for k, v in _DTYPE_CODES.items()}[code]
    return req_hash, num_blocks, KVLayout(layers, heads, head_dim, block_size, dtype)


def _peers(handle: KVBlocksHandle, need_src: bool) -> DistPeers:
    peers = handle.locator
    if not isinstance(peers, DistPeers) or (need_src and peers.src_rank is None):
        raise KVTransferError(f"{handle.req_id}: torch_dist locator must be DistPeers with both ranks, got {peers!r}")
    return peers


class _Channel:
    """This side's state for one peer rank: transfers with it run one at a time (the lock),
    through its own staging tensor; a failed op marks the pair broken for good."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.staging = Staging()
        self.broken: str | None = None
        self.orphans: list[object] = []  # buffers that failed ops may still touch: kept alive

    def check(self) -> None:
        if self.broken is not None:
            raise KVTransferError(
                f"the pair with rank {self.rank} failed earlier ({self.broken}); re-create the process group"
            )

    def start(self, op, tensor: torch.Tensor):
        return self._guard(lambda: op(tensor, self.rank), tensor)

    def wait(self, work, tensor: torch.Tensor, timeout_s: float | None) -> None:
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self._guard(lambda: work.wait() if timeout is None else work.wait(timeout=timeout), tensor)

    def run(self, op, tensor: torch.Tensor, timeout_s: float | None) -> None:
        self.wait(self.start(op, tensor), tensor, timeout_s)

    def _guard(self, call, tensor: torch.Tensor):
        try:
            return call()
        except RuntimeError as exc:  # gloo/NCCL timeouts and peer failures (DistBackendError too)
            self.broken = str(exc).splitlines()[0][:200]
            self.orphans += [tensor, self.staging]  # a posted op may still touch their memory
            self.staging = Staging()
            raise KVTransferError(f"torch_dist transfer with rank {self.rank} failed: {exc}") from exc


class _Channels:
    """One channel per peer rank of the current group (an earlier group's are dropped)."""

    def __init__(self) -> None:
        self._by_rank: dict[int, _Channel] = {}
        self._generation = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def use(self, rank: int, group: str) -> Iterator[_Channel]:
        """The channel with ``rank`` in the current group, held for one transfer of a hand-off
        set up in ``group``."""
        with _membership.transfer(group) as generation:
            channel = self._get(rank, generation)
            with channel.lock:
                channel.check()
                yield channel

    def _get(self, rank: int, generation: int) -> _Channel:
        with self._lock:
            if generation != self._generation:
                self._release()
                self._by_rank, self._generation = {}, generation
            return self._by_rank.setdefault(rank, _Channel(rank))

    def close(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        for channel in self._by_rank.values():
            channel.staging.release()


def _layer_chunks(num_layers: int) -> list[slice]:
    """Layer ranges sent as separate messages, so packing, the wire and unpacking overlap."""
    step = max(1, -(-num_layers // _NUM_CHUNKS))
    return [slice(i, min(i + step, num_layers)) for i in range(0, num_layers, step)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # return only once the bytes are where they belong
        torch.cuda.current_stream(device).synchronize()


# ---- sender / receiver ----------------------------------------------------------------

class TorchDistSender:
    transport = "torch_dist"
    rendezvous = True

    def __init__(self) -> None:
        self._channels = _Channels()

    def bind(self, handle: KVBlocksHandle, src_block_ids: Sequence[int]) -> KVBlocksHandle:
        peers = _peers(handle, need_src=False)
        return handle.with_source(src_block_ids, DistPeers(peers.dst_rank, _membership.rank(peers.group), peers.group))

    def send(self, cache: torch.Tensor, handle: KVBlocksHandle, *, timeout_s: float | None = None) -> TransferResult:
        start = time.perf_counter()
        peers = _peers(handle, need_src=True)
        with self._channels.use(peers.dst_rank, peers.group) as channel:
            try:
                check_side(cache, handle, "src")
            except KVTransferError:  # tell the receiver, so it fails now and the pair stays in step
                channel.run(dist.isend, _header(handle.req_id, _ABORT, handle.layout, cache.device), timeout_s)
                raise
            _send(channel, cache, handle, timeout_s)
        return TransferResult(handle, handle.num_bytes, time.perf_counter() - start)

    def close(self) -> None:
        self._channels.close()


class TorchDistReceiver:
    transport = "torch_dist"

    def __init__(self) -> None:
        self._channels = _Channels()

    def locator(self, cache: torch.Tensor) -> object:
        rank, group = _membership.place()
        return DistPeers(dst_rank=rank, group=group)

    def receive(self, cache: torch.Tensor, handle: KVBlocksHandle, *, timeout_s: float | None = None) -> TransferResult:
        start = time.perf_counter()
        peers = _peers(handle, need_src=True)
        with self._channels.use(peers.src_rank, peers.group) as channel:
            _receive(channel, cache, handle, timeout_s)
        return TransferResult(handle, handle.num_bytes, time.perf_counter() - start)

    def close(self) -> None:
        self._channels.close()


def _send(channel: _Channel, cache: torch.Tensor, handle: KVBlocksHandle, timeout_s: float | None) -> None:
    header = _header(handle.req_id, handle.num_blocks, layout_of(cache), cache.device)
    sent = [(channel.start(dist.isend, header), header)]
    staging = channel.staging.view(cache, handle.num_blocks)
    for layers in _layer_chunks(cache.shape[0]):
        gather_blocks(cache[layers], handle.src_block_ids, staging[layers])
        sent.append((channel.start(dist.isend, staging[layers]), staging[layers]))  # goes while we pack the next
    for work, tensor in sent:
        channel.wait(work, tensor, timeout_s)
    _sync(cache.device)


def _receive(channel: _Channel, cache: torch.Tensor, handle: KVBlocksHandle, timeout_s: float | None) -> None:
    header = torch.empty(8, dtype=torch.int64, device=cache.device)
    channel.run(dist.irecv, header, timeout_s)
    req_hash, num_blocks, sent_layout = _parse_header(header)
    if num_blocks == _ABORT:
        raise KVTransferError(f"{handle.req_id}: the sender (rank {channel.rank}) aborted the transfer")
    error = _first_error(cache, handle, req_hash, num_blocks, sent_layout)
    if error is None:
        payload = channel.staging.view(cache, num_blocks)
    else:  # take the sender's frames anyway, so the pair stays in step, then raise
        payload = torch.empty(sent_layout.cache_shape(num_blocks), dtype=torch_dtype(sent_layout.dtype), device=cache.device)
    chunks = _layer_chunks(sent_layout.num_layers)
    posted = [channel.start(dist.irecv, payload[layers]) for layers in chunks]
    for work, layers in zip(posted, chunks):
        channel.wait(work, payload[layers], timeout_s)
        if error is None:  # unpack this chunk while the next one arrives
            scatter_blocks(payload[layers], cache[layers], handle.dst_block_ids)
    if error is not None:
        raise error
    _sync(cache.device)


def _first_error(
    cache: torch.Tensor, handle: KVBlocksHandle, req_hash: int, num_blocks: int, sent: KVLayout
) -> KVTransferError | None:
    """Why the announced frames must not land in ``cache`` (None: they may)."""
    try:
        check_side(cache, handle, "dst")
        check_layout(handle.layout, sent)
    except KVTransferError as exc:
        return exc
    if req_hash != _req_hash(handle.req_id) or num_blocks != handle.num_blocks:
        return KVTransferError(
            f"{handle.req_id}: the sender sent another request's KV ({num_blocks} blocks): "
            "transfers of this pair were issued in different orders"
        )
    return None
