"""kvtransfer: byte-exact hand-offs between real processes, and every check that guards them.

In-process tests cover the handle, the block copies, /dev/shm allocation, transport choice
and the fake transport's fault injection. Two real Ray actors (a prefill-like peer with a
plain cache, a decode-like peer whose cache lives in /dev/shm) cover shm, gloo and the
object store: random KV in shuffled, non-contiguous source blocks must land bit for bit in
other destination blocks, and no other destination block may change.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from engine.errors import KVTransferError, PeerLostError
from engine.types import KVLayout
from kvtransfer.blocks import block_runs, check_side, copy_blocks
from kvtransfer.cache_alloc import allocate_kv_cache, attach_kv_cache, release_kv_cache
from kvtransfer.handle import CudaIpcLocator, DistPeers, KVBlocksHandle, KVGroupChangedError, KVLayoutMismatchError, check_layout
from kvtransfer.local import LocalReceiver, LocalSender
from kvtransfer.select import choose_transport, make_receiver
from kvtransfer.shm import ShmSender

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
NUM_BLOCKS = 24
SRC_IDS = (17, 3, 11, 4, 5)    # shuffled, with one consecutive pair
DST_IDS = (2, 20, 8, 9, 14)
NUM_TOKENS = 18                # 5 blocks of 4, the last one partial


def random_blocks(num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.cache_shape(num_blocks), generator=gen)


def make_handle(**changes) -> KVBlocksHandle:
    handle = KVBlocksHandle("req-0", SRC_IDS, DST_IDS, NUM_TOKENS, LAYOUT, "local", None)
    return dataclasses.replace(handle, **changes)


def shm_path() -> str:
    return f"/dev/shm/pdserve-test-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# ---- handle and checks --------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("num_layers", 4), ("num_kv_heads", 1), ("head_dim", 16), ("block_size", 8), ("dtype", "float16"),
])
def test_check_layout_names_the_mismatching_field(field, value):
    other = dataclasses.replace(LAYOUT, **{field: value})
    with pytest.raises(KVTransferError, match=field) as info:
        check_layout(LAYOUT, other)
    assert isinstance(info.value, KVLayoutMismatchError) and info.value.field == field
    copy = pickle.loads(pickle.dumps(info.value))  # crosses Ray back to the caller
    assert copy.field == field and str(copy) == str(info.value)
    check_layout(LAYOUT, dataclasses.replace(LAYOUT))


def test_handle_crosses_processes_without_torch():
    handle = make_handle(locator=DistPeers(dst_rank=1, src_rank=0))
    ipc = make_handle(locator=CudaIpcLocator(0, b"h", 1, 0, b"r", 0, b"e", True, (1,), (1,), 0, "float32"))
    code = (
        "import pickle, sys; import kvtransfer, kvtransfer.select;"
        f"hs = [pickle.loads({pickle.dumps(handle)!r}), pickle.loads({pickle.dumps(ipc)!r})];"
        "kvtransfer.choose_transport('a', 'b', 'cpu'); kvtransfer.choose_transport('a', 'a', 'cpu', 'object_store');"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("changes, message", [
    ({"num_tokens": 21}, "block_ids has 5 blocks, 21 tokens need 6"),
    ({"src_block_ids": SRC_IDS[:4]}, "src_block_ids has 4 blocks"),
    ({"num_tokens": 0}, "num_tokens must be positive"),
])
def test_block_counts_must_match_num_tokens(changes, message):
    with pytest.raises(KVTransferError, match=message):
        make_handle(**changes).check_counts()


def test_check_side_rejects_bad_block_ids():
    cache = torch.zeros(LAYOUT.cache_shape(NUM_BLOCKS))
    with pytest.raises(KVTransferError, match="outside"):
        check_side(cache, make_handle(dst_block_ids=(2, 20, 8, 9, NUM_BLOCKS)), "dst")
    with pytest.raises(KVTransferError, match="repeated"):
        check_side(cache, make_handle(dst_block_ids=(2, 20, 8, 2, 14)), "dst")
    with pytest.raises(KVTransferError, match="head_dim"):
        check_side(torch.zeros(3, 2, NUM_BLOCKS, 4, 2, 16), make_handle(), "src")


def test_copy_blocks_is_byte_exact_and_merges_runs():
    assert block_runs([3, 4, 5, 9], [7, 8, 1, 2]) == [(3, 7, 2), (5, 1, 1), (9, 2, 1)]
    src, dst = random_blocks(NUM_BLOCKS, seed=1), random_blocks(NUM_BLOCKS, seed=2)
    before = dst.clone()
    copy_blocks(src, SRC_IDS, dst, DST_IDS)
    assert torch.equal(dst[:, :, list(DST_IDS)], src[:, :, list(SRC_IDS)])
    others = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
    assert torch.equal(dst[:, :, others], before[:, :, others])


# ---- /dev/shm cache -----------------------------------------------------------------------

def test_shm_cache_is_shared_sized_and_removed_on_release():
    path = shm_path()
    cache = allocate_kv_cache(LAYOUT, NUM_BLOCKS, shm_path=path)
    try:
        assert os.path.getsize(path) == NUM_BLOCKS * LAYOUT.bytes_per_block
        assert cache.shape == LAYOUT.cache_shape(NUM_BLOCKS) and not cache.any()
        attach_kv_cache(LAYOUT, NUM_BLOCKS, path)[1, 0, 5].fill_(7.0)
        assert (cache[1, 0, 5] == 7.0).all()
        with pytest.raises(KVTransferError, match="needs"):
            attach_kv_cache(LAYOUT, NUM_BLOCKS + 1, path)
        with pytest.raises(KVTransferError, match="already exists"):
            allocate_kv_cache(LAYOUT, NUM_BLOCKS, shm_path=path)
    finally:
        release_kv_cache(path)
    assert not os.path.exists(path)
    release_kv_cache(path)  # idempotent


def test_shm_sender_rejects_a_layout_mismatch_before_writing():
    path = shm_path()
    dst = allocate_kv_cache(LAYOUT, NUM_BLOCKS, shm_path=path)
    try:
        wrong = dataclasses.replace(LAYOUT, head_dim=16)
        handle = make_handle(transport="shm", locator=path, layout=wrong)
        with pytest.raises(KVLayoutMismatchError, match="head_dim"):
            ShmSender().send(random_blocks(NUM_BLOCKS, seed=3), handle)
        with pytest.raises(KVLayoutMismatchError, match="head_dim"):
            make_receiver("shm", shm_path=path).receive(dst, handle)
        assert not dst.any()
    finally:
        release_kv_cache(path)


def test_shm_sender_drops_its_mapping_of_a_dead_workers_unlinked_pool():
    """A replaced decode worker's pool is unlinked; the sender must not keep its memory mapped."""
    old, new = shm_path(), shm_path()
    allocate_kv_cache(LAYOUT, NUM_BLOCKS, shm_path=old)
    allocate_kv_cache(LAYOUT, NUM_BLOCKS, shm_path=new)
    sender, src = ShmSender(), random_blocks(NUM_BLOCKS, seed=4)
    try:
        sender.send(src, sender.bind(make_handle(transport="shm", locator=old), SRC_IDS))
        release_kv_cache(old)   # the supervisor unlinks the dead worker's pool
        sender.send(src, sender.bind(make_handle(transport="shm", locator=new), SRC_IDS))
        assert list(sender._mapped) == [new]
    finally:
        release_kv_cache(old)
        release_kv_cache(new)


