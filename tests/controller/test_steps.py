"""Step coordination: shards stream to training cells, gradients gather, then the core applies."""

from base import wire
from controller.steps import StepCoordinator


def shard(step, sid):
    seq = wire.Sequence(execution_id="e", tokens=[1, 2], target_mask=[0, 1], behaviour_logprobs=[0, -1.0],
                        advantage=1.0, token_weight=1.0)
    return wire.Shard(step=step, shard_id=sid, num_executions=1, sequences=[seq])


def done(step, gid, n=2, dropped=""):
    return wire.GroupDone(group_id=gid, step=step, num_usable=n, mean_reward=0.5, dropped=dropped)


def test_stream_then_gather_then_apply():
    sc = StepCoordinator(core_cell=0, total_steps=3)
    sc.plan(0, 2)
    sc.on_shard(shard(0, "a"))
    sc.on_group_done(done(0, "a"))
    assert sc.train_demand() == 1
    sent = sc.assign([0, 2])
    assert [c for c, _ in sent] == [0]  # streamed before the step's rollouts are complete
    sc.on_shard(shard(0, "b"))
    assert [c for c, _ in sc.assign([2])] == [2]
    sc.on_microstep_done(0, 0, "a", 1.0, 3)
    sc.on_microstep_done(2, 0, "b", 1.0, 3)
    assert sc.finish(core_training=True) == []  # group b not done yet
    sc.on_group_done(done(0, "b"))
    out = sc.finish(core_training=True)
    assert [(c, type(m).__name__) for c, m in out] == [(2, "SendGrads")]
    assert sc.busy_cells() == {2, 0}
    sc.on_grads_sent(2, 0)
    out = sc.finish(core_training=False)
    assert out == []  # the core must be training to apply
    (cell, apply), = sc.finish(core_training=True)
    assert cell == 0 and apply.satellite_cells == [2] and apply.num_executions == 4
    st = sc.on_step_applied(0, 1)
    assert sc.version == 1 and st.mean_reward == 0.5


def test_lost_cell_gives_its_work_back():
    sc = StepCoordinator(core_cell=0, total_steps=3)
    sc.plan(0, 2)
    sc.on_shard(shard(0, "a"))
    sc.on_shard(shard(0, "b"))
    sc.assign([1, 2])
    sc.on_microstep_done(1, 0, "a", 0.0, 1)
    sc.on_cell_lost(1)  # its done-but-unsent microstep returns
    sc.on_cell_lost(2)  # its running microstep returns
    assert sorted(s.shard_id for s in sc.current.ready) == ["a", "b"]
    assert sc.busy_cells() == set()


def test_a_second_microstep_queues_behind_the_running_one_only_with_a_round_to_spare():
    sc = StepCoordinator(core_cell=0, total_steps=1)
    sc.plan(0, 1)
    for sid in "abcdefg":
        sc.on_shard(shard(0, sid))
    sent = sc.assign([0, 1, 2], in_flight=2)  # 7 ready, 3 cells: one each, then one more each
    assert [(c, m.shard.shard_id) for c, m in sent] == [(0, "a"), (1, "b"), (2, "c"), (0, "d"), (1, "e"), (2, "f")]
    assert sc.assign([0, 1, 2], in_flight=2) == []  # every cell holds two
    sc.on_microstep_done(1, 0, "b", 0.0, 1)
    # 1 ready for 3 cells, each running one: it waits for whichever cell frees first
    assert sc.assign([0, 1, 2], in_flight=2) == []
    sc.on_microstep_done(1, 0, "e", 0.0, 1)
    assert [(c, m.shard.shard_id) for c, m in sc.assign([0, 1, 2], in_flight=2)] == [(1, "g")]
    sc.on_microstep_done(0, 0, "a", 0.0, 1)
    sc.on_microstep_done(2, 0, "c", 0.0, 1)
    sc.on_shard(shard(0, "h"))
    sc.on_shard(shard(0, "i"))
    sc.on_shard(shard(0, "j"))
    assert sc.assign([0, 1, 2], in_flight=1) == []  # in_flight=1: only a cell with nothing running
    assert [(c, m.shard.shard_id) for c, m in sc.assign([0, 1, 2], in_flight=2)] == [(0, "h"), (1, "i"), (2, "j")]


