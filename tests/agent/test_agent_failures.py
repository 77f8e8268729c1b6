"""Agent runs that cannot train say so: an opening prompt longer than agent.max_total_tokens,
a .jinja template with a syntax error or an undefined call (one-line config errors before the
learner is built); a tool parser that raises or returns garbage and a template that raises on
the tool role fail their episodes, the first error of each kind is logged, and a round whose
every episode failed stops the run with one line."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from megatron_gspo.loop import build
from megatron_gspo.agent import loop as agent_loop
from megatron_gspo.cli import main
from megatron_gspo.config import load_config
from megatron_gspo.data.datasets import PromptItem
from megatron_gspo.data.sample import Sample
from megatron_gspo.rollout.engine import RolloutError
from tests.agent.agent_helpers import ScriptedEngine

EX = Path(__file__).resolve().parents[2] / "examples" / "multiturn_agent"
sys.path.insert(0, str(EX))
import task  # noqa: E402


@pytest.fixture
def no_learner(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the learner was built before the input checks failed")

    monkeypatch.setattr(build, "learner", refuse)


def _train(capsys, tmp_path, *overrides):
    rc = main(["train", str(EX / "config_cpu.yaml"), "--run-dir", str(tmp_path / "run"),
               "logging.progress_bar=false", "logging.tensorboard=false", *overrides])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines()  # not the tokenizer's length warning
             if ln.strip() and not ln.startswith("[transformers]")]
    return rc, lines, err


def test_opening_prompt_longer_than_max_total_tokens(capsys, tmp_path, no_learner):
    rc, lines, err = _train(capsys, tmp_path, "agent.environment=calculator",
                            "agent.max_total_tokens=40")
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert "config error: agent.max_total_tokens: 40 tokens, but the rendered opening prompt " \
           "of row" in lines[0] and "(tool list included) is" in lines[0], lines[0]
    n = int(lines[0].split("included) is ")[1].split()[0])
    assert n > 40


@pytest.mark.parametrize("body,needle", [
    ("{% for m in messages %}{{ m.content }{% endfor %}", "TemplateSyntaxError"),
    ("{% for m in messages %}{{ nope(m.content) }}{% endfor %}", "UndefinedError"),
])
def test_broken_jinja_template_is_a_config_error(capsys, tmp_path, no_learner, body, needle):
    t = tmp_path / "bad.jinja"
    t.write_text(body)
    rc, lines, err = _train(capsys, tmp_path, f"agent.chat_template={t}")
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("megatron-gspo: config error: agent.chat_template: ") and \
        needle in lines[0], lines[0]


PARSERS = """
def boom(text):
    raise KeyError("parser bug")


def garbage(text):
    return "not a ParsedAction"
"""
TOOL_ROLE_RAISES = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}"
    "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _rollout(tmp_path, *over):
    qtok = task.build_tokenizer()
    rows = [task.make_problem(random.Random(f"f{i}")) for i in range(2)]

    def script(prompt_ids, _n):
        call = '{"name":"calculator","arguments":{"expression":"1+2"}}'
        return qtok.encode(f"<tool_call>{call}</tool_call><|im_end|>", add_special_tokens=False)

    cfg = load_config(EX / "config_cpu.yaml", ["rollout.group_size=2", "train.prompts_per_step=2",
                                                "agent.max_total_tokens=2048", *over])
    reqs = [PromptItem([], r["prompt"], r["label"], i) for i, r in enumerate(rows)]
    return agent_loop.rollout_episodes(cfg, ScriptedEngine(script), iter(reqs), qtok, step=5)


@pytest.mark.parametrize("kind,over,needle", [
    ("tool parser", ["agent.tool_parser={dir}/parsers.py:boom"],
     "raised KeyError: 'parser bug'"),
    ("tool parser", ["agent.tool_parser={dir}/parsers.py:garbage"],
     "returned str, expected ParsedAction"),
    ("chat template", ["agent.chat_template={dir}/t.jinja"], "no tool role"),
])
def test_every_episode_failing_stops_with_the_first_error(tmp_path, monkeypatch, kind, over,
                                                          needle):
    (tmp_path / "parsers.py").write_text(PARSERS)
    (tmp_path / "t.jinja").write_text(TOOL_ROLE_RAISES)
    monkeypatch.setattr(agent_loop, "_REPORTED", set())
    over = [o.format(dir=tmp_path) for o in over]
    with pytest.raises(RolloutError, match=f"step 5: every one of 4 episodes failed; the first "
                                           f"{kind} error: .*{needle}") as e:
        _rollout(tmp_path, *over)
    assert "\n" not in str(e.value)


def test_first_error_of_each_kind_is_logged_once(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_loop, "_REPORTED", set())
    samples = []
    for i, (kind, err) in enumerate([("tool parser", "A"), ("tool parser", "B"),
                                     ("environment", "C"), (None, None)]):
        s = Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], index=i, group_index=0)
        if kind:
            s.metadata.update(env_error=err, error_kind=kind)
        samples.append(s)
    notes = agent_loop._episode_failures(samples, 3)
    assert len(notes) == 2 and "first tool parser error" in notes[0] and notes[0].endswith(": A")
    assert "first environment error" in notes[1] and notes[1].endswith(": C")
    assert agent_loop._episode_failures(samples, 4) == []  # each kind once per run
