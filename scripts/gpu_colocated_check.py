"""GPU check of the colocated weight sync through CUDA IPC, against a REAL SGLang server on the
learner's GPU, then the sync probe, with the loop's own functions in loop/train.py's order:

1. a small random Qwen3 (scripts/gpu_sglang_check.py's shape: 2 layers, hidden 256, head dim
   64, vocabulary 2048; bf16 on a GPU) saved as a Hugging Face folder with the tiny demo's
   tokenizer; the learner built and loaded from it (`loop.build`), offloaded with its cache
   returned (`rollout.offload_learner`, on for colocated servers as in the shipped configs);
2. one colocated SGLang server launched on the same GPU (`loop.build.rollout_engine`:
   `sglang.launch_server --enable-memory-saver`), its KV cache and CUDA graphs released at once
   as the loop does;
3. sync v0 (`loop.weight_sync_phase.sync_weights` ->
   `rollout.multinode.colocated.colocated_sync`): the
   learner's CUDA weights exported in buckets, flattened, pickled with SGLang's
   `monkey_patch_torch_reductions` (`rollout.weight_sync`) and posted with
   `update_weights_from_tensor`, the server opening CUDA IPC handles into the learner's
   memory; then the sync probe (`loop.weight_sync_phase.verify_sync`: the server answers the probe
   prompt,
   the learner recomputes the log-probs): a match is every token within `PROBE_TOLERANCE` of
   the served dtype;
4. control: the learner's weights changed (noise) and NOT synced: the probe must report a
   mismatch (a probe that cannot fail proves nothing);
5. sync v1 of the changed weights (a warm sync) and its probe: a match again.
Prints one line per step, writes --json (`summary_line` makes scripts/gpu_checks.sh's row);
exit 1 when a step does not behave. Without CUDA the same steps run against the CPU stand-in
server (`megatron_gspo.rollout.standin.server`: CPU tensors in shared memory, not CUDA IPC):
the CPU dry run. A GPU without sglang importable (the GPU check machine's image: SGLang and
its kernels are far beyond what the kit may carry) is reported as skipped, exit 0.

    python scripts/gpu_colocated_check.py [--json OUT.json] [--workdir DIR] [--server-module M]

Module level imports the standard library only (gpu_kit.py loads `summary_line`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDIN = "megatron_gspo.rollout.standin.server"
SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=2048, eos_token_id=2, pad_token_id=3,
             tie_word_embeddings=False)
# a short CUDA-graph capture and no warm-up request: the stage has 60 s on the GPU
GPU_SERVER_ARGS = ["--cuda-graph-max-bs=4", "--skip-server-warmup"]


def write_model(folder: Path, dtype: str) -> Path:
    """A random Qwen3 of SHAPE in `dtype`, with the tiny demo's tokenizer (ids < 128)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**SHAPE)).to(getattr(torch, dtype)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(ROOT / "examples" / "tiny" / "base").save_pretrained(folder)
    return folder


def config(model: Path, dtype: str, cuda: bool, logs: Path):
    from megatron_gspo.config import load_config

    extra = ",".join(GPU_SERVER_ARGS) if cuda else ""
    return load_config(ROOT / "examples" / "tiny" / "config.yaml", [
        f"model.path={model}", f"model.dtype={dtype}", "rollout.engine=sglang",
        "rollout.colocate=true", "rollout.weight_sync=tensor", "rollout.num_servers=1",
        "rollout.tp_size=1", f"rollout.mem_fraction={0.1 if cuda else 0.7}",
        "rollout.bucket_bytes=1048576", "rollout.verify_sync_interval=0",
        "rollout.startup_timeout=240", f"rollout.server_log_dir={logs}",
        f"rollout.extra_server_args=[{extra}]"])


