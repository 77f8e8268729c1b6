"""Old module path of `megatron_gspo.rollout.standin.server`, kept for command lines:
`python -m megatron_gspo.rollout.standin_server ...` runs the new module (with a one-line note on
stderr); importing this path is an error that names the new one."""
import runpy
import sys

NEW = "megatron_gspo.rollout.standin.server"
if __name__ != "__main__":
    raise ImportError(f"{__name__} moved to {NEW}: import that instead")
print(f"note: megatron_gspo.rollout.standin_server moved to {NEW}", file=sys.stderr)
runpy.run_module(NEW, run_name="__main__", alter_sys=True)
