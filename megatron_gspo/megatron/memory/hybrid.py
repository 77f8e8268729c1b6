"""The memory plan of a hybrid linear-attention model (Qwen3.5 dense / MoE, Qwen3-Next): gated
delta-net layers (arXiv 2412.06464) beside gated full-attention layers, in the learner and in
SGLang. `megatron.memory.plan` calls this for the layers of a `Dims` with a `linear` pattern;
a dense transformer never reaches it.

Learner parameters per layer, as Megatron-Core 0.16.1 builds them under TP (the local spec of
`megatron.models.qwen3_next`; `ssm/gated_delta_net.py` `GatedDeltaNet.__init__`), with
qk = key heads x key dim, v = value heads x value dim, nv = value heads:
- delta-net layer: input norm [h]; in_proj [(2 qk + 2 v + 2 nv) / tp, h] (column-parallel:
  transformers' in_proj_qkvz + in_proj_ba, or Qwen3.5's in_proj_qkv / z / b / a); conv1d
  [(2 qk + v) / tp, 1, kernel] (depthwise, no bias); dt_bias and A_log [nv / tp]; out_norm
  [value dim] (the same on every TP rank); out_proj [h, v / tp] (row-parallel);
- full-attention layer: input norm [h]; linear_qkv [(2 heads + 2 kv heads) x head_dim / tp, h]
  (the sigmoid output gate doubles the query rows, `attention_output_gate`); q / k norms
  [head_dim]; linear_proj [h, heads x head_dim / tp];
- every layer: pre-MLP norm [h]; MoE: router [E, h], E / EP experts (SwiGLU, expert-tensor
  split), a shared expert (fc1 [2 F_s / tp, h], fc2 [h, F_s / tp]) and its gate [1, h];
  dense (Qwen3.5 dense): fc1 / fc2 as any SwiGLU MLP.

Learner activations (an estimate; bf16, per token and layer, in elements): a delta-net layer
keeps in_proj's output (2 qk + 2 v + 2 nv), the conv input copy and its silu output
(2 x (2 qk + v)), q and k l2-normed and repeated to the value heads (2 x nv x key dim), the
contiguous v and z (2 v), the chunked rule's per-chunk matrix (64 fp32 = 128 elements per
value head: fla's chunk size 64) and the output norm, gate and out_proj input (3 v); a gated
full-attention layer keeps q, gate, k, v, their normed / rotated copies, the core output and
the gated product. Both: norms, residuals and the MLP's as for a dense layer, plus the shared
expert's fc1 output and activation (3 F_s / tp). Full recompute keeps each layer's input and
the largest layer's set.

SGLang (`runtime.sglang_pools`, read from SGLang 0.5.23): KV cells for the full-attention
layers only, and one delta-net state slot per request slot (conv + recurrent state of every
linear layer); the slots take rest x r / (1 + r) of the KV budget by default.
"""

from __future__ import annotations

import dataclasses

from megatron_gspo.runtime.sglang_pools import (
    HybridPools,
    ServerKnobs,
    gdn_state_bytes,
    hybrid_pools,
)

STATE_ROW = "SGLang delta-net state"


def is_hybrid(hf: dict) -> bool:
    """A config with gated delta-net layers (Qwen3.5, Qwen3-Next)."""
    types = hf.get("layer_types") or []
    return "linear_attention" in types or "linear_num_value_heads" in hf


def hybrid_fields(hf: dict) -> dict:
    """`Dims` fields of a hybrid config (the layer pattern as transformers reads it)."""
    from megatron_gspo.convert.qwen3_next import layer_types

    return dict(linear=tuple(t == "linear_attention" for t in layer_types(hf)),
                lk_heads=int(hf["linear_num_key_heads"]),
                lv_heads=int(hf["linear_num_value_heads"]),
                lk_dim=int(hf["linear_key_head_dim"]), lv_dim=int(hf["linear_value_head_dim"]),
                conv=int(hf.get("linear_conv_kernel_dim") or 4),
                shared_ffn=int(hf.get("shared_expert_intermediate_size") or 0),
                ssm_dtype=str(hf.get("mamba_ssm_dtype") or "float32"))


