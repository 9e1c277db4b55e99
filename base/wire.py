"""Every message that crosses a Gyre process, and the one way to encode and decode it.

A frame is MessagePack ``[PROTOCOL_VERSION, tag, {field: value}]``. Decoding unpacks, looks the
tag up in a closed table, checks every field's type (and the ranges a message declares in its
``check``), and builds a frozen dataclass. Anything else raises ``ProtocolError`` naming the
message and the field. Nothing on the wire chooses which code runs: tags map to these classes
only. This module imports only the standard library and msgpack, so every package may use it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 256 * 1024 * 1024
MAX_CELL_SERVERS = 4096
"""The most servers one cell may name (a 48-node cell of 8 one-GPU servers a node runs 384)."""


class ProtocolError(ValueError):
    """A frame that is not a valid Gyre message; the text names the message and the field."""


Role = Literal["serve", "train"]
# The phases of a cell, in the order a cell walks them (the elastic-cells issue times each one).
CellPhase = Literal["starting", "serving", "draining", "to_train", "training", "to_serve", "dead"]
Outcome = Literal["finished", "timed_out", "crashed"]
FinishReason = Literal["stop", "length", "abort"]
Lineage = Literal["main", "main-summary", "sub-agent", "sub-agent-summary", "side"]
WeightsDtype = Literal["float32", "bfloat16"]
WEIGHT_ITEMSIZE = {"float32": 4, "bfloat16": 2}
WEIGHT_NUMPY_DTYPE = {"float32": "<f4", "bfloat16": "<u2"}  # bf16 travels and is held as its raw 16 bits
PeerKind = Literal["cell", "proxy", "processor"]


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name}: want a finite number, got {value!r}")


def _non_negative(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name}: want >= 0, got {value!r}")


def _addresses(name: str, addrs: list[str]) -> None:
    for i, a in enumerate(addrs):
        if not a.startswith("tcp://"):
            raise ValueError(f"{name}[{i}]: want a tcp:// address, got {a!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    TAG: ClassVar[str] = ""

    def check(self) -> None:
        """Range checks beyond types; raise ValueError('field: why')."""


# ---------------------------------------------------------------- control plane: peers -> controller


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """First frame of every DEALER peer, so the controller knows who sits behind an identity."""

    TAG: ClassVar[str] = "hello"
    peer: PeerKind
    cell_id: int = -1
    pid: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CellReady(Message):
    """A cellrunner is up; its engine and weight/gradient endpoints are reachable."""

    TAG: ClassVar[str] = "cell_ready"
    cell_id: int
    engine_url: str
    weights_addr: str
    grads_addrs: list[str]
    """The core's ranks' gradient inboxes, in rank order (``cellrunner.grads``); [] elsewhere."""
    is_core: bool
    rank_weights_addrs: list[str] = field(default_factory=list)
    """A multi-rank core's ranks' own-shard publishers, in rank order (``cellrunner.rank_weights``)."""
    weight_version: int = 0
    """The version the cell starts with: 0, or the checkpoint's the controller resumed the core from."""
    weights_digest: str = ""
    """``cellrunner.model.weights_digest`` of the weights the cell's engine starts from: every cell
    that starts at one version must start from the same bytes ("" from a cell that did not hash)."""
    engine_urls: list[str] = field(default_factory=list)
    """Every server the cell serves through, ``engine_url`` first (``cellrunner.servers``: a cell
    larger than one SGLang server runs several); [] from a cell that names only ``engine_url``."""

    def serving_urls(self) -> list[str]:
        return list(self.engine_urls) or [self.engine_url]

    def check(self) -> None:
        _non_negative(cell_id=self.cell_id, weight_version=self.weight_version)
        if len(self.weights_digest) > 128:
            raise ValueError("weights_digest: over 128 characters")
        if len(self.engine_urls) > MAX_CELL_SERVERS:
            raise ValueError(f"engine_urls: {len(self.engine_urls)} servers, over {MAX_CELL_SERVERS}")
        for i, url in enumerate(self.engine_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine_urls[{i}]: want an http:// URL, got {url!r}")
        if len(set(self.engine_urls)) != len(self.engine_urls):
            raise ValueError("engine_urls: a server is named twice")
        if self.engine_urls and self.engine_urls[0] != self.engine_url:
            raise ValueError(f"engine_urls[0]: want engine_url {self.engine_url!r} first, got {self.engine_urls[0]!r}")
        _addresses("grads_addrs", self.grads_addrs)
        _addresses("rank_weights_addrs", self.rank_weights_addrs)
        if self.is_core and not self.grads_addrs:
            raise ValueError("grads_addrs: the core names one inbox per rank, got none")


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    TAG: ClassVar[str] = "heartbeat"
    cell_id: int
    phase: CellPhase
    num_running: int
    weight_version: int
    rss_bytes: int = 0
    down_urls: list[str] = field(default_factory=list)
    """The cell's servers that stopped answering (a dead or hung SGLang server): the controller
    leaves them out of the routing table until a later heartbeat no longer names them."""

    def check(self) -> None:
        _non_negative(cell_id=self.cell_id, num_running=self.num_running)
        if len(self.down_urls) > MAX_CELL_SERVERS:
            raise ValueError(f"down_urls: {len(self.down_urls)} servers, over {MAX_CELL_SERVERS}")
        for i, url in enumerate(self.down_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"down_urls[{i}]: want an http:// URL, got {url!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceHeartbeat(Message):
    """The processor or the proxy is alive and its loop turns (sent every heartbeat interval): the
    controller kills one silent for ``cluster.heartbeat_timeout_s``, as it drops a silent cell."""

    TAG: ClassVar[str] = "service_heartbeat"
    peer: Literal["processor", "proxy"]
    pid: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleSwitched(Message):
    """A switch finished; ``phases_s`` times each phase walked (drain, release, start, load...)."""

    TAG: ClassVar[str] = "role_switched"
    cell_id: int
    role: Role
    weight_version: int
    total_s: float
    phases_s: dict[str, float] = field(default_factory=dict)

    def check(self) -> None:
        _finite("total_s", self.total_s)
        _non_negative(total_s=self.total_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class MicrostepDone(Message):
    TAG: ClassVar[str] = "microstep_done"
    cell_id: int
    step: int
    shard_id: str
    num_tokens: int
    loss: float
    fb_s: float
    mean_ratio: float = 1.0
    """Mean GSPO sequence ratio s_i of the microstep's sequences (1 = on-policy)."""
    clip_fraction: float = 0.0
    """Share of sequences whose clipped term was the smaller (their gradient is cut)."""
    kl: float | None = None
    """KL(behaviour || current) per policy token (k3 estimator); None where the trainer does not measure it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GradsSent(Message):
    """A satellite pushed its gradient sum for ``step`` to the core."""

    TAG: ClassVar[str] = "grads_sent"
    cell_id: int
    step: int
    num_shards: int
    late_loss: float = 0.0
    """The loss of run-released shards, known only now that their groups' advantages are."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepApplied(Message):
    TAG: ClassVar[str] = "step_applied"
    cell_id: int
    step: int
    weight_version: int
    grad_norm: float
    apply_s: float
    late_loss: float = 0.0
    """The loss of the core's run-released shards (see ``GradsSent.late_loss``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsLoaded(Message):
    TAG: ClassVar[str] = "weights_loaded"
    cell_id: int
    weight_version: int
    load_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply(Message):
    """Sent back to whoever sent a frame that could not be decoded or obeyed."""

    TAG: ClassVar[str] = "error"
    where: str
    message: str


# ---------------------------------------------------------------- control plane: controller -> cells


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchRole(Message):
    TAG: ClassVar[str] = "switch_role"
    cell_id: int
    role: Role
    weight_version: int
    core_weights_addr: str
    core_grads_addrs: list[str]
    """The core's ranks' gradient inboxes, in rank order: rank r of a satellite sends to the r-th."""
    core_rank_weights_addrs: list[str] = field(default_factory=list)
    """A multi-rank core's ranks' own shards, in rank order: rank r of a satellite pulls the r-th."""

    def check(self) -> None:
        _addresses("core_grads_addrs", self.core_grads_addrs)
        _addresses("core_rank_weights_addrs", self.core_rank_weights_addrs)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadWeights(Message):
    """Serving cell: pull ``weight_version`` from the core and load it into the engine."""

    TAG: ClassVar[str] = "load_weights"
    weight_version: int
    core_weights_addr: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Sequence(Message):
    """One training sequence: context and policy tokens, aligned per position.

    ``target_mask[i]`` is 1 where ``tokens[i]`` was generated by the policy and is a training target
    in this shard; ``behaviour_logprobs[i]`` is its log-probability under the behaviour policy (0
    elsewhere). ``token_weight`` is 1 / (policy tokens of the execution), so summing
    ``token_weight * loss_t`` over an execution's tokens gives its per-execution mean.
    """

    TAG: ClassVar[str] = "sequence"
    execution_id: str
    tokens: list[int]
    target_mask: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    token_weight: float

    def check(self) -> None:
        n = len(self.tokens)
        if len(self.target_mask) != n or len(self.behaviour_logprobs) != n:
            raise ValueError("tokens/target_mask/behaviour_logprobs: lengths differ")
        if n < 2:
            raise ValueError("tokens: want at least 2")
        if self.target_mask[0]:
            raise ValueError("target_mask: the first token cannot be a target")
        _finite("advantage", self.advantage)
        _finite("token_weight", self.token_weight)
        _non_negative(token_weight=self.token_weight)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard(Message):
    """A microstep's data: whole executions of one step, complete and advantage-weighted.

    A *run-released* shard (``reward`` set, ``algo.release=run``) holds one execution, sent as
    soon as it is graded, before its group's advantages exist: its sequences carry advantage 0,
    ``reward`` is the execution's, and the cell keeps its gradient apart until ``GroupStats``
    for ``group_id`` turns the reward into the advantage (see ``cellrunner.run_release``).
    """

    TAG: ClassVar[str] = "shard"
    step: int
    shard_id: str
    num_executions: int
    sequences: list[Sequence]
    group_id: str = ""
    reward: float | None = None

    @property
    def run_released(self) -> bool:
        return self.reward is not None

    def check(self) -> None:
        _non_negative(step=self.step, num_executions=self.num_executions)
        if self.reward is None:
            return
        _finite("reward", self.reward)
        if not self.group_id:
            raise ValueError("group_id: a run-released shard names its group")
        if self.num_executions > 1 or len({s.execution_id for s in self.sequences}) > 1:
            raise ValueError("sequences: a run-released shard holds exactly one execution")
        if any(s.advantage != 0.0 for s in self.sequences):
            raise ValueError("sequences: a run-released shard's advantages are 0 until its group closes")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupStats(Message):
    """What turns a group's rewards into advantages: ``A = (reward - mean_reward) / adv_divisor``,
    0 for every member when ``adv_divisor`` is 0 (equal rewards). ``dropped``: the group is not
    trained; gradients kept for its run-released shards are thrown away."""

    TAG: ClassVar[str] = "group_stats"
    group_id: str
    mean_reward: float
    adv_divisor: float
    dropped: bool = False

    def check(self) -> None:
        _finite("mean_reward", self.mean_reward)
        _finite("adv_divisor", self.adv_divisor)
        _non_negative(adv_divisor=self.adv_divisor)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunMicrostep(Message):
    TAG: ClassVar[str] = "run_microstep"
    shard: Shard


@dataclass(frozen=True, slots=True, kw_only=True)
class SendGrads(Message):
    """Satellite: push the summed gradients of ``step`` to the core, then forget them."""

    TAG: ClassVar[str] = "send_grads"
    step: int
    groups: list[GroupStats] = field(default_factory=list)
    """Every group of the step, closed: the cell folds its run-released gradients in first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyStep(Message):
    """Core: add the satellites' gradients to its own, divide by executions, take an AdamW step."""

    TAG: ClassVar[str] = "apply_step"
    step: int
    satellite_cells: list[int]
    """The satellites whose gradients count (their ``GradsSent`` arrived). Any other gradient of
    this step is left out: a satellite lost after sending had its shards trained again elsewhere."""
    num_executions: int
    checkpoint: bool = False
    """Then save the new version's weights and optimizer state (the controller's checkpoint policy)."""
    groups: list[GroupStats] = field(default_factory=list)
    """As ``SendGrads.groups``: the core folds its own run-released gradients in before applying."""

    def check(self) -> None:
        for c in self.satellite_cells:
            _non_negative(satellite_cells=c)
        if len(set(self.satellite_cells)) != len(self.satellite_cells):
            raise ValueError(f"satellite_cells: a cell named twice in {self.satellite_cells}")
        if self.num_executions < 1:
            raise ValueError("num_executions: want >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Message):
    TAG: ClassVar[str] = "shutdown"
    reason: str = ""


# ---------------------------------------------------------------- controller <-> proxy, processor


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRoute(Message):
    TAG: ClassVar[str] = "engine_route"
    cell_id: int
    url: str
    weight_version: int = 0
    """The weights the cell serves (a lower bound: it never serves older ones once listed)."""

    def check(self) -> None:
        _non_negative(cell_id=self.cell_id, weight_version=self.weight_version)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingTable(Message):
    """The serving engines the proxy may send calls to; a newer ``version`` replaces an older one."""

    TAG: ClassVar[str] = "routing_table"
    version: int
    engines: list[EngineRoute]


@dataclass(frozen=True, slots=True, kw_only=True)
class SealExecution(Message):
    """The harness run is over: revoke its token and tell the processor how many calls it made."""

    TAG: ClassVar[str] = "seal_execution"
    execution_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Grade(Message):
    """An execution's outcome. ``reward`` is None when grading failed: excluded, never 0."""

    TAG: ClassVar[str] = "grade"
    execution_id: str
    group_id: str
    step: int
    group_size: int
    outcome: Outcome
    reward: float | None
    train: bool = True

    def check(self) -> None:
        if self.group_size < 1:
            raise ValueError("group_size: want >= 1")
        if self.reward is not None:
            _finite("reward", self.reward)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardReady(Message):
    TAG: ClassVar[str] = "shard_ready"
    shard: Shard


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupDone(Message):
    """The processor finished a group: its shard went out, or it was dropped (``dropped`` says why)."""

    TAG: ClassVar[str] = "group_done"
    group_id: str
    step: int
    num_usable: int
    mean_reward: float | None
    dropped: str = ""
    adv_divisor: float = 0.0
    """std + adv_eps of the usable rewards (``base.advantages.group_stats``); 0 when every
    advantage is 0. With ``mean_reward`` it makes a group's advantages from its members' rewards."""


# ---------------------------------------------------------------- data plane: proxy -> processor


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionMessage(Message):
    """One message as the proxy's sessions compare it (``harness_proxy.session_messages.normalize_message``):
    role, text, and each tool call as ``[name, arguments as canonical JSON]``."""

    TAG: ClassVar[str] = "session_message"
    role: str
    content: str
    tool_calls: list[list[str]] = field(default_factory=list)

    def check(self) -> None:
        if any(len(c) != 2 for c in self.tool_calls):
            raise ValueError("tool_calls: want [name, arguments] pairs")


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionEntry(Message):
    """What the proxy's SessionStore remembered of one call, carried on its CallRecord, so a
    restarted proxy remembers the call again exactly (``harness_proxy.sessions``): the call's
    messages are those of ``base_call_id`` (its request and reply) followed by ``new_messages``."""

    TAG: ClassVar[str] = "session_entry"
    base_call_id: str
    """The remembered call this prompt was spliced onto ("" when rendered from scratch)."""
    base_length: int
    """How many of this call's ``prompt_ids`` are the base call's remembered ids (0 without a base)."""
    new_messages: list[SessionMessage]
    reply: SessionMessage
    tools_json: str | None = None
    """The request's tools as canonical JSON; None: the same as the base call's."""
    line: str
    """The session key of the call's line ("" main, ``sub-<n>``, ``side-<n>``, or the harness's agent id)."""
    line_lineage: Lineage
    line_task_len: int
    """Messages in the first request of the call's line."""
    reply_tool_ids: list[str] = field(default_factory=list)
    """The ids the proxy gave the reply's tool calls (Anthropic ``toolu_...``): a harness echoes them,
    and the restarted proxy must know them as its own."""

    def check(self) -> None:
        _non_negative(base_length=self.base_length, line_task_len=self.line_task_len)
        if self.base_call_id and not self.base_length:
            raise ValueError("base_length: want > 0 with a base call")


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionSpan(Message):
    """Output positions [start, end) of one call sampled under one weight version (SGLang's
    ``meta_info.weight_versions`` entry): a call can outlive a weight update, or be cut by a
    cell's drain and continue on another cell."""

    TAG: ClassVar[str] = "version_span"
    version: int
    start: int
    end: int

    def check(self) -> None:
        _non_negative(version=self.version, start=self.start)
        if self.end <= self.start:
            raise ValueError(f"end: want > start ({self.start}), got {self.end}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CallRecord(Message):
    """One model call, token-in/token-out, exactly as the engine saw and produced it."""

    TAG: ClassVar[str] = "call_record"
    schema: int = 1
    execution_id: str
    call_id: str
    call_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    weight_version: int
    cell_id: int
    finish_reason: FinishReason
    lineage: Lineage = "main"
    agent_id: str = ""
    started_at: float
    finished_at: float
    num_tool_calls: int = 0
    """Tool calls the proxy parsed out of the output (for per-execution facts; never for training)."""
    temperature: float = 1.0
    """What the engine sampled at (0: greedy), with ``top_p`` and ``top_k`` (-1: all): for a training
    execution the run's ``algo.rollout``, which the trainer scores at; the behaviour log-probs are
    log_softmax(logits / temperature) over the whole vocabulary."""
    top_p: float = 1.0
    top_k: int = -1
    harness_temperature: float = 1.0
    """What the harness asked for (its default when it named none), kept beside what was used."""
    harness_top_p: float = 1.0
    lineage_reason: str = ""
    """Why the call got its ``lineage`` (``harness_proxy.lineage.REASONS``): the rule that decided it,
    and whether a harness-specific hint (a header, a summary marker) did."""
    session: SessionEntry | None = None
    """What the proxy's sessions remembered of the call (None for a call that produced nothing)."""
    weight_versions: list[VersionSpan] = field(default_factory=list)
    """The weight version of every output token, as spans covering the output in order, the first
    at ``weight_version``; [] = every token at ``weight_version``."""

    def check(self) -> None:
        if len(self.lineage_reason) > 64:
            raise ValueError("lineage_reason: over 64 characters")
        if self.session is not None and self.session.base_length >= len(self.prompt_ids) + 1:
            raise ValueError("session.base_length: longer than the prompt")
        if self.num_tool_calls < 0:
            raise ValueError("num_tool_calls: want >= 0")
        for name in ("temperature", "harness_temperature"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}: want a finite number >= 0")
        if not (0 < self.top_p <= 1 and 0 < self.harness_top_p <= 1):
            raise ValueError("top_p, harness_top_p: want (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError("top_k: want -1 (all) or >= 1")
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError("output_logprobs: want one per output token")
        if not self.prompt_ids:
            raise ValueError("prompt_ids: empty")
        _non_negative(call_index=self.call_index, weight_version=self.weight_version)
        for lp in self.output_logprobs:
            if not (lp <= 0.0 and math.isfinite(lp)):
                raise ValueError(f"output_logprobs: want finite values <= 0, got {lp!r}")
        if self.weight_versions:
            spans = self.weight_versions
            if spans[0].start != 0 or spans[-1].end != len(self.output_ids) or any(
                a.end != b.start for a, b in zip(spans, spans[1:])
            ):
                raise ValueError("weight_versions: want spans covering the output in order")
            if spans[0].version != self.weight_version:
                raise ValueError("weight_versions: the first span's version is not weight_version")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionFacts(Message):
    """What one execution did, from its CallRecords: the processor sends it to the controller once
    the execution is graded and sealed (metrics.jsonl ``execution_facts``, the report)."""

    TAG: ClassVar[str] = "execution_facts"
    execution_id: str
    num_calls: int
    main_calls: int
    """Turns of the main agent."""
    summary_calls: int
    """Compactions: main-summary and sub-agent-summary calls."""
    sub_agent_calls: int
    side_calls: int
    hung_up_calls: int
    num_sub_agents: int
    prompt_tokens: int
    """Summed over calls (a long session re-sends its history each call)."""
    output_tokens: int
    tool_calls: int
    tree_tokens: int = 0
    """Tokens left in the execution's call tree after shared prefixes are merged (0 for eval runs):
    prompt_tokens + output_tokens - tree_tokens is what deduplication saved."""
    call_s_sum: float = 0.0
    """Seconds the proxy spent on the execution's calls, engine included (started_at to finished_at)."""
    call_s_max: float = 0.0
    staleness_mean: float = 0.0
    """Mean over calls of (the step trained on) - (the weight version that sampled the call)."""
    staleness_max: int = 0
    main_output_tokens: int = 0
    """Output tokens of the main agent's calls (summaries included)."""
    untrained_output_tokens: int = 0
    """Output tokens never trained because of their calls' label (``side``): the policy wrote them,
    no gradient sees them."""
    lineage_reasons: dict[str, int] = field(default_factory=dict)
    """Calls by the reason their label was given (``CallRecord.lineage_reason``)."""

    def check(self) -> None:
        _non_negative(**{f: getattr(self, f) for f in (
            "num_calls", "main_calls", "summary_calls", "sub_agent_calls", "side_calls", "hung_up_calls",
            "num_sub_agents", "prompt_tokens", "output_tokens", "tool_calls", "tree_tokens", "call_s_sum",
            "call_s_max", "main_output_tokens", "untrained_output_tokens")})
        if len(self.lineage_reasons) > 64:
            raise ValueError("lineage_reasons: over 64 reasons")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionSealed(Message):
    """Sent by the proxy after the last CallRecord of an execution, on the same socket."""

    TAG: ClassVar[str] = "execution_sealed"
    execution_id: str
    num_calls: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordsAck(Message):
    """The processor -> the proxy: these CallRecords and seals are in its log (durable), so the
    proxy may forget them. Entry i names ``execution_ids[i]`` and ``call_ids[i]`` (``""`` for the
    execution's ``ExecutionSealed``)."""

    TAG: ClassVar[str] = "records_ack"
    execution_ids: list[str]
    call_ids: list[str]

    def check(self) -> None:
        if len(self.execution_ids) != len(self.call_ids):
            raise ValueError("call_ids: want one per execution id")


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionReplayRequest(Message):
    """The proxy -> the processor, on the records socket: send me the logged CallRecords of this
    execution (a proxy that restarted rebuilds its sessions from them before answering its next call)."""

    TAG: ClassVar[str] = "session_replay_request"
    execution_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionReplayEnd(Message):
    """The processor -> the proxy: the execution's logged CallRecords went out before this one, as
    logged, ``num_records`` of them; ``sealed``: the execution is sealed (its token must be refused)."""

    TAG: ClassVar[str] = "session_replay_end"
    execution_id: str
    num_records: int
    sealed: bool = False

    def check(self) -> None:
        _non_negative(num_records=self.num_records)


def record_key(msg: CallRecord | ExecutionSealed) -> tuple[str, str]:
    """What ``RecordsAck`` names a record or a seal by (the processor deduplicates by it too)."""
    return (msg.execution_id, msg.call_id if isinstance(msg, CallRecord) else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivered(Message):
    """The controller -> the processor: it took these shards and these groups' ``GroupDone``
    (deduplicated by id on its side), so the processor logs them as delivered and never sends
    them again, even after a restart."""

    TAG: ClassVar[str] = "delivered"
    shard_ids: list[str] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- data plane: weights and gradients


@dataclass(frozen=True, slots=True, kw_only=True)
class PullWeights(Message):
    TAG: ClassVar[str] = "pull_weights"
    min_version: int
    dtype: WeightsDtype = "float32"
    """``bfloat16``: the serving copy (half the bytes), for an engine that serves in bf16; a
    trainer starts from ``float32``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec(Message):
    TAG: ClassVar[str] = "tensor_spec"
    name: str
    shape: list[int]
    offset: int  # in elements of the flat float32 buffer

    def check(self) -> None:
        _non_negative(offset=self.offset)
        for d in self.shape:
            _non_negative(shape=d)


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsHeader(Message):
    """Precedes a raw little-endian buffer of ``dtype`` (bfloat16 as its raw 16 bits) holding every
    tensor back to back."""

    TAG: ClassVar[str] = "weights_header"
    weight_version: int
    num_elements: int
    tensors: list[TensorSpec]
    dtype: WeightsDtype = "float32"


@dataclass(frozen=True, slots=True, kw_only=True)
class GradsHeader(Message):
    TAG: ClassVar[str] = "grads_header"
    cell_id: int
    step: int
    num_elements: int
    rank: int = 0
    """The sending rank of the satellite; it goes to the same rank of the core."""

    def check(self) -> None:
        _non_negative(cell_id=self.cell_id, step=self.step, num_elements=self.num_elements, rank=self.rank)


# ---------------------------------------------------------------- Mooncake weight pull (cellrunner.transfer_mooncake)


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsOffer(Message):
    """Where ``weight_version`` lies: ``num_elements`` of ``dtype`` at ``remote_addr`` in the core's
    Mooncake segment ``session_id`` (``host:rpc_port``), slot ``slot`` at ``generation``."""

    TAG: ClassVar[str] = "weights_offer"
    weight_version: int
    num_elements: int
    tensors: list[TensorSpec]
    session_id: str
    remote_addr: int
    slot: int
    generation: int
    dtype: WeightsDtype = "float32"

    def check(self) -> None:
        if self.num_elements < 1:
            raise ValueError(f"num_elements: want >= 1, got {self.num_elements}")
        if self.remote_addr <= 0:
            raise ValueError(f"remote_addr: want a positive address, got {self.remote_addr}")
        if self.slot not in (0, 1):
            raise ValueError(f"slot: want 0 or 1, got {self.slot}")
        if self.generation < 1:
            raise ValueError(f"generation: want >= 1, got {self.generation}")
        host, _, port = self.session_id.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"session_id: want host:port, got {self.session_id!r}")
        offset = 0  # the manifest must tile the buffer exactly, or load_flat would read garbage
        for spec in self.tensors:
            if spec.offset != offset:
                raise ValueError(f"tensors: {spec.name} starts at {spec.offset}, want {offset}")
            offset += math.prod(spec.shape)
        if offset != self.num_elements:
            raise ValueError(f"tensors: cover {offset} elements, num_elements says {self.num_elements}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckSlot(Message):
    """After a read: was ``slot`` left alone since it was offered at ``generation``?"""

    TAG: ClassVar[str] = "check_slot"
    slot: int
    generation: int
    dtype: WeightsDtype = "float32"

    def check(self) -> None:
        if self.slot not in (0, 1):
            raise ValueError(f"slot: want 0 or 1, got {self.slot}")
        if self.generation < 1:
            raise ValueError(f"generation: want >= 1, got {self.generation}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotChecked(Message):
    TAG: ClassVar[str] = "slot_checked"
    unchanged: bool



MESSAGES: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (
        Hello, CellReady, Heartbeat, ServiceHeartbeat, RoleSwitched, MicrostepDone, GradsSent, StepApplied,
        WeightsLoaded, ErrorReply, SwitchRole, LoadWeights, Sequence, Shard, GroupStats, RunMicrostep,
        SendGrads, ApplyStep, Shutdown, EngineRoute, RoutingTable, SealExecution, Grade,
        ShardReady, GroupDone, CallRecord, ExecutionFacts, ExecutionSealed, PullWeights, TensorSpec,
        WeightsHeader, GradsHeader, WeightsOffer, CheckSlot, SlotChecked, RecordsAck, Delivered,
        SessionMessage, SessionEntry, SessionReplayRequest, SessionReplayEnd, VersionSpan,
    )
}


# ---------------------------------------------------------------- encoding


def to_plain(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, Message):
            value = to_plain(value)
        elif isinstance(value, list) and value and isinstance(value[0], Message):
            value = [to_plain(v) for v in value]
        out[f.name] = value
    return out


def encode(msg: Message) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, msg.TAG, to_plain(msg)], use_bin_type=True)


def decode(frame: bytes, *, expect: tuple[type[Message], ...] | None = None) -> Message:
    """Decode and validate one frame; raise ProtocolError on anything but a valid message."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame: want bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame: {len(frame)} bytes is over the {MAX_FRAME_BYTES} limit")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"frame: not MessagePack ({type(exc).__name__}: {exc})") from None
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ProtocolError("frame: want [version, tag, body]")
    version, tag, body = obj
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"frame: protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    cls = MESSAGES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"frame: unknown tag {tag!r}")
    if expect is not None and cls not in expect:
        raise ProtocolError(f"{tag}: not expected here (want {', '.join(c.TAG for c in expect)})")
    return from_plain(cls, body, where=tag)


def from_plain(cls: type[Message], body: Any, *, where: str) -> Message:
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: want a map of fields")
    hints = _hints(cls)
    unknown = set(body) - set(hints)
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs = {}
    for name, (hint, required) in hints.items():
        if name not in body:
            if required:
                raise ProtocolError(f"{where}.{name}: missing")
            continue
        kwargs[name] = _check(hint, body[name], f"{where}.{name}")
    msg = cls(**kwargs)
    try:
        msg.check()
    except ValueError as exc:
        raise ProtocolError(f"{where}.{exc}") from None
    return msg


_HINTS: dict[type, dict[str, tuple[Any, bool]]] = {}


def _hints(cls: type[Message]) -> dict[str, tuple[Any, bool]]:
    got = _HINTS.get(cls)
    if got is None:
        types = typing.get_type_hints(cls)
        got = {
            f.name: (
                types[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
        }
        _HINTS[cls] = got
    return got


def _check(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is int:
        if type(value) is not int:
            raise ProtocolError(f"{where}: want int, got {type(value).__name__}")
        return value
    if hint is float:
        if type(value) is float:
            return value
        if type(value) is int:
            return float(value)
        raise ProtocolError(f"{where}: want float, got {type(value).__name__}")
    if hint is str:
        if type(value) is not str:
            raise ProtocolError(f"{where}: want str, got {type(value).__name__}")
        return value
    if hint is bool:
        if type(value) is not bool:
            raise ProtocolError(f"{where}: want bool, got {type(value).__name__}")
        return value
    if hint is bytes:
        if type(value) is not bytes:
            raise ProtocolError(f"{where}: want bytes, got {type(value).__name__}")
        return value
    if origin is Literal:
        if value not in typing.get_args(hint) or type(value) is not str:
            raise ProtocolError(f"{where}: want one of {list(typing.get_args(hint))}, got {value!r}")
        return value
    if origin in (Union, getattr(__import__("types"), "UnionType")):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(inner, value, where)
    if origin is list:
        (inner,) = typing.get_args(hint)
        if type(value) is not list:
            raise ProtocolError(f"{where}: want list, got {type(value).__name__}")
        if inner is int:
            for v in value:
                if type(v) is not int:
                    raise ProtocolError(f"{where}: want list of int, found {type(v).__name__}")
            return value
        if inner is float:
            for v in value:
                if type(v) is not float and type(v) is not int:
                    raise ProtocolError(f"{where}: want list of float, found {type(v).__name__}")
            return value
        return [_check(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        kt, vt = typing.get_args(hint)
        if type(value) is not dict:
            raise ProtocolError(f"{where}: want map, got {type(value).__name__}")
        return {_check(kt, k, f"{where} key"): _check(vt, v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Message):
        return from_plain(hint, value, where=where)
    raise TypeError(f"wire: no checker for {hint!r} at {where}")  # our own bug, not bad input
