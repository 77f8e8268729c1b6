"""Prompt datasets for RL: rows from JSONL or Parquet files (or, through the `datasets` library,
a `save_to_disk` directory or a Hugging Face dataset name: `hf_datasets.py`), rendered with the
tokenizer's chat template (or used as raw text), validated once at load time, and served in
shuffled batches by an epoch-based iterator whose cursor (epoch, position) is saved in
checkpoints.

A row gives a prompt (a string, or a list of chat messages {"role", "content"}) and, optionally,
a label (the reference answer the reward function checks). All other fields of the row are kept
as the item's metadata and reach the reward function.

Bad rows (bytes that are not UTF-8, unparseable JSON, missing key, wrong type, empty prompt,
prompt longer than the maximum) raise a one-line DatasetError naming the file and row, or, with
`skip_bad_rows`, are skipped and counted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np

logger = logging.getLogger(__name__)

SUFFIXES_JSONL = (".jsonl", ".json", ".ndjson")
SUFFIXES_PARQUET = (".parquet", ".pq")


class DatasetError(ValueError):
    """A dataset file or row that cannot be used."""


class TokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer the datasets use."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class PromptItem:
    """One prompt ready for rollout.

    Attributes:
        prompt_ids: token ids of the rendered prompt (generation prompt included).
        prompt: the rendered prompt text.
        label: the reference answer for the reward function (None when the dataset has none).
        row: 0-based row index in the source file (JSONL: line number - 1).
        metadata: the row's other fields.
    """

    prompt_ids: list[int]
    prompt: str
    label: Any
    row: int
    metadata: dict[str, Any] = field(default_factory=dict)


class _BadRow(Exception):
    pass


def _read_jsonl(path: Path) -> Iterator[tuple[int, str, Any]]:
    """Yield (row index, where, parsed row or _BadRow) for each non-blank line."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            where = f"{path} line {i + 1}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield i, where, _BadRow(f"not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                        f"{e.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                yield i, where, json.loads(line)
            except json.JSONDecodeError as e:
                yield i, where, _BadRow(f"invalid JSON ({e.msg} at column {e.colno})")


def _as_dataset_errors(rows: Iterator[tuple[int, str, Any]], kind: type[Exception]
                       ) -> Iterator[tuple[int, str, Any]]:
    """`rows`, with a reading error of type `kind` re-raised as a DatasetError."""
    try:
        yield from rows
    except kind as e:
        raise DatasetError(str(e)) from None


def _read_parquet(path: Path) -> Iterator[tuple[int, str, Any]]:
    """Yield (row index, where, row dict) for each row of a Parquet file."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DatasetError(f"{path}: cannot read Parquet file: {e}") from e
    for i, row in enumerate(table.to_pylist()):
        yield i, f"{path} row {i}", row


def _as_messages(value: Any, system_prompt: str | None) -> list[dict[str, str]]:
    """Turn a prompt field into chat messages, checking their shape."""
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        for j, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise _BadRow(f"prompt message {j} is not {{'role': str, 'content': str}}")
        messages = [dict(m) for m in value]
    else:
        raise _BadRow(f"prompt must be a string or a non-empty list of messages, got "
                      f"{type(value).__name__}")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _check_encodable(value: Any, key: str) -> None:
    """_BadRow when a string of the prompt (its text, or a message's content) holds a lone
    surrogate (JSON "\\ud800"), which is not text any tokenizer can encode."""
    texts = [value] if isinstance(value, str) else [
        m.get("content") for m in value if isinstance(m, dict)] if isinstance(value, list) else []
    for j, t in enumerate(texts):
        if not isinstance(t, str):
            continue
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            where = f"message {j} of {key!r}" if isinstance(value, list) else repr(key)
            raise _BadRow(f"prompt {where} holds a lone surrogate {t[e.start]!r} at character "
                          f"{e.start} (not encodable text)") from None


class PromptDataset:
    """All valid rows of one JSONL or Parquet file, tokenized.

    Args:
        path: a .jsonl/.json/.ndjson (one JSON object per line) or .parquet file, a directory
            written by `datasets`' save_to_disk, or a Hugging Face dataset name.
        tokenizer: a Hugging Face tokenizer (anything with `apply_chat_template` and `encode`).
        prompt_key: field holding the prompt (a string, or a list of chat messages).
        label_key: field holding the reference answer; None when the rows have no labels.
        system_prompt: system message prepended to chat prompts that have none.
        apply_chat_template: render prompts with the tokenizer's chat template (with the
            generation prompt); when False the prompt field must be a string and is used as is.
        max_prompt_length: rows whose prompt has more tokens are bad rows; None: no limit.
        skip_bad_rows: skip and count bad rows instead of raising DatasetError.
        split: the split of a saved DatasetDict or a Hugging Face dataset.
        dataset_config: the configuration name of a Hugging Face dataset loaded by name.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: TokenizerLike,
        prompt_key: str = "prompt",
        label_key: str | None = "answer",
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
        max_prompt_length: int | None = None,
        skip_bad_rows: bool = False,
        split: str = "train",
        dataset_config: str | None = None,
    ) -> None:
        from megatron_gspo.data import hf_datasets

        self.path = Path(path)
        hf_source = self.path.is_dir() or hf_datasets.is_hub_name(str(path))
        if not hf_source and not self.path.is_file():
            raise DatasetError(f"dataset file not found: {self.path}")
        if system_prompt is not None and not apply_chat_template:
            raise DatasetError("system_prompt needs apply_chat_template=True")
        suffix = self.path.suffix.lower()
        if hf_source:
            try:
                _, rows = hf_datasets.load_rows(str(path), split, dataset_config)
            except hf_datasets.HFDatasetError as e:
                raise DatasetError(str(e)) from None
            rows = _as_dataset_errors(rows, hf_datasets.HFDatasetError)
        elif suffix in SUFFIXES_JSONL:
            rows = _read_jsonl(self.path)
        elif suffix in SUFFIXES_PARQUET:
            rows = _read_parquet(self.path)
        else:
            raise DatasetError(
                f"{self.path}: unknown dataset format {suffix!r} "
                f"(use one of {SUFFIXES_JSONL + SUFFIXES_PARQUET})"
            )
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.label_key = label_key
        self.system_prompt = system_prompt
        self.apply_chat_template = apply_chat_template
        self.max_prompt_length = max_prompt_length
        self.items: list[PromptItem] = []
        self.skipped: list[str] = []  # one message per skipped row
        for row_index, where, row in rows:
            try:
                self.items.append(self._make_item(row_index, row))
            except _BadRow as e:
                msg = f"{where}: {e}"
                if not skip_bad_rows:
                    raise DatasetError(msg + " (set skip_bad_rows to skip such rows)") from None
                self.skipped.append(msg)
        if self.skipped:
            logger.warning("%s: skipped %d bad rows; first: %s",
                           self.path, len(self.skipped), self.skipped[0])
        if not self.items:
            raise DatasetError(f"{self.path}: no usable rows "
                               f"({len(self.skipped)} bad rows skipped)")

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: TokenizerLike, **kwargs: Any) -> PromptDataset:
        """Same as the constructor (kept for call sites that read better this way)."""
        return cls(path, tokenizer, **kwargs)

    @property
    def num_skipped(self) -> int:
        """Number of bad rows skipped at load time."""
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    def render(self, prompt: Any) -> tuple[str, list[int]]:
        """Prompt field -> (text, token ids), with this dataset's template settings.

        Raises _BadRow for prompts of the wrong shape.
        """
        if self.apply_chat_template:
            messages = _as_messages(prompt, self.system_prompt)
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            # the template already holds any BOS / special tokens it wants
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            if not isinstance(prompt, str):
                raise _BadRow(f"prompt must be a string without a chat template, got "
                              f"{type(prompt).__name__}")
            text = prompt
            ids = self.tokenizer.encode(text)
        return text, list(ids)

    def _make_item(self, row_index: int, row: Any) -> PromptItem:
        if isinstance(row, _BadRow):
            raise row
        if not isinstance(row, dict):
            raise _BadRow(f"row must be a JSON object, got {type(row).__name__}")
        if self.prompt_key not in row:
            raise _BadRow(f"missing key {self.prompt_key!r} (keys: {sorted(row)})")
        prompt = row[self.prompt_key]
        if isinstance(prompt, str) and not prompt.strip():
            raise _BadRow(f"empty prompt in {self.prompt_key!r}")
        _check_encodable(prompt, self.prompt_key)  # the tokenizer raises on a lone surrogate
        label = None
        if self.label_key is not None:
            if self.label_key not in row:
                raise _BadRow(f"missing key {self.label_key!r} (keys: {sorted(row)})")
            label = row[self.label_key]
            if label is None:
                raise _BadRow(f"label {self.label_key!r} is null")
            if not isinstance(label, (str, int, float, bool, list, dict)):
                raise _BadRow(f"label {self.label_key!r} has unsupported type "
                              f"{type(label).__name__}")
        text, ids = self.render(prompt)
        if not ids:
            raise _BadRow("prompt renders to zero tokens")
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            raise _BadRow(f"prompt has {len(ids)} tokens, more than max_prompt_length="
                          f"{self.max_prompt_length}")
        metadata = {k: v for k, v in row.items() if k not in (self.prompt_key, self.label_key)}
        return PromptItem(prompt_ids=ids, prompt=text, label=label, row=row_index,
                          metadata=metadata)


