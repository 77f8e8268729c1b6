"""SGLang version differences, in one place (supported: 0.5.12 through 0.5.23).

The client, launcher and weight sync write against one protocol and ask this module where
releases differ; nothing else branches on the SGLang version. Each difference names the
upstream file that changed (paths under python/sglang/srt/):

- Weight-update sessions (managers/scheduler_components/weight_updater.py, 0.5.23): tensor
  and distributed weight updates are refused ("must run between begin_weight_update() and
  end_weight_update()") outside a session opened by `POST /begin_weight_update` and closed by
  `POST /end_weight_update` (entrypoints/http_server.py). 0.5.12 has neither endpoint and
  answers 404: `UPDATE_SESSION_PATHS`, `lacks_update_sessions` (the engine remembers the
  answer per server, so no version is read).
- Memory release on the CPU engine (managers/scheduler_components/weight_updater.py:379 in
  0.5.23, managers/scheduler_update_weights_mixin.py:156 in 0.5.12): `release_memory_occupation`
  ends with `torch.get_device_module().synchronize()`. Under torch 2.11 (0.5.12's pin) that is
  `torch.cpu` on a machine without a GPU; under torch 2.14.1 (0.5.23's pin) `torch/__init__.py`
  `get_device_module` takes `torch._C._accelerator_getAccelerator()`, the build's accelerator,
  so a CUDA build gives `torch.cuda` and the call raises "Found no NVIDIA driver": the scheduler
  dies and the server exits. A CPU-engine server has no memory saver (torch_memory_saver needs
  CUDA; the launcher leaves --enable-memory-saver out), so on 0.5.12 release and resume free
  nothing. `sends_memory_calls` says which servers get them: none that reports device "cpu".
- Request ids refused before the scheduler (managers/tokenizer_manager.py): 0.5.12 keeps for
  good the rid of a request refused for its length; 0.5.23 releases it
  (`_release_req_states_on_failure`). The client sends a fresh rid per attempt: neither matters.
- The range itself (`SUPPORTED`, `version_warning`): a server outside it is served but logged.
"""

from __future__ import annotations

import re

#: Oldest and newest SGLang release tested (README "Supported versions"; the sglang_real tier
#: runs against both, scripts/sglang_cpu/lock-<version>.txt).
SUPPORTED = ("0.5.12", "0.5.23")

#: Opening and closing of a weight-update session (SGLang 0.5.23 entrypoints/http_server.py).
UPDATE_SESSION_PATHS = ("/begin_weight_update", "/end_weight_update")


def lacks_update_sessions(error: Exception) -> bool:
    """True when `error` (the client's RolloutError of `POST /begin_weight_update`) is the 404
    of a release without weight-update sessions (0.5.12); any other failure is a real one."""
    return "answered HTTP 404" in str(error)


def sends_memory_calls(server_info: dict) -> bool:
    """Whether `/release_memory_occupation` and `/resume_memory_occupation` go to the server of
    this `/server_info`: not to SGLang's CPU engine (`device` "cpu"), which has no memory to
    release and which they end on 0.5.23 (see the module docstring)."""
    return server_info.get("device") != "cpu"


def _release(text: str) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(x) for x in m.groups()) if m else None


def version_warning(server_info: dict) -> str | None:
    """A one-line note when the server's `version` is an SGLang release outside `SUPPORTED`
    (None inside it, and for servers that report no release, e.g. the stand-in)."""
    got = _release(str(server_info.get("version", "")))
    if got is None:
        return None
    low, high = (_release(v) for v in SUPPORTED)
    assert low is not None and high is not None
    if low <= got <= high:
        return None
    return (f"SGLang {server_info['version']} is outside the tested range {SUPPORTED[0]} to "
            f"{SUPPORTED[1]} (megatron_gspo/rollout/sglang/compat.py)")
