"""The fleet's policy (router/fleet.py) on engines in the router's process: loading on demand,
the memory limit, least recently used out first, pins, busy models kept, keep_alive, one load
shared by concurrent requests, failures. Worker processes themselves: test_workers_e2e.py."""

from __future__ import annotations

import asyncio
import time

import pytest

import router.fleet
from fakes import ByteTokenizer
from router.backend import LocalBackend
from router.config import ConfigError, parse_config
from router.engine import EngineStep
from router.errors import APIError, Unavailable
from router.fleet import Fleet, NoRoom
from router.footprint import Footprint
from router.hookspecs import hookimpl
from router.plugins import load_plugins

MiB = 1 << 20
LOADS: list[str] = []
FAIL: set[str] = set()


class TinyEngine:
    chat_template = None
    capabilities = frozenset()
    max_model_len = 64

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.stopped = False

    async def start(self):
        pass

    async def stop(self):
        self.stopped = True

    def stats(self):
        return {"running": 0, "waiting": 0}

    async def generate(self, request):
        yield EngineStep([1], finish_reason="stop")


class Tiny(LocalBackend):
    """100 MiB each, by its estimate; a model named in FAIL does not load."""

    @classmethod
    def estimate_memory(cls, config, base_dir):
        return Footprint(runtime=100 * MiB)

    def create_engine(self):
        time.sleep(0.05)  # a load takes a moment: concurrent requests meet it
        LOADS.append(self.name)
        if self.name in FAIL:
            raise FileNotFoundError(f"no weights for {self.name}")
        return TinyEngine()


class P:
    __name__ = "tiny"

    @hookimpl
    def register_backends(self, register):
        register("tiny", Tiny)


PLUGINS = load_plugins(entrypoints=False, extra=[P()])


def fleet_of(models: str, server: str = 'memory_limit = "250MiB"\nload_timeout = 0.3\n') -> Fleet:
    entries = ""
    for spec in models.split():
        name, *flags = spec.split(",")
        entries += f'[[models]]\nname="{name}"\nbackend="tiny"\nworker=false\n'
        entries += "".join(f"{flag}\n" for flag in flags)
        if not any(flag.startswith("preload") for flag in flags):
            entries += "preload=false\n"
    config = parse_config(f"[server]\n{server}\n{entries}".encode(), PLUGINS.backends)
    backends = {m.name: Tiny(m) for m in config.models}
    return Fleet(backends, config.server)


@pytest.fixture(autouse=True)
def fresh():
    LOADS.clear()
    FAIL.clear()


def loaded(fleet: Fleet) -> list[str]:
    return sorted(name for name, slot in fleet.slots.items() if slot.backend.state == "ready")


async def use(fleet: Fleet, name: str) -> None:
    (await fleet.lease(fleet.slots[name].backend)).release()


def test_least_recently_used_idle_model_makes_room():
    async def main():
        fleet = fleet_of("a b c")
        fleet.start()
        await use(fleet, "a")
        await use(fleet, "b")
        assert loaded(fleet) == ["a", "b"]
        await use(fleet, "c")  # a is the least recently used
        assert loaded(fleet) == ["b", "c"]
        await use(fleet, "b")
        await use(fleet, "a")  # now c is
        assert loaded(fleet) == ["a", "b"]
        assert fleet.in_use() <= fleet.limit
        await fleet.stop()
        return LOADS

    assert asyncio.run(main()) == ["a", "b", "c", "a"]


def test_a_pinned_model_is_never_unloaded_for_room():
    async def main():
        fleet = fleet_of("a,pin=true b c")
        fleet.start()
        for name in ["a", "b", "c", "b", "c"]:
            await use(fleet, name)
            assert "a" in loaded(fleet) and len(loaded(fleet)) <= 2
        await fleet.stop()

    asyncio.run(main())


def test_busy_models_stay_and_the_load_times_out_naming_them():
    async def main():
        fleet = fleet_of("a b c")
        fleet.start()
        held = [await fleet.lease(fleet.slots[n].backend) for n in ("a", "b")]
        t0 = time.monotonic()
        with pytest.raises(NoRoom) as e:
            await fleet.lease(fleet.slots["c"].backend)
        waited = time.monotonic() - t0
        for _ in range(50):  # the load itself gives up at its own deadline, a moment later
            if fleet.slots["c"].backend.state == "unloaded":
                break
            await asyncio.sleep(0.01)
        assert loaded(fleet) == ["a", "b"] and fleet.slots["c"].backend.state == "unloaded"
        err = e.value
        assert err.status == 503 and err.headers["Retry-After"]
        assert "`a`" in err.message and "`b`" in err.message and "1 request(s)" in err.message
        assert waited >= 0.3  # it waited for one of them to become idle, up to load_timeout
        # One becomes idle while c waits: c gets its room.
        waiter = asyncio.ensure_future(fleet.lease(fleet.slots["c"].backend))
        await asyncio.sleep(0.05)
        held[0].release()
        (await waiter).release()
        assert loaded(fleet) == ["b", "c"]
        held[1].release()
        await fleet.stop()

    asyncio.run(main())


def test_concurrent_first_requests_share_one_load():
    async def main():
        fleet = fleet_of("a")
        fleet.start()
        leases = await asyncio.gather(*(fleet.lease(fleet.slots["a"].backend) for _ in range(8)))
        assert fleet.slots["a"].users == 8
        for lease in leases:
            lease.release()
            lease.release()  # once only
        assert fleet.slots["a"].users == 0
        await fleet.stop()

    asyncio.run(main())
    assert LOADS == ["a"]


