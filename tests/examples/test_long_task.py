"""The long-response example (examples/long): task, reward, prompt files, pre-training batches
and the study's configs."""

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from megatron_gspo.rewards import get_reward_fn

ROOT = Path(__file__).resolve().parents[2]
LONG = ROOT / "examples" / "long"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def task():
    return _load("long_task", LONG / "task.py")


@pytest.fixture(scope="module")
def pretrain():
    sys.path.insert(0, str(ROOT / "examples"))
    other = sys.modules.pop("task", None)  # another example's `task` module (examples/tiny)
    try:
        return _load("long_pretrain", LONG / "pretrain.py")  # imports examples/long/task.py
    finally:
        sys.modules.pop("task", None)
        if other is not None:
            sys.modules["task"] = other


def test_solution_shows_every_step_and_the_reward_reads_the_total(task):
    row = task.make_problem(random.Random(3), n=4)
    nums = row["numbers"]
    assert task.parse_prompt(row["prompt"]) == nums
    text = task.solution(nums)
    lines = text.split("\n")
    assert len(lines) == 5 and lines[-1] == f"Answer: {sum(nums)}"
    assert lines[0] == f"a{nums[0]}: 0+{nums[0]}={nums[0]}"
    assert lines[1] == f"b{nums[1]}: {nums[0]}+{nums[1]}={sum(nums[:2])}"
    assert task.reward(text, row["answer"], {}) == 1.0
    assert task.reward(text.replace(f"Answer: {sum(nums)}", f"Answer: {sum(nums) + 1}"),
                       row["answer"], {}) == 0.0
    assert task.reward("\n".join(lines[:-1]), row["answer"], {}) == 0.0  # no Answer line
    assert task.reward(text + "\nmore", row["answer"], {}) == 0.0  # the Answer line is last
    assert task.reward(text, None, {}) == 0.0


def test_reward_with_work_needs_every_line_right(task):
    nums = [3, 7, 1, 9]
    text = task.solution(nums)
    assert task.work_errors(text, nums) == 0
    assert task.reward_with_work(text, "20", {"numbers": nums}) == 1.0
    wrong = text.replace("b7: 3+7=10", "b7: 3+7=11")  # a wrong line, right total
    assert task.reward(wrong, "20", {}) == 1.0
    assert task.work_errors(wrong, nums) == 1
    assert task.reward_with_work(wrong, "20", {"numbers": nums}) == 0.0
    skipped = "\n".join(ln for ln in text.split("\n") if not ln.startswith("c"))
    assert task.work_errors(skipped, nums) >= 1


def test_reward_resolves_as_a_config_reward_name(task):
    fn = get_reward_fn(f"{LONG / 'task.py'}:reward")
    assert fn(task.solution([1, 2, 3]), "6", {}) == 1.0


def test_prompt_files_are_the_seeded_rows_and_responses_are_long(task):
    for split, name, n in (("train", "train.jsonl", 2000), ("eval", "eval.jsonl", 256)):
        rows = [json.loads(x) for x in open(LONG / "data" / name)]
        want = task.rows(split, n)
        assert len(rows) == n
        assert rows == [{"prompt": r["prompt"], "answer": r["answer"]} for r in want]
    tok = task.build_tokenizer()
    lengths = [len(tok.encode(task.solution(r["numbers"]) + "<|im_end|>",
                              add_special_tokens=False)) for r in task.rows("eval", 256)]
    assert 64 <= min(lengths) and max(lengths) <= 512
    assert (task.N_MIN, task.N_MAX) == (6, 20)
    assert len(task.make_problem(random.Random(0), n=52)["numbers"]) == 52
    with pytest.raises(ValueError, match="numbers"):
        task.make_problem(random.Random(0), n=53)
    with pytest.raises(ValueError, match="expected c<digit>"):
        task.parse_prompt("Add a1 b2 d3")


def test_pretraining_batches_train_on_the_response_only(task, pretrain):
    tok = task.build_tokenizer()
    ids, labels = pretrain.make_batch(tok, random.Random(5), 3)
    assert ids.shape == labels.shape and ids.shape[0] == 3
    for i in range(3):
        on = labels[i] != -100
        text = tok.decode(labels[i][on].tolist())
        prompt = tok.decode(ids[i][~on].tolist())
        nums = task.parse_prompt(prompt.split("user\n")[1].split("<|im_end|>")[0])
        assert text == task.solution(nums) + "<|im_end|>"
    # one problem size per batch: rows differ only by the digits of their running sums
    assert int((ids == tok.pad_token_id).sum(-1).max()) < 0.1 * ids.shape[1]
    assert set(pretrain.ARCHS) == {"dense", "moe"}
    moe = pretrain.ARCHS["moe"]
    assert moe["num_hidden_layers"] >= 4 and moe["num_experts"] >= 16
    assert moe["num_experts_per_tok"] >= 4


def test_configs_and_study_load():
    from megatron_gspo.config import load_config
    from megatron_gspo.study.arms import arm_configs, load_study

    for name in ("config.yaml", "config_moe.yaml"):
        cfg = load_config(str(LONG / name), [])
        assert cfg.rollout.max_new_tokens >= 254 and cfg.data.max_prompt_length >= 100
    spec, path = load_study(LONG / "study.yaml")
    assert list(spec.arms) == ["gspo", "grpo", "grpo_r2", "grpo_r3", "gspo_engine_logprobs"]
    arms = arm_configs(spec, path, LONG / "study.yaml")
    assert len(arms) == 5
    spec, path = load_study(LONG / "study_replay.yaml")
    assert list(spec.arms) == ["gspo", "grpo", "grpo_r2"]
    arms = arm_configs(spec, path, LONG / "study_replay.yaml")
    assert [cfg.train.max_steps for _, cfg in arms.values()] == [60, 60, 60]


@pytest.mark.parametrize("arch,folder", [("dense", "base"), ("moe", "base_moe")])
def test_shipped_bases_are_the_pretrain_scripts_architectures(pretrain, arch, folder):
    """The shipped base models have the shapes `pretrain.py --arch` builds (a rebuilt or
    edited architecture that no longer matches the shipped files fails here)."""
    cfg = json.loads((LONG / folder / "config.json").read_text())
    for key, want in pretrain.ARCHS[arch].items():
        assert cfg[key] == want, (folder, key, cfg[key], want)
    assert (LONG / folder / "model.safetensors").stat().st_size > 1_000_000
