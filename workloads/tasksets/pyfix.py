"""The bundled coding task set ``pyfix``: small Python projects with a planted bug, as SWE-style rows.

``generate(data_dir)`` writes, deterministically and offline,

- ``<data_dir>/pyfix/repos/<instance_id>/``: a (bare) git repository per task. Its first commit (the
  task's ``base_commit``) holds the module with the bug, a README and a few visible tests that
  pass; its second commit, the repository's HEAD, is the fix with the hidden tests: the future
  history a workspace must never show (workloads/tasksets/swe.py builds workspaces without it);
- ``<data_dir>/pyfix/tasks.jsonl``: one row per task in the format swe.py loads, with the gold
  ``patch``, the hidden tests as ``test_patch`` and the ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` ids;
- ``<data_dir>/pyfix/STAMP``: the generator version; a different or missing stamp regenerates.

A task is one ``Family`` (a module of a few functions, and test cases as plain expressions) and
one ``Bug`` (a text substitution planting, say, an off-by-one). Expected values come from running
the correct module; which tests are FAIL_TO_PASS (fail with the bug, pass fixed) and which are
PASS_TO_PASS (pass both) is found by running every test in-process on both versions, so the split
is measured, not hand-labelled, and a bug no test catches stops the generator. The problem
statement reports the symptom of one or two failing cases in a user's words, never the fix.

Tests run with the system's ``python3 -m pytest`` (Debian's python3-pytest), which is what the
sandbox shows; the projects use the standard library only and grade in well under a second.
"""

from __future__ import annotations

import builtins
import difflib
import hashlib
import json
import random
import shutil
import tempfile
import types
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATOR_VERSION = "1"
"""Bump on any change to what ``generate`` writes: existing data dirs then regenerate."""
_AUTHOR = "pyfix <pyfix@gyre.invalid>"
_COMMIT_EPOCHS = (1704110400, 1704715200)
"""2024-01-01 and 2024-01-08, 12:00 UTC: with fixed dates every commit hash (so every base_commit)
is the same on every machine."""


@dataclass(frozen=True)
class Bug:
    kind: str
    """What sort of mistake: off-by-one, wrong operator, missing case, wrong default, ..."""
    correct: str
    """Text found exactly once in the family's source."""
    buggy: str
    """What it becomes in the task's base commit."""


@dataclass(frozen=True)
class Family:
    module: str
    title: str
    source: str
    cases: dict[str, tuple[str, ...]]
    """Callable (``word_count`` or ``Stack.pop``) -> test expressions; the correct module's
    result (or exception) is what each test wants."""
    bugs: tuple[Bug, ...]


@dataclass(frozen=True)
class _Test:
    name: str
    callable_name: str
    expr: str
    code: str


def task_file(data_dir: str | Path) -> Path:
    return Path(data_dir) / "pyfix" / "tasks.jsonl"


def generate(data_dir: str | Path) -> Path:
    """Write the task set under ``data_dir/pyfix`` unless its stamp is current; the task file's path.

    Built in a temporary folder and renamed into place, so concurrent callers never see half a set.
    """
    target = Path(data_dir) / "pyfix"
    stamp = target / "STAMP"
    if stamp.is_file() and stamp.read_text() == GENERATOR_VERSION:
        return target / "tasks.jsonl"
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".pyfix.", dir=data_dir))
    try:
        _write_task_set(building)
        (building / "STAMP").write_text(GENERATOR_VERSION)
        if target.exists():
            stale = Path(tempfile.mkdtemp(prefix=".pyfix-stale.", dir=data_dir))
            target.rename(stale / "pyfix")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            building.rename(target)
        except OSError:
            if not (stamp.is_file() and stamp.read_text() == GENERATOR_VERSION):
                raise  # not a concurrent generator that finished first
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target / "tasks.jsonl"


def _write_task_set(root: Path) -> None:
    rows = []
    for family in FAMILIES:
        for number, bug in enumerate(family.bugs, start=1):
            instance_id = f"pyfix__{family.module}-{number}"
            rows.append(_write_task(root / "repos" / instance_id, instance_id, family, bug))
    with open(root / "tasks.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def _write_task(repo: Path, instance_id: str, family: Family, bug: Bug) -> dict[str, Any]:
    if family.source.count(bug.correct) != 1:
        raise AssertionError(f"{instance_id}: bug text must occur once in {family.module}.py: {bug.correct!r}")
    buggy_source = family.source.replace(bug.correct, bug.buggy)
    correct_module = _load_module(family.module, family.source)
    buggy_module = _load_module(family.module, buggy_source)
    tests = _make_tests(family, correct_module)
    fail_to_pass, pass_to_pass = [], []
    for test in tests:
        if not _passes(test, correct_module):
            raise AssertionError(f"{instance_id}: {test.name} fails on the correct module")
        (pass_to_pass if _passes(test, buggy_module) else fail_to_pass).append(test)
    if not fail_to_pass:
        raise AssertionError(f"{instance_id}: no test catches the bug {bug.buggy!r}")
    visible = _visible_tests(tests, pass_to_pass)
    test_path = f"tests/test_{family.module}.py"
    hidden_text, visible_text = _test_file(family.module, tests), _test_file(family.module, visible)

    base = {"README.md": _readme(family), f"{family.module}.py": buggy_source, test_path: visible_text}
    fixed = {**base, f"{family.module}.py": family.source, test_path: hidden_text}
    base_commit, _ = _write_repository(repo, [
        (base, f"Add {family.module}: {family.title}", _COMMIT_EPOCHS[0]),
        (fixed, f"Fix {fail_to_pass[0].callable_name} ({bug.kind}) and test it", _COMMIT_EPOCHS[1]),
    ])
    statement = _problem_statement(instance_id, family, fail_to_pass, correct_module, buggy_module)
    ids = lambda group: [f"{test_path}::{t.name}" for t in group]  # noqa: E731
    return {
        "instance_id": instance_id,
        "repo": f"repos/{instance_id}",
        "base_commit": base_commit,
        "problem_statement": statement,
        "FAIL_TO_PASS": ids(fail_to_pass),
        "PASS_TO_PASS": ids(pass_to_pass),
        "patch": _diff(f"{family.module}.py", buggy_source, family.source),
        "test_patch": _diff(test_path, visible_text, hidden_text),
        "bug_kind": bug.kind,
        "version": GENERATOR_VERSION,
    }


# ---------------------------------------------------------------- tests, measured in-process


def _load_module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def _outcome(expr: str, module: types.ModuleType) -> tuple[str, Any]:
    """("value", v) or ("raises", exception) of ``expr`` evaluated against ``module``."""
    try:
        return "value", eval(expr, dict(module.__dict__))
    except Exception as exc:
        return "raises", exc


def _make_tests(family: Family, module: types.ModuleType) -> list[_Test]:
    tests = []
    for callable_name, exprs in family.cases.items():
        for number, expr in enumerate(exprs, start=1):
            name = f"test_{callable_name.replace('.', '_').lower()}_{number}"
            kind, result = _outcome(expr, module)
            if kind == "raises":
                exc_name = type(result).__name__
                assert getattr(builtins, exc_name, None) is type(result), f"{name}: {exc_name} is not a builtin"
                code = f"def {name}():\n    with pytest.raises({exc_name}):\n        {expr}\n"
            elif result is None or isinstance(result, bool):
                code = f"def {name}():\n    assert {expr} is {result!r}\n"
            else:
                assert eval(repr(result)) == result, f"{name}: {result!r} does not round-trip"
                code = f"def {name}():\n    assert {expr} == {result!r}\n"
            tests.append(_Test(name, callable_name, expr, code))
    return tests


def _passes(test: _Test, module: types.ModuleType) -> bool:
    # The test's globals are what its file's imports would bind; pytest.raises is stood in for, so
    # generating needs no pytest (the controller's install may have none).
    namespace: dict[str, Any] = {"pytest": types.SimpleNamespace(raises=_Raises),
                                 **{k: v for k, v in vars(module).items() if not k.startswith("__")}}
    try:
        exec(test.code, namespace)
        namespace[test.name]()
        return True
    except Exception:
        return False


class _Raises:
    """``pytest.raises(kind)`` as the generated tests use it: the block must raise ``kind``."""

    def __init__(self, kind: type[BaseException]):
        self.kind = kind

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, traceback) -> bool:
        if kind is None:
            raise AssertionError(f"DID NOT RAISE {self.kind.__name__}")
        return issubclass(kind, self.kind)  # another exception propagates: the test fails


def _visible_tests(tests: list[_Test], pass_to_pass: list[_Test]) -> list[_Test]:
    """The first passing test of up to three callables: what the repository shipped with."""
    chosen: dict[str, _Test] = {}
    for test in pass_to_pass:
        if test.callable_name not in chosen and len(chosen) < 3:
            chosen[test.callable_name] = test
    return [t for t in tests if t in chosen.values()]


