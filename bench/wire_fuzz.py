"""Random and mutated frames at every socket of a live run, as a member of it would send them.

    .venv/bin/python -m bench.wire_fuzz [--cases 10000] [--seed 0]

Starts the embedded default (``controller.main``, CURVE on) and, while it trains, throws
``--cases`` Hypothesis-generated frames at each bound socket and HTTP route of the run:

- ``controller``: the controller's ROUTER, from a connection holding the proxy's key. Each frame
  must be answered with an ``ErrorReply`` (a clear error). A frame that decodes as a valid
  ``Hello`` is not sent: saying Hello as itself is a member's right (a restarted proxy does it).
- ``records``: the processor's records ROUTER, holding the proxy's key; only frames that do not
  decode as a CallRecord or ExecutionSealed are sent (a valid one is the proxy's to send).
- ``records_foreign``: the same socket from cell 1's key, any frame: refused for its sender.
- ``grads``: the core's gradient inbox (rank 0), from the proxy's key, ``[header, payload]``
  frames built from a real gradient frame: each refused (malformed, or not the sender's cell).
- ``weights``: the core's weight server (ROUTER), from cell 1's key: each frame answered, with
  an ``ErrorReply`` or, for a valid ``PullWeights``, the weights (read-only).
- ``engine``: cell 1's engine HTTP routes (``/generate``, ``/abort_request``,
  ``/update_weights_from_disk``) with random JSON bodies, mostly with the run's engine key: never
  a 5xx; without the key (a tenth of the cases), always 401.

The proxy's HTTP routes are fuzzed in ``tests/harness_proxy/test_fuzz.py`` (a live proxy).

What is checked afterwards: every ZeroMQ frame refused is counted in its receiver's log (one line
each), the run kept training (weight versions applied in order, each once) and every process is
alive. Prints one JSON line: cases sent per target, replies, refusals counted, the versions
applied during and after the fuzz. ``tests/e2e/test_wire_fuzz.py`` runs the same with few cases.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from cellrunner.transfer import send_grads
from base import curve, engine_key, wire

ROOT = Path(__file__).resolve().parents[1]
REPLY_TIMEOUT_MS = 10_000

# ---------------------------------------------------------------- frames


def _templates() -> list[bytes]:
    """One valid frame of each kind a run's sockets see: mutations of these reach deep into
    validation (right tag and fields, one value wrong) where random bytes stop at MessagePack."""
    seq = wire.Sequence(execution_id="e", tokens=[1, 2, 3], target_mask=[0, 1, 1],
                        behaviour_logprobs=[0.0, -0.5, -0.25], advantage=0.5, token_weight=0.5)
    msgs: list[wire.Message] = [
        wire.Hello(peer="cell", cell_id=1),
        wire.CellReady(cell_id=1, engine_url="http://127.0.0.1:1", weights_addr="", grads_addrs=[], is_core=False),
        wire.Heartbeat(cell_id=1, phase="serving", num_running=0, weight_version=0),
        wire.MicrostepDone(cell_id=1, step=0, shard_id="s", num_tokens=3, loss=0.0, fb_s=0.1),
        wire.GradsSent(cell_id=1, step=0, num_shards=1),
        wire.StepApplied(cell_id=0, step=0, weight_version=1, grad_norm=1.0, apply_s=0.1),
        wire.WeightsLoaded(cell_id=1, weight_version=1, load_s=0.1),
        wire.ShardReady(shard=wire.Shard(step=0, shard_id="s", num_executions=1, sequences=[seq])),
        wire.GroupDone(group_id="g", step=0, num_usable=2, mean_reward=0.5),
        wire.CallRecord(execution_id="e", call_id="c", call_index=0, prompt_ids=[1, 2], output_ids=[3],
                        output_logprobs=[-0.5], weight_version=0, cell_id=1, finish_reason="stop",
                        started_at=1.0, finished_at=2.0),
        wire.ExecutionSealed(execution_id="e", num_calls=1),
        wire.PullWeights(min_version=0),
        wire.ErrorReply(where="fuzz", message="m"),
    ]
    return [wire.encode(m) for m in msgs]



_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=12))
_json_values = st.recursive(
    _json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)
_values = st.recursive(  # MessagePack has bytes too
    _json_scalars | st.binary(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)


def _mutate(frame: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(frame)
    for op, pos, byte in ops:
        if not buf:
            break
        i = pos % len(buf)
        if op == 0:
            buf[i] = byte
        elif op == 1:
            del buf[i:]
        elif op == 2:
            buf.insert(i, byte)
        else:
            del buf[i]
    return bytes(buf)


def _plausible(tag_and_fields: tuple[str, dict[str, Any]]) -> bytes:
    tag, body = tag_and_fields
    return msgpack.packb([wire.PROTOCOL_VERSION, tag, body], use_bin_type=True)


def _replace_fields(frame: bytes, changes: list[tuple[int, Any]]) -> bytes:
    """A valid frame with some fields' values replaced (by index among its fields) or dropped."""
    version, tag, body = msgpack.unpackb(frame, raw=False)
    names = sorted(body)
    for index, value in changes:
        name = names[index % len(names)]
        if value is _DROP:
            body.pop(name, None)
        else:
            body[name] = value
    return msgpack.packb([version, tag, body], use_bin_type=True)


