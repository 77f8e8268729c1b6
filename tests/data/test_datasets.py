"""Prompt datasets (JSONL, Parquet), bad-row handling and the resumable prompt iterator."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_gspo.data.datasets import DatasetError, PromptDataset, PromptIterator


class CharTokenizer:
    """One id per character; a chat template in the Qwen style."""

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        assert tokenize is False
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


TOK = CharTokenizer()


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_chat_template_label_metadata(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"question": "1+1?", "answer": "2", "source": "a"},
        "",  # blank lines are ignored
        {"question": [{"role": "user", "content": "hi"}], "answer": 3},
    ])
    ds = PromptDataset(p, TOK, prompt_key="question", label_key="answer", system_prompt="S")
    assert len(ds) == 2 and ds.num_skipped == 0
    a, b = ds[0], ds[1]
    assert a.prompt == "<system>S</><user>1+1?</><assistant>"
    assert a.prompt_ids == [ord(c) for c in a.prompt]  # no extra BOS after a template
    assert (a.label, a.row, a.metadata) == ("2", 0, {"source": "a"})
    assert (b.label, b.row) == (3, 2)  # row = line number - 1
    assert b.prompt.startswith("<system>S</><user>hi</>")


def test_raw_prompt_and_no_label(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "abc"}])
    ds = PromptDataset(p, TOK, label_key=None, apply_chat_template=False)
    assert ds[0].prompt == "abc" and ds[0].prompt_ids == [0, 97, 98, 99] and ds[0].label is None
    with pytest.raises(DatasetError, match="system_prompt needs apply_chat_template"):
        PromptDataset(p, TOK, apply_chat_template=False, system_prompt="S")


def test_parquet(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["x", "yy", ""], "answer": ["1", "2", "3"]}), p)
    with pytest.raises(DatasetError, match=r"d\.parquet row 2: empty prompt"):
        PromptDataset(p, TOK)
    ds = PromptDataset(p, TOK, skip_bad_rows=True)
    assert [it.label for it in ds] == ["1", "2"] and ds.num_skipped == 1


BAD_ROWS = [
    ('{"prompt": "ok", "answer": "1"', "line 1: invalid JSON"),
    ({"answer": "1"}, "line 1: missing key 'prompt'"),
    ({"prompt": "ok"}, "line 1: missing key 'answer'"),
    ({"prompt": "ok", "answer": None}, "line 1: label 'answer' is null"),
    ({"prompt": 5, "answer": "1"}, "line 1: prompt must be a string or a non-empty list"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "line 1: prompt message 0 is not"),
    ({"prompt": "   ", "answer": "1"}, "line 1: empty prompt"),
    ([1, 2], "line 1: row must be a JSON object"),
    ({"prompt": "x" * 50, "answer": "1"}, "line 1: prompt has 70 tokens, more than"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_bad_row_error_names_file_and_row(tmp_path, row, message):
    p = write_jsonl(tmp_path / "bad.jsonl", [row, {"prompt": "fine", "answer": "2"}])
    with pytest.raises(DatasetError) as e:
        PromptDataset(p, TOK, max_prompt_length=40)
    msg = str(e.value)
    assert "bad.jsonl" in msg and message in msg and "\n" not in msg
    ds = PromptDataset(p, TOK, max_prompt_length=40, skip_bad_rows=True)
    assert len(ds) == 1 and ds.num_skipped == 1 and ds[0].row == 1
    assert message in ds.skipped[0]


def test_file_errors(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        PromptDataset(tmp_path / "nope.jsonl", TOK)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown dataset format '.csv'"):
        PromptDataset(tmp_path / "d.csv", TOK)
    p = write_jsonl(tmp_path / "allbad.jsonl", [{"x": 1}])
    with pytest.raises(DatasetError, match="no usable rows"):
        PromptDataset(p, TOK, skip_bad_rows=True)
    (tmp_path / "corrupt.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot read Parquet"):
        PromptDataset(tmp_path / "corrupt.parquet", TOK)


def test_iterator_epochs_cover_everything_and_reshuffle():
    it = PromptIterator(list(range(10)), batch_size=4, seed=3)
    batches = [it.next_batch() for _ in range(5)]  # 20 items = 2 epochs
    flat = [x for b in batches for x in b]
    assert all(len(b) == 4 for b in batches)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new order each epoch
    assert it.state_dict()["epoch"] == 2 and it.state_dict()["position"] == 0
    other_seed = PromptIterator(list(range(10)), batch_size=10, seed=4).next_batch()
    assert other_seed != flat[:10]


def test_iterator_num_epochs_and_no_shuffle():
    it = PromptIterator(list(range(5)), batch_size=2, shuffle=False, num_epochs=1)
    assert list(it.batches()) == [[0, 1], [2, 3], [4]]
    assert list(PromptIterator(list(range(3)), shuffle=False, num_epochs=2)) == [0, 1, 2] * 2


def test_item_iteration_consumes_exactly_what_is_taken():
    """A generator over the iterator abandoned mid-way moves the cursor only by items taken."""
    a = PromptIterator(list(range(9)), seed=5)
    gen = (x for x in a)
    taken = [next(gen) for _ in range(4)]
    assert a.state_dict()["position"] == 4
    b = PromptIterator(list(range(9)), seed=5)
    assert b.next_batch(4) == taken and next(a) == next(b)


def test_iterator_resume_continues_exactly():
    data = list(range(7))
    full = PromptIterator(data, batch_size=3, seed=11)
    reference = [full.next_batch() for _ in range(8)]
    first = PromptIterator(data, batch_size=3, seed=11)
    head = [first.next_batch() for _ in range(2)] + [[next(first) for _ in range(3)]]
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = PromptIterator(data, batch_size=3, seed=11)
    resumed.load_state_dict(state)
    assert head + [resumed.next_batch() for _ in range(5)] == reference


def test_iterator_rejects_mismatched_cursor():
    it = PromptIterator(list(range(7)), batch_size=3, seed=11)
    with pytest.raises(ValueError, match="7 usable prompts, the checkpoint's data cursor was "
                       "saved for 8"):
        it.load_state_dict({"epoch": 0, "position": 0, "seed": 11, "size": 8})
    with pytest.raises(ValueError, match="seed 12"):
        it.load_state_dict({"epoch": 0, "position": 0, "seed": 12, "size": 7})
    with pytest.raises(ValueError, match="lacks"):
        it.load_state_dict({"epoch": 0})
