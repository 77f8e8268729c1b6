"""Shared fixtures for rollout tests: a tiny Qwen3 model, an embedded engine, a stand-in server."""

from __future__ import annotations

import pytest
import torch

TINY = dict(
    model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    max_position_embeddings=256, eos_token_id=1, tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def tiny_config() -> dict:
    return dict(TINY)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_config):
    """A saved tiny HF model directory (config.json + model.safetensors)."""
    from megatron_gspo.rollout.embedded import build_hf_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen3")
    build_hf_model(tiny_config).save_pretrained(path)
    return str(path)


@pytest.fixture()
def engine(tiny_model_dir):
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(tiny_model_dir, seed=123)


@pytest.fixture()
def standin(engine):
    """A stand-in SGLang server in a thread, backed by `engine`."""
    from megatron_gspo.rollout.standin.server import StandinServer

    srv = StandinServer(engine, model_path="tiny").start_in_thread()
    yield srv
    srv.stop_thread()


@pytest.fixture()
def client(standin):
    from megatron_gspo.rollout.sglang.client import SGLangEngine

    eng = SGLangEngine(server_urls=[standin.url], backoff_s=0.01, request_timeout_s=30)
    yield eng
    eng.shutdown()