_DROP = object()


def frames() -> st.SearchStrategy[bytes]:
    """Random bytes; valid frames with a few bytes changed, cut or added; valid frames with some
    fields' values replaced or dropped; frames with a real tag, its own field names (and a made-up
    one) holding random values."""
    templates = _templates()
    ops = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**16), st.integers(0, 255)), min_size=1, max_size=4)
    changes = st.lists(st.tuples(st.integers(0, 31), st.one_of(_values, st.just(_DROP))), min_size=1, max_size=3)

    def bodies(tag: str) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
        names = sorted(wire._hints(wire.MESSAGES[tag])) + ["x"]
        return st.tuples(st.just(tag), st.dictionaries(st.sampled_from(names), _values, max_size=len(names)))

    return st.one_of(
        st.binary(max_size=300),
        st.builds(_mutate, st.sampled_from(templates), ops),
        st.builds(_replace_fields, st.sampled_from(templates), changes),
        st.builds(_plausible, st.sampled_from(sorted(wire.MESSAGES)).flatmap(bodies)),
    )


def decodes_as(frame: bytes, *kinds: type[wire.Message]) -> bool:
    try:
        return isinstance(wire.decode(frame), kinds)
    except wire.ProtocolError:
        return False


# ---------------------------------------------------------------- targets


