"""``sandbox=none``: no confinement, only cwd and a clean environment. For debugging; logged loudly."""

from __future__ import annotations

from workloads.api import SandboxSpec


class NoSandbox:
    kind = "none"

    def wrap(self, spec: SandboxSpec) -> list[str]:
        return list(spec.argv)

    def describe(self) -> str:
        return ("SANDBOX OFF (sandbox=none): harnesses run as this user with every file, process and "
                "address of this node in reach")
