"""grpc.health.v1 that tells the truth: SERVING only while a complete serving path exists.

Life cycle: ``start_server`` adds the servicer and reports the current state; the launcher
calls ``update`` whenever a worker goes down or comes back (``WorkerRegistry.can_serve``: a
decode or colocated worker is up). Both the overall status ("") and the Pdserve service's
follow it, so a load balancer stops sending traffic while nothing can serve and resumes once a
replacement is ready. ``stopping`` (the server drains before it shuts down) makes it NOT_SERVING
for good: a replica on its way out takes no new traffic.
"""

from __future__ import annotations

import logging

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from protos import pdserve_pb2 as pb

logger = logging.getLogger(__name__)

PDSERVE_SERVICE = pb.DESCRIPTOR.services_by_name["Pdserve"].full_name


class ServingHealth:
    def __init__(self) -> None:
        self.servicer = health_aio.HealthServicer()
        self.serving: bool | None = None
        self._stopping = False

    async def stopping(self) -> None:
        self._stopping = True
        await self.update(False)

    async def update(self, serving: bool) -> None:
        serving = serving and not self._stopping
        if serving == self.serving:
            return
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", PDSERVE_SERVICE):
            await self.servicer.set(service, status)
        # ERROR only when no path can serve; a drain the operator asked for is no fault.
        level = logging.INFO if serving or self._stopping else logging.ERROR
        logger.log(level, "health: %s%s", "SERVING" if serving else "NOT_SERVING", _why(serving, self._stopping))


def _why(serving: bool, stopping: bool) -> str:
    """What a NOT_SERVING line says of its cause (an operator's first question)."""
    if serving:
        return ""
    if stopping:
        return " (stopping)"
    return " (no decode worker is up)"
