"""Trajectory processor ingest: tokens per second and memory per unique token, one core.

    .venv/bin/python -m bench.processor [--small] [--executions 16] [--repeats 5] [--billing-header]

What is measured, on one group of Claude-Code-shaped executions (``bench.fixtures``) encoded as
wire frames (``base.wire.encode``), each stage timed alone and repeated (medians):

- ``decode``: ``wire.decode(frame, expect=(CallRecord, ExecutionSealed))`` for every frame
  (MessagePack + per-field validation);
- ``insert``: ``Processor.on_record`` for every decoded record (tree insertion, dedup checks);
- ``ingest``: decode + insert on a fresh processor, the two back to back per frame, i.e. what
  the service does per record minus the log;
- ``service``: ``ProcessorService.on_record_frames`` in batches of 512 (the ZMQ loop's drain
  size) with an ``AppendLog`` without fsync in a temporary directory: decode, log write, insert;
- ``assemble``: the group's seals and grades, then sampling, dedup and shard packing (the time
  from the last grade to the shards), reported in seconds, not tokens.

``tokens_per_s`` = (prompt + output tokens of all records) / ingest seconds; the same for each
stage in ``stage_tokens_per_s``. Every call re-sends its whole prompt, so this counts what the
proxy ships, which is far more than the unique tokens the trees keep.

Memory: ``bytes_per_unique_token`` = bytes ``tracemalloc`` sees still allocated after all
records are inserted into a fresh processor (trees, call infos, id sets; numpy arrays are
traced), divided by the trees' positions (``TokenTree.num_tokens``, shared prefixes once).
``tree_array_bytes_per_unique_token`` counts only the edges' numpy arrays (int32 token, int32
call, float64 logprob = 16 bytes a position). Tracing is a separate pass; it is not timed.

Left out: ZMQ, the log's fsync (``fsync=True`` in production: one per drained batch), the
controller. Single thread by construction (the processor is pure Python + numpy).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from bench.fixtures import algo_config, executions, median, preset, run_info
from base.wire import CallRecord, ExecutionSealed, Grade, decode, encode
from trajectory.delivery import ProcessorService
from trajectory.log import AppendLog
from trajectory.processor import Processor

DRAIN = 512


def processor(k: int) -> Processor:
    return Processor(algo=algo_config(max_trajectories_per_execution=k), min_usable=1, max_trajectories=k)


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--executions", type=int, default=None, help="default 16, one group (2 with --small)")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (1 with --small)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--billing-header", action="store_true", help="keep system[0] (see bench.fixtures)")
    args = ap.parse_args(argv)
    num_executions = args.executions or (2 if args.small else 16)
    repeats = args.repeats or (1 if args.small else 5)
    shape = preset(args.small, billing_header=args.billing_header)

    runs = executions(num_executions, shape)
    records = [r for recs in runs for r in recs]
    frames = [encode(r) for r in records]
    num_tokens = sum(len(r.prompt_ids) + len(r.output_ids) for r in records)
    seals = [ExecutionSealed(execution_id=recs[0].execution_id, num_calls=len(recs)) for recs in runs]
    grades = [
        Grade(execution_id=recs[0].execution_id, group_id="g0", step=0, group_size=num_executions,
              outcome="finished", reward=float(i % 3), train=True)
        for i, recs in enumerate(runs)
    ]
    print(f"{len(records)} records, {num_tokens} prompt+output tokens, {sum(map(len, frames))} frame bytes",
          file=sys.stderr, flush=True)

    expect = (CallRecord, ExecutionSealed)
    times: dict[str, list[float]] = {s: [] for s in ("decode", "insert", "ingest", "service", "assemble")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            times["decode"].append(timed(lambda: [decode(f, expect=expect) for f in frames]))
            p = processor(args.k)
            times["insert"].append(timed(lambda: [p.on_record(rec) for rec in records]))

            def finish(p: Processor = p) -> None:
                for s in seals:
                    p.on_sealed(s)
                for g in grades:
                    p.on_grade(g)

            times["assemble"].append(timed(finish))
            p = processor(args.k)
            times["ingest"].append(timed(lambda: [p.on_message(decode(f, expect=expect)) for f in frames]))
            log = AppendLog(Path(tmp) / f"log{r}", fsync=False)
            list(log.replay())
            service = ProcessorService(processor(args.k), log)
            times["service"].append(timed(
                lambda: [service.on_record_frames(frames[i : i + DRAIN]) for i in range(0, len(frames), DRAIN)]
            ))
            log.close()
            print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()),
                  file=sys.stderr, flush=True)

    memory = measure_memory(records, args.k)
    med = {k: median(v) for k, v in times.items()}
    result: dict[str, object] = {
        "tokens_per_s": num_tokens / med["ingest"],
        "bytes_per_unique_token": memory["traced_bytes"] / memory["unique_tokens"],
        "tree_array_bytes_per_unique_token": memory["array_bytes"] / memory["unique_tokens"],
        "stage_tokens_per_s": {k: num_tokens / med[k] for k in ("decode", "insert", "ingest", "service")},
        "assemble_s": med["assemble"],
        "median_s": med,
        "times_s": times,
        "memory": memory,
        "num_records": len(records),
        "num_tokens": num_tokens,
        "frame_bytes": sum(map(len, frames)),
        "config": {"shape": shape.__dict__, "executions": num_executions, "repeats": repeats, "k": args.k,
                   "drain": DRAIN, "log_fsync": False},
        **run_info(),
    }
    print(json.dumps(result, sort_keys=True), flush=True)
    return result


def measure_memory(records: list[CallRecord], k: int) -> dict[str, int]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    p = processor(k)
    for rec in records:
        p.on_record(rec)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    trees = [ex.tree for ex in p._executions.values() if ex.tree is not None]  # noqa: SLF001 (a bench looks inside)
    array_bytes = 0
    for tree in trees:
        stack = [tree.root]
        while stack:
            edge = stack.pop()
            array_bytes += edge.tokens.nbytes + edge.calls.nbytes + edge.logprobs.nbytes
            stack.extend(edge.children.values())
    return {
        "traced_bytes": held,
        "array_bytes": array_bytes,
        "unique_tokens": sum(t.num_tokens for t in trees),
        "num_trees": len(trees),
    }


if __name__ == "__main__":
    # The processor warns once per sequence over max_tokens_per_microstep; expected here.
    logging.getLogger("trajectory.samples").setLevel(logging.ERROR)
    main()
