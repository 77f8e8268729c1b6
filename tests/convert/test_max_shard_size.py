"""`mcore-to-hf --max-shard-size inf` (or nan) is a one-line error before the conversion starts,
not an OverflowError traceback once the checkpoint is checked (issue 43, item 11)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from megatron_gspo.cli import convert as cli_convert
from megatron_gspo.megatron.io import conversion as conv


@pytest.fixture
def launched(monkeypatch):
    """A checkpoint that passes its checks (what comes after them is the shard size's use);
    the conversions that would be launched."""
    calls = []

    @contextmanager
    def held(path):
        yield path

    monkeypatch.setattr(cli_convert, "_held", held)
    monkeypatch.setattr(cli_convert, "_refuse_lora", lambda ckpt: None)
    monkeypatch.setattr(conv, "check_mcore_to_hf", lambda *a, **k: {})
    monkeypatch.setattr(conv, "launch", lambda *a, **k: calls.append(k))
    return calls


@pytest.mark.parametrize("size", ["inf", "nan", "0"])
def test_a_shard_size_that_is_no_size_is_one_line(tmp_path, capsys, launched, size):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    rc = cli_convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"),
                           "--max-shard-size", size])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 1 and len(err) == 1 and not launched, err
    assert "--max-shard-size must be a finite number > 0" in err[0], err


def test_a_finite_shard_size_reaches_the_conversion(tmp_path, launched):
    assert cli_convert.main(["mcore-to-hf", "--ckpt", str(tmp_path), "--out",
                             str(tmp_path / "hf"), "--max-shard-size", "0.5"]) == 0
    assert launched[0]["max_shard_bytes"] == 2**29
