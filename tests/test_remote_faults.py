"""The remote backend against upstreams that misbehave on purpose (tests/upstreams.py), through a
real router process: failover before the first byte, never after it, 4xx relayed and not retried,
every error shape normalized, cooldown and recovery, all-down 503s, health checks, and a client
that leaves closing the upstream request."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from backends.remote.stream import DRAIN_S
from server import RouterProcess
from sse_util import chat_text, parse_events
from upstreams import Blackhole, FaultUpstream, closed_port_url

MESSAGES = [{"role": "user", "content": "hi"}]
FAST = {"health_check_interval": "0", "first_byte_timeout": "0.5", "read_timeout": "0.5",
        "request_timeout": "1.0", "connect_timeout": "1.0"}


def model(name: str, deployments: list[tuple], **settings: str) -> str:
    """A remote model entry; each deployment is (url, weight[, extra toml line]). A weight-1000
    "primary" takes every request it can, so its weight-1 "backup" only ever sees failovers."""
    keys = "".join(f"{k} = {v}\n" for k, v in {**FAST, **settings}.items())
    out = f'\n[[models]]\nname = "{name}"\nbackend = "remote"\nupstream_model = "up-{name}"\n{keys}'
    for url, weight, *extra in deployments:
        out += f'[[models.deployments]]\nurl = "{url}"\nweight = {weight}\n' + "".join(f"{e}\n" for e in extra)
    return out


@pytest.fixture(scope="module")
def ups():
    names = ["primary", "backup", "refused_backup", "shape", "shape_backup", "cut", "cut_backup",
             "cool", "cool_backup", "endless", "slow", "plain", "gappy", "keyed", "partial", "linger"]
    ups = {n: FaultUpstream(name=n).start() for n in names}
    yield ups
    for u in ups.values():
        u.stop()


@pytest.fixture(scope="module")
def blackhole():
    b = Blackhole()
    yield b
    b.close()


@pytest.fixture(scope="module")
def router(ups, blackhole, tmp_path_factory):
    config = (
        model("failover", [(ups["primary"].url, 1000), (ups["backup"].url, 1)], failure_threshold="1000")
        + model("refused", [(closed_port_url(), 1000), (ups["refused_backup"].url, 1)], failure_threshold="1000")
        + model("unreachable", [(blackhole.url, 1000), (ups["refused_backup"].url, 1)], failure_threshold="1000",
                connect_timeout="0.5", first_byte_timeout="5", request_timeout="5")
        + model("shapes", [(ups["shape"].url, 1000), (ups["shape_backup"].url, 1)], failure_threshold="1000")
        + model("cut", [(ups["cut"].url, 1000), (ups["cut_backup"].url, 1)], failure_threshold="1000")
        + model("cool", [(ups["cool"].url, 1000), (ups["cool_backup"].url, 1)], failure_threshold="2", cooldown="1.5")
        + model("endless", [(ups["endless"].url, 1)])
        + model("slow", [(ups["slow"].url, 1)], request_timeout="30")
        + model("plain", [(ups["plain"].url, 1)], max_tokens_limit="7")
        + model("gappy", [(ups["gappy"].url, 1)])
        + model("linger", [(ups["linger"].url, 1)])
        + model("keyed", [(ups["keyed"].url, 1)], api_key='"env:ROUTER_TEST_UPSTREAM_KEY"')
        + model("partial", [(closed_port_url(), 1, 'forward_extras = ["top_k"]'), (ups["partial"].url, 1)],
                failure_threshold="1", cooldown="30")
    )
    r = RouterProcess(config, tmp_path_factory.mktemp("remote_faults"),
                      env={"ROUTER_TEST_UPSTREAM_KEY": "sekret"}, name="front")
    yield r
    r.stop()


@pytest.fixture(autouse=True)
def fresh(ups, router):
    for u in ups.values():
        u.reset("ok")
        u.events, u.gap, u.delay = 3, 0.0, 3.0
    # The previous test's abandoned attempts may still be winding down; "fewest in flight" would
    # then send this test's first attempt elsewhere. Start from idle deployments.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        models = httpx.get(f"{router.url}/health").json()["models"]
        if all(d.get("in_flight", 0) == 0 for m in models.values() for d in m.get("deployments", ())):
            break
        time.sleep(0.02)


def deployment(router_url: str, model: str, up) -> dict:
    """/health's entry for the deployment of ``model`` served by upstream ``up``."""
    entries = httpx.get(f"{router_url}/health").json()["models"][model]["deployments"]
    (entry,) = [e for e in entries if e["url"] == up.url]
    return entry


