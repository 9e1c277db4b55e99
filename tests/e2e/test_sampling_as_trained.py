"""Sampling as trained: a harness asks for temperature 0.3; a training execution is sampled at the
run's ``algo.rollout`` temperature instead, the CallRecord says both, and the trainer scores the
tokens at that temperature, so an unchanged policy's GSPO ratio is 1.

The real embedded engine behind the real proxy (the official OpenAI SDK as the harness), the
CallRecord as the processor receives it, the embedded trainer's own microstep on it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import yaml

from cellrunner.config import ModelConfig
from cellrunner.engine import EmbeddedEngine
from cellrunner.gspo import pack, sequence_ratios, token_logprobs
from cellrunner.model import build_model, flatten_params, vocab_rows
from cellrunner.trainer import EmbeddedTrainer
from base import wire
from base.typed_config import build
from base.execution_token import mint_token
from tests.harness_proxy import SECRET, LiveProxy
from base.algo_config import AlgoConfig

ROOT = Path(__file__).resolve().parents[2]
ROLLOUT_T = 0.6
HARNESS_T = 0.3


def model_cfg() -> ModelConfig:
    # The proxy's test tokenizer is the 4,096-rank compact vocabulary: the model has its rows.
    return build(ModelConfig, {**yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()), "compact_ranks": 4096})


def algo(temperature: float) -> AlgoConfig:
    raw = yaml.safe_load((ROOT / "conf/algo/gspo.yaml").read_text())
    return build(AlgoConfig, {**raw, "rollout": {**raw["rollout"], "temperature": temperature}})


@pytest.fixture(scope="module")
def served():
    """One engine on the seeded version 0, one proxy routing to it with algo.rollout at 0.6."""
    cfg = model_cfg()
    rows = vocab_rows(cfg)
    engine = EmbeddedEngine(model_cfg=cfg, vocab_size=rows, host="127.0.0.1", port=0, cell_id=0, max_running=8, seed=0)
    engine.start()
    engine.resume(flatten_params(build_model(cfg, rows), 0))
    proxy = LiveProxy(num_engines=0, rollout={"temperature": ROLLOUT_T, "top_p": 1.0, "top_k": -1})
    table = wire.RoutingTable(version=proxy.routing_version + 1, engines=[wire.EngineRoute(cell_id=0, url=engine.url, weight_version=0)])
    assert proxy.lt.call(proxy.server.apply_routing_table, table)
    yield cfg, rows, proxy
    proxy.close()
    engine.stop()


def ask(proxy: LiveProxy, execution_id: str, *, train: bool) -> wire.CallRecord:
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=mint_token(SECRET, execution_id, train=train),
                           max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="gyre-policy", messages=[{"role": "user", "content": "Name three prime numbers."}],
        temperature=HARNESS_T, max_tokens=48,
    )
    assert reply.choices[0].message is not None
    record = proxy.recv()
    assert isinstance(record, wire.CallRecord) and record.execution_id == execution_id
    return record


def as_shard(record: wire.CallRecord) -> wire.Shard:
    tokens = [*record.prompt_ids, *record.output_ids]
    n = len(record.prompt_ids)
    mask = [0] * n + [1] * len(record.output_ids)
    behaviour = [0.0] * n + list(record.output_logprobs)
    seq = wire.Sequence(execution_id=record.execution_id, tokens=tokens, target_mask=mask,
                        behaviour_logprobs=behaviour, advantage=1.0, token_weight=1.0 / len(record.output_ids))
    return wire.Shard(step=0, shard_id="s0", num_executions=1, sequences=[seq])


def test_training_calls_sample_at_the_runs_temperature_and_train_with_ratio_one(served):
    cfg, rows, proxy = served
    record = ask(proxy, "train-1", train=True)
    assert (record.temperature, record.top_p, record.top_k) == (ROLLOUT_T, 1.0, -1)
    assert (record.harness_temperature, record.harness_top_p) == (HARNESS_T, 1.0)  # kept beside, not used
    assert len(record.output_ids) >= 8

    shard = as_shard(record)
    trainer = EmbeddedTrainer(model_cfg=cfg, algo=algo(ROLLOUT_T), vocab_size=rows, is_core=True)
    trainer.start(None)  # the same version 0 the engine serves
    result = trainer.microstep(shard)
    assert abs(result.mean_ratio - 1.0) <= 1e-6, result.mean_ratio

    # The check can fail: scored at T = 1 (what the trainer assumed before), the same tokens give a
    # ratio over ten times outside GSPO's clip band (3e-4 below, 4e-4 above), even on this
    # near-uniform random init.
    batch = pack(list(shard.sequences))
    ratio_t1 = float(sequence_ratios(token_logprobs(trainer.model, batch, 1.0).detach(), batch)[0][0])
    assert abs(ratio_t1 - 1.0) > 10 * 4e-4, ratio_t1


def test_eval_calls_keep_the_harnesss_temperature(served):
    _, _, proxy = served
    record = ask(proxy, "eval-1", train=False)
    assert record.temperature == HARNESS_T == record.harness_temperature


def test_truncated_rollout_sampling_is_refused_for_training():
    raw = yaml.safe_load((ROOT / "conf/algo/gspo.yaml").read_text())
    for bad in ({"top_p": 0.9}, {"top_k": 20}, {"temperature": 0.0}):
        with pytest.raises(ValueError, match="rollout"):
            build(AlgoConfig, {**raw, "rollout": {**raw["rollout"], **bad}})
    assert np.isclose(build(AlgoConfig, raw).rollout.temperature, 1.0)
