"""Decode graphs (engine/cuda_graphs.py), the CPU side: everything but the capture itself.

- The capture ladder and the padding rule (next captured batch size, next block-table width).
- The plan: graphs on only for CUDA (or GraphMode.UNCAPTURED), never for a prefill worker; the
  null block is kept out of the KV manager's hands.
- The static rows: each request's token, position, slot, context length and block table in its
  row; padded rows and table tails on the null block; and, running the step, nothing but the real
  rows' slots and the null block changes in the KV cache.
- Fallbacks to eager: a prefill token in the step, a batch above the largest size, a context
  wider than the widest table, graphs switched off.
- The fixed-shape path the graphs replay, run without capture (GraphMode.UNCAPTURED): the same
  logits as the eager path step by step, and greedy output equal to HF ``generate`` under every
  engine config, with the C++ paged kernel and with the torch attention the GPU uses.
- The dtype rule (bf16 by default on CUDA, fp32 on CPU) and the serve flags.
The GPU side (capture, replay == eager == HF) is in test_cuda.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest
import torch

from engine import cuda_graphs
from engine.config import EngineConfig, EngineRole, GraphMode
from engine.cuda_graphs import CTX, ID, POS, SLOT, TABLE, DecodeGraphPool, Fallback, GraphInputs, GraphPlan
from engine.engine import LLMEngine
from engine.kv_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.types import RequestSpec, SamplingParams
from tests.conftest import assert_no_leaks, greedy_workload, hf_greedy
from tests.test_engine_exact import CONFIGS, run_staggered

UNCAPTURED = GraphMode.UNCAPTURED


@pytest.fixture(scope="module")
def workload(hf_reference):
    return greedy_workload(hf_reference, seed=11, num=10, prompt_len=(1, 90), output_len=(1, 24))


# ---- ladders and padding ------------------------------------------------------------------------
def test_capture_sizes_follow_vllms_ladder():
    assert cuda_graphs.capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert cuda_graphs.capture_sizes(10) == (1, 2, 4, 8, 16)   # the first size that holds 10
    assert cuda_graphs.capture_sizes(1) == (1,)
    assert cuda_graphs.capture_sizes(3) == (1, 2, 4)
    assert cuda_graphs.capture_sizes(10_000)[-1] == cuda_graphs.MAX_CAPTURE_BATCH


def test_width_ladder_doubles_up_to_the_widest():
    assert cuda_graphs.width_ladder(128) == (4, 8, 16, 32, 64, 128)
    assert cuda_graphs.width_ladder(13) == (4, 8, 13)
    assert cuda_graphs.width_ladder(4) == (4,)
    assert cuda_graphs.width_ladder(2) == (2,)


@pytest.mark.parametrize("value, padded", [(1, 1), (3, 4), (5, 8), (9, 16), (17, 24), (64, 64), (65, None)])
def test_pick_pads_to_the_next_captured_size(value, padded):
    assert cuda_graphs.pick(cuda_graphs.capture_sizes(64), value) == padded


# ---- the plan -----------------------------------------------------------------------------------
def test_graphs_only_on_cuda_or_when_asked_and_never_for_prefill_workers():
    assert cuda_graphs.plan_for(EngineConfig(), 64, 512) is None                       # CPU, AUTO
    assert cuda_graphs.plan_for(EngineConfig(decode_graphs=GraphMode.EAGER), 64, 512) is None
    cuda = cuda_graphs.plan_for(EngineConfig(device="cuda", block_size=16), 64, 8192)
    assert cuda == GraphPlan(capture=True, batch_sizes=cuda_graphs.capture_sizes(64),
                             widths=(4, 8, 16, 32, 64, 128), null_block=63)   # 2048-token default cap
    assert cuda_graphs.plan_for(EngineConfig(device="cuda", decode_graphs="eager"), 64, 512) is None
    assert cuda_graphs.plan_for(EngineConfig(device="cuda", role=EngineRole.PREFILL), 64, 512) is None
    plan = cuda_graphs.plan_for(EngineConfig(decode_graphs=UNCAPTURED, block_size=8, max_num_seqs=5), 20, 100)
    assert plan == GraphPlan(capture=False, batch_sizes=(1, 2, 4, 8), widths=(4, 8, 13), null_block=19)
    assert len(plan.keys) == 4 * 3


def test_engine_keeps_the_null_block_from_the_kv_manager(tiny_model):
    eager = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=32))
    assert eager.kv.num_total_blocks == 32 and eager.runner.graphs is None
    graphs = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=32, decode_graphs=UNCAPTURED))
    assert graphs.kv.num_total_blocks == 31 and graphs.pool_tokens == 31 * 16
    assert graphs.runner.graphs.plan.null_block == 31
    assert graphs.runner.graphs.num_graphs == 0, "nothing is captured without CUDA"
    with pytest.raises(ValueError, match="null block|for padding"):
        LLMEngine(tiny_model, EngineConfig(num_kv_blocks=1, decode_graphs=UNCAPTURED))


# ---- static rows --------------------------------------------------------------------------------
BLOCK = 4


def decode_step(kv: KVCacheManager, contexts: list[int], sample: list[bool] | None = None) -> SchedulerOutput:
    """Requests that know ``ctx`` tokens and have computed all but the last: one decode each."""
    scheduled = []
    for i, ctx in enumerate(contexts):
        req = Request(RequestSpec(f"q{i}", tuple(range(100 + i, 100 + i + ctx)), SamplingParams(max_tokens=4)))
        req.num_computed_tokens = ctx - 1
        kv.allocate_slots(req.req_id, ctx)
        scheduled.append(ScheduledRequest(req, 1, True if sample is None else sample[i], kv.block_tables[req.req_id]))
    return SchedulerOutput(scheduled, len(contexts))


def pool_for(plan: GraphPlan, num_blocks: int = 40) -> DecodeGraphPool:
    cache = torch.zeros(1, 2, num_blocks, BLOCK, 1, 2)

    def never(*args):
        raise AssertionError("prepare must not run the model")

    return DecodeGraphPool(plan, never, cache, BLOCK)


def test_rows_hold_each_request_and_padding_points_at_the_null_block():
    kv = KVCacheManager(39, BLOCK)
    kv.allocate_slots("other", 9)          # real blocks held by someone else come first
    plan = GraphPlan(capture=False, batch_sizes=(1, 2, 4), widths=(4, 8, 16), null_block=39)
    pool = pool_for(plan)
    out = decode_step(kv, [6, 18, 41])
    inputs = pool.prepare(out)
    assert isinstance(inputs, GraphInputs)
    assert (inputs.batch, inputs.width, inputs.num_rows) == (4, 16, 3)   # 3 -> 4 rows; 11 blocks -> 16
    assert inputs.sample_rows is None and inputs.num_kv_tokens == 6 + 18 + 41
    rows = pool._rows
    for i, s in enumerate(out.scheduled):
        pos, table = s.request.num_computed_tokens, kv.block_tables[s.request.req_id]
        n = pos // BLOCK + 1
        assert rows[i, ID] == s.request.all_token_ids[pos] and rows[i, POS] == pos and rows[i, CTX] == pos + 1
        assert rows[i, SLOT] == table[pos // BLOCK] * BLOCK + pos % BLOCK
        assert rows[i, TABLE : TABLE + n].tolist() == table[:n]
        assert (rows[i, TABLE + n : TABLE + 16] == 39).all(), "table tails read the null block"
    assert rows[3, :TABLE].tolist() == [0, 0, 39 * BLOCK, 1], "a padded row writes and reads the null slot"
    assert (rows[3, TABLE : TABLE + 16] == 39).all()


def test_rows_that_do_not_sample_are_left_out_of_the_logits():
    kv = KVCacheManager(39, BLOCK)
    pool = pool_for(GraphPlan(capture=False, batch_sizes=(1, 2, 4), widths=(4,), null_block=39))
    inputs = pool.prepare(decode_step(kv, [3, 5, 7], sample=[True, False, True]))
    assert inputs.sample_rows.tolist() == [0, 2]


def test_a_smaller_step_after_a_larger_one_leaves_no_stale_row():
    kv = KVCacheManager(39, BLOCK)
    pool = pool_for(GraphPlan(capture=False, batch_sizes=(1, 2, 4), widths=(4, 8), null_block=39))
    pool.prepare(decode_step(kv, [20, 21, 22, 23]))
    small = KVCacheManager(39, BLOCK)
    inputs = pool.prepare(decode_step(small, [2]))
    assert (inputs.batch, inputs.width) == (1, 4)
    table = small.block_tables["q0"]
    assert pool._rows[0, : TABLE + 4].tolist() == [101, 1, table[0] * BLOCK + 1, 2, table[0], 39, 39, 39]


def test_rows_stay_current_over_random_steps():
    """The block tables are rewritten only where a row changed: over random decode steps (requests
    growing by a token or crossing into a new block, joining, leaving, re-admitted with new
    blocks after a preemption, batches shrinking and growing) every row always equals a full
    rewrite: its request's blocks, then the null block across the widest table; padded rows the
    null block alone."""
    rng = random.Random(7)
    kv = KVCacheManager(200, BLOCK)
    plan = GraphPlan(capture=False, batch_sizes=(1, 2, 4, 8), widths=(4, 8, 16), null_block=200)
    pool = pool_for(plan, num_blocks=201)
    live: dict[str, Request] = {}
    for step in range(300):
        if len(live) < 8 and rng.random() < 0.3:
            req = Request(RequestSpec(f"s{step}", tuple(range(3, 3 + rng.randint(1, 40))), SamplingParams(max_tokens=90)))
            req.num_computed_tokens = req.num_tokens - 1
            kv.allocate_slots(req.req_id, req.num_tokens)
            live[req.req_id] = req
        for req_id in [r for r in live if rng.random() < 0.05 or live[r].num_tokens >= 16 * BLOCK]:
            kv.free(req_id)   # finished (or as long as the widest table holds), or preempted and re-admitted
            if rng.random() < 0.5 or live[req_id].num_tokens >= 16 * BLOCK:
                del live[req_id]
            else:
                kv.allocate_slots(req_id, live[req_id].num_tokens)
        if not live:
            continue
        order = rng.sample(list(live.values()), k=len(live))
        out = SchedulerOutput([ScheduledRequest(r, 1, True, kv.block_tables[r.req_id]) for r in order], len(order))
        inputs = pool.prepare(out)
        assert isinstance(inputs, GraphInputs)
        rows = pool._rows
        for i, r in enumerate(order):
            table, n = kv.block_tables[r.req_id], r.num_computed_tokens // BLOCK + 1
            assert rows[i, TABLE : TABLE + n].tolist() == table[:n], f"step {step}, row {i}"
            assert (rows[i, TABLE + n :] == 200).all(), f"step {step}, row {i}: stale blocks past the table"
        assert (rows[len(order) : inputs.batch, TABLE:] == 200).all(), f"step {step}: a padded row reads a block"
        for r in order:   # the step's token lands: the next decode is one further
            r.append_output(5, None)
            r.num_computed_tokens += 1
            kv.allocate_slots(r.req_id, r.num_tokens)


class RecordingGraphs:
    """Stands in for torch.cuda's graph API on CPU (tests only): ``graph(...)`` runs its body
    eagerly and records which graph it captured with which pool; ``replay`` records the call."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.pool = object()
        outer = self

        class Graph:
            def replay(self) -> None:
                outer.events.append(("replay", self))

        self.CUDAGraph = Graph

    def graph(self, graph, pool=None, capture_error_mode="global"):
        self.events.append(("capture", (graph, pool, capture_error_mode)))
        return contextlib.nullcontext()

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "CUDAGraph", self.CUDAGraph)
        monkeypatch.setattr(torch.cuda, "graph", self.graph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: self.pool)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_capture_bookkeeping(tiny_model, monkeypatch):
    """Every key once, largest batch and widest table first, all in one pool; one warm-up per
    batch size, before its captures; capture runs write only the null block; a step replays the
    graph of its padded key and returns the real rows of the static logits."""
    fake = RecordingGraphs()
    fake.install(monkeypatch)
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=10))
    kv_cache = engine.cache
    runner_forward = engine.runner._forward
    runs: list[int] = []   # batch of each forward

    def forward(input_ids, *args):
        runs.append(input_ids.shape[1])
        return runner_forward(input_ids, *args)

    kv_cache.normal_()   # any write shows, even of the zeros the padding token (id 0) may project to
    before = kv_cache.clone()
    plan = GraphPlan(capture=True, batch_sizes=(1, 2, 4, 8, 16), widths=(4, 8), null_block=63)
    pool = DecodeGraphPool(plan, forward, kv_cache, 4)
    pool.capture()
    captures = [e[1] for e in fake.events if e[0] == "capture"]
    assert pool.num_graphs == len(plan.keys) == len(captures)
    assert all(p is fake.pool and mode == "thread_local" for _, p, mode in captures)
    order = list(pool._graphs)
    assert order == [(b, w) for b in (16, 8, 4, 2, 1) for w in (8, 4)]
    assert runs == [b for b in (16, 8, 4, 2, 1) for _ in range(3)], "a warm-up, then 2 captures"
    changed = (before != kv_cache).flatten(start_dim=3).any(dim=-1).any(dim=0).any(dim=0)   # [blocks]
    assert changed.nonzero().flatten().tolist() == [63], "capture runs write the null block only"

    kv = KVCacheManager(63, 4)
    inputs = pool.prepare(decode_step(kv, [3, 9, 30]))
    assert (inputs.batch, inputs.width) == (4, 8)
    logits = pool.run(inputs)
    assert fake.events[-1] == ("replay", pool._graphs[(4, 8)]) and pool.num_replays == 1
    assert logits.data_ptr() == pool._logits.data_ptr() and logits.shape[0] == 3


