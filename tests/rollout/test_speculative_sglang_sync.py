"""The speculative draft's weights on every SGLang weight path, against stand-in servers that hold
a NEXTN draft as SGLang does (`standin/draft.py`) of a tiny DeepSeek-V3 checkpoint with its MTP
layer (tests/convert/tiny_mtp.py): a draft tensor changed on the learner side reaches the draft
through tensor, disk, delta (tensor and distributed) and distributed (gloo) updates; acting as
SGLang 0.5.12, the distributed path reaches it only through the project's loader
(`gspo_delta_loader.link_draft`, installed by the launcher's flags): without it the sync is
refused in one line, and the broadcast alone leaves the draft stale. The sync probe's draft
check (`draft_probe.acheck_draft`, SGLang 0.5.23's /weights_checker) passes on a synced draft
and names the path of a stale one; a 0.5.12 server, whose checker cannot read the draft, is
counted unverified. SGLang's real CPU server cannot draft at either release (docs/weight-sync.md
"Speculative servers"), so these run against the stand-in only."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_gspo.rollout.engine import RolloutError
from megatron_gspo.rollout.sglang import weight_sync_delta as delta_sync
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.sglang.launch import LaunchSpec, server_argv
from megatron_gspo.rollout.sglang.speculative import link_launch_extras, speculative_server_args
from megatron_gspo.rollout.sglang.draft_probe import tensor_checksum
from tests.megatron._dist import free_port

ROOT = Path(__file__).resolve().parents[2]
MTP = "model.layers.4."  # the tiny DeepSeek-V3 has 4 layers; its MTP layer is index 4




@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from tests.convert.tiny_mtp import make_mtp_checkpoint

    d = tmp_path_factory.mktemp("spec_sync") / "ds"
    d.mkdir()
    make_mtp_checkpoint("DeepseekV3ForCausalLM", d)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the stand-in decodes its answers
        (d / f).write_bytes((ROOT / "examples" / "tiny" / "base" / f).read_bytes())
    return d


def _learner(mtp_dir: Path, step: int) -> list[tuple[str, torch.Tensor]]:
    """What the weight sync sends after `step` steps of MTP training: the MTP layer's own
    tensors (not its embedding / head copies) with eh_proj and enorm moved, and the final norm."""
    sd = load_file(str(mtp_dir / "model.safetensors"))
    out = [(n, t.float().clone()) for n, t in sorted(sd.items()) if n.startswith(MTP) and not
           any(s in n for s in ("embed_tokens", "shared_head.head"))]
    out.append(("model.norm.weight", sd["model.norm.weight"].float().clone()))
    for n, t in out:
        if n.endswith(("eh_proj.weight", "enorm.weight")):
            t.add_(1e-2 * step)
    return out


def _start(mtp_dir: Path, tmp_path: Path, link: bool, as_0523: bool):
    extra = tuple(speculative_server_args("DeepseekV3ForCausalLM", 2, 1, None)) + (
        "--custom-weight-loader", delta_sync.LOADER)
    env = {"PYTHONPATH": delta_sync.loader_dir(str(tmp_path / "loader")) + ":" + str(ROOT)}
    if link:
        extra, env = link_launch_extras(extra, env)
    extra += ("--device", "cpu") + (("--weight-update-sessions",) if as_0523 else ())
    port = free_port(55535)
    spec = LaunchSpec(model_path=str(mtp_dir), dtype="float32", extra_args=extra,
                      module="megatron_gspo.rollout.standin.server")
    proc = subprocess.Popen(server_argv(spec, 0, port), env={**env, "PATH": "/usr/bin:/bin"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.2)
    raise AssertionError("stand-in did not start")


def _draft(url: str) -> dict[str, str]:
    return json.loads(urllib.request.urlopen(url + "/standin/weights_digest").read())["draft"]


def _holds(url: str, named) -> bool:
    """The server's draft holds the MTP-only tensors of `named` (checksums of SGLang names)."""
    got = _draft(url)
    keys = {n: "draft.model." + n[len(MTP):] for n, _ in named
            if n.startswith(MTP) and n[len(MTP):].split(".")[0] in ("enorm", "eh_proj")}
    assert len(keys) == 2
    return all(got[k] == tensor_checksum(t) for n, t in named for k in [keys.get(n)] if k)


