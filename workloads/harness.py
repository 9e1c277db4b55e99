"""The bundled black-box harness: a file-writing agent that only speaks HTTP.

    OPENAI_API_KEY=TOKEN python -m workloads.harness --base-url http://127.0.0.1:PORT/v1 \\
        --workspace DIR --max-turns N --max-tokens M --temperature T --model NAME \\
        [--think-median-s S --think-sigma X --think-max-s S --think-seed N --think-key EXECUTION_ID]

It reads ``TASK.md`` from its workspace (first line ``file: <name>``, then the prompt), asks an
OpenAI-compatible Chat Completions endpoint (non-streaming, ``Authorization: Bearer TOKEN``),
and writes each reply, stripped, over the named file. A workspace without ``TASK.md`` is a coding
task (an SWE-style row): the prompt is ``$GYRE_PROMPT_FILE`` (or ``--prompt-file``), and each reply
names the file it replaces on its first line (``file: path/in/the/workspace``), the file's whole new
content after it; a reply naming no plain relative path is told so and writes nothing. After a write it reports
``wrote N bytes to NAME`` and asks again, up to ``--max-turns`` calls; an empty reply ends the
run early. The assistant turns it sends back are the replies exactly as received, so a proxy can
splice in the token ids it generated.

With ``--think-median-s`` > 0 it also spends *think time* after each write, as an agent runs its
tools: the run's total is log-normal around the median (``--think-sigma``), capped at
``--think-max-s``, a function of (``--think-seed``, ``--think-key``: the execution id, which the
controller passes; by default the workspace folder's name) only, and split evenly over ``--max-turns``; ``think_times`` is that function, so a
simulator can replay a run's lengths exactly. It prints ``harness: think <s>s over <n> turns``,
and ``harness: answered <id>`` for each completion it got (its ``id``: the proxy's call id), so a
run can check that every call a harness was answered is in the processor's log (``bench.soak``).

Standard library only, and no Gyre imports: it is a stand-in for a third-party harness, and it
starts in tens of milliseconds. Exit codes: 0 done; 2 a bad task file or an HTTP/API error
(one ``harness: error: ...`` line on stderr). Retries 429/502/503/504 and connection errors with
backoff before giving up. Each write replaces the file atomically, so a run killed at its
timeout leaves a complete earlier reply for partial grading.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SYSTEM_PROMPT = "You write files. Reply with only the text to put in the file; reply empty when done."
TASK_FILE = "TASK.md"
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RETRY_STATUSES = frozenset({429, 502, 503, 504})
RETRY_ATTEMPTS = 7
"""Tries per call (the first plus six retries, ~9 s of backoff: longer than a proxy takes to be
restarted in place) before the run gives up with exit code 2."""
BACKOFF_S = (0.2, 0.4, 0.8, 1.6, 3.2)
MAX_RETRY_AFTER_S = 5.0


class HarnessError(Exception):
    """Ends the run with exit code 2; the text is the stderr line."""


def wrote_message(num_bytes: int, file_name: str) -> str:
    """The user turn that reports a write back to the model."""
    return f"wrote {num_bytes} bytes to {file_name}"


CODING_SYSTEM_PROMPT = ("You fix bugs by rewriting files. Reply with 'file: <path in the repository>' on the first line "
                        "and the file's whole new content after it; reply empty when done.")
RELATIVE_PATH_RE = re.compile(r"^(?!/)(?!.*(?:^|/)\.\.(?:/|$))(?!\.git(?:/|$))[A-Za-z0-9_./-]{1,200}$")


def split_reply(reply: str) -> tuple[str, str] | None:
    """(path, content) of a coding reply ``file: <path>\n<content>``; None when it names no plain relative path."""
    first, _, rest = reply.strip().partition("\n")
    if not first.startswith("file:"):
        return None
    path = first[len("file:"):].strip()
    return (path, rest) if RELATIVE_PATH_RE.match(path) else None


def read_task(workspace: Path) -> tuple[str, str]:
    """(file name, prompt) from ``TASK.md``."""
    try:
        text = (workspace / TASK_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HarnessError(f"cannot read {workspace / TASK_FILE}: {exc}") from None
    first, _, rest = text.partition("\n")
    if not first.startswith("file:"):
        raise HarnessError(f"{TASK_FILE}: first line must be 'file: <name>', got {first[:80]!r}")
    file_name = first[len("file:"):].strip()
    if not FILE_NAME_RE.match(file_name) or file_name == TASK_FILE:
        raise HarnessError(f"{TASK_FILE}: not a plain workspace file name: {file_name!r}")
    prompt = rest.strip()
    if not prompt:
        raise HarnessError(f"{TASK_FILE}: no prompt after the file line")
    return file_name, prompt


def write_atomic(path: Path, text: str) -> int:
    data = text.encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)


def _retry_delay_s(attempt: int, retry_after: str | None) -> float:
    delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
    if retry_after:
        try:
            delay = max(delay, min(float(retry_after), MAX_RETRY_AFTER_S))
        except ValueError:
            pass
    return delay


def _http_detail(exc: urllib.error.HTTPError) -> str:
    try:
        body = exc.read(300).decode("utf-8", errors="replace")
    except Exception:  # the body is only decoration for the error line
        body = ""
    return f"HTTP {exc.code} {body.strip()}".strip()


def chat(args: argparse.Namespace, messages: list[dict[str, str]]) -> str:
    """One Chat Completions call; the reply's text ('' when the model said nothing)."""
    url = args.base_url.rstrip("/") + "/chat/completions"
    body = json.dumps({
        "model": args.model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": False,
    }).encode("utf-8")
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {args.api_key}"}
    last, delay = "", 0.0
    for attempt in range(RETRY_ATTEMPTS):
        if attempt:
            time.sleep(delay)
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=args.request_timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            last = _http_detail(exc)
            if exc.code not in RETRY_STATUSES:
                raise HarnessError(f"POST {url}: {last}") from None
            delay = _retry_delay_s(attempt, exc.headers.get("Retry-After"))
            continue
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            delay = _retry_delay_s(attempt, None)
            continue
        return _reply_text(url, raw)
    raise HarnessError(f"POST {url}: gave up after {RETRY_ATTEMPTS} attempts; last: {last}")


