"""Records which top-level modules a Python process imported, for scripts/gpu_checks.sh
(`GPU_CHECKS_RECORD_IMPORTS=DIR`): at exit, also at `os._exit` (the learner check's workers
end that way), the names in sys.modules go to DIR/<GPU_CHECKS_STAGE>.<pid>.txt, one a line.
On PYTHONPATH only while recording; `scripts/gpu_kit.py imports` reads the files."""

import atexit
import os
import sys

_DIR = os.environ.get("GPU_CHECKS_RECORD_IMPORTS")


def _dump() -> None:
    names = sorted({m.split(".", 1)[0] for m in list(sys.modules) if m and not m.startswith("_")})
    stage = os.environ["GPU_CHECKS_STAGE"]
    try:
        with open(os.path.join(_DIR, f"{stage}.{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(names) + "\n")
    except OSError:
        pass


if _DIR and os.environ.get("GPU_CHECKS_STAGE"):  # the stages' processes only
    atexit.register(_dump)
    _exit = os._exit

    def _exit_recorded(code):
        _dump()
        _exit(code)

    os._exit = _exit_recorded
