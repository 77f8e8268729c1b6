"""A/B studies: several arms of one base run config, each a list of `a.b=c` overrides, trained
one after the other with identical data order, seeds and sample budget, then summarised side by
side (`DIR/summary.json`) and plotted with the arms overlaid (`DIR/study.png`).

    megatron-gspo study examples/study/gspo_vs_grpo.yaml [--out DIR] [a.b=c ...]

Study file (strict: an unknown key is an error naming its path)::

    base: ../tiny/config.yaml          # run config, relative to the study file
    overrides: [train.max_steps=40]    # applied to every arm, before the arm's own
    arms:                              # arm name -> overrides; run in this order
      gspo: []
      grpo: [algorithm.loss=grpo]

Each arm trains in its own process into `DIR/<arm>` with `train.resume: auto`, so a killed study
resumes: finished arms (marked by `DIR/<arm>/study_arm.json`) are not rerun and a half-done arm
continues from its newest checkpoint. An arm's trainer dies with the study (kill -9 too), a
study holds the lock `DIR/run.lock` (two studies never write into one --out), and an arm
whose run ended with its last checkpoint is done even if the study died before saying so.
Settings that fix the data order, seeds and sample budget
(`LOCKED`) must be equal in every arm. Overrides on the command line apply to every arm after the
file's common ones (e.g. `train.max_steps=2` for a quick version of a study).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.config import Config, ConfigError, load_config
from megatron_gspo.config.schema import from_dict, option
from megatron_gspo.runtime.rundir import RunError
from megatron_gspo.config.yaml_strict import StrictYAMLError, strict_load

__all__ = ["StudySpec", "load_study", "arm_configs", "run_study", "LOCKED"]

# Settings that fix data order, seeds and sample budget: equal in every arm of a study.
LOCKED = ("train.seed", "train.max_steps", "train.prompts_per_step", "rollout.group_size",
          "rollout.max_new_tokens", "data.train_path", "data.eval_path", "data.shuffle",
          "train.eval_interval", "train.eval_prompts", "train.eval_temperature")
_ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Appended to every arm's overrides: resumable runs, no progress bar in the arm's log file.
FORCED = ("train.resume=auto", "logging.progress_bar=false")


@dataclass
class StudySpec:
    base: str | None = option(None, "run config every arm starts from (relative to the study "
                              "file)")
    overrides: list[str] = option([], "a.b=c overrides applied to every arm, before its own")
    arms: dict[str, list[str]] = option({}, "arm name -> its a.b=c overrides of the base "
                                        "config; arms run in this order")
    description: str = option("", "one line copied into summary.json")


def load_study(path: str | Path) -> tuple[StudySpec, Path]:
    """Read and check a study file.

    Returns:
        (spec, resolved base config path). Raises ConfigError naming the file and the key.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"study file not found: {p}")
    try:
        data = strict_load(p.read_text(encoding="utf-8")) or {}
    except (StrictYAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: {e}") from None
    except Exception as e:  # yaml.YAMLError and its kin: one line
        raise ConfigError(f"{p}: invalid YAML: {str(e).splitlines()[0]}") from None
    try:
        spec = from_dict(StudySpec, data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    if not spec.base:
        raise ConfigError(f"{p}: base: required (the run config the arms start from)")
    if not spec.arms:
        raise ConfigError(f"{p}: arms: at least one arm is required")
    for name in spec.arms:
        if not _ARM_NAME.match(str(name)):
            raise ConfigError(f"{p}: arms.{name}: an arm name is a directory name "
                              "(letters, digits, '_', '.', '-')")
    base = (p.parent / spec.base).resolve() if not Path(spec.base).is_absolute() \
        else Path(spec.base)
    if not base.is_file():
        raise ConfigError(f"{p}: base: {base} is not a file")
    return spec, base


def _get(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def arm_configs(spec: StudySpec, base: Path, study_path: str | Path = "study",
                extra: list[str] | tuple[str, ...] = ()) -> dict:
    """Every arm's validated Config (a bad override is an error naming the arm), checked to
    share the `LOCKED` settings.

    Returns:
        {arm name: (overrides list, Config)} in study order.
    """
    out = {}
    for name, arm in spec.arms.items():
        ovr = list(spec.overrides) + list(extra) + list(arm) + list(FORCED)
        try:
            out[name] = (ovr, load_config(base, ovr))
        except ConfigError as e:
            raise ConfigError(f"{study_path}: arms.{name}: {e}") from None
    first, (_, ref) = next(iter(out.items()))
    for name, (_, cfg) in out.items():
        for key in LOCKED:
            if _get(cfg, key) != _get(ref, key):
                raise ConfigError(
                    f"{study_path}: arms.{name}: {key}={_get(cfg, key)!r} differs from arm "
                    f"{first}'s {_get(ref, key)!r}; the arms of a study share data order, "
                    "seeds and sample budget")
    return out


def _arm_state(arm_dir: Path) -> dict:
    f = arm_dir / "study_arm.json"
    try:
        return json.loads(f.read_text()) if f.exists() else {}
    except json.JSONDecodeError:
        return {}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)


def _run_arm(base: Path, ovr: list[str], arm_dir: Path) -> int:
    """Train one arm in its own process (output in DIR/<arm>/train.log); returns its exit code.
    The kernel ends the arm's trainer when the study dies (kill -9 too), so a killed study
    leaves no arm training on its own."""
    from megatron_gspo.runtime.exec_with_parent import wrap

    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(base), "--run-dir",
           str(arm_dir), *ovr]
    with open(arm_dir / "train.log", "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(wrap(cmd), stdout=f, stderr=subprocess.STDOUT).returncode


def _finished(cfg: Config, arm_dir: Path) -> bool:
    """The arm's run holds a complete checkpoint of its last step (it finished, though the
    study that ran it died before marking it done)."""
    from megatron_gspo.runtime.run_checkpoint import Checkpointer

    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else arm_dir / "checkpoints"
    done = Checkpointer(root).complete() if root.is_dir() else []
    return bool(done) and done[-1][0] >= cfg.train.max_steps


def _check_not_running(name: str, arm_dir: Path) -> None:
    """An arm whose run dir is locked by a live trainer (started by an earlier study) is not
    started again beside it."""
    from megatron_gspo.runtime.rundir import RunDirLock

    try:
        RunDirLock(arm_dir).acquire().release()
    except RunError as e:
        raise RunError(f"arm {name}: {e}") from None


def run_study(path: str | Path, out: str | Path | None = None, log=None,
              overrides: list[str] | tuple[str, ...] = ()) -> Path:
    """Run (or resume) every arm of a study, then write DIR/summary.json and DIR/study.png.

    Args:
        path: the study YAML file.
        out: output directory (default runs/study-<file stem>).
        log: callable taking one line (default: print to stderr).
        overrides: a.b=c overrides for every arm (after the study's common ones).
    Returns:
        the output directory. Raises ConfigError for a bad study file, RunError naming the arms
        that failed (after every other arm ran and the summary was written).
    """
    log = log or (lambda line: print(f"study: {line}", file=sys.stderr, flush=True))
    spec, base = load_study(path)
    arms = arm_configs(spec, base, path, overrides)
    out = Path(out) if out else Path("runs") / f"study-{Path(path).stem}"
    out.mkdir(parents=True, exist_ok=True)
    from megatron_gspo.runtime.rundir import RunDirLock

    lock = RunDirLock(out).acquire()  # one study per --out (RunError naming the holder)
    try:
        return _run_arms(path, spec, base, arms, out, log)
    finally:
        lock.release()


def _run_arms(path, spec: StudySpec, base: Path, arms: dict, out: Path, log) -> Path:
    """The arms in order, then the summary (see `run_study`)."""
    from megatron_gspo.study.study_report import plot_study, summarize

    failed: list[str] = []
    for name, (ovr, cfg) in arms.items():
        arm_dir = out / name
        arm_dir.mkdir(exist_ok=True)
        state = _arm_state(arm_dir)
        if state and state.get("overrides") != ovr:
            raise ConfigError(f"{path}: arms.{name}: {arm_dir} holds a run with other overrides "
                              f"({state.get('overrides')}); use another --out")
        if state.get("status") == "done":
            log(f"arm {name}: finished earlier, not rerun")
            continue
        _check_not_running(name, arm_dir)
        if state.get("status") == "running" and _finished(cfg, arm_dir):
            state["status"] = "done"  # trained to the end; the study died before saying so
            _write_json(arm_dir / "study_arm.json", state)
            log(f"arm {name}: finished earlier (its last checkpoint is complete), not rerun")
            continue
        state = {"overrides": ovr, "status": "running", "attempts": state.get("attempts", [])}
        _write_json(arm_dir / "study_arm.json", state)
        log(f"arm {name}: training ({' '.join(ovr) or 'base config'}) -> {arm_dir}")
        t0 = time.perf_counter()
        rc = _run_arm(base, ovr, arm_dir)
        wall = time.perf_counter() - t0
        state["attempts"].append({"wall_s": round(wall, 3), "exit": rc})
        state["status"] = "done" if rc == 0 else "failed"
        _write_json(arm_dir / "study_arm.json", state)
        if rc != 0:
            failed.append(name)
            log(f"arm {name}: failed (exit {rc}); see {arm_dir / 'train.log'}")
        else:
            log(f"arm {name}: done in {wall:.1f} s")
    summary = summarize(out, list(arms), spec.description, {n: o for n, (o, _) in arms.items()})
    _write_json(out / "summary.json", summary)
    png = plot_study(out, list(arms))
    log(f"summary {out / 'summary.json'}; plots {png}")
    if failed:
        raise RunError(f"study {path}: arm(s) {', '.join(failed)} failed; see their train.log "
                       f"under {out}; rerun the same command to retry them")
    return out