def layer_numels(d, i: int, *, tp: int, ep: int, etp: int) -> list[tuple[int, str]]:
    """(elements, kind) of layer `i`'s parameters on one rank, in module order; kind: "tp"
    (split or local), "rep" (the same on every TP rank), "halves" (a SwiGLU fc1), "expert",
    "expert_halves"."""
    h, hd = d.hidden, d.head_dim
    qk, v, nv = d.lk_heads * d.lk_dim, d.lv_heads * d.lv_dim, d.lv_heads
    out = [(h, "rep")]
    if d.linear[i]:
        out += [((2 * qk + 2 * v + 2 * nv) * h // tp, "tp"), ((2 * qk + v) // tp * d.conv, "tp"),
                (nv // tp, "tp"), (nv // tp, "tp"), (d.lv_dim, "rep"), (v // tp * h, "tp")]
    else:
        out += [((2 * d.heads + 2 * d.kv_heads) * hd * h // tp, "tp"), (hd, "rep"), (hd, "rep"),
                (d.heads * hd * h // tp, "tp")]
    out.append((h, "rep"))
    if d.experts:
        out.append((d.experts * h, "rep"))
        for _ in range(d.experts // ep):
            out += [(2 * d.expert_ffn * h // etp, "expert_halves"),
                    (d.expert_ffn * h // etp, "expert")]
        if d.shared_ffn:
            out += [(2 * d.shared_ffn * h // tp, "halves"), (d.shared_ffn * h // tp, "tp"),
                    (h, "rep")]
    else:
        out += [(2 * d.ffn * h // tp, "halves"), (d.ffn * h // tp, "tp")]
    return out


def lora_numels(d, i: int, r: int, targets, *, tp: int, ep: int,
                etp: int) -> list[tuple[int, str]]:
    """(elements, kind) of layer `i`'s LoRA factors (`megatron.lora.adapters`): qkv / proj
    only on full-attention layers (a delta-net layer's in_proj / out_proj is no target),
    routed experts and the shared expert on every MoE layer."""
    h, hd = d.hidden, d.head_dim
    out: list[tuple[int, str]] = []
    if not d.linear[i]:
        if "qkv" in targets:
            out += [(r * h, "rep"), ((2 * d.heads + 2 * d.kv_heads) * hd // tp * r, "tp")]
        if "proj" in targets:
            out += [(r * d.heads * hd // tp, "tp"), (h * r, "rep")]
    if d.experts and "experts" in targets:
        for _ in range(d.experts // ep):
            out += [(r * h, "expert"), (2 * d.expert_ffn // etp * r, "expert"),
                    (r * d.expert_ffn // etp, "expert"), (h * r, "expert")]
    if d.experts and d.shared_ffn and "shared_experts" in targets:
        out += [(r * h, "rep"), (2 * d.shared_ffn // tp * r, "halves"),
                (r * d.shared_ffn // tp, "tp"), (h * r, "rep")]
    return out


def layer_activation_elements(d, *, tp: int, sp: bool, etp: int) -> tuple[int, int]:
    """Estimated activation elements per token of a (delta-net, full-attention) layer."""
    h, hd = d.hidden, d.head_dim
    qk, v, nv = d.lk_heads * d.lk_dim, d.lv_heads * d.lv_dim, d.lv_heads
    outside = 4 * h // (tp if sp else 1) + 2 * h  # norm inputs / outputs, residuals
    gdn = ((2 * qk + 2 * v + 2 * nv) + 2 * (2 * qk + v) + 2 * nv * d.lk_dim + 2 * v
           + 128 * nv + 3 * v) // tp
    attn = (2 * (2 * d.heads + 2 * d.kv_heads) * hd + 3 * d.heads * hd) // tp
    if d.experts:
        mlp = d.topk * (h + 3 * d.expert_ffn // etp) + d.experts // tp + 3 * d.shared_ffn // tp
    else:
        mlp = 3 * d.ffn // tp + h // (tp if sp else 1)
    return outside + gdn + mlp, outside + attn + mlp


def state_bytes_per_request(d, server_tp: int, knobs: ServerKnobs) -> int:
    """One SGLang request slot's delta-net state on one server TP rank."""
    return gdn_state_bytes(linear_layers=sum(d.linear), key_heads=d.lk_heads,
                           value_heads=d.lv_heads, key_dim=d.lk_dim, value_dim=d.lv_dim,
                           conv_kernel=d.conv, tp=server_tp,
                           ssm_dtype=knobs.mamba_ssm_dtype or d.ssm_dtype)


def context_len(d, knobs: ServerKnobs) -> int:
    """SGLang's context length: --context-length, else the config's max_position_embeddings."""
    return knobs.context_length or d.context_len or 1


def server_pools(d, *, server_tp: int, knobs: ServerKnobs, free: int, weights: int,
                 mem_fraction: float, cell: int) -> HybridPools:
    """SGLang 0.5.23's KV tokens and delta-net state slots of one server TP rank."""
    return hybrid_pools(free, weights, mem_fraction, cell,
                        state_bytes_per_request(d, server_tp, knobs), context_len(d, knobs),
                        knobs)


def state_note(d, pools: HybridPools, per_request: int, knobs: ServerKnobs,
               batch_per_server: int, seq_tokens: int) -> str:
    """The plan's note on the state row: slots, bytes, requests at once, the batch."""
    ssm = knobs.mamba_ssm_dtype or d.ssm_dtype
    full = pools.kv_tokens // max(1, seq_tokens)
    return (f"{pools.state_slots} slots x {per_request} B/request ({sum(d.linear)} linear "
            f"layers, conv bf16 + recurrent {ssm}); {pools.max_running_requests} requests at "
            f"once ({knobs.slots_per_request()} slots each), KV for {full} full-length; "
            f"{batch_per_server} per server per step")


def state_rows(plan, x, free: int, weights: int, cell: int) -> list:
    """A hybrid's SGLang pools for `report.build_plan` (`plan`: its Plan, `x`: PlanInputs):
    sets the plan's KV tokens and state slots, returns the delta-net state row, and adds a
    problem where SGLang would refuse to start."""
    d = x.dims
    pools = server_pools(d, server_tp=x.server_tp, knobs=x.knobs, free=free, weights=weights,
                         mem_fraction=x.mem_fraction, cell=cell)
    per = state_bytes_per_request(d, x.server_tp, x.knobs)
    plan.kv_tokens = pools.kv_tokens
    plan.state_slots, plan.max_running_requests = pools.state_slots, pools.max_running_requests
    if pools.max_running_requests < 1:
        plan.problems.append(
            f"SGLang delta-net state: {pools.state_slots} slots of {per} B serve "
            f"{max(0, pools.max_running_requests)} requests ({x.knobs.slots_per_request()} "
            "slots each): SGLang refuses to start")
    return [(STATE_ROW, pools.state_bytes,
             state_note(d, pools, per, x.knobs, x.batch_per_server, x.kv_tokens_needed))]


def ledger_fields(x) -> dict | None:
    """The device ledger's sizing inputs of a hybrid's SGLang pools (`LedgerSpec.hybrid`;
    None for other models)."""
    if not x.dims.linear:
        return None
    return {"state_bytes_per_request": state_bytes_per_request(x.dims, x.server_tp, x.knobs),
            "context_len": context_len(x.dims, x.knobs), "knobs": dataclasses.asdict(x.knobs)}