def _test_file(module: str, tests: list[_Test]) -> str:
    names = sorted({t.callable_name.split(".")[0] for t in tests})
    header = f"import pytest\n\nfrom {module} import {', '.join(names)}\n" if names else "import pytest\n"
    return header + "".join(f"\n\n{t.code}" for t in tests)


# ---------------------------------------------------------------- words and files


_OPENERS = (
    "I think there is a bug in `{callable}` ({module}.py).",
    "`{callable}` in `{module}.py` gives wrong results for some inputs.",
    "Found a problem with the {title} in `{module}.py`, in `{callable}`.",
    "While using `{module}.py` I ran into unexpected behaviour from `{callable}`.",
    "Bug report: `{callable}` does not do what its documentation says.",
)
_WRONG_VALUE = (
    "`{expr}` returns `{got}`, but it should return `{want}`.",
    "Calling `{expr}` gives `{got}` instead of `{want}`.",
    "I expected `{expr}` to be `{want}`, yet it is `{got}`.",
)
_CLOSERS = ("", "Everything else I tried works as documented.", "Please fix it without changing the signature.",
            "Could you take a look?", "Other inputs seem fine.")


def _problem_statement(instance_id: str, family: Family, failing: list[_Test], correct: types.ModuleType,
                       buggy: types.ModuleType) -> str:
    rng = random.Random(instance_id)
    subject = failing[0].callable_name
    lines = [rng.choice(_OPENERS).format(callable=subject, module=family.module, title=family.title), ""]
    for test in [t for t in failing if t.callable_name == subject][:2]:
        lines.append(_symptom(rng, test.expr, _outcome(test.expr, correct), _outcome(test.expr, buggy)))
    doc = _docstring(correct, subject)
    if doc:
        lines += ["", f'Its docstring says: "{doc}"']
    closer = rng.choice(_CLOSERS)
    return "\n".join(lines + (["", closer] if closer else [])) + "\n"


def _symptom(rng: random.Random, expr: str, want: tuple[str, Any], got: tuple[str, Any]) -> str:
    def show(outcome: tuple[str, Any]) -> str:
        kind, value = outcome
        if kind == "raises":
            text = f"{type(value).__name__}: {value}"
        elif type(value).__repr__ is object.__repr__:  # its repr holds an address: not the same twice
            text = f"a {type(value).__name__} object"
        else:
            text = repr(value)
        return text if len(text) <= 100 else text[:97] + "..."

    if want[0] == "value" and got[0] == "value":
        return rng.choice(_WRONG_VALUE).format(expr=expr, got=show(got), want=show(want))
    if want[0] == "value":
        return f"`{expr}` raises `{show(got)}` instead of returning `{show(want)}`."
    expected = type(want[1]).__name__
    if got[0] == "value":
        return f"`{expr}` returns `{show(got)}`, but it should raise `{expected}`."
    return f"`{expr}` raises `{show(got)}`, but it should raise `{expected}`."


def _docstring(module: types.ModuleType, callable_name: str) -> str:
    obj: Any = module
    for part in callable_name.split("."):
        obj = getattr(obj, part, None)
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return " ".join(doc.split())


def _readme(family: Family) -> str:
    return (f"# {family.module}\n\n{family.title[0].upper()}{family.title[1:]}, in `{family.module}.py` "
            f"(standard library only).\n\nRun the tests with `python3 -m pytest`.\n")


def _diff(path: str, before: str, after: str) -> str:
    body = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{path}", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


def _write_repository(repo: Path, commits: list[tuple[dict[str, str], str, int]]) -> list[str]:
    """A bare git repository at ``repo`` holding ``commits`` (files, message, epoch seconds) in a
    line, ``main`` at the last; the commits' hashes.

    Objects are written directly rather than by running git: five git processes for each of the
    140 repositories made generation take a minute on a busy 2-core machine, and the hashes, which
    depend only on content, names and the fixed dates, come out exactly as git's own.
    """
    (repo / "refs" / "heads").mkdir(parents=True)
    (repo / "refs" / "tags").mkdir()
    (repo / "objects").mkdir()
    (repo / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / "config").write_text("[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = true\n")
    hashes: list[str] = []
    for files, message, epoch in commits:
        tree = _write_tree(repo, {path: text.encode("utf-8") for path, text in files.items()})
        ident = f"{_AUTHOR} {epoch} +0000"
        header = [f"tree {tree}", *(f"parent {h}" for h in hashes[-1:]), f"author {ident}", f"committer {ident}"]
        hashes.append(_write_object(repo, "commit", ("\n".join(header) + f"\n\n{message}\n").encode("utf-8")))
    (repo / "refs" / "heads" / "main").write_text(hashes[-1] + "\n")
    return hashes


def _write_tree(repo: Path, files: dict[str, bytes]) -> str:
    blobs: dict[str, bytes] = {}
    folders: dict[str, dict[str, bytes]] = {}
    for path, data in files.items():
        head, _, rest = path.partition("/")
        if rest:
            folders.setdefault(head, {})[rest] = data
        else:
            blobs[head] = data
    entries = [(name, "100644", _write_object(repo, "blob", data)) for name, data in blobs.items()]
    entries += [(name, "40000", _write_tree(repo, sub)) for name, sub in folders.items()]
    entries.sort(key=lambda e: e[0] + "/" if e[1] == "40000" else e[0])  # git's order: a folder sorts as 'name/'
    body = b"".join(f"{mode} {name}".encode() + b"\0" + bytes.fromhex(sha) for name, mode, sha in entries)
    return _write_object(repo, "tree", body)


def _write_object(repo: Path, kind: str, body: bytes) -> str:
    data = f"{kind} {len(body)}".encode() + b"\0" + body
    digest = hashlib.sha1(data).hexdigest()
    path = repo / "objects" / digest[:2] / digest[2:]
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(zlib.compress(data))
    return digest


# ---------------------------------------------------------------- the families
# Each family: the correct module, test expressions per callable, and the bugs planted one per task.
# Bugs must not make a loop endless: the generator runs every test in-process, with no timeout.

_TEXTSTATS = r'''"""Text statistics: words, sentences, averages."""


def word_count(text):
    """Return the number of whitespace-separated words in text."""
    return len(text.split())


def sentence_count(text):
    """Return the number of sentences, each ending with '.', '!' or '?'."""
    count = 0
    for char in text:
        if char in ".!?":
            count += 1
    return count


def average_word_length(text):
    """Return the mean word length rounded to two decimals (0.0 for no words)."""
    words = text.split()
    if not words:
        return 0.0
    return round(sum(len(w) for w in words) / len(words), 2)


def longest_word(text):
    """Return the longest word; the first one wins a tie ('' for no words)."""
    best = ""
    for word in text.split():
        if len(word) > len(best):
            best = word
    return best


def top_words(text, n=3):
    """Return the n most frequent lower-cased words as (word, count), most frequent first, ties alphabetical."""
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:n]
'''

_MATHUTILS = r'''"""Small math helpers."""


def clamp(value, low, high):
    """Return value limited to the range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    """Return the arithmetic mean; raise ValueError for an empty list."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    """Return the median of the values (the mean of the middle two for an even count)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def is_prime(n):
    """Return True when n is a prime number."""
    if n < 2:
        return False
    divisor = 2
    while divisor * divisor <= n:
        if n % divisor == 0:
            return False
        divisor += 1
    return True


def factorial(n):
    """Return n! for n >= 0."""
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result
'''

_DATEPARSE = r'''"""Parse and format simple dates without the datetime module."""

MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]


def is_leap_year(year):
    """Return True for a Gregorian leap year."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    """Return the number of days in the month (1-12) of the year."""
    if month == 2:
        return 29 if is_leap_year(year) else 28
    if month in (4, 6, 9, 11):
        return 30
    return 31


def parse_iso(text):
    """Parse 'YYYY-MM-DD' into (year, month, day); raise ValueError for a bad date."""
    parts = text.strip().split("-")
    if len(parts) != 3:
        raise ValueError(f"not a date: {text!r}")
    year, month, day = (int(p) for p in parts)
    if not 1 <= month <= 12 or not 1 <= day <= days_in_month(year, month):
        raise ValueError(f"not a date: {text!r}")
    return year, month, day


def parse_month_name(text):
    """Parse '5 Mar 2024' (any case, a month name of 3 or more letters) into (year, month, day)."""
    day, name, year = text.split()
    month = MONTHS.index(name[:3].lower()) + 1
    return int(year), month, int(day)


def format_date(year, month, day):
    """Format as 'YYYY-MM-DD' with zero padding."""
    return f"{year:04d}-{month:02d}-{day:02d}"


def day_of_year(year, month, day):
    """Return the ordinal day in the year, 1 for January 1st."""
    return sum(days_in_month(year, m) for m in range(1, month)) + day
'''

