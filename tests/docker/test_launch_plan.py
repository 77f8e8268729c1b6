"""The launch scripts run what the memory plan checked: the config is the one source of truth
for the rollout layout, every launcher runs `megatron-gspo plan --brief` on its exact command
before torchrun, refuses a layout that does not fit in one line naming the changes checked
that fit, and prints the resolved layout and the verdict in its dry run."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from megatron_gspo.config import load_config
from test_launch_scripts import ROOT, argv_lines, run, split_torchrun

SHAPES = ROOT / "examples" / "qwen3_gpu" / "shapes"
# Every shipped GPU config: (nodes, GPUs per node, model shape) it is written for.
GPU_CONFIGS = {
    "examples/qwen3_gpu/qwen3_8b_1node.yaml": (1, 8, "Qwen3-8B"),
    "examples/qwen3_gpu/qwen3_30b_a3b_1node.yaml": (1, 8, "Qwen3-30B-A3B"),
    "examples/qwen3_gpu/qwen3_30b_a3b_2nodes.yaml": (2, 8, "Qwen3-30B-A3B"),
    "examples/qwen3_gpu/qwen3_5_35b_a3b_1node.yaml": (1, 8, "Qwen3.5-35B-A3B"),
    "examples/qwen3_gpu/qwen3_5_35b_a3b_2nodes.yaml": (2, 8, "Qwen3.5-35B-A3B"),
    "examples/multiturn_agent/config_gpu.yaml": (1, 2, "Qwen3-1.7B"),
}
GPU_MEMORY = "80GB"  # the shipped configs are written for 80 GB GPUs
ROLLOUT_URL = "http://roll-0:30000"


def test_the_table_lists_every_shipped_gpu_config():
    found = set()
    for p in sorted((ROOT / "examples").rglob("*.yaml")):
        raw = yaml.safe_load(p.read_text()) or {}
        if not isinstance(raw, dict) or "rollout" not in raw or "model" not in raw:
            continue
        cfg = load_config(p, [])
        if cfg.rollout.engine == "sglang" and cfg.rollout.sglang_device == "cuda":
            found.add(str(p.relative_to(ROOT)))
    assert found == set(GPU_CONFIGS)


def plan_lines(out: str) -> dict[str, str]:
    """The dry run's comment lines 'rollout: ...', 'learner: ...', 'plan: ...' by their head."""
    rows = [ln[2:] for ln in out.splitlines() if ln.startswith("# ") and ": " in ln]
    return {ln.split(": ", 1)[0]: ln.split(": ", 1)[1] for ln in rows
            if ln.split(": ", 1)[0] in ("rollout", "learner", "plan")}


def rollout_fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split())


def launches(config: str, nodes: int, gpus: int, shape: str) -> list[tuple[str, list, dict]]:
    """(label, script and arguments, environment) of every launcher's dry run of `config`."""
    base = {"GPUS_PER_NODE": str(gpus), "NNODES": str(nodes), "NODE_RANK": "0",
            "MASTER_ADDR": "node-0", "GPU_MEMORY": GPU_MEMORY,
            "MODEL_CONFIG": str(SHAPES / shape)}
    hosts = ",".join(f"gpu-{i}" for i in range(nodes + 1))
    slurm = {"SLURM_JOB_NODELIST": hosts, "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT),
             "DRY_RUN": "1", "GPUS_PER_NODE": str(gpus), "GPU_MEMORY": GPU_MEMORY,
             "MODEL_CONFIG": str(SHAPES / shape)}
    one_fewer = ",".join(f"gpu-{i}" for i in range(nodes))
    return [
        ("torchrun.sh", ["torchrun.sh", "--dry-run", config], base),
        ("colocated.sh", ["colocated.sh", "--dry-run", config], base),
        ("disaggregated.sh", ["disaggregated.sh", "--dry-run", "learner", config],
         {**base, "ROLLOUT_URLS": ROLLOUT_URL}),
        ("slurm colocated", ["slurm.sbatch", config], {**slurm, "SLURM_JOB_NODELIST": one_fewer}),
        ("slurm disaggregated", ["slurm.sbatch", config],
         {**slurm, "PLACEMENT": "disaggregated", "ROLLOUT_NODES": "1", "MODEL_DIR": "/m"}),
    ]


