"""The python tool's limits (`agent.env_kwargs.python_kwargs`, PythonSandbox's arguments): one
typed dataclass, checked like a config section (unknown keys, wrong types and out-of-range values
name their path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_gspo.config.schema import ConfigError, from_dict, option
from megatron_gspo.config.yaml_strict import brief

__all__ = ["PythonToolLimits", "check_python_limits"]


@dataclass
class PythonToolLimits:
    """The python tool's limits (agent.env_kwargs.python_kwargs; PythonSandbox's arguments)."""

    cpu_seconds: int = option(5, "CPU seconds of one call, all its processes together (a "
                             "cgroup; else one process, RLIMIT_CPU)", ge=1, le=86400)
    memory_mb: int = option(512, "memory of one call in MiB, all its processes together "
                            "(a cgroup, with max_disk_mb; else one process) and each "
                            "process's RLIMIT_AS", ge=64,
                            le=1 << 22)
    wall_timeout_s: float = option(10.0, "wall-clock seconds of one call (default: the tool "
                                   "timeout minus 1 s)", gt=0, le=86400)
    max_output_chars: int = option(4000, "cap on the text a call returns", ge=1, le=10**8)
    max_file_mb: int = option(16, "largest file a call may write (RLIMIT_FSIZE)", ge=1,
                              le=1 << 20)
    max_disk_mb: int = option(64, "byte quota of a call's temp dir, all files together", ge=1,
                              le=1 << 20)
    isolate_network: bool = option(True, "own user, PID, mount and network namespaces")
    max_code_chars: int = option(20000, "longest program accepted", ge=1, le=10**8)
    max_processes: int = option(16, "processes of one call (RLIMIT_NPROC, pids cgroup; 1 "
                                "where no cgroup can be made)", ge=1,
                                le=4096)
    require_landlock: bool = option(True, "refuse to run on a kernel without Landlock")


def check_python_limits(value: Any, path: str) -> dict[str, Any]:
    """`value` (python_kwargs) checked against PythonToolLimits; returns the keys it sets.
    Raises ConfigError naming `path.key` for an unknown key, a wrong type or a bad value."""

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping of python tool limits, got {brief(value)}")
    checked = from_dict(PythonToolLimits, value, path)
    return {k: getattr(checked, k) for k in value}
