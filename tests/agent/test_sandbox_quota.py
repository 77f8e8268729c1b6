"""The sandbox's temp dir has a byte quota per call (`max_disk_mb`): a call writing past it
fails with a message naming the quota, other calls are unaffected, and concurrent calls hold at
most their own quota each."""

import asyncio

import pytest

from megatron_gspo.agent.tools import ToolError
from megatron_gspo.agent.tools.python_sandbox import PythonSandbox, isolation_prefix

MB = 1024 * 1024
# writes 1 MiB files up to `total` MiB; reports how far it got
_WRITE = (
    "import os\nn = 0\n"
    "try:\n"
    "    for i in range({total}):\n"
    "        with open('f%d' % i, 'wb') as f:\n"
    "            f.write(b'x' * (1024 * 1024))\n"
    "        n += 1\n"
    "finally:\n"
    "    print('wrote', n, flush=True)\n"
)

MODES = ["tmpfs", "budget"]


def _sandbox(mode: str, **kw) -> PythonSandbox:
    if mode == "tmpfs" and "--mount-proc" not in isolation_prefix():
        pytest.skip("no mount namespace here")
    return PythonSandbox(cpu_seconds=5, wall_timeout_s=20, max_disk_mb=4,
                         isolate_network=mode == "tmpfs", **kw)


@pytest.mark.parametrize("mode", MODES)
def test_call_past_the_quota_fails_and_others_do_not(mode):
    sb = _sandbox(mode)

    async def both():
        return await asyncio.gather(sb({"code": _WRITE.format(total=12)}),
                                    sb({"code": _WRITE.format(total=2)}),
                                    return_exceptions=True)

    big, small = asyncio.run(both())
    assert isinstance(big, ToolError), big
    assert "more than the 4 MiB its working directory may hold" in str(big)
    assert small == "wrote 2"


def test_three_concurrent_calls_hold_their_own_quota_each():
    sb = _sandbox("tmpfs")

    async def three():
        return await asyncio.gather(*(sb.run(_WRITE.format(total=12)) for _ in range(3)))

    wrote = []
    for _rc, out, err, _ in asyncio.run(three()):
        assert "No space left on device" in err, err
        wrote.append(int(out.split()[-1]))
    assert all(n <= 4 for n in wrote) and sum(wrote) <= 3 * 4, wrote
    assert all(n >= 3 for n in wrote), wrote  # each got (nearly) its whole quota
