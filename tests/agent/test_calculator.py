"""Calculator: ast-walked arithmetic with bounds, never eval."""

import asyncio

import pytest

from megatron_gspo.agent.tools.calculator import CalcError, Calculator, evaluate, format_number


@pytest.mark.parametrize(
    "expr,value",
    [
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-7 % 3", 2),
        ("2**10", 1024),
        ("-(3 - 5)", 2),
        ("+4", 4),
        ("2 ** -1", 0.5),
        ("1.5e3 + 1", 1501.0),
        ("(((2)))", 2),
    ],
)
def test_values(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr,msg",
    [
        ("__import__('os').system('x')", "unsupported syntax: Call"),
        ("x + 1", "Name"),
        ("(1).real", "Attribute"),
        ("1 < 2", "Compare"),
        ("'a' * 3", "literal"),
        ("True + 1", "literal"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("2 ** 1000", "exponent"),
        ("10 ** 40", "magnitude"),
        ("9999999999 ** 9", "magnitude"),
        ("1 +", "cannot parse"),
        ("1" * 300, "longer than"),
        ("+".join(["1"] * 80), "parts"),
        ("[1, 2]", "List"),
        ("(-8) ** 0.5", "negative"),
        ("0 ** -1", "division by zero"),
    ],
)
def test_rejects(expr, msg):
    with pytest.raises(CalcError, match=msg):
        evaluate(expr)


def test_tool_interface_and_format():
    calc = Calculator()
    assert asyncio.run(calc({"expression": "12 * (3 + 4)"})) == "84"
    assert asyncio.run(calc({"expression": "10 / 4"})) == "2.5"
    assert format_number(6.0) == "6" and format_number(1 / 3) == "0.333333333333"
    with pytest.raises(KeyError):
        asyncio.run(calc({"expr": "1"}))
