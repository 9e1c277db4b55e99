"""``sandbox=apptainer``: for HPC centres where unprivileged user namespaces (and so bwrap) are off.

The command line, for one ``SandboxSpec`` (``cfg.image`` a .sif or a sandbox folder)::

    apptainer exec --contain --pid --ipc --no-mount hostfs,bind-paths,cwd --no-home | --home H:H
        --bind W:W --bind P:P:ro ... --pwd W [--env PATH=...] [--net --network none] IMAGE ARGV...

What apptainer enforces then:

- Files: the image's system, read-only; the workspace W writable and the cwd; ``spec.home`` bound
  writable and ``$HOME`` (without one, an empty private ``$HOME``); ``cfg.ro_paths`` and
  ``spec.ro_paths`` read-only; a private ``/tmp`` and minimal ``/dev`` (``--contain``). Nothing of
  the host besides: not its home, the cwd, or the site's ``bind path`` entries of apptainer.conf
  (``--no-mount bind-paths``: sites often bind /scratch or /project there, which hold run folders).
  Apptainer still mounts ``/proc`` of the new PID namespace and a read-only ``/sys``.
- Processes: its own PID and IPC namespaces: nothing outside can be seen or signalled, and when the
  container's first process ends the kernel ends the rest.
- Network: NOT confined for harnesses. ``network=proxy`` runs on the host's network (the proxy at
  127.0.0.1:``proxy_port`` as on the host), so the harness could reach anything the node reaches.
  ``network=none`` (graders) adds ``--net --network none`` where this site lets this user create a
  network namespace (probed once, see ``net_none_problem``); elsewhere graders fall back to the
  host's network too. ``describe()`` says which holds.
- Limits: the launcher (workloads/sandbox/inner.py, bound read-only, run by the image's
  ``/usr/bin/python3``) sets the rlimits, ``no_new_privs`` and the no-setuid seccomp filter first;
  ``/tmp`` has no size limit (apptainer's ``--contain`` makes it on the host).
- Environment: exactly the environment apptainer is started with (Popen it with ``env=spec.env``),
  plus apptainer's own ``APPTAINER_*`` variables; ``PATH`` is set with ``--env``, as apptainer does
  not carry the host's PATH in. ``--cleanenv`` (and so ``--containall``) is not used: it would force
  the environment onto the argv (``--env``), where the execution token would be readable by every
  user of the node in ``/proc/*/cmdline``; ``/proc/*/environ`` is the owner's only.

``image: ''`` is refused: the host's ``/`` as the image would show the run folder, the tokens and
every other workspace, which is what the sandbox exists to hide. Use ``sandbox=none`` to run
unconfined on purpose. ``--writable-tmpfs`` is not used either (it needs overlay support that many
sites lack); a harness writes in its workspace, ``$HOME`` and ``/tmp``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from workloads.api import SandboxSpec
from workloads.config import SandboxConfig
from workloads.sandbox import SandboxUnavailable
from workloads.sandbox.launcher import INNER_SOURCE, inner_argv

NO_MOUNT = "hostfs,bind-paths,cwd"
INNER_INSIDE = "/run/gyre/inner.py"
PROBE_TIMEOUT_S = 120.0  # a first run may unpack a .sif


def find_apptainer(binary: str = "") -> str:
    """``binary``, or ``apptainer`` on PATH; '' when there is none."""
    if binary:
        return binary if os.access(binary, os.X_OK) else ""
    return shutil.which("apptainer") or ""


@functools.cache
def apptainer_problem(binary: str, image: str) -> str:
    """'' when ``apptainer exec --contain IMAGE true`` runs here (tried once); else one line why not."""
    if not image:
        return ("sandbox.image is '': apptainer needs an image (a .sif or a sandbox folder); the host's / "
                "as the image would show the run folder, the tokens and other workspaces")
    found = find_apptainer(binary)
    if not found:
        return f"no apptainer binary ({binary or 'apptainer on PATH'})"
    return _probe([found, "exec", "--contain", "--pid", "--ipc", image, "true"])


@functools.cache
def net_none_problem(binary: str, image: str) -> str:
    """'' when this user may run ``--net --network none`` here (tried once); else one line why not."""
    found = find_apptainer(binary)
    if not found:
        return f"no apptainer binary ({binary or 'apptainer on PATH'})"
    return _probe([found, "exec", "--contain", "--net", "--network", "none", image, "true"])


def _probe(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]} did not run: {exc}"
    if r.returncode != 0:
        why = r.stderr.decode(errors="replace").strip().splitlines()
        return f"{' '.join(argv)}: {why[-1] if why else f'exit {r.returncode}'}"
    return ""


class ApptainerSandbox:
    kind = "apptainer"
    shows_fixed_paths = True

    def __init__(self, cfg: SandboxConfig, *, isolated_net: bool | None = None) -> None:
        """``isolated_net``: whether graders get ``--net --network none``; None probes this site once.

        Raises ``SandboxUnavailable`` when ``cfg.image`` is ''.
        """
        if not cfg.image:
            raise SandboxUnavailable(f"sandbox=apptainer: {apptainer_problem(cfg.binary, cfg.image)}")
        self.shows_fixed_paths = cfg.fixed_paths
        self.binary = find_apptainer(cfg.binary) or cfg.binary or "apptainer"
        self.image = cfg.image
        self.ro_paths = tuple(Path(p) for p in cfg.ro_paths)
        if isolated_net is None:
            isolated_net = net_none_problem(cfg.binary, cfg.image) == ""
        self.isolated_net = isolated_net

    def wrap(self, spec: SandboxSpec) -> list[str]:
        """The apptainer command line for ``spec``; Popen it with ``env=spec.env`` (see the module doc).

        Raises ``ValueError`` for a relative path, or one holding ``:`` or ``,`` (apptainer's bind
        syntax cannot carry them).
        """
        ro_paths = (*self.ro_paths, *spec.ro_paths)
        _check_paths(spec.workspace, *ro_paths, *([spec.home] if spec.home else []))
        _check_paths(*(p for bind in spec.ro_binds for p in bind),
                     *(p for p in (spec.workspace_inside, spec.home_inside) if p is not None))
        ws, ws_inside = str(spec.workspace), str(spec.workspace_inside or spec.workspace)
        argv = [self.binary, "exec", "--contain", "--pid", "--ipc", "--no-mount", NO_MOUNT]
        argv += ["--home", f"{spec.home}:{spec.home_inside or spec.home}"] if spec.home is not None else ["--no-home"]
        argv += ["--bind", f"{ws}:{ws_inside}"]
        for path in ro_paths:
            argv += ["--bind", f"{path}:{path}:ro"]
        for host, inside in spec.ro_binds:
            argv += ["--bind", f"{host}:{inside}:ro"]
        argv += ["--bind", f"{INNER_SOURCE}:{INNER_INSIDE}:ro", "--pwd", ws_inside]
        path_var = spec.env.get("PATH")
        if path_var:
            if "," in path_var:
                raise ValueError(f"sandbox=apptainer: PATH with a comma cannot pass --env: {path_var!r}")
            argv += ["--env", f"PATH={path_var}"]
        if spec.network == "none" and self.isolated_net:
            argv += ["--net", "--network", "none"]
        launcher = inner_argv("/usr/bin/python3", INNER_INSIDE, spec, nproc=False)
        return [*argv, spec.image or self.image, *launcher, *spec.argv]

    def describe(self) -> str:
        graders = ("graders without network (--net --network none)" if self.isolated_net else
                   "graders ALSO on the host network (this site refuses --net --network none)")
        return (f"sandbox=apptainer ({self.binary}, image {self.image}): image system, writable workspace and "
                f"home, private /tmp, PID/IPC namespaces; harness network NOT confined (host network, the "
                f"proxy-only rule is not enforced by apptainer); {graders}")


def _check_paths(*paths: Path) -> None:
    for p in paths:
        if not p.is_absolute():
            raise ValueError(f"sandbox=apptainer: want an absolute path, got {str(p)!r}")
        if ":" in str(p) or "," in str(p):
            raise ValueError(f"sandbox=apptainer: a path with ':' or ',' cannot be bound: {str(p)!r}")