def run(workdir: Path, module: str, cuda: bool) -> dict:
    """Steps 1-5; the report (the --json content)."""
    from megatron_gspo.loop import build, weight_sync_phase as sync
    from megatron_gspo.rollout.engine import RolloutError
    from megatron_gspo.rollout.multinode import colocated
    from megatron_gspo.rollout.sglang.weight_sync_endpoints import PROBE_TOLERANCE

    os.environ["SGLANG_SERVER_MODULE"] = module
    dtype = "bfloat16" if cuda else "float32"
    cfg = config(write_model(workdir / "model", dtype), dtype, cuda, workdir / "logs")
    res = {"status": "ran", "server": module, "dtype": dtype, "tolerance": PROBE_TOLERANCE[dtype],
           "path": "CUDA IPC" if cuda else "CPU shared memory", "steps": [], "failures": []}
    hf = build.read_hf_config(cfg.model.path)
    learner = build.learner(cfg, hf)
    engine = None

    def sync_to(version: int) -> None:
        t = time.perf_counter()
        m = sync.sync_weights(learner, engine, hf, cfg, version=version)
        step = {"step": f"sync v{version}", "seconds": time.perf_counter() - t,
                "buckets": m.get("weight_sync/buckets"), "bytes": m.get("weight_sync/bytes")}
        res["steps"].append(step)
        print(f"{step['step']}: {step['seconds']:.2f} s, {step['buckets']} buckets, "
              f"{step['bytes']} bytes", flush=True)

    def probe(version: int, expect: str) -> None:
        t = time.perf_counter()
        try:
            diff, got = sync.verify_sync(learner, engine, cfg, version), "match"
        except RolloutError as e:
            found = re.search(r"log-probs (\S+) away", str(e))
            diff, got = (float(found.group(1)) if found else None), "mismatch"
        step = {"step": f"probe v{version}", "seconds": time.perf_counter() - t, "max_diff": diff,
                "result": got, "expected": expect}
        res["steps"].append(step)
        print(f"{step['step']}: {got} (expected {expect}), max |d| {diff}, "
              f"{step['seconds']:.2f} s", flush=True)
        if got != expect:
            res["failures"].append(f"probe v{version}: {got}, expected {expect}")

    try:
        build.load_initial_weights(cfg, learner, hf)
        if sync.offloading(cfg):  # loop/train.py: SGLang sizes its KV cache from free memory
            learner.offload()
            colocated.free_learner_cache()
        t = time.perf_counter()
        engine = build.rollout_engine(cfg, hf, build.tokenizer(cfg))
        engine.sync(engine.astart())  # launched and healthy (the loop's first call does it)
        res["launch_seconds"] = time.perf_counter() - t
        print(f"server launched in {res['launch_seconds']:.1f} s: {engine.urls}", flush=True)
        engine.release_memory(colocated.RESUME_AFTER)
        sync_to(0)
        probe(0, "match")
        import torch

        with colocated.learner_room(learner, engine, colocated.PROBE_PARTS, "control"), \
                torch.no_grad():  # the learner's weights change; the server's do not
            for p in (p for m in learner.chunks for p in m.parameters()):
                p.add_(0.05 * torch.randn_like(p))
        probe(1, "mismatch")
        sync_to(1)
        probe(1, "match")
    except Exception as e:  # noqa: BLE001 - the report is written regardless
        traceback.print_exc()
        res["failures"].append(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    finally:
        if engine is not None:
            engine.shutdown()
        learner.shutdown()
    return res


def summary_line(res: dict) -> str:
    """The colocated stage's cell of scripts/gpu_checks.sh's summary (from the --json report)."""
    if res.get("status") == "skipped":
        return f"skipped: {res['reason']}"
    parts = [f"{res['path']} to {res['server']} ({res['dtype']}, probe tolerance "
             f"{res['tolerance']:g})"]
    if res.get("launch_seconds") is not None:
        parts.append(f"launch {res['launch_seconds']:.1f} s")
    for s in res.get("steps", []):
        if s["step"].startswith("sync"):
            mib = f", {s['bytes'] / 2**20:.1f} MiB" if s.get("bytes") else ""
            parts.append(f"{s['step']} {s['seconds']:.2f} s ({s['buckets']:.0f} buckets{mib})"
                         if s.get("buckets") is not None else f"{s['step']} {s['seconds']:.2f} s")
        else:
            d = "n/a" if s["max_diff"] is None else f"{s['max_diff']:.3g}"
            parts.append(f"{s['step']} {s['result']} (expected {s['expected']}) max diff {d} "
                         f"in {s['seconds']:.2f} s")
    if res.get("failures"):
        parts.append(f"{len(res['failures'])} failure(s), first: {res['failures'][0]}")
    return "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--server-module", default=None,
                    help="sglang.launch_server on a GPU, the stand-in without CUDA")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from megatron_gspo.megatron.parallel import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    import torch

    from megatron_gspo.rollout.weight_sync_payloads import sglang_importable

    cuda = torch.cuda.is_available()
    module = args.server_module or ("sglang.launch_server" if cuda else STANDIN)
    if cuda and not sglang_importable():
        res = {"status": "skipped", "reason": "sglang is not importable here (the CUDA IPC "
               "payloads need its reduction; install sglang to run this stage)"}
        print(f"SKIP: {res['reason']}")
    else:
        res = run(Path(args.workdir or tempfile.mkdtemp(prefix="gpu_colocated_check_")),
                  module, cuda)
    res["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(summary_line(res))
    for f in res.get("failures", []):
        print(f"FAIL: {f}")
    return 1 if res.get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