class Targets:
    """Sockets to a live run, each holding one member's key, and what each case found."""

    def __init__(self, run_dir: Path):
        ep = json.loads((run_dir / "endpoints.json").read_text())
        self.records_addr = json.loads((run_dir / "processor.ready").read_text())["records_addr"]
        self.ctx = zmq.Context()
        self.keys = run_dir / "keys"
        self.controller = self._socket("proxy", zmq.DEALER, "controller", ep["controller"], routing_id=b"fuzz")
        self.records = self._socket("proxy", zmq.DEALER, "processor", self.records_addr)
        self.records_foreign = self._socket("cell-1", zmq.DEALER, "processor", self.records_addr)
        self.grads = self._socket("proxy", zmq.PUSH, "cell-0", ep["core_grads"][0])
        self.weights = self._socket("cell-1", zmq.DEALER, "cell-0", ep["core_weights"])
        self.engine_url = ep["cells"]["1"]
        self.engine_key = engine_key.read_key(run_dir / "engine.key")
        self.sent: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self.skipped_valid: Counter[str] = Counter()
        self.http_status: Counter[str] = Counter()
        self.seconds: dict[str, float] = {}
        self.grad_frame = self._grad_frame()

    def _socket(self, member: str, kind: int, server: str, addr: str, routing_id: bytes | None = None) -> zmq.Socket:
        keys = curve.load_keys(self.keys, member)
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public_of(server))
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.connect(addr)
        return sock

    @staticmethod
    def _grad_frame() -> list[bytes]:
        class Capture:
            parts: list[bytes] = []

            def send_multipart(self, parts, **_: Any) -> None:
                self.parts = [bytes(p) for p in parts]

        cap = Capture()
        send_grads(cap, cell_id=1, step=10_000, grads=np.zeros(8, dtype=np.float32))  # type: ignore[arg-type]
        return cap.parts

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    # one case each ------------------------------------------------------------

    def to_controller(self, frame: bytes) -> None:
        if decodes_as(frame, wire.Hello):
            self.skipped_valid["controller"] += 1
            return
        self.controller.send(frame)
        self.sent["controller"] += 1
        if decodes_as(frame, wire.ErrorReply):
            self.skipped_valid["controller_error_replies"] += 1
            return  # logged by the controller, never answered (no ping-pong of errors)
        if not self.controller.poll(REPLY_TIMEOUT_MS):
            raise AssertionError(f"the controller did not answer {frame!r}")
        reply = wire.decode(self.controller.recv())
        if not (isinstance(reply, wire.ErrorReply) and reply.message):
            raise AssertionError(f"the controller answered {frame!r} with {reply!r}")
        self.answered["controller"] += 1

    def to_records(self, frame: bytes) -> None:
        if decodes_as(frame, wire.CallRecord, wire.ExecutionSealed):
            self.skipped_valid["records"] += 1
            return
        self.records.send(frame)
        self.sent["records"] += 1

    def to_records_foreign(self, frame: bytes) -> None:
        self.records_foreign.send(frame)
        self.sent["records_foreign"] += 1

    def to_grads(self, header: bytes, payload_cut: int, raw: bool) -> None:
        parts = [header] if raw else [header, self.grad_frame[1][: payload_cut % (len(self.grad_frame[1]) + 1)]]
        self.grads.send_multipart(parts)
        self.sent["grads"] += 1

    def to_weights(self, frame: bytes) -> None:
        self.weights.send(frame)
        self.sent["weights"] += 1
        if not self.weights.poll(REPLY_TIMEOUT_MS):
            raise AssertionError(f"the weight server did not answer {frame!r}")
        parts = self.weights.recv_multipart()
        head = wire.decode(parts[0])
        if not isinstance(head, (wire.ErrorReply, wire.WeightsHeader)):
            raise AssertionError(f"the weight server answered {frame!r} with {head!r}")
        self.answered["weights"] += 1

    def to_engine(self, route: str, body: bytes, with_key: bool) -> None:
        """As a member (with the run's key): any status but a 5xx other than 503. Without the
        key, as anyone on the node: 401 and nothing else."""
        headers = {"Content-Type": "application/json", **(engine_key.headers(self.engine_key) if with_key else {})}
        req = urllib.request.Request(self.engine_url + route, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status = resp.status
        except urllib.error.HTTPError as exc:
            status = exc.code
            if status >= 500 and status != 503:
                raise AssertionError(f"{route} answered {status} to {body[:200]!r}: {exc.read()[:300]!r}") from None
        if not with_key and status != 401:
            raise AssertionError(f"{route} answered {status} without the run's key")
        self.sent["engine"] += 1
        self.http_status[str(status)] += 1


def _json_bodies() -> st.SearchStrategy[bytes]:
    generate_like = st.fixed_dictionaries({}, optional={
        "input_ids": st.one_of(st.lists(st.integers(-5, 200_000), max_size=8), _json_values),
        "rid": _json_values, "sampling_params": st.one_of(_json_values, st.fixed_dictionaries({}, optional={
            "max_new_tokens": st.one_of(st.integers(-3, 4), _json_values), "temperature": _json_values})),
        "return_logprob": _json_values, "model_path": _json_values, "load_format": _json_values, "weight_version": _json_values,
    })
    return st.one_of(st.binary(max_size=200), st.builds(lambda v: json.dumps(v).encode(), st.one_of(_json_values, generate_like)))


def fuzz(targets: Targets, cases: int, seed_value: int, only: tuple[str, ...] = ()) -> None:
    """``cases`` Hypothesis examples per target (fewer only where a valid frame was skipped)."""

    def run(name: str, strategy: st.SearchStrategy, fn: Callable[..., None]) -> None:
        if only and name not in only:
            return

        t0 = time.monotonic()

        @seed(seed_value)  # a failing run is rerun as it was
        @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def case(args: tuple) -> None:
            fn(*args)

        case()
        targets.seconds[name] = round(time.monotonic() - t0, 2)

    f = frames()
    run("controller", st.tuples(f), targets.to_controller)
    run("records", st.tuples(f), targets.to_records)
    run("records_foreign", st.tuples(f), targets.to_records_foreign)
    grad_headers = st.one_of(f, st.builds(_mutate, st.just(targets.grad_frame[0]),
                                          st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**16),
                                                             st.integers(0, 255)), min_size=1, max_size=3)),
                             st.just(targets.grad_frame[0]))
    run("grads", st.tuples(grad_headers, st.integers(0, 64), st.booleans()), targets.to_grads)
    run("weights", st.tuples(f), targets.to_weights)
    run("engine", st.tuples(st.sampled_from(["/generate", "/abort_request", "/update_weights_from_disk"]),
                            _json_bodies(), st.integers(0, 9).map(lambda n: n > 0)), targets.to_engine)


