"""HTML for the viewer: the run (steps, executions with filters) and one execution's call tree.

Server-rendered, no script and nothing fetched from elsewhere; everything from the run is escaped."""

from __future__ import annotations

import math
from html import escape
from typing import Any

import numpy as np

from trajectory.tree import CONTEXT, Edge
from viewer.runfolder import Run, Tree, build_tree, work_file

CONTEXT_CHARS = 600
"""Context (prompt) text shown per tree edge; the rest is counted, not printed."""

STYLE = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}th{background:#f3f3f3}
.note{background:#fff4d6;border:1px solid #e0c060;padding:4px 8px;margin:4px 0}
.edge{border-left:3px solid #bbb;margin:6px 0 6px 14px;padding-left:8px}
.main{border-color:#4c9be8}.main-summary{border-color:#9b59b6}.sub-agent{border-color:#e67e22}
.sub-agent-summary{border-color:#c0392b}.side{border-color:#7f8c8d}
.ctx{color:#666;white-space:pre-wrap;font:12px monospace}.tok{font:12px monospace;white-space:pre-wrap}
.untrained{outline:1px dashed #999}.label{font-weight:600}pre{white-space:pre-wrap;background:#f7f7f7;padding:6px}
"""


def page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def error_page(message: str) -> str:
    return page("gyre-view", f"<h1>gyre-view</h1><p class='note'>{escape(message)}</p>")


def _notes(run: Run) -> str:
    return "".join(f"<p class='note'>{escape(n)}</p>" for n in run.notes)


def _num(v: Any, digits: int = 3) -> str:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v)
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.{digits}f}"
    return escape(str(v))


def run_page(run: Run, filters: dict[str, str]) -> str:
    s = run.summary
    head = (f"<h1>Run {escape(run.path.name)}</h1>{_notes(run)}"
            f"<p>steps {_num(s.get('steps'))}, wall {_num(s.get('wall_s'), 1)} s, eval reward "
            f"{_num(s.get('eval_reward_start'))} &rarr; {_num(s.get('eval_reward_end'))}</p>")
    steps = "".join(
        f"<tr><td>{_num(e.get('step'))}</td><td>{_num(e.get('reward_mean'))}</td><td>{_num(e.get('loss'))}</td>"
        f"<td>{_num(e.get('num_executions'))}</td><td>{_num(e.get('num_tokens'))}</td>"
        f"<td>{_num(e.get('clip_fraction'))}</td><td>{_num(e.get('kl'), 5)}</td></tr>" for e in run.steps)
    rows = []
    for eid, ex in sorted(run.executions.items()):
        if not _matches(ex, filters):
            continue
        facts = ex.get("facts") or {}
        rows.append(
            f"<tr><td><a href='/execution/{escape(eid)}'>{escape(eid)}</a></td><td>{_num(ex.get('step'))}</td>"
            f"<td>{'train' if ex.get('train') else 'eval'}</td><td>{escape(str(ex.get('harness', '-')))}</td>"
            f"<td>{escape(str(ex.get('outcome', '-')))}</td><td>{_num(ex.get('reward'))}</td>"
            f"<td>{_num(ex.get('run_s'), 1)}</td><td>{_num(facts.get('num_calls'))}</td>"
            f"<td>{_num(facts.get('num_sub_agents'))}</td></tr>")
    form = (
        "<form method='get' action='/'>reward &ge; <input name='min_reward' size=4 value='{}'> "
        "&le; <input name='max_reward' size=4 value='{}'> outcome <input name='outcome' size=9 value='{}'> "
        "harness <input name='harness' size=11 value='{}'> <button>filter</button></form>"
    ).format(*(escape(filters.get(k, "")) for k in ("min_reward", "max_reward", "outcome", "harness")))
    return page(f"gyre-view {run.path.name}", head + "<h2>Steps</h2><table><tr><th>step</th><th>reward</th>"
                "<th>GSPO loss</th><th>executions</th><th>tokens trained</th><th>clip fraction</th><th>KL</th></tr>"
                + steps + f"</table><h2>Executions ({len(rows)})</h2>" + form
                + "<table><tr><th>execution</th><th>step</th><th>kind</th><th>harness</th><th>outcome</th>"
                "<th>reward</th><th>run s</th><th>calls</th><th>sub-agents</th></tr>" + "".join(rows) + "</table>")


def parse_filters(query: dict[str, list[str]]) -> dict[str, str]:
    """The filter fields; ValueError (a 400) for a reward bound that is not a number."""
    out = {k: v[-1].strip() for k, v in query.items() if k in ("min_reward", "max_reward", "outcome", "harness") and v}
    for k in ("min_reward", "max_reward"):
        if out.get(k):
            if not math.isfinite(float(out[k])):
                raise ValueError(f"{k}: want a finite number")
    return out


def _matches(ex: dict[str, Any], f: dict[str, str]) -> bool:
    reward = ex.get("reward")
    if f.get("min_reward") and not (isinstance(reward, (int, float)) and reward >= float(f["min_reward"])):
        return False
    if f.get("max_reward") and not (isinstance(reward, (int, float)) and reward <= float(f["max_reward"])):
        return False
    if f.get("outcome") and str(ex.get("outcome")) != f["outcome"]:
        return False
    return not f.get("harness") or str(ex.get("harness")) == f["harness"]


def execution_page(run: Run, eid: str) -> str:
    ex = run.executions[eid]
    t = build_tree(run, eid)
    grade = run.grades.get(eid)
    body = [f"<h1>Execution {escape(eid)}</h1>{_notes(run)}<p><a href='/'>&larr; run</a></p>",
            f"<p>outcome {escape(str(ex.get('outcome', '-')))}, reward {_num(ex.get('reward'))}, "
            f"{'training' if ex.get('train', grade.train if grade else False) else 'eval'} run, "
            f"{len(run.records.get(eid, []))} calls recorded; "
            + ("its kept trajectories were trained" if t.trained else "not trained") + "</p>"]
    body += [f"<p class='note'>record refused by the tree: {escape(r)}</p>" for r in t.refused]
    body.append(_trajectory_table(t))
    body.append("<h2>Call tree</h2><p>Policy tokens are coloured by their behaviour log-probability "
                "(green near 0, red low); a dashed outline marks tokens no kept trajectory trains.</p>")
    trained_edges = {e for tr in t.kept for e in tr.edges} if t.trained else set()
    body.append(_edge_html(run, t, t.tree.root, trained_edges))
    for name in ("grade.json", "stdout.log", "stderr.log"):
        text = work_file(run, eid, name)
        if text is not None:
            body.append(f"<h2>{name}</h2><pre>{escape(text)}</pre>")
    return page(f"gyre-view {eid}", "".join(body))


def _trajectory_table(t: Tree) -> str:
    kept = set(map(id, t.kept))
    rows = "".join(
        f"<tr><td class='label'>{escape(tr.kind)}</td><td>{tr.num_tokens}</td><td>{tr.num_policy_tokens}</td>"
        f"<td>{escape(tr.first_call_id)}</td><td>{'kept' if id(tr) in kept else 'over the cap'}</td></tr>"
        for tr in t.trajectories)
    return ("<h2>Trajectories (branches)</h2><table><tr><th>branch</th><th>tokens</th><th>policy tokens</th>"
            f"<th>first call</th><th>cap</th></tr>{rows}</table>")


def _edge_html(run: Run, t: Tree, edge: Edge, trained: set[Edge]) -> str:
    parts = []
    for child in edge.children.values():
        lineages = sorted({t.tree.calls[c].lineage for c in child.calls if c != CONTEXT}
                          | {t.tree.calls[c].lineage for c in child.end_calls})
        kind = lineages[0] if len(lineages) == 1 else "main"
        agents = sorted({t.tree.calls[c].agent_id for c in child.calls if c != CONTEXT} - {""})
        label = ", ".join(lineages) or "context"
        head = (f"<div class='edge {escape(kind)}'><span class='label'>{escape(label)}</span>"
                + (f" (agent {escape(', '.join(agents))})" if agents else "")
                + f" &middot; {len(child)} tokens, {child.num_policy} policy")
        parts.append(head + _tokens_html(run, child, child in trained) + _edge_html(run, t, child, trained) + "</div>")
    return "".join(parts)


def _tokens_html(run: Run, edge: Edge, trained: bool) -> str:
    """Context as text (cut), policy tokens one span each, coloured by logprob: the heat strip."""
    out, i, n = [], 0, len(edge)
    policy = edge.calls != CONTEXT
    while i < n:
        j = i
        while j < n and policy[j] == policy[i]:
            j += 1
        ids = edge.tokens[i:j].tolist()
        if not policy[i]:
            text = _decode(run, ids)
            cut = f" … ({len(ids)} tokens)" if len(text) > CONTEXT_CHARS else ""
            out.append(f"<div class='ctx'>{escape(text[:CONTEXT_CHARS])}{cut}</div>")
        else:
            spans = "".join(
                f"<span class='{'' if trained else 'untrained'}' style='background:{_heat(float(lp))}' "
                f"title='logprob {float(lp):.3f}'>{escape(_decode(run, [tok]))}</span>"
                for tok, lp in zip(ids, edge.logprobs[i:j]))
            out.append(f"<div class='tok policy'>{spans}</div>")
        i = j
    return "".join(out)


def _decode(run: Run, ids: list[int]) -> str:
    if run.tokenizer is None:
        return " ".join(map(str, ids))
    try:
        return run.tokenizer.decode(ids)
    except Exception:  # an id past the vocabulary of a mis-configured run: show it, not a traceback
        return " ".join(map(str, ids))


def _heat(logprob: float) -> str:
    p = float(np.exp(max(logprob, -20.0)))  # 1 -> green, 0 -> red
    return f"hsl({int(120 * p)},70%,80%)"

