"""Prefix caching in the engine: the block pool's reference counts, LRU eviction and
confirmed lookups; the scheduler starting a prefill after the cached prefix; and greedy outputs
equal to HF ``generate`` (and so to the cache-off engine) for requests sharing prefixes of
various lengths, sequential and concurrent, across chunked prefill, preemption, abort, eviction
under pressure, migration and forced hash collisions. Each ends with a leak check, in which
cached-but-free blocks count as free."""

from __future__ import annotations

import random

import pytest

from engine.block_pool import BlockPool
from engine.config import EngineConfig, EngineRole
from engine.engine import LLMEngine
from engine.kv_manager import KVCacheManager
from engine.prefix_hash import block_hashes, default_block_hash, max_cached_tokens
from engine.types import FinishReason, RequestSpec, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy
from tests.test_engine_exact import run_staggered
from tests.test_scheduler import assert_empty, drain, make_scheduler, req, step


def colliding_hash(parent, token_ids) -> int:
    """Every block gets the same hash: every lookup past the first filed block collides."""
    return 42


# ---- the pool and the manager -----------------------------------------------------------------
def test_block_hashes_chain_and_extend():
    tokens = list(range(10))
    full = block_hashes(tokens, 4)
    assert len(full) == 2, "only full blocks are hashed"
    assert block_hashes(tokens, 4, known=full[:1]) == full
    assert block_hashes([0, 1, 2, 3, 9, 5, 6, 7], 4)[1] != full[1], "a block's hash covers its content"
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != full[1], "... and its parent's"
    assert default_block_hash(None, (1, 2)) == default_block_hash(None, (1, 2))
    assert max_cached_tokens(8) == 7 and max_cached_tokens(0) == 0


def test_pool_shares_counts_and_evicts_least_recently_freed():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert pool.cache(a[0], 1, (1,), 0) == 1 and pool.cache(a[1], 2, (2,), 1) == 2
    pool.touch(a)                       # a second request shares both
    pool.free(a)
    assert pool.num_free == 2, "still held by the other request"
    pool.free(a)
    assert pool.num_free == 4 and pool.num_cached == 2, "freed, still findable"
    assert pool.lookup(1, (1,), 0) == a[0]
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(a), "uncached free blocks go first"
    b = pool.allocate(1)
    assert b == [a[1]], "the tail of a prompt (freed first) is evicted first"
    assert pool.lookup(2, (2,), 1) is None and pool.lookup(1, (1,), 0) == a[0]
    assert pool.num_evictions == 1
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([a[0]])


def test_lookup_confirms_tokens_and_parent_never_trusts_the_hash():
    pool = BlockPool(4)
    a = pool.allocate(2)
    first = pool.cache(a[0], 7, (1, 2), 0)
    assert pool.cache(a[1], 7, (3, 4), first) is None, "a hash taken by other content is not filed"
    assert pool.lookup(7, (3, 4), first) is None, "same hash, other tokens: a miss"
    assert pool.lookup(7, (1, 2), first) is None, "same tokens after another parent: a miss"
    assert pool.num_collisions >= 2
    pool.free(a)
    # Block a[0] is reused for other content: a child filed under the old content must not be
    # found behind the new one, even if the block id (and, under a collision, the hash) match.
    pool2 = BlockPool(2)
    x = pool2.allocate(2)
    s0 = pool2.cache(x[0], 1, (1,), 0)
    pool2.cache(x[1], 2, (2,), s0)
    pool2.free(x)
    reused = pool2.allocate(2)
    assert pool2.num_cached == 0 and sorted(reused) == sorted(x)


def test_manager_finds_confirmed_prefix_and_counts_hits():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(10, 22))                            # 3 full blocks
    kv.admit("a", tokens, [], len(tokens))
    kv.cache_computed("a", tokens, len(tokens))
    assert len(kv.find_cached("b", tokens)) == 2, "the last token is always computed: 11 // 4 blocks"
    assert len(kv.find_cached("c", tokens[:9] + [99, 98, 97])) == 2
    assert kv.find_cached("d", [1] + tokens[1:]) == [], "the first block differs"
    kv.free("a")
    for r in "bcd":
        kv.free(r)
    cached = kv.find_cached("e", tokens + [5])
    assert len(cached) == 3 and kv.can_admit("e", cached, 13)
    assert kv.admit("e", tokens + [5], cached, 13) == 12
    assert kv.counters.queries == 12 + 13 and kv.counters.hits == 12
    kv.free("e")
    assert kv.num_free_blocks == kv.num_total_blocks and not kv.block_tables


