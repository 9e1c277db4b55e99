"""Number families: math helpers, money in cents, matrices, unit conversions, Roman numerals and
dates.

Each is the correct module's source, its test expressions per callable, and the bugs planted one
per task (model.py says what the fields mean; __init__.py fixes the order).
"""

from workloads.tasksets.pyfix_families.model import Bug, Family

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

MATHUTILS = Family("mathutils", "small math helpers", _MATHUTILS, {
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
))

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

MONEY = Family("money", "money helpers working in cents", _MONEY, {
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
))

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

MATRIX = Family("matrix", "matrix helpers over lists of rows", _MATRIX, {
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
))

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

UNITS = Family("units", "unit conversions and durations", _UNITS, {
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
))

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

ROMAN = Family("roman", "Roman numeral conversion", _ROMAN, {
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
))

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

DATEPARSE = Family("dateparse", "date parsing helpers", _DATEPARSE, {
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
))
