"""scripts/gpu_checks.sh and its helpers on a CPU machine: the stage list and its time budget,
the kit folder's check and cross-install, the summary writer, a failing stage reported as failed.
The whole dry run, in the GPU machine's package set, is in test_gpu_machine_kit.py."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"
STAGES = ["wheels", "selfcheck", "learner", "demo", "bench_learner", "memory", "colocated",
          "fp8", "speculative", "bench_logprobs"]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_kit  # noqa: E402

sys.path.pop(0)


def fake_wheel(folder: Path, name: str = "megatron_core", version: str = "0.16.1",
               pad: int = 0, requires_python: str | None = None) -> Path:
    """A minimal valid binary wheel for CPython 3.12 x86-64 (metadata only, plus `pad` bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-cp312-cp312-manylinux_2_28_x86_64.whl"
    info = f"{name}-{version}.dist-info"
    needs = f"Requires-Python: {requires_python}\n" if requires_python else ""
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{needs}",
        f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                          "Tag: cp312-cp312-manylinux_2_28_x86_64\n"),
        f"{name}_pad.bin": "x" * pad,
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def run_checks(*args: str, env: dict | None = None, timeout: float = 300):
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECKS_")}
    e.update({"PYTHON": sys.executable, **(env or {})})
    e.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=e, timeout=timeout, cwd=ROOT)


def test_stage_list_fits_the_gpu_budget():
    r = run_checks("--list")
    assert r.returncode == 0, r.stderr
    rows = [ln.split("\t") for ln in r.stdout.splitlines()]
    assert [n for n, _ in rows[:-1]] == STAGES
    limits = [int(v) for _, v in rows[:-1]]
    assert rows[-1] == ["total", str(sum(limits))]
    # One device command may run 600 s and the machine is lent for about ten minutes in all:
    # 30 s are left for start-up and the summary.
    assert sum(limits) <= 570 and all(v >= 30 for v in limits)
    [said] = re.findall(r"^# Seconds per stage\. Together (\d+) s", SCRIPT.read_text(), re.M)
    assert int(said) == sum(limits)  # the header says what the limits add to
    r = run_checks("--list", "--stages", "demo,wheels", env={"GPU_CHECKS_LIMIT_DEMO": "7"})
    assert r.stdout.splitlines() == ["wheels\t40", "demo\t7", "total\t47"]
    r = run_checks("--list", "--cpu-dry-run", "--stages", "demo")  # a CPU gets 3x as long
    assert r.stdout.splitlines() == ["demo\t240", "total\t240"]
    r = run_checks("--list", "--stages", "memory", env={"GPU_CHECKS_LIMIT_MEMORY": "9"})
    assert r.returncode == 0 and r.stdout.splitlines() == ["memory\t9", "total\t9"]


@pytest.mark.parametrize("args, env, message", [
    (["--stages", "nope"], {}, "unknown stage 'nope'"),
    (["--bogus"], {}, "unknown option"),
    (["--list"], {"GPU_CHECKS_LIMIT_DEMO": "0"}, "GPU_CHECKS_LIMIT_DEMO"),
])
def test_bad_arguments_are_one_line_errors(args, env, message):
    r = run_checks(*args, env=env)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1


def test_manifest_pins_the_newest_megatron_core():
    """The kit carries the newest supported megatron-core: the one the mcore_new tier tests on
    Python 3.12 (scripts/megatron_py312/lock.txt), as the GPU machine runs Python 3.12."""
    pins = gpu_kit.read_manifest()
    lock = (ROOT / "scripts" / "megatron_py312" / "lock.txt").read_text()
    [mcore] = re.findall(r"^megatron-core==(\S+)$", lock, re.MULTILINE)
    assert pins["megatron_core"] == mcore


def test_kit_check(tmp_path):
    pins = {"megatron_core": "0.16.1"}
    _, problems = gpu_kit.check_kit(tmp_path / "absent", pins)
    assert problems and "run scripts/gpu_wheels.sh" in problems[0]
    kit = tmp_path / "kit"
    fake_wheel(kit)
    wheels, problems = gpu_kit.check_kit(kit, pins)
    assert [w.name for w in wheels] == [
        "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl"]
    assert problems == []
    assert gpu_kit.check_kit(kit, {"megatron_core": "0.17.0"})[1] == [
        "megatron_core: wheel 0.16.1, pinned 0.17.0"]
    assert gpu_kit.check_kit(kit, {**pins, "pyyaml": "6.0"})[1] == [
        f"no wheel of pyyaml==6.0 in {kit}"]
    fake_wheel(kit, version="0.15.0")
    assert "2 wheels of megatron_core" in gpu_kit.check_kit(kit, pins)[1][0]
    (kit / "megatron_core-0.15.0-cp312-cp312-manylinux_2_28_x86_64.whl").unlink()
    fake_wheel(kit, name="stray")
    assert gpu_kit.check_kit(kit, pins)[1] == ["stray: wheel not in scripts/gpu_wheels.txt"]
    (kit / "stray-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl").unlink()
    (kit / "learner_ref").mkdir()
    (kit / "learner_ref" / "ref.pt").write_bytes(b"0" * 5000)
    [problem] = gpu_kit.check_kit(kit, pins, limit=4000)[1]
    assert "over the 0 MiB limit" in problem