def chat(router, name: str, **kw) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/chat/completions", json={"model": name, "messages": MESSAGES, **kw}, timeout=30)


def stream(router, name: str, **kw) -> tuple[httpx.Response, bytes]:
    body = {"model": name, "messages": MESSAGES, "stream": True, **kw}
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=30) as r:
        return r, r.read()


def wait_for(predicate, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --- failover before the first byte ------------------------------------------------------------


@pytest.mark.parametrize("behaviour", ["500", "429", "html_500", "slow", "slow_first_event", "garbage"])
@pytest.mark.parametrize("streaming", [False, True])
def test_failover_before_first_byte(router, ups, behaviour, streaming):
    primary, backup = ups["primary"], ups["backup"]
    primary.behaviour = behaviour
    primary.delay = 30.0  # far past first_byte_timeout: waiting it out would hang the test
    if streaming:
        r, raw = stream(router, "failover")
        assert r.status_code == 200
        assert chat_text(parse_events(raw)) == " w0 w1 w2"
    else:
        r = chat(router, "failover")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == " w0 w1 w2"
    # (Once, in a CI run, the primary saw no request here and only the backup did; not reproduced
    # since, under load either. The router's record of both says what happened if it recurs.)
    seen = {n: deployment(router.url, "failover", u) for n, u in (("primary", primary), ("backup", backup))}
    assert (len(primary.hits), len(backup.hits), backup.finished) == (1, 1, 1), seen
    if behaviour.startswith("slow"):
        # abandoned at its timeout, not awaited: the router hung up on it
        assert wait_for(lambda: primary.disconnects == 1)


def test_failover_on_connection_refused(router, ups):
    for streaming in (False, True):
        if streaming:
            r, raw = stream(router, "refused")
            assert r.status_code == 200 and chat_text(parse_events(raw)) == " w0 w1 w2"
        else:
            assert chat(router, "refused").status_code == 200
    assert ups["refused_backup"].finished == 2


def test_failover_on_connect_timeout(router, ups):
    for streaming in (False, True):
        if streaming:
            r, raw = stream(router, "unreachable")
            assert r.status_code == 200 and chat_text(parse_events(raw)) == " w0 w1 w2"
        else:
            assert chat(router, "unreachable").status_code == 200
    assert ups["refused_backup"].finished == 2
    status = httpx.get(f"{router.url}/health").json()["models"]["unreachable"]["deployments"]
    (primary,) = [v for v in status if v["url"] != ups["refused_backup"].url]
    assert primary["failed"] >= 2 and primary["last_error"] == "cannot connect within 0.5s"


def test_every_attempt_failing_is_502_naming_each(router, ups):
    ups["primary"].behaviour = ups["backup"].behaviour = "500"
    r = chat(router, "failover")
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "upstream_error"
    assert err["message"].count("HTTP 500: upstream exploded") == 2 and "2 attempts failed" in err["message"]


def test_every_attempt_rate_limited_is_429_with_retry_after(router, ups):
    ups["primary"].behaviour = ups["backup"].behaviour = "429"
    r = chat(router, "failover")
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_every_attempt_timing_out_is_504(router, ups):
    ups["primary"].behaviour = ups["backup"].behaviour = "slow"
    r, raw = stream(router, "failover")
    assert r.status_code == 504 and json.loads(raw)["error"]["code"] == "upstream_timeout"


# --- 4xx: relayed, normalized, never retried ---------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("behaviour, status, error", [
    ("trt_error", 400, {"message": "Unrecognized field: 'top_k' is not permitted", "type": "invalid_request_error", "param": None, "code": 400}),
    ("string_error", 400, {"message": "messages: at least one message is required", "type": "invalid_request_error", "param": None, "code": None}),
    ("detail_error", 422, {"message": "max_tokens: Input should be a valid integer", "type": "invalid_request_error", "param": None, "code": None}),
    ("first_event_error", 400, {"message": "Unrecognized field: 'top_k' is not permitted", "type": "invalid_request_error", "param": None, "code": 400}),
])
def test_upstream_4xx_is_relayed_not_retried(router, ups, behaviour, status, error, streaming):
    if behaviour == "first_event_error" and not streaming:
        pytest.skip("an event stream only")
    ups["shape"].behaviour = behaviour
    if streaming:
        r, raw = stream(router, "shapes")
        body = json.loads(raw)
    else:
        r = chat(router, "shapes")
        body = r.json()
    assert r.status_code == status and r.headers["content-type"].startswith("application/json")
    assert body == {"error": error}
    assert len(ups["shape"].hits) == 1 and ups["shape_backup"].hits == []


