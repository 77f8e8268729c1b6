"""Runs in its own process: the tiny demo trained through `train.run` with
`rollout.weight_precision=fp8`, the sync probe at every step.

    python _fp8_worker.py WORK MODE [OVERRIDES_JSON]

MODE embedded: the embedded engine (W8A16: it dequantizes what every sync sends).
MODE launched: the run launches a stand-in SGLang server (SGLANG_SERVER_MODULE set by the test),
which starts from the run's FP8 copy of model.path (RUN_DIR/fp8_model/node0).
MODE bf16_server: a stand-in server of the BF16 model attached by URL with FP8 rollouts: the
run must refuse it at start (its /server_info names a folder without FP8 weights).
Prints "RESULT {...}" (the metrics rows and the events, or the error line).
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ["train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "algorithm.mini_batches=1", "train.eval_interval=0", "checkpoint.interval=0",
        "rollout.verify_sync_interval=1", "rollout.weight_precision=fp8",
        "logging.tensorboard=false", "logging.progress_bar=false", "logging.log_samples=0",
        "train.max_steps=3"]
SGLANG = ["rollout.engine=sglang", "rollout.colocate=false", "rollout.weight_sync=tensor"]


def main(work: str, mode: str, overrides: list[str]) -> None:
    from megatron_gspo.config import load_config
    from megatron_gspo.loop import train

    config = ROOT / "examples" / "tiny" / "config.yaml"
    run = Path(work) / "run"
    srv = None
    if mode == "embedded":
        cfg = load_config(config, [*BASE, *overrides])
    elif mode == "launched":
        assert os.environ.get("SGLANG_SERVER_MODULE")
        cfg = load_config(config, [*BASE, *SGLANG, *overrides])
    else:
        from megatron_gspo.rollout.embedded import EmbeddedEngine
        from megatron_gspo.rollout.standin.server import StandinServer

        model = ROOT / "examples" / "tiny" / "base"
        srv = StandinServer(EmbeddedEngine(str(model), dtype="float32", seed=3),
                            model_path=str(model)).start_in_thread()
        cfg = load_config(config, [*BASE, *SGLANG, f"rollout.server_urls=[{srv.url}]",
                                   *overrides])
    try:
        train.run(cfg, str(run))
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    finally:
        if srv is not None:
            srv.stop_thread()
    metrics = run / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    events = (run / "events.log").read_text() if (run / "events.log").is_file() else ""
    served = sorted(p.name for p in (run / "fp8_model" / "node0").glob("*")) if (
        run / "fp8_model" / "node0").is_dir() else []
    print("RESULT " + json.dumps({"rows": rows, "events": events, "error": error,
                                  "served": served}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else [])
