"""One process (gloo, rank 0 of 1) run by tests/megatron/test_async_save_nvrx.py with a release of
nvidia-resiliency-ext on PYTHONPATH: megatron.core imported after this package (or the one-line
refusal), then a real asynchronous checkpoint (Learner + Checkpointer + AsyncSaves), waited for,
closed and loaded back; then `AsyncSaves.close` on the release's own `AsyncCallsQueue`.
Writes the report to argv[2]/report.json.
"""

from __future__ import annotations

import inspect
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DENSE = dict(architectures=["Qwen3ForCausalLM"], hidden_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=64, num_hidden_layers=2,
             vocab_size=100, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
             hidden_act="silu", max_position_embeddings=256)


def save_and_close(out: Path) -> dict:
    """A real asynchronous save of a tiny learner, then wait, close, verify and load back."""
    import torch

    from megatron_gspo.data.sample import Sample
    from megatron_gspo.megatron import compat
    from megatron_gspo.megatron.io.async_save import AsyncSaves
    from megatron_gspo.megatron.learner import BatchSettings, Learner
    from megatron_gspo.megatron.optimizer import OptimSettings
    from megatron_gspo.runtime.run_checkpoint import Checkpointer, verify

    learner = Learner(DENSE, optim=OptimSettings(lr=1e-3),
                      batching=BatchSettings(num_microbatches=1), seed=7)
    samples = [Sample(prompt_ids=[1, 2, 3], response_ids=[4 + i, 5, 6], loss_mask=[1, 1, 1],
                      index=i, advantage=0.5 - i) for i in range(2)]
    old = learner.forward_logprobs(samples)
    learner.forward_backward(samples, old)
    learner.optimizer_step()  # the optimizer's state exists, as in every run's checkpoint
    saved = learner.full_state_dict()
    saves = AsyncSaves()
    ckpt = Checkpointer(out / "checkpoints")
    ckpt.save(1, learner, {"step": 1}, queue=saves)
    finalized = saves.wait()
    saves.close()
    step, path = ckpt.latest()
    problem = verify(path)
    learner.load_full_state_dict({k: torch.zeros_like(v) for k, v in saved.items()})
    learner.load_checkpoint(str(path / "model"))
    loaded = learner.full_state_dict()
    same = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k])
                                                   for k in saved)
    report = {"kwargs": saves.kwargs, "queue": type(saves.queue).__module__,
              "finalized": finalized, "step": step, "verify": problem, "reloaded_equal": same}
    if compat.version() >= (0, 17, 0):
        from megatron.core.dist_checkpointing.strategies import torch as strategies

        report["mcore_have_nvrx"] = strategies.HAVE_NVRX
    learner.shutdown()
    return report


def close_nvrx_queue() -> dict:
    """`AsyncSaves.close` on this release's own AsyncCallsQueue (None where it has none)."""
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
    except ImportError as e:
        return {"queue": None, "why": str(e)}
    from megatron_gspo.megatron.io.async_save import AsyncSaves

    saves = AsyncSaves.__new__(AsyncSaves)  # only the queue: close() needs no megatron.core
    saves._publisher = None
    takes = inspect.signature(AsyncCallsQueue.__init__).parameters  # 0.2.x: no `persistent`
    saves.queue = AsyncCallsQueue(**({"persistent": False} if "persistent" in takes else {}))
    try:
        saves.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"queue": "nvrx", "error": f"{type(e).__name__}: {e}"}
    return {"queue": "nvrx", "error": None}


def main() -> None:
    out = Path(sys.argv[1])
    report: dict = {}
    try:
        import megatron_gspo.megatron  # noqa: F401 - its import check comes first

        try:
            import megatron.core  # noqa: F401
        except Exception as e:  # noqa: BLE001 - reported to the test
            report["import_error"] = f"{type(e).__name__}: {e}"
        else:
            report["save"] = save_and_close(out)
        report["nvrx_close"] = close_nvrx_queue()
    except BaseException:  # noqa: BLE001 - the test prints it (torch's CheckpointException too)
        report["exception"] = traceback.format_exc()
    (out / "report.json").write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