def test_kit_installs_for_the_gpu_python(tmp_path):
    """Also from this interpreter when it is older than a wheel's Requires-Python (megatron-core
    0.17+ requires Python >=3.12)."""
    kit = tmp_path / "kit"
    for name, version in gpu_kit.read_manifest().items():
        fake_wheel(kit, name=name, version=version, requires_python=">=3.12")
    args = ["kit", "--kit", str(kit), "--target", str(tmp_path / "site"), "--cross",
            "--json", str(tmp_path / "kit.json")]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_kit.py"), *args],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    mcore = gpu_kit.read_manifest()["megatron_core"]
    assert (tmp_path / "site" / f"megatron_core-{mcore}.dist-info" / "METADATA").is_file()
    report = json.loads((tmp_path / "kit.json").read_text())
    assert report["problems"] == [] and report["modules"]["yaml"] != ""
    assert not report["reference"]


def write_work(work: Path) -> None:
    """A work directory as gpu_checks.sh leaves it: one passing, one timed-out and one failed
    stage, with the files the passing stages write."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "stages.tsv").write_text("wheels\t0\t3.2\t45\nbench_learner\t0\t40.0\t90\n"
                                     "bench_logprobs\t124\t75.1\t75\nlearner\t1\t12.0\t105\n"
                                     "memory\t1\t30.0\t60\n")
    (work / "kit.json").write_text(json.dumps({"wheels": ["megatron_core-0.16.1-x.whl"],
                                               "total_bytes": 3 * 2**20, "problems": []}))
    (work / "bench_learner.json").write_text(json.dumps({
        "device": "NVIDIA H200", "dtype": "bfloat16", "spec": "local", "samples": 32,
        "prompt": 256, "response": 768, "microbatches": 4, "matmul_tflops": 780.0,
        "rows": [{"model": "qwen3-0.6b", "params": 596049920, "tokens": 32768,
                  "tok_s": 50000.0, "step": 0.655, "mfu": 0.181, "peak_tflops": 989.0,
                  "peak_mem_gib": 30.5}]}))
    gib = 2**30
    (work / "memory.json").write_text(json.dumps({
        "model": "qwen3-0.6b", "resident_bytes": 9.5 * gib, "plan_bytes": 9.4 * gib,
        "train_peak_above_resident": 12.0 * gib, "plan_activation_logits": 14.0 * gib,
        "order_judged": True,
        "moments": [{"moment": "start-up", "event": "launch", "allocated": 0,
                     "reserved": 2.5 * gib, "free": 130 * gib, "expected": 0},
                    {"moment": "generation", "event": "release all", "allocated": 0,
                     "reserved": 0, "free": 130 * gib},
                    {"moment": "weight sync", "event": "resume weights", "allocated": 1.1 * gib,
                     "reserved": 1.2 * gib, "free": 131 * gib, "expected": 1 * gib}],
        "order_findings": ["start-up: servers launch while the learner holds 2.500 GiB"],
        "failures": ["start-up: servers launch while the learner holds 2.500 GiB"]}))
    (work / "learner.json").write_text(json.dumps({
        "stages": {"ref": {"status": "given"}, "gpu": {"status": "FAIL"}},
        "failures": ["dense.local.grad[x]: |diff|=1e-3 |ref|=1"]}))


def test_summary_reports_each_stage(tmp_path):
    work = tmp_path / "work"
    write_work(work)
    when = datetime.datetime(2026, 12, 1, 1, 2, tzinfo=datetime.timezone.utc)
    env = {"device": "1 x NVIDIA H200, 140 GiB, sm 9.0", "driver": "580.1", "python": "3.12.3",
           "torch": "2.11.0 (CUDA 13.0)", "megatron-core": "0.16.1"}
    text = gpu_kit.render_summary(work, "gpu", when=when, env=env, commit="abc123")
    lines = text.splitlines()
    assert lines[0] == "### 2026-12-01 01:02 UTC: GPU run"
    assert "- device: 1 x NVIDIA H200, 140 GiB, sm 9.0, driver 580.1" in lines
    assert "- versions: python 3.12.3, torch 2.11.0 (CUDA 13.0), megatron-core 0.16.1" in lines
    assert "- time: 160 s of the 375 s the stages were allowed" in lines
    rows = {ln.split(" | ")[0][2:]: ln.split(" | ") for ln in lines if ln.startswith("| ")}
    assert rows["wheels (offline install)"][1] == "ok"
    assert rows["bench/token_logprobs.py"][1] == "TIMEOUT (limit 75 s)"
    assert rows["scripts/gpu_learner_check.py"][1] == "FAILED (exit 1)"
    assert "1 failure(s), first: dense.local.grad" in rows["scripts/gpu_learner_check.py"][3]
    assert rows["scripts/gpu_memory_check.py"][1] == "FAILED (exit 1)"
    mem = rows["scripts/gpu_memory_check.py"][3]
    assert "resident 9.500 GiB (plan 9.400 GiB)" in mem
    assert "training peak 12.000 GiB (plan 14.000 GiB)" in mem
    assert "start-up launch 2.500 GiB (expected 0.00 MiB, driver free 130.000 GiB)" in mem
    assert "weight sync resume weights 1.200 GiB (expected 1.000 GiB" in mem
    assert "1 finding(s), first: start-up: servers launch" in mem
    bench = rows["bench/learner_step.py"][3]
    assert "596,049,920 params" in bench and "50,000 tok/s" in bench and "MFU 18.1%" in bench
    assert "989 TFLOP/s" in bench and "peak memory 30.5 GiB" in bench and "780 TFLOP/s" in bench
    assert lines[-1] == "Failed: bench_logprobs, learner, memory (logs in checks.log)."
    assert "CPU dry run" in gpu_kit.render_summary(work, "dry", env=env).splitlines()[0]


def test_insert_summary_newest_first():
    doc = (ROOT / "docs" / "gpu-results.md").read_text()
    assert "No GPU run has happened yet" in doc
    once = gpu_kit.insert_summary("### run 1\n", doc)
    twice = gpu_kit.insert_summary("### run 2\n", once)
    assert twice.index("### run 2") < twice.index("### run 1")
    assert twice.startswith(doc.split(gpu_kit.MARKER)[0])
    with pytest.raises(SystemExit, match="runs: newest first"):
        gpu_kit.insert_summary("x", "no marker here")


def test_failing_stages_are_reported_and_the_script_exits_0(tmp_path):
    """A missing kit fails the wheels stage; a stage past its limit is a TIMEOUT; the script
    goes on to the next stage, writes the summary and exits 0."""
    out = tmp_path / "out"
    r = run_checks("--cpu-dry-run", "--kit", str(tmp_path / "no_kit"), "--stages",
                   "wheels,bench_logprobs", str(out),
                   env={"GPU_CHECKS_LIMIT_BENCH_LOGPROBS": "1",
                        "GPU_CHECKS_WORK": str(tmp_path / "work")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[wheels] FAILED (exit 1)" in r.stdout
    assert "[bench_logprobs] TIMEOUT" in r.stdout
    summary = (out / "summary.md").read_text()
    assert "CPU dry run" in summary.splitlines()[0]
    assert "| wheels (offline install) | FAILED (exit 1) |" in summary
    assert "| bench/token_logprobs.py | TIMEOUT (limit 1 s) |" in summary
    assert "Failed: wheels, bench_logprobs" in summary
    assert "does not exist: run scripts/gpu_wheels.sh" in (out / "checks.log").read_text()
    results = json.loads((out / "results.json").read_text())
    assert [s["status"] for s in results["stages"]] == ["FAILED (exit 1)", "TIMEOUT (limit 1 s)"]


@pytest.mark.parametrize("script", ["gpu_checks.sh", "gpu_wheels.sh"])
def test_scripts_lint(script):
    import shutil

    path = ROOT / "scripts" / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck binary not installed (apt-get install -y shellcheck)")
    r = subprocess.run([exe, "-x", str(path)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def _learner_check():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_learner_check
    finally:
        sys.path.pop(0)
    return gpu_learner_check


def test_learner_check_workers_keep_the_callers_pythonpath(monkeypatch):
    """Packages installed with `pip --target` (the GPU kit) reach the worker processes."""
    glc = _learner_check()
    monkeypatch.setenv("PYTHONPATH", "/kit/site")
    env = glc.worker_env({"CUDA_VISIBLE_DEVICES": "0"})
    assert env == {"PYTHONPATH": f"{ROOT}{os.pathsep}/kit/site", "CUDA_VISIBLE_DEVICES": "0"}


def test_learner_check_without_cpu_layer_asks_for_a_reference(monkeypatch, tmp_path, capsys):
    glc = _learner_check()
    monkeypatch.setattr(glc, "cpu_layer_usable", lambda: False)
    out_json = tmp_path / "r.json"
    assert glc.main(["--reference-only", "--out", str(tmp_path), "--json", str(out_json)]) == 1
    assert "make it on a CPU machine with --reference-only" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["stages"]["ref"]["status"] == "FAIL"
    assert glc.main(["--reference-only", "--reference", str(tmp_path / "none.pt"),
                     "--out", str(tmp_path)]) == 1
    assert "no such file" in capsys.readouterr().out


def test_recorded_imports_leave_out_what_is_imported_only_when_present(tmp_path):
    """colorama came into the list through werkzeug's optional import in a venv that had it;
    a machine without it (the CI's) then failed the kit's import check."""
    (tmp_path / "colocated.txt").write_text("yaml colorama json megatron_gspo\n")
    got = gpu_kit.recorded_imports(tmp_path)
    assert "colorama" not in got["colocated"] and "json" not in got["colocated"]
    assert "yaml" in got["colocated"]
    listed = {m for mods in gpu_kit.read_stage_imports().values() for m in mods}
    assert not listed & gpu_kit.OPTIONAL_IMPORTS
