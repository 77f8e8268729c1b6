"""Old module path of the precision audit of stale samples, now `megatron_gspo.loop.stale_audit`
(a phase of the loop, beside the other pi_old code); importing this path is an error that names
the new one."""

raise ImportError(f"{__name__} moved to megatron_gspo.loop.stale_audit: import that instead")
