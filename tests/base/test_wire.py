"""The wire module: round trips, and every kind of bad frame ends in ProtocolError."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from base import wire


def _record(**over):
    base = dict(
        execution_id="s0-g0-e1", call_id="c1", call_index=0, prompt_ids=[1, 2, 3], output_ids=[4, 5],
        output_logprobs=[-0.5, -1.25], weight_version=3, cell_id=1, finish_reason="stop",
        started_at=1.0, finished_at=2.0,
    )
    base.update(over)
    return wire.CallRecord(**base)


def test_round_trip_nested():
    seq = wire.Sequence(execution_id="e", tokens=[1, 2, 3], target_mask=[0, 1, 1],
                        behaviour_logprobs=[0.0, -0.1, -0.2], advantage=-1.5, token_weight=0.5)
    msg = wire.RunMicrostep(shard=wire.Shard(step=2, shard_id="s2-g0", num_executions=1, sequences=[seq]))
    assert wire.decode(wire.encode(msg)) == msg
    rec = _record()
    assert wire.decode(wire.encode(rec)) == rec


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"execution_id": 5}, "call_record.execution_id: want str"),
        ({"finish_reason": "done"}, "call_record.finish_reason: want one of"),
        ({"output_logprobs": [-0.5]}, "call_record.output_logprobs: want one per output token"),
        ({"output_logprobs": [-0.5, 0.5]}, "<= 0"),
        ({"prompt_ids": [1, "x"]}, "call_record.prompt_ids: want list of int"),
        ({"prompt_ids": []}, "prompt_ids: empty"),
    ],
)
def test_bad_fields_name_message_and_field(body, needle):
    plain = wire.to_plain(_record())
    plain.update(body)
    frame = msgpack.packb([wire.PROTOCOL_VERSION, "call_record", plain])
    with pytest.raises(wire.ProtocolError, match=needle.replace("(", r"\(")):
        wire.decode(frame)


def test_unknown_tag_version_and_fields():
    with pytest.raises(wire.ProtocolError, match="unknown tag"):
        wire.decode(msgpack.packb([wire.PROTOCOL_VERSION, "launch_missiles", {}]))
    with pytest.raises(wire.ProtocolError, match="protocol version"):
        wire.decode(msgpack.packb([99, "shutdown", {}]))
    with pytest.raises(wire.ProtocolError, match="unknown field"):
        wire.decode(msgpack.packb([wire.PROTOCOL_VERSION, "shutdown", {"reason": "x", "extra": 1}]))
    with pytest.raises(wire.ProtocolError, match="missing"):
        wire.decode(msgpack.packb([wire.PROTOCOL_VERSION, "send_grads", {}]))
    with pytest.raises(wire.ProtocolError, match="not expected here"):
        wire.decode(wire.encode(wire.Shutdown()), expect=(wire.Grade,))


def test_grade_reward_none_is_not_zero():
    g = wire.Grade(execution_id="e", group_id="g", step=0, group_size=2, outcome="finished", reward=None)
    assert wire.decode(wire.encode(g)).reward is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_escape_as_other_errors(data):
    try:
        wire.decode(data)
    except wire.ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=20),
       st.sampled_from(sorted(wire.MESSAGES)))
def test_random_bodies_for_real_tags(body, tag):
    try:
        wire.decode(msgpack.packb([wire.PROTOCOL_VERSION, tag, body]))
    except wire.ProtocolError:
        pass


def _ready(**over) -> bytes:
    body = dict(cell_id=1, engine_url="http://10.0.0.1:30000", weights_addr="", grads_addrs=[], is_core=False)
    body.update(over)
    return msgpack.packb([wire.PROTOCOL_VERSION, "cell_ready", body])


def test_a_cell_names_all_its_servers_engine_url_first():
    urls = ["http://10.0.0.1:30000", "http://10.0.0.1:30001", "http://10.0.0.2:30000"]
    ready = wire.decode(_ready(engine_urls=urls))
    assert ready.serving_urls() == urls
    assert wire.decode(_ready()).serving_urls() == ["http://10.0.0.1:30000"]  # a cell that names one
    for urls, needle in [
        (["http://10.0.0.1:30000", "tcp://10.0.0.2:1"], r"engine_urls\[1\]: want an http:// URL"),
        (["http://10.0.0.1:30000", "http://10.0.0.1:30000"], "engine_urls: a server is named twice"),
        (["http://10.0.0.2:30000", "http://10.0.0.1:30000"], r"engine_urls\[0\]: want engine_url"),
        ([f"http://h:{i}" for i in range(wire.MAX_CELL_SERVERS + 1)], "engine_urls: 4097 servers"),
        ([1], r"cell_ready.engine_urls\[0\]: want str"),
    ]:
        with pytest.raises(wire.ProtocolError, match=needle):
            wire.decode(_ready(engine_urls=urls))


def test_a_heartbeat_names_the_servers_that_stopped_answering():
    def beat(**over) -> bytes:
        body = dict(cell_id=1, phase="serving", num_running=0, weight_version=2, **over)
        return msgpack.packb([wire.PROTOCOL_VERSION, "heartbeat", body])

    assert wire.decode(beat()).down_urls == []  # a cell that names none
    assert wire.decode(beat(down_urls=["http://10.0.0.1:30001"])).down_urls == ["http://10.0.0.1:30001"]
    for urls, needle in [
        (["tcp://10.0.0.2:1"], r"down_urls\[0\]: want an http:// URL"),
        ([f"http://h:{i}" for i in range(wire.MAX_CELL_SERVERS + 1)], "down_urls: 4097 servers"),
        ("http://h:1", "heartbeat.down_urls: want list"),
    ]:
        with pytest.raises(wire.ProtocolError, match=needle):
            wire.decode(beat(down_urls=urls))
