"""Runs one packed forward per step: every scheduled token of every request, no padding.

Life cycle per step: ``prepare`` turns a SchedulerOutput into packed input ids, position ids,
slot mapping and attention metadata; ``execute`` runs the transformers model through the
paged attention registered in ``engine.attention`` (q/k/v and gate/up projections fused by
``engine.fused_linear``, decode-step linears on ``engine.skinny_linear``, RMSNorm on
``engine.fast_norm``; for the Llama family without Hugging Face's plumbing, ``engine.lean_forward``,
on CUDA with ``engine.triton_fused``'s kernels)
and returns logits only at the positions that sample (each request's last
scheduled token when it reaches its last known token), then at the positions whose prompt
logprobs a request asked for (``engine.prompt_logprobs``).
With decode graphs on (``engine.cuda_graphs``), a decode-only step is loaded into the graph pool's
static buffer instead and replayed; every other step runs here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine import attention, fast_norm, fused_linear, lean_forward, paged_kernel, skinny_linear, triton_fused, triton_prefill
from engine.attention import AttentionMetadata, DecodeGroup, PrefillPath, PrefillSegment, offset_causal_mask
from engine.cuda_graphs import DecodeGraphPool, GraphInputs, GraphPlan
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.triton_prefill import SegmentBounds


_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor       # [1, num_tokens]
    position_ids: torch.Tensor    # [1, num_tokens]
    logits_indices: torch.Tensor  # [num_sampled] packed index of each sampling request's last token
    metadata: AttentionMetadata
    num_kv_tokens: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, decode_group: int,
                 graph_plan: GraphPlan | None = None) -> None:
        attention.register()
        model.config._attn_implementation = attention.ATTN_IMPLEMENTATION
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.decode_group = decode_group
        self.device = kv_cache.device
        if self.device.type == "cpu":
            paged_kernel.available()  # build or load the kernels now, not during the first decode step
        # One GEMM per q/k/v and per gate/up group (on a GPU: fewer kernels in a decode graph).
        self.fused = fused_linear.enabled()
        if self.fused:
            fused_linear.install(model)
        # Decode steps' few-row linears on the skinny kernel (float32 CPU with AVX-512 only).
        self.skinny = self.device.type == "cpu" and kv_cache.dtype == torch.float32 and skinny_linear.enabled()
        if self.skinny:
            skinny_linear.install(model)
        # RMSNorm as one fused op on float32 CPU (the same bits as the model's own). On CUDA the lean
        # forward's Triton kernels fuse it with the residual add (engine.triton_fused).
        self.fast_norm = self.device.type == "cpu" and kv_cache.dtype == torch.float32 and fast_norm.enabled()
        if self.fast_norm:
            fast_norm.install(model)
        # The same modules without Hugging Face's per-call plumbing (Llama family; None: the model's call).
        self.lean = lean_forward.build(model)
        if self.lean is not None and self.device.type == "cuda" and triton_fused.enabled():
            triton_fused.usable(self.device, kv_cache.dtype)   # its start-up check now, never under a capture
        # How prompt segments attend, decided once (the Triton kernel's start-up check runs here:
        # it checks and compiles the kernel now, never in a step).
        self.prefill_path = self._prefill_path()
        self.graphs = None if graph_plan is None else DecodeGraphPool(graph_plan, self._forward, kv_cache, self.block_size)
        if self.graphs is not None:
            self.graphs.capture()   # last: the model must be ready to run

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs | GraphInputs) -> torch.Tensor:
        if isinstance(inputs, GraphInputs):
            return self.graphs.run(inputs)
        return self._forward(inputs.input_ids, inputs.position_ids, inputs.logits_indices, inputs.metadata)

    def _forward(self, input_ids, position_ids, logits_indices, metadata: AttentionMetadata) -> torch.Tensor:
        """The model on packed tokens (the graph pool's captured body calls it too)."""
        with skinny_linear.active(self.skinny), fused_linear.active(self.fused), fast_norm.active(self.fast_norm), \
                self._sdpa_backends():
            if self.lean is not None:
                return self.lean(input_ids, position_ids, logits_indices, metadata)
            return self.model_call(input_ids, position_ids, logits_indices, metadata)

    def model_call(self, input_ids, position_ids, logits_indices, metadata: AttentionMetadata) -> torch.Tensor:
        """The model's own (Hugging Face) forward through the registered attention: the path of
        models lean_forward refuses, and its reference."""
        logits = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            logits_to_keep=logits_indices,
            use_cache=False,
            pdserve_attn=metadata,
        ).logits
        return logits[0]

    def _sdpa_backends(self):
        """On CUDA, SDPA without cuDNN attention: its first choice on Hopper builds an execution
        plan for every new shape, and every ragged prompt length is one (bf16 prefill steps ran
        5-7x slower on an H100). Flash and memory-efficient attention take any shape as is."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel(_CUDA_SDPA_BACKENDS)

    def prepare(self, out: SchedulerOutput) -> ModelInputs | GraphInputs:
        """Logits rows: each sampling request's, in step order, then the prompt-logprob
        positions' (``ScheduledRequest.prompt_positions``), in step order."""
        if self.graphs is not None and not any(s.prompt_positions for s in out.scheduled):
            graph_inputs = self.graphs.prepare(out)
            if isinstance(graph_inputs, GraphInputs):
                return graph_inputs
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        prompt_rows: list[int] = []
        bounds: list[SegmentBounds] = []
        decodes: list[tuple[int, ScheduledRequest]] = []
        for s in out.scheduled:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            q_start = len(ids)
            ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self._slots(s.block_ids, start, n))
            if n == 1 and start > 0:
                decodes.append((q_start, s))
            else:
                bounds.append(SegmentBounds(q_start, n, start + n, s.block_ids[: -(-(start + n) // self.block_size)]))
            if s.sample:
                logits_indices.append(q_start + n - 1)
            if s.prompt_positions:
                prompt_rows.extend(range(q_start + s.prompt_positions.start - start,
                                         q_start + s.prompt_positions.stop - start))
        path = self.prefill_path if bounds else PrefillPath.SDPA
        plan = triton_prefill.plan(bounds, self.device, self.kv_cache.dtype) if path is PrefillPath.TRITON else None
        metadata = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=self._tensor(slots),
            prefills=self._prefill_segments(bounds, path, plan),
            decode_groups=self._decode_groups(decodes, decode_only=not bounds),
            prefill_path=path,
            prefill_plan=plan,
        )
        num_kv = sum(s.request.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
        return ModelInputs(
            self._tensor(ids)[None], self._tensor(positions)[None], self._tensor(logits_indices + prompt_rows),
            metadata, num_kv
        )

    def _slots(self, table: list[int], start: int, n: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def _prefill_segments(self, bounds: list[SegmentBounds], path: PrefillPath,
                          plan: triton_prefill.PrefillPlan | None) -> list[PrefillSegment]:
        """The step's segments, their block ids views of one device copy (the Triton plan's, or
        their own); only SDPA needs the offset causal mask of a chunk after computed tokens."""
        tables = plan.tables if plan is not None else self._tensor([b for seg in bounds for b in seg.block_ids])
        segments, at = [], 0
        for seg in bounds:
            start = seg.ctx_len - seg.q_len
            masked = start and path is PrefillPath.SDPA
            segments.append(PrefillSegment(
                q_start=seg.q_start, q_len=seg.q_len, ctx_len=seg.ctx_len,
                block_ids=tables[at : at + len(seg.block_ids)],
                mask=offset_causal_mask(start, seg.q_len, self.kv_cache.dtype, self.device) if masked else None,
            ))
            at += len(seg.block_ids)
        return segments

    def _decode_groups(self, decodes: list[tuple[int, ScheduledRequest]], decode_only: bool) -> list[DecodeGroup]:
        # One group in step order (a decode-only step's then attends without gathering q or
        # scattering its output) on a GPU, bound on launching kernels, not on padding, and on
        # CPU's paged kernel, which gathers nothing and orders its own work (longest context
        # first, pulled by its threads) and needs no mask. The torch path on CPU groups
        # similar context lengths, so the padded gather wastes little.
        kernel = self._paged_kernel()
        if self.device.type == "cuda" or kernel:
            return [self._decode_group(decodes, every_token=decode_only, masked=not kernel)] if decodes else []
        decodes.sort(key=lambda d: d[1].request.num_computed_tokens)
        size = self.decode_group
        return [self._decode_group(decodes[i : i + size]) for i in range(0, len(decodes), size)]

    def _paged_kernel(self) -> bool:
        return self.kv_cache.dtype == torch.float32 and self.device.type == "cpu" and paged_kernel.enabled()

    def _prefill_path(self) -> PrefillPath:
        """Triton on CUDA where it imports and takes the shapes; the C++ kernel for float32 on a CPU
        it is preferred on; SDPA otherwise (and whenever ``PDSERVE_ATTENTION=torch``)."""
        kv_heads, head_dim = self.kv_cache.shape[-2:]
        if triton_prefill.supports(self.device, head_dim, self.block_size) and triton_prefill.enabled():
            shape = triton_prefill.HeadShape(self.model.config.num_attention_heads, kv_heads, head_dim, self.block_size)
            if triton_prefill.usable(self.device, self.kv_cache.dtype, shape):
                return PrefillPath.TRITON
        if self._paged_kernel() and paged_kernel.prefill_preferred(head_dim):
            return PrefillPath.CPU_KERNEL
        return PrefillPath.SDPA

    def _decode_group(self, members: list[tuple[int, ScheduledRequest]], every_token: bool = False,
                      masked: bool = True) -> DecodeGroup:
        """``masked``: build the key mask the torch path needs (not the CPU paged kernel)."""
        ctx_lens = [s.request.num_computed_tokens + 1 for _, s in members]
        max_blocks = -(-max(ctx_lens) // self.block_size)
        tables = [s.block_ids[:max_blocks] for _, s in members]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        context_lens = self._tensor(ctx_lens)
        key_mask = None
        if masked:
            key_pos = torch.arange(max_blocks * self.block_size, device=self.device)
            key_mask = (key_pos[None, :] < context_lens[:, None])[:, None, None, :]
        return DecodeGroup(
            q_index=self._tensor([q for q, _ in members]),
            block_tables=self._tensor(tables),
            key_mask=key_mask,
            context_lens=context_lens,
            every_token=every_token,
        )

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