# ---- fallbacks ----------------------------------------------------------------------------------
def test_fallbacks_prefill_batch_and_width():
    plan = GraphPlan(capture=False, batch_sizes=(1, 2), widths=(4, 8), null_block=39)
    pool = pool_for(plan)
    kv = KVCacheManager(39, BLOCK)
    assert pool.prepare(decode_step(kv, [3, 4, 5])) is Fallback.BATCH
    kv = KVCacheManager(39, BLOCK)
    assert pool.prepare(decode_step(kv, [33])) is Fallback.WIDTH     # 9 blocks > 8
    kv = KVCacheManager(39, BLOCK)
    mixed = decode_step(kv, [5])
    prompt = Request(RequestSpec("p", (1, 2, 3), SamplingParams()))
    kv.allocate_slots("p", 3)
    mixed.scheduled.append(ScheduledRequest(prompt, 3, True, kv.block_tables["p"]))
    assert pool.prepare(mixed) is Fallback.PREFILL
    kv = KVCacheManager(39, BLOCK)
    assert isinstance(pool.prepare(decode_step(kv, [32, 2])), GraphInputs)  # 8 blocks: fits
    assert pool.fallbacks == {Fallback.BATCH: 1, Fallback.WIDTH: 1, Fallback.PREFILL: 1}


