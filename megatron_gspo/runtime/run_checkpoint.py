"""Run checkpoints: model, optimizer and scheduler (Megatron dist checkpointing, any layout on
load) plus the loop's own state (step, data cursor, precision controller, RNG states).

Layout under the checkpoint root:

    step_00000012/            a complete checkpoint (has the COMPLETE marker)
        model/                torch_dist checkpoint written by the learner (collective)
        trainer.json          loop state from rank 0
        rng_rank{r}.pt        RNG states of each rank (tensors and plain types only)
        COMPLETE              written last: step, world size, size + sha256 of every file
    .tmp_step_00000014/       a save in progress (or killed): never taken for a checkpoint
    damaged_step_00000010/    a checkpoint that failed verification, kept for inspection
    incomplete_step_00000016/ renamed, but killed before its COMPLETE: moved aside at start-up

A save writes into the `.tmp_` folder, renames it, and only then writes COMPLETE, so a crash
at any point leaves nothing that looks complete. Loading verifies every file against COMPLETE:
`resume_point()` (resume: auto) moves a damaged newest checkpoint aside and falls back to the
previous one, with an event line; an explicitly named damaged checkpoint is a CheckpointError.
A checkpoint is never written while any parameter is NaN or infinite. An asynchronous save
(`queue`) starts only once the previous one is published, and its `checkpoint ...` event line
(`take_events`) is made only once its COMPLETE is durable.

Trust: our own files load with `torch.load(weights_only=True)` (no pickle). The `model/` folder
is PyTorch distributed checkpointing (Megatron's torch_dist format), whose `.metadata` file
is read with `pickle.load`: load run directories only from sources you trust. The checksums
detect damage, not tampering (whoever can edit the files can edit COMPLETE too).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.runtime import faults
from megatron_gspo.runtime.diskfull import disk_full
from megatron_gspo.runtime.durable import being_read, hold_for_reading  # noqa: F401 - API here
from megatron_gspo.runtime.durable import fsync_path, manifest, sha256_file
from megatron_gspo.runtime.rundir import RunError

__all__ = ["Checkpointer", "CheckpointError", "ResumePoint", "rng_state", "set_rng_state"]

_STEP_RE = re.compile(r"^step_(\d{8})$")
FORMAT = 2


class CheckpointError(RunError, ValueError):
    """A checkpoint that cannot be written or loaded safely (names the checkpoint and file)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(obj):
    """Rank 0's `obj` on every rank."""
    if _world() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def rng_state() -> dict:
    """Python, numpy and torch RNG states of this process (and CUDA's when present), as
    tensors and plain types (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                       float(gauss)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_marker(path: Path) -> dict:
    """The COMPLETE marker of checkpoint `path` (CheckpointError if unreadable)."""
    try:
        marker = json.loads((path / "COMPLETE").read_text())
        assert isinstance(marker, dict)
        return marker
    except (OSError, ValueError, AssertionError):
        raise CheckpointError(f"checkpoint {path}: COMPLETE marker missing or unreadable") \
            from None


def verify(path: str | os.PathLike) -> str | None:
    """Check every file of checkpoint `path` against its COMPLETE marker.

    Returns:
        None when intact, else what is wrong (one line naming the file).
    """
    path = Path(path)
    try:
        marker = read_marker(path)
    except CheckpointError as e:
        return str(e)
    files = marker.get("files")
    if not isinstance(files, dict):
        return f"checkpoint {path}: COMPLETE lists no files (written by an older version)"
    for name, (size, digest) in files.items():
        p = path / name
        if not p.is_file():
            return f"checkpoint {path}: {name} is missing"
        if p.stat().st_size != size:
            return f"checkpoint {path}: {name} has {p.stat().st_size} bytes, COMPLETE says {size}"
        if digest is not None and sha256_file(p) != digest:
            return f"checkpoint {path}: {name} does not match its sha256 in COMPLETE"
    return None


@dataclass
class ResumePoint:
    """Where `resume: auto` continues: the checkpoint, its step, and event lines to log."""

    step: int
    path: Path
    events: list[str] = field(default_factory=list)


def nonfinite_parameters(learner) -> list[str]:
    """Names of this rank's parameters (of `learner.chunks`) holding NaN or inf. Fast path:
    one norm per parameter (`_foreach_norm`), one host sync; only a non-finite norm (NaN, inf,
    or an overflow of finite weights) looks at each parameter."""
    params = [p.detach() for c in getattr(learner, "chunks", []) for p in c.parameters()]
    params = [p for p in params if p.numel()]
    try:
        if not params or bool(torch.isfinite(torch.stack(
                [n.float() for n in torch._foreach_norm(params)])).all()):
            return []
    except RuntimeError:  # parameters on several devices: the exact pass below
        pass
    bad = []
    for i, chunk in enumerate(getattr(learner, "chunks", [])):
        for name, p in chunk.named_parameters():
            if not torch.isfinite(p.detach()).all():
                bad.append(f"chunk{i}.{name}")
    return bad


def _count_all_ranks(n: int, learner) -> int:
    if _world() == 1:
        return n
    device = getattr(learner, "device", None) or torch.device("cpu")
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t.item())


class Checkpointer:
    """Saves, verifies and finds run checkpoints.

    Args:
        root: checkpoint directory (shared by all ranks).
        keep_last: complete checkpoints kept; older ones are deleted after a save.
        checksums: store and verify sha256 of every file (False: sizes only).
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, checksums: bool = True):
        self.root = Path(root)
        self.keep_last = max(1, int(keep_last))
        self.checksums = checksums
        self.events: list[str] = []  # lines for the run's event log (fallbacks, RNG notes)

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
        """The newest complete checkpoint (not verified), or None."""
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, learner, trainer_state: dict, queue=None) -> Path:
        """Write checkpoint `step` (collective over all ranks).

        Args:
            step: number of completed RL steps.
            learner: object with `save_checkpoint(path, schedule=None)` (collective), `chunks`.
            trainer_state: the loop's state, JSON-serialisable (rank 0's is written).
            queue: asynchronous save (`megatron/async_save.AsyncSaves`): the learner's files are
                written by forked writers and the rename + COMPLETE run once every rank's
                files are written and fsynced (`queue.schedule(request, finalize)`).
        Returns:
            the final checkpoint path; CheckpointError (nothing written) when a parameter is
            NaN or infinite on any rank.
        """
        began = time.time()
        if queue is not None:  # one save in flight: the previous one published before this
            queue.wait()  # one writes anything (a kill then leaves one complete checkpoint)
        bad = nonfinite_parameters(learner)
        if _count_all_ranks(len(bad), learner):
            raise CheckpointError(
                f"refusing to write checkpoint step {step}: non-finite parameters"
                + (f" (rank {_rank()}: {', '.join(bad[:3])})" if bad else "")
                + f"; the newest complete checkpoint is {self.latest()}")
        name = f"step_{step:08d}"
        tmp, final = self.root / f".tmp_{name}", self.root / name
        try:
            if _rank() == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            _barrier()
            if queue is None:
                learner.save_checkpoint(str(tmp / "model"))
            else:  # the model's state is staged now; trainer.json below goes with it. Once
                # every rank's writer ended: publish (hashes, rename, COMPLETE) in a thread
                publish = lambda: queue.in_background(  # noqa: E731
                    lambda: self._publish(step, tmp, final, began))
                queue.on_error = lambda e: self._not_written(e, step, tmp)  # writers, publish
                learner.save_checkpoint(str(tmp / "model"), save_kwargs=queue.save_kwargs(),
                                        stage=queue.stage,
                                        schedule=lambda req: queue.schedule(req, publish))
            rng = rng_state()
            if hasattr(learner, "rng_state"):  # the learner's own generators (model-parallel)
                rng["learner"] = learner.rng_state()
            with open(tmp / f"rng_rank{_rank()}.pt", "wb") as f:  # durable from every node
                torch.save(rng, f)
                f.flush()
                os.fsync(f.fileno())
            if _rank() == 0:
                (tmp / "trainer.json").write_text(json.dumps(trainer_state))
            _barrier()
        except BaseException as e:
            err = self._not_written(e, step, tmp)
            if err is e:
                raise
            raise err from None
        if queue is None:
            self._publish(step, tmp, final)
            _barrier()
        return final

    def _not_written(self, e: BaseException, step: int, tmp: Path) -> BaseException:
        """A full disk while writing `tmp` (also inside torch's CheckpointException, a
        BaseException, or a forked writer's failure): a one-line CheckpointError, the partial
        save removed; any other error: `e` itself."""
        msg = disk_full(e, tmp)
        if msg is None:
            return e
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = self.latest()
        return CheckpointError(f"checkpoint step {step} not written: {msg}; the newest "
                               f"complete checkpoint is {latest[1] if latest else 'none'}")

    def _publish(self, step: int, tmp: Path, final: Path, began: float | None = None) -> None:
        """Rank 0: the files of every rank are written: rename, COMPLETE, rotate. `began`
        (an asynchronous save): the event line `checkpoint ...` once COMPLETE is durable."""
        if _rank() == 0:
            faults.maybe_delay("delay_publish", step)
            marker = {"format": FORMAT, "step": step, "time": time.time(),
                      "world_size": _world(), "files": manifest(tmp, self.checksums)}
            faults.maybe_kill("kill_before_rename", step)
            if final.exists():
                self._discard(final)
            os.replace(tmp, final)
            fsync_path(self.root)
            faults.maybe_kill("kill_before_complete", step)
            part = final / "COMPLETE.tmp"
            part.write_text(json.dumps(marker))
            fsync_path(part)
            os.replace(part, final / "COMPLETE")
            fsync_path(final)
            if began is not None:
                self.events.append(f"checkpoint {final} (asynchronous; COMPLETE durable "
                                   f"{time.time() - began:.3f} s after the save began)")
            self.rotate()

    def take_events(self) -> list[str]:
        """The event lines noted since the last call (also by the publish thread), in order."""
        return [self.events.pop(0) for _ in range(len(self.events))]  # pop: thread-safe

    def rotate(self) -> None:
        """Delete complete checkpoints beyond `keep_last`, oldest first, except one being read
        (`hold_for_reading`, e.g. by the converter): it goes at a later rotation."""
        for _, old in self.complete()[: -self.keep_last]:
            if being_read(old):
                self.events.append(f"checkpoint {old} is being read (a conversion?); kept "
                                   "until a later save")
                continue
            self._discard(old)

    def _discard(self, path: Path) -> None:
        """Delete a checkpoint so that no half-deleted folder still looks complete."""
        gone = self.root / f".del_{path.name}"
        shutil.rmtree(gone, ignore_errors=True)
        os.replace(path, gone)
        shutil.rmtree(gone, ignore_errors=True)

    def resume_point(self) -> ResumePoint | None:
        """The newest intact complete checkpoint (collective; rank 0 verifies).

        A damaged one is moved aside to `damaged_<name>` (kept for inspection) with an event
        line, and the previous one is tried.
        Returns:
            a ResumePoint, or None when there is no complete checkpoint; CheckpointError when
            there are some but none is intact.
        """
        found, events, error = None, [], None
        if _rank() == 0:
            done = self.complete()
            for step, path in reversed(done):
                problem = verify(path)
                if problem is None:
                    found = (step, str(path))
                    break
                aside = self.root / f"damaged_{path.name}"
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(path, aside)
                events.append(f"{problem}; moved aside to {aside.name}, trying the previous "
                              "checkpoint")
            if done and found is None:
                error = (f"none of the {len(done)} checkpoints under {self.root} is intact "
                         f"({events[0]})")
        found, events, error = _from_rank0((found, events, error))
        if error:
            raise CheckpointError(error)
        self.events.extend(events)
        return None if found is None else ResumePoint(found[0], Path(found[1]), events)

    def load(self, path: str | os.PathLike, learner, *, verified: bool = False) -> dict:
        """Load model/optimizer/scheduler into `learner` and restore this rank's RNG
        (collective).

        Args:
            path: a checkpoint folder.
            learner: object with `load_checkpoint(path)` (and `load_rng_state` if it saves one).
            verified: skip the checksum pass (`resume_point` just did it).
        Trust: trainer.json and rng_rank*.pt load without pickle; the learner's `model/`
        folder (torch_dist) reads its `.metadata` with pickle.
        Returns:
            the loop state saved by rank 0; CheckpointError when the checkpoint is incomplete,
            damaged or lacks this rank's RNG file.
        """
        path = Path(path)
        if not (path / "COMPLETE").is_file():
            raise CheckpointError(f"checkpoint {path} is not complete (no COMPLETE marker)")
        problem = None if verified or _rank() != 0 else verify(path)
        problem = _from_rank0(problem)
        if problem:
            raise CheckpointError(problem)
        marker = read_marker(path)
        check = getattr(learner, "resume_check", None)
        if check is not None:  # what the checkpoint records against the config, before loading
            check(path)
        learner.load_checkpoint(str(path / "model"))
        rng = path / f"rng_rank{_rank()}.pt"
        saved_world = marker.get("world_size", _world())
        if saved_world == _world() and not rng.is_file():
            raise CheckpointError(f"checkpoint {path}: {rng.name} is missing (the RNG states of "
                                  f"rank {_rank()}); without it the run would not reproduce")
        if saved_world == _world():
            state = torch.load(rng, weights_only=True)
            set_rng_state(state)
            if "learner" in state and hasattr(learner, "load_rng_state"):
                learner.load_rng_state(state["learner"])
        else:  # per-rank streams do not map onto another world size
            self.events.append(f"checkpoint {path}: written by {saved_world} ranks, this run has "
                               f"{_world()}: RNG states not restored (samples will differ from "
                               "an uninterrupted run)")
        trainer = path / "trainer.json"
        if not trainer.is_file():
            raise CheckpointError(f"checkpoint {path}: trainer.json is missing")
        return json.loads(trainer.read_text())

    def clean_partial(self) -> None:
        """Remove leftovers of interrupted saves and deletions; a renamed folder whose
        COMPLETE marker was never written (its files are all there, killed before COMPLETE)
        is moved aside to `incomplete_<name>`, with an event line (rank 0; the run-dir lock
        makes this safe)."""
        if _rank() == 0 and self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                if p.name.startswith((".tmp_step_", ".del_step_")):
                    shutil.rmtree(p, ignore_errors=True)
                elif _STEP_RE.match(p.name) and not (p / "COMPLETE").is_file():
                    aside = self.root / f"incomplete_{p.name}"
                    shutil.rmtree(aside, ignore_errors=True)
                    os.replace(p, aside)
                    self.events.append(f"{p.name} under {self.root} has no COMPLETE marker (the "
                                       f"save was killed before it); moved aside to "
                                       f"{aside.name}, not resumed from")