class PromptIterator:
    """Shuffled prompts over epochs, with a resumable cursor.

    Iterating yields one item at a time (endlessly unless num_epochs is set); `next_batch`
    returns several. Epoch e visits the items in the order of a permutation drawn from
    (seed, e); a batch that reaches the end of an epoch continues with the next epoch, so every
    batch is full. The cursor is (epoch, position in that epoch's order) and advances by
    exactly the items handed out; `load_state_dict` of a saved cursor continues exactly where
    the saved iterator stopped.

    Args:
        dataset: the items (anything with __len__ and __getitem__).
        batch_size: default number of items per `next_batch`.
        seed: shuffle seed.
        shuffle: when False every epoch visits the items in file order.
        num_epochs: stop after this many epochs (StopIteration); None: never stop.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, seed: int = 0, shuffle: bool = True,
                 num_epochs: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
        self.dataset = dataset
        self.size = len(dataset)
        if self.size == 0:
            raise ValueError("cannot iterate over an empty dataset")
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order = np.arange(self.size)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            else:
                self._order = np.arange(self.size)
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> Any:
        """The next item; StopIteration after num_epochs epochs."""
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        item = self.dataset[int(self._epoch_order(self.epoch)[self.position])]
        self.position += 1
        if self.position == self.size:
            self.epoch += 1
            self.position = 0
        return item

    def next_batch(self, n: int | None = None) -> list[Any]:
        """The next n (default batch_size) items; the last batch of the last epoch may be short.

        Raises StopIteration when num_epochs epochs are done before the call.
        """
        n = self.batch_size if n is None else n
        batch = [next(self)]
        for _ in range(n - 1):
            try:
                batch.append(next(self))
            except StopIteration:
                break
        return batch

    def batches(self) -> Iterator[list[Any]]:
        """Iterate over batches of batch_size items until num_epochs (forever when None)."""
        while True:
            try:
                yield self.next_batch()
            except StopIteration:
                return

    def state_dict(self) -> dict[str, int]:
        """The cursor: {"epoch", "position", "seed", "size", "shuffle"}."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "size": self.size, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a cursor saved by state_dict; the dataset and seed must be the same."""
        missing = {"epoch", "position", "seed", "size"} - set(state)
        if missing:
            raise ValueError(f"data cursor lacks {sorted(missing)}")
        # (DatasetError: one line at the command line, naming the setting that differs)
        path = getattr(self.dataset, "path", None) or "the train file"
        if int(state["size"]) != self.size:
            raise DatasetError(f"data.train_path: {path} has {self.size} usable prompts, the "
                               f"checkpoint's data cursor was saved for {state['size']}; resume "
                               "with the train file the run started with")
        if int(state["seed"]) != self.seed:
            raise DatasetError(f"train.seed: {self.seed}, but the checkpoint's data cursor was "
                               f"saved with seed {state['seed']}; resume with "
                               f"train.seed={state['seed']}")
        if not 0 <= int(state["position"]) < self.size:
            raise DatasetError(f"data cursor position {state['position']} outside "
                               f"[0, {self.size})")
        if "shuffle" in state and bool(state["shuffle"]) != self.shuffle:
            raise DatasetError(f"data.shuffle: {self.shuffle}, but the checkpoint's data cursor "
                               f"was saved with shuffle={bool(state['shuffle'])}; resume with "
                               f"data.shuffle={str(bool(state['shuffle'])).lower()}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