def _engine(url: str, path: str) -> SGLangEngine:
    kw = ({"weight_sync": "distributed", "dist_master": ("127.0.0.1", free_port(55535)),
           "dist_backend": "gloo"} if path == "distributed" else {"weight_sync": "tensor"})
    return SGLangEngine(server_urls=[url], backoff_s=0.01, **kw)


def _stop(proc) -> None:
    proc.terminate()
    proc.wait(30)


def test_each_path_reaches_the_draft_as_0512_with_the_link(mtp_dir, tmp_path):
    from megatron_gspo.rollout.delta.sender import DeltaSender

    proc, url = _start(mtp_dir, tmp_path, link=True, as_0523=False)
    engines: dict[str, SGLangEngine] = {}  # one per transport (one update group per server)
    try:
        assert not _holds(url, _learner(mtp_dir, 1))
        step = 0
        for path in ("tensor", "disk", "delta", "distributed", "delta distributed"):
            step += 1
            named = _learner(mtp_dir, step)
            kind = path.split()[-1]
            if kind not in engines:
                engines[kind] = _engine(url, kind)
            eng = engines[kind]
            eng.delta = None
            if path == "disk":
                d = tmp_path / f"ckpt{step}"
                d.mkdir()
                (d / "config.json").write_text((mtp_dir / "config.json").read_text())
                save_file(dict(named), str(d / "model.safetensors"))
                eng.sync(eng.aupdate_weights_from_disk(str(d), step))
            else:
                if path.startswith("delta"):
                    eng.delta = DeltaSender("on")
                    eng.update_weights([named], step)  # the first delta sync is full
                    step += 1
                    named = _learner(mtp_dir, step)
                eng.update_weights([named], step)
                assert not path.startswith("delta") or eng.delta.stats.delta
            assert _holds(url, named), path
            # SGLang 0.5.12's /weights_checker cannot read the draft: counted unverified
            assert eng.sync(eng.acheck_draft(step)) == {"draft_tensors_checked": 0.0,
                                                        "draft_unverified": 1.0}
    finally:
        for eng in engines.values():
            eng.shutdown()
        _stop(proc)


def test_distributed_without_the_link_is_refused_and_the_broadcast_alone_leaves_it_stale(
        mtp_dir, tmp_path, monkeypatch):
    proc, url = _start(mtp_dir, tmp_path, link=False, as_0523=False)
    eng = _engine(url, "distributed")
    try:
        named = _learner(mtp_dir, 1)
        with pytest.raises(RolloutError) as e:
            eng.update_weights([named], 1)
        msg = str(e.value)
        assert "(distributed)" in msg and "loads the target only" in msg and "\n" not in msg
        assert "--custom-weight-loader gspo_delta_loader.link_draft" in msg
        monkeypatch.setattr(SGLangEngine, "alink_drafts", lambda self, v: _none())
        eng.update_weights([named], 2)  # SGLang 0.5.12's broadcast: the target only
        assert not _holds(url, named)
        tensor = _engine(url, "tensor")
        try:
            tensor.update_weights([named], 3)
            assert _holds(url, named)
        finally:
            tensor.shutdown()
    finally:
        eng.shutdown()
        _stop(proc)


async def _none() -> None:
    return None


def test_as_0523_the_broadcast_reaches_the_draft_and_the_probe_checks_it(mtp_dir, tmp_path):
    proc, url = _start(mtp_dir, tmp_path, link=False, as_0523=True)
    eng = _engine(url, "distributed")
    try:
        named = _learner(mtp_dir, 1)
        eng.update_weights([named], 1)
        assert _holds(url, named)
        assert eng.sync(eng.acheck_draft(1)) == {"draft_tensors_checked": 4.0,
                                                 "draft_unverified": 0.0}
    finally:
        eng.shutdown()
        _stop(proc)


