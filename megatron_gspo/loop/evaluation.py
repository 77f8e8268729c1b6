"""Evaluation on one or more named prompt sets: mean@n and pass@k.

Each prompt of a set gets `train.eval_samples` (n) responses (greedy when n = 1 and
`train.eval_temperature` is 0), scored with the run's reward (or, in agent mode, played as
episodes). Per set the metrics are:

- `reward_mean`: the mean reward over all scored responses; `prompts`;
- `mean@n`: per prompt the mean reward of its n responses, averaged over the prompts;
- `pass@k` for each k of `train.eval_pass_k`: the unbiased estimator of Chen et al. 2021
  (arXiv 2107.03374), pass@k = 1 - C(n-c, k) / C(n, k) with c the responses whose reward
  reaches `train.eval_pass_threshold`, averaged over the prompts;
- `samples_failed`: responses the engine failed on (metadata "rollout_error"); they are left
  out (a prompt with n' < n usable responses is estimated from those n'; prompts with fewer than
  k usable responses are left out of pass@k), so one failed request never ends the run.

The set of `data.eval_path` reports under `eval/`, a set of `data.eval_sets` under
`eval/<name>/`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from megatron_gspo.data.sample import Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which never forms the binomials (no
    overflow for large n).

    Args:
        n: responses sampled for the prompt.
        c: correct responses among them (0 <= c <= n).
        k: the k of pass@k (1 <= k <= n).
    Returns:
        the probability that at least one of k responses drawn without replacement is correct.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def default_ks(n: int) -> list[int]:
    """Powers of two up to n, and n itself: 1, 2, 4, ..., n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def set_metrics(rewards: Sequence[Sequence[float]], n: int, ks: Sequence[int],
                threshold: float) -> dict[str, float]:
    """mean@n and pass@k of one eval set from the rewards of each prompt's responses.

    Args:
        rewards: per prompt, the rewards of its usable responses (at most n).
        n: responses asked per prompt (names the mean@n metric).
        ks: the k values of pass@k (each <= n).
        threshold: a response is correct when its reward >= threshold.
    Returns:
        {"mean@n", "pass@k" for each k}; prompts without responses are left out, and a metric
        no prompt has enough responses for is left out of the dict.
    """
    rows = [list(map(float, r)) for r in rewards if len(r)]
    out: dict[str, float] = {}
    if rows:
        out[f"mean@{n}"] = sum(sum(r) / len(r) for r in rows) / len(rows)
    for k in ks:
        vals = [pass_at_k(len(r), sum(x >= threshold for x in r), k) for r in rows if len(r) >= k]
        if vals:
            out[f"pass@{k}"] = sum(vals) / len(vals)
    return out


def _requests(prompts):
    from megatron_gspo.rollout.engine import GenerateRequest

    for item in prompts:
        yield GenerateRequest(prompt_ids=list(item.prompt_ids), prompt=item.prompt,
                              label=item.label, metadata={"row": item.row})


def _generate(cfg: Any, engine: Any, tok: Any, score, prompts, n: int) -> tuple[list[Sample],
                                                                                dict]:
    """n scored responses per prompt (group_index = prompt position) and extra metrics."""
    from megatron_gspo.rollout.engine import SamplingParams

    if cfg.agent.enabled:
        from megatron_gspo.agent.loop import make_runner
        from megatron_gspo.agent.runner import episode_metrics

        items = [{**r.metadata, "prompt": r.prompt, "label": r.label}
                 for r in _requests(prompts)]  # the environment's view of a prompt
        runner = make_runner(cfg, engine, tok, temperature=cfg.train.eval_temperature)
        samples = runner.run_batch_sync(items, n_per_prompt=n)
        return samples, episode_metrics(samples)
    sp = replace(SamplingParams.for_rollouts(cfg.rollout, tok), n=n,
                 temperature=cfg.train.eval_temperature)
    reqs = [replace(r, sampling=sp, group_index=i) for i, r in enumerate(_requests(prompts))]
    samples = engine.generate(reqs)
    score(samples)
    return samples, {}


def evaluate_set(cfg: Any, engine: Any, tok: Any, score, prompts: Sequence[Any],
                 prefix: str) -> dict[str, float]:
    """The metrics of one eval set (module docstring), keys prefixed `prefix/`.

    Args:
        cfg: the run Config (train.eval_*, agent.*, rollout sampling).
        engine: the rollout engine.
        tok: the tokenizer.
        score: fills `reward` of the samples it is given (unused in agent mode).
        prompts: the set's PromptItems.
        prefix: "eval" or "eval/<name>".
    """
    t = cfg.train
    n = t.eval_samples
    ks = sorted(set(t.eval_pass_k)) if t.eval_pass_k else default_ks(n)
    samples, extra = _generate(cfg, engine, tok, score, prompts, n)
    per_prompt: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    failed = 0
    for s in samples:
        if "rollout_error" in s.metadata or s.reward is None:
            failed += 1
            continue
        per_prompt.setdefault(s.group_index, []).append(float(s.reward))
    usable = [r for r in per_prompt.values() if r]
    flat = [x for r in usable for x in r]
    out = {"reward_mean": sum(flat) / len(flat)} if flat else {}  # none if every one failed
    out.update(prompts=float(len(prompts)), **set_metrics(usable, n, ks, t.eval_pass_threshold))
    if failed:
        out["samples_failed"] = float(failed)
    out.update(extra)
    if "agent/reward" in extra:  # the same number, as agent-mode evaluation always reported
        out["reward_mean"] = extra["agent/reward"]
    return {f"{prefix}/{k}": v for k, v in out.items()}


def evaluate(cfg: Any, engine: Any, tok: Any, score, sets) -> dict[str, float]:
    """All eval sets: `sets` maps a set name to its prompts ("" = `data.eval_path`, reported
    under `eval/`; others under `eval/<name>/`); a plain list is the `eval/` set."""
    if sets is None:
        return {}
    if not isinstance(sets, dict):
        sets = {"": sets}
    out: dict[str, float] = {}
    for name, prompts in sets.items():
        if prompts:
            out.update(evaluate_set(cfg, engine, tok, score, prompts,
                                    f"eval/{name}" if name else "eval"))
    return out