def _check_program(config: str, label: str, program: list[str], out: str) -> None:
    """The trainer's command resolves to the config's own rollout section (the disaggregated
    learner: its placement fields aside), and the dry run printed it and a plan that fits."""
    i = program.index("train")
    own = load_config(ROOT / config, []).rollout
    resolved = load_config(ROOT / program[i + 1], program[i + 2:]).rollout
    if "disaggregated" in label:
        assert (resolved.colocate, resolved.server_urls, resolved.weight_sync) == (
            False, [ROLLOUT_URL] if label == "disaggregated.sh" else resolved.server_urls,
            "distributed")
        for name in ("colocate", "server_urls", "weight_sync"):
            setattr(resolved, name, getattr(own, name))
    assert resolved == own, (label, program)
    lines = plan_lines(out)
    assert lines["plan"].startswith("fits: "), (label, lines)
    printed = rollout_fields(lines["rollout"])
    if "disaggregated" not in label:
        assert (printed["num_servers"], printed["tp_size"], printed["mem_fraction"]) == (
            str(own.num_servers), str(own.tp_size), str(own.mem_fraction)), (label, printed)


# The default tier runs the 30B-A3B two-node config (every launcher, multi-node resolution); the
# other shipped configs run in the slow tier (about 20 s each on 2 cores).
@pytest.mark.parametrize("config", [c if "30b_a3b_2nodes" in c
                                    else pytest.param(c, marks=pytest.mark.slow)
                                    for c in sorted(GPU_CONFIGS)])
def test_every_gpu_config_through_every_launcher_runs_its_own_layout(config, tmp_path):
    nodes, gpus, shape = GPU_CONFIGS[config]
    todo = launches(config, nodes, gpus, shape)
    scontrol = tmp_path / "scontrol"  # `scontrol show hostnames LIST`, as SLURM prints it
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\n'
                        'echo "$3" | tr , "\\n"\n')
    scontrol.chmod(0o755)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda t: run(*t[1], env=t[2], plan=True,
                                              path_prefix=str(tmp_path)), todo))
    table = []
    for (label, _, _), r in zip(todo, results, strict=True):
        assert r.returncode == 0, (label, r.stdout, r.stderr)
        if label.startswith("slurm"):  # each node's section: '# host: NODE_RANK=r', then lines
            chunks = r.stdout.split("\n# gpu-")[1:]
            learners = chunks if label == "slurm colocated" else chunks[1:]
            assert len(learners) == nodes, (label, r.stdout)
            for chunk in learners:
                argv = [a for a in argv_lines(chunk) if a[0] == "torchrun"][0]
                _check_program(config, label, split_torchrun(argv)[1], "\n" + chunk)
        else:
            [argv] = argv_lines(r.stdout)
            _check_program(config, label, split_torchrun(argv)[1], r.stdout)
        lines = plan_lines(r.stdout)
        table.append(f"{label:20s} {lines['rollout']} | {lines['plan']}")
    print("\n".join([config, *table]))


