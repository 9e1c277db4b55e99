"""The layout check (controller/layout.py): shipped presets at their recipes' cells pass, impossible
layouts are refused naming the rule, and the command prints one JSON object last."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from controller import layout
from controller.layout import LayoutRequest, PRESET_SHAPES, check_layout
from cellrunner.servers import engine_pp_of

ROOT = Path(__file__).resolve().parents[2]
# The sbatch recipes' GPU stack (slurm/gyre_*.sbatch STACK) and a shared weight folder (servers over nodes).
STACK = ["engine=sglang", "trainer=megatron", "transfer=mooncake", "cluster.ranks_per_node=8", "engine.weight_dir=/shared/w"]
RECIPE_CELLS = {"gyre_2p4t": [48], "gyre_122b": [6, 7, 8]}  # 192 nodes / 4 cells; 24..32 nodes / 4 cells
PRESETS = {  # preset -> the recipes it is meant for (the recipes' comments name qwen3_hf and these presets)
    "qwen3_hf": ["gyre_2p4t", "gyre_122b"], "qwen3_0_6b": ["gyre_2p4t", "gyre_122b"],
    "qwen3_8b": ["gyre_2p4t", "gyre_122b"], "qwen3_32b": ["gyre_2p4t", "gyre_122b"],
    "qwen3_30b_a3b": ["gyre_2p4t", "gyre_122b"], "qwen3_235b_a22b": ["gyre_2p4t"],
}


def test_every_shipped_preset_covered():
    shipped = {p.stem for p in (ROOT / "conf/model").glob("*.yaml")} - {"tiny"}
    assert shipped == set(PRESETS)


@pytest.mark.parametrize("preset,nodes", [(p, n) for p, rs in PRESETS.items() for r in rs for n in RECIPE_CELLS[r]])
def test_shipped_preset_at_its_recipe_cells_is_ok(preset, nodes, capsys):
    rc = layout.main([preset, "--nodes-per-cell", str(nodes), "--gpus-per-node", "8", "--gpu-mem-gib", "80", *STACK])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (rc, out["ok"]) == (0, True), out["why"]
    assert out["engine"]["servers_per_cell"] >= 1 and out["trainer"]["world_size"] == nodes * 8
    assert not [n for n in out["not_built"] if n.startswith("serving")]  # a cell starts all its servers


def test_the_recipes_stack_passes_as_the_recipes_pass_it(capsys):
    """The sbatch recipes' own STACK (with the shared weight folder they default to) at their cells.
    The folder is a fixed shared-looking path, not one under this checkout: a checkout under
    /tmp is node-local, and the check rightly refuses it."""
    for script, cells in RECIPE_CELLS.items():
        text = (ROOT / "slurm" / f"{script}.sbatch").read_text()
        assert 'engine.weight_dir="${GYRE_WEIGHT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/runs/weights-' in text
        for nodes in cells:
            rc = layout.main(["qwen3_hf", "--nodes-per-cell", str(nodes), "--gpus-per-node", "8", *STACK[:-1],
                              "engine.weight_dir=/scratch/gyre/runs/weights-check"])
            out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            assert (rc, out["not_built"]) == (0, []), out["why"]
            assert out["engine"]["servers_per_cell"] == nodes * 8  # qwen3_hf: TP1, a server a GPU


def base(**kw) -> LayoutRequest:
    req = LayoutRequest(nodes_per_cell=48, gpus_per_node=8, gpu_mem_gib=80, ranks_per_node=8, trainer="megatron",
                        engine="sglang", shape=PRESET_SHAPES["qwen3_235b_a22b"], trainer_tp=4, trainer_pp=2,
                        trainer_ep=64, engine_tp=16, engine_ep=16, engine_nnodes=2, mem_fraction_static=0.6)
    return replace(req, **kw)


@pytest.mark.parametrize("kw,rule", [
    # the old qwen3_235b_a22b preset: 94 layers over PP 4, and EP x PP = 32 against 6-node cells
    ({"trainer_pp": 4, "trainer_ep": 8}, "megatron.layers_pp"),
    ({"nodes_per_cell": 6, "trainer_pp": 4, "trainer_ep": 8}, "megatron.world_ep_pp"),
    ({"nodes_per_cell": 7, "trainer_tp": 16, "trainer_pp": 1, "trainer_ep": 8}, "megatron.world_tp_pp"),
    ({"trainer_tp": 8}, "megatron.kv_heads_tp"),
    ({"trainer_ep": 3, "trainer_pp": 1, "nodes_per_cell": 3}, "megatron.experts_ep"),
    # forcing one 48-node server with qwen3_hf's TP1 and no --pp-size
    ({"engine_tp": 1, "engine_ep": 1, "engine_nnodes": 48}, "sglang.tp_pp_nnodes"),
    ({"engine_tp": 8, "engine_ep": 8, "engine_dp": 2, "engine_nnodes": 2}, "sglang.dp_nnodes"),
    ({"engine_ep": 3}, "sglang.ep_tp"),
    ({"engine_tp": 8, "engine_ep": 8, "engine_nnodes": 1}, "memory.serve"),
    ({"trainer_ep": 8, "trainer_pp": 1}, "memory.train"),
    ({"nodes_per_cell": 7, "trainer": "embedded"}, "gyre.servers_per_cell"),
    ({"ranks_per_node": 1}, "gyre.ranks_per_node"),
    # servers on a cell's other nodes cannot read the leader's tmpfs
    ({"engine_weight_dir": "/dev/shm/gyre"}, "gyre.weight_dir_shared"),
    # one process starts one server: a cell of 48 one-node servers needs a rank on each node
    ({"trainer": "embedded", "engine_tp": 8, "engine_ep": 8, "engine_nnodes": 1, "mem_fraction_static": 0.9,
      "shape": PRESET_SHAPES["qwen3_8b"]}, "gyre.one_process_serving"),
])
def test_impossible_layout_is_refused_naming_its_rule(kw, rule):
    result = check_layout(base(**kw))
    assert not result.ok
    assert result.rule == rule and result.why.startswith(f"{rule}: ") and "\n" not in result.why, result.why


def test_the_base_layout_is_ok_and_reports_servers_and_what_is_not_built():
    result = check_layout(base())
    assert result.ok, result.why
    assert result.engine["servers_per_cell"] == 24 and result.trainer["dp"] == 48
    assert not [n for n in result.not_built if n.startswith("serving")]  # 24 servers a cell are built
    one_node = check_layout(base(shape=PRESET_SHAPES["qwen3_8b"], trainer_ep=1, trainer_pp=1, engine_tp=8,
                                 engine_ep=1, engine_nnodes=1))
    assert one_node.ok and one_node.engine["servers_per_cell"] == 48 and one_node.not_built == [], one_node.why


def test_engine_pipeline_stages_come_from_extra_args():
    assert engine_pp_of(["--pp-size", "16"]) == 16 and engine_pp_of(["--pp-size=4"]) == 4
    assert engine_pp_of([]) == 1
    ok = check_layout(base(shape=None, engine_tp=8, engine_pp=16, engine_ep=1, engine_nnodes=16))
    assert ok.ok and ok.engine["servers_per_cell"] == 3 and ok.memory["estimated"] is False


def test_a_checkpoint_config_json_is_used(tmp_path):
    hf = {"num_hidden_layers": 36, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shape, where = layout.model_shape({"name": "qwen3-hf", "path": str(tmp_path)})
    assert shape == PRESET_SHAPES["qwen3_8b"] and where.endswith("config.json")


def test_the_command_prints_one_json_object_last():
    out = subprocess.run([sys.executable, "-m", "controller.layout", "qwen3_235b_a22b", "--nodes-per-cell", "6",
                          "--gpus-per-node", "8", *STACK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 1 and last["ok"] is False and last["rule"] == "megatron.world_ep_pp", last
    assert set(last) >= {"ok", "why", "trainer", "engine", "memory", "not_built"}


def test_a_bad_config_is_one_json_line_too(capsys):
    assert layout.main(["qwen3_235b_a22b", "--nodes-per-cell", "48", "--gpus-per-node", "8", "cluster.ranks_per_node=8"]) == 2
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] is False and out["rule"] == "config" and "weight_dir" in out["why"]
