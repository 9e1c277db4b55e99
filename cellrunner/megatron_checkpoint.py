"""A Megatron replica's own checkpoints: each rank's shard (parameters and Adam state, Megatron
layout) as safetensors plus one JSON manifest; the HF export is ``MegatronTrainer.weights()``.
Megatron's own ``dist_checkpointing`` pickles its metadata (``.metadata``, ``common.pt``), and
Gyre never pickles to a file.

A mixin of ``MegatronTrainer``: saving and loading read and write the replica's parameters and
optimizer state in place, so they work on the trainer's own attributes (``model``, ``optimizer``,
``version``, the parallel ranks); kept apart because the file format is one job of its own.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from base.checkpoints import META_FILE, Checkpoint
from cellrunner.megatron_setup import parallel_state

CHECKPOINT_MANIFEST = "gyre_megatron.json"
CHECKPOINT_FORMAT = 1


class MegatronCheckpoints:
    """``save_checkpoint``, ``restore`` and ``load_checkpoint`` for ``MegatronTrainer``."""

    model: Any
    optimizer: Any
    version: int
    is_core: bool

    def save_checkpoint(self, checkpoint_dir: str) -> str:
        """This version under ``<checkpoint_dir>/v<N>/``, the layout of ``base.checkpoints``:
        each rank of DP replica 0 writes its shard (parameters and Adam state) into a temporary
        folder; rank 0 adds the manifest and ``checkpoint.json`` last and renames the folder into
        place, so a job killed mid-write leaves the previous checkpoint the newest."""
        from safetensors.torch import save_file

        assert self.model is not None
        final = Path(checkpoint_dir) / f"v{self.version}"
        tmp = Path(checkpoint_dir) / f".v{self.version}.tmp"
        leader, multi = dist.get_rank() == 0, dist.get_world_size() > 1
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if multi:
            dist.barrier()
        if self.dp_rank == 0:
            tensors = {f"param/{n}": self._values(t).float().contiguous().cpu() for n, t in self._named_params().items()}
            for n, state in self._adam_state().items():
                for k, v in state.items():
                    tensors[f"{k}/{n}"] = v.float().contiguous().cpu() if v.dim() else v.reshape(1).float().cpu()
            save_file(tensors, str(tmp / self._shard_file()), metadata={"format": "pt"})
        if multi:
            dist.barrier()
        if leader:
            (tmp / CHECKPOINT_MANIFEST).write_text(json.dumps({
                "format": CHECKPOINT_FORMAT, "version": self.version, "layout": self._layout_key(),
                "has_optimizer": self.optimizer is not None}, indent=1))
            (tmp / META_FILE).write_text(json.dumps({"version": self.version, "trainer": "megatron"}))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        if multi:
            dist.barrier()
        return str(final)

    def restore(self, ckpt: Checkpoint) -> None:
        """Core only, instead of the first ``start(None)``: resume from ``save_checkpoint``'s folder."""
        assert self.is_core and self.model is None, "restore() replaces the first start()"
        self.start(None)
        self.load_checkpoint(str(ckpt.path))
        if self.version != ckpt.version:
            raise ValueError(f"{ckpt.path}: holds version {self.version}, the folder says {ckpt.version}")

    def load_checkpoint(self, directory: str) -> None:
        """Load one ``v<N>`` folder ``save_checkpoint`` wrote into a started replica of the same layout."""
        from safetensors.torch import load_file

        assert self.model is not None, "load_checkpoint before start()"
        assert not self._offloaded, "load_checkpoint while offloaded: start() brings the replica back first"
        try:
            with open(os.path.join(directory, CHECKPOINT_MANIFEST)) as f:
                manifest = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{directory}: not a Megatron checkpoint ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{CHECKPOINT_MANIFEST}: want format {CHECKPOINT_FORMAT}")
        if manifest.get("layout") != self._layout_key():
            raise ValueError(f"checkpoint layout {manifest.get('layout')} differs from this replica's "
                             f"{self._layout_key()}; reshard through the HF export (weights())")
        version = manifest.get("version")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"{CHECKPOINT_MANIFEST}: version: want an int >= 0, got {version!r}")
        tensors = load_file(os.path.join(directory, self._shard_file()))
        with torch.no_grad():
            for n, p in self._named_params().items():
                t = tensors.get(f"param/{n}")
                if t is None or tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"checkpoint shard {self._shard_file()}: {n} missing or of another shape")
                p.copy_(t.to(p.dtype))
        if self.optimizer is not None:
            if hasattr(self.optimizer, "reload_model_params"):
                self.optimizer.reload_model_params()  # fp32 main copies of bf16 weights
            self._set_adam_state(tensors)
        self.version = version

    def _adam_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam moments (and fp32 main weights under bf16) by global megatron name."""
        if self.optimizer is None:
            return {}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, (main, state) in self._optimizer_params().items():
            entry = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            if main is not None:
                entry["main"] = self._values(main).detach()
            out[name] = entry
        return out

    def _set_adam_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, (main, state) in self._optimizer_params().items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                t = tensors.get(f"{key}/{name}")
                if t is None:
                    continue
                state[key] = t.reshape(()) if key == "step" else t.to(self.device)
            if main is not None and f"main/{name}" in tensors:
                main.data.copy_(tensors[f"main/{name}"].to(main.device))

    def _optimizer_params(self) -> dict[str, tuple[torch.Tensor | None, dict]]:
        """name -> (fp32 main copy or None, the torch optimizer's state dict for it)."""
        by_id = {id(p): n for n, p in self._named_params().items()}
        out: dict[str, tuple[torch.Tensor | None, dict]] = {}
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = opt.optimizer
            if hasattr(opt, "float16_groups"):  # mixed precision: model params and fp32 mains pair up
                for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                    for p, main in zip(model_group, main_group):
                        out[by_id[id(p)]] = (main, inner.state.setdefault(main, {}))
                for group in opt.fp32_from_fp32_groups:
                    for p in group:
                        out[by_id[id(p)]] = (None, inner.state.setdefault(p, {}))
            else:
                for group in inner.param_groups:
                    for p in group["params"]:
                        out[by_id[id(p)]] = (None, inner.state.setdefault(p, {}))
        return out

    def _shard_file(self) -> str:
        return (f"tp{self.tp_rank:02d}_pp{parallel_state.get_pipeline_model_parallel_rank():02d}"
                f"_ep{self.ep_rank:02d}.safetensors")

    def _layout_key(self) -> dict[str, Any]:
        return {"tp": self.tp_size, "pp": self.cfg.pipeline_model_parallel_size,
                "ep": self.cfg.expert_model_parallel_size, "params_dtype": self.cfg.params_dtype,
                "padded_vocab_size": self.layout.padded_vocab_size, "layer_spec": self.cfg.layer_spec}