def test_a_layout_that_does_not_fit_is_refused_in_one_line(tmp_path):
    """The layout the scripts used to force on the 2-node 30B config (TP-1 servers, 8 per node,
    mem_fraction 0.5): refused before torchrun, in one line naming changes that fit; the dry
    run prints the verdict and exits 1; --skip-plan launches anyway."""
    config = "examples/qwen3_gpu/qwen3_30b_a3b_2nodes.yaml"
    env = {"GPUS_PER_NODE": "8", "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "node-0",
           "GPU_MEMORY": GPU_MEMORY, "MODEL_CONFIG": str(SHAPES / "Qwen3-30B-A3B"),
           "ROLLOUT_TP": "1", "ROLLOUT_MEM_FRACTION": "0.5",
           "TORCHRUN": str(tmp_path / "torchrun-must-not-run")}
    r = run("colocated.sh", config, env=env, plan=True)
    assert r.returncode == 2 and r.stdout == ""
    [line] = r.stderr.splitlines()
    assert line.startswith("torchrun.sh: plan: does not fit: checkpoint: 89.4 GiB > 74.5 GiB")
    assert "changes checked that fit: " in line and "rollout.tp_size=4 rollout.num_servers=2" \
        in line and line.endswith("(--skip-plan or SKIP_PLAN=1 launches anyway)")
    r = run("colocated.sh", "--dry-run", config, env=env, plan=True)
    assert r.returncode == 1
    assert plan_lines(r.stdout)["plan"].startswith("does not fit: checkpoint: 89.4 GiB")
    assert rollout_fields(plan_lines(r.stdout)["rollout"])["num_servers"] == "8"
    r = run("colocated.sh", "--dry-run", "--skip-plan", config, env=env, plan=True)
    assert r.returncode == 0 and plan_lines(r.stdout) == {}, r.stdout


def test_refusals_the_trainer_would_make_come_before_torchrun(tmp_path):
    """Servers needing more GPUs than a node has, loopback servers on several nodes, a config
    error: one line each, before torchrun starts."""
    config = "examples/qwen3_gpu/qwen3_8b_1node.yaml"
    env = {"GPUS_PER_NODE": "8", "GPU_MEMORY": GPU_MEMORY,
           "MODEL_CONFIG": str(SHAPES / "Qwen3-8B"), "TORCHRUN": str(tmp_path / "no")}
    r = run("colocated.sh", config, env={**env, "ROLLOUT_TP": "2", "ROLLOUT_NUM_SERVERS": "8"},
            plan=True)
    [line] = r.stderr.splitlines()
    assert r.returncode == 2 and "plan: refused: rollout.num_servers=8 x rollout.tp_size=2" \
        in line and "needs 16 GPUs on this node, which has 8" in line
    two = {**env, "NNODES": "2", "MASTER_ADDR": "node-0"}
    r = run("colocated.sh", config, env=two, plan=True)
    [line] = r.stderr.splitlines()
    assert r.returncode == 2 and "rollout.host=127.0.0.1: each of the 2 nodes" in line
    r = run("colocated.sh", "--dry-run", config, env={**two, "ROLLOUT_HOST": "internal"},
            plan=True)
    assert r.returncode == 0 and plan_lines(r.stdout)["plan"].startswith("fits"), r.stdout
    r = run("torchrun.sh", config, "rollout.tp_size=0", env=env, plan=True)
    [line] = r.stderr.splitlines()
    assert r.returncode == 2 and line.startswith("torchrun.sh: plan: megatron-gspo: config "
                                                 "error: rollout.tp_size"), line


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="nvidia-smi sizes the GPUs")
def test_without_a_gpu_size_the_layout_is_still_checked():
    """No GPU_MEMORY and no nvidia-smi: the dry run says the memory was not checked, still
    prints the resolved layout, and refuses what the layout check refuses."""
    config = "examples/qwen3_gpu/qwen3_8b_1node.yaml"
    env = {"GPUS_PER_NODE": "8", "MODEL_CONFIG": str(SHAPES / "Qwen3-8B")}
    r = run("torchrun.sh", "--dry-run", config, env=env, plan=True)
    assert r.returncode == 0, r.stderr
    lines = plan_lines(r.stdout)
    assert lines["plan"].startswith("memory not checked") and "num_servers=8" in lines["rollout"]
    r = run("torchrun.sh", "--dry-run", config, "rollout.num_servers=9", env=env, plan=True)
    assert r.returncode == 1 and plan_lines(r.stdout)["plan"].startswith("refused: ")
