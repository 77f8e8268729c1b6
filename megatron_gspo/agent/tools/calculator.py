"""Calculator tool: arithmetic parsed with `ast` and evaluated by walking the tree.

Allowed: int/float literals, + - * / // % **, unary + -, parentheses. Nothing else (names,
calls, attributes, comparisons, ...) is accepted, and there is no eval/exec. Sizes are bounded:
expression length, number of nodes, exponent magnitude and result magnitude.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, ClassVar

from megatron_gspo.agent.tools.toolset import ToolError

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ToolError):
    """An expression the calculator refuses or cannot evaluate."""


def evaluate(
    expression: str,
    *,
    max_chars: int = 256,
    max_nodes: int = 100,
    max_exponent: int = 64,
    max_abs: float = 1e30,
) -> int | float:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. "(3 + 4) * 2 ** 3".
        max_chars, max_nodes: input size bounds.
        max_exponent: largest |exponent| allowed in `**`.
        max_abs: largest |value| of any intermediate result.
    Returns:
        The value (int when every step stayed integral).
    Raises:
        CalcError: with a one-line reason.
    """
    if not isinstance(expression, str):
        raise CalcError("expression must be a string")
    if len(expression) > max_chars:
        raise CalcError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expression!r} as arithmetic") from None
    if sum(1 for _ in ast.walk(tree)) > max_nodes:
        raise CalcError(f"expression has more than {max_nodes} parts")

    def check(v: float) -> int | float:
        if isinstance(v, float) and not math.isfinite(v):
            raise CalcError("result is not a finite number")
        if abs(v) > max_abs:
            raise CalcError(f"result magnitude exceeds {max_abs:g}")
        return v

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise CalcError(f"unsupported literal {node.value!r}")
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](walk(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow):
                if abs(right) > max_exponent:
                    raise CalcError(f"exponent {right} exceeds the limit {max_exponent}")
                # bound |left| ** right before computing it
                if left != 0 and right >= 1 and right * math.log10(abs(left)) > math.log10(max_abs):
                    raise CalcError(f"result magnitude exceeds {max_abs:g}")
                if left == 0 and right < 0:
                    raise CalcError("division by zero")
                if left < 0 and isinstance(right, float) and not right.is_integer():
                    raise CalcError("fractional power of a negative number")
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise CalcError("division by zero")
            try:
                return check(_BINOPS[type(node.op)](left, right))
            except (OverflowError, ZeroDivisionError) as exc:
                raise CalcError(str(exc)) from None
        raise CalcError(f"unsupported syntax: {type(node).__name__}")

    return walk(tree)


def format_number(value: float) -> str:
    """Print integral floats as integers, others with up to 12 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


class Calculator:
    """The calculator tool: `{"expression": "..."}` -> the value as text."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression with + - * / // % ** and parentheses; "
        "returns the number."
    )
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}
        },
        "required": ["expression"],
    }

    async def __call__(self, arguments: dict[str, Any]) -> str:
        if set(arguments) != {"expression"}:
            raise KeyError('calculator takes exactly one argument, "expression"')
        return format_number(evaluate(arguments["expression"]))
