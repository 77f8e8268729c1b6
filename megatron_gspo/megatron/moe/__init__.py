"""MoE routing on the learner: routing replay R2 / R3 and routing metrics (router_replay), and the
data-parallel exchange of routing records (routing_exchange)."""
