"""sandbox=apptainer: its command line, and a real run where apptainer and a test image exist.

Apptainer is not installed on the development machine, so the command line is what is checked
everywhere; ``test_runs_confined`` runs it for real where ``apptainer`` is on PATH and
``GYRE_TEST_APPTAINER_IMAGE`` names an image with ``/usr/bin/python3``, and is skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from workloads.api import SandboxSpec
from workloads.config import SandboxConfig
from workloads.sandbox import SandboxUnavailable, make_sandbox
from tests.workloads import sandbox_config
from workloads.sandbox.apptainer import ApptainerSandbox
from workloads.sandbox.launcher import INNER_SOURCE


def _cfg(**kw) -> SandboxConfig:
    return sandbox_config("apptainer", **{"binary": "/opt/apptainer/bin/apptainer", "image": "/img/t.sif", **kw})


def _spec(tmp_path: Path, **kw) -> SandboxSpec:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    return SandboxSpec(**{"argv": ["python3", "run.py", "--flag"], "workspace": ws,
                          "env": {"PATH": "/usr/bin:/bin", "GYRE_TOKEN": "secret-token"}, **kw})


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def test_harness_command_line(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    sb = ApptainerSandbox(_cfg(ro_paths=("/shared/env",)), isolated_net=True)
    spec = _spec(tmp_path, home=home, ro_paths=(Path("/work/main/.tools/claude-code"),), proxy_port=8000)
    argv = sb.wrap(spec)
    ws = str(spec.workspace)
    assert argv[:2] == ["/opt/apptainer/bin/apptainer", "exec"]
    image_at = argv.index("/img/t.sif")
    # The image's python runs the launcher (limits, no setuid files) first, then the command.
    launcher = argv[image_at + 1:argv.index("--", image_at)]
    assert launcher[:4] == ["/usr/bin/python3", "-I", "-S", "/run/gyre/inner.py"] and "--no-setuid" in launcher
    assert argv[-3:] == ["python3", "run.py", "--flag"]
    opts = argv[2:image_at]
    assert {"--contain", "--pid", "--ipc"} <= set(opts)
    assert _pairs(opts, "--no-mount") == ["hostfs,bind-paths,cwd"]
    assert _pairs(opts, "--home") == [f"{home}:{home}"] and "--no-home" not in opts
    assert _pairs(opts, "--bind") == [f"{ws}:{ws}", "/shared/env:/shared/env:ro",
                                      "/work/main/.tools/claude-code:/work/main/.tools/claude-code:ro",
                                      f"{INNER_SOURCE}:/run/gyre/inner.py:ro"]
    assert _pairs(opts, "--pwd") == [ws]
    assert _pairs(opts, "--env") == ["PATH=/usr/bin:/bin"]
    # harnesses keep the host network: apptainer does not enforce proxy-only
    assert "--net" not in opts and "--network" not in opts
    # the token never reaches the argv, and the environment is not cleaned away
    assert not any("secret-token" in a for a in argv)
    assert "--cleanenv" not in opts and "--containall" not in opts


def test_grader_command_line_without_network(tmp_path):
    spec = _spec(tmp_path, network="none")
    argv = ApptainerSandbox(_cfg(), isolated_net=True).wrap(spec)
    assert _pairs(argv, "--network") == ["none"] and "--net" in argv
    assert "--no-home" in argv and "--home" not in argv
    assert argv.index("--net") < argv.index("/img/t.sif")


def test_falls_back_to_the_host_network_where_net_is_refused(tmp_path):
    sb = ApptainerSandbox(_cfg(), isolated_net=False)
    argv = sb.wrap(_spec(tmp_path, network="none"))
    assert "--net" not in argv and "--network" not in argv
    assert "graders ALSO on the host network" in sb.describe()
    assert "harness network NOT confined" in sb.describe()
    assert "graders without network" in ApptainerSandbox(_cfg(), isolated_net=True).describe()


def test_refuses_paths_it_cannot_bind(tmp_path):
    sb = ApptainerSandbox(_cfg(), isolated_net=True)
    with pytest.raises(ValueError, match="absolute"):
        sb.wrap(_spec(tmp_path, ro_paths=(Path("relative/tool"),)))
    with pytest.raises(ValueError, match="cannot be bound"):
        sb.wrap(_spec(tmp_path, ro_paths=(Path("/opt/a,b"),)))
    with pytest.raises(ValueError, match="cannot be bound"):
        sb.wrap(_spec(tmp_path, ro_paths=(Path("/opt/a:b"),)))
    with pytest.raises(ValueError, match="comma"):
        sb.wrap(_spec(tmp_path, env={"PATH": "/a,/b"}))


def test_no_image_is_refused():
    with pytest.raises(SandboxUnavailable, match="host's / as the image"):
        ApptainerSandbox(_cfg(image=""), isolated_net=True)
    with pytest.raises(SandboxUnavailable, match="sandbox=apptainer"):
        make_sandbox(_cfg(image=""))


def test_missing_binary_is_refused_at_start():
    with pytest.raises(SandboxUnavailable, match="no apptainer binary"):
        make_sandbox(_cfg(binary="/nonexistent/apptainer"))


IMAGE = os.environ.get("GYRE_TEST_APPTAINER_IMAGE", "")


@pytest.mark.skipif(shutil.which("apptainer") is None, reason="apptainer is not installed here")
@pytest.mark.skipif(not IMAGE, reason="GYRE_TEST_APPTAINER_IMAGE (an image with /usr/bin/python3) is not set")
def test_runs_confined(tmp_path):
    secret = tmp_path / "run" / "token"
    secret.parent.mkdir()
    secret.write_text("tok")
    sb = make_sandbox(_cfg(binary="", image=IMAGE))
    script = ("import os, pathlib; pathlib.Path('out.txt').write_text(os.environ['GYRE_TOKEN']); "
              f"print(os.path.exists({str(secret)!r}), os.getpid())")
    spec = _spec(tmp_path, argv=["/usr/bin/python3", "-c", script], network="none")
    r = subprocess.run(sb.wrap(spec), env=spec.env, cwd=spec.workspace, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    exists, pid = r.stdout.split()
    assert exists == "False" and int(pid) < 10  # the run folder is hidden; a PID namespace of its own
    assert (spec.workspace / "out.txt").read_text() == "secret-token"
