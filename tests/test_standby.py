"""The warm-spare pool's rules on scripted actors (no Ray processes): a spare that dies while
idle is rebuilt (at once the first time, after a doubling pause when spares keep dying), a
spare taken from the pool is no longer the pool's to watch, and stopping ends every watch."""

from __future__ import annotations

import asyncio

import ray

from deploy.standby import StandbyPool


class ScriptedSpare:
    """Answers ``ping`` at once; its ``lifeline`` fails (the process died) when ``die`` is set."""

    def __init__(self, dies_at_once: bool = False) -> None:
        self.died = asyncio.Event()
        if dies_at_once:
            self.died.set()
        self.ping = _Method(self._ping)
        self.lifeline = _Method(self._lifeline)
        self.shutdown = _Method(self._ping)

    async def _ping(self) -> None:
        return None

    async def _lifeline(self) -> None:
        await self.died.wait()
        raise ray.exceptions.RayActorError()


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


def _pool(made: list[ScriptedSpare], dies_at_once: bool) -> StandbyPool:
    def make(kind: str) -> ScriptedSpare:
        made.append(ScriptedSpare(dies_at_once))
        return made[-1]
    return StandbyPool(make)


def test_a_spare_that_dies_idle_is_rebuilt_at_once(monkeypatch):
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)

    async def scenario():
        made: list[ScriptedSpare] = []
        pool = _pool(made, dies_at_once=False)
        pool.fill({"decode"})
        first = await pool.peek("decode")
        first.died.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(made) == 2:
                break
        assert await pool.peek("decode") is made[1], "the dead spare should be replaced by a new one"
        taken = await pool.take("decode")
        assert taken is made[1]
        taken.died.set()    # a taken spare is a worker now: its death is the supervisor's, not the pool's
        await asyncio.sleep(0.05)
        assert len(made) == 2 and await pool.take("decode") is None
        await pool.stop()

    asyncio.run(scenario())


def test_spares_that_keep_dying_idle_are_rebuilt_after_a_doubling_pause(monkeypatch):
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)

    async def scenario():
        made: list[ScriptedSpare] = []
        pool = _pool(made, dies_at_once=True)
        pool.fill({"prefill"})
        await asyncio.sleep(1.5)
        # Built, died, rebuilt at once, died, then paused 2 s: not a busy loop of rebuilds.
        assert len(made) == 2, len(made)
        await pool.stop()
        assert not pool._watches and not pool._spares

    asyncio.run(scenario())
