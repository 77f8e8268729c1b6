"""Rule-based answer checking for math-style tasks, with Hugging Face `math-verify` for the
mathematical comparison (LaTeX, fractions, radicals, sets, intervals, symbolic equivalence).

The model's answer is the content of its last \\boxed{...} (nested braces allowed). A label
written as a solution ("... #### 72", or with its own \\boxed{}) is reduced to its final answer
first. Comparison, in order:

1. both sides parse as plain numbers (integers, decimals, thousands separators, simple
   fractions, \\frac of numbers, percent signs with 50% read as 50, the way datasets usually
   write labels): equal within a tolerance -> correct. Kept from the rule-based checker
   because math-verify reads "50\\%" as 0.5 and because it needs no worker round trip;
2. equal as normalised strings (LaTeX text wrappers, spaces, case) -> correct;
3. otherwise math-verify's `verify(parse(label), parse(answer))`, cut at `timeout_s` seconds
   per comparison (a cut comparison counts as wrong; see `verifier.py`).

The lenient `math` reward, for a response without a box, also accepts the last number of the
response (rule 1) and lets math-verify extract the answer from the whole response ("the final
answer is ...", last LaTeX expression); `math_boxed_strict` needs the box.

Neither counts an answer that only restates arithmetic ("8 + 21", "\\boxed{54 + 9}", a
response ending in such an expression): math-verify evaluates it and would find it equal to
the label, so a policy could score by echoing the question (seen in training: SmolLM2 on
addition learned to answer "a + b"). A label that is itself such an expression is compared
as before.
"""

from __future__ import annotations

import math
import re
from typing import Any

from megatron_gspo.rewards.verifier import default_verifier

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
# two or more plain numbers joined by + - * x ^ (not /: 3/4 is a value): an expression left
# unevaluated ("8 + 21"), which math-verify would evaluate and count as the answer
_NUM = r"-?\d[\d,]*(?:\.\d+)?"
_OP = r"(?:[-+*^×·]|\\times|\\cdot)"
_ARITHMETIC = re.compile(rf"{_NUM}(?:{_OP}{_NUM})+")
_EXPRESSION = re.compile(rf"(?<![\d.,]){_NUM}(?:\s*{_OP}\s*{_NUM})*")
_SPECIAL_TOKEN = re.compile(r"<\|[^|<>]*\|>|</?s>")


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


def check_math_label(label: Any) -> None:
    """A label the math rewards can read: a finite number (not a boolean) or a string with a
    final answer (`label_answer` not empty) and encodable text.

    Raises:
        ValueError naming what is wrong (the dataset row is then a bad row).
    """
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise ValueError(f"a math label is a number or a string, not {type(label).__name__}")
    if isinstance(label, float) and not math.isfinite(label):
        raise ValueError(f"a math label must be finite, got {label}")
    if isinstance(label, str):
        try:
            label.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the label holds a lone surrogate at character {e.start}") \
                from None
        if not label_answer(label):
            raise ValueError("the label holds no answer (empty, or an empty #### / \\boxed{})")


def check_exact_label(label: Any) -> None:
    """A label `exact_match` can compare: a string or finite number, or a non-empty list of
    them (any one may match). Raises ValueError naming what is wrong."""
    items = list(label) if isinstance(label, (list, tuple)) else [label]
    if not items:
        raise ValueError("an exact_match label list must not be empty")
    for x in items:
        if not isinstance(x, (str, int, float)):
            raise ValueError(f"an exact_match label is a string, a number or a list of them, "
                             f"not {type(x).__name__}")
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError(f"an exact_match label must be finite, got {x}")


def answers_match(answer: str, label: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-6,
                  timeout_s: float | None = 5.0) -> bool:
    """Compare an extracted answer with a label (rules 1-3 of the module docstring).

    Args:
        answer: the extracted answer (box content or a number).
        label: the reference answer (number, string, or solution ending in "#### answer").
        rel_tol, abs_tol: numeric tolerance of rule 1 (math.isclose).
        timeout_s: math-verify's limit in seconds; None skips math-verify (rules 1-2 only).
    Returns:
        True when the answer matches.
    """
    target = label_answer(label)
    if _rules_match(answer, target, rel_tol, abs_tol):
        return True
    if is_unevaluated_arithmetic(answer) and not is_unevaluated_arithmetic(target):
        return False
    if timeout_s is None:
        return False
    return default_verifier().verify(f"\\boxed{{{target}}}", f"\\boxed{{{answer}}}", timeout_s)


def is_unevaluated_arithmetic(answer: str) -> bool:
    """True when `answer` is only plain numbers joined by + - * x ^ ("8 + 21", "2^{10}" is not
    plain), i.e. arithmetic written out instead of its value."""
    return _ARITHMETIC.fullmatch(normalize_answer(answer)) is not None


def ends_in_unevaluated_arithmetic(text: str) -> bool:
    """True when the last numeric expression of a response (special tokens removed) is
    arithmetic it does not evaluate: "... 8 + 21." or "8 + 21, which is the sum", but not
    "8 + 21 = 29"."""
    found = _EXPRESSION.findall(_SPECIAL_TOKEN.sub("", text))
    return bool(found) and is_unevaluated_arithmetic(found[-1])


def _rules_match(answer: str, target: str, rel_tol: float, abs_tol: float) -> bool:
    a, b = parse_number(answer), parse_number(target)
    if a is not None and b is not None and math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol):
        return True
    return normalize_answer(answer) == normalize_answer(target)


def math_reward(response_text: str, label: Any, sample_metadata: dict | None = None, *,
                rel_tol: float = 1e-6, abs_tol: float = 1e-6,
                timeout_s: float | None = 5.0) -> float:
    """1.0 when the last \\boxed{} answer matches the label; without a box, when the last
    number matches or math-verify finds the label's answer in the response.

    Args:
        response_text: the decoded response.
        label: the reference answer (number, string, or solution ending in "#### answer").
        sample_metadata: unused.
        rel_tol, abs_tol: numeric tolerance (math.isclose).
        timeout_s: math-verify's limit per comparison in seconds (None: rules only).
    Returns:
        1.0 or 0.0.
    """
    answer = extract_boxed(response_text)
    if answer is not None:
        return float(answers_match(answer, label, rel_tol, abs_tol, timeout_s))
    target = label_answer(label)
    number = extract_last_number(response_text)
    if number is not None and _rules_match(number, target, rel_tol, abs_tol):
        return 1.0
    if timeout_s is None or not response_text.strip():
        return 0.0
    if ends_in_unevaluated_arithmetic(response_text) and not is_unevaluated_arithmetic(target):
        return 0.0  # math-verify would evaluate the restated question
    return float(default_verifier().verify(f"\\boxed{{{target}}}", response_text, timeout_s))


def math_boxed_strict_reward(response_text: str, label: Any, sample_metadata: dict | None = None,
                             *, rel_tol: float = 1e-6, abs_tol: float = 1e-6,
                             timeout_s: float | None = 5.0) -> float:
    """1.0 only when the response has a \\boxed{} answer that matches the label."""
    answer = extract_boxed(response_text)
    return float(answer is not None and answers_match(answer, label, rel_tol, abs_tol, timeout_s))


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


# The label check of each reward (`rewards.scoring.label_check`): rows whose label it refuses
# are bad rows at load time instead of a reward of 0 for every sample of theirs.
math_reward.check_label = check_math_label
math_boxed_strict_reward.check_label = check_math_label
exact_match_reward.check_label = check_exact_label