def test_too_wide_contexts_run_eager_and_still_match_hf(tiny_model, hf_reference):
    prompts, outputs = [[5, 6, 7], list(range(20, 32)), list(range(40, 100))], [8, 8, 8]   # the last: 15+ blocks
    refs = [hf_greedy(hf_reference, p, n) for p, n in zip(prompts, outputs)]
    config = EngineConfig(num_kv_blocks=256, block_size=4, decode_graphs=UNCAPTURED, cuda_graph_max_context=32)
    engine = LLMEngine(tiny_model, config)
    got = run_staggered(engine, prompts, outputs)
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    graphs = engine.runner.graphs
    assert graphs.plan.widths == (4, 8)
    assert graphs.fallbacks[Fallback.WIDTH] > 0 and graphs.num_replays > 0
    assert_no_leaks(engine)


def test_eager_mode_never_touches_the_graph_path(tiny_model, workload):
    prompts, outputs, refs = workload
    engine = LLMEngine(tiny_model, dataclasses.replace(CONFIGS["default"], decode_graphs=GraphMode.EAGER))
    assert engine.runner.graphs is None
    got = run_staggered(engine, prompts, outputs)
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert_no_leaks(engine)


# ---- the replayed path, uncaptured ---------------------------------------------------------------
class StepSpy:
    """Wraps a runner's prepare/execute: each step's inputs, logits and KV cache before and after."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.steps = engine, []
        runner = engine.runner
        prepare, execute = runner.prepare, runner.execute

        def spy_prepare(out):
            self.out = out
            return prepare(out)

        def spy_execute(inputs):
            before = engine.cache.clone()
            logits = execute(inputs)
            self.steps.append((self.out, inputs, logits.clone(), before, engine.cache.clone(), self._slots()))
            return logits

        runner.prepare, runner.execute = spy_prepare, spy_execute

    def _slots(self) -> list[tuple[int, int]]:
        """(block, offset) of each scheduled token of the step."""
        tables, bs = self.engine.kv.block_tables, self.engine.config.block_size
        return [(tables[s.request.req_id][p // bs], p % bs) for s in self.out.scheduled
                for p in range(s.request.num_computed_tokens, s.request.num_computed_tokens + s.num_new_tokens)]


def test_padded_rows_write_only_the_null_block(tiny_model):
    check_padded_rows_write_only_the_null_block(
        LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, block_size=4, decode_graphs=UNCAPTURED)))


def check_padded_rows_write_only_the_null_block(engine: LLMEngine) -> None:
    """Three requests, so decode steps are padded to 4 rows; after each, the KV cache differs only
    in the real rows' slots and the null block (test_cuda.py runs it on captured graphs)."""
    spy = StepSpy(engine)
    prompts = [[5, 6, 7], list(range(10, 31)), [9] * 9]
    run_staggered(engine, prompts, [6, 6, 6])
    graph_steps = [s for s in spy.steps if isinstance(s[1], GraphInputs)]
    assert any(inputs.batch > inputs.num_rows for _, inputs, *_ in graph_steps)
    null = engine.runner.graphs.plan.null_block
    for _, inputs, _, before, after, slots in graph_steps:
        changed = (before != after).flatten(start_dim=4).any(dim=-1).any(dim=0).any(dim=0)   # [blocks, slots]
        expected = torch.zeros_like(changed)
        for block, offset in slots:
            expected[block, offset] = True
        assert (changed & ~expected)[:null].sum() == 0, "a padded row wrote a real block"
        assert (changed == expected)[:null].all(), "every real row wrote its own slot"
    assert_no_leaks(engine)


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_static_path_gives_the_eager_logits(tiny_model, workload, attention, monkeypatch):
    if attention == "torch":   # the padded gather + SDPA the GPU runs
        monkeypatch.setenv("PDSERVE_ATTENTION", "torch")
    prompts, outputs, _ = workload
    spies = []
    for mode in (GraphMode.EAGER, UNCAPTURED):
        engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, block_size=4, decode_graphs=mode))
        spies.append(StepSpy(engine))
        run_staggered(engine, prompts, outputs)
        assert_no_leaks(engine)
    eager, static = spies
    assert len(eager.steps) == len(static.steps)
    replayed = 0
    for e, s in zip(eager.steps, static.steps):
        assert [r.request.req_id for r in e[0].scheduled] == [r.request.req_id for r in s[0].scheduled]
        torch.testing.assert_close(s[2], e[2], rtol=1e-5, atol=1e-5)
        replayed += isinstance(s[1], GraphInputs)
    assert replayed > 10