def test_evicting_a_parent_uncaches_its_descendants_so_none_is_orphaned():
    """a and b compute the same first block at once: b's copy stays uncached and b files its
    second block under a's copy. Evicting a's copy leaves b's second block unreachable; it must
    not keep its hash (an orphan would refuse the same content filed again after a recomputed
    first block, so c's filing would break and d would find one block instead of two)."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a, b = x + y + [0], x + z + [0]
    for r, tokens in (("a", a), ("b", b)):
        assert kv.find_cached(r, tokens) == []
        kv.admit(r, tokens, [], len(tokens))
    for r, tokens in (("a", a), ("b", b)):
        kv.cache_computed(r, tokens, len(tokens))
    assert kv.pool.num_cached == 3, "x (a's copy), y, z"
    kv.free("a")
    kv.free("b")
    pressure = kv.allocate_slots("p", 7 * 4)     # five uncached blocks, then a's y and x (LRU)
    assert kv.pool.num_evictions == 2
    assert kv.pool.num_cached == 0, "z went with its parent"
    kv.free("p")
    c = x + z + [7]
    assert kv.find_cached("c", c) == []
    kv.admit("c", c, [], len(c))
    kv.cache_computed("c", c, len(c))
    kv.free("c")
    assert len(kv.find_cached("d", x + z + [8])) == 2, "x and z filed again and found"
    assert kv.pool.num_collisions == 0, "nothing here collides"
    kv.free("d")
    assert kv.num_free_blocks == kv.num_total_blocks and len(pressure) == 7


def test_content_under_an_evicted_parent_is_not_filed():
    """A request whose chain went through another block's copy of its first block, evicted
    while it runs, stops filing: its next block's parent is gone."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    x = [1, 2, 3, 4]
    a, b = x + [0], x + [5, 6, 7, 8, 9]
    for r, tokens in (("a", a), ("b", b)):
        kv.admit(r, tokens, [], len(tokens))
    kv.cache_computed("a", a, len(a))
    kv.cache_computed("b", b, 4)                 # b's x: a's copy is cached, b chains through it
    kv.free("a")
    kv.allocate_slots("p", kv.num_free_blocks * 4)   # evicts a's x
    kv.cache_computed("b", b, 8)
    assert kv.pool.num_cached == 0
    for r in "bp":
        kv.free(r)
    assert kv.num_free_blocks == kv.num_total_blocks


def test_pool_reports_stored_and_removed_blocks_in_order():
    pool = BlockPool(2)
    a = pool.allocate(2)
    s0 = pool.cache(a[0], 10, (1,), 0)
    pool.cache(a[1], 11, (2,), s0)
    pool.cache(a[1], 11, (2,), s0)               # already cached: no event
    first = pool.take_events()
    assert [(e.kind.value, e.block_hash) for e in first] == [("stored", 10), ("stored", 11)]
    pool.free(a)
    pool.allocate(1)                             # evicts the tail (11), then nothing else
    pool.allocate(1)                             # evicts 10
    second = pool.take_events()
    assert [(e.kind.value, e.block_hash) for e in second] == [("removed", 11), ("removed", 10)]
    assert [e.seq for e in first + second] == [1, 2, 3, 4] and pool.take_events() == ()


# ---- the scheduler --------------------------------------------------------------------------------
def cached_scheduler(**kwargs):
    s = make_scheduler(**kwargs)
    s.kv.enable_prefix_caching = True
    return s


def test_prefill_starts_after_the_cached_prefix():
    s = cached_scheduler(budget=64)
    s.add(req("a", 22, max_tokens=2))                       # 5 full blocks of 4
    drain(s)
    s.add(req("b", 30, max_tokens=2))                       # shares a's 22 tokens: 5 blocks
    plan, *_ = step(s)
    assert plan == {"b": 10}, "20 cached tokens skipped"
    drain(s)
    s.add(req("c", 20, max_tokens=2))                       # all 5 blocks cached, the last recomputed
    plan, *_ = step(s)
    assert plan == {"c": 4}
    drain(s)
    assert s.kv.counters.hits == 20 + 16
    assert_empty(s)


def test_cached_blocks_are_shared_not_copied():
    s = cached_scheduler(num_blocks=12, budget=64)
    s.add(req("a", 17, max_tokens=8))
    step(s)
    s.add(req("b", 17, max_tokens=8))
    step(s)
    ta, tb = s.kv.block_tables["a"], s.kv.block_tables["b"]
    assert ta[:4] == tb[:4] and ta[4] != tb[4], "4 full blocks shared; the last partial one is b's own"
    drain(s)
    assert_empty(s)


