"""GPU check of the SGLang rollout engine against a REAL SGLang server.

Builds a small random Qwen3 model (no hub access needed), launches `sglang.launch_server` on it
(--skip-tokenizer-init: the client sends token ids), then checks through `SGLangEngine`:
  1. a batch with n>1: token ids, finish reasons, and engine log-probs vs a Hugging Face
     forward pass of the same model (bf16 engine vs fp32 reference: statistics are printed,
     mean |diff| must stay under --logprob-tol);
  2. colocated weight update (`update_weights_from_tensor`, flattened CUDA buckets): greedy
     answers change and the version is reported; restoring the weights restores the answers;
  3. `update_weights_from_disk`, then `release_memory_occupation` / `resume_memory_occupation`
     in the trainer's colocated order: release everything, resume `weights`, push the weights
     again, resume `kv_cache` and `cuda_graph`. A server started without
     `--enable-weights-cpu-backup` (the launcher does not pass it) does not keep its weights
     across a release, so the same answers after resume prove the push, not the release;
  4. killing the server makes generation fail with a clear error.
Exits 0 when every check passes; prints one line per check.

Usage: python scripts/gpu_sglang_check.py [--workdir DIR] [--tp-size 1] [--keep]
Needs CUDA and `sglang` installed (`pip install -e .[sglang]`). Server ports come from the
launcher (at most 55535: SGLang adds 10000 for its gRPC port and refuses more than 65535).
`run_checks(..., module="megatron_gspo.rollout.standin.server")` runs the same checks on the CPU
against the stand-in server, which follows SGLang's rules (weights lost on release included).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

SMALL = dict(
    model_type="qwen3", vocab_size=2048, hidden_size=256, intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=2048, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
)


def _ok(name: str, cond: bool, detail: str = "") -> bool:
    print(f"[{'PASS' if cond else 'FAIL'}] {name} {detail}", flush=True)
    return cond


def run_checks(workdir: str, tp_size: int = 1, logprob_tol: float = 0.05,
               colocated: bool = True, module: str = "sglang.launch_server") -> bool:
    """Run all checks; returns True when all passed.

    Args:
        workdir: model directory and server logs go here.
        tp_size: tensor-parallel size of the server.
        logprob_tol: bound on the mean |engine - HF fp32| log-prob difference.
        colocated: also check memory release/resume (server started with memory saving).
        module: server module taking SGLang's flags (SGLang's; the stand-in on a CPU).
    """
    from megatron_gspo.rollout.engine import GenerateRequest, RolloutError, SamplingParams
    from megatron_gspo.rollout.embedded import build_hf_model, sequence_logprobs
    from megatron_gspo.rollout.sglang.client import SGLangEngine
    from megatron_gspo.rollout.sglang.launch import LaunchSpec

    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:  # CPU tensors reach the (stand-in) server process through shared files
        torch.multiprocessing.set_sharing_strategy("file_system")
    model_dir = os.path.join(workdir, "small_qwen3")
    hf = build_hf_model(SMALL, dtype="bfloat16")
    hf.save_pretrained(model_dir)
    ref = build_hf_model(model_dir, dtype="float32", device=device)
    spec = LaunchSpec(module=module,
        model_path=model_dir, tp_size=tp_size, base_port=0, mem_fraction_static=0.3,
        colocated=colocated, dtype="bfloat16", log_dir=os.path.join(workdir, "logs"),
        extra_args=["--skip-tokenizer-init", "--skip-server-warmup", "--disable-cuda-graph"],
    )
    eng = SGLangEngine(launch=spec, startup_timeout_s=600, backoff_s=0.2, max_retries=1)
    results = []
    try:
        t0 = time.time()
        eng.sync(eng.astart())
        results.append(_ok("launch", True, f"{eng.urls} in {time.time() - t0:.0f} s"))

        reqs = [
            GenerateRequest(list(range(3, 20)), SamplingParams(max_new_tokens=24, n=4)),
            GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=16, temperature=0.7,
                                                      top_p=0.9, n=3, stop_token_ids=(9, 10))),
        ]
        out = eng.generate(reqs)
        diffs, shape_ok = [], len(out) == 7
        for s in out:
            sp = reqs[s.group_index].sampling
            shape_ok &= len(s.response_ids) == len(s.rollout_logprobs) <= sp.max_new_tokens
            shape_ok &= s.finish_reason in ("stop", "length")
            r = sequence_logprobs(ref, s.prompt_ids, s.response_ids, sp.temperature).cpu()
            diffs.append((torch.tensor(s.rollout_logprobs) - r).abs())
        d = torch.cat(diffs)
        results.append(_ok("generate n>1", shape_ok, f"{len(out)} samples"))
        results.append(_ok("logprobs vs HF fp32", d.mean().item() < logprob_tol,
                           f"mean|d|={d.mean():.4f} max|d|={d.max():.4f}"))

        greedy = [GenerateRequest([11, 12, 13], SamplingParams(max_new_tokens=12, temperature=0.0,
                                                               ignore_eos=True))]
        base = eng.generate(greedy)[0].response_ids
        orig = [(k, v.to(device)) for k, v in hf.state_dict().items()]
        noisy = [(k, v + 0.05 * torch.randn_like(v)) for k, v in orig]
        eng.update_weights([noisy[:8], noisy[8:]], version=1)
        changed = eng.generate(greedy)[0]
        results.append(_ok("update_weights_from_tensor", changed.weight_version == 1
                           and changed.response_ids != base, f"version={changed.weight_version}"))
        eng.update_weights([orig], version=2)
        back = eng.generate(greedy)[0]
        results.append(_ok("restore weights", back.response_ids == base and
                           back.weight_version == 2))

        eng.sync(eng.aupdate_weights_from_disk(model_dir, 3))
        disk = eng.generate(greedy)[0]
        results.append(_ok("update_weights_from_disk", disk.response_ids == base and
                           disk.weight_version == 3))

        if colocated:
            free0 = torch.cuda.mem_get_info()[0] if cuda else 0
            eng.release_memory()
            free1 = torch.cuda.mem_get_info()[0] if cuda else 1
            # Released weights are gone without --enable-weights-cpu-backup: resume the weight
            # memory, push the weights, then resume the KV cache and CUDA graphs.
            eng.resume_memory(("weights",))
            eng.update_weights([orig], version=4)
            eng.resume_memory(("kv_cache", "cuda_graph"))
            again = eng.generate(greedy)[0]
            results.append(_ok("release/resume memory + weight push", free1 > free0 and
                               again.response_ids == base and again.weight_version == 4,
                               f"freed {(free1 - free0) / 2**30:.2f} GiB"))

        eng.procs[0].stop(grace_s=5)
        try:
            eng.generate(greedy)
            results.append(_ok("dead server -> clear error", False, "no error raised"))
        except RolloutError as e:
            results.append(_ok("dead server -> clear error", "exited" in str(e), str(e)[:160]))
    finally:
        eng.shutdown()
    return all(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--logprob-tol", type=float, default=0.05)
    ap.add_argument("--no-colocated", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        sys.exit(0)
    try:
        import sglang  # noqa: F401
    except ImportError:
        print("SKIP: sglang is not installed")
        sys.exit(0)
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_sglang_check_")
    ok = run_checks(workdir, args.tp_size, args.logprob_tol, not args.no_colocated)
    print("ALL PASSED" if ok else "SOME CHECKS FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
