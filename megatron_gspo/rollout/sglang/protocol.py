"""Rules of SGLang 0.5.12's HTTP server that the client and the stand-in server both follow.

Each rule names the upstream file it reproduces (paths inside the sglang wheel, `sglang/srt/`):
- ports: server_args.py `_handle_deprecated_args` sets `grpc_port = port + 10000` (or
  `SGLANG_GRPC_PORT`) and refuses a value above 65535 even with gRPC off, so a server port
  above 55535 fails at start;
- context length: managers/tokenizer_manager.py `_validate_one_request` answers 400 when the
  input is not shorter than the context length or input + max_new_tokens exceeds it; the
  context length is `--context-length` or the model config's (utils/hf_transformers/common.py
  `get_context_length`);
- API key: utils/auth.py `decide_request_auth` lets /health* and /metrics* through and wants
  `Authorization: Bearer <key>` everywhere else (401 otherwise);
- health: entrypoints/http_server.py `/health` runs a one-token generation unless
  `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` is false; `/health_generate` always does;
- prompt token ids: a negative id or one not below the model's vocabulary size ends the server
  (layers/vocab_parallel_embedding.py looks it up with no bound check: IndexError in the
  scheduler, managers/scheduler.py, whose death ends the server), so they are never sent;
- dtype: configs/model_config.py `_get_and_verify_dtype` serves `--dtype auto` as the
  config's dtype, except a float32 (or absent) one: float16 (bfloat16 for Gemma);
- /generate answers: `meta_info.output_token_logprobs` holds `[logprob, token_id, text]` per
  generated token, where text is null unless `return_text_in_logprobs` was asked for.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import secrets
from collections.abc import Mapping
from typing import Any

from megatron_gspo.rollout.engine import RolloutError

#: Highest server port SGLang accepts: port + 10000 must stay a valid port (see module doc).
MAX_SERVER_PORT = 55535
#: entrypoints/http_server.py HEALTH_CHECK_TIMEOUT: a health generation that gets no answer
#: within this many seconds is answered 503 (read from this variable at start, default 20).
HEALTH_CHECK_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
HEALTH_CHECK_TIMEOUT_S = 20.0
#: Environment variable that turns /health's one-token generation off (SGLang environ.py).
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
# utils/hf_transformers/common.py CONTEXT_LENGTH_KEYS, in SGLang's order.
_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                 "max_position_embeddings")
_TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config", "thinker_config")


def grpc_port_error(port: int, env: Mapping[str, str]) -> str | None:
    """SGLang's refusal of a server port, or None when the port is accepted.

    Args:
        port: the server's --port.
        env: the server's environment (SGLANG_GRPC_PORT overrides port + 10000).
    """
    raw = env.get("SGLANG_GRPC_PORT")
    grpc = int(raw) if raw not in (None, "") else port + 10000
    if not 1 <= grpc <= 65535:
        return f"SGLANG_GRPC_PORT ({grpc}) must be between 1 and 65535"
    return None


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    """An SGLang boolean environment variable (environ.py EnvBool: true/1/yes/y, false/0/no/n)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    v = raw.lower()
    if v in ("true", "1", "yes", "y"):
        return True
    if v in ("false", "0", "no", "n"):
        return False
    raise ValueError(f'{name}: "{raw}" is not a valid boolean value')


def context_length_of(hf_config: Mapping[str, Any]) -> int:
    """The context length SGLang derives from a Hugging Face config.json mapping.

    Args:
        hf_config: the model's config (a text sub-config is used when present).
    Returns:
        the first of SGLang's context keys, times the rope-scaling factor where it applies;
        2048 when none is set (as upstream).
    """
    cfg: Mapping[str, Any] = hf_config
    for key in _TEXT_CONFIG_KEYS:
        sub = hf_config.get(key)
        if isinstance(sub, Mapping):
            cfg = sub
            break
    factor = 1.0
    rope = cfg.get("rope_scaling")
    if isinstance(rope, Mapping) and rope:
        factor = float(rope.get("factor", 1))
        if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
            factor = 1.0
    for key in _CONTEXT_KEYS:
        val = cfg.get(key)
        if val is not None:
            return int(factor * val)
    return 2048


def length_error(input_tokens: int, max_new_tokens: int | None, context: int) -> str | None:
    """SGLang's 400 message for a request that does not fit the context, or None."""
    if input_tokens >= context:
        return (f"The input ({input_tokens} tokens) is longer than the model's context length "
                f"({context} tokens).")
    if max_new_tokens is not None and input_tokens + max_new_tokens > context:
        return (f"Requested token count exceeds the model's maximum context length of {context} "
                f"tokens. You requested a total of {input_tokens + max_new_tokens} tokens: "
                f"{input_tokens} tokens from the input messages and {max_new_tokens} tokens for "
                "the completion. Please reduce the number of tokens in the input messages or "
                "the completion to fit within the limit.")
    return None


def served_dtype(dtype: str, hf_config: Mapping[str, Any]) -> str:
    """The dtype SGLang serves under `--dtype dtype` for a model config (see module doc)."""
    if dtype != "auto":
        return "float32" if dtype == "float" else dtype
    conf = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    conf = conf.removeprefix("torch.")
    if conf in ("float32", "float"):
        return "bfloat16" if str(hf_config.get("model_type", "")).startswith("gemma") \
            else "float16"
    return conf


