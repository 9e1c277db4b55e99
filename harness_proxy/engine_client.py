"""The proxy's engine client: one call's prompt ids to an engine's native ``/generate`` (SGLang's API).

``EngineClient.generate`` picks an engine from the ``Router`` (waiting up to ``proxy.route_wait_s``
while none is serving, as cells switch), posts the prompt ids, and validates the answer
(``parse_generate_response``). On a dead, unavailable or draining engine, or one that served
weights older than the execution's token accepts, the same prompt ids go to another engine from
the (re-read) routing table, with a growing pause, up to ``proxy.retry_attempts`` engines; then a
503 ``ApiError``. A call a draining cell cut mid-decode goes on elsewhere from its prompt and the
tokens it had (``continued``): the harness gets one answer, and the record keeps each token's
behaviour log-prob and weight version as the cell that sampled it gave them. An engine's 400 is the harness's to see, not retried. A call cancelled at an
engine (a harness hung up, its execution was sealed) or not answered in time is aborted there
(``/abort_request``) in the background.

What the answer means for the execution (its records, budgets, seals) is ``harness_proxy.server``'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson

from base import engine_key, wire
from harness_proxy.config import ProxyConfig
from harness_proxy.openai_api import ApiError
from harness_proxy.routing import Router

log = logging.getLogger(__name__)

RETRY_BACKOFF_S = 0.05
"""First pause before re-routing a call; doubles per attempt up to RETRY_BACKOFF_MAX_S."""
RETRY_BACKOFF_MAX_S = 1.0
ROUTE_POLL_S = 0.05
"""How often a call with no engine to go to looks at the routing table again."""
ABORT_TIMEOUT_S = 5.0
MAX_TOKEN_ID = 2**31 - 1


class EngineUnavailable(Exception):
    """The engine did not produce a usable answer; the call may be retried elsewhere."""


@dataclass(frozen=True, slots=True)
class EngineResult:
    route: wire.EngineRoute
    output_ids: list[int]
    output_logprobs: list[float]
    weight_version: int
    finish: str
    """stop | length | abort (abort: the cell is draining; what it had generated is carried on)."""
    weight_versions: tuple[tuple[int, int, int], ...] = ()
    """(version, start, end) spans over the output positions; () = all at ``weight_version``."""

    def spans(self) -> list[wire.VersionSpan]:
        """Every output token's version as wire spans ([] for no output)."""
        if not self.output_ids:
            return []
        spans = self.weight_versions or ((self.weight_version, 0, len(self.output_ids)),)
        return [wire.VersionSpan(version=v, start=s, end=e) for v, s, e in spans]


def continued(carried: EngineResult | None, result: EngineResult) -> EngineResult:
    """``result``, the rest of a call that ``carried`` began on another cell before its drain cut it:
    their outputs, log-probs and version spans joined, the record's version the first token's."""
    if carried is None or not carried.output_ids:
        return result
    offset = len(carried.output_ids)
    spans = [*carried.spans(), *(wire.VersionSpan(version=s.version, start=s.start + offset, end=s.end + offset)
                                 for s in result.spans())]
    merged: list[tuple[int, int, int]] = []
    for s in spans:  # one span per run of one version
        if merged and merged[-1][0] == s.version:
            merged[-1] = (s.version, merged[-1][1], s.end)
        else:
            merged.append((s.version, s.start, s.end))
    return EngineResult(result.route, carried.output_ids + result.output_ids,
                        carried.output_logprobs + result.output_logprobs, carried.weight_version, result.finish,
                        tuple(merged))


class EngineCall(Protocol):
    """What the engine client reads of a planned call (``call_state.PlannedCall``)."""

    @property
    def execution_id(self) -> str: ...
    @property
    def agent(self) -> str:
        """The routing key: calls of one line stay on one engine (its prefix cache)."""
    @property
    def call_id(self) -> str:
        """The engine's request id (``rid``), by which it is aborted."""
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def sampling_params(self) -> dict[str, Any]: ...


def parse_generate_response(data: Any, route: wire.EngineRoute) -> EngineResult:
    """Validate a ``/generate`` answer; raise EngineUnavailable naming what is wrong."""
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise EngineUnavailable("response: want an object with meta_info")
    fr = meta.get("finish_reason")
    finish = fr.get("type") if isinstance(fr, dict) else fr
    if finish not in ("stop", "length", "abort"):
        raise EngineUnavailable(f"meta_info.finish_reason: want stop|length|abort, got {fr!r}")
    if finish == "abort":  # a drain cut it: what it generated, if the answer says so validly, goes on
        try:
            partial = _parse_output(data, meta, route, "abort")
        except EngineUnavailable:
            return EngineResult(route, [], [], 0, "abort")
        return partial if partial.output_ids else EngineResult(route, [], [], 0, "abort")
    return _parse_output(data, meta, route, finish)


