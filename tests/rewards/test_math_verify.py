"""The `math` rewards with math-verify: LaTeX equivalence, intervals, radicals, wrong answers,
and a hanging comparison cut at its time limit (also off the main thread)."""

import sys
import threading
import time

import pytest

from megatron_gspo.rewards import get_reward_fn
from megatron_gspo.rewards.verifier import MathVerifier, default_verifier

HANG = r"\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate the tower when comparing with 1


@pytest.mark.parametrize("response,label,reward", [
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"so \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"the set is \boxed{(1,2]}", "(1,2]", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\sqrt{8}}", r"The length is \boxed{2\sqrt{2}}.", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0),
    # wrong ones
    (r"\boxed{(1,2)}", "(1,2]", 0.0),
    (r"\boxed{[1,2]}", "(1,2]", 0.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{8}", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    (r"\boxed{x^2+1}", "(x+1)^2", 0.0),
    (r"no answer at all", r"\sqrt{8}", 0.0),
    # kept rule-based extraction: percent as datasets write it, GSM8K labels, last number
    (r"\boxed{50\%}", "50", 1.0),
    ("so 1,000 in total", "Step... #### 1000", 1.0),
    # lenient: math-verify finds the answer in unboxed text
    (r"The final answer is $\frac{3}{4}$.", "0.75", 1.0),
])
def test_math_reward_with_math_verify(response, label, reward):
    assert get_reward_fn("math")(response, label, {}) == reward


def test_strict_reward_uses_math_verify_inside_the_box():
    fn = get_reward_fn("math_boxed_strict")
    assert fn(r"\boxed{2\sqrt{2}}", r"\sqrt{8}", {}) == 1.0
    assert fn(r"The final answer is $2\sqrt{2}$", r"\sqrt{8}", {}) == 0.0  # no box


def test_rules_only_without_math_verify():
    fn = get_reward_fn("math")
    assert fn(r"\boxed{2\sqrt{2}}", r"\sqrt{8}", {}, timeout_s=None) == 0.0
    assert fn(r"\boxed{0.5}", "1/2", {}, timeout_s=None) == 1.0


def test_hanging_comparison_is_cut_at_its_limit():
    v = MathVerifier()
    try:
        assert v.verify("$1$", "$1$", timeout_s=30.0)  # worker started and warm
        t = time.monotonic()
        assert v.verify("$1$", HANG, timeout_s=1.0) is False
        took = time.monotonic() - t
        assert 1.0 <= took < 3.0, took
        assert v.timeouts == 1
        assert v.verify(r"$\frac{1}{2}$", "$0.5$", timeout_s=30.0)  # a fresh worker
    finally:
        v.close()


def test_reward_with_a_hang_is_zero_and_the_next_one_still_works():
    fn = get_reward_fn("math")
    before = default_verifier().timeouts
    t = time.monotonic()
    assert fn(HANG, "1", {}, timeout_s=1.0) == 0.0
    assert time.monotonic() - t < 3.0 + 30.0  # start-up of the worker plus the limit
    assert default_verifier().timeouts == before + 1
    assert fn(r"\boxed{2\sqrt{2}}", r"\sqrt{8}", {}) == 1.0


def test_limit_works_off_the_main_thread():
    v = MathVerifier()
    out = {}

    def work():
        out["ok"] = v.verify(r"$\sqrt{8}$", r"$2\sqrt{2}$", timeout_s=30.0)
        t = time.monotonic()
        out["hang"] = v.verify("$1$", HANG, timeout_s=1.0)
        out["took"] = time.monotonic() - t

    try:
        th = threading.Thread(target=work)
        th.start()
        th.join(120)
        assert out == {"ok": True, "hang": False, "took": pytest.approx(out["took"])}
        assert 1.0 <= out["took"] < 3.0 and v.timeouts == 1
    finally:
        v.close()


def test_bad_limit_is_refused():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        MathVerifier().verify("1", "1", timeout_s=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and prctl")
def test_worker_dies_with_a_killed_parent_even_mid_comparison(tmp_path):
    import os
    import signal
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("from megatron_gspo.rewards.verifier import MathVerifier\n"
            "v = MathVerifier(); assert v.verify('$1$', '$1$', 60)\n"
            "print(v._proc.pid, flush=True)\n"
            f"v.verify('$1$', {HANG!r}, 600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE,
                            text=True)
    worker = int(proc.stdout.readline())
    time.sleep(0.5)  # the worker is now inside the comparison
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()

    def alive():
        try:
            stat = Path(f"/proc/{worker}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    still = alive()
    if still:
        os.kill(worker, signal.SIGKILL)
    assert not still, "the math-verify worker outlived its killed parent"


def test_right_answers_whatever_thread_asks():
    """A thread per request (ThreadingHTTPServer): the worker outlives the thread that
    started it, so no comparison meets a dying worker."""
    v = MathVerifier()
    results = []

    def ask(i):
        results.append(v.verify(r"$\frac{1}{2}$", f"{i % 2 + 0.5 - i % 2}", timeout_s=30.0))

    try:
        for i in range(12):
            t = threading.Thread(target=ask, args=(i,))
            t.start()
            t.join()
            time.sleep(0.05)  # the starting thread is gone before the next question
        assert results == [True] * 12 and v.crashes == 0 and v.timeouts == 0
    finally:
        v.close()
