"""Benchmark: delta weight sync vs full weight sync, on the weights a real GSPO run produces.

    python bench/weight_sync_delta.py [--config examples/smollm2/config.yaml] [--steps 4]
        [--engine-dtype bfloat16] [--prompts 4] [--group 4] [--new-tokens 24] [--real]

The config's run (`train.run`, embedded engine of `--engine-dtype`, the config's learning rate)
trains `--steps` steps; every weight sync of the loop (the export stream in the engine's dtype)
is also sent to two SGLang servers on 127.0.0.1: one by the full sync of `rollout.weight_sync
=tensor` (flattened buckets, CPU shared memory), one by the delta sync (`rollout.delta`, the
`gspo_delta_loader` custom loader). The servers are stand-ins (in threads of this process) or,
with `--real`, SGLang's CPU servers (scripts/sglang_cpu.sh). After every delta sync the delta
server's weights are compared with the export bit for bit (stand-in) or by the sync probe
against the full server's greedy answers (real: same ids and log-probs). The batch options
only make the steps cheaper: Adam's step size does not depend on the batch, so neither does
the share of bf16 values a step changes.

Table per sync: version, changed share (bit patterns), bytes full / sent, tensors per
encoding, full sync time, delta sync time (encode + send + apply), encode time. The last line is
`ratio=<delta time / full time>`, summed over the syncs after the first (the first sync is full
on both servers).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _standins(model: str, dtype: str, loader: str):
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.sglang.client import SGLangEngine
    from megatron_gspo.rollout.sglang.weight_sync_delta import LOADER
    from megatron_gspo.rollout.standin.server import StandinServer

    sys.path.insert(0, loader)
    out = []
    for loaders in ((), (LOADER,)):
        srv = StandinServer(EmbeddedEngine(model, dtype=dtype), model_path=model,
                            custom_weight_loaders=loaders).start_in_thread()
        out.append((srv, SGLangEngine(server_urls=[srv.url], backoff_s=0.05)))
    return out


def _real(model: str, dtype: str, loader: str):
    from megatron_gspo.rollout.sglang.client import SGLangEngine
    from megatron_gspo.rollout.sglang.weight_sync_delta import launch_extras
    from megatron_gspo.rollout.sglang.launch import LaunchSpec, cpu_server_env

    python = str(ROOT / ".sglang-cpu" / "venv" / "bin" / "python")
    out = []
    for mode in ("off", "on"):
        extra, env = launch_extras(cpu_server_env(python), mode, "copy", loader)
        spec = LaunchSpec(model_path=model, base_port=0, dtype=dtype, python=python,
                          device="cpu", env=env, extra_args=("--skip-server-warmup", *extra),
                          log_dir=tempfile.mkdtemp(prefix=f"bench-delta-{mode}-"))
        eng = SGLangEngine(launch=spec, startup_timeout_s=1200, request_timeout_s=600)
        eng.sync(eng.astart())
        out.append((None, eng))
    return out


def _served_equal(srv, buckets) -> bool:
    params = dict(srv.engine.model.named_parameters())
    return all(torch.equal(params[n].detach().reshape(-1).view(torch.uint8),
                           t.detach().reshape(-1).view(torch.uint8))
               for b in buckets for n, t in b if n in params)


def _greedy(eng):
    from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(p, sp) for p in ([3, 5, 7, 11, 13], [17, 19, 23, 29])]
    return [(s.response_ids, s.rollout_logprobs) for s in eng.generate(reqs)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "smollm2" / "config.yaml"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--engine-dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--real", action="store_true", help="SGLang's CPU servers, not stand-ins")
    args = ap.parse_args()
    torch.multiprocessing.set_sharing_strategy("file_system")

    from megatron_gspo.config import load_config
    from megatron_gspo.loop import train
    from megatron_gspo.rollout.delta.sender import DeltaSender
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.sglang.weight_sync_delta import loader_dir

    cfg = load_config(args.config, [
        f"rollout.dtype={args.engine_dtype}", f"train.max_steps={args.steps}",
        "train.eval_interval=0", "checkpoint.interval=0", "logging.tensorboard=false",
        "logging.progress_bar=false", "logging.log_samples=0",
        f"train.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.new_tokens}", "algorithm.mini_batches=1"])
    model = str(cfg.model.path if os.path.isabs(str(cfg.model.path)) else ROOT / cfg.model.path)
    loader = loader_dir()
    (srv_full, full), (srv_delta, delta) = (_real if args.real else _standins)(
        model, args.engine_dtype, loader)
    delta.delta = DeltaSender("on")
    rows: list[dict] = []
    original = EmbeddedEngine.load_buckets
    servers = {id(s.engine) for s in (srv_full, srv_delta) if s is not None}

    def load_buckets(self, buckets, version):
        if id(self) in servers:  # the stand-ins' own loads
            return original(self, buckets, version)
        got = [list(b) for b in buckets]  # the export of this version, in the engine's dtype
        t0 = time.perf_counter()
        full.update_weights(iter(got), version)
        t_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        delta.update_weights(iter(got), version)
        t_delta = time.perf_counter() - t0
        st = delta.delta.stats
        exact = (_served_equal(srv_delta, got) if srv_delta is not None
                 else _greedy(delta) == _greedy(full))
        rows.append({"version": version, "share": st.share(), "full_bytes": st.bytes_full,
                     "sent_bytes": st.bytes_sent, "kinds": dict(st.kinds), "full_s": t_full,
                     "delta_s": t_delta, "encode_s": st.encode_s, "delta": st.delta,
                     "exact": exact})
        return original(self, got, version)

    EmbeddedEngine.load_buckets = load_buckets
    load = os.getloadavg()[0]
    try:
        train.run(cfg, tempfile.mkdtemp(prefix="bench-delta-run-"))
    finally:
        EmbeddedEngine.load_buckets = original
        for srv, eng in ((srv_full, full), (srv_delta, delta)):
            eng.shutdown()
            if srv is not None:
                srv.stop_thread()
    print(f"# {Path(args.config).parent.name}, engine {args.engine_dtype}, lr "
          f"{cfg.optimizer.lr:g}, {'real SGLang CPU' if args.real else 'stand-in'} servers, "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| version | changed share | full MB | sent MB | same/sparse/xor/full | full s | "
          "delta s | encode s | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = "-" if r["share"] is None else f"{r['share']:.4f}"
        k = r["kinds"]
        print(f"| {r['version']} | {share} | {r['full_bytes'] / 1e6:.1f} | "
              f"{r['sent_bytes'] / 1e6:.2f} | {k['same']}/{k['sparse']}/{k['xor']}/{k['full']} | "
              f"{r['full_s']:.3f} | {r['delta_s']:.3f} | {r['encode_s']:.3f} | "
              f"{'yes' if r['exact'] else 'NO'} |")
    later = [r for r in rows if r["delta"]]
    if not later or not all(r["exact"] for r in rows):
        print("ratio=nan")
        return 1
    sent, whole = (sum(r[k] for r in later) for k in ("sent_bytes", "full_bytes"))
    print(f"bytes_ratio={sent / whole:.4f}")
    print(f"ratio={sum(r['delta_s'] for r in later) / sum(r['full_s'] for r in later):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
