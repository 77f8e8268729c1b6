"""A torchrun worker (`python -m torch.distributed.run --nproc-per-node 1 THIS MODEL OUT [URL]`):
with torchrun's environment (TORCHELASTIC_USE_AGENT_STORE=True among it),
1. URL given: the distributed (gloo broadcast) weight sync into that already running stand-in
   server, then its answers change;
2. a stand-in server launched from this worker becomes healthy, generates, and takes a
   distributed weight update.
Writes OUT/result.json step by step ({"env": ..., "attached": ..., "launched": ...})."""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams  # noqa: E402
from megatron_gspo.rollout.sglang.client import SGLangEngine  # noqa: E402
from megatron_gspo.rollout.sglang.launch import LaunchSpec  # noqa: E402

STANDIN = "megatron_gspo.rollout.standin.server"
GREEDY = [GenerateRequest([4, 5, 6], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                    ignore_eos=True))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def push_distributed(eng: SGLangEngine, model: str, version: int) -> dict:
    from safetensors.torch import load_file

    weights = load_file(f"{model}/model.safetensors")
    base = eng.generate(GREEDY)[0].response_ids
    eng.weight_sync, eng.dist_backend = "distributed", "gloo"
    eng.dist_master = ("127.0.0.1", free_port())
    eng.update_weights([[(k, v + 0.3) for k, v in weights.items()]], version=version)
    after = eng.generate(GREEDY)[0]
    eng.update_weights([list(weights.items())], version=version + 1)  # back to the original
    eng.close_update_group()  # the next engine forms one of the same name
    return {"changed": after.response_ids != base, "version": after.weight_version}


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    url = sys.argv[3] if len(sys.argv) > 3 else None
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_DEADLINE_S", "150")),
                                      exit=True)
    torch.multiprocessing.set_sharing_strategy("file_system")
    res: dict = {"env": {k: os.environ.get(k) for k in (
        "TORCHELASTIC_USE_AGENT_STORE", "RANK", "MASTER_PORT", "LOCAL_RANK")}}

    def save():
        (out / "result.json").write_text(json.dumps(res))

    save()
    if url:
        eng = SGLangEngine(server_urls=[url], startup_timeout_s=60)
        try:
            res["attached"] = push_distributed(eng, model, version=1)
        finally:
            eng.shutdown()
        save()
    spec = LaunchSpec(model_path=model, module=STANDIN, base_port=0, python=sys.executable,
                      log_dir=str(out), dtype="float32")
    eng = SGLangEngine(launch=spec, startup_timeout_s=90)
    try:
        res["launched"] = {"healthy": bool(eng.generate(GREEDY))}
        save()
        res["launched"].update(push_distributed(eng, model, version=3))
    finally:
        eng.shutdown()
    save()
    os._exit(0)


if __name__ == "__main__":
    main()
