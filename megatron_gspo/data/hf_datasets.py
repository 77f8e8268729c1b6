"""Prompt rows from the Hugging Face `datasets` library: a directory written by
`Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or a dataset name on the Hub (or in the
local cache, e.g. with HF_DATASETS_OFFLINE=1), loaded with `load_dataset(name, config,
split=...)`. Rows come out as plain dicts, like the rows of a JSONL or Parquet file, so the
same prompt/label columns (`data.prompt_key`, `data.label_key`) and bad-row rules apply.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, Iterator

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
FILE_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".pq", ".csv", ".txt", ".arrow")


class HFDatasetError(ValueError):
    """A dataset directory or name that `datasets` cannot load (one-line message)."""


def is_hub_name(source: str) -> bool:
    """True for "name" or "org/name" that is not a local path (and has no file suffix)."""
    if source.lower().endswith(FILE_SUFFIXES) or Path(source).exists():
        return False
    return bool(_HUB_NAME.match(source))


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _pick_split(obj: Any, split: str, where: str):
    """The split of a DatasetDict (a Dataset is returned as is)."""
    import datasets

    if isinstance(obj, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in obj:
            raise HFDatasetError(f"{where}: no split {split!r} (splits: {', '.join(obj)}); set "
                                 "data.train_split / data.eval_split")
        return obj[split]
    return obj


def load_rows(source: str | Path, split: str = "train",
              config: str | None = None) -> tuple[str, Iterator[tuple[int, str, Any]]]:
    """Rows of a saved dataset directory or a Hub dataset.

    Args:
        source: a directory saved with `save_to_disk`, or a dataset name ("org/name").
        split: the split to use when the source holds several (a DatasetDict, a Hub dataset).
        config: the dataset configuration of a Hub dataset (e.g. "main"); None: the default.
    Returns:
        (description of the source, iterator of (row index, where, row dict)).
    Raises:
        HFDatasetError naming the source.
    """
    import datasets

    source = str(source)
    if Path(source).is_dir():
        where = f"{source} [{split}]"
        try:
            obj = datasets.load_from_disk(source)
        except (FileNotFoundError, ValueError) as e:
            raise HFDatasetError(f"{source}: not a directory written by datasets' save_to_disk "
                                 f"({_first_line(e)})") from None
        except (OSError, TypeError, KeyError, IndexError, AttributeError) as e:
            # an empty save, a truncated .arrow file, a damaged state.json / dataset_info.json
            raise HFDatasetError(f"{source}: cannot read the saved dataset ({_first_line(e)}); "
                                 "is it damaged or empty? save it again") from None
    else:
        where = f"{source}{'/' + config if config else ''} [{split}]"
        try:
            obj = datasets.load_dataset(source, config, split=split)
        except Exception as e:  # noqa: BLE001 - network, missing dataset/config/split, ...
            raise HFDatasetError(f"{where}: cannot load the Hugging Face dataset: "
                                 f"{_first_line(e)}") from None
    ds = _pick_split(obj, split, source)

    def rows() -> Iterator[tuple[int, str, Any]]:
        it = iter(ds)
        for i in itertools.count():
            try:
                row = next(it)
            except StopIteration:
                return
            except (OSError, ValueError, TypeError, KeyError, IndexError) as e:  # damaged data
                raise HFDatasetError(f"{where} row {i}: cannot read the saved dataset "
                                     f"({_first_line(e)})") from None
            yield i, f"{where} row {i}", dict(row)

    return where, rows()
