"""Test and bench equipment: stand-ins for SGLang's HTTP server (`server`, with its generation
side in `generate` and its weights and memory side in `weight_sync_server`) and for sglang-router
(`router`), backed by the embedded engine. They follow SGLang 0.5.12's rules
(`rollout.sglang.protocol`), refusals and crashes included, so the client is tested against the
real server's behaviour where the real server cannot run."""