def refusals(run_dir: Path) -> dict[str, int]:
    """Frames each receiver logged as refused, by the lines it writes per frame."""
    ctl = (run_dir / "controller.log").read_text(errors="replace")
    proc = (run_dir / "logs/processor.log").read_text(errors="replace")
    core = (run_dir / "logs/cell0.log").read_text(errors="replace")
    return {
        "controller": sum(ctl.count(s) for s in ("control socket: rejected frame from b'fuzz'",
                                                 "control socket: b'fuzz' speaks for cell",
                                                 "control socket: b'fuzz' sent a processor-only",
                                                 "from b'fuzz' is not a message for the controller")),
        "records": proc.count("rejected a frame on records: ") - proc.count("sent on the proxy's socket"),
        "records_foreign": proc.count("cell-1 sent on the proxy's socket"),
        "grads": core.count("rejected gradient frame"),
        "weights": core.count("weight server: rejected request"),
    }


# ---------------------------------------------------------------- the bench


def _steps(run_dir: Path) -> list[int]:
    out = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("kind") == "step":
            out.append(e["weight_version"])
    return out


def _wait(pred: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc.poll() is not None:
            raise RuntimeError(f"gyre exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.2)


def fuzz_live_run(runs: Path, cases: int, seed_value: int) -> tuple[dict[str, Any], Path]:
    """Start the embedded default under ``runs`` (steps without end), fuzz it, see it train two
    more steps, then kill it; return the figures and the run folder (left for inspection)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.main", f"run.runs_dir={runs}", "run.steps=100000",
         "run.eval_at_start=false", "workload.groups_per_step=2", "workload.group_size=4",
         "workload.min_usable_per_group=2", f"run.seed={seed_value}"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        _wait(lambda: any(p.is_dir() and not p.is_symlink() for p in runs.glob("*")), 60, "run folder", proc)
        run_dir = next(p for p in runs.glob("*") if p.is_dir() and not p.is_symlink())
        _wait(lambda: (run_dir / "endpoints.json").exists(), 300, "endpoints.json", proc)
        targets = Targets(run_dir)
        try:
            before = _steps(run_dir)
            fuzz(targets, cases, seed_value)
            during = _steps(run_dir)
            # The run goes on after the fuzz: two more steps, every process still there.
            _wait(lambda: len(_steps(run_dir)) >= len(during) + 2, 600, "two steps after the fuzz", proc)
        finally:
            targets.close()
        after = _steps(run_dir)
        time.sleep(1.0)  # the last frames' log lines
        result = {
            "cases": cases, "seed": seed_value, "sent": dict(targets.sent), "answered": dict(targets.answered),
            "skipped_valid": dict(targets.skipped_valid), "engine_status": dict(targets.http_status),
            "seconds": targets.seconds, "refusals_logged": refusals(run_dir), "steps_before": len(before),
            "steps_during_fuzz": len(during) - len(before),
            "versions_in_order_once": after == list(range(1, len(after) + 1)), "gyre_alive": proc.poll() is None,
            "wall_s": round(time.monotonic() - t0, 1),
        }
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _wait_gone(runs)
    return result, run_dir


def _wait_gone(runs: Path, timeout_s: float = 60.0) -> None:
    """Until no process names ``runs`` any more: the run's processes end by themselves once the
    controller is gone (they watch their parent), and must before the folder is removed."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(str(runs) in a for a in p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                continue
        if not left:
            return
        time.sleep(0.2)
    print(f"wire_fuzz: processes of {runs} still running after {timeout_s:.0f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000, help="Hypothesis examples per socket or route")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gyre-fuzz-", ignore_cleanup_errors=True) as tmp:
        result, _ = fuzz_live_run(Path(tmp) / "runs", args.cases, args.seed)
        print(json.dumps(result, sort_keys=True), flush=True)
    return result


if __name__ == "__main__":
    main()
