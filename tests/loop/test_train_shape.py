"""loop/train.py reads top to bottom: its start-up is one phase (`loop/startup.py`), so the loop
and what runs before it fit one screen (issue 57 item 7: about 110 lines of start-up before)."""

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "megatron_gspo" / "loop" / "train.py"


def test_start_up_is_one_phase_before_the_loop():
    tree = ast.parse(TRAIN.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_train")
    loop = next(n for n in fn.body if isinstance(n, ast.For))
    before = [n for n in fn.body if n.lineno < loop.lineno]
    assert loop.lineno - fn.lineno <= 15, f"{loop.lineno - fn.lineno} lines before the loop"
    calls = [c.func for n in before for c in ast.walk(n) if isinstance(c, ast.Call)]
    assert any(isinstance(f, ast.Attribute) and f.attr == "start_run" for f in calls)
    assert len(TRAIN.read_text().splitlines()) <= 200