# --- after the first byte: no retry, never a silent truncation ---------------------------------


def test_stream_cut_midway_ends_with_error_event_and_done(router, ups):
    ups["cut"].behaviour = "cut"
    r, raw = stream(router, "cut")
    assert r.status_code == 200
    events = parse_events(raw)  # strict framing; ends with exactly one [DONE]
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}, {"content": " w0"}]
    assert all(e["model"] == "cut" for e in events[:2])
    err = events[-1]["error"]
    assert err["type"] == "server_error" and err["code"] == "upstream_stream_broken"
    assert "incomplete" in err["message"]
    assert len(events) == 3
    assert len(ups["cut"].hits) == 1 and ups["cut_backup"].hits == []  # not retried


def test_stream_without_done_is_not_silently_truncated(router, ups):
    ups["cut"].behaviour = "no_done"
    r, raw = stream(router, "cut")
    events = parse_events(raw)
    assert chat_text(events) == " w0 w1 w2"
    assert events[-1]["error"]["code"] == "upstream_stream_broken"
    assert "before `data: [DONE]`" in events[-1]["error"]["message"]
    assert ups["cut_backup"].hits == []


def test_client_has_the_whole_stream_at_done_without_waiting_for_the_upstream_end(router, ups):
    """After `[DONE]` the client's response ends at once, even while the upstream keeps its
    body open (the router waits for that end on its own, to reuse the connection, for at most
    a second), and the request still counts as complete."""
    up = ups["linger"]
    up.behaviour, up.delay = "linger", 30.0
    labels = 'router:request_success_total{model="linger",backend="remote",finished_reason="length"}'
    before = httpx.get(f"{router.url}/metrics").text
    disconnects = up.disconnects
    t0 = time.monotonic()
    r, raw = stream(router, "linger")
    # The client has its complete answer while the upstream's body is still open: before the
    # router gives up waiting for that end (after DRAIN_S, or read_timeout's 0.5 s here), which
    # it would otherwise wait out first.
    assert time.monotonic() - t0 < min(DRAIN_S, float(FAST["read_timeout"])) and up.lingered == 0
    events = parse_events(raw)
    assert chat_text(events) == " w0 w1 w2" and raw.endswith(b"data: [DONE]\n\n")
    deadline = time.monotonic() + 10
    while up.disconnects == disconnects and time.monotonic() < deadline:
        time.sleep(0.05)
    assert up.disconnects == disconnects + 1  # the router closed the lingering upstream response
    after = httpx.get(f"{router.url}/metrics").text
    assert after.count(labels) == 1
    count = lambda text: float(text.split(labels + " ")[1].split()[0]) if labels in text else 0.0  # noqa: E731
    assert count(after) - count(before) == 1  # complete, not a 499


def test_garbage_event_midway_ends_with_error_event_and_done(router, ups):
    ups["cut"].behaviour = "garbage_mid"
    r, raw = stream(router, "cut")
    assert r.status_code == 200
    events = parse_events(raw)  # strict framing: the garbage never reaches the client
    assert chat_text(events) == " w0"
    err = events[-1]["error"]
    assert err["code"] == "upstream_stream_broken" and "not a JSON object" in err["message"]
    assert ups["cut_backup"].hits == []  # bytes were sent: no retry


