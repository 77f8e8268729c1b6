"""Benchmark: checkpoint conversion throughput vs a plain safetensors load + save.

Builds a ~0.5 GB random Qwen3 model with a small config (fp32), saves it as safetensors, then
times, in one process (TP=1 PP=1, gloo on CPU or NCCL on GPU):
  - baseline:    safetensors load_file + save_file of the same bytes;
  - hf-to-mcore: read HF tensors, fuse / pad into a GPTModel, write a torch_dist checkpoint;
  - export:      `export_hf_weights` of the loaded model (HF-named buckets, in memory);
  - mcore-to-hf: load the dist checkpoint, export, write sharded safetensors.
GB/s = model bytes / wall seconds. Prints one table.

    python bench/convert.py [--layers 6] [--hidden 1024] [--bucket-mb 256] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _make_model(out: Path, layers: int, hidden: int) -> int:
    import torch
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(cfg)
    sd = {k: torch.randn(v.shape) * 0.02 for k, v in model.state_dict().items()}
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(out)
    return sum(t.numel() * t.element_size() for t in sd.values())


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file, save_file

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    hf = work / "hf"
    try:
        nbytes = _make_model(hf, args.layers, args.hidden)
        rows = []

        def baseline():
            sd = load_file(hf / "model.safetensors")
            save_file(sd, str(work / "copy.safetensors"))

        rows.append(("safetensors load+save (baseline)", _timed(baseline)[0]))

        from megatron_gspo.convert import get_adapter
        from megatron_gspo.megatron.io import dist_checkpoint as cio
        from megatron_gspo.megatron.io.conversion import hf_to_mcore, mcore_to_hf
        from megatron_gspo.megatron.io.weight_export import export_hf_weights
        from megatron_gspo.megatron.parallel import ParallelLayout, initialize, shutdown

        import megatron.core.dist_checkpointing  # noqa: F401  (imports are not timed)
        import megatron.core.models.gpt  # noqa: F401

        from megatron_gspo.convert.hf_io import HFCheckpointReader, read_config

        os.environ.pop("MASTER_PORT", None)
        t, _ = _timed(lambda: hf_to_mcore(str(hf), str(work / "ck"), progress=False))
        rows.append(("hf-to-mcore (CLI body: init, build, load, save)", t))

        # the two halves of hf-to-mcore, on a warm process
        os.environ.pop("MASTER_PORT", None)
        cfg = read_config(hf)
        initialize(ParallelLayout(), hf_config=cfg)
        try:
            reader = HFCheckpointReader(hf)
            adapter = get_adapter(cfg)
            models = cio.build_rank_models(cfg, perform_initialization=False)
            t, _ = _timed(lambda: cio.load_hf_weights(models, reader, adapter, adapter.dims(cfg)))
            rows.append(("  read HF + fuse + shard into model", t))
            t, _ = _timed(lambda: cio.save_checkpoint(models, work / "ck2", metadata={}))
            rows.append(("  torch_dist save (2nd save in process)", t))
        finally:
            shutdown()

        os.environ.pop("MASTER_PORT", None)
        initialize(ParallelLayout(), hf_config=cfg)
        try:
            models = cio.build_rank_models(cfg, perform_initialization=False)
            cio.load_checkpoint(models, work / "ck")
            bound = args.bucket_mb * 2**20

            def export():
                n = 0
                for bucket in export_hf_weights(models, cfg, bucket_bytes=bound):
                    n += sum(t.numel() * t.element_size() for _, t in bucket)
                return n

            t, exported = _timed(export)
            assert exported == nbytes, (exported, nbytes)
            rows.append((f"export ({args.bucket_mb} MB buckets, in memory)", t))
        finally:
            shutdown()

        os.environ.pop("MASTER_PORT", None)
        t, _ = _timed(
            lambda: mcore_to_hf(str(work / "ck"), str(hf), str(work / "hf_out"), progress=False)
        )
        rows.append(("mcore-to-hf (load, export, write shards)", t))
        back = load_file(work / "hf_out" / "model-00001-of-00001.safetensors")
        ref = load_file(hf / "model.safetensors")
        assert all(torch.equal(back[k], ref[k]) for k in ref), "round trip not bit exact"

        dev = "cuda" if torch.cuda.is_available() else f"cpu x{os.cpu_count()}"
        print(
            f"\nmodel: Qwen3 {args.layers} layers, hidden {args.hidden}, "
            f"{nbytes / 1e9:.3f} GB fp32, device {dev}"
        )
        print(f"{'step':<52}{'seconds':>10}{'GB/s':>10}{'vs baseline':>13}")
        base = rows[0][1]
        for name, t in rows:
            print(f"{name:<52}{t:>10.2f}{nbytes / 1e9 / t:>10.2f}{base / t:>12.2f}x")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
