"""Text families: text statistics, string and paragraph helpers, a tiny CSV reader, a settings file
reader and input validators.

Each is the correct module's source, its test expressions per callable, and the bugs planted one
per task (model.py says what the fields mean; __init__.py fixes the order).
"""

from workloads.tasksets.pyfix_families.model import Bug, Family

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

TEXTSTATS = Family("textstats", "text statistics helpers", _TEXTSTATS, {
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
))

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

STRUTILS = Family("strutils", "string helpers", _STRUTILS, {
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
))

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

TEXTFORMAT = Family("textformat", "plain-text formatting helpers", _TEXTFORMAT, {
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
))

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

CSVLITE = Family("csvlite", "tiny CSV reader and writer", _CSVLITE, {
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
))

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

SETTINGS = Family("settings", "settings file reader", _SETTINGS, {
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
))

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

VALIDATORS = Family("validators", "input validation helpers", _VALIDATORS, {
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
))
