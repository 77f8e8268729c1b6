"""The chaos script (tests/loop/chaos.py) on the tiny demo: one round of each injection kind;
every resumed run must reproduce the undisturbed metrics and leave nothing complete-looking
that is wrong."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.mark.slow
def test_chaos_rounds_reproduce_the_undisturbed_run(tmp_path, capsys):
    import chaos

    code = chaos.main(["--rounds", str(len(chaos.KINDS)), "--seed", "1",
                       "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mismatches: 0  violations: 0" in out
