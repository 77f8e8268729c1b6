"""SGLang servers on the learner's GPUs: `node_servers` (colocated servers on every node of a job,
launched by each node's leader), `colocated` (weight sync into servers sharing the learner's
GPUs, in SGLang's memory order) and `weight_sync_nodes` (the same with servers on every node,
all nodes at
once, each fed by the learner ranks of its own node)."""
