"""Rows the run cannot use are bad rows named at start-up, not a reward of 0 or a traceback at
the first rollout (issue 43, items 7 and 14): a label the math reward cannot read, a prompt
with no room for a response in the model's context, a lone surrogate; and
agent.max_total_tokens above the model's context is a config error."""

import json
import math
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.data.datasets import DatasetError
from megatron_gspo.loop import build, early_checks
from megatron_gspo.rewards.math import check_exact_label, check_math_label, math_reward

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny"
GOOD = {"prompt": "What is 1+1?", "answer": "2"}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY / "base")


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _cfg(path, *extra):
    return load_config(TINY / "config.yaml", [f"data.train_path={path}", "data.eval_path=null",
                                              "train.eval_interval=0", *extra])


# item 7: labels the math reward cannot read


@pytest.mark.parametrize("label,why", [({"a": 1}, "dict"), (float("nan"), "finite"),
                                       (True, "bool"), ("", "no answer"),
                                       ("#### ", "no answer"), ([1, 2], "list")])
def test_an_unreadable_math_label_is_a_bad_row_named(tmp_path, tok, label, why):
    p = _write(tmp_path / "rows.jsonl", [GOOD, {"prompt": "What is 2+2?", "answer": label}])
    with pytest.raises(DatasetError) as e:
        build.prompt_stream(_cfg(p), tok)
    msg = str(e.value)
    assert "rows.jsonl row 1: label" in msg and why in msg and "\n" not in msg, msg
    stream = build.prompt_stream(_cfg(p, "data.skip_bad_rows=true"), tok)
    assert [it.label for it in stream.dataset.items] == ["2"]
    assert stream.dataset.num_skipped == 1


def test_a_file_whose_every_label_is_unreadable_is_an_error(tmp_path, tok):
    p = _write(tmp_path / "rows.jsonl", ['{"prompt": "What is 1+1?", "answer": NaN}',
                                         {"prompt": "What is 1+2?", "answer": {"a": 1}}])
    with pytest.raises(DatasetError, match=r"rows.jsonl: no usable rows \(2 bad rows skipped\)"):
        build.prompt_stream(_cfg(p, "data.skip_bad_rows=true"), tok)


def test_eval_sets_get_the_same_label_check(tmp_path, tok):
    good = _write(tmp_path / "train.jsonl", [GOOD])
    bad = _write(tmp_path / "eval.jsonl", [{"prompt": "What is 1+1?", "answer": True}])
    with pytest.raises(DatasetError, match=r"eval.jsonl row 0: label True"):
        build.eval_prompts(_cfg(good, f"data.eval_path={bad}"), tok)


def test_readable_labels_pass_and_score():
    for label in ("2", 2, 2.0, "The sum is #### 2", "\\boxed{2}", "1,234", "3/4"):
        check_math_label(label)
    assert math_reward("\\boxed{2}", 2) == 1.0
    for label in ("yes", 3, ["a", "b"], ("a",)):
        check_exact_label(label)
    for bad in ({"a": 1}, [], [None], math.inf):
        with pytest.raises(ValueError):
            check_exact_label(bad)


def test_a_reward_service_or_a_user_reward_without_a_check_loads_any_label(tmp_path, tok):
    p = _write(tmp_path / "rows.jsonl", [GOOD, {"prompt": "What is 2+2?", "answer": {"a": 1}}])
    stream = build.prompt_stream(_cfg(p, "reward.url=http://127.0.0.1:9/score"), tok)
    assert len(stream.dataset.items) == 2


# item 14: prompts the model's context cannot hold, lone surrogates, agent.max_total_tokens


def test_a_prompt_longer_than_the_context_is_a_bad_row_named(tmp_path, tok):
    long = {"prompt": "What is " + "1+" * 80 + "1?", "answer": "81"}  # > 128 tokens
    p = _write(tmp_path / "rows.jsonl", [GOOD, long])
    with pytest.raises(DatasetError) as e:
        build.prompt_stream(_cfg(p, "data.max_prompt_length=4096"), tok)
    msg = str(e.value)
    assert "rows.jsonl row 1: prompt has" in msg and "context of 128 tokens" in msg, msg
    stream = build.prompt_stream(_cfg(p, "data.max_prompt_length=4096",
                                      "data.skip_bad_rows=true"), tok)
    assert [it.row for it in stream.dataset.items] == [0]
    only_long = _write(tmp_path / "long.jsonl", [long, long])
    with pytest.raises(DatasetError, match="no usable rows"):
        build.prompt_stream(_cfg(only_long, "data.max_prompt_length=4096",
                                 "data.skip_bad_rows=true"), tok)


@pytest.mark.parametrize("prompt", ['"What is 1+1? \\ud800"',
                                    '[{"role": "user", "content": "\\udc00 1+1?"}]'])
def test_a_lone_surrogate_is_a_bad_row_named(tmp_path, tok, prompt):
    p = _write(tmp_path / "rows.jsonl", [GOOD, f'{{"prompt": {prompt}, "answer": "2"}}'])
    with pytest.raises(DatasetError) as e:
        build.prompt_stream(_cfg(p), tok)
    assert "rows.jsonl line 2: prompt" in str(e.value) and "lone surrogate" in str(e.value)
    stream = build.prompt_stream(_cfg(p, "data.skip_bad_rows=true"), tok)
    assert len(stream.dataset.items) == 1 and stream.dataset.num_skipped == 1


def test_a_label_with_a_lone_surrogate_is_a_bad_row(tmp_path, tok):
    p = _write(tmp_path / "rows.jsonl", [GOOD, '{"prompt": "What is 1+1?", "answer": "\\ud800"}'])
    with pytest.raises(DatasetError, match="row 1: label .*lone surrogate"):
        build.prompt_stream(_cfg(p), tok)


def test_agent_max_total_tokens_above_the_context_is_a_config_error(tok):
    hf = build.read_hf_config(str(TINY / "base"))
    cfg = load_config(TINY / "config.yaml", ["agent.enabled=true", "data.apply_chat_template=false",
                                             "agent.max_total_tokens=129"])
    with pytest.raises(ConfigError) as e:
        early_checks.check_inputs(cfg, hf, tok)
    msg = str(e.value)
    assert msg.startswith("agent.max_total_tokens: 129 is above") and "128 tokens" in msg, msg
    cfg = load_config(TINY / "config.yaml", ["agent.enabled=true", "data.apply_chat_template=false",
                                             "agent.max_total_tokens=128"])
    early_checks.check_inputs(cfg, hf, tok)