def _parse_output(data: dict[str, Any], meta: dict[str, Any], route: wire.EngineRoute, finish: str) -> EngineResult:
    ids = data.get("output_ids")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise EngineUnavailable("output_ids: want a list of token ids")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise EngineUnavailable("meta_info.output_token_logprobs: want one entry per output id")
    logprobs = []
    for i, entry in enumerate(entries):
        lp = entry[0] if isinstance(entry, list) and len(entry) >= 2 else None
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not lp <= 1e-4 or lp != lp:
            raise EngineUnavailable(f"output_token_logprobs[{i}]: want [logprob <= 0, id, ...], got {entry!r:.60}")
        if entry[1] != ids[i]:
            raise EngineUnavailable(f"output_token_logprobs[{i}]: id {entry[1]!r} != output id {ids[i]}")
        logprobs.append(min(float(lp), 0.0))  # float rounding may leave a hair above 0
    if any(lp == float("-inf") for lp in logprobs):
        raise EngineUnavailable("output_token_logprobs: -inf")
    version = meta.get("weight_version")
    try:
        weight_version = int(version)  # SGLang reports it as a string
    except (TypeError, ValueError):
        raise EngineUnavailable(f"meta_info.weight_version: want an integer, got {version!r}") from None
    if weight_version < 0 or isinstance(version, (bool, float)):
        raise EngineUnavailable(f"meta_info.weight_version: want an integer >= 0, got {version!r}")
    return EngineResult(route, ids, logprobs, weight_version, finish,
                        _version_spans(meta.get("weight_versions"), len(ids), weight_version))


def _version_spans(spans: Any, num_output: int, weight_version: int) -> tuple[tuple[int, int, int], ...]:
    """SGLang 0.5.23's ``meta_info.weight_versions`` ([{version, start, end}], versions as strings)
    as checked spans covering the output; () when the engine sent none or all at one version."""
    if spans is None or not num_output:
        return ()
    out: list[tuple[int, int, int]] = []
    try:
        for s in spans:
            version, start, end = int(s["version"]), s["start"], s["end"]
            if type(start) is not int or type(end) is not int or version < 0 or end <= start:
                raise ValueError
            out.append((version, start, end))
    except (TypeError, KeyError, ValueError):
        raise EngineUnavailable(f"meta_info.weight_versions: want [{{version, start, end}}], got {spans!r:.80}") from None
    if (not out or out[0][1] != 0 or out[-1][2] != num_output or out[0][0] != weight_version
            or any(a[2] != b[1] for a, b in zip(out, out[1:]))):
        raise EngineUnavailable("meta_info.weight_versions: want spans covering the output, the first at weight_version")
    return () if len(out) == 1 else tuple(out)


