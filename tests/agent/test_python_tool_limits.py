"""The python tool's limits are typed (issue 43 item 16): a bad value in
agent.env_kwargs.python_kwargs is a one-line config error naming its path, at load time;
a limit the kernel cannot take (cpu_seconds: 1e30) never reaches a tool call."""

import asyncio

import pytest
import yaml

from megatron_gspo.agent.tools import PythonSandbox, build_toolset
from megatron_gspo.cli import main
from megatron_gspo.config import ConfigError, load_config

BAD = [
    ("max_disk_mb: -1", r"python_kwargs.max_disk_mb: expected int >= 1"),
    ("memory_mb: lots", r"python_kwargs.memory_mb: expected int >= 64 .*got 'lots'"),
    ("bogus: 1", r"python_kwargs.bogus: unknown key; known keys: cpu_seconds"),
    ("cpu_seconds: 0", r"python_kwargs.cpu_seconds: expected int >= 1 and <= 86400, got 0"),
    ("cpu_seconds: 1e30", r"python_kwargs.cpu_seconds: expected int >= 1 and <= 86400"),
    ("cpu_seconds: 100000000000000000000", r"python_kwargs.cpu_seconds: expected int"),
    ("wall_timeout_s: .inf", r"python_kwargs.wall_timeout_s: expected a finite float"),
    ("isolate_network: 'no'", r"python_kwargs.isolate_network: expected bool"),
]


def _config(tmp_path, limits: str):
    path = tmp_path / "config.yaml"
    path.write_text("agent:\n  enabled: true\n  python_tool: true\n  env_kwargs:\n"
                    "    python_kwargs:\n      " + limits + "\n")
    return str(path)


@pytest.mark.parametrize("limits,match", BAD)
def test_bad_python_tool_limit_is_a_one_line_config_error(tmp_path, capsys, limits, match):
    path = _config(tmp_path, limits)
    with pytest.raises(ConfigError, match="agent.env_kwargs." + match):
        load_config(path)
    assert main(["config", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "agent.env_kwargs.python_kwargs." in err[0], err


@pytest.mark.parametrize("limits,match", BAD)
def test_bad_limit_given_in_code_names_the_field(limits, match):
    kwargs = yaml.safe_load(limits)
    with pytest.raises(ConfigError, match=match):
        build_toolset(python=True, python_kwargs=kwargs)
    if "bogus" not in kwargs:
        with pytest.raises(ConfigError, match=match):
            PythonSandbox(**kwargs)


def test_good_limits_load_and_the_tool_runs(tmp_path):
    cfg = load_config(_config(tmp_path, "{cpu_seconds: 2, memory_mb: 256, max_disk_mb: 8}"))
    kwargs = cfg.agent.env_kwargs["python_kwargs"]
    assert kwargs == {"cpu_seconds": 2, "memory_mb": 256, "max_disk_mb": 8}
    tools = build_toolset(python=True, timeout_s=20, python_kwargs=kwargs)
    sb = tools.tools["python"]
    assert (sb.cpu_seconds, sb.max_disk_bytes, sb.wall_timeout_s) == (2, 8 << 20, 19.0)
    assert asyncio.run(sb({"code": "print(6 * 7)"})) == "42"