_INVENTORY = r'''"""Stock kept as a dict: item name -> quantity."""


def add_item(stock, name, quantity=1):
    """Return a copy of stock with quantity more of name; quantity must be positive."""
    if quantity <= 0:
        raise ValueError("quantity must be positive")
    updated = dict(stock)
    updated[name] = updated.get(name, 0) + quantity
    return updated


def remove_item(stock, name, quantity=1):
    """Return a copy of stock with quantity less of name, dropping it at zero. Raise KeyError for an unknown item and ValueError when fewer are left."""
    if name not in stock:
        raise KeyError(name)
    if quantity > stock[name]:
        raise ValueError(f"only {stock[name]} {name} left")
    updated = dict(stock)
    updated[name] -= quantity
    if updated[name] == 0:
        del updated[name]
    return updated


def total_units(stock):
    """Return the number of units in stock."""
    return sum(stock.values())


def low_stock(stock, threshold=5):
    """Return the sorted names whose quantity is at or below threshold."""
    return sorted(name for name, count in stock.items() if count <= threshold)


def stock_value(stock, prices):
    """Return the value of the stock at prices (name -> unit price); unpriced items count 0."""
    return sum(count * prices.get(name, 0) for name, count in stock.items())
'''

_STACKQUEUE = r'''"""A stack, a queue and a ring buffer."""


class Stack:
    """Last in, first out."""

    def __init__(self, items=()):
        self._items = list(items)

    def push(self, item):
        """Put item on top; returns the stack."""
        self._items.append(item)
        return self

    def pop(self):
        """Remove and return the top item; IndexError when empty."""
        if not self._items:
            raise IndexError("pop from an empty stack")
        return self._items.pop()

    def peek(self):
        """Return the top item without removing it; None when empty."""
        return self._items[-1] if self._items else None

    def __len__(self):
        return len(self._items)


class Queue:
    """First in, first out."""

    def __init__(self, items=()):
        self._items = list(items)

    def enqueue(self, item):
        """Add item at the back; returns the queue."""
        self._items.append(item)
        return self

    def dequeue(self):
        """Remove and return the oldest item; IndexError when empty."""
        if not self._items:
            raise IndexError("dequeue from an empty queue")
        return self._items.pop(0)

    def __len__(self):
        return len(self._items)


class RingBuffer:
    """Keeps the last `capacity` items appended (capacity at least 1)."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._items = []

    def append(self, item):
        """Add item, dropping the oldest when full; returns the buffer."""
        self._items.append(item)
        if len(self._items) > self.capacity:
            del self._items[0]
        return self

    def items(self):
        """Return the kept items, oldest first."""
        return list(self._items)
'''

_VALIDATORS = r'''"""Input validation helpers."""

import re

_EMAIL = re.compile(r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+$")


def is_valid_email(address):
    """Return True for an address like 'name@example.org'."""
    return bool(_EMAIL.match(address))


def is_strong_password(password, min_length=8):
    """Return True when the password has min_length or more characters, a digit, a lower and an upper case letter."""
    return (len(password) >= min_length
            and any(c.isdigit() for c in password)
            and any(c.islower() for c in password)
            and any(c.isupper() for c in password))


def is_valid_username(name):
    """Return True for 3 to 16 letters, digits and '_', not starting with a digit."""
    if not 3 <= len(name) <= 16:
        return False
    if name[0].isdigit():
        return False
    return all(c.isalnum() or c == "_" for c in name)


def luhn_valid(number):
    """Return True when the digit string passes the Luhn checksum (spaces ignored)."""
    digits = [int(c) for c in number.replace(" ", "")]
    total = 0
    for index, digit in enumerate(reversed(digits)):
        if index % 2 == 1:
            digit *= 2
            if digit > 9:
                digit -= 9
        total += digit
    return total % 10 == 0


def is_valid_ipv4(address):
    """Return True for four dot-separated numbers 0-255 without leading zeros."""
    parts = address.split(".")
    if len(parts) != 4:
        return False
    for part in parts:
        if not part.isdigit() or int(part) > 255:
            return False
        if len(part) > 1 and part[0] == "0":
            return False
    return True
'''

_STRUTILS = r'''"""String helpers."""


def slugify(text):
    """Lower-case runs of letters and digits joined by '-' ('Hello, World!' gives 'hello-world')."""
    words = []
    current = ""
    for char in text.lower():
        if char.isalnum():
            current += char
        elif current:
            words.append(current)
            current = ""
    if current:
        words.append(current)
    return "-".join(words)


def truncate(text, width, suffix="..."):
    """Cut text to at most width characters, ending with suffix when it was cut."""
    if len(text) <= width:
        return text
    return text[:width - len(suffix)] + suffix


def title_case(text, minor=("a", "an", "the", "of", "and")):
    """Capitalise each word except minor words that are not first."""
    words = text.lower().split()
    result = []
    for index, word in enumerate(words):
        if index > 0 and word in minor:
            result.append(word)
        else:
            result.append(word[:1].upper() + word[1:])
    return " ".join(result)


def is_palindrome(text):
    """True when the letters and digits read the same both ways, ignoring case."""
    cleaned = [c.lower() for c in text if c.isalnum()]
    return cleaned == cleaned[::-1]


def camel_to_snake(name):
    """Convert 'parseHttpResponse' to 'parse_http_response'."""
    out = []
    for index, char in enumerate(name):
        if char.isupper() and index > 0:
            out.append("_")
        out.append(char.lower())
    return "".join(out)


def count_vowels(text):
    """Return the number of vowels (a, e, i, o, u, any case)."""
    return sum(1 for c in text.lower() if c in "aeiou")
'''

_MONEY = r'''"""Money amounts in integer cents."""


def parse_amount(text):
    """Parse '12.34', '$1,234.5' or '-0.99' into cents; raise ValueError otherwise."""
    cleaned = text.strip().replace(",", "").replace("$", "")
    negative = cleaned.startswith("-")
    if negative:
        cleaned = cleaned[1:]
    whole, _, fraction = cleaned.partition(".")
    if not whole.isdigit() or (fraction and not fraction.isdigit()) or len(fraction) > 2:
        raise ValueError(f"not an amount: {text!r}")
    cents = int(whole) * 100 + int(fraction.ljust(2, "0"))
    return -cents if negative else cents


def format_cents(cents, symbol="$"):
    """Format cents as '$1,234.50' ('-$0.99' for a negative amount)."""
    sign = "-" if cents < 0 else ""
    whole, rest = divmod(abs(cents), 100)
    return f"{sign}{symbol}{whole:,}.{rest:02d}"


def split_bill(total_cents, people):
    """Split total_cents among people; the first ones pay a cent more when it does not divide evenly."""
    if people < 1:
        raise ValueError("need at least one person")
    share, extra = divmod(total_cents, people)
    return [share + 1 if i < extra else share for i in range(people)]


def apply_discount(cents, percent):
    """Return the price after a percent discount, rounded half up to the cent."""
    if not 0 <= percent <= 100:
        raise ValueError("percent must be within 0-100")
    return (cents * (100 - percent) + 50) // 100


def add_tax(cents, rate_percent):
    """Return the price with tax added, the tax rounded half up to the cent."""
    return cents + (cents * rate_percent + 50) // 100
'''

_MATRIX = r'''"""Matrices as lists of rows."""


def shape(matrix):
    """Return (rows, columns); (0, 0) for an empty matrix."""
    if not matrix:
        return (0, 0)
    return (len(matrix), len(matrix[0]))


def transpose(matrix):
    """Return the transpose."""
    return [list(column) for column in zip(*matrix)]


def add(a, b):
    """Return the element-wise sum; ValueError when the shapes differ."""
    if shape(a) != shape(b):
        raise ValueError("shapes differ")
    return [[x + y for x, y in zip(row_a, row_b)] for row_a, row_b in zip(a, b)]


def multiply(a, b):
    """Return the matrix product; ValueError when a's column count differs from b's row count."""
    rows, inner = shape(a)
    if inner != shape(b)[0]:
        raise ValueError("shapes do not align")
    columns = shape(b)[1]
    return [[sum(a[i][k] * b[k][j] for k in range(inner)) for j in range(columns)] for i in range(rows)]


def identity(n):
    """Return the n x n identity matrix."""
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]


def trace(matrix):
    """Return the sum of the main diagonal of a square matrix."""
    return sum(matrix[i][i] for i in range(len(matrix)))
'''

_UNITS = r'''"""Unit conversions and durations."""


def celsius_to_fahrenheit(celsius):
    """Convert degrees Celsius to Fahrenheit."""
    return celsius * 9 / 5 + 32


def fahrenheit_to_celsius(fahrenheit):
    """Convert degrees Fahrenheit to Celsius."""
    return (fahrenheit - 32) * 5 / 9


def km_to_miles(km, digits=2):
    """Convert kilometres to miles, rounded to digits decimals."""
    return round(km * 0.621371, digits)


def parse_duration(text):
    """Parse '1h30m', '45m', '2h' or '90s' (any case) into seconds; ValueError otherwise."""
    units = {"h": 3600, "m": 60, "s": 1}
    total = 0
    number = ""
    for char in text.strip().lower():
        if char.isdigit():
            number += char
        elif char in units and number:
            total += int(number) * units[char]
            number = ""
        else:
            raise ValueError(f"bad duration: {text!r}")
    if number:
        raise ValueError(f"missing unit in {text!r}")
    return total


def format_duration(seconds):
    """Format seconds as 'H:MM:SS'."""
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def bytes_to_human(size):
    """Format a byte count in the largest unit that keeps it at 1 or more, e.g. '1.5 KiB'."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    value = float(size)
    for unit in units:
        if value < 1024 or unit == units[-1]:
            return f"{value:.1f} {unit}"
        value /= 1024
'''

