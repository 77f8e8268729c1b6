"""`megatron_gspo.algo` exports its public API at the package level, with `__all__`, and stays
pure torch (importing it imports no Megatron)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import megatron_gspo.algo as algo

MODULES = ("advantages", "kl", "logprobs", "losses", "precision", "sapo", "cispo", "gmpo",
           "corrections", "speculative_sampling")


def test_documented_names_import_from_the_package():
    from megatron_gspo.algo import (entropy_loss, group_advantages, grpo_loss,  # noqa: F401
                                    gspo_loss, gspo_token_loss, kl_loss, kl_reward,
                                    sequence_kl, token_kl, token_logprobs)

    from megatron_gspo.algo import losses

    assert gspo_loss is losses.gspo_loss


def test_all_lists_every_submodule_export_and_each_name_is_the_submodule_object():
    assert len(algo.__all__) == len(set(algo.__all__))
    for name in algo.__all__:
        assert hasattr(algo, name), name
    for mod in MODULES:
        sub = importlib.import_module(f"megatron_gspo.algo.{mod}")
        missing = set(sub.__all__) - set(algo.__all__)
        assert not missing, f"{mod}: {sorted(missing)} not exported by megatron_gspo.algo"
        for name in sub.__all__:
            assert getattr(algo, name) is getattr(sub, name), f"{mod}.{name}"


def test_star_import_gives_exactly_all():
    ns: dict = {}
    exec("from megatron_gspo.algo import *", ns)  # noqa: S102
    assert set(ns) - {"__builtins__"} == set(algo.__all__)


def test_package_import_is_pure_torch():
    code = ("import sys, megatron_gspo.algo; "
            "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
