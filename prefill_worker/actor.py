"""Ray actor around PrefillWorker: one process, its own engine loop, thin async methods; and
``DecodePeer``, the worker's view of a decode actor, where Ray's failure modes become ours."""

from __future__ import annotations

from typing import Any, AsyncIterator

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from engine.errors import PeerLostError
from engine.types import FirstToken, PrefillResult, RequestSpec, WorkerStats
from engine.worker_actor import WorkerActor
from engine.worker_spec import WorkerSpec
from kvtransfer.handle import KVBlocksHandle


class DecodePeer:
    """A decode actor as the prefill worker's hand-off sees it: its death (or a peer that stays
    unreachable) is ``PeerLostError``; errors it raised on purpose pass through."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.peer_id = actor._actor_id.hex()

    async def reserve(self, spec: RequestSpec, transport: str) -> KVBlocksHandle:
        """Reserve the prompt's blocks there. Made by this worker, not by the router, so the
        router's ``prefill`` call is the one actor call on the first token's path: no second
        submission, no object ref lent to this call (Ray's borrower protocol costs ~1-2 ms)."""
        return await self._peer_call(self.actor.reserve.remote(spec, transport))

    async def commit(self, req_id: str, first_token_id: int, handle: KVBlocksHandle) -> float:
        return await self._peer_call(self.actor.commit.remote(req_id, first_token_id, handle))

    @staticmethod
    async def _peer_call(ref: Any) -> Any:
        if not isinstance(ref, ray.ObjectRef):
            return ref
        try:
            return await ref
        except (ActorUnavailableError, RayActorError) as exc:
            raise PeerLostError(f"decode worker lost during the hand-off: {type(exc).__name__}") from exc
        except RayTaskError as exc:   # raised there on purpose: that error, never Ray's wrapper, whose
            raise exc.cause from None  # text (process, address, traceback) would reach the client


@ray.remote
class PrefillActor(WorkerActor):
    def __init__(self, spec: WorkerSpec, standby: bool = False) -> None:
        from prefill_worker.worker import PrefillWorker   # here: the router imports this class, never the engine

        self.worker = PrefillWorker(spec, standby)

    async def start(self) -> dict:
        self.worker.start()
        await self.worker.open_submissions()
        return self.worker.info(ray.get_runtime_context().get_node_id())

    async def prefill(self, spec: RequestSpec, transport: str | None, decode: Any,
                      inbox: str | None = None) -> AsyncIterator[FirstToken | PrefillResult]:
        """A streaming call: the first token as soon as it may go to the client, then the
        result (one call, so the first token does not wait for the hand-off's round trips).
        This worker reserves the KV's blocks on ``decode`` itself, over ``transport``, while
        it prefills; ``inbox``: the router's first-token inbox on this node (``None``: none)."""
        peer = self.worker.known_peer(DecodePeer(decode)) if decode is not None else None
        async for item in self.worker.stream(spec, transport, peer, inbox):
            yield item

    async def abort(self, req_id: str) -> WorkerStats:
        return await self.worker.abort(req_id)

