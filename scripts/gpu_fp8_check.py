"""GPU check of FP8 rollouts (`rollout.weight_precision: fp8`; block FP8 of DeepSeek-V3, arXiv
2412.19437: e4m3 weights, 128 x 128 blocks, fp32 inverse scales; `megatron_gspo/quant/`):

1. quantizer: `quant.blockfp8.quantize` of random weights of Qwen3-0.6B's shape (28 layers of
   q/k/v/o and gate/up/down projections, 440 M parameters, 0.82 GiB in BF16, plus one
   1000 x 1000 tensor with partial edge blocks) on CUDA, compared bit for bit (the e4m3 bytes
   and the fp32 scales) with the same function on the CPU; its time per GiB of BF16 input on
   the GPU (best of --repeats passes, synchronized) and, for comparison, on this CPU;
2. log-probs: a small random Qwen3 (scripts/gpu_colocated_check.py's shape) in BF16, its FP8
   copy written by `quant.fp8_checkpoint.write_fp8_checkpoint` (what launched servers start
   from) and read back dequantized (`dequantized_state`: a W8A16 engine's weights) into a second
   model: the per-token log-prob error of the FP8 model against the BF16 one on random
   sequences (max and mean |d|), the sequence-level mean d_i and the share of sequences whose
   |d_i| is beyond GSPO's clip range (4e-4), judged against the sync probe's FP8 tolerance;
3. server: where sglang imports on CUDA, one SGLang server launched colocated from the run's
   FP8 copy (`loop.fp8_rollout.served_checkpoint`, the launch of `loop.build.rollout_engine`
   with the FP8 environment of `loop/server_setup.py`), refused unless it serves block FP8
   (`fp8_rollout.check_served`), one sync (quantized on the learner side,
   `loop.weight_sync_phase.sync_weights`) and the sync probe with the FP8 tolerance. Without
   CUDA the CPU stand-in server (W8A16) takes its place: the dry run. CUDA without sglang (the
   GPU check machine's image) reports it skipped.

    python scripts/gpu_fp8_check.py [--layers 28] [--repeats 3] [--json OUT.json] [--workdir DIR]

Prints one line per part, writes --json (`summary_line` makes scripts/gpu_checks.sh's row);
exit 1 when a part does not behave. Module level imports the standard library only
(gpu_kit.py loads `summary_line`).
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
# Qwen3-0.6B (config.json): hidden 1024, 16 query heads and 8 KV heads of 128, MLP 3072
QWEN3_06B = {"self_attn.q_proj": (2048, 1024), "self_attn.k_proj": (1024, 1024),
             "self_attn.v_proj": (1024, 1024), "self_attn.o_proj": (1024, 2048),
             "mlp.gate_proj": (3072, 1024), "mlp.up_proj": (3072, 1024),
             "mlp.down_proj": (1024, 3072)}
EDGE = ("edge.proj.weight", (1000, 1000))  # partial blocks on both edges
CLIP = 4e-4  # GSPO's eps_high (arXiv 2507.18071): a sequence ratio beyond it is clipped


def _scripts_module(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def check_quantizer(layers: int, repeats: int, device: str) -> dict:
    """Part 1: the quantizer on `device` against the CPU, and its speed."""
    import torch

    from megatron_gspo.quant.blockfp8 import quantize

    g = torch.Generator(device=device).manual_seed(0)
    names = [(f"model.layers.{i}.{m}.weight", s) for i in range(layers)
             for m, s in QWEN3_06B.items()] + [EDGE]
    weights = {}
    for n, (rows, cols) in names:  # rows of different magnitudes: the scales differ per block
        w = torch.randn(rows, cols, generator=g, device=device)
        w *= 0.02 * torch.rand(rows, 1, generator=g, device=device) * 4
        weights[n] = w.to(torch.bfloat16)
    nbytes = sum(w.numel() * w.element_size() for w in weights.values())
    gib = nbytes / 2**30

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    out = {n: quantize(w, n) for n, w in weights.items()}  # warm-up, and the result compared
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for n, w in weights.items():
            quantize(w, n)
        sync()
        best = min(best, time.perf_counter() - t)
    mismatched, first = [], None
    t = time.perf_counter()
    for n, w in weights.items():
        q_ref, s_ref = quantize(w.cpu(), n)
        q, s = out[n]
        dq = int((q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)).sum())
        ds = int((s.cpu() != s_ref).sum())
        if dq or ds or q.dtype != q_ref.dtype or s.dtype != s_ref.dtype:
            mismatched.append(n)
            first = first or f"{n}: {dq} fp8 bytes and {ds} scales differ"
    cpu_s = time.perf_counter() - t  # the CPU quantizer plus the copies and the compare
    return {"device": device, "tensors": len(weights),
            "params": sum(w.numel() for w in weights.values()), "gib": gib,
            "seconds": best, "s_per_gib": best / gib, "cpu_s_per_gib": cpu_s / gib,
            "repeats": repeats, "mismatched": len(mismatched), "first_mismatch": first}


def token_logprobs(model, ids):
    """[B, T-1] float32 log-probs of each next token."""
    import torch

    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def check_logprobs(workdir: Path, device: str, sequences: int, length: int) -> dict:
    """Part 2: the dequantized FP8 copy's log-probs against the BF16 model's."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from megatron_gspo.loop.fp8_rollout import FP8_PROBE_TOLERANCE
    from megatron_gspo.quant.fp8_checkpoint import dequantized_state, write_fp8_checkpoint

    coloc = _scripts_module("gpu_colocated_check")
    src = coloc.write_model(workdir / "bf16", "bfloat16")
    write_fp8_checkpoint(src, workdir / "fp8", keep_bf16_layers=0)
    bf16 = AutoModelForCausalLM.from_pretrained(src).to(torch.bfloat16).to(device)
    fp8 = AutoModelForCausalLM.from_pretrained(src).to(torch.bfloat16)
    state = dequantized_state(workdir / "fp8", torch.bfloat16)
    fp8.load_state_dict(state, strict=True)
    fp8.to(device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, coloc.SHAPE["vocab_size"], (sequences, length), generator=g)
    ids = ids.to(device)
    d = token_logprobs(bf16, ids) - token_logprobs(fp8, ids)  # [B, T-1]
    seq = d.mean(-1)  # [B]: the sequence-level mismatch d_i
    n_fp8 = 0
    for f in (workdir / "fp8").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n_fp8 += sum(k.endswith("_scale_inv") for k in st.keys())
    return {"tokens": int(d.numel()), "sequences": sequences, "max_abs": float(d.abs().max()),
            "mean_abs": float(d.abs().mean()), "seq_max_abs": float(seq.abs().max()),
            "seq_beyond_clip": float((seq.abs() > CLIP).float().mean()),
            "fp8_weights": n_fp8, "tolerance": FP8_PROBE_TOLERANCE,
            "changed": bool(d.abs().max() > 0)}


