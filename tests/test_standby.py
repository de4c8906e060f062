"""The warm-spare pool's rules on scripted actors (no Ray processes): a spare that dies while
idle or while it loads is rebuilt (at once the first time, after a doubling pause when spares
keep dying, at once again after a stable spell), a loss during such a pause does not wait for
it, a spare taken from the pool is no longer the pool's to watch, and stopping ends every watch.
(Probe pass 5 found the loading case and the pause holding up a replacement.)"""

from __future__ import annotations

import asyncio

import ray

from deploy.standby import StandbyPool


class ScriptedSpare:
    """Answers ``ping`` at once; its ``lifeline`` fails (the process died) when ``die`` is set."""

    def __init__(self, dies_at_once: bool = False, dies_loading: bool = False) -> None:
        self.died = asyncio.Event()
        self.dies_loading = dies_loading
        if dies_at_once:
            self.died.set()
        self.ping = _Method(self._ping)
        self.lifeline = _Method(self._lifeline)
        self.shutdown = _Method(self._shutdown)

    async def _ping(self) -> None:
        if self.dies_loading:
            raise ray.exceptions.RayActorError()

    async def _shutdown(self) -> None:
        return None

    async def _lifeline(self) -> None:
        await self.died.wait()
        raise ray.exceptions.RayActorError()


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


def _pool(made: list[ScriptedSpare], dies_at_once: bool = False, dies_loading: int = 0) -> StandbyPool:
    """Spares made for ``made``; the first ``dies_loading`` of them die while they load."""
    def make(kind: str) -> ScriptedSpare:
        made.append(ScriptedSpare(dies_at_once, dies_loading=len(made) < dies_loading))
        return made[-1]
    return StandbyPool(make)


async def _until(check, timeout_s: float = 1.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not in time")


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


def test_a_spare_that_dies_while_loading_is_rebuilt(monkeypatch):
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)

    async def scenario():
        made: list[ScriptedSpare] = []
        pool = _pool(made, dies_loading=1)
        pool.fill({"decode"})
        await _until(lambda: len(made) == 2)
        assert await pool.peek("decode") is made[1]
        assert await pool.take("decode") is made[1]
        await pool.stop()

    asyncio.run(scenario())


def test_a_loss_during_a_pause_does_not_wait_for_it(monkeypatch):
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)

    async def scenario():
        made: list[ScriptedSpare] = []
        pool = _pool(made, dies_loading=2)
        pool.fill({"decode"})
        await _until(lambda: len(made) == 2 and "decode" in pool._pausing)   # two died: a 2 s pause
        start = asyncio.get_running_loop().time()
        assert await pool.take("decode") is None, "a cold start is sooner than the pause"
        assert asyncio.get_running_loop().time() - start < 0.5
        pool.refill("decode")   # the launcher's refill after a take: no pause (a loss starts over)
        assert await asyncio.wait_for(pool.peek("decode"), 1.0) is made[2]
        await pool.stop()

    asyncio.run(scenario())


def test_spare_deaths_far_apart_start_the_pauses_over(monkeypatch):
    from deploy import standby

    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    monkeypatch.setattr(standby, "STABLE_S", 0.2)

    async def scenario():
        made: list[ScriptedSpare] = []
        pool = _pool(made)
        pool.fill({"prefill"})
        for n in range(1, 4):   # each death a stable spell after the last: rebuilt at once every time
            spare = await pool.peek("prefill")
            await asyncio.sleep(0.3)
            spare.died.set()
            await _until(lambda: len(made) == n + 1)
            assert "prefill" not in pool._pausing
        await pool.stop()

    asyncio.run(scenario())
