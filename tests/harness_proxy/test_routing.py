"""Engine choice: newest table, stickiness, least load, stable ties."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from base.wire import EngineRoute, RoutingTable
from harness_proxy.routing import Router, pick_engine

E = [EngineRoute(cell_id=i, url=f"http://e{i}") for i in range(3)]


def test_least_loaded_with_stable_ties():
    assert pick_engine([], in_flight={}, num_sticky={}) is None
    assert pick_engine(E, in_flight={}, num_sticky={}) == E[0]
    assert pick_engine(E, in_flight={"http://e0": 2, "http://e1": 1}, num_sticky={}) == E[2]
    assert pick_engine(E, in_flight={"http://e0": 1}, num_sticky={"http://e1": 3}) == E[2]
    assert pick_engine(list(reversed(E)), in_flight={}, num_sticky={}) == E[0]


def test_sticky_and_exclude():
    busy = {"http://e1": 9}
    assert pick_engine(E, in_flight=busy, num_sticky={}, sticky_url="http://e1") == E[1]
    assert pick_engine(E, in_flight=busy, num_sticky={}, sticky_url="http://gone") == E[0]
    assert pick_engine(E, in_flight={}, num_sticky={}, sticky_url="http://e1", exclude={"http://e1"}) == E[0]
    everything = {e.url for e in E}
    assert pick_engine(E, in_flight={"http://e0": 1}, num_sticky={}, exclude=everything) == E[1]


@given(st.dictionaries(st.sampled_from([e.url for e in E]), st.integers(0, 5)),
       st.sets(st.sampled_from([e.url for e in E])))
def test_the_choice_is_a_least_loaded_allowed_engine(in_flight, exclude):
    got = pick_engine(E, in_flight=in_flight, num_sticky={}, exclude=exclude)
    allowed = [e for e in E if e.url not in exclude] or E
    assert got in allowed
    assert in_flight.get(got.url, 0) == min(in_flight.get(e.url, 0) for e in allowed)


def test_router_tables_stickiness_and_load():
    r = Router()
    assert r.choose("ex", "") is None
    assert r.update(RoutingTable(version=2, engines=E[:2]))
    assert not r.update(RoutingTable(version=2, engines=[]))
    assert not r.update(RoutingTable(version=1, engines=[]))
    assert r.engines() == E[:2]
    assert r.choose("a", "") == E[0]
    assert r.choose("b", "") == E[1]  # e0 already holds a sticky agent
    with r.track(E[0].url):
        assert r.in_flight(E[0].url) == 1
        assert r.choose("a", "") == E[0]  # sticky beats load
        assert r.choose("c", "") == E[1]
    assert r.in_flight(E[0].url) == 0
    assert r.update(RoutingTable(version=3, engines=E[1:]))
    assert r.choose("a", "") == E[2] and r.sticky_url("a", "") == E[2].url  # e1 holds b and c
    r.forget("a")
    assert r.sticky_url("a", "") is None


def test_engines_older_than_the_floor_are_never_chosen():
    versions = [EngineRoute(cell_id=i, url=f"http://v{i}", weight_version=i) for i in range(3)]
    assert pick_engine(versions, in_flight={}, num_sticky={}, min_version=1) == versions[1]
    assert pick_engine(versions, in_flight={}, num_sticky={}, sticky_url="http://v0", min_version=2) == versions[2]
    # Excluding every new-enough engine falls back to them, never to an older one.
    assert pick_engine(versions, in_flight={}, num_sticky={}, exclude={"http://v2"}, min_version=2) == versions[2]
    assert pick_engine(versions, in_flight={}, num_sticky={}, min_version=3) is None


# ---------------------------------------------------------------- a cell's servers, one of them dead

CELL = [EngineRoute(cell_id=4, url=f"http://s{i}") for i in range(3)]  # one cell's three servers


def test_a_down_server_is_passed_over_while_another_can_take_the_call():
    down = {"http://s1"}
    assert pick_engine(CELL, in_flight={}, num_sticky={}, sticky_url="http://s1", down=down) == CELL[0]
    assert pick_engine(CELL, in_flight={"http://s0": 1}, num_sticky={}, down=down) == CELL[2]
    # only down (or already tried) servers left: the down one, not one this call already failed on
    assert pick_engine(CELL, in_flight={}, num_sticky={}, exclude={"http://s0", "http://s2"}, down=down) == CELL[1]
    everything = {e.url for e in CELL}
    assert pick_engine(CELL, in_flight={}, num_sticky={}, exclude=everything, down=everything) == CELL[0]


def test_sessions_stick_spread_and_move_off_a_dead_server():
    now = [100.0]
    r = Router(clock=lambda: now[0], down_s=10.0)
    assert r.update(RoutingTable(version=1, engines=CELL))
    first = {ex: r.choose(ex, "").url for ex in ("a", "b", "c")}
    assert sorted(first.values()) == [e.url for e in CELL]  # new sessions spread over the servers
    assert all(r.choose(ex, "").url == url for ex, url in first.items())  # and each stays on its own
    dead = first["b"]
    r.failed(dead)
    moved = r.choose("b", "", exclude=[dead]).url
    assert moved != dead and r.sticky_url("b", "") == moved  # re-pinned where its call landed
    assert r.choose("b", "").url == moved
    assert r.choose("d", "").url != dead  # a new session avoids it, although it holds no session now
    now[0] += 10.0
    assert r.down() == set()  # after down_s it takes sessions again
    assert r.choose("e", "").url == dead
    r.failed(dead)
    r.succeeded(dead)  # an answer clears it at once
    assert r.down() == set()


def test_a_new_session_prefers_the_server_holding_its_prefix_within_the_slack():
    match = {"http://e1": 3000, "http://e2": 5000}
    pick = lambda load, slack: pick_engine(E, in_flight=load, num_sticky={}, prefix_match=match,  # noqa: E731
                                           min_prefix=1024, affinity_slack=slack)
    assert pick({}, 0) == E[2]  # the longest prefix held
    assert pick({"http://e2": 3}, 4) == E[2]
    assert pick({"http://e2": 5}, 4) == E[1]  # e2 over the slack: the next holder
    assert pick({"http://e1": 5, "http://e2": 5}, 4) == E[0]  # every holder over it: the least loaded
    assert pick_engine(E, in_flight={}, num_sticky={}, prefix_match={"http://e1": 1000}, min_prefix=1024) == E[0]
    # a pinned session stays where it is, whatever another server holds
    assert pick_engine(E, in_flight={}, num_sticky={}, sticky_url="http://e0", prefix_match=match) == E[0]


@given(st.dictionaries(st.sampled_from([e.url for e in E]), st.integers(0, 20)),
       st.dictionaries(st.sampled_from([e.url for e in E]), st.integers(0, 9000)), st.integers(0, 6))
def test_affinity_never_loads_a_server_past_the_slack(in_flight, match, slack):
    got = pick_engine(E, in_flight=in_flight, num_sticky={}, prefix_match=match, min_prefix=1024, affinity_slack=slack)
    least = min(in_flight.get(e.url, 0) for e in E)
    assert in_flight.get(got.url, 0) <= least + slack


def test_a_group_started_at_once_lands_on_few_servers_and_new_weights_forget_the_index():
    """Sixteen sessions with one harness prompt on four servers: the prefix holder takes them while
    it is at most `slack` calls ahead, then a second server; a weight update empties the hint."""
    servers = [EngineRoute(cell_id=i, url=f"http://e{i}") for i in range(4)]
    router = Router(affinity_slack=8, min_prefix=1024)
    router.update(RoutingTable(version=1, engines=servers))
    prompt = list(range(5000))
    used = []
    for i in range(16):
        route = router.choose(f"ex{i}", "main", prompt_ids=[*prompt, 100_000 + i])
        used.append(route.url)
        router._in_flight[route.url] += 1  # the call is in flight: its first answer is minutes away
    assert used[:9] == ["http://e0"] * 9 and set(used) == {"http://e0", "http://e1"}
    newer = [EngineRoute(cell_id=s.cell_id, url=s.url, weight_version=2) for s in servers]
    router.update(RoutingTable(version=2, engines=newer))
    assert router.prefixes.match(newer, prompt) == {}