def test_error_event_midway_is_normalized(router, ups):
    ups["cut"].behaviour = "error_event"
    r, raw = stream(router, "cut")
    events = parse_events(raw)
    assert events[-1] == {"error": {"message": "engine died", "type": "server_error", "param": None, "code": 500}}
    assert ups["cut_backup"].hits == []


def test_stalled_stream_ends_after_read_timeout(router, ups):
    up = ups["cut"]
    up.behaviour, up.gap = "ok", 2.0  # first event at once, then silence past read_timeout (0.5 s)
    r, raw = stream(router, "cut")
    events = parse_events(raw)
    assert "sent nothing for 0.5s" in events[-1]["error"]["message"]
    assert ups["cut_backup"].hits == []


# --- passive ejection: cooldown and recovery ---------------------------------------------------


def test_cooldown_after_n_failures_then_recovery(router, ups):
    bad, good = ups["cool"], ups["cool_backup"]
    bad.behaviour = "500"
    for _ in range(2):
        assert chat(router, "cool").status_code == 200  # failed over
    assert len(bad.hits) == 2
    health = httpx.get(f"{router.url}/health").json()["models"]["cool"]
    assert health["state"] == "ready"
    assert deployment(router.url, "cool", bad)["state"] == "cooling"
    for _ in range(4):
        assert chat(router, "cool").status_code == 200
    assert len(bad.hits) == 2 and good.finished == 6  # skipped while cooling
    bad.behaviour = "ok"
    time.sleep(1.6)
    assert chat(router, "cool").status_code == 200
    assert len(bad.hits) == 3 and bad.finished == 1  # back after the cooldown
    assert deployment(router.url, "cool", bad)["state"] == "up"


# --- the client leaves -------------------------------------------------------------------------


def test_client_disconnect_mid_stream_closes_upstream(router, ups):
    up = ups["endless"]
    up.behaviour, up.gap = "endless", 0.05
    body = {"model": "endless", "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=10) as r:
        got = b""
        for chunk in r.iter_raw():
            got += chunk
            if got.count(b"\n\n") >= 3:
                break
    assert wait_for(lambda: up.disconnects == 1), "the upstream request was not closed"
    assert deployment(router.url, "endless", up)["in_flight"] == 0


def test_client_disconnect_while_waiting_non_streaming(router, ups):
    up = ups["slow"]
    up.behaviour, up.delay = "slow", 10.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.url}/v1/chat/completions", json={"model": "slow", "messages": MESSAGES}, timeout=0.5)
    assert wait_for(lambda: up.disconnects == 1), "the upstream request was not closed"
    assert wait_for(lambda: deployment(router.url, "slow", up)["in_flight"] == 0)


# --- what goes upstream, what comes back -------------------------------------------------------


def test_model_rewritten_both_ways_and_usage_only_when_asked(router, ups):
    up = ups["plain"]
    r, raw = stream(router, "plain")
    events = parse_events(raw)
    assert all(e["model"] == "plain" for e in events)
    assert all("usage" not in e for e in events)
    assert up.hits[-1]["body"] == {"model": "up-plain", "messages": MESSAGES, "stream": True, "max_tokens": 7,
                                   "stream_options": {"include_usage": True}}  # max_tokens_limit = 7
    r, raw = stream(router, "plain", stream_options={"include_usage": True})
    events = parse_events(raw)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert events[-1]["model"] == "plain"
    r = chat(router, "plain", max_tokens=5)
    assert r.json()["model"] == "plain" and r.json()["system_fingerprint"] == "fp_up"
    assert up.hits[-1]["body"] == {"model": "up-plain", "messages": MESSAGES, "max_tokens": 5}
    assert deployment(router.url, "plain", up)["completion_tokens"] == 9  # usage counted every time


