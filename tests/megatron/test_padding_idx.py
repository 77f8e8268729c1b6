"""transformers' `padding_idx` on Megatron-Core's word embedding (`megatron/models/padding_idx.py`):
the embedding gradient of the same tokens, with the pad token inside the sequence, equals
transformers' with untied (Qwen3) and tied (Qwen2) embeddings; without the hook the pad row's
gradient is about 1,000 times the largest of transformers' (the first RMSNorm of the zero pad
vector). Under sequence parallelism the hook cuts the rank's slice of the sequence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from megatron_gspo.megatron.models.padding_idx import keep_pad_row_frozen, pad_id_of

ROOT = Path(__file__).resolve().parents[2]


def test_embedding_gradient_equals_transformers_with_pad_tokens_in_the_sequence(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_padding_idx_worker.py")),
                          str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    for arch, r in res.items():
        assert r["pad_row_weight"] == 0.0, arch  # transformers zero-initialises the pad row
        assert r["max_diff"] < 1e-5 * max(1.0, r["scale"]), (arch, r)
    assert res["Qwen3ForCausalLM"]["pad_row_mine"] == 0.0  # untied: lookups only
    assert res["Qwen2ForCausalLM"]["pad_row_mine"] > 0.0  # tied: the output layer's part stays


class _ScatteredEmbedding(torch.nn.Module):
    """Stands in for a VocabParallelEmbedding with `reduce_scatter_embeddings` (sequence
    parallel): returns this rank's [s / tp, b, h] slice of a fixed [s, b, h] output."""

    def __init__(self, full: torch.Tensor, tp: int, rank: int):
        super().__init__()
        self.full, self.reduce_scatter_embeddings = full, True
        self.tp_group = type("G", (), {"size": lambda _: tp, "rank": lambda _: rank})()

    def forward(self, ids):
        return self.full.chunk(self.tp_group.size(), dim=0)[self.tp_group.rank()]


def test_sequence_parallel_slice_detaches_the_rank_s_pad_positions():
    ids = torch.tensor([[1, 5, 2, 3], [5, 4, 4, 5]])  # [b=2, s=4], pad 5
    for rank in (0, 1):
        full = torch.randn(4, 2, 3, requires_grad=True)  # [s, b, h]
        emb = _ScatteredEmbedding(full, tp=2, rank=rank)
        keep_pad_row_frozen(emb, 5)
        emb(ids).sum().backward()
        rows = full.grad.abs().sum(-1)  # [s, b]: 0 where no gradient came back
        mine = ids.t().chunk(2, dim=0)[rank]  # [s/2, b] this rank's positions
        got = rows.chunk(2, dim=0)[rank]
        assert torch.equal(got == 0, mine == 5), (rank, got, mine)


def test_pad_id_of():
    assert pad_id_of({"pad_token_id": 3}, 10) == 3
    assert pad_id_of({"pad_token_id": None}, 10) is None
    assert pad_id_of({}, 10) is None
    assert pad_id_of({"pad_token_id": 12}, 10) is None  # out of the vocabulary
    assert pad_id_of({"pad_token_id": [1, 2]}, 10) is None