def test_blocked_queue_head_looks_its_prefix_up_once_per_cache_change():
    """The head of the queue waits for room step after step; its cached prefix is looked up
    again only when the cache's content changed (a block filed or evicted)."""
    s = cached_scheduler(num_blocks=10, budget=64)
    s.add(req("a", 20, max_tokens=3))                       # 5 full blocks, filed
    drain(s)
    s.add(req("big", 28, max_tokens=5))                     # shares a's 5 blocks, holds 7
    step(s)
    lookups = []
    real = s.kv.pool.lookup
    s.kv.pool.lookup = lambda *a: lookups.append(a) or real(*a)
    s.add(req("c", 37, max_tokens=2))                       # 7 cached (big filed its prompt) + 3 new, 2 free
    versions = set()
    for _ in range(3):                                      # big decodes tokens 29-31: no block fills
        plan, *_ = step(s)
        assert "c" not in plan
        versions.add(s.kv.pool.version)
    assert len(versions) == 1 and len(lookups) == 8, "c's 7 hits and 1 miss, once (24 without the memo)"
    drain(s)
    assert s.kv.counters.hits >= 20 + 28, "big found a's prefix, c found big's"
    assert_empty(s)


def test_decode_role_reserve_shares_cached_prefix():
    s = cached_scheduler(role=EngineRole.DECODE)
    first = req("a", 10, max_tokens=3)
    blocks = s.park(first)
    s.unpark("a", 7)
    drain(s)
    second = req("b", 13, max_tokens=3)
    cached = s.kv.find_cached("b", second.all_token_ids)
    assert cached == blocks[:2], "a's two full prompt blocks are still cached (free)"
    assert s.park(second, cached)[:2] == blocks[:2]
    s.unpark("b", 7)
    drain(s)
    assert_empty(s)


# ---- greedy outputs equal HF ------------------------------------------------------------------------
MAX_NEW = 12


@pytest.fixture(scope="module")
def shared_workload(hf_reference):
    """Prompts sharing prefixes of several lengths: two 'system prompts' (37 tokens, not aligned
    to any block size used here; 32, aligned), prompts that are a prefix of another, one equal
    to a system prompt, and a second turn that resends the first turn and its answer."""
    rng = random.Random(11)
    sys_a = [rng.randrange(3, 500) for _ in range(37)]
    sys_b = [rng.randrange(3, 500) for _ in range(32)]
    tail = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    prompts = [sys_a + tail(5), sys_a + tail(11), sys_b + tail(1), sys_b + tail(17), list(sys_a), list(sys_b),
               sys_a[:20] + tail(9), sys_b + tail(3)]
    refs = [hf_greedy(hf_reference, p, MAX_NEW) for p in prompts]
    turn2 = prompts[0] + refs[0] + tail(7)
    prompts.append(turn2)
    refs.append(hf_greedy(hf_reference, turn2, MAX_NEW))
    return prompts, refs


CONFIGS = {
    "default": EngineConfig(num_kv_blocks=256),
    "small_blocks": EngineConfig(num_kv_blocks=256, block_size=4),
    "chunked": EngineConfig(num_kv_blocks=256, max_num_batched_tokens=7, block_size=4),
    "preempt": EngineConfig(num_kv_blocks=16, block_size=8, max_num_batched_tokens=64),
}


def specs_for(prompts, prefix="r"):
    return [RequestSpec(f"{prefix}{i}", tuple(p), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_matches_hf_sequential(tiny_model, shared_workload, name):
    prompts, refs = shared_workload
    engine = LLMEngine(tiny_model, CONFIGS[name])
    for spec, ref in zip(specs_for(prompts), refs):
        assert engine.generate([spec])[spec.req_id] == ref, f"{spec.req_id} differs under {name}"
    assert engine.kv.counters.hits > 0
    assert engine.kv.pool.num_cached > 0, "cached blocks outlive their requests ..."
    assert_no_leaks(engine)   # ... and count as free: no request holds them


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_matches_hf_concurrent(tiny_model, shared_workload, name):
    prompts, refs = shared_workload
    engine = LLMEngine(tiny_model, CONFIGS[name])
    got = run_staggered(engine, prompts, [MAX_NEW] * len(prompts))
    for i, ref in enumerate(refs):
        assert got[f"r{i}"] == ref, f"request r{i} differs from HF generate under {name}"
    assert engine.kv.counters.hits > 0
    if name == "preempt":
        assert engine.scheduler.num_preemptions > 0, "the tiny pool must force preemption"
    assert_no_leaks(engine)


def test_cache_off_matches_and_finds_nothing(tiny_model, shared_workload):
    prompts, refs = shared_workload
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, block_size=4, enable_prefix_caching=False))
    got = run_staggered(engine, prompts, [MAX_NEW] * len(prompts))
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert engine.kv.counters.hits == 0 and engine.kv.pool.num_cached == 0
    assert_no_leaks(engine)


