"""Role switches of real embedded cells: median serve -> train and train -> serve seconds.

    .venv/bin/python -m bench.switch [--quick] [--cycles 10] [--cells 3] [--transfer zmq|mooncake|both]
        [--curve on|off|both] [KEY=VALUE ...]

This program plays the controller's part for switches only: it starts real cellrunners
(``python -m cellrunner.main``, the same config JSON the controller writes, from ``conf/`` plus
Hydra-style overrides), and then, ``--cycles`` times, switches every cell to training, has the
core apply a step (a new weight version to pull), and switches every cell back to serving. Cells
switch one at a time, as the elastic scheduler moves them, so each switch has the machine to
itself. A switch's time is the ``total_s`` the cell reports in ``RoleSwitched``, the figure
``runs/<id>/summary.json`` takes its medians from:

- serve -> train: drain (no calls in flight here, so ~0), release the engine, pull the weights
  (satellites; the core's trainer already holds them), start the trainer;
- train -> serve: stop the trainer, pull the weights (satellites), resume the engine.

With ``--transfer both`` the whole run repeats with each weight transfer and the table shows
both; the JSON's headline is the config's ``cluster.transfer``. ``--curve both`` repeats it with
CURVE off and on (``cluster.curve``, on by default: every socket authenticated and encrypted) and
gives ``curve_cost`` (on / off, per role) in the JSON. The last line is JSON:
``to_train_s``, ``to_serve_s`` (medians over every cell), ``n_switches``, per-role phase medians,
core and satellites apart, and everything per transfer under ``by_transfer``.

Left out: calls in flight at a switch (the drain waits for them up to
``cluster.drain_timeout_s``, a policy choice, not switch mechanics), the controller's decision.
``--quick`` (2 cells, 2 cycles) is the smoke test. The 405 MB model of ``bench.transfer``:

    python -m bench.switch --transfer both --cycles 3 model.tokenizer=qwen model.hidden_size=512 \
        model.intermediate_size=2048 model.num_hidden_layers=6 model.num_attention_heads=8 \
        model.num_key_value_heads=4 model.head_dim=64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bench.fixtures import CONF, run_info
from base import curve, wire
from controller.config import GyreConfig, build_config
from controller.controller import cellrunner_config
from controller.processes import log_tail, spawn, stop
from base.typed_config import to_dict

WAIT_S = 120.0


def load_config(overrides: list[str]) -> GyreConfig:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        raw = compose(config_name="config", overrides=overrides)
    return build_config(OmegaConf.to_container(raw, resolve=True))


class Cells:
    """The cellrunners of one run and the ROUTER they report to."""

    def __init__(self, cfg: GyreConfig, num_cells: int, work_dir: Path):
        self.log_dir = work_dir / "logs"
        self.ctx = zmq.Context.instance()
        keys_args: list[str] = []
        if cfg.cluster.curve:  # as the controller does: fresh member keys, this process the controller
            curve.create_keys(work_dir / "keys", curve.member_names(num_cells))
            curve.install(work_dir / "keys", "controller")
            keys_args = ["--curve-keys", str(work_dir / "keys")]
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.server(self.sock)
        self.sock.bind(f"tcp://{cfg.cluster.host}:0")
        addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        cfg_path = work_dir / "cellrunner.json"
        cfg_path.write_text(json.dumps(cellrunner_config(
            cfg, checkpoint_dir=work_dir / "checkpoints", log_dir=self.log_dir)))
        self.core = cfg.cluster.core_cell
        self.procs = {
            i: spawn(f"cell{i}", "cellrunner.main",
                     ["--config-json", str(cfg_path), "--cell-id", str(i), "--controller", addr, *keys_args],
                     self.log_dir)
            for i in range(num_cells)
        }
        self.ready: dict[int, wire.CellReady] = {}
        while len(self.ready) < num_cells:
            ident, msg = self.recv(f"{num_cells - len(self.ready)} cells to start")
            if isinstance(msg, wire.CellReady):
                self.ready[msg.cell_id] = msg

    def recv(self, waiting_for: str) -> tuple[bytes, wire.Message]:
        """The next frame that is not a heartbeat or a hello; fail on errors, dead cells, silence."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for i, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"cell {i} exited ({p.returncode}):\n{log_tail(self.log_dir, f'cell{i}')}")
            if not self.sock.poll(200):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = wire.decode(frame)
            if isinstance(msg, wire.ErrorReply):
                raise RuntimeError(f"{ident.decode()}: {msg.where}: {msg.message}")
            if not isinstance(msg, (wire.Heartbeat, wire.Hello)):
                return ident, msg
        raise RuntimeError(f"nothing from the cells in {WAIT_S}s while waiting for {waiting_for}")

    def ask(self, cell_id: int, msg: wire.Message, want: type[wire.Message]) -> wire.Message:
        self.sock.send_multipart([f"cell-{cell_id}".encode(), wire.encode(msg)])
        _, reply = self.recv(f"{want.TAG} from cell {cell_id}")
        if not isinstance(reply, want):
            raise RuntimeError(f"cell {cell_id}: want {want.TAG}, got {reply.TAG}")
        return reply

    def close(self) -> None:
        for i in self.procs:
            self.sock.send_multipart([f"cell-{i}".encode(), wire.encode(wire.Shutdown(reason="bench done"))])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.1)
        stop(list(self.procs.values()))
        self.sock.close(0)
        curve.stop()
        curve.install(None, "")


def run_cycles(cells: Cells, cycles: int) -> list[wire.RoleSwitched]:
    core = cells.ready[cells.core]
    version, switches = 0, []

    def switch(cell_id: int, role: wire.Role) -> None:
        msg = wire.SwitchRole(cell_id=cell_id, role=role, weight_version=version,
                              core_weights_addr=core.weights_addr, core_grads_addrs=core.grads_addrs)
        switches.append(cells.ask(cell_id, msg, wire.RoleSwitched))

    for c in range(cycles):
        for i in cells.ready:
            switch(i, "train")
        applied = cells.ask(cells.core, wire.ApplyStep(step=version, satellite_cells=[], num_executions=1),
                            wire.StepApplied)
        version = applied.weight_version  # satellites now pull a version they have not seen
        for i in cells.ready:
            switch(i, "serve")
        this_cycle = switches[-2 * len(cells.ready):]
        print(f"cycle {c}: " + ", ".join(f"cell{s.cell_id}->{s.role} {s.total_s:.3f}s" for s in this_cycle),
              file=sys.stderr, flush=True)
    return switches


def medians(switches: list[wire.RoleSwitched], core_cell: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for role, key in (("train", "to_train_s"), ("serve", "to_serve_s")):
        mine = [s for s in switches if s.role == role]
        out[key] = statistics.median(s.total_s for s in mine)
        for who, group in (("core", [s for s in mine if s.cell_id == core_cell]),
                           ("satellites", [s for s in mine if s.cell_id != core_cell])):
            if group:
                out[f"{key}_{who}"] = statistics.median(s.total_s for s in group)
                phases = sorted({p for s in group for p in s.phases_s})
                out[f"{key}_{who}_phases"] = {
                    p: statistics.median(s.phases_s.get(p, 0.0) for s in group) for p in phases
                }
    out["n_switches"] = len(switches)
    return out


def measure(cfg: GyreConfig, num_cells: int, cycles: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        cells = Cells(cfg, num_cells, Path(tmp))
        start_s = time.monotonic() - t0
        try:
            switches = run_cycles(cells, cycles)
        finally:
            cells.close()
    return {**medians(switches, cfg.cluster.core_cell), "cells_start_s": start_s}


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 cells, 2 cycles (smoke test)")
    ap.add_argument("--cycles", type=int, default=None, help="default 10 (2 with --quick)")
    ap.add_argument("--cells", type=int, default=None, help="default 3 (2 with --quick): the core + satellites")
    ap.add_argument("--transfer", choices=["zmq", "mooncake", "both"], default=None,
                    help="default: the config's cluster.transfer")
    ap.add_argument("--curve", choices=["on", "off", "both"], default=None, help="default: the config's cluster.curve")
    ap.add_argument("overrides", nargs="*", help="Hydra-style KEY=VALUE, as for gyre")
    args = ap.parse_args(argv)
    cycles = args.cycles or (2 if args.quick else 10)
    num_cells = args.cells or (2 if args.quick else 3)
    base = load_config(args.overrides)
    transfers = [base.cluster.transfer] if args.transfer is None else (
        ["zmq", "mooncake"] if args.transfer == "both" else [args.transfer])
    curves = {None: [base.cluster.curve], "on": [True], "off": [False], "both": [False, True]}[args.curve]
    by_transfer = {}
    for t in transfers:
        for on in curves:
            label = t if len(curves) == 1 else f"{t} curve={'on' if on else 'off'}"
            cfg = load_config([*args.overrides, f"cluster.transfer={t}", f"cluster.curve={str(on).lower()}"])
            by_transfer[label] = measure(cfg, num_cells, cycles)

    m = base.model
    print(f"\n{num_cells} cells, {cycles} cycles, model {m.name} (tokenizer {m.tokenizer}, hidden {m.hidden_size}, "
          f"{m.num_hidden_layers} layers); medians of RoleSwitched.total_s", flush=True)
    print(f"{'transfer':<20} {'to_train_s':>10} {'to_serve_s':>10} {'sat to_train':>13} {'sat to_serve':>13} {'switches':>9}")
    for t, r in by_transfer.items():
        print(f"{t:<20} {r['to_train_s']:>10.3f} {r['to_serve_s']:>10.3f} {r.get('to_train_s_satellites', float('nan')):>13.3f} "
              f"{r.get('to_serve_s_satellites', float('nan')):>13.3f} {r['n_switches']:>9}")
    headline = by_transfer.get(base.cluster.transfer) or next(iter(by_transfer.values()))
    curve_cost = {}
    if len(curves) == 2:  # CURVE on over off, per transfer and role
        curve_cost = {f"{t} {key}": by_transfer[f"{t} curve=on"][key] / by_transfer[f"{t} curve=off"][key]
                      for t in transfers for key in ("to_train_s", "to_serve_s")}
    result: dict[str, object] = {
        "curve_cost": curve_cost,
        "to_train_s": headline["to_train_s"], "to_serve_s": headline["to_serve_s"],
        "n_switches": headline["n_switches"], "by_transfer": by_transfer,
        "config": {"quick": args.quick, "cycles": cycles, "cells": num_cells, "overrides": args.overrides,
                   "transfer": base.cluster.transfer, "model": to_dict(base.model)},
        **run_info(),
    }
    print(json.dumps(result, sort_keys=True), flush=True)
    return result


if __name__ == "__main__":
    main()
