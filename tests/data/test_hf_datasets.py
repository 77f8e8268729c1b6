"""`data.train_path` / eval sets through the `datasets` library: save_to_disk directories
(Dataset and DatasetDict, split and column names configurable), Hub names routed to
load_dataset (faked here: no hub access), and one-line errors."""

import pytest

datasets = pytest.importorskip("datasets")

from megatron_gspo.data import hf_datasets  # noqa: E402
from megatron_gspo.data.datasets import DatasetError, PromptDataset  # noqa: E402
from tests.data.test_datasets import TOK  # noqa: E402

ROWS = [{"question": "1+1?", "solution": "#### 2", "level": 1},
        {"question": "2+3?", "solution": "#### 5", "level": 2}]


def test_saved_dataset_directory(tmp_path):
    d = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(d))
    ds = PromptDataset(d, TOK, prompt_key="question", label_key="solution",
                       apply_chat_template=False)
    assert [it.label for it in ds.items] == ["#### 2", "#### 5"]
    assert ds[1].prompt == "2+3?" and ds[1].metadata == {"level": 2} and ds[1].row == 1


def test_saved_dataset_dict_picks_the_split(tmp_path):
    d = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(d))
    kw = dict(prompt_key="question", label_key="solution")
    assert len(PromptDataset(d, TOK, split="train", **kw)) == 2
    assert len(PromptDataset(d, TOK, split="test", **kw)) == 1
    with pytest.raises(DatasetError, match=r"no split 'validation' \(splits: train, test\)"):
        PromptDataset(d, TOK, split="validation", **kw)


def test_bad_rows_of_a_saved_dataset_name_the_row(tmp_path):
    d = tmp_path / "bad"
    datasets.Dataset.from_list([{"q": "ok", "a": "1"}, {"q": "", "a": "2"}]).save_to_disk(str(d))
    with pytest.raises(DatasetError, match=r"bad \[train\] row 1: empty prompt"):
        PromptDataset(d, TOK, prompt_key="q", label_key="a")
    ds = PromptDataset(d, TOK, prompt_key="q", label_key="a", skip_bad_rows=True)
    assert len(ds) == 1 and ds.num_skipped == 1


def test_a_directory_that_is_not_a_saved_dataset(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DatasetError, match="not a directory written by datasets' save_to_disk"):
        PromptDataset(tmp_path / "plain", TOK)


def test_hub_names_go_to_load_dataset_with_config_and_split(monkeypatch):
    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if name == "org/missing":
            raise FileNotFoundError("Dataset 'org/missing' doesn't exist on the Hub\nmore")
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = PromptDataset("openai/gsm8k", TOK, prompt_key="question", label_key="solution",
                       split="test", dataset_config="main")
    assert calls == [("openai/gsm8k", "main", "test")] and len(ds) == 2
    with pytest.raises(DatasetError) as e:
        PromptDataset("org/missing", TOK)
    assert str(e.value) == ("org/missing [train]: cannot load the Hugging Face dataset: "
                            "FileNotFoundError: Dataset 'org/missing' doesn't exist on the Hub")


def test_files_and_missing_paths_are_not_hub_names(tmp_path):
    assert hf_datasets.is_hub_name("openai/gsm8k") and hf_datasets.is_hub_name("gsm8k")
    assert not hf_datasets.is_hub_name("/data/train")  # absolute path
    assert not hf_datasets.is_hub_name("data/train.jsonl")
    assert not hf_datasets.is_hub_name(str(tmp_path))
    with pytest.raises(DatasetError, match="dataset file not found"):
        PromptDataset(tmp_path / "missing.jsonl", TOK)


def test_train_path_and_eval_sets_from_saved_datasets_through_the_config(tmp_path):
    from pathlib import Path

    from transformers import AutoTokenizer

    from megatron_gspo.loop import build
    from megatron_gspo.config import load_config

    root = Path(__file__).resolve().parents[2]
    d = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS * 3),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(d))
    cfg = load_config(root / "examples" / "tiny" / "config.yaml",
                      [f"data.train_path={d}", f"data.eval_sets={{held: {d}}}",
                       "data.prompt_key=question", "data.label_key=solution",
                       "data.eval_split=test", "data.eval_path=null"])
    tok = AutoTokenizer.from_pretrained(root / "examples" / "tiny" / "base")
    assert len(build.prompt_stream(cfg, tok).next_batch(6)) == 6
    sets = build.eval_prompts(cfg, tok)
    assert list(sets) == ["held"] and len(sets["held"]) == 1


def _damaged(tmp_path, kind):
    d = tmp_path / kind
    rows = [] if kind == "empty" else [{"question": "x" * 100, "solution": "1"}] * 200
    datasets.Dataset.from_list(rows).save_to_disk(str(d))
    if kind == "truncated":
        for f in d.glob("*.arrow"):
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)
    if kind == "bad_state":
        (d / "state.json").write_text('{"_data_files": 3}')
    return d


@pytest.mark.parametrize("kind,needle", [
    ("empty", "cannot read the saved dataset"), ("truncated", "cannot read the saved dataset"),
    ("bad_state", "cannot read the saved dataset")])
def test_damaged_saved_datasets_are_one_line_errors(tmp_path, kind, needle):
    d = _damaged(tmp_path, kind)
    with pytest.raises(DatasetError, match=needle) as e:
        PromptDataset(d, TOK, prompt_key="question", label_key="solution",
                      apply_chat_template=False)
    assert str(d) in str(e.value) and "\n" not in str(e.value)