def test_keep_alive_unloads_an_idle_model_and_a_request_keeps_it():
    async def main():
        fleet = fleet_of("a,keep_alive=0.2 b")
        fleet.start()
        lease = await fleet.lease(fleet.slots["a"].backend)
        await asyncio.sleep(0.4)
        assert loaded(fleet) == ["a"]  # held by a request: keep_alive counts from its end
        lease.release()
        await use(fleet, "b")
        await asyncio.sleep(0.1)
        await use(fleet, "a")  # used again: the clock starts over
        await asyncio.sleep(0.15)
        assert loaded(fleet) == ["a", "b"]
        await asyncio.sleep(0.3)
        assert loaded(fleet) == ["b"]  # b has no keep_alive: loaded for good
        engine = fleet.slots["a"].backend.engine
        assert engine.engine.stopped
        await fleet.stop()

    asyncio.run(main())


def test_unload_refuses_a_busy_model_and_load_brings_it_back():
    async def main():
        fleet = fleet_of("a")
        fleet.start()
        backend = fleet.slots["a"].backend
        lease = await fleet.lease(backend)
        with pytest.raises(APIError) as e:
            await fleet.unload(backend)
        assert e.value.status == 409 and "1 request(s)" in e.value.message
        lease.release()
        await fleet.unload(backend)
        assert backend.state == "unloaded" and fleet.status_of(backend) == {"value": "unloaded"}
        await fleet.load(backend)
        assert fleet.status_of(backend) == {"value": "loaded", "memory_bytes": 100 * MiB}
        await fleet.stop()

    asyncio.run(main())


def test_a_failed_load_is_named_then_tried_again(monkeypatch):
    monkeypatch.setattr(router.fleet, "FAILED_RETRY", 0.2)

    async def main():
        fleet = fleet_of("a")
        fleet.start()
        backend = fleet.slots["a"].backend
        FAIL.add("a")
        for _ in range(2):  # the second is refused without trying
            with pytest.raises(Unavailable) as e:
                await fleet.lease(backend)
            assert "no weights for a" in e.value.message and e.value.headers["Retry-After"]
        assert fleet.status_of(backend)["value"] == "failed"
        assert "no weights for a" in fleet.status_of(backend)["reason"]
        FAIL.clear()
        await asyncio.sleep(0.25)
        await use(fleet, "a")
        await fleet.stop()

    asyncio.run(main())
    assert LOADS == ["a", "a"]


def test_preloads_fill_the_limit_in_order_and_skip_what_does_not_fit():
    async def main():
        fleet = fleet_of("a,preload=true b,preload=true c,preload=true")
        fleet.start()
        await fleet.wait_ready()
        assert loaded(fleet) == ["a", "b"] and fleet.slots["c"].backend.state == "unloaded"
        await fleet.stop()

    asyncio.run(main())


def test_a_model_larger_than_the_limit_is_refused_by_name():
    with pytest.raises(ConfigError) as e:
        parse_config(b'[server]\nmemory_limit = "64MiB"\n[[models]]\nname="big"\nbackend="tiny"\n', PLUGINS.backends)
    (problem,) = e.value.problems
    assert "`big`" in problem and "64 MiB" in problem and "memory_limit" in problem


@pytest.mark.parametrize("key", ["preload = false", "keep_alive = \"5m\"", "pin = true", "worker = false"])
def test_a_remote_model_takes_no_lifecycle_keys(key):
    from backends.remote import RemoteBackend

    text = f'[[models]]\nname="r"\nbackend="remote"\nupstream_model="m"\n{key}\n'
    text += '[[models.deployments]]\nurl="http://127.0.0.1:9/v1"\n'
    with pytest.raises(ConfigError) as e:
        parse_config(text.encode(), {"remote": RemoteBackend})
    assert e.value.problems[0].startswith(f"models[0].{key.split()[0]}: only a local model")


def test_with_every_model_busy_the_oldest_drains_so_each_gets_its_turn(monkeypatch):
    monkeypatch.setattr(router.fleet, "DRAIN_AFTER", 0.1)

    async def main():
        fleet = fleet_of("a b c", 'memory_limit = "250MiB"\nload_timeout = 5\n')
        fleet.start()
        a = await fleet.lease(fleet.slots["a"].backend)
        await asyncio.sleep(0.01)
        b = await fleet.lease(fleet.slots["b"].backend)
        c = asyncio.ensure_future(fleet.lease(fleet.slots["c"].backend))
        await asyncio.sleep(0.2)
        assert fleet.slots["a"].draining and not fleet.slots["b"].draining and not c.done()
        # a takes no new request while it drains: this one waits, without holding a up.
        again = asyncio.ensure_future(fleet.lease(fleet.slots["a"].backend))
        await asyncio.sleep(0.05)
        assert not again.done() and fleet.slots["a"].backend.state == "ready"
        a.release()  # a's last running request ends: it unloads, c loads
        c_lease = await asyncio.wait_for(c, 2)
        assert loaded(fleet) == ["b", "c"] and not fleet.slots["a"].draining
        # a's waiting request now needs the room in turn: b (loaded before c) drains.
        await asyncio.sleep(0.2)
        assert fleet.slots["b"].draining and not again.done()
        b.release()
        (await asyncio.wait_for(again, 2)).release()
        assert loaded(fleet) == ["a", "c"]
        c_lease.release()
        await fleet.stop()
        return LOADS

    assert asyncio.run(main()) == ["a", "b", "c", "a"]