def test_eviction_under_pressure(tiny_model, shared_workload):
    """A pool too small to keep every prefix: cached blocks are evicted (LRU) and recomputed."""
    prompts, refs = shared_workload
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=14, block_size=8))
    for _ in range(2):
        for spec, ref in zip(specs_for(prompts), refs):
            assert engine.generate([spec])[spec.req_id] == ref
    assert engine.kv.pool.num_evictions > 0 and engine.kv.counters.hits > 0
    assert_no_leaks(engine)


def test_forced_hash_collisions_are_detected_and_recomputed(tiny_model, shared_workload):
    prompts, refs = shared_workload
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, block_size=4), block_hash_fn=colliding_hash)
    got = run_staggered(engine, prompts, [MAX_NEW] * len(prompts))
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert engine.kv.pool.num_collisions > 0
    for spec, ref in zip(specs_for(prompts, "again"), refs):
        assert engine.generate([spec])[spec.req_id] == ref
    assert_no_leaks(engine)


def test_abort_keeps_shared_blocks_for_the_others(tiny_model, shared_workload):
    prompts, refs = shared_workload
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, block_size=4, max_num_batched_tokens=16))
    specs = specs_for(prompts[:4])
    for spec in specs:
        engine.add_request(spec)
    got = {s.req_id: [] for s in specs}
    for i in range(6):
        if i == 3:
            engine.abort("r1")          # mid-prefill of a request sharing r0's blocks
        for d in engine.step().deltas:
            got[d.req_id].extend(d.token_ids)
            if d.req_id == "r1":
                assert d.finish_reason in (None, FinishReason.ABORT)
    while engine.has_work():
        for d in engine.step().deltas:
            got[d.req_id].extend(d.token_ids)
    for i in (0, 2, 3):
        assert got[f"r{i}"] == refs[i]
    again = specs_for([prompts[1]], "again")[0]
    assert engine.generate([again])["again0"] == refs[1]
    assert_no_leaks(engine)


def test_migrated_request_resumes_from_cached_prompt(tiny_model, shared_workload):
    """A migrated request's prompt is the original plus the tokens it streamed: the original's
    blocks are a cached prefix, and the continuation equals the uninterrupted output."""
    prompts, refs = shared_workload
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, block_size=4))
    engine.generate(specs_for(prompts[:1]))
    resumed = RequestSpec("m", tuple(prompts[0] + refs[0][:5]), SamplingParams(max_tokens=MAX_NEW - 5, ignore_eos=True),
                          num_generated=5)
    hits = engine.kv.counters.hits
    assert engine.generate([resumed])["m"] == refs[0][5:]
    assert engine.kv.counters.hits - hits >= len(prompts[0]) // 4 * 4
    assert_no_leaks(engine)


def test_prefill_and_decode_engines_with_cached_prefix(tiny_model, hf_reference, shared_workload):
    """Two engines in one process: the decode side's reservation says which leading blocks it
    holds already; only the rest is copied, and the output still equals HF."""
    prompts, refs = shared_workload
    prefill = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, block_size=4, role=EngineRole.PREFILL))
    decode = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, block_size=4, role=EngineRole.DECODE))
    moved = []
    for spec, ref in zip(specs_for(prompts[:2]), refs):
        dst, num_cached = decode.reserve_prefix(spec)
        prefill.add_request(spec)
        done = []
        while not done:
            done = prefill.step().prefilled
        skip = num_cached // 4
        src = list(done[0].block_ids)
        decode.cache[:, :, dst[skip:]] = prefill.cache[:, :, src[skip:]]
        moved.append(len(dst) - skip)
        prefill.release(spec.req_id)
        decode.commit_kv(spec.req_id, done[0].first_token_id)
        out = [done[0].first_token_id]
        while decode.has_work():
            for d in decode.step().deltas:
                out.extend(d.token_ids)
        assert out == ref
    assert moved[1] < moved[0], "the second request moved fewer blocks"
    assert prefill.kv.counters.hits > 0 and decode.kv.counters.hits > 0
    assert decode.stats().prefix_cache_hit_tokens == decode.kv.counters.hits
    assert_no_leaks(prefill)
    assert_no_leaks(decode)