_ROMAN = r'''"""Roman numerals."""

_VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
           (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
_DIGITS = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def to_roman(number):
    """Return the Roman numeral for 1 <= number <= 3999; ValueError otherwise."""
    if not 1 <= number <= 3999:
        raise ValueError("out of range")
    out = []
    for value, letters in _VALUES:
        while number >= value:
            out.append(letters)
            number -= value
    return "".join(out)


def from_roman(text):
    """Return the integer a Roman numeral (any case) stands for."""
    total = 0
    text = text.upper()
    for index, letter in enumerate(text):
        value = _DIGITS[letter]
        if index + 1 < len(text) and _DIGITS[text[index + 1]] > value:
            total -= value
        else:
            total += value
    return total


def is_roman(text):
    """True when text is the canonical numeral of some number (any case)."""
    try:
        return to_roman(from_roman(text)) == text.upper()
    except (KeyError, ValueError):
        return False
'''

_INTERVALS = r'''"""Closed integer intervals as (start, end) pairs."""


def overlaps(a, b):
    """True when the intervals share at least one point."""
    return a[0] <= b[1] and b[0] <= a[1]


def merge(intervals):
    """Merge overlapping or touching intervals; return them sorted."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(interval):
    """Number of integer points in the interval."""
    return interval[1] - interval[0] + 1


def total_covered(intervals):
    """Number of integer points covered by any of the intervals."""
    return sum(length(i) for i in merge(intervals))


def contains(interval, point):
    """True when point lies in the interval."""
    return interval[0] <= point <= interval[1]


def gaps(intervals, start, end):
    """The sub-intervals of [start, end] that none of the intervals covers."""
    result = []
    cursor = start
    for lo, hi in merge(intervals):
        if lo > cursor:
            result.append((cursor, min(lo - 1, end)))
        cursor = max(cursor, hi + 1)
        if cursor > end:
            break
    if cursor <= end:
        result.append((cursor, end))
    return result
'''

_TEXTFORMAT = r'''"""Plain-text formatting."""


def wrap(text, width=20):
    """Break text into lines of at most width characters at spaces (a longer word gets its own line)."""
    lines = []
    current = ""
    for word in text.split():
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        lines.append(current)
    return lines


def center(text, width, fill=" "):
    """Center text in width characters; an odd leftover goes to the right."""
    if len(text) >= width:
        return text
    left = (width - len(text)) // 2
    right = width - len(text) - left
    return fill * left + text + fill * right


def indent(text, prefix="    "):
    """Prefix every non-blank line with prefix."""
    return "\n".join(prefix + line if line.strip() else line for line in text.split("\n"))


def bullet_list(items, marker="-"):
    """One line per item, '- item'; an empty list gives ''."""
    return "\n".join(f"{marker} {item}" for item in items)


def table_row(cells, widths):
    """Cells left-aligned in columns of the given widths, separated by ' | '."""
    return " | ".join(str(cell).ljust(width) for cell, width in zip(cells, widths))
'''

_CSVLITE = r'''"""A tiny CSV reader and writer (comma separated, double-quoted fields)."""


def parse_line(line):
    """Split one CSV line into fields; quotes allow commas, and '""' inside quotes is one quote."""
    fields = []
    current = ""
    in_quotes = False
    index = 0
    while index < len(line):
        char = line[index]
        if in_quotes:
            if char == '"' and index + 1 < len(line) and line[index + 1] == '"':
                current += '"'
                index += 1
            elif char == '"':
                in_quotes = False
            else:
                current += char
        elif char == '"':
            in_quotes = True
        elif char == ",":
            fields.append(current)
            current = ""
        else:
            current += char
        index += 1
    fields.append(current)
    return fields


def format_field(value):
    """The field as CSV: quoted when it holds a comma, a quote or a newline."""
    text = str(value)
    if any(c in text for c in ',"\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def format_line(values):
    """One CSV line of the values."""
    return ",".join(format_field(v) for v in values)


def read_records(text, header=True):
    """Rows as dicts keyed by the header row (lists with header=False); blank lines are skipped."""
    rows = [parse_line(line) for line in text.splitlines() if line.strip()]
    if not header:
        return rows
    names = rows[0]
    return [dict(zip(names, row)) for row in rows[1:]]
'''

_GRADES = r'''"""Course grades."""


def letter_grade(score):
    """A from 90, B from 80, C from 70, D from 60, else F; ValueError outside 0-100."""
    if not 0 <= score <= 100:
        raise ValueError(f"score out of range: {score}")
    for floor, letter in ((90, "A"), (80, "B"), (70, "C"), (60, "D")):
        if score >= floor:
            return letter
    return "F"


def weighted_average(scores, weights):
    """Average of scores weighted by weights, rounded to one decimal; ValueError unless one weight per score."""
    if len(scores) != len(weights) or not scores:
        raise ValueError("need one weight per score")
    total_weight = sum(weights)
    return round(sum(s * w for s, w in zip(scores, weights)) / total_weight, 1)


def drop_lowest(scores, count=1):
    """The scores without the count lowest ones, in their original order."""
    if count <= 0:
        return list(scores)
    dropped = sorted(scores)[:count]
    kept = list(scores)
    for score in dropped:
        kept.remove(score)
    return kept


def class_rank(scores, student):
    """1-based rank of student in scores (name -> score); equal scores share a rank."""
    mine = scores[student]
    return 1 + sum(1 for other in scores.values() if other > mine)


def pass_rate(scores, passing=60):
    """Share of scores at or above passing, rounded to two decimals (0.0 for no scores)."""
    if not scores:
        return 0.0
    return round(sum(1 for s in scores if s >= passing) / len(scores), 2)
'''

_ORDERS = r'''"""Order totals in cents."""

SHIPPING_FREE_FROM = 5000
SHIPPING_FLAT = 499


def line_total(price_cents, quantity, discount_percent=0):
    """Price times quantity less a percent discount, rounded down to the cent."""
    return price_cents * quantity * (100 - discount_percent) // 100


def subtotal(lines):
    """Sum of line totals; a line is (price_cents, quantity) or (price_cents, quantity, discount_percent)."""
    return sum(line_total(*line) for line in lines)


def shipping(subtotal_cents):
    """Free from SHIPPING_FREE_FROM cents on, else the flat rate; an empty order ships for nothing."""
    if subtotal_cents == 0:
        return 0
    return 0 if subtotal_cents >= SHIPPING_FREE_FROM else SHIPPING_FLAT


def order_total(lines, coupon_cents=0):
    """Subtotal less a coupon (never below zero), plus shipping on the subtotal."""
    sub = subtotal(lines)
    return max(sub - coupon_cents, 0) + shipping(sub)


def bulk_discount(quantity):
    """Percent off for buying in bulk: 10 from 10 items, 20 from 50."""
    if quantity >= 50:
        return 20
    if quantity >= 10:
        return 10
    return 0
'''

_CONTACTS = r'''"""Contact records."""


def normalize_phone(text):
    """Digits only, keeping a leading '+'; ValueError with fewer than 7 digits."""
    digits = "".join(c for c in text if c.isdigit())
    if len(digits) < 7:
        raise ValueError(f"not a phone number: {text!r}")
    return ("+" if text.strip().startswith("+") else "") + digits


def split_name(full_name):
    """(first, last) of a full name; middle names go with the first; a single name has last ''."""
    parts = full_name.split()
    if len(parts) == 1:
        return parts[0], ""
    return " ".join(parts[:-1]), parts[-1]


def initials(full_name):
    """Upper-case initials with dots: 'ada king lovelace' gives 'A.K.L.'."""
    return "".join(part[0].upper() + "." for part in full_name.split())


def sort_contacts(contacts):
    """Contacts (dicts with 'first' and 'last') sorted by last then first name, ignoring case."""
    return sorted(contacts, key=lambda c: (c["last"].lower(), c["first"].lower()))


def find_by_prefix(names, prefix):
    """Names starting with prefix, ignoring case, in their original order."""
    prefix = prefix.lower()
    return [name for name in names if name.lower().startswith(prefix)]
'''

