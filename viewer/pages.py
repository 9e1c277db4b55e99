"""HTML for the viewer: the run (steps, executions with filters) and one execution's call tree.

Server-rendered, no script and nothing fetched from elsewhere. Everything that comes from the run
(messages are arbitrary text) goes through ``escape``.
"""

from __future__ import annotations

import codecs
import math
import typing
from html import escape
from typing import Any

from base import wire
from trajectory.tree import CONTEXT, Edge, Trajectory
from viewer import calltree
from viewer.calltree import CallTree
from viewer.runfolder import Run, work_file

SHORT_CHARS = 400
"""Context text longer than this is folded (``<details>``), its start shown."""
OUTCOMES = typing.get_args(wire.Outcome)
FILTERS = ("min_reward", "max_reward", "outcome", "harness", "kind")

STYLE = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:4px 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}th{background:#f3f3f3}
.note{background:#fff4d6;border:1px solid #e0c060;padding:4px 8px;margin:4px 0}
.edge{border-left:3px solid #bbb;margin:6px 0 6px 14px;padding-left:8px}
.main{border-color:#4c9be8}.main-summary{border-color:#9b59b6}.sub-agent{border-color:#e67e22}
.sub-agent-summary{border-color:#c0392b}.shared{border-color:#555}
.ctx{color:#666;white-space:pre-wrap;font:12px monospace}.policy{font:12px monospace;white-space:pre-wrap}
.trained{border-bottom:2px solid #222}.untrained{opacity:.55}.label{font-weight:600}
pre{white-space:pre-wrap;background:#f7f7f7;padding:6px}summary{cursor:pointer}
"""


def page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def error_page(message: str) -> str:
    return page("gyre-view", f"<h1>gyre-view</h1><p class='note'>{escape(message)}</p>")


def _notes(notes: list[str]) -> str:
    return "".join(f"<p class='note'>{escape(n)}</p>" for n in notes)


def _num(v: Any, digits: int = 3) -> str:
    if v is None or isinstance(v, bool):
        return "-" if v is None else str(v)
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.{digits}f}"
    return escape(str(v))


def _table(head: list[str], rows: list[list[str]]) -> str:
    """Cells are HTML already (escaped by the caller)."""
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows) + "</table>")


# ------------------------------------------------------------------ the run


def parse_filters(query: dict[str, list[str]]) -> dict[str, str]:
    """The filter fields (others are ignored); ValueError (a 400) for a value that cannot match."""
    out = {k: v[-1].strip() for k, v in query.items() if k in FILTERS and v and v[-1].strip()}
    for k in ("min_reward", "max_reward"):
        if k in out:
            try:
                ok = math.isfinite(float(out[k]))
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{k}={out[k]!r}: want a finite number")
    if out.get("outcome", OUTCOMES[0]) not in OUTCOMES:
        raise ValueError(f"outcome={out['outcome']!r}: want one of {', '.join(OUTCOMES)}")
    if out.get("kind", "train") not in ("train", "eval"):
        raise ValueError(f"kind={out['kind']!r}: want train or eval")
    return out


def _matches(ex: dict[str, Any], f: dict[str, str]) -> bool:
    reward = ex.get("reward")
    has_reward = isinstance(reward, (int, float)) and not isinstance(reward, bool)
    if "min_reward" in f and not (has_reward and reward >= float(f["min_reward"])):
        return False
    if "max_reward" in f and not (has_reward and reward <= float(f["max_reward"])):
        return False
    if "kind" in f and ("train" if ex.get("train") else "eval") != f["kind"]:
        return False
    return all(str(ex.get(k)) == f[k] for k in ("outcome", "harness") if k in f)


def run_page(run: Run, filters: dict[str, str]) -> str:
    s = run.summary
    body = [f"<h1>Run {escape(run.path.name)}</h1>", _notes(run.notes),
            f"<p>steps {_num(s.get('steps'))}, wall {_num(s.get('wall_s'), 1)} s, eval reward "
            f"{_num(s.get('eval_reward_start'))} &rarr; {_num(s.get('eval_reward_end'))}</p>"]
    for scan in run.logs:
        if scan.processor is not None:
            counts = {k: v for k, v in scan.processor.counters.metrics().items() if v}
            body.append(f"<p>{escape(str(scan.path.relative_to(run.path)))}: {scan.num_entries} entries; the "
                        "processor's counters over them: " + escape(", ".join(f"{k} {v}" for k, v in counts.items()))
                        + "</p>")
    body.append("<h2>Steps</h2>" + _table(
        ["step", "reward", "GSPO loss", "executions", "tokens trained", "clip fraction", "KL"],
        [[_num(e.get("step")), _num(e.get("reward_mean")), _num(e.get("loss")), _num(e.get("num_executions")),
          _num(e.get("num_tokens")), _num(e.get("clip_fraction")), _num(e.get("kl"), 5)] for e in run.steps]))
    sent = {eid: n for scan in run.logs if scan.processor is not None for eid, n in scan.targets.items()}
    rows = [[f"<a href='/execution/{escape(eid)}'>{escape(eid)}</a>", _num(ex.get("step")),
             "train" if ex.get("train") else "eval", escape(str(ex.get("harness", "-"))),
             escape(str(ex.get("outcome", "-"))), _num(ex.get("reward")), _num(ex.get("run_s"), 1),
             _num((ex.get("facts") or {}).get("num_calls")), _num((ex.get("facts") or {}).get("num_sub_agents")),
             _num(sent.get(eid, 0) if run.config else None)]
            for eid, ex in sorted(run.executions.items()) if _matches(ex, filters)]
    body.append(f"<h2>Executions ({len(rows)} of {len(run.executions)})</h2>" + _filter_form(run, filters))
    body.append(_table(["execution", "step", "kind", "harness", "outcome", "reward", "run s", "calls",
                        "sub-agents", "tokens trained"], rows))
    return page(f"gyre-view {run.path.name}", "".join(body))


def _filter_form(run: Run, f: dict[str, str]) -> str:
    def select(name: str, options: list[str]) -> str:
        opts = "".join(f"<option{' selected' if f.get(name) == o else ''}>{escape(o)}</option>" for o in options)
        return f"{name} <select name='{name}'><option value=''>any</option>{opts}</select> "

    harnesses = sorted({str(ex["harness"]) for ex in run.executions.values() if "harness" in ex})
    return ("<form method='get' action='/'>"
            f"reward &ge; <input name='min_reward' size=4 value='{escape(f.get('min_reward', ''))}'> "
            f"&le; <input name='max_reward' size=4 value='{escape(f.get('max_reward', ''))}'> "
            + select("outcome", list(OUTCOMES)) + select("harness", harnesses) + select("kind", ["train", "eval"])
            + "<button>filter</button></form>")


# ------------------------------------------------------------------ one execution


def execution_page(run: Run, eid: str) -> str:
    ex = run.executions[eid]
    t = calltree.build(run, eid)
    g = t.grade
    body = [f"<h1>Execution {escape(eid)}</h1><p><a href='/'>&larr; run</a></p>", _notes(run.notes),
            f"<p>step {_num(ex.get('step', g.step if g else None))}, "
            f"{'train' if ex.get('train', g.train if g else False) else 'eval'} run, "
            f"harness {escape(str(ex.get('harness', '-')))}, outcome {escape(str(ex.get('outcome', g.outcome if g else '-')))}, "
            f"reward {_num(ex.get('reward', g.reward if g else None))}; {len(t.records)} calls recorded"
            + (f", sealed at {t.sealed.num_calls}" if t.sealed else ", not sealed") + "</p>",
            f"<p class='verdict'>{escape(_verdict(run, t))}</p>"]
    scans = run.scans_of(eid)
    if len(scans) > 1:  # a resumed run ran the interrupted step again under the same ids
        body.append(f"<p class='note'>recorded by {len(scans)} attempts of the run ("
                    + escape(", ".join(s.path.parent.name for s in scans))
                    + f"); shown: the last, {escape(scans[-1].path.parent.name)}, the one that counted</p>")
    body += [f"<p class='note'>record refused by the tree: {escape(r)}</p>" for r in t.refused]
    if t.sent_targets and t.sent_targets != t.num_targets:  # the processor's functions disagree with themselves
        body.append(f"<p class='note'>the processor sent {t.sent_targets} targets, this tree trains {t.num_targets}</p>")
    names = {id(tr): f"T{i + 1}" for i, tr in enumerate(t.trajectories)}
    body.append(_trajectory_table(t, names))
    body.append(_calls_table(run, t))
    body.append("<h2>Call tree</h2><p>Each box is a run of tokens no branch splits, labelled with the "
                "trajectories through it. Policy tokens are coloured by their behaviour logprob (green near 0, "
                "red low; hover for the value); trained ones are underlined, the others faded.</p>")
    through: dict[Edge, list[str]] = {}
    for tr in t.trajectories:
        for e in tr.edges:
            through.setdefault(e, []).append(f"{names[id(tr)]} {tr.kind}")
    body.append(_edge_html(run, t, t.tree.root, through, t.trained_edges))
    if g is not None:
        body.append(f"<h2>Grade</h2><p>{escape(', '.join(f'{k} {v}' for k, v in wire.to_plain(g).items()))}</p>")
    for name in ("grade.json", "stdout.log", "stderr.log"):
        text = work_file(run, eid, name)
        if text is not None:
            body.append(f"<h2>{name}</h2><pre>{escape(text)}</pre>")
    return page(f"gyre-view {eid}", "".join(body))


def _verdict(run: Run, t: CallTree) -> str:
    """Why the execution did or did not train; the fact itself is the processor's (``sent_targets``)."""
    g, scan = t.grade, run.scan_of(t.tree.execution_id)
    if t.sent_targets is None:
        return "what trained is not known (no processor.json, or the processor failed on the log)"
    if t.sent_targets:
        return f"trained: the processor sent {t.sent_targets} policy tokens of its kept trajectories to train"
    why = ("not graded yet" if g is None else "an eval run: scored, never trained" if not g.train
           else f"outcome {g.outcome}" if g.outcome not in ("finished", "timed_out")
           else "the grader failed (no reward)" if g.reward is None
           else "not sealed yet" if t.sealed is None
           else "cut: sealed with calls missing or refused" if t.refused or len(t.records) < t.sealed.num_calls
           else f"its group was dropped ({scan.dropped[g.group_id]})" if scan and g.group_id in scan.dropped
           else "no policy tokens" if not t.num_targets else "its group is not complete yet")
    return f"not trained: {why}"


def _trajectory_table(t: CallTree, names: dict[int, str]) -> str:
    rank = {id(tr): i for i, tr in enumerate(t.kept or [])}
    covered = {e for k in t.kept or [] for e in k.edges}

    def cap(tr: Trajectory) -> str:
        if t.kept is None:
            return "unknown"
        if id(tr) in rank:
            return f"<span class='kept'>kept #{rank[id(tr)] + 1}</span>"
        # select() passes over a chain with nothing new to train; one that still has is past the cap.
        new = any(e.num_policy for e in tr.edges if e not in covered)
        return f"<span class='dropped'>{'over the cap' if new else 'adds no target'}</span>"

    rows = [[names[id(tr)], f"<span class='label'>{escape(tr.kind)}</span>", str(tr.num_tokens),
             str(tr.num_policy_tokens), escape(tr.first_call_id), cap(tr), str(t.targets.get(id(tr), 0))]
            for tr in t.trajectories]
    return (f"<h2>Trajectories ({len(t.trajectories)}; the cap keeps "
            f"{len(t.kept) if t.kept is not None else '?'}, {t.num_targets} targets)</h2>"
            + _table(["", "branch", "tokens", "policy tokens", "ending call", "cap", "targets"], rows))


def _calls_table(run: Run, t: CallTree) -> str:
    rows = []
    for r in t.records:
        side = (f"<details><summary>side call, not in the tree</summary><div class='ctx'>"
                f"{escape(_decode(run, r.output_ids))}</div></details>" if r.lineage == "side" else "")
        rows.append([str(r.call_index), escape(r.call_id), f"<span class='label'>{escape(r.lineage)}</span>",
                     escape(r.agent_id), str(len(r.prompt_ids)), str(len(r.output_ids)), escape(r.finish_reason),
                     str(r.weight_version), str(r.num_tool_calls), f"{r.finished_at - r.started_at:.2f}", side])
    return "<h2>Calls</h2>" + _table(["#", "call", "lineage", "agent", "prompt", "output", "finish", "version",
                                      "tool calls", "s", ""], rows)


def _edge_html(run: Run, t: CallTree, edge: Edge, through: dict[Edge, list[str]], trained: set[Edge]) -> str:
    parts = []
    for child in edge.children.values():
        kinds = {k.split(" ", 1)[1] for k in through.get(child, [])}
        css = kinds.pop() if len(kinds) == 1 else "shared"
        agents = calltree.edge_agents(t.tree, child)
        lineages = calltree.edge_lineages(t.tree, child)
        parts.append(
            f"<div class='edge {escape(css)}'><span class='label'>{escape(', '.join(through.get(child, [])))}</span>"
            f" &middot; {len(child)} tokens, {child.num_policy} policy"
            + (f" by {escape(', '.join(lineages))}" if child.num_policy else "")
            + (f" (agent {escape(', '.join(agents))})" if agents else "")
            + _tokens_html(run, child, child in trained) + _edge_html(run, t, child, through, trained) + "</div>")
    return "".join(parts)


def _tokens_html(run: Run, edge: Edge, trained: bool) -> str:
    """Context as text (long runs folded), policy tokens one span each: the heat strip."""
    out, i, n = [], 0, len(edge)
    policy = edge.calls != CONTEXT
    while i < n:
        j = i
        while j < n and policy[j] == policy[i]:
            j += 1
        ids = edge.tokens[i:j].tolist()
        if not policy[i]:
            text = _decode(run, ids)
            out.append(f"<div class='ctx'>{escape(text)}</div>" if len(text) <= SHORT_CHARS else
                       f"<details class='ctx'><summary>{escape(text[:SHORT_CHARS])} &hellip; ({len(ids)} tokens)</summary>"
                       f"{escape(text[SHORT_CHARS:])}</details>")
        else:
            cls = "trained" if trained else "untrained"
            spans = "".join(f"<span class='{cls}' style='background:{_heat(lp)}' title='logprob {lp:.3f}'>{escape(s)}</span>"
                            for s, lp in zip(_pieces(run, ids), edge.logprobs[i:j].tolist()))
            out.append(f"<div class='policy'>{spans}</div>")
        i = j
    return "".join(out)


def _pieces(run: Run, ids: list[int]) -> list[str]:
    """Each token's text; a character split over tokens shows on the token that completes it."""
    if run.tokenizer is None:
        return [f"{i} " for i in ids]
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        return [dec.decode(run.tokenizer.decode_bytes([i])) for i in ids]
    except Exception:  # an id past the vocabulary (a mis-configured run): ids, not a traceback
        return [f"{i} " for i in ids]


def _decode(run: Run, ids: list[int]) -> str:
    if run.tokenizer is None:
        return " ".join(map(str, ids))
    try:
        return run.tokenizer.decode(ids)
    except Exception:  # as in _pieces
        return " ".join(map(str, ids))


def _heat(logprob: float) -> str:
    p = math.exp(max(logprob, -20.0))  # 1 -> green, 0 -> red
    return f"hsl({int(120 * p)},70%,80%)"
