"""Per-rank config copies (`controller.slurm_launch.bind_config_to_node`) on a real 2.4T-sized cell:
48 nodes of ordinary, long site names. A file name holds at most 255 bytes (NAME_MAX)."""

import json
from pathlib import Path

from controller import slurm_launch

NAME_MAX = 255


def long_names(n: int, *, prefix: str) -> list[str]:
    return [f"{prefix}-gpu-rack{i // 8:02d}-node{i:04d}" for i in range(n)]  # 24 characters each


def bind_all(tmp_path, monkeypatch, cells: list[list[str]], ranks: int) -> list[Path]:
    shared = tmp_path / "cellrunner.json"
    shared.write_text(json.dumps({"host": slurm_launch.AUTO_HOST, "cell": 0}))
    monkeypatch.setattr(slurm_launch, "resolve_host", lambda host: "10.0.0.7")
    return [Path(slurm_launch.bind_config_to_node(str(shared), ",".join(nodes), rank))
            for nodes in cells for rank in range(ranks)]


def test_a_48_node_cell_writes_bounded_per_rank_files(tmp_path, monkeypatch):
    nodes = long_names(48, prefix="cluster01")
    assert all(len(n) >= 20 for n in nodes)
    paths = bind_all(tmp_path, monkeypatch, [nodes], ranks=3)
    for path in paths:
        assert len(path.name.encode()) <= NAME_MAX, path.name
        assert path.parent == tmp_path and path.name.startswith("cellrunner.")
        assert json.loads(path.read_text()) == {"host": "10.0.0.7", "cell": 0}


def test_per_rank_files_are_unique_across_ranks_and_cells(tmp_path, monkeypatch):
    nodes = long_names(192, prefix="cluster01")
    cells = [nodes[i * 48:(i + 1) * 48] for i in range(4)]
    paths = bind_all(tmp_path, monkeypatch, cells, ranks=4)
    assert len({p.name for p in paths}) == len(paths) == 16
    # the same cell and rank name the same file again (a restarted task overwrites its own copy)
    assert bind_all(tmp_path, monkeypatch, cells[:1], ranks=1)[0] == paths[0]
