"""Rule-based answer checking for math-style tasks.

The model's answer is the content of its last \\boxed{...} (nested braces allowed) or, for the
lenient `math` reward, the last number in the response when there is no box. Answers and labels
are compared as numbers (integers, decimals, thousands separators, simple fractions, \\frac,
percent signs) within a tolerance, and as normalised strings otherwise. A label written as a
solution ("... #### 72", or with its own \\boxed{}) is reduced to its final answer first.
"""

from __future__ import annotations

import math
import re
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in text, braces balanced; else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: no usable answer


def extract_last_number(text: str) -> str | None:
    """The last number written in text (e.g. "1,234.5", "-3", ".5"), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def normalize_answer(s: str) -> str:
    """Strip LaTeX wrappers, dollar signs, spaces, trailing period; lower-case."""
    s = s.strip()
    s = _TEXT_WRAP.sub(r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("$", "").replace("\\%", "%")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    return s.lower()


def parse_number(s: str) -> float | None:
    """A float from an answer string ("1,234", "-2.5", "3/4", "\\frac{3}{4}", "50%"); else None.

    A percentage parses to its number (50% -> 50), matching how datasets usually write labels.
    """
    s = normalize_answer(s)
    if s.endswith("%"):
        s = s[:-1]
    m = _FRAC.match(s)
    if m:
        num, den = parse_number(m.group(1)), parse_number(m.group(2))
        return None if num is None or den in (None, 0.0) else num / den
    if s.count("/") == 1:
        a, b = s.split("/")
        num, den = parse_number(a), parse_number(b)
        return None if num is None or den in (None, 0.0) else num / den
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        value = float(s)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def label_answer(label: Any) -> str:
    """The final answer of a label: a number, a string, or a worked solution."""
    if isinstance(label, bool):
        return str(label).lower()
    if isinstance(label, (int, float)):
        return repr(label)
    text = str(label)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = extract_boxed(text)
    return boxed if boxed is not None else text.strip()


def answers_match(answer: str, label: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
    """Compare an extracted answer with a label: numerically when both parse, else as strings."""
    target = label_answer(label)
    a, b = parse_number(answer), parse_number(target)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
    return normalize_answer(answer) == normalize_answer(target)


def math_reward(response_text: str, label: Any, sample_metadata: dict | None = None, *,
                rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> float:
    """1.0 when the last \\boxed{} answer (or, without a box, the last number) matches the label.

    Args:
        response_text: the decoded response.
        label: the reference answer (number, string, or solution ending in "#### answer").
        sample_metadata: unused.
        rel_tol, abs_tol: numeric tolerance (math.isclose).
    Returns:
        1.0 or 0.0.
    """
    answer = extract_boxed(response_text)
    if answer is None:
        answer = extract_last_number(response_text)
    return float(answer is not None and answers_match(answer, label, rel_tol, abs_tol))


def math_boxed_strict_reward(response_text: str, label: Any, sample_metadata: dict | None = None,
                             *, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> float:
    """1.0 only when the response has a \\boxed{} answer that matches the label."""
    answer = extract_boxed(response_text)
    return float(answer is not None and answers_match(answer, label, rel_tol, abs_tol))


def exact_match_reward(response_text: str, label: Any, sample_metadata: dict | None = None, *,
                       case_sensitive: bool = False) -> float:
    """1.0 when the response equals the label (or one of a list of labels) after normalisation.

    Normalisation: strip, collapse whitespace, drop a trailing period, lower-case unless
    case_sensitive.
    """
    labels = label if isinstance(label, (list, tuple)) else [label]

    def norm(s: Any) -> str:
        s = re.sub(r"\s+", " ", str(s).strip())
        return (s if case_sensitive else s.lower()).rstrip(".").strip()

    got = norm(response_text)
    return float(any(got == norm(x) for x in labels))
