"""Runs in its own process: the tiny demo trained through `train.run` against a stand-in SGLang
server in a thread (launched with the delta loader: `--custom-weight-loader`), with
`rollout.weight_sync_delta` and the sync probe at every step.

    python _delta_worker.py WORK OVERRIDES_JSON [TAMPER_VERSION] [RESUME_STEPS]

TAMPER_VERSION: once the server loaded version TAMPER_VERSION - 1, the loader's base copy of
model.norm.weight gets 1 added (a base the learner does not know), so the delta sync of
TAMPER_VERSION serves wrong weights and its probe fails. RESUME_STEPS: a
second `train.run` resumes the run dir to that many steps against the same server. Prints
"RESULT {...}" (the metrics rows, the server's weight version, per run).

With SGLANG_SERVER_MODULE set (the stand-in's module) the run launches its own servers
(`rollout.num_servers`, no server_urls; no tamper, no resume); the server's weight version is
then None."""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BASE = ["rollout.engine=sglang", "rollout.colocate=false", "rollout.weight_sync=tensor",
        "train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "algorithm.mini_batches=1", "train.eval_interval=0", "checkpoint.interval=1",
        "rollout.verify_sync_interval=1", "logging.tensorboard=false",
        "logging.progress_bar=false", "logging.log_samples=0", "train.max_steps=3"]


def main(work: str, overrides: list[str], tamper: int | None, resume: int | None) -> None:
    import torch

    from megatron_gspo.config import load_config
    from megatron_gspo.loop import train
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.sglang.weight_sync_delta import LOADER, loader_dir
    from megatron_gspo.rollout.standin.server import StandinServer

    if os.environ.get("SGLANG_SERVER_MODULE"):  # launched by the run (servers.sglang_engine)
        cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", [*BASE, *overrides])
        rows = _rows(train.run(cfg, str(Path(work) / "run")))
        print("RESULT " + json.dumps({"runs": [rows], "weight_version": None, "died": None}))
        return
    sys.path.insert(0, loader_dir(str(Path(work) / "loader")))
    model = ROOT / "examples" / "tiny" / "base"
    srv = StandinServer(EmbeddedEngine(str(model), dtype="float32", seed=3),
                        model_path=str(model), custom_weight_loaders=[LOADER]).start_in_thread()
    if tamper is not None:  # after the sync of version tamper - 1: its base, not its weights
        count = srv._count_update

        def note(version):
            count(version)
            if version == str(tamper - 1):
                state = srv.served_model._gspo_delta_state
                with torch.no_grad():
                    state.base["model.norm.weight"].add_(1.0)

        srv._count_update = note
    runs = []
    try:
        cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", [
            f"rollout.server_urls=[{srv.url}]", *BASE, *overrides])
        run_dir = train.run(cfg, str(Path(work) / "run"))
        runs.append(_rows(run_dir))
        if resume:
            cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", [
                f"rollout.server_urls=[{srv.url}]", *BASE, *overrides,
                f"train.max_steps={resume}", "train.resume=auto"])
            runs.append(_rows(train.run(cfg, str(run_dir))))
        out = {"runs": runs, "weight_version": srv.weight_version,
               "died": getattr(srv, "died", None)}
    finally:
        srv.stop_thread()
    print("RESULT " + json.dumps(out))


def _rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]),
         int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None,
         int(sys.argv[4]) if len(sys.argv) > 4 else None)
