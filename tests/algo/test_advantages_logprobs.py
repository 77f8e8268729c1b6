"""Group advantages and chunked token log-probs."""

import subprocess
import sys

import pytest
import torch

from megatron_gspo.algo.advantages import group_advantages, zero_variance_groups
from megatron_gspo.algo.logprobs import token_logprobs


def test_group_advantages_std_and_none():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = group_advantages(r, 4)
    g0 = r[:4]
    expect = (g0 - g0.mean()) / (g0.std(unbiased=True) + 1e-6)
    assert torch.allclose(a[:4], expect)
    assert torch.all(a[4:] == 0)  # zero-variance group -> zero advantages, no NaN
    assert torch.allclose(group_advantages(r, 4, scale="none")[:4], g0 - 0.5)
    assert torch.all(group_advantages(torch.tensor([3.0, 1.0]), 1) == 0)
    assert zero_variance_groups(r, 4).tolist() == [False, True]
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(r, 4, scale="max")


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_token_logprobs_equal_log_softmax_gather_float64(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 97, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    targets = torch.randint(0, 97, (3, 7), generator=g)
    ours, ent = token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk,
                               return_entropy=True)
    ls = torch.log_softmax(logits / temperature, -1)
    ref = ls.gather(-1, targets[..., None]).squeeze(-1)
    assert ours.dtype == torch.float64
    assert torch.allclose(ours, ref, atol=1e-12, rtol=1e-12)
    ref_ent = -(ls.exp() * ls).sum(-1)
    assert torch.allclose(ent, ref_ent.detach(), atol=1e-10)
    w = torch.randn(3, 7, generator=g, dtype=torch.float64)
    (g1,) = torch.autograd.grad((ours * w).sum(), logits)
    (g2,) = torch.autograd.grad((ref * w).sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-12, rtol=1e-10)


def test_token_logprobs_bfloat16_logits():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 64, (2, 5), generator=g)
    ours = token_logprobs(logits, targets, chunk_size=3)
    assert ours.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(ours, ref, atol=1e-6)
    (gr,) = torch.autograd.grad(ours.sum(), logits)
    assert gr.dtype == torch.bfloat16 and torch.isfinite(gr.float()).all()


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="target ids"):
        token_logprobs(torch.zeros(2, 4), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))


def test_algo_imports_without_megatron_sglang_transformers():
    code = (
        "import sys\n"
        "import megatron_gspo.algo.losses, megatron_gspo.algo.advantages, "
        "megatron_gspo.algo.logprobs\n"
        "import megatron_gspo.algo as A, pkgutil, importlib\n"
        "for m in pkgutil.iter_modules(A.__path__):\n"
        "    importlib.import_module('megatron_gspo.algo.' + m.name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('megatron', 'sglang', 'transformers', 'transformer_engine', 'apex')]\n"
        "assert not bad, bad\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout
