"""`gyre`: run Gyre from the Hydra config in conf/ (the embedded default unless overridden).

    gyre                                  # embedded default: 4 local cells, tiny model, bundled harness
    gyre scheduler=async run.steps=10     # any key=value or group=option override
    gyre launcher=submitit cluster=slurm  # the same run as a Slurm job, submitted through submitit
"""

from __future__ import annotations

import os
import dataclasses
import logging
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from controller.config import GyreConfig, build_config
from controller.controller import Controller, RunFailed, make_run_dir
from controller.layout import check_job
from controller.processes import StartError
from controller.report import plot_rewards, plot_roles, plot_run_lengths, plot_water_level, write_markdown, write_summary
from controller.submit import SubmititLauncherConfig, build_launcher, submit_run
from base.typed_config import ConfigError
from workloads.parts import PartsError

log = logging.getLogger("gyre")
# conf/ sits beside the packages; an absolute path works for editable installs and plain checkouts.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def run_resuming(cfg: GyreConfig) -> dict:
    """``run``, and when an attempt fails in a way a new one can get past (a dead core: the
    ``resumable`` RunFailed), a new attempt from the newest checkpoint, up to ``run.auto_resume``
    times: what an operator would do by hand, and a requeued Slurm job does."""
    for attempt in range(cfg.run.auto_resume + 1):
        try:
            return run(cfg)
        except RunFailed as exc:
            if not exc.resumable or attempt == cfg.run.auto_resume:
                raise
            run_id = getattr(exc, "run_id", "")
            log.error("gyre: run failed: %s\ngyre: resuming run %s from its newest checkpoint (%d of %d)",
                      exc, run_id, attempt + 1, cfg.run.auto_resume)
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_id=run_id, resume=True))
    raise AssertionError("unreachable")


def run(cfg: GyreConfig) -> dict:
    if cfg.cluster.kind == "slurm":  # Megatron's and SGLang's layout rules, before any step starts
        layout = check_job(cfg, os.environ)
        if layout is not None and not layout.ok:
            raise StartError(f"layout: {layout.why} (python -m controller.layout shows the whole layout)")
    run_dir = make_run_dir(cfg.run.runs_dir, cfg.run.name, cfg.run.run_id)
    logging.basicConfig(
        level=cfg.run.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(run_dir / "controller.log"), logging.StreamHandler(sys.stderr)], force=True,
    )
    log.info("gyre: run directory %s", run_dir)
    t0 = time.monotonic()
    ctl = Controller(cfg, run_dir)
    try:
        ctl.start()
        ctl.run()
    except RunFailed as exc:
        exc.run_id = run_dir.name  # type: ignore[attr-defined]  # where a new attempt resumes
        raise
    finally:
        ctl.shutdown()
    now = time.monotonic()
    evals = {r.label: r.mean() for r in ctl.evals}
    cells = list(ctl.cells.cells.values())
    summary = write_summary(
        run_dir, steps=ctl.steps.version, wall_s=now - t0, eval_start=evals.get("start"), eval_end=evals.get("end"),
        cells=cells, now=now,
        extra={"scheduler": cfg.scheduler.kind, "groups_dropped": ctl.num_groups_dropped,
               "executions_crashed": ctl.executions.num_crashed, "executions_timed_out": ctl.executions.num_timed_out,
               "grader_failures": ctl.executions.num_grade_failed, "bad_control_frames": ctl.num_bad_frames},
    )
    eval_points = [(r.at_step, r.mean()) for r in ctl.evals if r.mean() is not None]
    plot_rewards(run_dir, ctl.step_rewards, eval_points)
    plot_roles(run_dir, cells, ctl.t0, now)
    plot_water_level(run_dir)
    plot_run_lengths(run_dir)
    write_markdown(run_dir, summary)
    print(f"gyre: done in {summary['wall_s']:.1f}s; eval reward {summary['eval_reward_start']} -> "
          f"{summary['eval_reward_end']}; report in {run_dir}/report.md", flush=True)
    return summary


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(raw: DictConfig) -> None:
    resolved = OmegaConf.to_container(raw, resolve=True)
    launcher_raw = resolved.pop("launcher", None)  # how the run starts, not part of it: controller/submit.py
    try:
        cfg = build_config(resolved)
        launcher = build_launcher(launcher_raw)
    except ConfigError as exc:
        print(f"gyre: bad config: {exc}", file=sys.stderr)
        sys.exit(2)
    if isinstance(launcher, SubmititLauncherConfig):
        sys.exit(submit_run(launcher, cfg, list(HydraConfig.get().overrides.task)))
    try:
        run_resuming(cfg)
    except PartsError as exc:  # a harness not installed, no sandbox: nothing was started
        print(f"gyre: {exc}", file=sys.stderr)
        sys.exit(2)
    except (StartError, RunFailed) as exc:
        print(f"gyre: run failed: {exc}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    # Everything a run writes (checkpoints, logs, prompts, task files with gold patches and hidden
    # tests) is the run user's alone on a shared node: files 0600, folders 0700.
    os.umask(0o077)
    _hydra_main()


if __name__ == "__main__":
    main()
