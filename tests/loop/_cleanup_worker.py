"""A run that fails in its first training phase (own process: the learner starts
torch.distributed): prints whether the rollout engine was shut down, whether the process group
was released and whether the run-dir lock is gone, after `train.run` raised."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_gspo.loop import build, phases, train
from megatron_gspo.config import load_config


def main(run_dir: str, model: str) -> None:
    cfg = load_config("examples/tiny/config.yaml", [
        f"model.path={model}", "train.max_steps=2", "train.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=2", "logging.progress_bar=false",
        "logging.tensorboard=false", "train.eval_interval=0", "logging.log_samples=0"])
    shut = []
    make_engine = build.rollout_engine

    def engine_with_spy(*a, **k):
        engine = make_engine(*a, **k)
        stop = engine.shutdown
        engine.shutdown = lambda: (shut.append(True), stop())[1]
        return engine

    def failing_phase(*a, **k):
        raise RuntimeError("injected failure in the training phase")

    build.rollout_engine = engine_with_spy
    phases.train_on_batch = failing_phase
    error = ""
    try:
        train.run(cfg, run_dir)
    except RuntimeError as e:
        error = str(e)
    print("RESULT " + json.dumps({
        "error": error, "engine_shut_down": shut == [True],
        "process_group_released": not dist.is_initialized(),
        "lock_left": (Path(run_dir) / "run.lock").exists()}))
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
