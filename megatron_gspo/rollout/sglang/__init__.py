"""SGLang as the rollout engine: `client` (the engine: an async HTTP client of launched or
attached servers, retries, per-sample failures), `launch` (server and router command lines and
processes), `lifecycle` (server lifecycle: health, `/server_info` checks), `protocol` (SGLang
0.5.12's HTTP rules, shared with the stand-in server) and `weight_sync_endpoints`
(pause/continue, tensor,
disk and distributed weight updates, memory release), `versions` (what differs between the
supported SGLang releases, 0.5.12 through 0.5.23)."""
