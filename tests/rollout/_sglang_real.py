"""The `sglang_real` tier's common ground: where scripts/sglang_cpu.sh installed SGLang's CPU
server (MEGATRON_GSPO_SGLANG_CPU, default .sglang-cpu in the repository root), one-line skips
when it is not installed (a failure instead with MEGATRON_GSPO_SGLANG_REQUIRED=1, as in CI), and
the launch of real servers through the project's own launcher (`LaunchSpec`, device cpu)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny" / "base"
API_KEY = "tier-k3y"


def install_dir() -> Path:
    return Path(os.environ.get("MEGATRON_GSPO_SGLANG_CPU") or ROOT / ".sglang-cpu").resolve()


def python() -> str:
    return str(install_dir() / "venv" / "bin" / "python")


def version() -> str:
    """The installed SGLang release ("0.5.12"; "" when not installed)."""
    found = sorted(install_dir().glob("venv/lib/python3*/site-packages/sglang-*.dist-info"))
    return found[0].name[len("sglang-"):-len(".dist-info")] if found else ""


#: The release the stand-in copies (its answers are compared key for key with this one's).
PINNED = "0.5.12"


def require_tier() -> None:
    """Skip (one line) unless scripts/sglang_cpu.sh finished its install."""
    d = install_dir()
    if not (d / ".installed").is_file() or not Path(python()).is_file():
        msg = (f"SGLang CPU server not installed in {d} (run scripts/sglang_cpu.sh, then "
               ".venv/bin/python -m pytest -m sglang_real tests/rollout)")
        if os.environ.get("MEGATRON_GSPO_SGLANG_REQUIRED") == "1":
            pytest.fail(msg)
        pytest.skip(msg, allow_module_level=True)


def spec(model: str | Path, dtype: str = "float32", api_key: str | None = None,
         log_dir: str | None = None, extra: tuple[str, ...] = ()):
    """LaunchSpec of one real CPU server of `model` (what `rollout.sglang_device=cpu` builds)."""
    from megatron_gspo.rollout.sglang.launch import LaunchSpec, cpu_server_env

    return LaunchSpec(model_path=str(model), base_port=0, dtype=dtype, python=python(),
                      device="cpu", env=cpu_server_env(python()), log_dir=log_dir,
                      api_key=api_key, extra_args=("--skip-server-warmup", *extra))


def wait_idle(url: str, timeout_s: float = 120.0) -> float:
    """Wait until the real server at `url` runs and queues nothing: its `/flush_cache` answers
    400 while any request is pending (scheduler.flush_cache in SGLang's managers/scheduler.py)
    and 200 once idle. Returns the seconds waited; fails the test after `timeout_s`."""
    import time
    import urllib.error
    import urllib.request

    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout_s:
        req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read()[:200]!r}"
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    pytest.fail(f"{url} still busy after {timeout_s:.0f} s (last /flush_cache: {last})")


def train_args() -> list[str]:
    """Config overrides that run the trainer's rollouts on launched real CPU servers."""
    return ["rollout.engine=sglang", f"rollout.sglang_python={python()}",
            "rollout.sglang_device=cpu", "rollout.verify_sync_interval=1",
            "rollout.startup_timeout=600"]


def hf_model(model: str | Path, state: dict | None = None, dtype: str = "float32"):
    """The Hugging Face model of `model` (optionally holding `state`), eval mode, on CPU."""
    import torch
    import transformers

    net = transformers.AutoModelForCausalLM.from_pretrained(str(model),
                                                            dtype=getattr(torch, dtype))
    if state is not None:
        net.load_state_dict(state, strict=False)
    return net.eval()


def recompute(net, pairs, temperature: float = 1.0) -> list[list[float]]:
    """Token log-probs of each (prompt ids, response ids) under `net` at `temperature`."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, resp in pairs:
            ids = torch.tensor([list(prompt) + list(resp)])
            logits = net(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # [R, V]
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def perturbed(net, scale: float, seed: int) -> dict:
    """A copy of `net`'s parameters with seeded noise of `scale` added (a 'new version')."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: (v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)).contiguous()
            for k, v in net.state_dict().items()}


class RecomputeLearner:
    """The learner's side of the sync probe (`Learner.forward_logprobs`) by `recompute` on a
    Hugging Face model; nothing offloaded."""

    def __init__(self, net) -> None:
        self.net = net

    def offloaded_parts(self) -> list[str]:
        return []

    def forward_logprobs(self, samples, temperature):
        return recompute(self.net, [(s.prompt_ids, s.response_ids) for s in samples],
                         temperature)
