"""The package pkgbugs plants its bugs in: inflection 0.5.1 (MIT), and the bugs, as data.

inflection is one module of string rules (plurals, CamelCase, URL slugs, ordinals) with a single
test file of parametrized cases whose ids hold spaces, quotes and non-ASCII text, and it needs only
the standard library. The sdist ships unmodified in workloads/tasksets/sources/ (its README says
where it came from); workloads/tasksets/pkgbugs.py is the generator and knows nothing of inflection.

Each bug is one changed line of ``inflection/__init__.py``; ``correct`` may span more lines when
one line alone is not unique. ``symptoms`` are calls a user would report: the generator evaluates
them against both versions and writes what each returns into the problem statement, so a symptom
that does not show the bug stops it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    kind: str
    """What sort of mistake: off-by-one, wrong comparison, dropped case, swapped branch, ..."""
    correct: str
    """Text found exactly once in the package source."""
    buggy: str
    """What it becomes in the task's base commit."""
    symptoms: tuple[str, ...]
    """One or two expressions over the imported package whose result the bug changes."""


@dataclass(frozen=True)
class Package:
    name: str
    """The import name, also the name the symptom expressions use."""
    sdist: str
    """File name under workloads/tasksets/sources/."""
    sdist_sha256: str
    source_path: str
    """The file the bugs are planted in, relative to the sdist's root folder."""
    test_files: tuple[str, ...]
    """The package's own test files, relative to its root: what ``test_cmd`` runs."""
    dropped: tuple[str, ...]
    """Path parts of sdist members left out of the repositories: build metadata, not source."""
    bugs: tuple[Bug, ...]


INFLECTION = Package(
    name="inflection",
    sdist="inflection-0.5.1.tar.gz",
    sdist_sha256="1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
    source_path="inflection/__init__.py",
    test_files=("test_inflection.py",),
    dropped=("PKG-INFO", "inflection.egg-info", "__pycache__"),
    bugs=(
        Bug("dropped case", "    if number % 100 in (11, 12, 13):", "    if number % 100 in (11, 12):",
            ("inflection.ordinalize(13)", "inflection.ordinalize(113)")),
        Bug("dropped case", "    number = abs(int(number))", "    number = int(number)",
            ("inflection.ordinalize(-1)", "inflection.ordinal(-22)")),
        Bug("wrong operand", '        }.get(number % 10, "th")', '        }.get(number % 100, "th")',
            ("inflection.ordinalize(21)", "inflection.ordinalize(32)")),
        Bug("wrong separator", '        return re.sub(r"(?:^|_)(.)", lambda m: m.group(1).upper(), string)',
            '        return re.sub(r"(?:^|-)(.)", lambda m: m.group(1).upper(), string)',
            ("inflection.camelize('special_guest')",)),
        Bug("dropped case", '        string = re.sub(r"(?i)^{sep}|{sep}$".format(sep=re_sep), \'\', string)',
            '        string = re.sub(r"(?i)^{sep}".format(sep=re_sep), \'\', string)',
            ("inflection.parameterize('Trailing bad characters!@#')",)),
        Bug("wrong comparison", "    if not word or word.lower() in UNCOUNTABLES:",
            "    if not word or word in UNCOUNTABLES:",
            ("inflection.pluralize('Sheep')", "inflection.pluralize('Equipment')")),
        Bug("wrong anchor", "        if re.search(r'(?i)\\b(%s)\\Z' % inflection, word):",
            "        if re.search(r'(?i)^(%s)\\Z' % inflection, word):",
            ("inflection.singularize('funky jeans')",)),
        Bug("dropped case", '    (r"(?i)(x|ch|ss|sh)$", r\'\\1es\'),', '    (r"(?i)(x|ch|sh)$", r\'\\1es\'),',
            ("inflection.pluralize('process')", "inflection.pluralize('address')")),
        Bug("typo in a rule", '    (r"(?i)([^aeiouy]|qu)y$", r\'\\1ies\'),',
            '    (r"(?i)([^aeiouy]|qu)y$", r\'\\1es\'),',
            ("inflection.pluralize('category')",)),
        Bug("dropped case", '    (r"(?i)(m|l)ice$", r\'\\1ouse\'),', '    (r"(?i)(m)ice$", r\'\\1ouse\'),',
            ("inflection.singularize('lice')",)),
        Bug("dropped case", '    (r"(?i)([lr])f$", r\'\\1ves\'),', '    (r"(?i)(l)f$", r\'\\1ves\'),',
            ("inflection.pluralize('dwarf')",)),
        Bug("off-by-one", "            r\"(?i)({}){}$\".format(singular[0], singular[1:]),\n"
                          "            r'\\1' + plural[1:]",
            "            r\"(?i)({}){}$\".format(singular[0], singular[1:]),\n"
            "            r'\\1' + plural[2:]",
            ("inflection.pluralize('person')", "inflection.pluralize('child')")),
        Bug("dropped case", '    word = re.sub(r"([a-z\\d])([A-Z])", r\'\\1_\\2\', word)',
            '    word = re.sub(r"([a-z])([A-Z])", r\'\\1_\\2\', word)',
            ("inflection.underscore('Area51Controller')",)),
        Bug("dropped case", '        r"\\b(\'?\\w)",', '        r"\\b(\\w)",',
            ("inflection.titleize(\"david's code\")",)),
        Bug("wrong normal form", "    normalized = unicodedata.normalize('NFKD', string)",
            "    normalized = unicodedata.normalize('NFC', string)",
            ("inflection.parameterize('Malmö')", "inflection.transliterate('Garçons')")),
        Bug("off-by-one", "    return word.replace('_', '-')", "    return word.replace('_', '-', 1)",
            ("inflection.dasherize('person_street_address')",)),
        Bug("swapped branch", "    if separator:\n        re_sep", "    if not separator:\n        re_sep",
            ("inflection.parameterize('Hello, World!')",)),
        Bug("wrong anchor", '    word = re.sub(r"_id$", "", word)', '    word = re.sub(r"id$", "", word)',
            ("inflection.humanize('employee_id')",)),
    ),
)