def test_the_probe_names_the_path_of_a_stale_draft(mtp_dir):
    """In-process stand-in acting as 0.5.23 on a CPU: the probe compares checksums exactly;
    the trainer's sync probe (`verify_sync`) passes on the synced draft and fails on a stale
    one, whose target log-probs are right."""
    from megatron_gspo.config import load_config
    from megatron_gspo.loop.weight_sync_phase import verify_sync
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.standin.draft import load_draft
    from megatron_gspo.rollout.standin.server import StandinServer
    from tests.rollout._sglang_real import RecomputeLearner

    served = EmbeddedEngine(str(mtp_dir))
    cfg = load_config(None, ["model.dtype=float32", "rollout.speculative.algorithm=mtp"])
    srv = StandinServer(served, model_path=str(mtp_dir), device="cpu",
                        weight_update_sessions=True, draft=load_draft(str(mtp_dir),
                                                                      torch.float32),
                        speculative={"algorithm": "EAGLE", "num_steps": 2, "eagle_topk": 1,
                                     "num_draft_tokens": 3}).start_in_thread()
    eng = _engine(srv.url, "tensor")
    try:
        eng.update_weights([_learner(mtp_dir, 1)], 1)
        assert verify_sync(RecomputeLearner(served.model), eng, cfg, 1) < 1e-4
        assert eng.draft_probe == {"draft_tensors_checked": 4.0, "draft_unverified": 0.0}
        eng.update_weights([_learner(mtp_dir, 2)], 2)
        key = f"{MTP}eh_proj.weight"
        srv.draft.tensors[key].copy_(dict(_learner(mtp_dir, 1))[key])  # a draft left behind
        with pytest.raises(RolloutError, match=r"\(tensor\) did not reach the draft"):
            verify_sync(RecomputeLearner(served.model), eng, cfg, 2)
        eng.update_weights([_learner(mtp_dir, 3)], 3)
        srv.draft.tensors[key].copy_(dict(_learner(mtp_dir, 2))[key])
        with pytest.raises(RolloutError) as e:
            eng.sync(eng.acheck_draft(3))
        msg = str(e.value)
        assert msg.startswith("weight sync to version 3 (tensor) did not reach the draft: ")
        assert "draft.model.eh_proj.weight" in msg and "\n" not in msg
    finally:
        eng.shutdown()
        srv.stop_thread()


@pytest.mark.parametrize("order", ["delta loader first", "link first"])
def test_link_draft_hands_the_mtp_tensors_to_the_draft_in_either_order(order, tmp_path,
                                                                       monkeypatch):
    """`gspo_delta_loader.link_draft` called as SGLang 0.5.12's EAGLEWorker calls a custom
    loader (the draft model, then the target), before or after the delta loader's wrapper:
    a plain broadcast and a delta bucket reaching the target's load_weights (what 0.5.12's
    distributed path does) load the MTP layer's tensors into the draft, decoded."""
    import importlib

    from megatron_gspo.rollout.delta.sender import DeltaSender

    monkeypatch.syspath_prepend(delta_sync.loader_dir(str(tmp_path / "l")))
    loader = importlib.import_module("gspo_delta_loader")
    monkeypatch.setattr(loader, "_DRAFTS", [])

    class Model:
        def __init__(self, names):
            self.held = {n: None for n in names}
            self.config = type("C", (), {"num_hidden_layers": 4})()

        def load_weights(self, weights):
            for n, t in weights:
                if n in self.held:
                    self.held[n] = t.clone()

    class DeepseekV3ForCausalLMNextN(Model):
        pass

    mtp, main = f"{MTP}eh_proj.weight", "model.norm.weight"
    draft, target = DeepseekV3ForCausalLMNextN([mtp]), Model([main])
    calls = [loader.load, loader.link_draft] if order == "delta loader first" else [
        loader.link_draft, loader.load]
    for call in calls:  # EAGLEWorker.update_weights_from_tensor: draft runner, then target
        call(draft, [])
        call(target, [])
    w = {mtp: torch.ones(2, 4), main: torch.ones(4)}
    target.load_weights(list(w.items()))  # a full broadcast
    assert torch.equal(draft.held[mtp], w[mtp]) and draft.held.get(main) is None
    sender = DeltaSender("on")
    for v, new in ((1, w), (2, {mtp: w[mtp] + 1, main: w[main]})):
        assert sender.begin(v).delta == (v == 2)  # sync 1 in full, then a delta on its base
        bucket = sender.encode(list(new.items()))
        assert all(n.startswith("__gspo_delta__") for n, _ in bucket)
        target.load_weights(bucket)  # decoded by the wrapper, then the MTP tensor to the draft
        sender.commit()
        sender.finish(True)
        assert torch.equal(draft.held[mtp], new[mtp]) and torch.equal(target.held[main],
                                                                      new[main])
