"""Hydra config: the defaults are the embedded default; overrides work; bad keys are refused."""

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from controller.config import build_config
from base.typed_config import ConfigError

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")


def load(*overrides):
    with initialize_config_dir(version_base="1.3", config_dir=os.path.abspath(CONF)):
        return build_config(OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True))


def test_defaults_are_the_embedded_default():
    cfg = load()
    assert cfg.cluster.kind == "local" and cfg.cluster.num_cells == 4
    assert cfg.scheduler.kind == "elastic" and cfg.algo.kind == "gspo"
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == (3e-4, 4e-4)


def test_group_and_key_overrides():
    cfg = load("scheduler=async", "run.steps=3", "algo.lr=0.01", "cluster.num_cells=2")
    assert cfg.scheduler.kind == "async" and cfg.run.steps == 3 and cfg.algo.lr == 0.01
    assert cfg.cluster.num_cells == 2
    assert load("scheduler=colocate").scheduler.kind == "colocate"


def test_unknown_and_missing_keys_are_errors():
    with pytest.raises(ConfigError, match="unknown key"):
        load("+run.typo=1")
    with pytest.raises(ConfigError, match="missing key"):
        load("~run.steps")
    with pytest.raises(ConfigError, match="want one of"):
        load("model.tokenizer=gpt2")


def test_cross_package_checks():
    with pytest.raises(ConfigError, match="core_cell"):
        load("cluster.core_cell=7")
    with pytest.raises(ConfigError, match="train_cells"):
        load("scheduler=async", "scheduler.train_cells=4")
    with pytest.raises(ConfigError, match="ranks_per_node=2: trainer=embedded is one process per cell"):
        load("cluster.ranks_per_node=2")
    assert load("cluster.ranks_per_node=8", "trainer=megatron").cluster.ranks_per_node == 8
    with pytest.raises(ConfigError, match="microsteps_in_flight"):
        load("cluster.microsteps_in_flight=0")
    with pytest.raises(ConfigError, match="dist_port"):
        load("cluster.dist_port=80")
    with pytest.raises(ConfigError, match="set algo.release=group"):
        load("trainer=megatron", "algo.release=run")
    assert load("algo.release=run").algo.release == "run"
    with pytest.raises(ConfigError, match="release"):
        load("algo.release=sometimes")


def test_backends_are_groups_and_kind_picks_the_typed_config():
    from cellrunner.config import EmbeddedEngineConfig, EmbeddedTrainerConfig, MegatronConfig, SGLangConfig

    cfg = load()
    assert isinstance(cfg.trainer, EmbeddedTrainerConfig) and isinstance(cfg.engine, EmbeddedEngineConfig)
    assert cfg.cluster.transfer == "zmq"
    gpu = load("trainer=megatron", "engine=sglang", "transfer=mooncake", "engine.tp_size=8")
    assert isinstance(gpu.trainer, MegatronConfig) and isinstance(gpu.engine, SGLangConfig)
    assert gpu.engine.tp_size == 8 and gpu.cluster.transfer == "mooncake"
    with pytest.raises(ConfigError, match=r"trainer.kind: want one of \['embedded', 'megatron'\]"):
        load("trainer.kind=deepspeed")
    with pytest.raises(ConfigError, match="engine: unknown key"):
        load("+engine.tp_size=2")  # the embedded engine has no such knob


def test_a_cell_may_start_as_long_as_its_engine_does():
    # A cell is ready once its engine is: a shorter start wait stops runs whose engine is still
    # inside its own start timeout (cluster=slurm had 300 s against SGLang's 600).
    assert load().cluster.start_timeout_s == 120.0  # the embedded engine has no start timeout of its own
    assert load("engine=sglang").cluster.start_timeout_s == 600.0  # local follows the engine's
    slurm = load("cluster=slurm", "engine=sglang")
    assert slurm.cluster.start_timeout_s >= slurm.engine.startup_timeout_s
    with pytest.raises(ConfigError, match="start_timeout_s=300 is shorter than engine.startup_timeout_s=600"):
        load("cluster=slurm", "engine=sglang", "cluster.start_timeout_s=300")
    with pytest.raises(ConfigError, match="shorter than engine.startup_timeout_s=1200"):
        load("cluster=slurm", "engine=sglang", "engine.startup_timeout_s=1200")
    assert load("cluster=slurm", "cluster.start_timeout_s=300").cluster.start_timeout_s == 300.0  # embedded engine
    assert load("trainer=megatron").trainer.command_timeout_s >= 7 * 24 * 3600
    with pytest.raises(ConfigError, match="command_timeout_s"):
        load("trainer=megatron", "trainer.command_timeout_s=0")


def test_a_negative_eval_every_is_refused():
    with pytest.raises(ConfigError, match="eval_every"):
        load("run.eval_every=-1")
