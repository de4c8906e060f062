"""CUDA graphs for decode-only steps: captured per padded batch size, replayed after (vLLM, SGLang).

Why: a small model on a big GPU is bound on launching kernels, not on running them (SmolLM2-135M
on an H100: ~2,000 launches per decode step, 5x more CPU time than GPU time). A CUDA graph replays
a whole step's kernels with one launch. A graph replays fixed shapes at fixed addresses, so:
- the step's inputs live in one static buffer, a row per request — token id, position, KV slot,
  context length, block table — padded up to a captured batch size. Padded rows write their K/V
  to the null block (the pool's last block, which the KV manager never hands out: vLLM v1's null
  block, SGLang's slot 0) and attend to that one slot alone, so they can never touch a request's KV;
- block tables are padded to a captured width (a ladder of block counts; keys past a row's context
  length are masked out), since engine.attention's decode path has no host sync and no
  data-dependent shape once its metadata has fixed shapes;
- logits land in one static output buffer; the caller gets the real rows.
Prefill and mixed steps stay eager, as do steps too big or too wide for the captured graphs.

Life cycle: the engine asks ``uses_graphs`` (reserving the null block) and ``plan_for``; the model
runner builds a ``DecodeGraphPool`` and calls ``capture`` once at start-up: every (batch, width)
key, largest first so smaller graphs reuse the memory of larger ones, one shared memory pool, an
eager warm-up per batch size first. Per step ``prepare`` loads the inputs into the static buffer
and returns ``GraphInputs``, or the ``Fallback`` that sends the step down the eager path; ``run``
replays the key's graph (GraphMode.UNCAPTURED: runs the same fixed-shape forward without one,
which is how the CPU tests check the replayed code) and returns the real rows' logits.
"""

from __future__ import annotations

import enum
import time
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention import AttentionMetadata, DecodeGroup
from engine.config import EngineConfig, EngineRole, GraphMode
from engine.scheduler import SchedulerOutput

MAX_CAPTURE_BATCH = 256   # larger batches run eager; their launches are amortized over many rows
MIN_WIDTH = 4             # narrowest captured block table (blocks)
NULL_BLOCKS = 1           # blocks the pool keeps for padded rows

# Columns of a row of the static input buffer; the block table follows.
ID, POS, SLOT, CTX, TABLE = range(5)

# (input_ids [1, B], position_ids [1, B], logits_indices [B], metadata) -> logits [B, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class Fallback(enum.Enum):
    """Why a step runs eager although decode graphs are on."""

    PREFILL = "prefill"   # a prefill (or mixed) step: ragged shapes, as in vLLM and SGLang
    BATCH = "batch"       # more requests than the largest captured batch
    WIDTH = "width"       # a context longer than the widest captured block table


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """vLLM's ladder — 1, 2, 4, then multiples of 8 — up to the first size that holds
    ``max_batch`` (capped at MAX_CAPTURE_BATCH)."""
    top = min(max_batch, MAX_CAPTURE_BATCH)
    ladder = [1, 2, 4] + list(range(8, MAX_CAPTURE_BATCH + 1, 8))
    return tuple(ladder[: bisect_left(ladder, top) + 1])


def width_ladder(max_width: int) -> tuple[int, ...]:
    """Block-table widths: powers of two from MIN_WIDTH below ``max_width``, then ``max_width``.
    A row reads at most twice the keys it needs; the ladder stays short (few captures)."""
    widths, w = [], MIN_WIDTH
    while w < max_width:
        widths.append(w)
        w *= 2
    return (*widths, max_width)


def pick(ladder: tuple[int, ...], value: int) -> int | None:
    """The smallest entry of ``ladder`` (ascending) that holds ``value``; None if none does."""
    i = bisect_left(ladder, value)
    return ladder[i] if i < len(ladder) else None


def uses_graphs(config: EngineConfig) -> bool:
    """Decode steps go through the static-buffer path (captured or not). A prefill worker never
    decodes: it captures nothing."""
    if config.role is EngineRole.PREFILL or config.decode_graphs is GraphMode.EAGER:
        return False
    return config.decode_graphs is GraphMode.UNCAPTURED or config.device.startswith("cuda")


@dataclass(frozen=True, slots=True)
class GraphPlan:
    capture: bool                   # False: the fixed-shape forward runs without a graph (UNCAPTURED)
    batch_sizes: tuple[int, ...]    # ascending
    widths: tuple[int, ...]         # block-table widths in blocks, ascending
    null_block: int                 # padded rows' block: never held by a request

    @property
    def keys(self) -> list[tuple[int, int]]:
        return [(b, w) for b in self.batch_sizes for w in self.widths]