def test_a_send_into_an_unlinked_pool_is_the_decode_worker_lost_not_a_failed_transfer():
    """Only a decode worker's shutdown or the supervisor (after its death) unlinks its pool: a
    hand-off that finds it gone lost its peer (the router migrates the request and counts the
    death), it is no transfer failure (recomputed on that same, gone, worker)."""
    path = shm_path()
    allocate_kv_cache(LAYOUT, NUM_BLOCKS, shm_path=path)
    sender, src = ShmSender(), random_blocks(NUM_BLOCKS, seed=5)
    try:
        sender.send(src, sender.bind(make_handle(transport="shm", locator=path), SRC_IDS))   # mapped
        release_kv_cache(path)
        for fresh in (sender, ShmSender()):   # mapped before, or never
            with pytest.raises(PeerLostError, match="gone"):
                fresh.send(src, fresh.bind(make_handle(transport="shm", locator=path), SRC_IDS))
    finally:
        release_kv_cache(path)


# ---- transport choice and the fake ----------------------------------------------------------

@pytest.mark.parametrize("args, kwargs, expected", [
    (("n1", "n1", "cpu"), {}, "shm"),
    (("n1", "n2", "cpu"), {}, "torch_dist"),
    (("n1", "n2", "cpu"), {"dist_ready": False}, "object_store"),
    (("n1", "n1", "cuda:0"), {}, "cuda_ipc"),
    (("n1", "n1", "cuda:0"), {"decode_device": "cuda:1"}, "torch_dist"),
    (("n1", "n2", "cuda:0"), {}, "torch_dist"),
    (("n1", "n1", "cuda:0"), {"decode_device": "cpu"}, "object_store"),
    (("n1", "n1", "cpu", "object_store"), {}, "object_store"),
    (("n1", "n1", "cpu", "torch_dist"), {}, "torch_dist"),
    # a forced torch_dist while its group is down (being formed again): what placement allows
    (("n1", "n1", "cpu", "torch_dist"), {"dist_ready": False}, "shm"),
    (("n1", "n2", "cpu", "torch_dist"), {"dist_ready": False}, "object_store"),
    (("n1", "n1", "cpu", "shm"), {"dist_ready": False}, "shm"),
])
def test_choose_transport(args, kwargs, expected):
    assert choose_transport(*args, **kwargs) == expected


