"""The contracts between the controller and what a run works on: tasks, harnesses, sandboxes, graders.

Standard library only, so the controller, the validator and the tests import it without torch.
Each concern lives in its own package and offers exactly what is declared here:

- ``workloads.tasksets``: a ``TaskSet`` (the run's tasks, how to lay out a workspace, how to grade it);
- ``workloads.harnesses``: a ``HarnessAdapter`` per harness kind (how to start one program);
- ``workloads.sandbox``: a ``Sandbox`` per kind (how to wrap a command so it sees only its workspace);
- ``workloads.graders``: the graders a task set calls (hidden tests, the wordmap similarity).

The controller calls only these small interfaces; it never parses a harness's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

Outcome = Literal["finished", "timed_out", "crashed"]
NetworkMode = Literal["proxy", "none", "host"]
"""``proxy``: the harness reaches the Gyre proxy and nothing else (where the sandbox can enforce it);
``none``: no network at all (graders); ``host``: the node's network (a task's ``setup_cmd`` that
its task file says may install packages)."""


class Task(Protocol):
    """One task of a task set: what the harness is asked, under a stable id."""

    @property
    def task_id(self) -> str: ...

    @property
    def prompt(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class GradeResult:
    reward: float | None
    """In [0, 1]; None when grading failed (the execution is then excluded and counted, never 0)."""
    error: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    """What the grader saw, for the report (e.g. ``{"passed": [...], "failed": [...]}``)."""


@dataclass(frozen=True, kw_only=True)
class RunArtifacts:
    """Where one execution's harness left what the grader may read besides its workspace."""

    stdout_path: Path
    stderr_path: Path
    outcome: Outcome
    grade_dir: Path
    """A folder of the grader's own, outside the workspace and never visible to the harness (the
    fresh tree the tests run in, their report, the applied patch); the grader creates it."""


@dataclass(frozen=True, kw_only=True)
class ResourceLimits:
    """What one confined command (and everything it starts) may use; 0 is no limit for that one.

    Per process (rlimits, set by the sandbox's launcher inside): ``cpu_time_s``, ``file_bytes``,
    ``open_files``, and ``memory_bytes`` as RLIMIT_DATA. Per process tree, where the node lets the
    run make cgroups: ``processes`` (pids.max) and ``memory_bytes`` (memory.max); without cgroups
    ``processes`` is RLIMIT_NPROC, which counts per user and never binds uid 0. ``tmp_bytes``: the
    size of the sandbox's private ``/tmp`` and ``/dev/shm`` (bwrap)."""

    processes: int
    memory_bytes: int
    cpu_time_s: int
    file_bytes: int
    open_files: int
    tmp_bytes: int


@dataclass(frozen=True, kw_only=True)
class SandboxSpec:
    """One command to run confined. Paths are the same inside and outside the sandbox unless an
    ``*_inside`` field or ``ro_binds`` shows one elsewhere (only where ``Sandbox.shows_fixed_paths``)."""

    argv: list[str]
    workspace: Path
    """Writable; the command's cwd."""
    env: dict[str, str]
    """The command's whole environment (nothing else is inherited)."""
    home: Path | None = None
    """A writable private folder set as ``$HOME`` (harness state: transcripts, settings)."""
    ro_paths: tuple[Path, ...] = ()
    """Extra read-only paths visible at the same path (a harness's install, a task environment)."""
    workspace_inside: Path | None = None
    """Where the command sees the workspace (its cwd); None: at ``workspace``."""
    home_inside: Path | None = None
    """Where the command sees ``home`` (its ``$HOME``); None: at ``home``."""
    ro_binds: tuple[tuple[Path, Path], ...] = ()
    """Read-only files or folders shown elsewhere: (path on this host, path inside)."""
    network: NetworkMode = "proxy"
    proxy_port: int = 0
    """With ``network=proxy``: the port the proxy listens on at 127.0.0.1, reachable inside."""
    proxy_socket: Path | None = None
    """With ``network=proxy`` in a sandbox with its own network: the proxy's Unix socket, which a
    relay inside exposes again as 127.0.0.1:``proxy_port``."""
    limits: ResourceLimits | None = None
    """Applied inside the sandbox before the command runs; None: none."""
    started_fd: int = -1
    """An inherited file descriptor (pass it in ``pass_fds``) the sandbox's launcher writes one byte
    to just before it runs the command, once every limit holds: no byte means the sandbox never
    started, a failure of the grader or the node, never of the agent. -1: not asked."""
    image: str = ""
    """``apptainer``: this command's image instead of ``sandbox.image`` (a task's environment)."""


