"""One rank of a 2-node colocated run under torchrun (tests/rollout/test_multinode.py): a short
GSPO run through `train.run` whose node leaders launch stand-in SGLang servers
(SGLANG_SERVER_MODULE). After every weight sync each node leader records its servers' weight
digests, weight versions and counters next to the learner's digest of the same export; with
CRASH_FIRST_SERVER=1 the node-1 leader arms the `crash` fault of its server 0, which then exits
on its first /generate (mid-rollout: the sync probe, on by default, is then off, else its
/generate would be the first; a probe that loses a server is test_sync_probe_default.py's).
Writes OUT_DIR/rank<R>.json.

Args: MODEL_DIR RUN_DIR OUT_DIR BASE_PORT [override ...]
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(model: str, run_dir: str, out_dir: str, base_port: int, extra: list[str]) -> None:
    import torch.distributed as dist

    from megatron_gspo.loop import build, phases, train
    from megatron_gspo.loop import weight_sync_phase as sync_phase
    from megatron_gspo.config import load_config
    from megatron_gspo.megatron.io.weight_export import export_hf_weights
    from megatron_gspo.rollout.multinode.node_servers import gather_layout, node_engine
    from megatron_gspo.rollout.standin.server import weights_digest

    records: list[dict] = []
    engines: list = []  # stopped here when the run fails (train.run stops them on success)
    info: dict = {}
    make_engine, sync = build.rollout_engine, sync_phase.sync_weights

    def rollout_engine(cfg, hf, tok):
        eng = make_engine(cfg, hf, tok)
        own = node_engine(eng)
        info["type"] = type(eng).__name__
        engines.append(eng)
        if own is not None:
            node = getattr(own, "node", 0)  # a single SGLangEngine serves node 0 only
            info.update(node=node, urls=list(own.urls))
            if node == 1 and os.environ.get("CRASH_FIRST_SERVER") == "1":
                own.sync(own._post(own.urls[0], "/standin/faults", {"crash": True}))
        return eng

    def sync_weights(learner, engine, hf_config, cfg, version, event=None):
        m = sync(learner, engine, hf_config, cfg, version, event)
        away = learner.offloaded_parts()  # rollout.offload_learner: weights read, then away
        learner.onload(away)
        named = [kv for b in export_hf_weights(learner.chunks, hf_config, bucket_bytes=1 << 30,
                                               dtype=build.DTYPES[cfg.model.dtype]) for kv in b]
        # clones: numpy views would pin the learner's storages (torch stops resizing them)
        learner_digest = weights_digest([(k, v.clone()) for k, v in named])  # collective export
        del named
        learner.offload(away)
        own = node_engine(engine)
        if own is not None:
            for u in own.urls:
                got = own.sync(own._post(u, "/standin/weights_digest", get=True))
                records.append({"version": version, "url": u, "learner": learner_digest,
                                **got})
        if engine is not None and hasattr(engine, "client"):
            info.setdefault("client_urls", []).append(list(engine.client.urls))
        dist.barrier()  # rank 0 generates again only once every server has been read
        return m

    rollout = phases.rollout

    def rollout_servers(*args, **kw):  # rank 0: which server produced each sample
        samples, m = rollout(*args, **kw)
        info.setdefault("sample_servers", []).append(
            [s.metadata.get("server") for s in samples])
        return samples, m

    build.rollout_engine, sync_phase.sync_weights = rollout_engine, sync_weights
    phases.rollout = rollout_servers
    cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", [
        f"model.path={model}", "rollout.engine=sglang", "rollout.colocate=true",
        "rollout.num_servers=2", f"rollout.base_port={base_port}", "rollout.bucket_bytes=24576",
        "rollout.startup_timeout=240", "rollout.backoff=0.05", "parallel.tensor=2",
        "train.max_steps=3", "train.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "algorithm.mini_batches=1", "train.eval_interval=0",
        "checkpoint.interval=0", "logging.tensorboard=false", "logging.progress_bar=false",
        "logging.log_samples=0", *extra,
        *(["rollout.verify_sync_interval=0"] if os.environ.get("CRASH_FIRST_SERVER") else [])])
    error = None
    try:
        train.run(cfg, run_dir)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        for eng in engines:
            if eng is not None:
                eng.shutdown()
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    layout = gather_layout() if error is None else None
    out = {"rank": rank, "error": error, "records": records, **info,
           "node_of": list(layout.node_of) if layout else None}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    if error is not None:
        print(f"ERROR {error}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
