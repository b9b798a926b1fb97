"""The worker boundary's pieces without a process: framing, one frame per engine step for every
request, constraints built on the engine's side, failures and aborts as they cross."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from fakes import ByteTokenizer
from router.constraints import ConstraintPlan, ConstraintSpec, TokenConstraint
from router.engine import EngineError, EngineRequest, EngineStep, SamplingParams, TokenLogprobs, UnknownAdapter
from router.errors import BadRequest
from router.thinking_gate import AfterReasoning, ReasoningGate
from router.workers.client import error_of
from router.workers.host import EngineHost
from router.workers.wire import Abort, Call, FrameProtocol, Generate, Reply, Steps, Stop, ToRouter, ToWorker

ENCODE = msgspec.msgpack.Encoder().encode


def framed(message) -> bytes:
    payload = ENCODE(message)
    return len(payload).to_bytes(4, "big") + payload


def request(rid: str = "r", **extra) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], SamplingParams(temperature=0.0, logit_bias={5: -1.0}), 4,
                         stop_token_ids=frozenset({7}), bad_words=((1, 2),), extras={"echo_times": 2}, **extra)


def test_frames_split_anywhere_decode_whole_and_in_order():
    messages = [Generate(i, request(f"r{i}"), None) for i in range(20)] + [Abort(3), Call(1, "x", [1, "a"]), Stop()]
    data = b"".join(framed(m) for m in messages)
    rng = random.Random(4)
    for _ in range(20):
        got = []
        protocol = FrameProtocol(ToWorker, got.append, lambda: None)
        at = 0
        while at < len(data):
            step = rng.randint(1, 300)
            protocol.data_received(data[at:at + step])
            at += step
        assert got == messages


def test_what_the_engine_sees_and_says_survives_the_crossing():
    sent = Generate(9, request(prediction=[4, 5], adapter="pirate", cache_salt="s"), None)
    (back,) = _roundtrip(sent, ToWorker)
    assert back == sent and back.request.stop_token_ids == frozenset({7}) and back.request.sampling.logit_bias == {5: -1.0}
    step = EngineStep([3, 4], [TokenLogprobs(-0.5, [(3, -0.5), (9, -1.5)]), TokenLogprobs(-0.1, [])], "stop", 4, 2,
                      [TokenLogprobs(-2.0, [(1, -0.1)], rank=3)], (1, 2))
    (frame,) = _roundtrip(Steps([(9, step)], stats={"running": 1}), ToRouter)
    assert frame.steps == [(9, step)] and frame.stats == {"running": 1}


def _roundtrip(message, kind):
    got = []
    FrameProtocol(kind, got.append, lambda: None).data_received(framed(message))
    return got


class StepEngine:
    """Delivers a step of every running request in one callback, as the torch engine does."""

    chat_template = None
    capabilities = frozenset()
    max_model_len = 64

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.queues: dict[str, asyncio.Queue] = {}
        self.seen: list[EngineRequest] = []
        self.closed: list[str] = []
        self.fail: BaseException | None = None

    def stats(self):
        return {"running": len(self.queues), "waiting": 0}

    async def generate(self, req):
        self.seen.append(req)
        if self.fail is not None:
            raise self.fail
        queue = self.queues[req.request_id] = asyncio.Queue()
        try:
            while True:
                step = await queue.get()
                yield step
                if step.finish_reason:
                    return
        finally:
            del self.queues[req.request_id]
            self.closed.append(req.request_id)

    def step(self, finish: str | None = None) -> None:
        for queue in self.queues.values():
            queue.put_nowait(EngineStep([65], finish_reason=finish))


class SubmitEngine(StepEngine):
    """The same engine with ``submit``: steps delivered by callback, as the built-in engines do."""

    def submit(self, req, deliver):
        self.seen.append(req)
        if self.fail is not None:
            raise self.fail
        queue = self.queues[req.request_id] = _Delivery(deliver)

        def abort():
            if self.queues.pop(req.request_id, None) is not None:
                self.closed.append(req.request_id)

        return abort

    def step(self, finish: str | None = None) -> None:
        for rid, delivery in list(self.queues.items()):
            delivery.put_nowait(EngineStep([65], finish_reason=finish))
            if finish:
                del self.queues[rid]


class _Delivery:
    def __init__(self, deliver):
        self.put_nowait = deliver


ENGINES = pytest.mark.parametrize("engine_type", [StepEngine, SubmitEngine], ids=["generate", "submit"])


async def _host(engine):
    frames = []
    host = EngineHost(engine, lambda m: frames.append(m) or True)
    return host, frames


@ENGINES
def test_one_frame_carries_a_step_of_every_request(engine_type):
    async def main():
        engine = engine_type()
        host, frames = await _host(engine)
        for rid in range(8):
            host.receive(Generate(rid, request(f"r{rid}"), None))
        await asyncio.sleep(0.01)
        engine.step()
        await asyncio.sleep(0.6)  # the engine's stats go out on their own, at most every half second
        engine.step("length")
        await asyncio.sleep(0.01)
        await host.close()
        return frames

    frames = asyncio.run(main())
    steps = [f for f in frames if f.steps]
    assert len(steps) == 2
    assert [sorted(rid for rid, _ in f.steps) for f in steps] == [list(range(8))] * 2
    assert all(step.finish_reason == "length" for _, step in steps[1].steps)
    # Stats on their own every half second, and with the frame that ends requests; not per step.
    assert steps[0].stats is None and steps[1].stats == {"running": 0, "waiting": 0}
    assert [f.stats for f in frames if f.stats and not f.steps] == [{"running": 8, "waiting": 0}]


@ENGINES
def test_an_abort_closes_the_engines_iterator_and_nothing_more_is_sent(engine_type):
    async def main():
        engine = engine_type()
        host, frames = await _host(engine)
        host.receive(Generate(1, request("a"), None))
        host.receive(Generate(2, request("b"), None))
        await asyncio.sleep(0.01)
        host.receive(Abort(1))
        await asyncio.sleep(0.01)
        engine.step("stop")
        await asyncio.sleep(0.01)
        await host.close()
        return engine.closed, [s for f in frames for s in f.steps]

    closed, steps = asyncio.run(main())
    assert closed[0] == "a" and [rid for rid, _ in steps] == [2]


@ENGINES
@pytest.mark.parametrize("raised, kind", [(UnknownAdapter("pirate"), UnknownAdapter), (EngineError("on fire"), EngineError),
                                          (ValueError("bad adapter"), ValueError), (RuntimeError("bug"), EngineError)])
def test_failures_cross_as_what_they_were(raised, kind, engine_type):
    async def main():
        engine = engine_type()
        engine.fail = raised
        host, frames = await _host(engine)
        host.receive(Generate(5, request(), None))
        await asyncio.sleep(0.01)
        await host.close()
        return [f for f in frames if f.failures]

    (frame,) = asyncio.run(main())
    (failure,) = frame.failures
    err = error_of(failure)
    assert failure.rid == 5 and type(err) is kind
    assert str(err) == (str(raised) if not isinstance(raised, RuntimeError) else "RuntimeError: bug")


@ENGINES
def test_constraints_are_built_where_the_engine_runs(engine_type):
    spec = ConstraintSpec("choice", ["ab", "bc"], "structured_outputs.choice")
    gate = ReasoningGate.of(b"</think>", None)

    async def main():
        engine = engine_type()
        host, frames = await _host(engine)
        host.receive(Call(1, "check_constraint", [msgspec.to_builtins(spec)]))
        host.receive(Call(2, "check_constraint", [msgspec.to_builtins(ConstraintSpec("regex", "(", "x"))]))
        await asyncio.sleep(0.5)
        host.receive(Generate(1, request("plain"), ConstraintPlan(spec)))
        host.receive(Generate(2, request("thinking"), ConstraintPlan(spec, gate)))
        await asyncio.sleep(0.2)
        await host.close()
        return engine.seen, {f.cid: f for f in frames if isinstance(f, Reply)}, host.grammars.compiled

    seen, replies, compiled = asyncio.run(main())
    assert replies[1].error is None
    err = error_of(replies[2].error)
    assert isinstance(err, BadRequest) and err.param == "x" and "regex" in err.message
    plain, thinking = seen
    assert isinstance(plain.constraint, TokenConstraint) and isinstance(thinking.constraint, AfterReasoning)
    assert plain.constraint is not thinking.constraint._inner  # each sequence its own matcher
    assert compiled == 1  # the check compiled it; the requests found it compiled