# Where a harness sees its execution's files when the sandbox can show them anywhere. The same
# for every execution, so the harness's prompt, which names its working directory and home, is
# the same too, and the executions of a group share the engine's KV of it.
WORKSPACE_INSIDE = Path("/workspace")
HOME_INSIDE = Path("/home/agent")
PROMPT_INSIDE = Path("/run/gyre/prompt.md")


class Sandbox(Protocol):
    kind: str
    shows_fixed_paths: bool
    """Whether harness runs see the fixed paths (``WORKSPACE_INSIDE`` ...: ``sandbox.fixed_paths``
    where the kind can show a path at another place inside, ``SandboxSpec.workspace_inside``)."""

    def wrap(self, spec: SandboxSpec) -> list[str]:
        """The argv that runs ``spec.argv`` confined (Popen it with ``env=spec.env`` or the env the
        sandbox kind documents, and ``cwd=spec.workspace``)."""
        ...

    def describe(self) -> str:
        """One line for the run's log: what this sandbox enforces here."""
        ...


@dataclass(frozen=True, kw_only=True)
class HarnessLaunch:
    """What a harness adapter is told about one execution."""

    execution_id: str
    workspace: Path
    prompt_file: Path
    """The task's prompt as a file (also ``$GYRE_PROMPT_FILE``), outside the workspace."""
    home: Path
    """The execution's private writable home (``$HOME`` inside the sandbox)."""
    host_home: Path | None = None
    """Where ``home`` is on this host, for files an adapter writes before the start; None: ``home``.
    ``workspace``, ``prompt_file`` and ``home`` are the paths the harness sees."""
    host_prompt_file: Path | None = None
    """Where ``prompt_file`` is on this host, for an adapter that reads it; None: ``prompt_file``."""
    model: str
    base_url: str
    """The proxy's OpenAI base, ending in ``/v1``."""
    anthropic_base_url: str
    """The proxy's root, for ``ANTHROPIC_BASE_URL``."""
    token: str
    """The execution's bearer token; never put it on argv where a harness can take it from env."""
    max_turns: int
    """This run's (``workload.drift`` may change it by step)."""
    max_new_tokens: int
    temperature: float
    think_scale: float = 1.0
    """Multiplies the bundled harness's think time for this run (``workload.drift``)."""

    @property
    def home_on_host(self) -> Path:
        return self.host_home if self.host_home is not None else self.home

    @property
    def prompt_file_on_host(self) -> Path:
        return self.host_prompt_file if self.host_prompt_file is not None else self.prompt_file


@dataclass(frozen=True, kw_only=True)
class HarnessCommand:
    argv: list[str]
    env: dict[str, str]
    """Added to the common environment every harness gets (proxy URLs, token, prompt file)."""
    ro_paths: tuple[Path, ...] = ()
    """What the harness program needs to see read-only inside the sandbox (its install)."""


class HarnessAdapter(Protocol):
    kind: str

    def check_installed(self) -> str:
        """'' when the harness can start here; else one line saying which ``make`` target installs it."""
        ...

    def command(self, launch: HarnessLaunch) -> HarnessCommand: ...


class TaskSet(Protocol):
    name: str

    def split(self) -> tuple[list[Task], list[Task]]:
        """(train, held-out eval), deterministic for the config."""
        ...

    def prepare(self, task: Task, workspace: Path) -> None:
        """Lay out ``workspace`` (created here) for ``task``: never the original repository."""
        ...

    def grade(self, task: Task, workspace: Path, run: RunArtifacts) -> GradeResult:
        """Score what the harness left. Any failure of the grader itself is ``reward=None``."""
        ...
