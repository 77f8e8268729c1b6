"""Runs in its own process (the learner starts torch.distributed): a short colocated GSPO run
against a stand-in SGLang server (no CPU weight backup, so every release loses the weights)
through `train.run`; prints one JSON line for tests/rollout/test_colocated_sync.py."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def tiny_model(d: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(ROOT / "examples" / "tiny"))
    from task import VOCAB_SIZE, build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    hc = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                     eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                     pad_token_id=tok.pad_token_id)
    Qwen3ForCausalLM(hc).save_pretrained(d)
    tok.save_pretrained(d)


def main(work: str, bucket_bytes: int) -> None:
    from megatron_gspo.loop import train
    from megatron_gspo.config import load_config
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.standin.server import StandinServer

    model = Path(work) / "model"
    tiny_model(model)
    srv = StandinServer(EmbeddedEngine(str(model), dtype="float32", seed=3),
                        model_path=str(model)).start_in_thread()
    try:
        cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", [
            f"model.path={model}", "rollout.engine=sglang", f"rollout.server_urls=[{srv.url}]",
            "rollout.colocate=true", f"rollout.bucket_bytes={bucket_bytes}",
            "train.max_steps=2", "train.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=4", "algorithm.mini_batches=1", "train.eval_interval=0",
            "checkpoint.interval=0", "logging.tensorboard=false", "logging.progress_bar=false",
            "logging.log_samples=0"])
        run_dir = train.run(cfg, str(Path(work) / "run"))
        out = {"run_dir": str(run_dir), "memory_log": srv.memory_log,
               "lost_weights": sorted(srv.lost_weights), "weight_version": srv.weight_version,
               "tensor_bytes": {k: v.numel() * v.element_size()
                                for k, v in srv.engine.model.state_dict().items()}}
    finally:
        srv.stop_thread()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
