"""``harness=mini_swe_agent``: the pinned mini-swe-agent CLI (its own venv), over the OpenAI API.

``mini -y --exit-immediately -m openai/<model> -t <prompt>`` with the proxy as litellm's
``api_base``; cost tracking off (the model has no price), the first-run wizard skipped, its
config and trajectory kept in the execution's home.
"""

from __future__ import annotations

from pathlib import Path

from workloads.api import HarnessCommand, HarnessLaunch
from workloads.config import MiniSweAgentHarnessConfig
from workloads.harnesses.common import TOOLS_DIR, missing_binary, prompt_arg

VENV_DIR = TOOLS_DIR / "mini-swe-agent"
DEFAULT_BINARY = VENV_DIR / "bin" / "mini"


def venv_base_interpreter(venv: Path) -> Path | None:
    """The folder of the Python a venv was made from (``home`` in pyvenv.cfg): its ``bin/python``
    is a symlink there, so a sandbox must show that install too."""
    try:
        for line in (venv / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                return Path(value.strip()).parent
    except OSError:
        return None
    return None


class MiniSweAgentHarness:
    kind = "mini_swe_agent"

    def __init__(self, cfg: MiniSweAgentHarnessConfig):
        self.cfg = cfg
        self.binary = Path(cfg.binary) if cfg.binary else DEFAULT_BINARY

    def check_installed(self) -> str:
        return missing_binary(self.binary, self.kind, "mini-swe-agent")

    def command(self, launch: HarnessLaunch) -> HarnessCommand:
        c = self.cfg
        argv = [
            str(self.binary), "-y", "--exit-immediately", "-m", f"openai/{launch.model}", "-t", prompt_arg(launch),
            "-c", "mini.yaml", "-c", f"model.model_kwargs.api_base={launch.base_url}", "-c", "agent.cost_limit=0",
            "-c", f"agent.step_limit={c.step_limit}", "-o", str(launch.home / "trajectory.json"), *c.extra_args,
        ]
        # LITELLM_LOCAL_MODEL_COST_MAP: litellm otherwise fetches its price list from the internet at
        # start (three tries, ~8 s, in a sandbox where only the proxy is reachable).
        env = {"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "MSWEA_GLOBAL_CONFIG_DIR": str(launch.home / ".mini-swe-agent"), **c.env}
        venv = self.binary.resolve().parent.parent
        ro = [venv]
        base = venv_base_interpreter(venv)
        if base is not None:
            ro.append(base)
        return HarnessCommand(argv=argv, env=env, ro_paths=tuple(ro))
