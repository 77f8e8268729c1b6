"""The metrics reference (`loop/metric_keys.py`, rendered as reference/metrics.md) against what
runs log: tiny CPU runs through `megatron-gspo train` in the modes that add keys (synchronous
with evaluation, the audit, KL, a correction and overlong shaping; the agent example under
asynchronous rollouts with evaluation; the MoE demo with a named eval set; slow tier: the
SGLang client against the stand-in server with delta weight sync) fail on a logged key the
reference lacks, naming it. And the other way: every segment of every reference key is written
by the package's code (a string literal, f-string or keyword argument outside the table), and
every config field the reference names exists."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.cli.reference import metrics_reference
from megatron_gspo.config import Config, describe
from megatron_gspo.loop.metric_keys import GROUPS, entries, find_entry, pattern_regex

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_gspo"
QUIET = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.log_samples=0",
         "checkpoint.interval=0", "train.max_steps=2", "train.prompts_per_step=4",
         "rollout.group_size=4"]
RUNS = {
    "sync": ("examples/tiny/config.yaml",
             ["train.eval_interval=2", "train.eval_prompts=8", "precision.audit_fraction=1.0",
              "algorithm.kl_coef=0.01", "precision.correction=tis",
              "reward.overlong_buffer=2", "model.mtp_layers=add",
              "algorithm.mtp_loss_weight=1"], {}),
    "agent_async": ("examples/multiturn_agent/config_cpu.yaml",
                    ["rollout.mode=async", "rollout.max_staleness=1", "train.eval_interval=2",
                     "train.eval_prompts=4", "rollout.max_new_tokens=48"], {}),
    "moe": ("examples/moe/config.yaml",
            ["train.eval_interval=2", "train.eval_prompts=8",
             "data.eval_sets={small: examples/tiny/data/eval.jsonl}",
             "precision.correction=mask"], {}),
}
SLOW_RUNS = {
    "sglang_standin": ("examples/tiny/config.yaml",
                       ["train.eval_interval=0", "rollout.engine=sglang", "rollout.num_servers=1",
                        "rollout.weight_sync_delta=on", "rollout.startup_timeout=240"],
                       {"SGLANG_SERVER_MODULE": "megatron_gspo.rollout.standin.server"}),
}


def logged_keys(run_dir: Path) -> set[str]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return set().union(*rows)


def _run(name: str, spec, tmp_path: Path) -> set[str]:
    config, over, env = spec
    run = tmp_path / name
    out = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "train", config,
                          "--run-dir", str(run), *QUIET, *over], cwd=ROOT,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2",
                                  PYTHONFAULTHANDLER="1", **env),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return logged_keys(run)


def _check(keys: set[str]) -> None:
    missing = sorted(k for k in keys if find_entry(k) is None)
    assert not missing, (f"logged but not in the metrics reference "
                         f"(megatron_gspo/loop/metric_keys.py): {missing}")


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_key_a_run_logs_is_in_the_reference(name, tmp_path):
    keys = _run(name, RUNS[name], tmp_path)
    assert len(keys) > 60 if name == "sync" else len(keys) > 40, sorted(keys)
    _check(keys)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_RUNS))
def test_every_key_a_server_run_logs_is_in_the_reference(name, tmp_path):
    keys = _run(name, SLOW_RUNS[name], tmp_path)
    assert any(k.startswith("weight_sync/delta") for k in keys), sorted(keys)
    _check(keys)


def test_a_key_missing_from_the_reference_is_named():
    with pytest.raises(AssertionError, match=r"\['made_up/key'\]"):
        _check({"loss", "eval/pass@4", "eval/small/agent/stop/done", "made_up/key"})


def test_patterns_match_what_they_say():
    rx = pattern_regex("eval/[<set>/]mean@<n>")
    assert rx.match("eval/mean@4") and rx.match("eval/gsm8k/mean@4")
    assert not rx.match("eval/a/b/mean@4") and not rx.match("eval/mean@4/x")
    assert pattern_regex("agent/<info...>").match("agent/tool_errors/timeout")
    assert find_entry("clip_fraction/minibatch_3") == "clip_fraction/minibatch_<i>"
    assert find_entry("agent/reward") == "agent/reward"  # a literal row before a pattern


def _code_texts() -> set[str]:
    """Every string literal (f-strings with their `{...}` parts), keyword-argument name and
    `dict(...)`-style key of the package, the table and its renderer left out."""
    skip = {PKG / "loop" / "metric_keys.py", PKG / "cli" / "reference.py"}
    out: set[str] = set()
    for path in PKG.rglob("*.py"):
        if path in skip:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                out.add(ast.unparse(node)[2:-1])
            elif isinstance(node, ast.keyword) and node.arg:
                out.add(node.arg)
    return out


def _written(seg: str, texts: set[str], blob: str, templates: list[re.Pattern]) -> bool:
    """Whether the code writes the key segment `seg`: as a whole word of a string (the
    segment's own placeholders matching a word or an f-string's `{...}`), or as an f-string
    segment whose `{...}` parts are words the code holds as whole strings (f"engine_{k}_total"
    with "requests" a key of the counters)."""
    parts = re.split(r"<[^>]+>", seg)
    rx = r"(?:\{[^}]*\}|\w+)".join(map(re.escape, parts))
    if re.search(rf"(?<![\w]){rx}(?![\w])", blob):
        return True
    if "<" in seg:
        return False
    return any((m := t.fullmatch(seg)) and all(g in texts for g in m.groups())
               for t in templates)


def test_every_reference_key_is_written_by_the_code():
    """Each `/`-segment of each key is written by the package's code (`_written`): a key no
    code writes fails. (Segments are checked one by one: `weight_sync/delta` is written as
    f"weight_sync/{k}" with k = "delta" elsewhere, so whole keys cannot be required.)"""
    texts = _code_texts()
    blob = "\n".join(texts)
    templates = [re.compile("".join(r"(\w+)" if p.startswith("{") else re.escape(p)
                                    for p in re.split(r"(\{[^}]*\})", seg)))
                 for t in texts if "{" in t for seg in t.split("/") if "{" in seg
                 and re.fullmatch(r"[\w@]*(?:\{[^}]*\}[\w@]*)+", seg)]
    missing = []
    for key, _, _ in entries():
        for seg in re.sub(r"[\[\]]", "", key).split("/"):
            if seg and not re.fullmatch(r"<[^>]+>", seg) and \
                    not _written(seg, texts, blob, templates):
                missing.append((key, seg))
    assert not missing, f"reference keys whose words no code writes: {missing}"


def test_config_fields_the_reference_names_exist():
    names = {r[0] for r in describe(Config)}
    text = " ".join(g.when + " " + " ".join(m for _, _, m in g.rows) for g in GROUPS)
    named = set(re.findall(r"`([a-z_]+\.[a-z_]+)`", text)) | set(
        re.findall(r"`([a-z_]+\.[a-z_]+)[:` ]", text))
    assert sorted(n for n in named if n not in names) == []


def test_the_page_holds_every_entry_once():
    page = metrics_reference()
    keys = [k for k, _, _ in entries()]
    assert len(keys) == len(set(keys))
    assert all(f"| `{k}` |" in page for k in keys)
    assert "reference/metrics.md" in (ROOT / "docs" / "hooks.py").read_text()