@pytest.mark.parametrize("attention", ["kernel", "torch"])
@pytest.mark.parametrize("name", CONFIGS)
def test_static_path_matches_hf(tiny_model, workload, name, attention, monkeypatch):
    if attention == "torch":
        monkeypatch.setenv("PDSERVE_ATTENTION", "torch")
    prompts, outputs, refs = workload
    engine = LLMEngine(tiny_model, dataclasses.replace(CONFIGS[name], decode_graphs=UNCAPTURED))
    got = run_staggered(engine, prompts, outputs)
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    graphs = engine.runner.graphs
    assert graphs.num_replays > 0 and graphs.fallbacks[Fallback.PREFILL] > 0
    if name == "preempt":
        assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


# ---- dtype and flags ----------------------------------------------------------------------------
def test_dtype_auto_is_bf16_on_cuda_and_fp32_elsewhere():
    assert EngineConfig().dtype == "float32"
    assert EngineConfig(device="cuda").dtype == "bfloat16"
    assert EngineConfig(device="cuda:1").dtype == "bfloat16"
    assert EngineConfig(device="cuda", dtype="float32").dtype == "float32"
    undecided = EngineConfig(device="auto")
    assert undecided.dtype == "auto"
    assert dataclasses.replace(undecided, device="cuda").dtype == "bfloat16"   # as the launcher resolves it
    assert dataclasses.replace(undecided, device="cpu").dtype == "float32"


