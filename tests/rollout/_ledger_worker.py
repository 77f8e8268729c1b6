"""Runs in its own process: a short colocated GSPO run of the tiny model against a stand-in
SGLang server (no CPU weight backup: a release of the weights loses them), through
`train.run`, with the device-memory ledgers named in MEGATRON_GSPO_DEVICE_LEDGER (if any).

    python _ledger_worker.py WORK OVERRIDES_JSON

WORK/model is built once (reused by a resume); the run dir is WORK/run. Prints one JSON line
"RESULT {...}" for tests/rollout/test_device_ledger_run.py."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

BASE = ["rollout.engine=sglang", "rollout.colocate=true", "rollout.bucket_bytes=32768",
        "train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "algorithm.mini_batches=1", "train.eval_interval=0", "checkpoint.interval=1",
        "rollout.verify_sync_interval=1", "logging.tensorboard=false",
        "logging.progress_bar=false", "logging.log_samples=0"]


def main(work: str, overrides: list[str]) -> None:
    from _colocated_worker import tiny_model

    from megatron_gspo.config import load_config
    from megatron_gspo.loop import train
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.standin.server import StandinServer

    model = Path(work) / "model"
    if not (model / "config.json").exists():
        tiny_model(model)
    srv = StandinServer(EmbeddedEngine(str(model), dtype="float32", seed=3),
                        model_path=str(model)).start_in_thread()
    try:
        cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", [
            f"model.path={model}", f"rollout.server_urls=[{srv.url}]", *BASE, *overrides])
        run_dir = train.run(cfg, str(Path(work) / "run"))
        out = {"run_dir": str(run_dir), "memory_log": srv.memory_log,
               "lost_weights": sorted(srv.lost_weights), "weight_version": srv.weight_version}
    finally:
        srv.stop_thread()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
