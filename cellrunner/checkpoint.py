"""Writing and reading the core's checkpoints: weights and AdamW state of one version, so a
requeued job resumes exactly. When to save and which one to resume from is the controller's
call (base.checkpoints, which also defines the folder layout).

``<checkpoint_dir>/v<N>/`` holds ``model.safetensors`` (HF names, what ``save_safetensors``
writes), ``optimizer.safetensors`` (per parameter ``<name>.exp_avg`` and ``<name>.exp_avg_sq``)
and ``checkpoint.json`` (version, AdamW step count, hyper-parameters). A checkpoint is written in
a temporary folder and renamed into place, so a job killed mid-write leaves the previous one
intact; only folders with ``checkpoint.json`` count. No pickle: safetensors and JSON only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import safetensors.numpy
import torch

from cellrunner.engine import load_safetensors, save_safetensors
from cellrunner.model import FlatWeights
from base.checkpoints import META_FILE, Checkpoint
from base.wire import TensorSpec

OPTIMIZER_FILE = "optimizer.safetensors"
log = logging.getLogger(__name__)


def save_checkpoint(
    checkpoint_dir: str | Path, weights: FlatWeights, optimizer: torch.optim.Optimizer | None,
    names: list[str],
) -> Path:
    """Write version ``weights.version`` atomically; ``names`` are the optimizer's parameters in order."""
    final = Path(checkpoint_dir) / f"v{weights.version}"
    tmp = Path(checkpoint_dir) / f".v{weights.version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_safetensors(weights, str(tmp))
    meta: dict = {"version": weights.version, "optimizer": None}
    if optimizer is not None:
        state = optimizer.state_dict()
        params = state["param_groups"][0]["params"]
        if len(state["param_groups"]) != 1 or len(params) != len(names):
            raise ValueError("save_checkpoint: want one AdamW param group covering every named parameter")
        tensors, steps = {}, []
        for index, name in zip(params, names):
            s = state["state"].get(index)
            if s is None:  # never stepped: nothing to keep
                continue
            tensors[f"{name}.exp_avg"] = s["exp_avg"].detach().cpu().numpy()
            tensors[f"{name}.exp_avg_sq"] = s["exp_avg_sq"].detach().cpu().numpy()
            steps.append(float(s["step"]))
        if tensors:
            safetensors.numpy.save_file(tensors, str(tmp / OPTIMIZER_FILE))
        group = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
        meta["optimizer"] = {
            "step": steps[0] if steps else 0.0,
            "group": {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()
                      if isinstance(v, (int, float, bool, tuple, str)) or v is None},
        }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_weights(ckpt: Checkpoint, specs: tuple[TensorSpec, ...]) -> FlatWeights:
    meta = _meta(ckpt)
    if meta.get("version") != ckpt.version:
        raise ValueError(f"{ckpt.path / META_FILE}: version {meta.get('version')!r}, folder says {ckpt.version}")
    return load_safetensors(str(ckpt.path), specs=specs, version=ckpt.version)


def load_optimizer_state(ckpt: Checkpoint, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
    """Put the checkpoint's AdamW moments and step count into ``optimizer`` (built over ``names``)."""
    meta = _meta(ckpt).get("optimizer")
    path = ckpt.path / OPTIMIZER_FILE
    if not meta or not path.is_file():
        return  # saved before the first step: a fresh optimizer is the same thing
    tensors = safetensors.numpy.load_file(str(path))
    state = optimizer.state_dict()
    params = state["param_groups"][0]["params"]
    step = float(meta["step"])
    if not (isinstance(step, float) and step >= 0):
        raise ValueError(f"{ckpt.path / META_FILE}: optimizer.step {step!r}")
    new_state = {}
    for index, name, p in zip(params, names, optimizer.param_groups[0]["params"]):
        if f"{name}.exp_avg" not in tensors:
            continue
        avg, avg_sq = tensors[f"{name}.exp_avg"], tensors.get(f"{name}.exp_avg_sq")
        if avg_sq is None or avg.shape != tuple(p.shape) or avg_sq.shape != tuple(p.shape):
            raise ValueError(f"{path}: {name} moments missing or not shaped {tuple(p.shape)}")
        new_state[index] = {
            "step": torch.tensor(step), "exp_avg": torch.from_numpy(np.array(avg)),
            "exp_avg_sq": torch.from_numpy(np.array(avg_sq)),
        }
    state["state"] = new_state
    optimizer.load_state_dict(state)
    # lr, betas, eps and weight decay come from the config (an operator may change lr on a
    # resume); say so when they are not the ones the checkpoint was trained with.
    saved = meta.get("group") or {}
    now = {k: list(v) if isinstance(v, tuple) else v for k, v in optimizer.param_groups[0].items() if k in saved}
    changed = sorted(k for k in now if now[k] != saved[k])
    if changed:
        log.warning("%s: optimizer %s from the config, not the checkpoint's (%s)", ckpt.path,
                    ", ".join(f"{k}={now[k]!r}" for k in changed), ", ".join(f"{k}={saved[k]!r}" for k in changed))


def _meta(ckpt: Checkpoint) -> dict:
    try:
        meta = json.loads((ckpt.path / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{ckpt.path / META_FILE}: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{ckpt.path / META_FILE}: want an object")
    return meta