def test_a_lost_cell_gives_back_every_microstep_queued_on_it():
    sc = StepCoordinator(core_cell=0, total_steps=1)
    sc.plan(0, 1)
    for sid in "abcd":
        sc.on_shard(shard(0, sid))
    sc.assign([1, 2], in_flight=2)
    sc.on_cell_lost(1)
    assert sorted(s.shard_id for s in sc.current.ready) == ["a", "c"]
    assert sc.busy_cells() == {2}


def test_dropped_groups_do_not_count_executions():
    sc = StepCoordinator(core_cell=0, total_steps=1)
    sc.plan(0, 1)
    assert sc.on_group_done(done(0, "a", dropped="too_few_usable")) is True
    assert sc.current.rollouts_done and sc.train_demand() == 0 and sc.finish(core_training=True) == []


def test_the_core_is_told_to_checkpoint_by_the_policy():
    def apply_of(step: int, every: int) -> wire.ApplyStep:
        sc = StepCoordinator(core_cell=0, total_steps=10, checkpoint_every=every)
        sc.version = step
        sc.plan(step, 1)
        sc.on_shard(shard(step, "a"))
        sc.on_group_done(done(step, "a"))
        sc.assign([0])
        sc.on_microstep_done(0, step, "a", 1.0, 3)
        ((_, msg),) = sc.finish(core_training=True)
        return msg

    # every=3: versions 3 and 6 are saved, i.e. after steps 2 and 5; every=0: never mid-run.
    assert [apply_of(s, 3).checkpoint for s in range(6)] == [False, False, True, False, False, True]
    assert not any(apply_of(s, 0).checkpoint for s in range(4))


def run_shard(step, gid, eid):
    seq = wire.Sequence(execution_id=eid, tokens=[1, 2], target_mask=[0, 1], behaviour_logprobs=[0, -1.0],
                        advantage=0.0, token_weight=1.0)
    return wire.Shard(step=step, shard_id=f"{gid}/{eid}", num_executions=1, sequences=[seq], group_id=gid, reward=1.0)


def test_run_released_shards_stream_before_their_group_and_the_orders_carry_its_stats():
    sc = StepCoordinator(core_cell=0, total_steps=1)
    sc.plan(0, 2)
    sc.on_shard(run_shard(0, "a", "e1"))
    sc.on_shard(run_shard(0, "b", "e2"))
    sc.on_shard(run_shard(0, "b", "e3"))
    assert [c for c, _ in sc.assign([0, 1])] == [0, 1]  # no group has closed yet
    sc.on_microstep_done(0, 0, "a/e1", 0.0, 1)
    sc.on_microstep_done(1, 0, "b/e2", 0.0, 1)
    sc.on_group_done(wire.GroupDone(group_id="a", step=0, num_usable=2, mean_reward=0.25, adv_divisor=0.5))
    # group b is dropped: its shard still waiting is not trained; the trained one is thrown away
    sc.on_group_done(done(0, "b", dropped="too_few_usable"))
    assert not sc.current.ready
    (cell, send), = sc.finish(core_training=True)
    want = {"a": (0.25, 0.5, False), "b": (0.5, 0.0, True)}
    assert cell == 1 and {g.group_id: (g.mean_reward, g.adv_divisor, g.dropped) for g in send.groups} == want
    sc.on_grads_sent(1, 0, late_loss=0.5)
    (cell, apply), = sc.finish(core_training=True)
    assert cell == 0 and {g.group_id for g in apply.groups} == {"a", "b"} and apply.num_executions == 2
    assert wire.decode(wire.encode(apply)) == apply
    assert sc.on_step_applied(0, 1, late_loss=0.25).loss == 0.75


def test_a_lost_cell_gives_back_run_released_shards_but_not_those_of_dropped_groups():
    sc = StepCoordinator(core_cell=0, total_steps=1)
    sc.plan(0, 2)
    sc.on_shard(run_shard(0, "a", "e1"))
    sc.on_shard(run_shard(0, "b", "e2"))
    sc.assign([1, 2])
    sc.on_microstep_done(1, 0, "a/e1", 0.0, 1)
    sc.on_group_done(done(0, "b", dropped="too_few_usable"))
    sc.on_cell_lost(1)
    sc.on_cell_lost(2)
    assert [s.shard_id for s in sc.current.ready] == ["a/e1"]
    sc.on_shard(run_shard(0, "b", "e3"))  # late, for a dropped group
    assert [s.shard_id for s in sc.current.ready] == ["a/e1"]