def test_metrics_count_remote_requests(router, ups):
    import re

    def value(text: str, series: str) -> float:
        m = re.search(r"^" + re.escape(series) + r" (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    labels = '{model="plain",backend="remote"}'
    before = httpx.get(f"{router.url}/metrics").text
    stream(router, "plain")
    chat(router, "plain")
    after = httpx.get(f"{router.url}/metrics").text
    assert value(after, f"router:generation_tokens_total{labels}") - value(before, f"router:generation_tokens_total{labels}") == 6
    assert value(after, f"router:prompt_tokens_total{labels}") - value(before, f"router:prompt_tokens_total{labels}") == 10
    assert value(after, f"router:time_to_first_token_seconds_count{labels}") - value(before, f"router:time_to_first_token_seconds_count{labels}") == 1
    ok = 'router:request_success_total{model="plain",backend="remote",finished_reason="length"}'
    assert value(after, ok) - value(before, ok) == 2
    up = f'router:remote_deployment_up{{model="plain",backend="remote",deployment="{ups["plain"].url}"}}'
    assert value(after, up) == 1.0
    r = chat(router, "plain", max_tokens=8)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # over max_tokens_limit


def test_completions_relayed(router, ups):
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "plain", "prompt": "x", "max_tokens": 3}, timeout=10)
    assert r.status_code == 200 and r.json()["model"] == "plain" and r.json()["object"] == "text_completion"
    assert ups["plain"].hits[-1]["path"] == "/v1/completions"
    with httpx.stream("POST", f"{router.url}/v1/completions", timeout=10,
                      json={"model": "plain", "prompt": "x", "stream": True}) as r:
        events = parse_events(r.read())
    assert "".join(e["choices"][0]["text"] for e in events) == " w0 w1 w2"
    assert all(e["model"] == "plain" for e in events)


def test_unlisted_extra_is_400_and_never_sent(router, ups):
    r = chat(router, "plain", top_k=5)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "Model `plain` (backend `remote`) cannot honour `top_k`.",
                                 "type": "invalid_request_error", "param": "top_k", "code": "unsupported_parameter"}
    r = chat(router, "plain", return_token_ids=True)  # an extra no plugin requires a capability for
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"
    assert ups["plain"].hits == []


def test_requests_go_only_where_their_extras_are_accepted(router, ups):
    # `partial`: deployment 0 (refusing connections) takes top_k, deployment 1 does not.
    first = chat(router, "partial", top_k=3)
    assert first.status_code == 502 and "1 attempt failed" in first.json()["error"]["message"]
    second = chat(router, "partial", top_k=3)  # the only deployment that takes top_k cools down
    assert second.status_code == 503 and 25 <= int(second.headers["retry-after"]) <= 30
    assert "no deployment available that accepts `top_k`" in second.json()["error"]["message"]
    for _ in range(2):
        assert chat(router, "partial").status_code == 200  # without top_k: the other one
    assert len(ups["partial"].hits) == 2 and all("top_k" not in h["body"] for h in ups["partial"].hits)


def test_events_are_not_clumped(router, ups):
    up = ups["gappy"]
    up.events, up.gap = 6, 0.15
    body = {"model": "gappy", "messages": MESSAGES, "stream": True}
    arrivals = []
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=10) as r:
        buf = b""
        for chunk in r.iter_raw():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                arrivals.append(time.monotonic())
    assert len(arrivals) == 9  # role, 6 content, finish, [DONE]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # Each event leaves as it arrives. A relay that held events back, even in pairs, would
    # show gaps near 0; one short gap is tolerated for a scheduler hiccup on a busy machine.
    assert sum(g < 0.075 for g in gaps) <= 1, gaps
    assert arrivals[-1] - arrivals[0] > 7 * 0.15 * 0.9


def test_api_key_from_env_reaches_upstream(router, ups):
    assert chat(router, "keyed").status_code == 200
    assert ups["keyed"].hits[-1]["headers"]["authorization"] == "Bearer sekret"
    assert chat(router, "plain").status_code == 200
    assert "authorization" not in ups["plain"].hits[-1]["headers"]


