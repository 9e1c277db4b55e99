"""The pyfix task set's data: the 20 families, in the order their tasks are generated.

Each family (model.py) is the correct source of a small standard-library module, test expressions
per callable, and the bugs planted one per task. They are grouped by theme: text.py, numbers.py,
records.py, structures.py. workloads/tasksets/pyfix.py owns how repositories, commits, patches
and rows are built from them.

Bugs must not make a loop endless: the generator runs every test in-process, with no timeout.
"""

from __future__ import annotations

from workloads.tasksets.pyfix_families import numbers, records, structures, text
from workloads.tasksets.pyfix_families.model import Bug, Family

__all__ = ["Bug", "FAMILIES", "Family"]

FAMILIES: tuple[Family, ...] = (
    # The order fixes each task's place in tasks.jsonl: add new families at the end.
    text.TEXTSTATS,
    numbers.MATHUTILS,
    numbers.DATEPARSE,
    records.INVENTORY,
    structures.STACKQUEUE,
    text.VALIDATORS,
    text.STRUTILS,
    numbers.MONEY,
    numbers.MATRIX,
    numbers.UNITS,
    numbers.ROMAN,
    structures.INTERVALS,
    text.TEXTFORMAT,
    text.CSVLITE,
    records.GRADES,
    records.ORDERS,
    records.CONTACTS,
    records.LEDGER,
    structures.LISTUTILS,
    text.SETTINGS,
)
