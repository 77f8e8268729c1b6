"""Worker processes for the multi-process learner tests (launched by `_dist.launch`).

Cases:
  ref  (1 rank)  reference run (TP=PP=EP=DP=1) of two tiny models; also checks the
                 micro-batch normalisation (M = 1, 2, 4) and packing in-process.
  par  (4 ranks) vocab-parallel log-probs (TP=2), the CP per-sequence reduction (CP=2), then
                 several TP / PP / VPP / EP / SP / DP layouts compared with the reference.
                 Runs on CPU (gloo) or, with >= 4 visible GPUs, on NCCL.
  gpu  (1 rank)  GPU / NCCL: local spec vs the CPU reference, TE spec (bf16) when installed.
Each rank writes `<case>.rank<r>.json` = {"failures": [...], "info": {...}}.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if "tests" not in sys.modules:  # a regular `tests` package elsewhere on the path (the GPU
    sys.path.insert(1, str(ROOT / "scripts"))  # kit's folder) would shadow this namespace one
    import repo_tests

    repo_tests.bind(ROOT)
    sys.path.remove(str(ROOT / "scripts"))

from megatron_gspo.data.sample import Sample  # noqa: E402

MOE = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=32, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, intermediate_size=64, num_hidden_layers=4,
           vocab_size=100, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
           hidden_act="silu", max_position_embeddings=256)
DENSE = dict(architectures=["Qwen3ForCausalLM"], hidden_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=64, num_hidden_layers=4,
             vocab_size=100, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
             hidden_act="silu", max_position_embeddings=256)
MODELS = {"moe": MOE, "dense": DENSE}
RTOL = 1e-5


def make_samples(n: int = 8, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(1, 100) for _ in range(rng.randint(2, 6))]
        r = [rng.randrange(1, 100) for _ in range(rng.randint(3, 9))]
        mask = [1] * len(r)
        if i == 3:
            mask[1] = 0  # an environment token inside the response
        if i == 5:
            mask = [0] * len(r)  # no trainable token: contributes nothing, not counted
        out.append(Sample(prompt_ids=p, response_ids=r, loss_mask=mask, index=i,
                          advantage=rng.uniform(-1.0, 1.0)))
    return out


def old_logprobs(lps: list[list[float]], seed: int = 1, scale: float = 2e-3):
    g = torch.Generator().manual_seed(seed)
    return [[x + scale * float(torch.randn((), generator=g)) for x in lp] for lp in lps]


class Checker:
    def __init__(self):
        self.failures: list[str] = []

    def close(self, what, a, b, rtol=RTOL, atol=1e-7):
        a = torch.as_tensor(a, dtype=torch.float64)
        b = torch.as_tensor(b, dtype=torch.float64)
        if a.shape != b.shape:
            self.failures.append(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            return
        err = (a - b).norm().item()
        ref = b.norm().item()
        if not err <= rtol * ref + atol:
            self.failures.append(f"{what}: |diff|={err:.3e} |ref|={ref:.3e}")

    def dicts(self, what, got: dict, ref: dict, rtol=RTOL, atol=1e-7):
        if set(got) != set(ref):
            self.failures.append(f"{what}: keys differ {sorted(set(got) ^ set(ref))[:6]}")
        for k in sorted(set(got) & set(ref)):
            self.close(f"{what}[{k}]", got[k], ref[k], rtol, atol)

    def metrics(self, what, got: dict, ref: dict):
        for k in ("loss", "clip_fraction", "clip_fraction_low", "clip_fraction_high",
                  "ratio_mean", "ratio_min", "ratio_max", "trainable_tokens", "sequences",
                  "clipped_tokens", "entropy"):
            self.close(f"{what}.{k}", got[k], ref[k])


# ----------------------------------------------------------------------------- ref
def case_ref(outdir: Path, chk: Checker, info: dict):
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.step import LossSettings

    import logging

    from megatron_gspo.megatron import cpu

    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger(cpu.__name__).addHandler(Grab())
    if not cpu.enable(trace=True):
        chk.failures.append("cpu.enable() did not activate on a CPU-only process")
    samples = make_samples()
    ref = {}
    for name, hf in MODELS.items():
        L = Learner(hf, optim=OptimSettings(lr=1e-3), batching=BatchSettings(num_microbatches=1),
                    seed=7)
        full = L.full_state_dict()
        lps = L.forward_logprobs(samples)
        old = old_logprobs(lps)
        m1 = L.forward_backward(samples, old)
        g1 = L.full_grads()
        info[f"{name}.clip_fraction"] = m1["clip_fraction"]
        for mbs in (2, 4):  # per-sequence normalisation across micro-batch splits
            L.batching = BatchSettings(num_microbatches=mbs)
            m = L.forward_backward(samples, old)
            chk.metrics(f"{name}.M{mbs}", m, m1)
            chk.dicts(f"{name}.M{mbs}.grad", L.full_grads(), g1)
            if m["micro_batches"] != mbs:
                chk.failures.append(f"{name}: asked {mbs} micro-batches, ran {m['micro_batches']}")
        L.batching = BatchSettings(num_microbatches=1)
        L.forward_backward(samples, old)
        L.optimizer_step()
        after = L.full_state_dict()
        entry = dict(full=full, lps=lps, old=old, metrics=m1, grads=g1, after=after)
        if name == "moe":
            # run checkpoint: MoE pre-MLP norms stored under the TE spec's key; exact reload
            from torch.distributed.checkpoint import FileSystemReader

            L.save_checkpoint(str(outdir / "ckpt-moe"))
            keys = set(FileSystemReader(str(outdir / "ckpt-moe")).read_metadata()
                       .state_dict_metadata)
            if ("decoder.layers.pre_mlp_layernorm.weight" not in keys
                    or "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys):
                chk.failures.append(f"moe checkpoint norm keys: {sorted(keys)[:12]}")
            L.load_full_state_dict(full)
            L.load_checkpoint(str(outdir / "ckpt-moe"))
            chk.dicts("moe checkpoint reload", L.full_state_dict(), after, rtol=0.0, atol=0.0)
            # packing: each sample alone gives the same log-probs as packed with others
            L.load_full_state_dict(full)
            packed = L.forward_logprobs(samples)
            for k in (0, 1, 4):
                alone = L.forward_logprobs([samples[k]])[0]
                chk.close(f"packing sample {k}", packed[k], alone, rtol=1e-6)
            chk.close("forward_logprobs reproducible", packed[0], lps[0], rtol=1e-6)
            # GSPO-token with A_it = A_i through packing: same loss and gradient as GSPO
            import copy

            tok = copy.deepcopy(samples)
            for s in tok:
                s.advantage = [s.advantage] * len(s.response_ids)
            L.load_full_state_dict(full)
            L.loss_settings = LossSettings(kind="gspo_token")
            mt = L.forward_backward(tok, old)
            chk.close("gspo_token loss", mt["loss"], m1["loss"])
            chk.dicts("gspo_token grad", L.full_grads(), g1)
            # token-mean GRPO reference for the DP / micro-batch check
            L.loss_settings = LossSettings(kind="grpo", eps_low=0.2, eps_high=0.28,
                                           grpo_aggregation="token-mean")
            entry["grpo_metrics"] = L.forward_backward(samples, old)
            entry["grpo_grads"] = L.full_grads()
        ref[name] = entry
    torch.save(ref, outdir / "ref.pt")
    # the trace names Megatron call sites (file:line) of the CUDA -> CPU rewrites
    sites = [m for m in seen if "megatron/core/" in m and ".py:" in m]
    info["cpu_trace_sites"] = len(sites)
    if not sites:
        chk.failures.append(f"cpu trace logged no Megatron call site ({seen[:3]})")


# ----------------------------------------------------------------------------- par
def _dev():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def check_vocab_parallel(chk: Checker, group, rank: int, size: int):
    from megatron_gspo.algo.logprobs import token_logprobs
    from megatron_gspo.megatron.tp_logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(3)
    full = torch.randn(37, 128, generator=g, dtype=torch.float64).float() * 3
    tgt = torch.randint(0, 100, (37,), generator=g)
    up = torch.randn(37, generator=g)
    ref_in = full[:, :100].clone().requires_grad_(True)
    ref_lp, ref_ent = token_logprobs(ref_in, tgt, temperature=0.7, return_entropy=True)
    (ref_lp * up).sum().backward()
    width = 128 // size
    mine = full[:, rank * width:(rank + 1) * width].clone().to(_dev()).requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(mine, tgt.to(_dev()), temperature=0.7,
                                      vocab_start=rank * width, vocab_size=100, group=group,
                                      chunk_size=8, return_entropy=True)
    (lp * up.to(_dev())).sum().backward()
    lp, ent = lp.cpu(), ent.cpu()
    chk.close("vocab-parallel logprobs", lp, ref_lp, rtol=1e-6)
    chk.close("vocab-parallel entropy", ent, ref_ent, rtol=1e-5)
    ref_grad = torch.cat([ref_in.grad, torch.zeros(37, 28)], dim=1)
    chk.close("vocab-parallel grad", mine.grad.cpu(), ref_grad[:, rank * width:(rank + 1) * width],
              rtol=1e-6)


def check_context_parallel(chk: Checker, group, rank: int, size: int):
    """Sequences split over CP ranks in 2*cp chunks: same s_i, loss and gradient as CP=1."""
    import torch.distributed as dist

    from megatron_gspo.data.batch import pack_microbatch
    from megatron_gspo.megatron import step
    from megatron_gspo.megatron.tp_logprobs import sequence_sums

    samples = make_samples(6, seed=5)
    old = old_logprobs([[-4.6] * len(s.response_ids) for s in samples], scale=0.3)
    mb = pack_microbatch(samples, list(range(6)), old_logprobs=old, seq_multiple=2 * size,
                         total_multiple=2 * size)

    def run(cp_size, cp_rank, cp_group):
        g = torch.Generator().manual_seed(11)
        emb = torch.randn(128, 16, generator=g).to(_dev()).requires_grad_(True)
        w = torch.randn(16, 128, generator=g).mul_(0.3).to(_dev()).requires_grad_(True)
        ctx = step.ParallelContext(cp_group=cp_group, cp_size=cp_size, cp_rank=cp_rank,
                                   vocab_size=100)
        data = step.device_batch(mb, _dev(), ctx)
        logits = (emb[data["tokens"][0]] @ w)[None]  # [1, S/cp, V] toy model
        lp, _ = step.token_logprobs_full(logits, data, ctx, temperature=1.0)
        settings = step.LossSettings(kind="gspo", eps_low=0.02, eps_high=0.03)
        loss, stats = step.compute_loss(lp, data, settings, num_sequences=5.0, num_tokens=1.0)
        loss.backward()
        # per-sequence sums through the autograd all-reduce, from this rank's positions only
        own = torch.zeros(mb.seq_len, device=_dev())
        own[data["local_index"]] = 1.0
        lr_tok = (lp.detach() - data["old_logprobs"]) * data["loss_mask"] * own
        sums = sequence_sums(lr_tok, data["seq_index"], data["seq_valid"], cp_group)
        stats = {k: v.cpu() for k, v in stats.items()}
        return loss.detach().cpu(), stats, emb.grad, w.grad, sums

    loss1, st1, ge1, gw1, sums1 = run(1, 0, None)
    loss2, st2, ge2, gw2, sums2 = run(size, rank, group)
    for t in (ge2, gw2):
        dist.all_reduce(t, group=group)  # DDP's sum over the CP ranks
    chk.close("cp loss", loss2, loss1)
    chk.close("cp clip tokens", st2["clipped_tokens"], st1["clipped_tokens"])
    chk.close("cp ratio_mean (s_i)", st2["ratio_mean"], st1["ratio_mean"])
    chk.close("cp per-sequence sums", sums2.cpu(), sums1.cpu())
    chk.close("cp grad emb", ge2.cpu(), ge1.cpu())
    chk.close("cp grad w", gw2.cpu(), gw1.cpu())
    chk.close("cp ratio_min", st2["ratio_min"], st1["ratio_min"])
    chk.close("cp ratio_max", st2["ratio_max"], st1["ratio_max"])
    if loss1.abs() == 0 or st1["clipped_tokens"] == 0:
        chk.failures.append("cp check is degenerate (zero loss or no clipping)")


def case_par(outdir: Path, chk: Checker, info: dict):
    from megatron.core import parallel_state as ps

    from megatron_gspo.megatron import parallel
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.step import LossSettings

    ref = torch.load(outdir / "ref.pt", weights_only=False)
    parallel.initialize(parallel.ParallelLayout(tensor=2))
    grp = ps.get_tensor_model_parallel_group()
    r, n = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    check_vocab_parallel(chk, grp, r, n)
    check_context_parallel(chk, grp, r, n)

    samples = make_samples()
    PL = parallel.ParallelLayout
    layouts = [
        ("moe", "tp2-sp", PL(tensor=2, sequence_parallel=True), {}),
        ("moe", "pp2", PL(pipeline=2), {}),
        ("moe", "ep2", PL(expert=2), {}),
        ("moe", "tp2-ep2-sp", PL(tensor=2, expert=2, sequence_parallel=True), {}),
        ("moe", "pp2-vpp2", PL(pipeline=2, virtual_pipeline=2), {}),
        ("moe", "dp4-m2", PL(), {"mbs": 2}),
        ("moe", "tp2-sp-distopt", PL(tensor=2, sequence_parallel=True), {"distopt": True}),
        ("moe", "dp2-pp2-grpo-token-mean", PL(pipeline=2), {"grpo": True, "mbs": 2}),
        ("dense", "tp2-pp2", PL(tensor=2, pipeline=2), {"ckpt_save": True}),
        ("dense", "tp2-sp-dp2", PL(tensor=2, sequence_parallel=True), {}),
        ("dense", "tp2-dp2", PL(tensor=2), {"mbs": 2}),
        ("dense", "ckpt-load-pp2-dp2", PL(pipeline=2), {"ckpt_load": True}),
    ]
    only = os.environ.get("MG_TEST_LAYOUTS")  # debugging aid: comma-separated names
    for model, name, layout, opts in layouts:
        if only and name not in only.split(","):
            continue
        print(f"layout {model}.{name}", flush=True)
        t0 = time.perf_counter()
        R = ref[model]
        loss = (LossSettings(kind="grpo", eps_low=0.2, eps_high=0.28,
                             grpo_aggregation="token-mean") if opts.get("grpo") else None)
        L = Learner(MODELS[model], layout=layout, seed=99, loss=loss,
                    optim=OptimSettings(lr=1e-3,
                                        use_distributed_optimizer=opts.get("distopt", False)),
                    batching=BatchSettings(num_microbatches=opts.get("mbs", 1)))
        tag = f"{model}.{name}"
        ckpt = outdir / "ckpt-dense"
        if opts.get("ckpt_load"):  # torch_dist checkpoint saved under TP2 x PP2, loaded here
            L.load_checkpoint(str(ckpt))
            saved = torch.load(outdir / "ckpt-dense-params.pt")  # what the saving layout held
            chk.dicts(f"{tag}.params", L.full_state_dict(), saved, rtol=0.0, atol=0.0)
            if L.steps != 1 or L.scheduler.num_steps != 1:
                chk.failures.append(f"{tag}: steps {L.steps}, scheduler {L.scheduler.num_steps}")
            info[tag] = round(time.perf_counter() - t0, 2)
            continue
        L.load_full_state_dict(R["full"])
        if opts.get("grpo"):
            m = L.forward_backward(samples, R["old"])
            chk.metrics(tag, m, R["grpo_metrics"])
            chk.dicts(f"{tag}.grad", L.full_grads(), R["grpo_grads"])
        else:
            if name in ("tp2-sp", "tp2-ep2-sp", "tp2-pp2"):
                lps = L.forward_logprobs(samples)
                for k in range(len(samples)):
                    chk.close(f"{tag}.logprobs[{k}]", lps[k], R["lps"][k], rtol=1e-6)
            m = L.forward_backward(samples, R["old"])
            chk.metrics(tag, m, R["metrics"])
            if not opts.get("distopt"):
                chk.dicts(f"{tag}.grad", L.full_grads(), R["grads"])
            L.optimizer_step()
            # Adam's first step moves an element by lr*g/(|g|+eps): where |g| is near eps, the
            # last-bit gradient differences of another summation order move it by up to
            # lr*|dg|/eps (seen: 4.6e-6); an element updated from the wrong shard is off by ~lr.
            after = L.full_state_dict()
            chk.dicts(f"{tag}.params-after-step", after, R["after"], atol=1e-5)
            if opts.get("ckpt_save"):
                if int(os.environ.get("RANK", "0")) == 0:
                    torch.save(after, outdir / "ckpt-dense-params.pt")
                L.save_checkpoint(str(ckpt))
        info[tag] = round(time.perf_counter() - t0, 2)


# ----------------------------------------------------------------------------- gpu (1 rank)
GPU_ORDER = ("dense", "moe")  # the dense model first: an MoE-only failure leaves it checked


def each_model(chk: Checker, info: dict, one) -> None:
    """Run `one(name, hf_config)` for every model in `GPU_ORDER`, each passing or failing on
    its own: an exception is that model's failure, and the next model still runs.
    `info["models"]` = {name: "ok" | "FAIL"}."""
    info["models"] = {}
    for name in GPU_ORDER:
        before = len(chk.failures)
        try:
            one(name, MODELS[name])
        except Exception:
            chk.failures.append(f"{name}: exception:\n" + traceback.format_exc())
        info["models"][name] = "ok" if len(chk.failures) == before else "FAIL"


def case_gpu(outdir: Path, chk: Checker, info: dict):
    """One GPU, NCCL: the local spec against the CPU reference (TF32 off), then the TE spec
    (THD packed attention) in bf16 against the same reference with a loose tolerance."""
    from megatron_gspo.megatron.learner import Learner
    from megatron_gspo.megatron.models.builder import te_available
    from megatron_gspo.megatron.optimizer import OptimSettings

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = torch.load(outdir / "ref.pt", weights_only=False)
    samples = make_samples()
    info["te_available"] = te_available()
    from tests.megatron import _gpu_extra

    _gpu_extra.check_grads_finite_cuda(chk, info)
    specs = [("local", False, torch.float32)]
    if te_available():
        specs.append(("te", True, torch.bfloat16))

    def one(model: str, hf: dict) -> None:
        R = ref[model]
        for spec, use_te, dtype in specs:
            tag = f"{model}.{spec}"
            L = Learner(hf, optim=OptimSettings(lr=1e-3), use_te=use_te, params_dtype=dtype,
                        seed=5)
            L.load_full_state_dict(R["full"])
            lps = L.forward_logprobs(samples)
            diff = max(abs(a - b) for x, y in zip(lps, R["lps"], strict=True)
                       for a, b in zip(x, y, strict=True))
            info[f"{tag}.max_logprob_diff"] = diff
            m = L.forward_backward(samples, R["old"])
            info[f"{tag}.loss"] = (m["loss"], R["metrics"]["loss"])
            if dtype == torch.float32:
                chk.close(f"{tag}.logprobs", [x for y in lps for x in y],
                          [x for y in R["lps"] for x in y], rtol=1e-5)
                chk.metrics(tag, m, R["metrics"])
                chk.dicts(f"{tag}.grad", L.full_grads(), R["grads"], rtol=1e-4, atol=1e-6)
                L.optimizer_step()
                chk.dicts(f"{tag}.params-after-step", L.full_state_dict(), R["after"],
                          rtol=1e-4, atol=1e-5)
            elif not diff < 0.1:
                chk.failures.append(f"{tag}: max |logprob - reference| = {diff:.3f} >= 0.1")

    each_model(chk, info, one)


def run_case(cases: dict) -> None:
    """A worker's main: run case `argv[1]` (a key of `cases`, called as (outdir, Checker, info))
    into `argv[2]`, write `<case>.rank<R>.json` = {"failures", "info"}, and exit 1 when it
    raised (a rank that raised must not leave the others waiting in a collective)."""
    case, outdir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    if os.environ.get("MG_TEST_DUMP_AFTER"):  # debugging aid: stack dump of a hung rank
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["MG_TEST_DUMP_AFTER"]), exit=True)
    chk, info = Checker(), {}
    try:
        cases[case](outdir, chk, info)
    except Exception:
        chk.failures.append("exception:\n" + traceback.format_exc())
    (outdir / f"{case}.rank{rank}.json").write_text(json.dumps(
        {"failures": chk.failures, "info": info}, default=str))
    os._exit(0 if not any(f.startswith("exception") for f in chk.failures) else 1)


def main():
    run_case({"ref": case_ref, "par": case_par, "gpu": case_gpu})


if __name__ == "__main__":
    main()