_LEDGER = r'''"""A ledger of (kind, amount_cents) transactions, kind 'deposit' or 'withdrawal'."""


def balance(transactions, opening=0):
    """Opening balance plus deposits minus withdrawals; ValueError for another kind."""
    total = opening
    for kind, amount in transactions:
        if kind == "deposit":
            total += amount
        elif kind == "withdrawal":
            total -= amount
        else:
            raise ValueError(f"unknown kind: {kind!r}")
    return total


def can_withdraw(transactions, amount, overdraft=0):
    """True when the balance covers amount, allowing overdraft cents below zero."""
    return balance(transactions) + overdraft >= amount


def monthly_interest(balance_cents, annual_rate_percent):
    """One month of interest on a positive balance, rounded down to the cent; 0 otherwise."""
    if balance_cents <= 0:
        return 0
    return balance_cents * annual_rate_percent // 1200


def largest_withdrawal(transactions):
    """The largest withdrawal amount, or 0 with none."""
    amounts = [amount for kind, amount in transactions if kind == "withdrawal"]
    return max(amounts) if amounts else 0


def running_balances(transactions, opening=0):
    """The balance after each transaction."""
    result = []
    total = opening
    for transaction in transactions:
        total = balance([transaction], opening=total)
        result.append(total)
    return result
'''

_LISTUTILS = r'''"""List helpers."""


def binary_search(items, target):
    """Index of target in the sorted list items, or -1."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1


def chunk(items, size):
    """Consecutive pieces of at most size items; ValueError for a size below 1."""
    if size < 1:
        raise ValueError("size must be at least 1")
    return [items[i:i + size] for i in range(0, len(items), size)]


def flatten(nested):
    """Flatten lists nested to any depth."""
    flat = []
    for item in nested:
        if isinstance(item, list):
            flat.extend(flatten(item))
        else:
            flat.append(item)
    return flat


def dedupe(items):
    """Items without repeats, in the order of their first occurrence."""
    seen = set()
    result = []
    for item in items:
        if item not in seen:
            seen.add(item)
            result.append(item)
    return result


def rotate(items, steps):
    """Rotate right by steps (negative steps rotate left)."""
    if not items:
        return []
    steps %= len(items)
    return items[-steps:] + items[:-steps] if steps else list(items)


def pairwise_sums(items):
    """Sums of neighbouring items."""
    return [items[i] + items[i + 1] for i in range(len(items) - 1)]
'''

_SETTINGS = r'''"""Read 'key = value' settings with [sections] and '#' comments."""


def parse_bool(text):
    """'yes', 'true', 'on', '1' are True; 'no', 'false', 'off', '0' are False (any case); ValueError otherwise."""
    value = text.strip().lower()
    if value in ("yes", "true", "on", "1"):
        return True
    if value in ("no", "false", "off", "0"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_settings(text):
    """{section: {key: value}}; keys before any section go in section ''."""
    settings = {"": {}}
    section = ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            settings.setdefault(section, {})
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"not a setting: {raw!r}")
        settings[section][key.strip()] = value.strip()
    return settings


def get_int(settings, section, key, default=0):
    """The setting as an int, or default when it is missing."""
    value = settings.get(section, {}).get(key)
    return default if value is None else int(value)


def merge_settings(base, override):
    """base with override's sections merged in key by key (override wins)."""
    merged = {name: dict(values) for name, values in base.items()}
    for name, values in override.items():
        merged.setdefault(name, {}).update(values)
    return merged
'''

