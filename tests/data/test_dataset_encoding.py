"""Bytes that are not UTF-8 in a JSONL row make that row bad (named by file and line), not a
traceback; with skip_bad_rows the other rows load. Unlabeled rows load with label_key=None."""

import pytest

from megatron_gspo.data.datasets import DatasetError, PromptDataset
from tests.data.test_datasets import TOK


def _rows(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "1+1?", "answer": "2"}\n'
                  b'{"prompt": "caf\xe9 1+2?", "answer": "3"}\n'
                  b'{"prompt": "2+2?", "answer": "4"}\n')
    return p


def test_non_utf8_row_is_a_bad_row(tmp_path):
    p = _rows(tmp_path)
    with pytest.raises(DatasetError, match=r"d.jsonl line 2: not UTF-8 \(byte 0xe9 at column "
                                           r"16\)"):
        PromptDataset(p, TOK)
    ds = PromptDataset(p, TOK, skip_bad_rows=True)
    assert [it.label for it in ds] == ["2", "4"] and ds.num_skipped == 1
    assert [it.row for it in ds] == [0, 2]


def test_unlabeled_rows_with_label_key_none(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_text('{"prompt": "write a poem"}\n{"prompt": "say hi", "extra": 1}\n')
    ds = PromptDataset(p, TOK, label_key=None)
    assert [it.label for it in ds] == [None, None]
    assert ds[1].metadata == {"extra": 1}
