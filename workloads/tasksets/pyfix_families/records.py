"""Record families: bookkeeping over dicts and lists (stock, course grades, orders, contacts, a
ledger).

Each is the correct module's source, its test expressions per callable, and the bugs planted one
per task (model.py says what the fields mean; __init__.py fixes the order).
"""

from workloads.tasksets.pyfix_families.model import Bug, Family

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

INVENTORY = Family("inventory", "stock-keeping helpers", _INVENTORY, {
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
))

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

GRADES = Family("grades", "course grade helpers", _GRADES, {
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
))

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

ORDERS = Family("orders", "order total helpers", _ORDERS, {
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
))

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

CONTACTS = Family("contacts", "contact record helpers", _CONTACTS, {
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
))

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

LEDGER = Family("ledger", "account ledger helpers", _LEDGER, {
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
))