def server_config(model: Path, dtype: str, cuda: bool, logs: Path):
    from megatron_gspo.config import load_config

    coloc = _scripts_module("gpu_colocated_check")
    extra = ",".join(coloc.GPU_SERVER_ARGS) if cuda else ""
    return load_config(ROOT / "examples" / "tiny" / "config.yaml", [
        f"model.path={model}", f"model.dtype={dtype}", "rollout.engine=sglang",
        "rollout.colocate=true", "rollout.weight_sync=tensor", "rollout.num_servers=1",
        "rollout.tp_size=1", f"rollout.mem_fraction={0.1 if cuda else 0.7}",
        "rollout.bucket_bytes=1048576", "rollout.verify_sync_interval=0",
        "rollout.weight_precision=fp8", "rollout.fp8_bf16_layers=0",
        "rollout.startup_timeout=240", f"rollout.server_log_dir={logs}",
        f"rollout.extra_server_args=[{extra}]"])


def check_server(workdir: Path, module: str, cuda: bool) -> dict:
    """Part 3: an FP8 server from the FP8 copy, one sync, the probe."""
    from megatron_gspo.loop import build, fp8_rollout, weight_sync_phase as sync
    from megatron_gspo.rollout.engine import RolloutError
    from megatron_gspo.rollout.multinode import colocated
    from megatron_gspo.rollout.sglang.weight_sync_endpoints import PROBE_TOLERANCE

    coloc = _scripts_module("gpu_colocated_check")
    os.environ["SGLANG_SERVER_MODULE"] = module
    dtype = "bfloat16" if cuda else "float32"
    cfg = server_config(coloc.write_model(workdir / "model", dtype), dtype, cuda,
                        workdir / "logs")
    res = {"status": "ran", "server": module, "dtype": dtype, "env": fp8_rollout.server_env(),
           "tolerance": fp8_rollout.probe_tolerance(cfg, PROBE_TOLERANCE), "failures": []}
    hf = build.read_hf_config(cfg.model.path)
    learner = build.learner(cfg, hf)
    engine = None
    try:
        build.load_initial_weights(cfg, learner, hf)
        t = time.perf_counter()
        served = fp8_rollout.served_checkpoint(cfg, workdir / "run", 0)
        res["copy_seconds"] = time.perf_counter() - t
        if sync.offloading(cfg):
            learner.offload()
            colocated.free_learner_cache()
        t = time.perf_counter()
        engine = build.rollout_engine(cfg, hf, build.tokenizer(cfg), served)
        engine.sync(engine.astart())
        res["launch_seconds"] = time.perf_counter() - t
        engine.release_memory(colocated.RESUME_AFTER)
        fp8_rollout.check_served(engine)
        t = time.perf_counter()
        m = sync.sync_weights(learner, engine, hf, cfg, version=0)
        res.update(sync_seconds=time.perf_counter() - t, buckets=m.get("weight_sync/buckets"),
                   bytes=m.get("weight_sync/bytes"), fp8_tensors=m.get("weight_sync/fp8_tensors"))
        t = time.perf_counter()
        try:
            res["probe_max_diff"], res["probe"] = sync.verify_sync(learner, engine, cfg, 0), "match"
        except RolloutError as e:
            found = re.search(r"log-probs (\S+) away", str(e))
            res["probe_max_diff"] = float(found.group(1)) if found else None
            res["probe"] = "mismatch"
            res["failures"].append(f"probe v0: mismatch ({str(e).splitlines()[0][:200]})")
        res["probe_seconds"] = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - the report is written regardless
        traceback.print_exc()
        res["failures"].append(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    finally:
        if engine is not None:
            engine.shutdown()
        learner.shutdown()
    return res


def _fmt(x, spec=".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def summary_line(res: dict) -> str:
    """The fp8 stage's cell of scripts/gpu_checks.sh's summary (from the --json report)."""
    parts = []
    q = res.get("quantizer")
    if q:
        exact = "bit-exact" if not q["mismatched"] else (
            f"{q['mismatched']} tensor(s) differ, first {q['first_mismatch']}")
        dry = " (no CUDA: CPU against itself)" if q["device"] == "cpu" else ""
        parts.append(f"quantizer on {q['device']}: {q['tensors']} tensors of Qwen3-0.6B's shape "
                     f"({q['params'] / 1e6:.0f} M params, {q['gib']:.2f} GiB bf16) {exact} vs "
                     f"CPU{dry}, {q['s_per_gib']:.3g} s/GiB (CPU {q['cpu_s_per_gib']:.3g} s/GiB)")
    lp = res.get("logprobs")
    if lp:
        parts.append(f"log-probs FP8 copy vs BF16 ({lp['fp8_weights']} FP8 weights, "
                     f"{lp['tokens']} tokens): per token max abs diff {lp['max_abs']:.3g}, "
                     f"mean {lp['mean_abs']:.3g}; sequence mean d_i max abs "
                     f"{lp['seq_max_abs']:.3g} "
                     f"({100 * lp['seq_beyond_clip']:.0f}% beyond {CLIP:g}); probe tolerance "
                     f"{lp['tolerance']:g}")
    s = res.get("server")
    if s and s.get("status") == "skipped":
        parts.append(f"server: skipped: {s['reason']}")
    elif s:
        env = ",".join(f"{k}={v}" for k, v in s["env"].items()) or "no env"
        mib = f", {s['bytes'] / 2**20:.1f} MiB" if s.get("bytes") else ""
        parts.append(f"server {s['server']} from the FP8 copy ({s['dtype']}, {env}): copy "
                     f"{_fmt(s.get('copy_seconds'), '.1f')} s, launch "
                     f"{_fmt(s.get('launch_seconds'), '.1f')} s, sync v0 "
                     f"{_fmt(s.get('sync_seconds'), '.2f')} s ({_fmt(s.get('fp8_tensors'), '.0f')}"
                     f" FP8 tensors{mib}), probe {s.get('probe', 'n/a')} max diff "
                     f"{_fmt(s.get('probe_max_diff'))} (tolerance {s['tolerance']:g})")
    if res.get("failures"):
        parts.append(f"{len(res['failures'])} failure(s), first: {res['failures'][0]}")
    return "; ".join(parts) or "no report"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28, help="Qwen3-0.6B has 28")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
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
    device = "cuda" if cuda else "cpu"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_fp8_check_"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"failures": [], "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if cuda:
        res["capability"] = list(torch.cuda.get_device_capability())
    for part, fn in (("quantizer", lambda: check_quantizer(args.layers, args.repeats, device)),
                     ("logprobs", lambda: check_logprobs(work / "logprobs", device,
                                                         args.sequences, args.length))):
        try:
            res[part] = fn()
        except Exception as e:  # noqa: BLE001 - the other parts still run
            traceback.print_exc()
            res["failures"].append(f"{part}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        print(summary_line({part: res.get(part)}), flush=True)
    q, lp = res.get("quantizer"), res.get("logprobs")
    if q and q["mismatched"]:
        res["failures"].append(f"quantizer: {q['first_mismatch']}")
    if lp and not lp["changed"]:
        res["failures"].append("log-probs: the FP8 copy equals the BF16 model (nothing quantized)")
    if lp and not lp["max_abs"] < lp["tolerance"]:
        res["failures"].append(f"log-probs: max |d| {lp['max_abs']:.3g} is not below the probe's "
                               f"FP8 tolerance {lp['tolerance']:g}")
    module = args.server_module or ("sglang.launch_server" if cuda else
                                    "megatron_gspo.rollout.standin.server")
    if cuda and not sglang_importable():
        res["server"] = {"status": "skipped", "reason": "sglang is not importable here (install "
                         "sglang to launch an FP8 server from the FP8 copy)"}
    else:
        res["server"] = check_server(work / "server", module, cuda)
        res["failures"] += [f"server: {f}" for f in res["server"].pop("failures")]
    print(summary_line({"server": res["server"]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(summary_line(res))
    for f in res["failures"]:
        print(f"FAIL: {f}")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
