"""docs/troubleshooting.md quotes messages the code still prints. For each `<!-- message -->`
line of the page: the CLI's prefix (`megatron-gspo: config error: `, `megatron-gspo: <Error>: `,
an events.log time stamp) names a real error class, and the message's fixed part (what is left
once the run's own values are taken out: numbers, paths, addresses, quoted values, field names)
is made of the package's string literals and f-string literal runs: at least 60% of its letters
lie inside such runs (of 10 characters or more, one of them 12 or more) found verbatim in the
line. A value the code puts between two runs (a moment's name, a host) is what stays uncovered.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
PKG = ROOT / "megatron_gspo"
# a run's own values: words with a digit, paths and URLs, quoted values, bracketed lists,
# `key=value` pairs, field and key names (a dot or an underscore), lists of words (`a, b, c`)
# and the `a -> b` of a change
VALUE = re.compile(r"'[^']*'|\{[^}]*\}|\[[^\]]*\]|\S*\d\S*|\S*/\S*|\S+=\S+|\S*_\S*|"
                   r"\w+\.\w\S*|\w+(?:, \w+)+|->")
MIN_COVER = 0.6


def messages(text: str) -> list[str]:
    return [m.group(1).strip() for m in
            re.finditer(r"<!-- message -->\s*```text\n(.*?)```", text, re.S)]


def _literal_runs() -> tuple[set[str], set[str]]:
    """The package's string literals and the literal runs of its f-strings (10 characters or
    more), and its class names."""
    runs, classes = set(), set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                runs.add(node.value.strip())
            elif isinstance(node, ast.JoinedStr):
                runs |= {v.value.strip() for v in node.values if isinstance(v, ast.Constant)}
            elif isinstance(node, ast.ClassDef):
                classes.add(node.name)
    return {r for r in runs if len(r) >= 10 and "\n" not in r}, classes


def coverage(message: str, runs: set[str]) -> tuple[float, int, str]:
    """(share of the fixed part's letters inside code runs found in `message`, the longest such
    run, the uncovered fixed text)."""
    cov = [False] * len(message)
    longest = 0
    for r in runs:
        i = message.find(r)
        if i >= 0:
            longest = max(longest, len(r))
        while i >= 0:
            cov[i:i + len(r)] = [True] * len(r)
            i = message.find(r, i + 1)
    val = [False] * len(message)
    for v in VALUE.finditer(message):
        val[v.start():v.end()] = [True] * (v.end() - v.start())
    fixed = [k for k, c in enumerate(message) if not val[k] and c.isalnum()]
    share = sum(cov[k] for k in fixed) / max(len(fixed), 1)
    left = "".join(c if not (val[k] or cov[k]) else " " for k, c in enumerate(message))
    return share, longest, " ".join(left.split())


def test_the_page_quotes_the_likely_failures():
    found = messages(PAGE.read_text())
    assert len(found) >= 12
    text = " ".join(found)
    for needle in ("memory plan", "before becoming healthy", "not verified", "resume from",
                   "invalid parallel layout", "is in use by"):
        assert needle in text, needle


def test_every_quoted_message_is_still_in_the_code():
    runs, classes = _literal_runs()
    bad = []
    for line in messages(PAGE.read_text()):
        rest = re.sub(r"^\[\d\d:\d\d:\d\d\] ", "", line)
        m = re.match(r"megatron-gspo: (?:config error: |(\w+): )?", rest)
        if m and m.group(1):
            assert m.group(1) in classes, (m.group(1), line)
        rest = rest[m.end():] if m else rest
        share, longest, left = coverage(rest, runs)
        if share < MIN_COVER or longest < 12:
            bad.append((line[:70], f"{share:.2f}", left))
    assert not bad, f"quoted on the page, but not what the code writes: {bad}"


def test_a_made_up_message_is_caught():
    runs, _ = _literal_runs()
    share, longest, _ = coverage("step 3: the weights melted into the floor of the GPU", runs)
    assert share < MIN_COVER or longest < 12