def test_engine_refuses_a_model_in_another_dtype_or_an_undecided_device(tiny_model):
    with pytest.raises(ValueError, match="dtype"):
        LLMEngine(tiny_model, EngineConfig(num_kv_blocks=8, dtype="bfloat16"))
    with pytest.raises(ValueError, match="device"):
        LLMEngine(tiny_model, EngineConfig(num_kv_blocks=8, device="auto"))


def test_serve_flags_enforce_eager_and_dtype():
    from deploy.cli import _parser, cluster_config

    default = cluster_config(_parser().parse_args(["serve"]))
    assert default.decode_engine.decode_graphs is GraphMode.AUTO and default.decode_engine.dtype == "auto"
    eager = cluster_config(_parser().parse_args(["serve", "--enforce-eager", "--dtype", "float32"]))
    assert eager.decode_engine.decode_graphs is GraphMode.EAGER and eager.decode_engine.dtype == "float32"


def test_the_forward_has_no_host_sync_in_transformers_mask_code(tiny_model, monkeypatch):
    """transformers' packed-sequence check calls ``.all()`` on a GPU tensor (a host sync, fatal
    while capturing); with no mask function registered for the paged attention it never runs."""
    import transformers.masking_utils as masking

    calls = []
    check = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a, **k: calls.append(1) or check(*a, **k))
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=16, decode_graphs=UNCAPTURED))
    # The engine's start-up probe (engine.model_support) runs the model's own forward once, with
    # transformers' SDPA and its masks, as the reference for the engine's: that one may check.
    calls.clear()
    engine.generate([RequestSpec("a", (5, 6, 7), SamplingParams(max_tokens=4, ignore_eos=True))])
    assert engine.runner.graphs.num_replays == 3 and calls == []
    assert_no_leaks(engine)
