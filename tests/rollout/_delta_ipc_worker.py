"""One of two learner processes (gloo): a colocated delta sync (`rollout.weight_sync_delta`)
into two tp_size=1 stand-in servers with the delta loader, server i's only TP rank on the GPU
of learner rank i. The stand-ins record where each received tensor's memory lives
(`standin.weight_sync_server.origins`): host shared memory names the process that shared it, as a
CUDA
IPC handle names its GPU. Prints one JSON line for test_delta_placement.py.

Modes: "stream" calls `stream_buckets` with the plan [[0], [1]]; "loop" calls the weight-sync
phase of the RL loop (`loop.weight_sync_phase.sync_weights`, the learner's export replaced by the
same
buckets), where learner rank i reports GPU i (`colocated.local_gpu`, as
`torch.cuda.current_device()` does on a node of GPUs) and the plan comes from
`colocated.entry_ranks`.

argv: rank, port, loader folder, mode."""

import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=256, eos_token_id=1, tie_word_embeddings=False)
LOOP = ["rollout.engine=sglang", "rollout.colocate=true", "rollout.num_servers=2",
        "rollout.tp_size=1", "rollout.weight_sync=tensor", "rollout.weight_sync_delta=on",
        "rollout.offload_learner=false", "rollout.verify_sync_interval=0"]


def syncer(mode: str, rank: int, eng):
    """(named tensors, version) -> None: one sync by `mode`, collective."""
    from megatron_gspo.megatron.io import weight_export as export
    from megatron_gspo.megatron.io.weight_export import bucketize
    from megatron_gspo.rollout.multinode import colocated

    if mode == "stream":
        return lambda named, v: colocated.stream_buckets(
            bucketize(iter(named), 4096), eng, v, [[0], [1]], 2, 1)
    from megatron_gspo.config import load_config
    from megatron_gspo.loop.weight_sync_phase import sync_weights

    cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", LOOP)
    colocated.local_gpu = lambda: rank  # learner rank i on GPU i, as on a node of GPUs
    learner = SimpleNamespace(chunks=None, lora=None, offloaded_parts=lambda: [])
    hf = {**TINY, "architectures": ["Qwen3ForCausalLM"]}

    def sync(named, v):
        export.export_hf_weights = lambda *a, **k: bucketize(iter(named), 4096)
        sync_weights(learner, eng, hf, cfg, v)
    return sync


def main(rank: int, port: int, loader: str, mode: str) -> None:
    from megatron_gspo.rollout.embedded import EmbeddedEngine, build_hf_model

    sys.path.insert(0, loader)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    torch.manual_seed(7)  # the learner's weights: identical on both ranks
    named = [(k, v.detach().clone()) for k, v in build_hf_model(TINY).state_dict().items()]
    srvs, eng = [], None
    if rank == 0:
        from megatron_gspo.rollout.delta.sender import DeltaSender
        from megatron_gspo.rollout.sglang.client import SGLangEngine
        from megatron_gspo.rollout.sglang.weight_sync_delta import LOADER
        from megatron_gspo.rollout.standin.server import StandinServer

        torch.manual_seed(0)
        d = tempfile.mkdtemp()
        build_hf_model(TINY).save_pretrained(d)
        srvs = [StandinServer(EmbeddedEngine(d), custom_weight_loaders=[LOADER]).start_in_thread()
                for _ in range(2)]
        eng = SGLangEngine(server_urls=[s.url for s in srvs], backoff_s=0.01)
        if mode == "stream":  # the loop makes its own (loop.weight_sync_phase.delta_sender)
            eng.delta = DeltaSender("on")
    out: dict = {"rank": rank, "pids": pids}
    sync = syncer(mode, rank, eng)
    sync(named, 1)  # full: no base
    g = torch.Generator().manual_seed(3)
    named = [(k, v + (torch.rand(v.shape, generator=g) < 0.02) * 1e-3) for k, v in named]
    for s in srvs:
        s.received.clear()
    sync(named, 2)  # the delta sync
    if rank == 0:
        out["delta"] = eng.delta.stats.delta
        out["received"] = [list(s.received) for s in srvs]
        out["equal"] = [all(torch.equal(s.engine.model.state_dict()[k], v) for k, v in named)
                        for s in srvs]
        out["versions"] = [s.weight_version for s in srvs]
        eng.shutdown()
        for s in srvs:
            s.stop_thread()
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