def prompt_ids_error(ids: Any, vocab_size: int | None) -> str | None:
    """Why SGLang must not get these prompt token ids (they end the server, see module doc),
    or None. Without a vocabulary size only negative and non-integer ids are refused."""
    for i, t in enumerate(ids):
        if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f" [0, {vocab_size})" if vocab_size is not None else " >= 0"
            return (f"prompt token id {t!r} at position {i} is outside the vocabulary{bound} "
                    "(it would end the SGLang server); not sent")
    return None


def auth_allowed(path: str, authorization: str | None, api_key: str | None) -> bool:
    """Whether SGLang lets a request through when the server runs with `--api-key`."""
    if not api_key or path.startswith("/health") or path.startswith("/metrics"):
        return True
    parts = (authorization or "").split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return secrets.compare_digest(parts[1], api_key)


def http_error(url: str, status: int, text: str) -> str:
    """One line for a non-200 answer (a hint on 401/403, never the key)."""
    hint = (" (the server wants SGLang's --api-key: set rollout.api_key_env)"
            if status in (401, 403) else "")
    return f"{url} answered HTTP {status}{hint}: {text[:300]}"


def decode_json(text: str) -> Any:
    """Parse a server answer; ValueError (with a short reason) when it is not usable JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("answer is JSON nested too deeply to parse") from None
    except ValueError as e:
        raise ValueError(f"answer is not JSON ({e}): {text[:80]!r}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_generate_output(
    out: Any, where: str, max_new_tokens: int | None = None, vocab_size: int | None = None,
) -> tuple[list[int], list[float], str, str | None]:
    """(token ids, log-probs, finish reason, weight version) from one /generate answer.

    Args:
        out: the decoded JSON of one result.
        where: names the server and sample in error messages.
        max_new_tokens: the most tokens the request allowed (longer answers are refused).
        vocab_size: token ids must lie in [0, vocab_size) (None: only >= 0 is checked).
    Raises:
        RolloutError: the answer is malformed (names `where`).
    """
    if isinstance(out, list) and len(out) == 1:
        out = out[0]
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict):
        raise RolloutError(f"{where}: /generate answer has no meta_info: {str(out)[:200]}")
    lps = meta.get("output_token_logprobs")
    if not isinstance(lps, list):
        raise RolloutError(f"{where}: /generate answer lacks meta_info.output_token_logprobs")
    logprobs: list[float] = []
    ids: list[int] = []
    for t, e in enumerate(lps):
        if not isinstance(e, list | tuple) or len(e) < 2:
            raise RolloutError(f"{where}: malformed output_token_logprobs entry {t}: {e!r:.80}")
        lp, tok = e[0], e[1]
        if not _is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
            raise RolloutError(f"{where}: token id {tok!r} at position {t} is not an id in "
                               f"[0, {vocab_size if vocab_size is not None else 'vocab'})")
        if lp is None or isinstance(lp, bool) or not isinstance(lp, int | float) or \
                math.isnan(lp):
            raise RolloutError(f"{where}: log-prob {lp!r} at position {t} is not a number")
        ids.append(tok)
        logprobs.append(float(lp))
    if max_new_tokens is not None and len(ids) > max_new_tokens:
        raise RolloutError(f"{where}: {len(ids)} tokens returned for max_new_tokens="
                           f"{max_new_tokens}")
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in ("stop", "length", "abort"):
        raise RolloutError(f"{where}: unknown finish_reason {fr!r}")
    version = meta.get("weight_version")
    return ids, logprobs, kind, None if version is None else str(version)


def decode_routed_experts(out: Any, where: str, num_tokens: int,
                          shape: tuple[int, int] | None = None):
    """The `meta_info.routed_experts` of one /generate answer asked with `return_routed_experts`:
    base64 of int32 [tokens, layers, top-k] (SGLang 0.5.12 detokenizer_manager), with
    tokens = prompt + completion - 1 (the last sampled token is never fed to the model).

    Args:
        out: the decoded JSON of one result.
        where: names the server and sample in error messages.
        num_tokens: prompt + completion tokens of the sample.
        shape: (layers, top-k) expected (None: only the row count is checked).
    Returns:
        int32 tensor [num_tokens - 1, layers, top-k].
    Raises:
        RolloutError: the field is missing or does not decode to that shape (names `where`).
    """
    import numpy as np
    import torch

    if isinstance(out, list) and len(out) == 1:
        out = out[0]
    b64 = (out.get("meta_info") or {}).get("routed_experts") if isinstance(out, dict) else None
    if not isinstance(b64, str):
        raise RolloutError(f"{where}: /generate answer has no meta_info.routed_experts (start "
                           "SGLang with --enable-return-routed-experts)")
    try:
        raw = base64.b64decode(b64.encode("ascii"), validate=True)
    except (binascii.Error, ValueError):
        raise RolloutError(f"{where}: meta_info.routed_experts is not base64") from None
    rows = num_tokens - 1
    if len(raw) % 4:
        raise RolloutError(f"{where}: meta_info.routed_experts has {len(raw)} bytes, not int32")
    flat = torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy())
    per_row = flat.numel() // rows if rows > 0 else 0
    if rows <= 0 or flat.numel() != rows * per_row or (shape and per_row != shape[0] * shape[1]):
        want = f"{rows} x {shape[0]} x {shape[1]}" if shape else f"{rows} rows"
        raise RolloutError(f"{where}: meta_info.routed_experts holds {flat.numel()} ids, expected "
                           f"{want} (prompt + completion - 1 tokens)")
    if shape is None:
        return flat.reshape(rows, per_row, 1)
    return flat.reshape(rows, shape[0], shape[1])
