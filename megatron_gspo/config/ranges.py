"""Cross-field rules of `Config.validate` that keep settings inside what the math and the
services can use, so that a setting which would overflow, never act or never connect is a
one-line ConfigError naming its field instead of a traceback (or a silent no-op) mid-run:

- the clip range against `algorithm.logratio_bound`: ratios are bounded to
  exp(+-logratio_bound) before the clip, so a clip beyond that never binds (and 1 + 1e308 does
  not even convert to float32);
- `precision.correction` runs on the steps whose learner log-probs are computed (see the
  field's help); a correction no step would run is refused;
- `reward.url` is a URL an HTTP client can connect to (scheme, host, port).
"""

from __future__ import annotations

import math
from urllib.parse import urlsplit

from megatron_gspo.config.schema import ConfigError
from megatron_gspo.config.yaml_strict import brief

__all__ = ["check_ranges", "url_problem"]


def check_ranges(cfg) -> None:
    """The rules of the module docstring on a Config; raises ConfigError naming the field."""
    _check_clip(cfg.algorithm)
    _check_correction(cfg.precision)
    if cfg.reward.url is not None:
        problem = url_problem(cfg.reward.url)
        if problem:
            raise ConfigError(f"reward.url: {problem}")


def _check_clip(a) -> None:
    """The clip range lies inside the ratio bound (log space for GMPO, ratio space else)."""
    if a.loss == "sapo":  # no clip
        return
    lo, hi = a.clip_range()
    b = a.logratio_bound
    if a.loss == "gmpo":
        for name, eps in (("eps_low", lo), ("eps_high", hi)):
            if eps > b:
                raise ConfigError(
                    f"algorithm.{name}: {eps:g} (GMPO, log space) is wider than "
                    f"algorithm.logratio_bound={b:g}, which bounds every log-ratio first, so "
                    f"it never clips; use at most {b:g}")
        return
    if math.log1p(hi) > b:
        raise ConfigError(
            f"algorithm.eps_high: the upper clip 1 + {hi:g} lies beyond exp(algorithm."
            f"logratio_bound={b:g}), the largest ratio after the bound, so it never clips; use "
            f"at most {math.expm1(b):.6g}")


def _check_correction(p) -> None:
    """A correction some step runs: learner log-probs exist on audited steps when reusing the
    engine's, on every step with `old_logprobs: recompute`."""
    if p.correction != "none" and p.audit_fraction == 0 and p.old_logprobs != "recompute":
        raise ConfigError(
            f"precision.correction: {p.correction!r} runs only on steps with learner log-probs, "
            f"and with precision.old_logprobs={p.old_logprobs!r} and precision.audit_fraction=0 "
            "no step has them, so it would never run; set audit_fraction > 0 (1: every step) or "
            "old_logprobs=recompute, or drop the correction")


def url_problem(url: str) -> str | None:
    """Why an http(s) URL cannot be connected to (no scheme, host or valid port), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a port out of range or not a number
    except ValueError as e:  # e.g. an unclosed '[' of an IPv6 address
        return f"{brief(url)} is not a usable URL ({str(e)[:100]})"
    if parts.scheme not in ("http", "https"):
        return f"expected an http:// or https:// URL, got {brief(url)}"
    host = parts.hostname
    if not host or any(c.isspace() for c in host):
        return f"{brief(url)} has no usable host name"
    if port == 0:
        return f"{brief(url)}: port 0 cannot be connected to; expected 1-65535"
    return None