def test_choose_transport_rejects_an_unknown_forced_name():
    with pytest.raises(KVTransferError, match="unknown KV transport"):
        choose_transport("n1", "n1", "cpu", forced="carrier-pigeon")


def test_local_transport_moves_blocks_and_fails_on_demand():
    src, dst = random_blocks(NUM_BLOCKS, seed=4), torch.zeros(LAYOUT.cache_shape(NUM_BLOCKS))
    receiver = LocalReceiver()
    handle = make_handle(src_block_ids=(), locator=receiver.locator(dst))
    sender = LocalSender(fail_next=1)
    bound = sender.bind(handle, SRC_IDS)
    with pytest.raises(KVTransferError, match="injected"):
        sender.send(src, bound)
    assert not dst.any()
    result = sender.send(src, bound)
    receiver.receive(dst, result.handle)
    assert torch.equal(dst[:, :, list(DST_IDS)], src[:, :, list(SRC_IDS)])
    assert result.num_bytes == 5 * LAYOUT.bytes_per_block
    with pytest.raises(KVTransferError, match="stalled"):
        LocalSender(gate=threading.Event()).send(src, bound, timeout_s=0.05)
    receiver.close()


# ---- two real processes (Ray actors) --------------------------------------------------------

@pytest.fixture(scope="module")
def peer_actor():
    """``KVPeer`` as a Ray actor class (Ray started for the module if it is not running)."""
    ray = pytest.importorskip("ray")
    from kvtransfer.peer import KVPeer

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    actor = ray.remote(num_cpus=0)(KVPeer)
    if started:  # workers inherit PYTHONPATH from the raylet we start (a runtime_env costs ~5 s)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    else:
        actor = actor.options(runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield actor
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def peers(peer_actor):
    """(prefill-like peer, decode-like peer with a /dev/shm cache, that cache's path)."""
    import ray

    path = shm_path()
    prefill, decode = peer_actor.remote(LAYOUT, NUM_BLOCKS), peer_actor.remote(LAYOUT, NUM_BLOCKS, shm_path=path)
    ray.get(prefill.write_blocks.remote(list(SRC_IDS), random_blocks(len(SRC_IDS), seed=5)))
    ray.get(decode.write_blocks.remote(list(range(NUM_BLOCKS)), random_blocks(NUM_BLOCKS, seed=6)))
    yield prefill, decode, path
    ray.get([prefill.close.remote(), decode.close.remote()])
    assert not os.path.exists(path), "the owner's close() must unlink its /dev/shm cache"
    for peer in (prefill, decode):
        ray.kill(peer)


@pytest.fixture
def gloo_pair(peers):
    """The two peers in a fresh 2-rank gloo group (prefill rank 0, decode rank 1)."""
    import ray
    from kvtransfer.rendezvous import rendezvous_address

    prefill, decode, _ = peers
    address = rendezvous_address()
    ray.get([prefill.join_group.remote(address, 2, 0, 20.0), decode.join_group.remote(address, 2, 1, 20.0)])
    return prefill, decode


def transfer(prefill, decode, req_id: str, transport: str, dst_ids=DST_IDS, src_ids=SRC_IDS, timeout_s=20.0):
    """One hand-off in the documented call order; returns (sender, receiver) results."""
    import ray

    handle = ray.get(decode.new_handle.remote(req_id, list(dst_ids), NUM_TOKENS, transport))
    return run_bound(prefill, decode, ray.get(prefill.bind.remote(handle, list(src_ids))), timeout_s)


def run_bound(prefill, decode, handle, timeout_s=20.0):
    import ray

    if handle.transport == "torch_dist":  # rendezvous: the receive must be running during send
        received = decode.receive.remote(handle, timeout_s)
        sent = prefill.send.remote(handle, timeout_s)
        return ray.get(sent)[0], ray.get(received)[0]
    sent = ray.get(prefill.send.remote(handle, timeout_s))[0]
    return sent, ray.get(decode.receive.remote(sent.handle, timeout_s))[0]


def assert_landed(prefill, decode, before: torch.Tensor, dst_ids=DST_IDS) -> None:
    import ray

    src, after = ray.get([prefill.snapshot.remote(), decode.snapshot.remote()])
    assert torch.equal(after[:, :, list(dst_ids)], src[:, :, list(SRC_IDS)]), "KV differs from the source"
    others = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert torch.equal(after[:, :, others], before[:, :, others]), "a block outside the reservation changed"


@pytest.mark.parametrize("transport", ["shm", "object_store", "torch_dist"])
def test_round_trip_between_ray_actors_is_byte_exact(peers, request, transport):
    import ray

    prefill, decode, _ = peers
    if transport == "torch_dist":
        request.getfixturevalue("gloo_pair")
    dst_ids = tuple(reversed(DST_IDS)) if transport == "torch_dist" else DST_IDS
    before = ray.get(decode.snapshot.remote())
    sent, received = transfer(prefill, decode, f"req-{transport}", transport, dst_ids=dst_ids)
    assert sent.num_bytes == received.num_bytes == len(DST_IDS) * LAYOUT.bytes_per_block
    assert_landed(prefill, decode, before, dst_ids)


def test_object_store_receiver_checks_the_layout(peers):
    import ray

    prefill, decode, _ = peers
    handle = ray.get(decode.new_handle.remote("req-os-bad", list(DST_IDS), NUM_TOKENS, "object_store"))
    sent = ray.get(prefill.send.remote(ray.get(prefill.bind.remote(handle, list(SRC_IDS)))))[0]
    before = ray.get(decode.snapshot.remote())
    wrong = dataclasses.replace(sent.handle, layout=dataclasses.replace(LAYOUT, num_kv_heads=4))
    with pytest.raises(KVTransferError, match="num_kv_heads"):
        ray.get(decode.receive.remote(wrong))
    assert torch.equal(ray.get(decode.snapshot.remote()), before)


def test_torch_dist_failures_raise_and_keep_the_pair_in_step(peers, gloo_pair):
    import ray

    prefill, decode = gloo_pair
    before = ray.get(decode.snapshot.remote())
    # 1. decode side rejects its own reservation: it drains the payload, then raises.
    with pytest.raises(KVTransferError, match="outside"):
        transfer(prefill, decode, "req-bad-dst", "torch_dist", dst_ids=(2, 20, 8, 9, 99))
    # 2. the sender's layout differs from the handle's: it raises and the receiver hears of it.
    handle = ray.get(decode.new_handle.remote("req-bad-layout", list(DST_IDS), NUM_TOKENS, "torch_dist"))
    handle = ray.get(prefill.bind.remote(handle, list(SRC_IDS)))
    wrong = dataclasses.replace(handle, layout=dataclasses.replace(LAYOUT, block_size=8), num_tokens=40)
    received = decode.receive.remote(wrong, 20.0)
    with pytest.raises(KVTransferError, match="block_size"):
        ray.get(prefill.send.remote(wrong, 20.0))
    with pytest.raises(KVTransferError, match="aborted"):
        ray.get(received)
    # 3. the two sides disagree on the order: the receiver detects it instead of landing garbage.
    first = ray.get(decode.new_handle.remote("req-a", list(DST_IDS), NUM_TOKENS, "torch_dist"))
    second = dataclasses.replace(first, req_id="req-b")
    received = decode.receive.remote(ray.get(prefill.bind.remote(first, list(SRC_IDS))), 20.0)
    ray.get(prefill.send.remote(ray.get(prefill.bind.remote(second, list(SRC_IDS))), 20.0))
    with pytest.raises(KVTransferError, match="different orders"):
        ray.get(received)
    assert torch.equal(ray.get(decode.snapshot.remote()), before), "a failed transfer wrote blocks"
    # ... and the pair still works.
    transfer(prefill, decode, "req-after-failures", "torch_dist")
    assert_landed(prefill, decode, before)


def test_torch_dist_receive_times_out(peers, gloo_pair):
    import ray

    prefill, decode = gloo_pair
    handle = ray.get(decode.new_handle.remote("req-never-sent", list(DST_IDS), NUM_TOKENS, "torch_dist"))
    handle = ray.get(prefill.bind.remote(handle, list(SRC_IDS)))
    with pytest.raises(KVTransferError, match="Timed out"):
        ray.get(decode.receive.remote(handle, 0.5))
    with pytest.raises(KVTransferError, match="re-create the process group"):
        ray.get(decode.receive.remote(handle, 0.5))


def test_torch_dist_pair_works_in_a_new_group_after_a_member_died(peer_actor, peers):
    """A member of the group dies: a transfer with it fails and marks that pair broken. Once its
    replacement is up, the survivors join a fresh group with it under the same ranks (each leaves
    the broken one first): transfers work again, byte exact, the broken pair's state not reused."""
    import ray

    from kvtransfer.rendezvous import rendezvous_address

    prefill, decode, _ = peers
    doomed = peer_actor.remote(LAYOUT, NUM_BLOCKS)
    address = rendezvous_address()
    ray.get([prefill.join_group.remote(address, 2, 0, 20.0), doomed.join_group.remote(address, 2, 1, 20.0)])
    transfer(prefill, doomed, "req-before-death", "torch_dist")
    handle = ray.get(prefill.bind.remote(ray.get(doomed.new_handle.remote("req-dying", list(DST_IDS), NUM_TOKENS,
                                                                            "torch_dist")), list(SRC_IDS)))
    reserved = ray.get(doomed.new_handle.remote("req-reserved", list(DST_IDS), NUM_TOKENS, "torch_dist"))   # not yet bound
    ray.kill(doomed)
    with pytest.raises(KVTransferError, match="rank 1"):
        ray.get(prefill.send.remote(handle, 5.0))
    with pytest.raises(KVTransferError, match="failed earlier"):
        ray.get(prefill.send.remote(handle, 5.0))
    address = rendezvous_address()   # the replacement (here ``decode``) takes rank 1
    ray.get([prefill.join_group.remote(address, 2, 0, 20.0), decode.join_group.remote(address, 2, 1, 20.0)])
    # Hand-offs set up in the old group are refused on both sides, nothing sent: rank 1 is another
    # worker now (a probe: a dead decode worker's reservation, bound and sent after the group was
    # formed again, took the receive of the replacement's own hand-off: a 30 s stall, a broken pair).
    with pytest.raises(KVGroupChangedError):
        ray.get(prefill.bind.remote(reserved, list(SRC_IDS)))
    with pytest.raises(KVGroupChangedError):
        ray.get(prefill.send.remote(handle, 5.0))
    with pytest.raises(KVGroupChangedError):
        ray.get(decode.receive.remote(handle, 5.0))
    before = ray.get(decode.snapshot.remote())
    sent, received = transfer(prefill, decode, "req-new-group", "torch_dist")
    assert sent.num_bytes == received.num_bytes == len(DST_IDS) * LAYOUT.bytes_per_block
    assert_landed(prefill, decode, before)


def test_joining_again_waits_for_transfers_in_flight_and_refuses_new_ones():
    """In one process (a 1-rank group): a join while a transfer runs waits for it; transfers
    asked for meanwhile are refused; a transfer that outlasts ``drain_s`` keeps the old group."""
    import time

    import torch.distributed as dist

    from kvtransfer import torch_dist
    from kvtransfer.rendezvous import rendezvous_address

    membership = torch_dist._membership
    torch_dist.init_kv_group(rendezvous_address(), 1, 0, timeout_s=10.0)
    group = membership.group
    try:
        in_flight, done = threading.Event(), threading.Event()

        def transfer_in_flight():
            with membership.transfer(group):
                in_flight.set()
                done.wait(10)

        holder = threading.Thread(target=transfer_in_flight)
        holder.start()
        assert in_flight.wait(5)
        generation = membership.generation
        joiner = threading.Thread(target=torch_dist.init_kv_group, args=(rendezvous_address(), 1, 0),
                                  kwargs={"timeout_s": 10.0})
        joiner.start()
        time.sleep(0.3)
        assert joiner.is_alive(), "the join did not wait for the transfer in flight"
        with pytest.raises(KVTransferError, match="not in a KV group"):
            with membership.transfer(group):
                pass
        with pytest.raises(KVTransferError, match="not in a KV group"):   # nor is a hand-off bound
            membership.rank(group)
        done.set()
        holder.join(5)
        joiner.join(10)
        assert not joiner.is_alive() and membership.generation > generation and dist.is_initialized()
        with pytest.raises(KVGroupChangedError):   # set up in the group before
            with membership.transfer(group):
                pass
        group = membership.group
        with membership.transfer(group) as now:
            assert now == membership.generation
        # a transfer that does not end within drain_s: the join gives up and the group stays
        in_flight.clear(), done.clear()
        holder = threading.Thread(target=transfer_in_flight)
        holder.start()
        assert in_flight.wait(5)
        generation = membership.generation
        with pytest.raises(KVTransferError, match="still in flight"):
            torch_dist.init_kv_group(rendezvous_address(), 1, 0, timeout_s=10.0, drain_s=0.2)
        assert membership.generation == generation and dist.is_initialized()
        done.set()
        holder.join(5)
    finally:
        torch_dist.destroy_kv_group()
    assert not dist.is_initialized()


def _fresh_member(address: str, out) -> None:
    """A replacement's first join (rank 1), then one tensor to rank 0."""
    import torch.distributed as dist

    from kvtransfer import torch_dist

    torch.set_num_threads(1)
    try:
        torch_dist.init_kv_group(address, 2, 1, timeout_s=20.0)
        dist.send(torch.arange(4.0), 0)
        out.put("ok")
    except Exception as exc:   # noqa: BLE001 - reported to the test, which fails naming it
        out.put(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    finally:
        torch_dist.destroy_kv_group()


def test_a_member_whose_join_failed_meets_a_fresh_process_at_the_next_join():
    """Found by a probe: a member whose join failed (its peer died during the rendezvous) kept
    torch's count of the group it did not make, so at every later join it waited for other store
    keys than its fresh replacement peer wrote, and the group was never formed again."""
    import multiprocessing

    import torch.distributed as dist

    from kvtransfer import torch_dist
    from kvtransfer.rendezvous import rendezvous_address

    with pytest.raises(Exception):   # noqa: B017 - torch's own timeout error: no peer ever comes
        torch_dist.init_kv_group(rendezvous_address(), 2, 0, timeout_s=1.0)
    assert not dist.is_initialized()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    address = rendezvous_address()
    child = ctx.Process(target=_fresh_member, args=(address, out))
    child.start()
    try:
        torch_dist.init_kv_group(address, 2, 0, timeout_s=20.0)
        got = torch.zeros(4)
        dist.recv(got, 1)
        assert torch.equal(got, torch.arange(4.0))
        assert out.get(timeout=20) == "ok"
    finally:
        torch_dist.destroy_kv_group()
        child.join(20)
        if child.is_alive():
            child.kill()


def _hosting_rank0(addresses) -> None:
    """Rank 0 of a 3-member forming: hosts the store (as ``kv_group_address`` does), then joins."""
    from kvtransfer import group_store, torch_dist

    torch.set_num_threads(1)
    address = group_store.host("127.0.0.1", 30.0)
    addresses.put(address)
    torch_dist.init_kv_group(address, 3, 0, timeout_s=30.0, hosted=True)


def _timed_member(address: str, rank: int, out) -> None:
    import time

    from kvtransfer import torch_dist

    torch.set_num_threads(1)
    start = time.monotonic()
    try:
        torch_dist.init_kv_group(address, 3, rank, timeout_s=30.0, hosted=True)
        out.put((rank, "joined", time.monotonic() - start))
    except Exception as exc:   # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", time.monotonic() - start))


@pytest.mark.parametrize("rank0_dies", [False, True])
def test_rank_0_lost_during_a_forming_fails_every_join_at_once(rank0_dies):
    """Found by a probe: rank 0 (its store's host) SIGKILLed as a forming's joins went out; a
    member that reached for the store after that retried its connect for the whole 30 s timeout,
    twice, with a random pause between (63-72 s), and the group came back 84-96 s after the first
    kill. Rank 0 now hosts the store before any join is asked for: a member already connected
    fails as the store goes, a later one finds nothing listening and fails at once."""
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("spawn")
    addresses, out = ctx.Queue(), ctx.Queue()
    rank0 = ctx.Process(target=_hosting_rank0, args=(addresses,))
    rank0.start()
    address = addresses.get(timeout=60)
    members = [ctx.Process(target=_timed_member, args=(address, 1, out))]
    members[0].start()
    if rank0_dies:
        time.sleep(1.0)   # rank 1 is connected, waiting for rank 2
        os.kill(rank0.pid, signal.SIGKILL)
    members.append(ctx.Process(target=_timed_member, args=(address, 2, out)))
    members[1].start()
    try:
        results = sorted(out.get(timeout=60) for _ in members)
    finally:
        for p in (rank0, *members):
            p.kill()
            p.join(10)
    if not rank0_dies:
        assert [r[1] for r in results] == ["joined", "joined"]
        return
    assert all(r[1] != "joined" and r[2] < 10 for r in results), results
    assert "rendezvous store at 127.0.0.1" in results[1][1] and "is gone" in results[1][1], results


def test_a_reservation_for_torch_dist_outside_a_group_is_refused_before_any_block_is_held():
    """A decode worker not in a KV group (it is being formed again) refuses a torch_dist
    reservation: it said so only after reserving the prompt's blocks, which nothing freed."""
    import asyncio

    from decode_worker.worker import DecodeWorker
    from engine.config import EngineConfig
    from engine.types import RequestSpec, SamplingParams
    from engine.worker_base import WorkerSpec

    async def scenario():
        worker = DecodeWorker(WorkerSpec("decode-t", random_model={"seed": 0}, engine=EngineConfig(num_kv_blocks=32)))
        worker.start()
        try:
            spec = RequestSpec("r", tuple(range(1, 40)), SamplingParams(max_tokens=4))
            with pytest.raises(KVTransferError, match="not in a KV group"):
                await worker.reserve(spec, "torch_dist")
            return await worker.leak_report()
        finally:
            worker.shutdown()

    report = asyncio.run(scenario())
    assert report["requests"] == 0 and report["free_blocks"] == report["total_blocks"]


# ---- CUDA IPC (hardware-gated) ----------------------------------------------------------------

def _cuda_ipc_sender(handle: KVBlocksHandle, src: torch.Tensor) -> None:
    from kvtransfer.cuda_ipc import CudaIpcSender

    sender = CudaIpcSender()
    sender.send(src.cuda(), sender.bind(handle, SRC_IDS))
    sender.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_round_trip_between_processes():
    import torch.multiprocessing as mp

    from kvtransfer.cuda_ipc import CudaIpcReceiver

    dst = torch.zeros(LAYOUT.cache_shape(NUM_BLOCKS), device="cuda")
    src = random_blocks(NUM_BLOCKS, seed=7)
    receiver = CudaIpcReceiver()
    handle = make_handle(src_block_ids=(), transport="cuda_ipc", locator=receiver.locator(dst))
    child = mp.get_context("spawn").Process(target=_cuda_ipc_sender, args=(handle, src))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    receiver.receive(dst, dataclasses.replace(handle, src_block_ids=SRC_IDS))
    assert torch.equal(dst[:, :, list(DST_IDS)].cpu(), src[:, :, list(SRC_IDS)])
    others = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
    assert not dst[:, :, others].any()
