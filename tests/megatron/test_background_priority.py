"""Checkpoint work beside training runs at the lowest CPU priority (megatron/io/child_procs.py):
processes forked inside `background_children` (Megatron's checkpoint writer) and the thread
that calls `lower_priority()` (the publish thread) get nice 19; the trainer's own threads and
its other forks keep theirs."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading

import pytest

from megatron_gspo.megatron.io.child_procs import (BACKGROUND_NICE, background_children,
                                                   lower_priority, tie_forked_children)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def _report(q):
    q.put(os.getpriority(os.PRIO_PROCESS, 0))


def _child_nice(background: bool) -> int:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_report, args=(q,))
    if background:
        with background_children():
            p.start()
    else:
        p.start()
    out = q.get(timeout=60)
    p.join(timeout=60)
    return out


def test_writer_forks_and_publish_thread_yield_to_training():
    tie_forked_children()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert mine < BACKGROUND_NICE  # (a run at nice 19 already would prove nothing)
    assert _child_nice(background=True) == BACKGROUND_NICE
    assert _child_nice(background=False) == mine  # other forks: unchanged

    seen = {}

    def publish():
        lower_priority()
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=publish)
    t.start()
    t.join()
    assert seen["thread"] == BACKGROUND_NICE
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the training thread keeps its priority