def plan_for(config: EngineConfig, num_cache_blocks: int, max_model_len: int) -> GraphPlan | None:
    """The graphs an engine with this config and a cache of ``num_cache_blocks`` (the null block
    included) uses; None when decode steps run eager."""
    if not uses_graphs(config):
        return None
    max_context = min(config.cuda_graph_max_context, max_model_len)
    return GraphPlan(
        capture=config.decode_graphs is GraphMode.AUTO,
        batch_sizes=capture_sizes(config.max_num_seqs),
        widths=width_ladder(-(-max_context // config.block_size)),
        null_block=num_cache_blocks - NULL_BLOCKS,
    )


def reserved_blocks(config: EngineConfig, num_cache_blocks: int) -> int:
    """Blocks of the cache the KV manager must not hand out (the null block when graphs are on)."""
    if not uses_graphs(config):
        return 0
    if num_cache_blocks <= NULL_BLOCKS:
        raise ValueError(f"decode graphs keep {NULL_BLOCKS} KV block for padding; the pool has only "
                         f"{num_cache_blocks} (add blocks or use decode_graphs='eager')")
    return NULL_BLOCKS


@dataclass(frozen=True, slots=True)
class GraphInputs:
    """A decode step loaded into the static buffer, ready to replay."""

    batch: int                          # captured (padded) batch size
    width: int                          # captured block-table width
    num_rows: int                       # real requests: rows 0 .. num_rows - 1
    sample_rows: torch.Tensor | None    # rows whose logits the step samples; None: all real rows
    num_kv_tokens: int


class DecodeGraphPool:
    def __init__(self, plan: GraphPlan, forward: Forward, kv_cache: torch.Tensor, block_size: int) -> None:
        self.plan = plan
        self.forward = forward
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.null_slot = plan.null_block * block_size
        max_batch, max_width = plan.batch_sizes[-1], plan.widths[-1]
        on_cuda = self.device.type == "cuda"
        # Host rows are written with numpy (fast for small assignments), then copied in one go.
        self._host = torch.zeros(max_batch, TABLE + max_width, dtype=torch.long, pin_memory=on_cuda)
        self._host_np = self._host.numpy()
        self._tables = _RowTables(self._host_np[:, TABLE:], plan.null_block)
        self._rows = self._host.to(self.device) if on_cuda else self._host
        self._copied = torch.cuda.Event() if on_cuda else None
        self._row_index = torch.arange(max_batch, device=self.device)
        self._key_pos = torch.arange(max_width * block_size, device=self.device)
        self._logits: torch.Tensor | None = None   # [max_batch, vocab]: sized by the first forward
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self.fallbacks: Counter[Fallback] = Counter()
        self.capture_s = 0.0

    # ---- per step -------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> GraphInputs | Fallback:
        """Load a decode-only step into the static buffer, or say why it must run eager."""
        fallback = self._fallback(out)
        if fallback is not None:
            self.fallbacks[fallback] += 1
            return fallback
        scheduled, bs = out.scheduled, self.block_size
        batch = pick(self.plan.batch_sizes, len(scheduled))
        width = pick(self.plan.widths, -(-max(s.request.num_computed_tokens + 1 for s in scheduled) // bs))
        self._load(out, batch, width)
        sample = [i for i, s in enumerate(scheduled) if s.sample]
        sample_rows = None if len(sample) == len(scheduled) else torch.tensor(sample, device=self.device)
        num_kv = sum(s.request.num_computed_tokens + 1 for s in scheduled)
        return GraphInputs(batch, width, len(scheduled), sample_rows, num_kv)

    def _fallback(self, out: SchedulerOutput) -> Fallback | None:
        scheduled = out.scheduled
        if any(s.num_new_tokens != 1 or s.request.num_computed_tokens == 0 for s in scheduled):
            return Fallback.PREFILL
        if pick(self.plan.batch_sizes, len(scheduled)) is None:
            return Fallback.BATCH
        longest = max(s.request.num_computed_tokens + 1 for s in scheduled)
        if pick(self.plan.widths, -(-longest // self.block_size)) is None:
            return Fallback.WIDTH
        return None

    def _load(self, out: SchedulerOutput, batch: int, width: int) -> None:
        """Real rows first, in scheduling order; padded rows read and write the null block only.
        The four scalar columns are written whole; a row's block table only where it changed
        (``_RowTables``): most decode steps add no block to any table."""
        if self._copied is not None:
            self._copied.synchronize()   # the last step's copy has read the host rows (async, pinned)
        rows, bs, n = self._host_np, self.block_size, len(out.scheduled)
        ids, positions, slots = [], [], []
        for i, s in enumerate(out.scheduled):
            req, pos, table = s.request, s.request.num_computed_tokens, s.block_ids
            ids.append(req.all_token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            self._tables.load(i, table, pos // bs + 1)
        rows[:n, ID], rows[:n, POS], rows[:n, SLOT] = ids, positions, slots
        rows[:n, CTX] = rows[:n, POS] + 1
        rows[n:batch, :TABLE] = (0, 0, self.null_slot, 1)
        self._tables.pad(n, batch)
        if self._copied is not None:
            self._rows[:batch].copy_(self._host[:batch], non_blocking=True)
            self._copied.record()

    def run(self, inputs: GraphInputs) -> torch.Tensor:
        """Replay the step's graph; the real rows' logits (those that sample), a view of the static
        output: read them before the next step."""
        key = (inputs.batch, inputs.width)
        if self.plan.capture:
            self._graphs[key].replay()
        else:
            with torch.inference_mode():
                self._forward_static(*key)
        self.num_replays += 1
        logits = self._logits[: inputs.num_rows]
        return logits if inputs.sample_rows is None else logits.index_select(0, inputs.sample_rows)

    def _forward_static(self, batch: int, width: int) -> None:
        """The captured body: reads only the static rows, writes only the static logits."""
        rows = self._rows[:batch]
        context_lens = rows[:, CTX].contiguous()
        key_mask = self._key_pos[: width * self.block_size] < context_lens[:, None]
        group = DecodeGroup(
            q_index=self._row_index[:batch],
            block_tables=rows[:, TABLE : TABLE + width].contiguous(),
            key_mask=key_mask[:, None, None, :],
            context_lens=context_lens,
            every_token=True,
        )
        meta = AttentionMetadata(self.kv_cache, rows[:, SLOT].contiguous(), prefills=[], decode_groups=[group])
        logits = self.forward(rows[:, ID].contiguous()[None], rows[:, POS].contiguous()[None],
                              self._row_index[:batch], meta)
        if self._logits is None:   # the first forward runs eager (a warm-up), never under capture
            self._logits = logits.new_empty(self._rows.shape[0], logits.shape[-1])
        self._logits[:batch].copy_(logits)

    # ---- start-up -----------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every key (nothing to do when uncaptured). Largest batch first: later, smaller
        graphs take their scratch from the memory the larger ones already hold in the shared pool.
        Rows are all padding meanwhile: warm-ups and captures write the null block only."""
        if not self.plan.capture or self._graphs:
            return
        start = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for batch in reversed(self.plan.batch_sizes):
                self._load_padding(batch)
                self._forward_static(batch, self.plan.widths[-1])   # warm-up: lazy init outside capture
                torch.cuda.synchronize(self.device)
                for width in reversed(self.plan.widths):
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: another thread's harmless CUDA call must not void the capture
                    with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
                        self._forward_static(batch, width)
                    self._graphs[(batch, width)] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start

    def _load_padding(self, batch: int) -> None:
        self._host_np[:batch, :TABLE] = (0, 0, self.null_slot, 1)
        self._tables.pad(0, batch)
        self._rows[:batch].copy_(self._host[:batch])

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


class _RowTables:
    """The block-table columns of the static buffer's host rows, rewritten only where a row's
    table changed. A row holds the first ``num_blocks`` blocks of the table list it was last
    loaded from, then the null block. A request's table list only ever grows (the KV manager
    extends it; a re-admitted request gets a new list), so the list itself (held here: its
    identity cannot be reused) and its block count say whether a row is current."""

    def __init__(self, columns, null_block: int) -> None:
        self.columns = columns                  # numpy view [max_batch, max_width] of the host rows
        self.null_block = null_block
        self.columns[:] = null_block
        self._source: list[tuple[list[int] | None, int]] = [(None, 0)] * columns.shape[0]

    def load(self, row: int, table: list[int], num_blocks: int) -> None:
        held, written = self._source[row]
        if held is table and written == num_blocks:
            return   # most decode steps
        if held is table and written < num_blocks:
            self.columns[row, written:num_blocks] = table[written:num_blocks]   # the table grew
        else:
            self.columns[row, :num_blocks] = table[:num_blocks]
            if written > num_blocks:
                self.columns[row, num_blocks:written] = self.null_block
        self._source[row] = (table, num_blocks)

    def pad(self, start: int, stop: int) -> None:
        """Rows ``start .. stop - 1`` hold the null block alone (padded rows)."""
        for row in range(start, stop):
            if self._source[row][1]:
                self.columns[row, : self._source[row][1]] = self.null_block
                self._source[row] = (None, 0)
