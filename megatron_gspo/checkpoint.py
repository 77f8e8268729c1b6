"""Run checkpoints: model, optimizer and scheduler (Megatron dist checkpointing, any layout on
load) plus the loop's own state (step, data cursor, precision controller, RNG states).

Layout under the checkpoint root:

    step_00000012/            a complete checkpoint (has the COMPLETE marker)
        model/                torch_dist checkpoint written by the learner (collective)
        trainer.pt            loop state from rank 0
        rng_rank{r}.pt        RNG states of each rank
        COMPLETE              written last, after every rank finished
    .tmp_step_00000014/       a save in progress (or killed): never taken for a checkpoint

A save writes into the `.tmp_` folder, renames it, and only then writes COMPLETE, so a crash
at any point leaves nothing that looks complete. `latest()` returns the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Checkpointer", "rng_state", "set_rng_state"]

_STEP_RE = re.compile(r"^step_(\d{8})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    """Python, numpy and torch RNG states of this process (and CUDA's when present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Saves and finds run checkpoints.

    Args:
        root: checkpoint directory (shared by all ranks).
        keep_last: complete checkpoints kept; older ones are deleted after a save.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = max(1, int(keep_last))

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first."""
        out = []
        if self.root.is_dir():
            for p in self.root.iterdir():
                m = _STEP_RE.match(p.name)
                if m and (p / "COMPLETE").is_file():
                    out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint, or None."""
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, learner, trainer_state: dict) -> Path:
        """Write checkpoint `step` (collective over all ranks).

        Args:
            step: number of completed RL steps.
            learner: object with `save_checkpoint(path)` (collective).
            trainer_state: the loop's state (rank 0's is written).
        Returns:
            the final checkpoint path.
        """
        name = f"step_{step:08d}"
        tmp, final = self.root / f".tmp_{name}", self.root / name
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        learner.save_checkpoint(str(tmp / "model"))
        rng = rng_state()
        if hasattr(learner, "rng_state"):  # the learner's own generators (model-parallel RNG)
            rng["learner"] = learner.rng_state()
        torch.save(rng, tmp / f"rng_rank{_rank()}.pt")
        if _rank() == 0:
            torch.save(trainer_state, tmp / "trainer.pt")
        _barrier()
        if _rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            marker = final / "COMPLETE.tmp"
            marker.write_text(json.dumps({"step": step, "time": time.time()}))
            with open(marker) as f:
                os.fsync(f.fileno())
            os.replace(marker, final / "COMPLETE")
            for _, old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def load(self, path: str | os.PathLike, learner) -> dict:
        """Load model/optimizer/scheduler into `learner` and restore this rank's RNG.

        Returns:
            the loop state saved by rank 0.
        """
        path = Path(path)
        if not (path / "COMPLETE").is_file():
            raise ValueError(f"checkpoint {path} is not complete (no COMPLETE marker)")
        learner.load_checkpoint(str(path / "model"))
        rng = path / f"rng_rank{_rank()}.pt"
        if rng.is_file():
            state = torch.load(rng, weights_only=False)
            set_rng_state(state)
            if "learner" in state:
                learner.load_rng_state(state["learner"])
        return torch.load(path / "trainer.pt", weights_only=False)

    def clean_partial(self) -> None:
        """Remove leftovers of interrupted saves (rank 0)."""
        if _rank() == 0 and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(".tmp_step_"):
                    shutil.rmtree(p, ignore_errors=True)