class EngineClient:
    """Calls engines for one proxy, on its event loop: ``start`` before the first call, ``close`` last."""

    def __init__(self, cfg: ProxyConfig, router: Router, *, min_version: Callable[[str], int],
                 engine_api_key: str = ""):
        """``min_version(execution_id)``: the oldest weight version the execution's token accepts,
        read again at every attempt. ``engine_api_key``: the run's engine key (``base.engine_key``),
        sent to every engine."""
        self.cfg = cfg
        self.router = router
        self._min_version = min_version
        self._engine_api_key = engine_api_key
        self._background: set[asyncio.Task[Any]] = set()
        self._http: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.engine_timeout_s),
                                           headers=engine_key.headers(self._engine_api_key))

    async def close(self) -> None:
        """Let the aborts still on their way land (up to ABORT_TIMEOUT_S), then close the connections."""
        if self._background:
            await asyncio.wait(self._background, timeout=ABORT_TIMEOUT_S)
        if self._http is not None:
            await self._http.close()

    async def generate(self, call: EngineCall) -> EngineResult:
        """Generate on some engine: on a dead, unavailable or draining one, the same prompt ids go
        to another engine from the (re-read) routing table, up to cfg.retry_attempts engines."""
        tried: list[str] = []
        last = "no serving engine in the routing table"
        attempts = max(1, self.cfg.retry_attempts)
        carried: EngineResult | None = None  # what cells cut by their drain had generated so far
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(min(RETRY_BACKOFF_S * 2 ** (attempt - 1), RETRY_BACKOFF_MAX_S))
            route = await self._wait_for_route(call, tried)
            if route is None:
                continue
            tried.append(route.url)
            try:
                with self.router.track(route.url):
                    result = await self._engine_generate(route, call, carried)
            except EngineUnavailable as exc:
                last = f"cell {route.cell_id} ({route.url}): {exc}"
                self.router.failed(route.url)  # its other sessions move on without a failed try each
            else:
                self.router.succeeded(route.url)
                floor = self._min_version(call.execution_id)
                whole = continued(carried, result)
                if result.finish != "abort" and whole.weight_version >= floor:
                    return whole
                if result.finish == "abort":
                    last = f"cell {route.cell_id} ({route.url}) aborted the request (draining)"
                    if result.output_ids and whole.weight_version >= floor:
                        # The next cell goes on from the prompt and these tokens (its prefix's KV
                        # from the run's shared tier), each token keeping its own log-prob and version.
                        carried = whole
                        if len(carried.output_ids) >= call.sampling_params["max_new_tokens"]:
                            return EngineResult(whole.route, whole.output_ids, whole.output_logprobs,
                                                whole.weight_version, "length", whole.weight_versions)
                else:  # the table listed it too new: never hand the harness (or training) a too-stale call
                    last = f"cell {route.cell_id} ({route.url}) served weight v{result.weight_version} < v{floor}"
            log.warning(
                "call %s (execution %s) attempt %d/%d failed: %s", call.call_id, call.execution_id,
                attempt + 1, attempts, last,
            )
        raise ApiError(
            503, f"no engine could serve the call after {attempts} attempt(s): {last}",
            type="server_error", code="engine_unavailable",
        )

    async def _wait_for_route(self, call: EngineCall, tried: list[str]) -> wire.EngineRoute | None:
        """An engine for the call; while none is serving (cells mid-switch), wait for the next
        routing table up to cfg.route_wait_s, so the harness sees a slower answer, not an error."""
        deadline = asyncio.get_running_loop().time() + self.cfg.route_wait_s
        version = self.router.table.version
        while True:
            route = self.router.choose(
                call.execution_id, call.agent, exclude=tried, min_version=self._min_version(call.execution_id),
                prompt_ids=call.prompt_ids,
            )
            if route is not None or asyncio.get_running_loop().time() >= deadline:
                return route
            await asyncio.sleep(ROUTE_POLL_S)
            if self.router.table.version != version:
                version = self.router.table.version
                tried.clear()  # a new table: engines that failed before may be serving again

    async def _engine_generate(self, route: wire.EngineRoute, call: EngineCall,
                               carried: EngineResult | None = None) -> EngineResult:
        """One attempt; with ``carried``, the call's continuation after the tokens it holds."""
        assert self._http is not None, "start() first"
        input_ids, sampling = call.prompt_ids, call.sampling_params
        if carried is not None and carried.output_ids:
            input_ids = call.prompt_ids + carried.output_ids
            sampling = {**sampling, "max_new_tokens": sampling["max_new_tokens"] - len(carried.output_ids)}
        payload = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True, "rid": call.call_id}
        try:
            # orjson: a 100k-id prompt is most of the proxy's time when json.dumps encodes it.
            body = orjson.dumps(payload)
            async with self._http.post(
                f"{route.url}/generate", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                if resp.status == 400:
                    text = (await resp.text())[:500]
                    raise ApiError(400, f"the engine refused the request: {text}", code="engine_rejected")
                if resp.status != 200:
                    raise EngineUnavailable(f"HTTP {resp.status}")
                data = await resp.json(content_type=None)
        except asyncio.CancelledError:
            self._spawn(self._abort(route.url, call.call_id))
            raise
        except TimeoutError:
            self._spawn(self._abort(route.url, call.call_id))
            raise EngineUnavailable(f"no answer within {self.cfg.engine_timeout_s} s") from None
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a body that is not JSON
            raise EngineUnavailable(f"{type(exc).__name__}: {exc}") from None
        return parse_generate_response(data, route)

    async def _abort(self, url: str, rid: str) -> None:
        assert self._http is not None
        try:
            async with self._http.post(
                f"{url}/abort_request", json={"rid": rid}, timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("abort of %s on %s failed: %s", rid, url, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
