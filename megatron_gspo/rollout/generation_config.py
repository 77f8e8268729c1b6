"""The stop ids of a model's `generation_config.json`: its `eos_token_id`, an int or a list
(Gemma 3 instruction models: [1, 106], 106 = <end_of_turn>, which ends a chat turn while the
tokenizer's own eos is 1). Hugging Face `generate` stops on all of them; the rollouts here
stop on them too: `loop.build.tokenizer` reads them where the model is loaded and
`SamplingParams.for_rollouts` adds them to every request's stop ids (embedded engine and
SGLang alike).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["generation_stop_ids"]

MAX_BYTES = 2**20  # a generation_config.json is a few hundred bytes


def generation_stop_ids(model_dir: str | Path) -> list[int]:
    """`eos_token_id` of `model_dir/generation_config.json` as a list of ids ([] without the
    file or the key).

    Raises:
        ValueError naming the file when it is not a JSON object or the ids are not token ids.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_BYTES + 1).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON {type(data).__name__}, expected an object")
    eos = data.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError(f"{path}: eos_token_id {eos!r} is not a token id or a list of them")
    return list(dict.fromkeys(ids))
