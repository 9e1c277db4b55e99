"""Structure families: a stack, queue and ring buffer, integer intervals, and list helpers.

Each is the correct module's source, its test expressions per callable, and the bugs planted one
per task (model.py says what the fields mean; __init__.py fixes the order).
"""

from workloads.tasksets.pyfix_families.model import Bug, Family

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

STACKQUEUE = Family("stackqueue", "stack, queue and ring buffer classes", _STACKQUEUE, {
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
))

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

INTERVALS = Family("intervals", "integer interval helpers", _INTERVALS, {
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
))

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

LISTUTILS = Family("listutils", "list helpers", _LISTUTILS, {
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
))
