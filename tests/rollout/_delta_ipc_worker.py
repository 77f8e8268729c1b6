"""One of two learner processes (gloo): a colocated delta sync (`rollout.weight_sync_delta`)
through `stream_buckets` with the plan [[0], [1]] (server i's only TP rank on the GPU of
learner rank i), into two tp_size=1 stand-in servers with the delta loader. The stand-ins
record where each received tensor's memory lives (`standin.weights.origins`): host shared
memory names the process that shared it, as a CUDA IPC handle names its GPU. Prints one JSON
line for test_delta_placement.py.

argv: rank, port, loader folder."""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

TINY = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=256, eos_token_id=1, tie_word_embeddings=False)


def main(rank: int, port: int, loader: str) -> None:
    from megatron_gspo.megatron.io.export import bucketize
    from megatron_gspo.rollout.embedded import EmbeddedEngine, build_hf_model
    from megatron_gspo.rollout.multinode.colocated import stream_buckets

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
        from megatron_gspo.rollout.sglang.delta_sync import LOADER
        from megatron_gspo.rollout.standin.server import StandinServer

        torch.manual_seed(0)
        d = tempfile.mkdtemp()
        build_hf_model(TINY).save_pretrained(d)
        srvs = [StandinServer(EmbeddedEngine(d), custom_weight_loaders=[LOADER]).start_in_thread()
                for _ in range(2)]
        eng = SGLangEngine(server_urls=[s.url for s in srvs], backoff_s=0.01)
        eng.delta = DeltaSender("on")
    out: dict = {"rank": rank, "pids": pids}
    stream_buckets(bucketize(iter(named), 4096), eng, 1, [[0], [1]], 2, 1)  # full: no base
    g = torch.Generator().manual_seed(3)
    named = [(k, v + (torch.rand(v.shape, generator=g) < 0.02) * 1e-3) for k, v in named]
    for s in srvs:
        s.received.clear()
    stream_buckets(bucketize(iter(named), 4096), eng, 2, [[0], [1]], 2, 1)  # the delta sync
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
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