FAMILIES: tuple[Family, ...] = (
    Family("textstats", "text statistics helpers", _TEXTSTATS, {
        "word_count": ('word_count("hello world")', 'word_count("  many   spaces here ")', 'word_count("")',
                       'word_count("one")'),
        "sentence_count": ('sentence_count("Hi. How are you? Great!")', 'sentence_count("no end")',
                           'sentence_count("Stop!")'),
        "average_word_length": ('average_word_length("ab abcd")', 'average_word_length("")',
                                'average_word_length("a bb ccc")'),
        "longest_word": ('longest_word("a abc ab")', 'longest_word("tie tie2 four")', 'longest_word("")'),
        "top_words": ('top_words("b a b c a b")', 'top_words("x y z", n=2)', 'top_words("A a B")'),
    }, (
        Bug("wrong comparison", "if len(word) > len(best):", "if len(word) >= len(best):"),
        Bug("off-by-one", "/ len(words), 2)", "/ (len(words) + 1), 2)"),
        Bug("missing case", 'if char in ".!?":', 'if char in ".!":'),
        Bug("wrong default", "def top_words(text, n=3):", "def top_words(text, n=2):"),
        Bug("missing normalisation", "for word in text.lower().split():", "for word in text.split():"),
        Bug("wrong sort order", "key=lambda item: (-item[1], item[0])", "key=lambda item: (item[1], item[0])"),
        Bug("wrong split", "return len(text.split())", 'return len(text.split(" "))'),
    )),
    Family("mathutils", "small math helpers", _MATHUTILS, {
        "clamp": ("clamp(5, 0, 10)", "clamp(-3, 0, 10)", "clamp(12, 0, 10)", "clamp(10, 0, 10)"),
        "mean": ("mean([1, 2, 3, 4])", "mean([])", "mean([5])"),
        "median": ("median([3, 1, 2])", "median([4, 1, 3, 2])", "median([7])"),
        "is_prime": ("is_prime(2)", "is_prime(1)", "is_prime(9)", "is_prime(13)", "is_prime(25)"),
        "factorial": ("factorial(0)", "factorial(5)", "factorial(1)"),
    }, (
        Bug("swapped values", "if value < low:\n        return low", "if value < low:\n        return high"),
        Bug("off-by-one", "(ordered[middle - 1] + ordered[middle]) / 2", "(ordered[middle] + ordered[middle + 1]) / 2"),
        Bug("missing sort", "ordered = sorted(values)", "ordered = list(values)"),
        Bug("wrong comparison", "while divisor * divisor <= n:", "while divisor * divisor < n:"),
        Bug("off-by-one", "if n < 2:", "if n < 1:"),
        Bug("off-by-one", "range(2, n + 1)", "range(2, n)"),
        Bug("missing case", '    if not values:\n        raise ValueError("mean of an empty list")\n', ""),
    )),
    Family("dateparse", "date parsing helpers", _DATEPARSE, {
        "is_leap_year": ("is_leap_year(2024)", "is_leap_year(1900)", "is_leap_year(2000)", "is_leap_year(2023)"),
        "days_in_month": ("days_in_month(2024, 2)", "days_in_month(2023, 2)", "days_in_month(2023, 4)",
                          "days_in_month(2023, 11)", "days_in_month(2023, 12)"),
        "parse_iso": ('parse_iso("2024-03-05")', 'parse_iso(" 1999-12-31 ")', 'parse_iso("2023-02-29")',
                      'parse_iso("2024-13-01")', 'parse_iso("2024/01/01")'),
        "parse_month_name": ('parse_month_name("5 Mar 2024")', 'parse_month_name("17 SEPTEMBER 1999")',
                             'parse_month_name("1 jan 2000")'),
        "format_date": ("format_date(2024, 3, 5)", "format_date(999, 12, 1)"),
        "day_of_year": ("day_of_year(2024, 1, 1)", "day_of_year(2024, 3, 1)", "day_of_year(2023, 12, 31)"),
    }, (
        Bug("missing case", "year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)", "year % 4 == 0 and year % 100 != 0"),
        Bug("missing case", "if month in (4, 6, 9, 11):", "if month in (4, 6, 9):"),
        Bug("off-by-one", "not 1 <= day <= days_in_month(year, month)", "not 1 <= day < days_in_month(year, month)"),
        Bug("off-by-one", "MONTHS.index(name[:3].lower()) + 1", "MONTHS.index(name[:3].lower())"),
        Bug("missing normalisation", "MONTHS.index(name[:3].lower())", "MONTHS.index(name[:3])"),
        Bug("swapped arguments", 'f"{year:04d}-{month:02d}-{day:02d}"', 'f"{year:04d}-{day:02d}-{month:02d}"'),
        Bug("off-by-one", "for m in range(1, month)) + day", "for m in range(1, month + 1)) + day"),
        Bug("swapped values", "return int(year), month, int(day)", "return int(day), month, int(year)"),
    )),
    Family("inventory", "stock-keeping helpers", _INVENTORY, {
        "add_item": ('add_item({"apple": 2}, "apple", 3)', 'add_item({}, "pear")', 'add_item({"a": 1}, "a", 0)',
                     'add_item({"a": 1}, "a", -2)'),
        "remove_item": ('remove_item({"apple": 5}, "apple", 2)', 'remove_item({"apple": 2}, "apple", 2)',
                        'remove_item({"apple": 1}, "kiwi")', 'remove_item({"apple": 1}, "apple", 3)',
                        'remove_item({"a": 3}, "a")'),
        "total_units": ('total_units({"a": 2, "b": 5})', "total_units({})"),
        "low_stock": ('low_stock({"a": 5, "b": 6, "c": 1})', 'low_stock({"a": 5, "b": 6}, threshold=6)',
                      'low_stock({"z": 0, "m": 2})'),
        "stock_value": ('stock_value({"a": 2, "b": 3}, {"a": 1.5, "b": 2})', 'stock_value({"a": 2}, {})'),
    }, (
        Bug("wrong comparison", "if quantity <= 0:", "if quantity < 0:"),
        Bug("wrong comparison", "if quantity > stock[name]:", "if quantity >= stock[name]:"),
        Bug("missing case", "    if updated[name] == 0:\n        del updated[name]\n", ""),
        Bug("wrong comparison", "if count <= threshold)", "if count < threshold)"),
        Bug("wrong default", "def low_stock(stock, threshold=5):", "def low_stock(stock, threshold=3):"),
        Bug("missing case", "prices.get(name, 0)", "prices[name]"),
    )),
    Family("stackqueue", "stack, queue and ring buffer classes", _STACKQUEUE, {
        "Stack.pop": ("Stack([1, 2, 3]).pop()", 'Stack().push("a").push("b").pop()', "Stack().pop()"),
        "Stack.peek": ("Stack([4, 5]).peek()", "Stack().peek()", "len(Stack([1, 2]).push(3))"),
        "Queue.dequeue": ("Queue([1, 2, 3]).dequeue()", 'Queue().enqueue("x").enqueue("y").dequeue()',
                          "Queue().dequeue()", "len(Queue([1]))"),
        "RingBuffer": ("RingBuffer(0)", "RingBuffer(2).capacity"),
        "RingBuffer.append": ("RingBuffer(2).append(1).append(2).append(3).items()", "RingBuffer(3).append(1).items()",
                              'RingBuffer(1).append("a").append("b").items()'),
    }, (
        Bug("wrong end", "        return self._items.pop()\n", "        return self._items.pop(0)\n"),
        Bug("wrong index", "return self._items[-1] if self._items else None", "return self._items[0] if self._items else None"),
        Bug("wrong end", "return self._items.pop(0)", "return self._items.pop()"),
        Bug("off-by-one", "if len(self._items) > self.capacity:", "if len(self._items) >= self.capacity:"),
        Bug("off-by-one", "if capacity < 1:", "if capacity < 0:"),
        Bug("missing case", "return self._items[-1] if self._items else None", "return self._items[-1]"),
    )),
    Family("validators", "input validation helpers", _VALIDATORS, {
        "is_valid_email": ('is_valid_email("ann@example.org")', 'is_valid_email("ann.lee+tag@mail.example.co.uk")',
                           'is_valid_email("ann@localhost")', 'is_valid_email("@example.org")',
                           'is_valid_email("ann@@example.org")'),
        "is_strong_password": ('is_strong_password("Secret123")', 'is_strong_password("Secret12")',
                               'is_strong_password("secret123")', 'is_strong_password("Sh0rt")',
                               'is_strong_password("Abcdefg1", min_length=9)', 'is_strong_password("ABCDEFG1")'),
        "is_valid_username": ('is_valid_username("ann_lee")', 'is_valid_username("ab")', 'is_valid_username("9lives")',
                              'is_valid_username("a" * 16)', 'is_valid_username("a" * 17)',
                              'is_valid_username("bad-name")'),
        "luhn_valid": ('luhn_valid("4539 1488 0343 6467")', 'luhn_valid("8273 1232 7352 0569")', 'luhn_valid("0")',
                       'luhn_valid("79927398713")'),
        "is_valid_ipv4": ('is_valid_ipv4("192.168.0.1")', 'is_valid_ipv4("255.255.255.255")',
                          'is_valid_ipv4("256.1.1.1")', 'is_valid_ipv4("1.2.3")', 'is_valid_ipv4("01.2.3.4")',
                          'is_valid_ipv4("0.0.0.0")', 'is_valid_ipv4("a.b.c.d")'),
    }, (
        Bug("off-by-one", "len(password) >= min_length", "len(password) > min_length"),
        Bug("missing case", "\n            and any(c.isupper() for c in password))", ")"),
        Bug("off-by-one", "if not 3 <= len(name) <= 16:", "if not 3 <= len(name) < 16:"),
        Bug("missing case", "    if name[0].isdigit():\n        return False\n", ""),
        Bug("wrong parity", "if index % 2 == 1:", "if index % 2 == 0:"),
        Bug("wrong constant", "digit -= 9", "digit -= 10"),
        Bug("wrong comparison", "int(part) > 255", "int(part) >= 255"),
        Bug("off-by-one", 'if len(part) > 1 and part[0] == "0":', 'if len(part) > 2 and part[0] == "0":'),
        Bug("wrong quantifier", r"(\.[A-Za-z0-9-]+)+$", r"(\.[A-Za-z0-9-]+)*$"),
    )),
    Family("strutils", "string helpers", _STRUTILS, {
        "slugify": ('slugify("Hello, World!")', 'slugify("  Many   spaces ")', 'slugify("Python 3 rocks")',
                    'slugify("")'),
        "truncate": ('truncate("hello world", 8)', 'truncate("short", 10)', 'truncate("exactly", 7)',
                     'truncate("abcdef", 4, suffix="~")'),
        "title_case": ('title_case("the lord of the rings")', 'title_case("a tale OF two cities")',
                       'title_case("war and peace")'),
        "is_palindrome": ('is_palindrome("A man, a plan, a canal: Panama")', 'is_palindrome("hello")',
                          'is_palindrome("")', "is_palindrome(\"No 'x' in Nixon\")"),
        "camel_to_snake": ('camel_to_snake("parseHttpResponse")', 'camel_to_snake("Name")',
                           'camel_to_snake("already_snake")'),
        "count_vowels": ('count_vowels("Hello World")', 'count_vowels("AEIOU")', 'count_vowels("rhythm")'),
    }, (
        Bug("missing case", "    if current:\n        words.append(current)\n    return", "    return"),
        Bug("off-by-one", "if len(text) <= width:", "if len(text) < width:"),
        Bug("off-by-one", "return text[:width - len(suffix)] + suffix", "return text[:width] + suffix"),
        Bug("missing case", "if index > 0 and word in minor:", "if word in minor:"),
        Bug("missing normalisation", "words = text.lower().split()", "words = text.split()"),
        Bug("missing case", "if char.isupper() and index > 0:", "if char.isupper():"),
        Bug("missing normalisation", "cleaned = [c.lower() for c", "cleaned = [c for c"),
        Bug("missing normalisation", "for c in text.lower() if c in", "for c in text if c in"),
        Bug("wrong default", 'def truncate(text, width, suffix="..."):', 'def truncate(text, width, suffix=".."):'),
    )),
    Family("money", "money helpers working in cents", _MONEY, {
        "parse_amount": ('parse_amount("12.34")', 'parse_amount("$1,234.5")', 'parse_amount("-0.99")',
                         'parse_amount("7")', 'parse_amount("1.234")', 'parse_amount("abc")'),
        "format_cents": ("format_cents(123450)", "format_cents(-99)", "format_cents(5)",
                         'format_cents(100, symbol="€")'),
        "split_bill": ("split_bill(100, 3)", "split_bill(90, 3)", "split_bill(5, 1)", "split_bill(10, 0)"),
        "apply_discount": ("apply_discount(1000, 15)", "apply_discount(999, 50)", "apply_discount(1234, 0)",
                           "apply_discount(100, 101)"),
        "add_tax": ("add_tax(1000, 8)", "add_tax(999, 7)", "add_tax(0, 20)"),
    }, (
        Bug("wrong padding", 'int(fraction.ljust(2, "0"))', 'int(fraction.rjust(2, "0"))'),
        Bug("off-by-one", "or len(fraction) > 2:", "or len(fraction) > 3:"),
        Bug("missing padding", "{whole:,}.{rest:02d}", "{whole:,}.{rest}"),
        Bug("missing case", 'sign = "-" if cents < 0 else ""', 'sign = ""'),
        Bug("off-by-one", "share + 1 if i < extra else share", "share + 1 if i <= extra else share"),
        Bug("missing rounding", "(cents * (100 - percent) + 50) // 100", "(cents * (100 - percent)) // 100"),
        Bug("missing term", "return cents + (cents * rate_percent + 50) // 100", "return (cents * rate_percent + 50) // 100"),
        Bug("off-by-one", "if people < 1:", "if people < 0:"),
    )),
    Family("matrix", "matrix helpers over lists of rows", _MATRIX, {
        "shape": ("shape([[1, 2, 3], [4, 5, 6]])", "shape([])"),
        "transpose": ("transpose([[1, 2, 3], [4, 5, 6]])", "transpose([[1]])"),
        "add": ("add([[1, 2]], [[3, 4]])", "add([[1]], [[1, 2]])"),
        "multiply": ("multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]])", "multiply([[1, 2, 3]], [[1], [2], [3]])",
                     "multiply([[1, 2]], [[1, 2]])"),
        "identity": ("identity(3)", "identity(1)"),
        "trace": ("trace([[1, 2], [3, 4]])", "trace([[5, 0, 0], [0, 5, 0], [0, 0, 5]])"),
    }, (
        Bug("swapped values", "return (len(matrix), len(matrix[0]))", "return (len(matrix[0]), len(matrix))"),
        Bug("swapped indices", "a[i][k] * b[k][j]", "a[i][k] * b[j][k]"),
        Bug("missing check", '    if shape(a) != shape(b):\n        raise ValueError("shapes differ")\n', ""),
        Bug("wrong comparison", "1 if i == j else 0", "1 if i <= j else 0"),
        Bug("off-by-one", "for i in range(len(matrix)))", "for i in range(len(matrix) - 1))"),
        Bug("wrong dimension", "if inner != shape(b)[0]:", "if inner != shape(b)[1]:"),
    )),
    Family("units", "unit conversions and durations", _UNITS, {
        "celsius_to_fahrenheit": ("celsius_to_fahrenheit(100)", "celsius_to_fahrenheit(0)",
                                  "celsius_to_fahrenheit(-40)"),
        "fahrenheit_to_celsius": ("fahrenheit_to_celsius(212)", "fahrenheit_to_celsius(32)",
                                  "fahrenheit_to_celsius(-40)"),
        "km_to_miles": ("km_to_miles(10)", "km_to_miles(42.195, digits=1)", "km_to_miles(0)"),
        "parse_duration": ('parse_duration("1h30m")', 'parse_duration("45m")', 'parse_duration("90s")',
                           'parse_duration("2H")', 'parse_duration("10")', 'parse_duration("5x")'),
        "format_duration": ("format_duration(3661)", "format_duration(59)", "format_duration(36000)"),
        "bytes_to_human": ("bytes_to_human(512)", "bytes_to_human(1536)", "bytes_to_human(1048576)",
                           "bytes_to_human(1023)", "bytes_to_human(1024)"),
    }, (
        Bug("wrong formula", "return celsius * 9 / 5 + 32", "return celsius * 5 / 9 + 32"),
        Bug("operator precedence", "return (fahrenheit - 32) * 5 / 9", "return fahrenheit - 32 * 5 / 9"),
        Bug("wrong default", "def km_to_miles(km, digits=2):", "def km_to_miles(km, digits=1):"),
        Bug("missing normalisation", "for char in text.strip().lower():", "for char in text.strip():"),
        Bug("missing check", '    if number:\n        raise ValueError(f"missing unit in {text!r}")\n', ""),
        Bug("swapped arguments", 'f"{hours}:{minutes:02d}:{secs:02d}"', 'f"{hours}:{secs:02d}:{minutes:02d}"'),
        Bug("off-by-one", "if value < 1024 or", "if value <= 1024 or"),
    )),
    Family("roman", "Roman numeral conversion", _ROMAN, {
        "to_roman": ("to_roman(1994)", "to_roman(4)", "to_roman(3999)", "to_roman(9)", "to_roman(40)", "to_roman(0)",
                     "to_roman(4000)"),
        "from_roman": ('from_roman("MCMXCIV")', 'from_roman("iv")', 'from_roman("XLII")', 'from_roman("MMXXIV")'),
        "is_roman": ('is_roman("XIV")', 'is_roman("IIII")', 'is_roman("ABC")', 'is_roman("mcm")'),
    }, (
        Bug("missing case", '(1000, "M"), (900, "CM"), ', '(1000, "M"), '),
        Bug("wrong comparison", "while number >= value:", "while number > value:"),
        Bug("wrong comparison", "_DIGITS[text[index + 1]] > value", "_DIGITS[text[index + 1]] >= value"),
        Bug("missing normalisation", "    text = text.upper()\n", ""),
        Bug("off-by-one", "if not 1 <= number <= 3999:", "if not 1 <= number < 3999:"),
        Bug("off-by-one", "if index + 1 < len(text) and", "if index + 1 <= len(text) and"),
    )),
    Family("intervals", "integer interval helpers", _INTERVALS, {
        "overlaps": ("overlaps((1, 5), (5, 9))", "overlaps((1, 2), (3, 4))", "overlaps((3, 8), (1, 4))",
                     "overlaps((1, 10), (2, 3))"),
        "merge": ("merge([(5, 8), (1, 3), (2, 4)])", "merge([(1, 2), (4, 5)])", "merge([(1, 10), (2, 3)])",
                  "merge([])"),
        "length": ("length((3, 7))", "length((4, 4))"),
        "total_covered": ("total_covered([(1, 3), (2, 5), (10, 10)])",),
        "contains": ("contains((1, 5), 5)", "contains((1, 5), 0)", "contains((1, 5), 1)"),
        "gaps": ("gaps([(2, 3), (6, 7)], 1, 9)", "gaps([], 1, 3)", "gaps([(0, 10)], 2, 5)"),
    }, (
        Bug("wrong comparison", "and b[0] <= a[1]", "and b[0] < a[1]"),
        Bug("off-by-one", "start <= merged[-1][1] + 1:", "start <= merged[-1][1]:"),
        Bug("missing case", "max(merged[-1][1], end))", "end)"),
        Bug("missing sort", "for start, end in sorted(intervals):", "for start, end in intervals:"),
        Bug("off-by-one", "return interval[1] - interval[0] + 1", "return interval[1] - interval[0]"),
        Bug("wrong comparison", "interval[0] <= point <= interval[1]", "interval[0] <= point < interval[1]"),
        Bug("off-by-one", "min(lo - 1, end)", "min(lo, end)"),
    )),
    Family("textformat", "plain-text formatting helpers", _TEXTFORMAT, {
        "wrap": ('wrap("the quick brown fox jumps over the lazy dog", 10)', 'wrap("a b c", 3)', 'wrap("")',
                 'wrap("supercalifragilistic word", 5)'),
        "center": ('center("ab", 6)', 'center("ab", 5)', 'center("abcdef", 3)', 'center("x", 3, fill="*")'),
        "indent": ('indent("a\\n\\nb")', 'indent("x", prefix="> ")'),
        "bullet_list": ('bullet_list(["eggs", "milk"])', "bullet_list([])", 'bullet_list(["a"], marker="*")'),
        "table_row": ('table_row(["id", 7], [4, 3])',),
    }, (
        Bug("off-by-one", "len(current) + 1 + len(word) > width:", "len(current) + 1 + len(word) >= width:"),
        Bug("missing case", "    if current:\n        lines.append(current)\n", ""),
        Bug("off-by-one", "left = (width - len(text)) // 2", "left = (width - len(text) + 1) // 2"),
        Bug("missing case", "prefix + line if line.strip() else line for", "prefix + line for"),
        Bug("wrong default", 'def bullet_list(items, marker="-"):', 'def bullet_list(items, marker="*"):'),
        Bug("wrong alignment", "str(cell).ljust(width)", "str(cell).rjust(width)"),
    )),
    Family("csvlite", "tiny CSV reader and writer", _CSVLITE, {
        "parse_line": ('parse_line("a,b,c")', "parse_line('\"x, y\",z')", "parse_line('\"say \"\"hi\"\"\",2')",
                       'parse_line("")', 'parse_line("a,,b")', 'parse_line("a,")'),
        "format_field": ('format_field("plain")', 'format_field("a,b")', "format_field('say \"hi\"')",
                         "format_field(3)", 'format_field("two\\nlines")'),
        "format_line": ('format_line(["a", "b,c", 1])',),
        "read_records": ('read_records("name,age\\nann,31\\n\\nbob,27")', 'read_records("1,2\\n3,4", header=False)'),
    }, (
        Bug("missing case", "    fields.append(current)\n    return fields", "    return fields"),
        Bug("missing case", "if char == '\"' and index + 1 < len(line) and line[index + 1] == '\"':\n"
            "                current += '\"'\n                index += 1\n            elif char == '\"':",
            "if char == '\"':"),
        Bug("missing case", "for c in ',\"\\n')", "for c in ',\"')"),
        Bug("missing escape", "text.replace('\"', '\"\"')", "text"),
        Bug("missing check", "for line in text.splitlines() if line.strip()]", "for line in text.splitlines()]"),
        Bug("off-by-one", "for row in rows[1:]]", "for row in rows]"),
        Bug("wrong default", "def read_records(text, header=True):", "def read_records(text, header=False):"),
    )),
    Family("grades", "course grade helpers", _GRADES, {
        "letter_grade": ("letter_grade(95)", "letter_grade(90)", "letter_grade(89.5)", "letter_grade(60)",
                         "letter_grade(59)", "letter_grade(101)", "letter_grade(-1)"),
        "weighted_average": ("weighted_average([90, 80], [1, 3])", "weighted_average([70], [2])",
                             "weighted_average([1, 2], [1])", "weighted_average([], [])"),
        "drop_lowest": ("drop_lowest([70, 50, 90])", "drop_lowest([3, 1, 2, 1], count=2)",
                        "drop_lowest([5, 6], count=0)"),
        "class_rank": ('class_rank({"ann": 90, "bob": 85, "cy": 90}, "bob")',
                       'class_rank({"ann": 90, "bob": 85, "cy": 90}, "ann")', 'class_rank({"solo": 10}, "solo")'),
        "pass_rate": ("pass_rate([50, 60, 70, 80])", "pass_rate([])", "pass_rate([59, 61], passing=50)"),
    }, (
        Bug("wrong comparison", "if score >= floor:", "if score > floor:"),
        Bug("missing case", '(70, "C"), (60, "D")):', '(70, "C")):'),
        Bug("wrong denominator", "/ total_weight, 1)", "/ len(scores), 1)"),
        Bug("wrong order", "dropped = sorted(scores)[:count]", "dropped = sorted(scores, reverse=True)[:count]"),
        Bug("wrong comparison", "if other > mine)", "if other >= mine)"),
        Bug("wrong default", "def pass_rate(scores, passing=60):", "def pass_rate(scores, passing=65):"),
        Bug("wrong comparison", "if s >= passing)", "if s > passing)"),
    )),
    Family("orders", "order total helpers", _ORDERS, {
        "line_total": ("line_total(250, 4)", "line_total(999, 3, 10)", "line_total(100, 0)"),
        "subtotal": ("subtotal([(250, 2), (100, 1, 50)])", "subtotal([])"),
        "shipping": ("shipping(0)", "shipping(4999)", "shipping(5000)", "shipping(12000)"),
        "order_total": ("order_total([(1000, 2)])", "order_total([(3000, 2)], coupon_cents=500)",
                        "order_total([(100, 1)], coupon_cents=1000)", "order_total([(2600, 2)], coupon_cents=500)"),
        "bulk_discount": ("bulk_discount(9)", "bulk_discount(10)", "bulk_discount(49)", "bulk_discount(50)",
                          "bulk_discount(200)"),
    }, (
        Bug("wrong comparison", "if subtotal_cents >= SHIPPING_FREE_FROM", "if subtotal_cents > SHIPPING_FREE_FROM"),
        Bug("missing case", "    if subtotal_cents == 0:\n        return 0\n", ""),
        Bug("missing clamp", "return max(sub - coupon_cents, 0) + shipping(sub)", "return sub - coupon_cents + shipping(sub)"),
        Bug("wrong order", "    if quantity >= 50:\n        return 20\n    if quantity >= 10:\n        return 10\n",
            "    if quantity >= 10:\n        return 10\n    if quantity >= 50:\n        return 20\n"),
        Bug("wrong default", "def line_total(price_cents, quantity, discount_percent=0):",
            "def line_total(price_cents, quantity, discount_percent=10):"),
        Bug("wrong argument", "+ shipping(sub)", "+ shipping(sub - coupon_cents)"),
    )),
    Family("contacts", "contact record helpers", _CONTACTS, {
        "normalize_phone": ('normalize_phone("+1 (555) 123-4567")', 'normalize_phone("555.123.4567")',
                            'normalize_phone("12-34")', 'normalize_phone("1234567")'),
        "split_name": ('split_name("Ada King Lovelace")', 'split_name("Plato")', 'split_name("Grace Hopper")'),
        "initials": ('initials("ada king lovelace")', 'initials("Alan Turing")'),
        "sort_contacts": ('sort_contacts([{"first": "bo", "last": "Zed"}, {"first": "Al", "last": "zed"}, '
                          '{"first": "Cy", "last": "Abe"}])',),
        "find_by_prefix": ('find_by_prefix(["Anna", "bob", "annie", "Bea"], "an")', 'find_by_prefix(["x"], "")',
                           'find_by_prefix(["Anna", "bob"], "AN")'),
    }, (
        Bug("off-by-one", "if len(digits) < 7:", "if len(digits) <= 7:"),
        Bug("missing case", 'return ("+" if text.strip().startswith("+") else "") + digits', "return digits"),
        Bug("wrong slice", 'return " ".join(parts[:-1]), parts[-1]', 'return " ".join(parts[:1]), parts[-1]'),
        Bug("missing case", '    if len(parts) == 1:\n        return parts[0], ""\n', ""),
        Bug("swapped keys", '(c["last"].lower(), c["first"].lower())', '(c["first"].lower(), c["last"].lower())'),
        Bug("missing normalisation", "    prefix = prefix.lower()\n", ""),
        Bug("missing normalisation", 'part[0].upper() + "."', 'part[0] + "."'),
    )),
    Family("ledger", "account ledger helpers", _LEDGER, {
        "balance": ('balance([("deposit", 500), ("withdrawal", 200)])', "balance([], opening=100)",
                    'balance([("refund", 5)])', 'balance([("withdrawal", 50)], opening=20)'),
        "can_withdraw": ('can_withdraw([("deposit", 100)], 100)', 'can_withdraw([("deposit", 100)], 150)',
                         'can_withdraw([("deposit", 100)], 150, overdraft=50)'),
        "monthly_interest": ("monthly_interest(120000, 5)", "monthly_interest(-500, 5)", "monthly_interest(1000, 3)"),
        "largest_withdrawal": ('largest_withdrawal([("withdrawal", 30), ("deposit", 99), ("withdrawal", 70)])',
                               'largest_withdrawal([("deposit", 5)])',
                               'largest_withdrawal([("withdrawal", 70), ("withdrawal", 30)])'),
        "running_balances": ('running_balances([("deposit", 10), ("withdrawal", 3), ("deposit", 1)])',
                             'running_balances([("deposit", 1)], opening=5)'),
    }, (
        Bug("missing check", '        elif kind == "withdrawal":\n            total -= amount\n        else:\n'
            '            raise ValueError(f"unknown kind: {kind!r}")\n', "        else:\n            total -= amount\n"),
        Bug("wrong comparison", "+ overdraft >= amount", "+ overdraft > amount"),
        Bug("wrong operator", "balance(transactions) + overdraft", "balance(transactions) - overdraft"),
        Bug("wrong constant", "// 1200", "// 100"),
        Bug("wrong choice", "return max(amounts) if amounts else 0", "return amounts[-1] if amounts else 0"),
        Bug("wrong argument", "balance([transaction], opening=total)", "balance([transaction], opening=opening)"),
        Bug("missing case", "    total = opening\n    for kind", "    total = 0\n    for kind"),
    )),
    Family("listutils", "list helpers", _LISTUTILS, {
        "binary_search": ("binary_search([1, 3, 5, 7, 9], 7)", "binary_search([1, 3, 5, 7, 9], 1)",
                          "binary_search([1, 3, 5, 7, 9], 9)", "binary_search([1, 3], 2)", "binary_search([], 4)",
                          "binary_search([4], 4)", "binary_search([1, 3, 5], 6)"),
        "chunk": ("chunk([1, 2, 3, 4, 5], 2)", "chunk([], 3)", "chunk([1], 0)"),
        "flatten": ("flatten([1, [2, [3, [4]]], 5])", "flatten([])", "flatten([[], [1]])"),
        "dedupe": ("dedupe([3, 1, 3, 2, 1])", 'dedupe("abca")'),
        "rotate": ("rotate([1, 2, 3, 4], 1)", "rotate([1, 2, 3, 4], -1)", "rotate([1, 2, 3], 3)", "rotate([], 2)",
                   "rotate([1, 2, 3, 4], 5)"),
        "pairwise_sums": ("pairwise_sums([1, 2, 3])", "pairwise_sums([5])"),
    }, (
        Bug("wrong comparison", "while low <= high:", "while low < high:"),
        Bug("off-by-one", "low, high = 0, len(items) - 1", "low, high = 0, len(items)"),
        Bug("missing recursion", "flat.extend(flatten(item))", "flat.extend(item)"),
        Bug("missing case", "            seen.add(item)\n", ""),
        Bug("missing case", "    steps %= len(items)\n", ""),
        Bug("off-by-one", "for i in range(0, len(items), size)]", "for i in range(0, len(items) - 1, size)]"),
        Bug("off-by-one", "for i in range(len(items) - 1)]", "for i in range(1, len(items) - 1)]"),
    )),
    Family("settings", "settings file reader", _SETTINGS, {
        "parse_bool": ('parse_bool("Yes")', 'parse_bool("off")', 'parse_bool(" 1 ")', 'parse_bool("maybe")',
                       'parse_bool("FALSE")', 'parse_bool("On")'),
        "parse_settings": ('parse_settings("a = 1\\n[db]\\nhost = x # primary\\nport=5432")',
                           'parse_settings("# only a comment\\n")', 'parse_settings("[s]\\nurl = http://h/?a=b")',
                           'parse_settings("novalue")', 'parse_settings("[ spaced ]\\nk=v")'),
        "get_int": ('get_int({"db": {"port": "5432"}}, "db", "port")', 'get_int({}, "db", "port", default=80)',
                    'get_int({"db": {}}, "db", "port")'),
        "merge_settings": ('merge_settings({"a": {"x": "1", "y": "2"}}, {"a": {"y": "3"}, "b": {"z": "4"}})',),
    }, (
        Bug("missing normalisation", "value = text.strip().lower()", "value = text.strip()"),
        Bug("missing case", '("yes", "true", "on", "1")', '("yes", "true", "1")'),
        Bug("wrong split", 'key, sep, value = line.partition("=")', 'key, sep, value = line.rpartition("=")'),
        Bug("missing case", 'line = raw.split("#", 1)[0].strip()', "line = raw.strip()"),
        Bug("missing normalisation", "section = line[1:-1].strip()", "section = line[1:-1]"),
        Bug("wrong default", "return default if value is None", "return 0 if value is None"),
        Bug("wrong merge", "merged.setdefault(name, {}).update(values)", "merged[name] = dict(values)"),
    )),
)
