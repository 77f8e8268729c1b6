"""The strict loader bounds what aliases may expand to, and every config error shows a value in
a bounded, one-line repr (issue 54, defect 8: a 0.5 KB alias bomb hung `config` and `train`)."""

import json
import subprocess
import sys

import pytest

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.config.yaml_strict import MAX_ALIAS_NODES, StrictYAMLError, strict_load


def _bomb(key: str) -> str:
    """Nine nested anchors (9^9 leaves) as the list value of `key` (a 'section.field')."""
    section, name = key.split(".")
    rows, prev = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'], "a"
    for c in "bcdefghi":
        rows.append(f"{c}: &{c} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = c
    return f"{section}:\n  {name}:\n" + "".join(f"    - {r}\n" for r in rows)


_CHILD = """
import json, sys, time
from megatron_gspo.config import ConfigError, load_config
t = time.perf_counter()
try:
    load_config(sys.argv[1])
    out = "loaded"
except ConfigError as e:
    out = str(e)
print(json.dumps({"s": time.perf_counter() - t, "error": out}))
"""


@pytest.mark.parametrize("key", ["train.max_steps", "agent.env_kwargs", "data.eval_sets"])
def test_an_alias_bomb_under_a_known_key_is_one_line_fast(tmp_path, key):
    p = tmp_path / "bomb.yaml"
    p.write_text(_bomb(key))
    assert p.stat().st_size < 600
    # a child process: on a loader without the bound this takes minutes and gigabytes
    r = subprocess.run([sys.executable, "-c", _CHILD, str(p)], capture_output=True, text=True,
                       timeout=60)
    got = json.loads(r.stdout)
    assert got["s"] < 2.0, got
    assert "alias" in got["error"] and f"{p}: line 8:" in got["error"], got
    assert "\n" not in got["error"] and len(got["error"]) < 300
    r = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "alias bomb" in r.stderr, r.stderr[:500]


def test_aliases_a_config_uses_stay_allowed_and_a_value_may_not_contain_itself():
    data = strict_load("a: &a {x: [1, 2]}\nb: *a\nc: [*a, *a]\n")
    assert data["b"] == {"x": [1, 2]} and data["c"] == [data["a"], data["a"]]
    wide = "a: &a [" + ",".join(["1"] * 1000) + "]\nb: [" + ",".join(["*a"] * 99) + "]\n"
    assert len(strict_load(wide)["b"]) == 99  # 99,000 nodes added: under the bound
    too_wide = wide.replace(",".join(["*a"] * 99), ",".join(["*a"] * 101))
    assert 101 * 1001 > MAX_ALIAS_NODES
    with pytest.raises(StrictYAMLError, match=r"^line 2: aliases expand this value"):
        strict_load(too_wide)
    with pytest.raises(StrictYAMLError, match=r"^line 2: a value that contains itself"):
        strict_load("x: 1\ntrain: {max_steps: &a [1, *a]}\n")


def _one_short_line(e: pytest.ExceptionInfo, where: str) -> str:
    text = str(e.value)
    assert text.startswith(where) and "\n" not in text and len(text) < 400, text[:600]
    return text


def test_an_error_about_a_huge_value_prints_a_bounded_message(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: [" + ",".join(str(i) for i in range(200_000)) + "]\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "..." in _one_short_line(e, "train.max_steps: expected int")
    p.write_text("train:\n  max_steps: '" + "x" * 1_000_000 + "'\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    _one_short_line(e, "train.max_steps: expected int")
    p.write_text('train:\n  ? "' + "k\\n" * 100_000 + '"\n  : 1\n')  # unknown key, newlines
    with pytest.raises(ConfigError) as e:
        load_config(p)
    _one_short_line(e, "train.'k\\nk\\n")
    p.write_text(f"? {'y' * 1_000_000}\n: 1\n? {'y' * 1_000_000}\n: 2\n")  # a long key
    with pytest.raises(ConfigError) as e:
        load_config(p)
    _one_short_line(e, f"{p}: line 3: duplicate key 'yyy")
    huge = "z" * 1_000_000
    for overrides, where in ((["train.max_steps=" + huge], "train.max_steps: expected int"),
                             ([huge], "override 'zzz"),
                             (["train.seed=[" + huge], "override train.seed: cannot parse"),
                             (["data.eval_sets={? '" + huge + "/': x.jsonl}"],
                              "data.eval_sets: set name"),
                             (["reward.url=" + huge], "reward.url: expected an http"),
                             (["agent.env_kwargs={python_kwargs: [" + huge + "]}"],
                              "agent.env_kwargs.python_kwargs: expected a mapping")):
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        _one_short_line(e, where)