def _reply_text(url: str, raw: bytes) -> str:
    try:
        completion = json.loads(raw)
        content = completion["choices"][0]["message"].get("content")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise HarnessError(f"POST {url}: not a chat completion: {raw[:200]!r}") from None
    print(f"harness: answered {completion.get('id')}", flush=True)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise HarnessError(f"POST {url}: message.content is {type(content).__name__}, want a string")
    return content


def think_times(*, seed: int, execution_id: str, median_s: float, sigma: float, max_s: float,
                turns: int) -> list[float]:
    """Seconds of think time after each of a run's ``turns`` calls (see the module docstring)."""
    rng = random.Random(f"gyre-think/{seed}/{execution_id}")
    total = min(max_s, rng.lognormvariate(math.log(median_s), sigma))
    return [total / turns] * turns


def run(args: argparse.Namespace) -> None:
    workspace = Path(args.workspace)
    coding = not (workspace / TASK_FILE).exists() and bool(args.prompt_file)
    if coding:
        try:
            file_name, prompt = "", Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise HarnessError(f"cannot read the prompt file {args.prompt_file}: {exc}") from None
    else:
        file_name, prompt = read_task(workspace)
    system = CODING_SYSTEM_PROMPT if coding else SYSTEM_PROMPT
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    think = [0.0] * args.max_turns
    if args.think_median_s > 0:
        key = args.think_key or workspace.resolve().name
        think = think_times(seed=args.think_seed, execution_id=key, median_s=args.think_median_s,
                            sigma=args.think_sigma, max_s=args.think_max_s, turns=args.max_turns)
        print(f"harness: think {sum(think):.3f}s over {args.max_turns} turns", flush=True)
    for turn in range(args.max_turns):
        reply = chat(args, messages)
        text = reply.strip()
        if not text:
            return
        messages.append({"role": "assistant", "content": reply})
        target, content = (file_name, text) if not coding else (split_reply(reply) or ("", ""))
        if not target:
            messages.append({"role": "user", "content": "Your reply named no file: start it with 'file: <path>'."})
            continue
        try:
            (workspace / target).parent.mkdir(parents=True, exist_ok=True)
            num_bytes = write_atomic(workspace / target, content if coding else text)
        except OSError as exc:
            raise HarnessError(f"cannot write {target}: {exc}") from None
        messages.append({"role": "user", "content": wrote_message(num_bytes, target)})
        if think[turn] > 0:
            time.sleep(think[turn])  # the "tools" run; a run killed meanwhile keeps its last write


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workloads.harness", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY; on argv it is readable in /proc)")
    p.add_argument("--workspace", required=True)
    p.add_argument("--prompt-file", default=os.environ.get("GYRE_PROMPT_FILE", ""),
                   help="a coding task's prompt, for a workspace without TASK.md (default: $GYRE_PROMPT_FILE)")
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--model", default="gyre-policy")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--think-median-s", type=float, default=0.0, help="0: no think time")
    p.add_argument("--think-sigma", type=float, default=1.0)
    p.add_argument("--think-max-s", type=float, default=40.0)
    p.add_argument("--think-seed", type=int, default=0)
    p.add_argument("--think-key", default="",
                   help="what a run's think time is a function of, with the seed: its execution id (default: "
                        "the workspace folder's name)")
    args = p.parse_args(argv)
    if not args.api_key:
        p.error("--api-key or $OPENAI_API_KEY: the execution's token")
    if args.max_turns < 1 or args.max_tokens < 1:
        p.error("--max-turns and --max-tokens: want >= 1")
    if not (math.isfinite(args.think_median_s) and args.think_median_s >= 0 and args.think_sigma >= 0
            and math.isfinite(args.think_max_s) and args.think_max_s > 0):
        p.error("--think-median-s >= 0, --think-sigma >= 0 and --think-max-s > 0, all finite")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except HarnessError as exc:
        print(f"harness: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
