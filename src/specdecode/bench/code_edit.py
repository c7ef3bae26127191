"""Code-edit requests: one instruction ("add type hints and a docstring") over different small
Python functions, as an agent or an IDE sends them. ``scripts/server_warmup.py`` (one request
at a time, the shared suffix tree's warm-up) and ``scripts/serving_bench.py`` (many clients at
once) both use them; the first 24 functions are those server_warmup.py has always measured.
"""

from __future__ import annotations

INSTRUCTION = ("Add type hints and a docstring to this Python function. Reply with the "
               "complete function only.\n\n```python\n{code}\n```")

FUNCTIONS = [
    "def area(width, height):\n    return width * height",
    "def greet(name):\n    return 'Hello, ' + name + '!'",
    "def is_even(n):\n    return n % 2 == 0",
    "def average(values):\n    return sum(values) / len(values)",
    "def clamp(x, low, high):\n    return max(low, min(x, high))",
    "def count_words(text):\n    return len(text.split())",
    "def reverse(s):\n    return s[::-1]",
    "def first_or_none(items):\n    return items[0] if items else None",
    "def to_celsius(fahrenheit):\n    return (fahrenheit - 32) * 5 / 9",
    "def square_all(numbers):\n    return [n * n for n in numbers]",
    "def merge(a, b):\n    result = dict(a)\n    result.update(b)\n    return result",
    "def join_names(names):\n    return ', '.join(sorted(names))",
    "def max_index(values):\n    return values.index(max(values))",
    "def is_palindrome(word):\n    word = word.lower()\n    return word == word[::-1]",
    "def percent(part, whole):\n    return 100 * part / whole",
    "def unique(items):\n    return list(dict.fromkeys(items))",
    "def circle_area(radius):\n    return 3.14159 * radius ** 2",
    "def starts_with_vowel(word):\n    return word[:1].lower() in 'aeiou'",
    "def total_price(prices, tax):\n    return sum(prices) * (1 + tax)",
    "def flatten(lists):\n    return [x for sub in lists for x in sub]",
    "def word_lengths(words):\n    return {w: len(w) for w in words}",
    "def safe_divide(a, b):\n    if b == 0:\n        return None\n    return a / b",
    "def last_n(items, n):\n    return items[-n:]",
    "def count_upper(text):\n    return sum(1 for c in text if c.isupper())",
    # more, so that 64 clients each get a function of their own
    "def to_fahrenheit(celsius):\n    return celsius * 9 / 5 + 32",
    "def is_odd(n):\n    return n % 2 == 1",
    "def cube(x):\n    return x ** 3",
    "def initials(name):\n    return ''.join(part[0].upper() for part in name.split())",
    "def count_vowels(text):\n    return sum(1 for c in text.lower() if c in 'aeiou')",
    "def minimum(values):\n    return min(values) if values else None",
    "def double_all(numbers):\n    return [2 * n for n in numbers]",
    "def is_empty(items):\n    return len(items) == 0",
    "def rectangle_perimeter(width, height):\n    return 2 * (width + height)",
    "def first_word(text):\n    words = text.split()\n    return words[0] if words else ''",
    "def repeat(text, times):\n    return text * times",
    "def evens(numbers):\n    return [n for n in numbers if n % 2 == 0]",
    "def key_of_max(scores):\n    return max(scores, key=scores.get)",
    "def capitalize_words(text):\n"
    "    return ' '.join(w.capitalize() for w in text.split())",
    "def hypotenuse(a, b):\n    return (a * a + b * b) ** 0.5",
    "def contains(items, value):\n    return value in items",
    "def pairs(items):\n    return list(zip(items, items[1:]))",
    "def strip_all(lines):\n    return [line.strip() for line in lines]",
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n"
    "    return result",
    "def sum_of_squares(numbers):\n    return sum(n * n for n in numbers)",
    "def is_leap_year(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
    "def chunk(items, size):\n    return [items[i:i + size] for i in range(0, len(items), size)]",
    "def invert(mapping):\n    return {v: k for k, v in mapping.items()}",
    "def discount(price, rate):\n    return price * (1 - rate)",
    "def longest(words):\n    return max(words, key=len)",
    "def digits(n):\n    return [int(d) for d in str(n)]",
    "def bmi(weight, height):\n    return weight / height ** 2",
    "def remove_none(items):\n    return [x for x in items if x is not None]",
    "def count_lines(text):\n    return text.count('\\n') + 1",
    "def median(values):\n    s = sorted(values)\n    mid = len(s) // 2\n"
    "    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2",
    "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
    "def title_case(text):\n    return text.title()",
    "def positive(numbers):\n    return [n for n in numbers if n > 0]",
    "def seconds_to_minutes(seconds):\n    return seconds // 60, seconds % 60",
    "def all_equal(items):\n    return len(set(items)) <= 1",
    "def tail(text, n):\n    return text[-n:]",
    "def sum_dict(values):\n    return sum(values.values())",
    "def swap(pair):\n    a, b = pair\n    return b, a",
    "def is_sorted(values):\n    return all(a <= b for a, b in zip(values, values[1:]))",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a",
]
