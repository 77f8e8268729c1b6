"""Megatron-Core's MTP block in the learner against a reference written from the DeepSeek-V3
report's definition of an MTP module, and the policy's log-probs / gradients with and without
the block; prints one JSON line. Run by tests/megatron/test_mtp_learner.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp_logits(arch: str, hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """MTP module 1 from its definition (arXiv 2412.19437, eq. 21-23), on the HF tensors:
    h' = eh_proj([RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h_i)]), then the transformer layer stored
    at index num_hidden_layers (run as transformers' decoder layer), then shared_head.norm and
    the shared head. h_i is the main model's output representation (after its final norm, as
    Megatron-Core and SGLang pass it). Returns [B, S-1, V] (positions with a next token)."""
    import transformers

    from tests.convert.tiny_families import FAMILIES
    fields = FAMILIES[arch][1]
    n = fields["num_hidden_layers"]
    cls = getattr(transformers, arch)
    main = cls.from_pretrained(hf_dir, attn_implementation="eager").eval()  # MTP layer ignored
    ref_dir = hf_dir.parent / f"{arch}_as_{n + 1}_layers"  # the MTP layer as a decoder layer
    ref_dir.mkdir(exist_ok=True)
    cfg = json.loads((hf_dir / "config.json").read_text()) | {"num_hidden_layers": n + 1}
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    if not (ref_dir / "model.safetensors").exists():
        (ref_dir / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    full = cls.from_pretrained(ref_dir, attn_implementation="eager").eval()
    from safetensors.torch import load_file

    sd = load_file(str(hf_dir / "model.safetensors"))
    eps, p = fields["rms_norm_eps"], f"model.layers.{n}."
    with torch.no_grad():
        h = main.model(input_ids=tokens).last_hidden_state[:, :-1]  # [B, S-1, H] (final norm)
        emb = sd[p + "embed_tokens.weight"][tokens[:, 1:]]  # Emb(t_{i+1})  [B, S-1, H]
        x = torch.cat([_rms(emb, sd[p + "enorm.weight"], eps),
                       _rms(h, sd[p + "hnorm.weight"], eps)], -1) @ sd[p + "eh_proj.weight"].T
        S = x.shape[1]
        pos = torch.arange(S)[None]
        cos_sin = full.model.rotary_emb(x, pos)
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
        layer = full.model.layers[n]
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        head = sd[p + "shared_head.head.weight"]
        return _rms(out, sd[p + "shared_head.norm.weight"], eps) @ head.T


def _logprob_sum(logits, tokens, vocab):
    lp = logits[:, :-1, :vocab].float().log_softmax(-1)
    return lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, S-1]


def learner_gspo_with_and_without_mtp(hf_dir: Path) -> dict:
    """One GSPO forward-backward of the real Learner (2 micro-batches, fixed samples) with and
    without the MTP block: loss and every gradient bit-identical?"""
    import random

    from megatron_gspo.data.sample import Sample
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.megatron.step import LossSettings
    from tests.megatron._family_train_worker import _load_hf

    cfg = json.loads((hf_dir / "config.json").read_text())
    rng = random.Random(0)
    samples = [Sample(prompt_ids=[rng.randrange(2, 150) for _ in range(3 + i % 3)],
                      response_ids=[rng.randrange(2, 150) for _ in range(4 + i % 4)],
                      loss_mask=[1] * (4 + i % 4), index=i, advantage=rng.uniform(-1, 1))
               for i in range(6)]
    runs = {}
    for mtp in (False, True):
        L = Learner(cfg, optim=OptimSettings(lr=1e-3), seed=11, mtp=mtp,
                    loss=LossSettings(kind="gspo", eps_low=3e-4, eps_high=4e-4),
                    batching=BatchSettings(num_microbatches=2))
        _load_hf(L, hf_dir)
        old = [[x + 0.01 for x in lp] for lp in L.forward_logprobs(samples)]
        m = L.forward_backward(samples, old)
        runs[mtp] = (m["loss"], L.full_grads(),
                     sum(1 for n, _ in L.chunks[0].named_parameters() if n.startswith("mtp.")))
        L.shutdown()
    (l0, g0, n0), (l1, g1, n1) = runs[False], runs[True]
    return {"learner_mtp_params": [n0, n1], "learner_loss": [l0, l1],
            "learner_gspo_equal": l0 == l1 and set(g0) <= set(g1)
            and all(torch.equal(g0[k], g1[k]) for k in g0),
            # full_grads lists the frozen MTP weights too: gradient zero
            "learner_mtp_grads_zero": all(k.startswith("mtp.") and not g1[k].any()
                                          for k in set(g1) - set(g0))}


def main(work: Path) -> None:
    from megatron_gspo.convert import get_adapter
    from megatron_gspo.convert.hf_io import HFCheckpointReader
    from megatron_gspo.megatron.io import dist_checkpoint as cio
    from megatron_gspo.megatron.models.mtp_block import mtp_logits
    from megatron_gspo.megatron.parallel import ParallelLayout, initialize
    from tests.convert.tiny_mtp import make_mtp_checkpoint

    out = {}
    for arch in sys.argv[2].split(","):
        hf_dir = work / arch
        make_mtp_checkpoint(arch, hf_dir)
        reader = HFCheckpointReader(hf_dir)
        cfg = cio.normalize_hf_config(reader.config)
        adapter = get_adapter(cfg)
        initialize(ParallelLayout(), hf_config=cfg)
        vocab = cfg["vocab_size"]
        tokens = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(3))
        pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        res = {}
        runs = {}
        for with_mtp in (False, True):
            torch.manual_seed(0)
            (model,) = cio.build_rank_models(cfg, perform_initialization=False, mtp=with_mtp)
            n = cio.load_hf_weights([model], reader, adapter, adapter.dims(cfg))
            lp = _logprob_sum(model(tokens, pos, None), tokens, vocab)
            lp.sum().backward()
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
            if not with_mtp:  # the config declares the MTP layer, the model has none
                from megatron_gspo.megatron.io.weight_export import export_hf_weights

                p = f"model.layers.{cfg['num_hidden_layers']}."
                names = {k for b in export_hf_weights([model], cfg, bucket_bytes=1 << 20)
                         for k, _ in b}
                res["no_mtp_export_is_the_main_model"] = names == {
                    k for k in reader.keys() if not k.startswith(p)}
            runs[with_mtp] = (lp.detach(), grads, n, model)
        (lp0, g0, n0, _), (lp1, g1, n1, model) = runs[False], runs[True]
        res["params_loaded"] = [n0, n1]
        res["mtp_params"] = sum(1 for k, _ in model.named_parameters() if k.startswith("mtp."))
        res["mtp_trainable"] = sum(1 for k, p in model.named_parameters()
                                   if k.startswith("mtp.") and p.requires_grad)
        res["logprobs_equal"] = bool(torch.equal(lp0, lp1))
        res["grad_names_equal"] = sorted(g0) == sorted(g1)
        res["grads_equal"] = res["grad_names_equal"] and all(torch.equal(g0[k], g1[k]) for k in g0)
        from megatron_gspo.megatron.io.weight_export import export_hf_weights

        sent = {k: t for b in export_hf_weights([model], cfg, bucket_bytes=1 << 20) for k, t in b}
        res["export_names_equal_checkpoint"] = sorted(sent) == sorted(reader.keys())
        res["export_bit_exact"] = all(torch.equal(sent[k], reader.get(k)) for k in sent)
        draft = {k for b in export_hf_weights([model], cfg, bucket_bytes=1 << 20, only_mtp=True)
                 for k, _ in b}
        p = f"model.layers.{cfg['num_hidden_layers']}."
        res["draft_export_is_the_mtp_layer"] = draft == {
            k for k in reader.keys() if k.startswith(p) and "embed_tokens" not in k
            and "shared_head.head" not in k}
        model.eval()
        with torch.no_grad():
            (mine,) = mtp_logits(model, tokens, pos)  # [B, S, V_pad]
        ref = reference_mtp_logits(arch, hf_dir, tokens)  # [B, S-1, V]
        res["mtp_vs_reference"] = float((mine[:, :-1, :vocab] - ref).abs().max())
        res["ref_scale"] = float(ref.abs().max())
        out[arch] = res
        from megatron_gspo.megatron.parallel import shutdown

        shutdown()
        res.update(learner_gspo_with_and_without_mtp(hf_dir))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
