"""The one rule for the engine's on/off environment switches (PDSERVE_FUSED_LINEAR,
PDSERVE_FAST_NORM, PDSERVE_LEAN_FORWARD, PDSERVE_KEEP_FREED_MEMORY): a feature is on unless its
variable says "off", "0" or "false" (any case). Read at each call, so tests and comparison runs can
flip a switch between engines."""

from __future__ import annotations

import os

OFF_VALUES = ("off", "0", "false")


def switched_off(env_var: str) -> bool:
    return os.environ.get(env_var, "").lower() in OFF_VALUES
