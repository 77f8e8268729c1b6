"""One of two learner processes (gloo): colocated tensor sync where each server TP rank's
entry is serialized by the learner rank assigned to it and gathered to rank 0, which posts
them to a tp_size=2 stand-in server. Prints one JSON line for test_colocated_sync.py.

argv: rank, port, mode ("same" | "mismatch": rank 1 serializes other tensors)."""

import json
import sys
import tempfile

import torch
import torch.distributed as dist

TINY = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=256, eos_token_id=1, tie_word_embeddings=False)


def main(rank: int, port: int, mode: str) -> None:
    from megatron_gspo.megatron.io.weight_export import bucketize
    from megatron_gspo.rollout.engine import RolloutError
    from megatron_gspo.rollout.multinode.colocated import stream_buckets
    from megatron_gspo.rollout.embedded import EmbeddedEngine, build_hf_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(7)  # the new weights: identical on both ranks
    named = [(k, v.detach().clone()) for k, v in build_hf_model(TINY).state_dict().items()]
    if mode == "mismatch" and rank == 1:
        named = [(k, v + 1) for k, v in named]
    srv = eng = None
    if rank == 0:
        from megatron_gspo.rollout.sglang.client import SGLangEngine
        from megatron_gspo.rollout.standin.server import StandinServer

        torch.manual_seed(0)
        d = tempfile.mkdtemp()
        build_hf_model(TINY).save_pretrained(d)
        srv = StandinServer(EmbeddedEngine(d), tp_size=2).start_in_thread()
        eng = SGLangEngine(server_urls=[srv.url], tp_size=2, backoff_s=0.01)
    out: dict = {"rank": rank}
    try:
        stream_buckets(bucketize(iter(named), 4096), eng, 7, [[0, 1]], 1, 2)
        out["ok"] = True
    except RolloutError as e:
        out["error"] = str(e)
    if rank == 0:
        state = srv.engine.model.state_dict()
        out["version"] = srv.weight_version
        out["died"] = getattr(srv, "died", None)  # why the stand-in ended, as SGLang's would
        out["equal"] = all(torch.equal(state[k], v) for k, v in named)
        out["stats"] = eng.sync_stats
        eng.shutdown()
        srv.stop_thread()
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