def test_models_list_shows_remote_models(router):
    data = httpx.get(f"{router.url}/v1/models").json()["data"]
    cards = {m["id"]: m for m in data}
    assert cards["plain"]["backend"] == "remote" and cards["plain"]["ready"] is True
    assert httpx.get(f"{router.url}/v1/models/plain").json()["id"] == "plain"


# --- active health checks and all-down ---------------------------------------------------------


@pytest.fixture(scope="module")
def health_router(tmp_path_factory):
    a, b = FaultUpstream(name="ha").start(), FaultUpstream(name="hb").start()
    checked = f"""
[[models]]
name = "checked"
backend = "remote"
health_check_interval = 0.2
health_check_timeout = 0.5
[[models.deployments]]
url = "{a.url}"
[[models.deployments]]
url = "{b.url}"

[[models]]
name = "dead"
backend = "remote"
health_check_interval = 5
[[models.deployments]]
url = "{closed_port_url()}"
[[models.deployments]]
url = "{closed_port_url()}"

[[models]]
name = "burnt"
backend = "remote"
health_check_interval = 0
failure_threshold = 1
cooldown = 30
[[models.deployments]]
url = "{closed_port_url()}"
"""
    r = RouterProcess(checked, tmp_path_factory.mktemp("remote_health"), wait_ready=False, name="health")
    yield r, a, b
    r.stop()
    a.stop()
    b.stop()


def models_health(r) -> dict:
    return httpx.get(f"{r.url}/health").json()["models"]


def test_all_deployments_down_is_503_with_retry_after(health_router):
    r, _, _ = health_router
    assert wait_for(lambda: models_health(r).get("dead", {}).get("state") == "down", 10)
    resp = httpx.post(f"{r.url}/v1/chat/completions", json={"model": "dead", "messages": MESSAGES}, timeout=10)
    assert resp.status_code == 503 and 1 <= int(resp.headers["retry-after"]) <= 5
    err = resp.json()["error"]
    assert err["type"] == "service_unavailable" and err["code"] == "no_deployment_available"
    assert "cannot connect: connection refused" in err["message"]
    # The router takes requests (the issue on workers): /health is 200 and names the model's
    # trouble, as /v1/models' status does.
    h = httpx.get(f"{r.url}/health")
    assert h.status_code == 200 and h.json()["models"]["dead"]["error"].startswith("no deployment is up")
    status = {m["id"]: m["status"] for m in httpx.get(f"{r.url}/v1/models").json()["data"]}
    assert status["dead"]["value"] == "failed" and status["dead"]["reason"].startswith("no deployment is up")


def test_passive_all_down_is_503_after_failures(health_router):
    r, _, _ = health_router
    first = httpx.post(f"{r.url}/v1/chat/completions", json={"model": "burnt", "messages": MESSAGES}, timeout=10)
    assert first.status_code == 502 and "cannot connect" in first.json()["error"]["message"]
    second = httpx.post(f"{r.url}/v1/chat/completions", json={"model": "burnt", "messages": MESSAGES, "stream": True}, timeout=10)
    assert second.status_code == 503 and 25 <= int(second.headers["retry-after"]) <= 30


def test_health_checks_take_a_deployment_out_and_back(health_router):
    r, a, b = health_router
    assert wait_for(lambda: models_health(r).get("checked", {}).get("state") == "ready", 10)
    a.health_status = 503
    assert wait_for(lambda: deployment(r.url, "checked", a)["state"] == "down")
    a.reset()
    b.reset()
    for _ in range(4):
        resp = httpx.post(f"{r.url}/v1/chat/completions", json={"model": "checked", "messages": MESSAGES}, timeout=10)
        assert resp.status_code == 200
    assert a.hits == [] and len(b.hits) == 4
    b.health_status = 503
    assert wait_for(lambda: models_health(r)["checked"]["state"] == "down")
    resp = httpx.post(f"{r.url}/v1/chat/completions", json={"model": "checked", "messages": MESSAGES}, timeout=10)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    a.health_status = b.health_status = 200
    assert wait_for(lambda: models_health(r)["checked"]["state"] == "ready")
    assert deployment(r.url, "checked", a)["state"] == "up"
