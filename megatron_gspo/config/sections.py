"""The sections of the run configuration: one typed dataclass per YAML section, each field
with its type, default and documentation (`megatron-gspo fields`). The root `Config`, its
cross-field rules and the YAML loader are in `config/root.py` (unknown keys, wrong types and
out-of-range values fail with the dotted path of the field)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_gspo.config.schema import option
from megatron_gspo.config.speculative_rollouts import SpeculativeConfig
from megatron_gspo.config.tool_limits import check_python_limits

LOSSES = ("gspo", "gspo_token", "grpo", "sapo", "cispo", "gmpo")
# Default clip ranges per loss: GSPO's sequence ratios live very close to 1. CISPO: no lower
# bound on its IS weight (1 - 1 = 0), upper 0.28; GMPO: log-space range (e^-0.4, e^0.4); SAPO
# has no clip (its gate temperatures are algorithm.sapo_tau_pos / sapo_tau_neg).
DEFAULT_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.28),
                "sapo": (None, None), "cispo": (1.0, 0.28), "gmpo": (0.4, 0.4)}
# Losses that take per-token advantages (turn-level agent advantages): see megatron/step.py.
TOKEN_ADVANTAGE_LOSSES = ("gspo_token", "grpo", "sapo", "cispo")

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "experts", "shared_experts")  # lora/adapters.py


@dataclass
class LoraConfig:
    rank: int = option(0, "LoRA rank r; 0 = off. On: base weights frozen, adapters trained, "
                       "synced merged and checkpointed alone (docs/lora.md)", ge=0)
    alpha: float = option(16.0, "LoRA alpha; adapter output scaled by alpha / rank", gt=0)
    dropout: float = option(0.0, "dropout on the adapters' input (training)", ge=0, lt=1)
    targets: list[str] = option(["qkv", "proj", "fc1", "fc2"], "adapted layers: qkv, proj "
                                "(attention out), fc1 / fc2 (dense MLP), experts (routed)")


@dataclass
class ModelConfig:
    path: str | None = option(None, "Hugging Face model directory (config.json, weights, "
                               "tokenizer)")
    tokenizer: str | None = option(None, "tokenizer directory; default: model.path")
    dtype: str = option("bfloat16", "learner parameter dtype",
                        choices=("float32", "bfloat16", "float16"))
    transformer_impl: str = option("auto", "layer spec: TE when importable (auto), or forced",
                                   choices=("auto", "local", "transformer_engine"))
    recompute_activations: bool = option(False, "full activation recomputation in the learner")
    load_checkpoint: str | None = option(
        None, "Megatron dist checkpoint to initialise from instead of the HF weights")
    reference_path: str | None = option(
        None, "Hugging Face model directory of the KL reference policy; default: the initial "
        "weights (model.load_checkpoint or model.path); needs algorithm.kl_coef > 0")
    reference_offload: bool = option(False, "keep the KL reference's weights in CPU memory "
                                     "between its forward passes")
    mtp_layers: str = option(
        "auto", "multi-token-prediction layers of the checkpoint (DeepSeek-V3, GLM-4.5): keep "
        "(built frozen, in run checkpoints and exports, synced to SGLang servers with a draft), "
        "drop, add (a model that ships without gets one, trained as the draft), or auto: keep "
        "when model.path has them (docs/model-families.md, MTP)",
        choices=("auto", "keep", "drop", "add"))
    lora: LoraConfig = option(default_factory=LoraConfig, doc="LoRA adapters on the learner "
                              "(megatron_gspo/megatron/lora/adapters.py)")


@dataclass
class ParallelConfig:
    tensor: int = option(1, "tensor-parallel size", ge=1)
    pipeline: int = option(1, "pipeline-parallel size", ge=1)
    virtual_pipeline: int | None = option(None, "virtual pipeline stages per rank (interleaved)",
                                          ge=1)
    expert: int = option(1, "expert-parallel size (MoE)", ge=1)
    expert_tensor: int | None = option(None, "tensor-parallel size inside experts; default: tensor",
                                       ge=1)
    context: int = option(1, "context-parallel size (needs Transformer Engine attention)", ge=1)
    sequence_parallel: bool = option(False, "sequence parallelism (needs tensor > 1)")
    timeout: float = option(1800.0, "seconds one collective among the learner's ranks may "
                            "wait before the job fails (NCCL's watchdog)", gt=0)
    rank0_wait_timeout: float = option(86400.0, "seconds ranks 1..N may wait on a gloo group for "
                                       "rank 0's rollout, scoring, eval, server start-up", gt=0)


@dataclass
class OptimizerConfig:
    lr: float = option(1e-6, "peak learning rate", gt=0)
    min_lr: float = option(0.0, "final learning rate of the decay", ge=0)
    lr_warmup_steps: int = option(0, "linear warmup, in optimizer steps", ge=0)
    lr_decay_style: str = option("constant", "learning-rate schedule after warmup",
                                 choices=("constant", "cosine", "linear"))
    weight_decay: float = option(0.0, "decoupled weight decay (AdamW)", ge=0)
    adam_beta1: float = option(0.9, "Adam beta1", ge=0, lt=1)
    adam_beta2: float = option(0.999, "Adam beta2", ge=0, lt=1)
    adam_eps: float = option(1e-8, "Adam epsilon", gt=0)
    clip_grad: float = option(1.0, "global gradient-norm clip (0 disables)", ge=0)
    distributed_optimizer: bool = option(False, "shard optimizer state over data-parallel ranks")
    offload_outside_step: bool = option(
        False, "fp32 main weights and Adam moments in pinned CPU memory except during each "
        "optimizer step (2 PCIe copies per step), for state that does not fit beside activations")


@dataclass
class RolloutConfig:
    engine: str = option("embedded", "rollout engine", choices=("embedded", "sglang"))
    group_size: int = option(8, "responses sampled per prompt (G); at least 2, as the "
                             "advantages are relative to the prompt's group", ge=2)
    temperature: float = option(1.0, "sampling temperature (the learner uses the same; below "
                                "1e-6 engines sample greedily)", ge=1e-6)
    top_p: float = option(1.0, "nucleus sampling threshold", gt=0, le=1)
    top_k: int = option(-1, "top-k sampling (-1 disables)", ge=-1)
    max_new_tokens: int = option(512, "maximum generated tokens per response", ge=1)
    stop_token_ids: list[int] = option([], "extra token ids that end a response")
    dtype: str = option("bfloat16", "embedded engine dtype", choices=("float32", "bfloat16",
                                                                      "float16"))
    over_sample: float = option(1.0, "sample this many times more prompts, keep the needed ones",
                                ge=1)
    drop_zero_variance_groups: bool = option(False, "drop groups whose rewards are all equal")
    colocate: bool = option(True, "rollout engine shares the learner's GPUs (memory released)")
    server_urls: list[str] = option([], "attach to running SGLang servers instead of launching")
    num_servers: int = option(1, "SGLang servers to launch on each node that launches them "
                              "(colocated with tensor weight sync: every node of the job)",
                              ge=1)
    tp_size: int = option(1, "tensor-parallel size of each SGLang server", ge=1)
    mem_fraction: float = option(
        0.7, "SGLang --mem-fraction-static: share of the memory FREE when a server starts for its "
        "weights + KV cache (KV tokens = (free x f - weights) / bytes per token; see "
        "`megatron-gspo plan`)", gt=0, lt=1)
    offload_learner: bool | None = option(
        None, "colocated SGLang: the learner's weights, grads, fp32 main weights, Adam moments "
        "and KL reference leave the GPU while the servers hold it; null = on when colocated")
    host: str = option("127.0.0.1", "host SGLang servers bind to; internal: each node's "
                       "cluster-internal address (what its host name resolves to), which "
                       "colocated servers on several nodes need so that rank 0 reaches them")
    base_port: int = option(30000, "first port for launched servers (SGLang refuses ports above "
                            "55535: it adds 10000 for its gRPC port)", ge=1, le=55535)
    extra_server_args: list[str] = option([], "extra command-line arguments for SGLang servers")
    sglang_python: str | None = option(
        None, "python interpreter that runs launched SGLang servers (e.g. the venv "
        "scripts/sglang_cpu.sh installs: .sglang-cpu/venv/bin/python); default this one")
    sglang_device: str = option(
        "cuda", "device of launched SGLang servers; cpu: SGLang's CPU engine (--device cpu, "
        "no overlap schedule, no CUDA graphs, torch_native attention, SGLANG_USE_CPU_ENGINE=1, "
        "the no-GPU driver stub next to sglang_python's venv on LD_LIBRARY_PATH, no memory "
        "saver: memory is not released)", choices=("cuda", "cpu"))
    verify_sync_interval: int = option(1, "every this many weight syncs the engine's log-probs "
        "of a fixed probe sequence are compared with the learner's (a sync that changed nothing "
        "fails with one error naming it; 0: never). One 8-token generation per server and one "
        "learner forward: 4-10% of the tiny CPU demo's step (bench/sync_probe_cost.py)",
        ge=0)
    max_concurrency: int = option(256, "in-flight HTTP requests per server", ge=1)
    request_timeout: float = option(600.0, "seconds before a generate request is retried", gt=0)
    max_retries: int = option(5, "retries per request on connection errors and 5xx", ge=0)
    startup_timeout: float = option(900.0, "seconds to wait for a launched server to be healthy",
                                    gt=0)
    weight_sync: str = option("auto", "how weights reach SGLang: tensor (colocated, CUDA IPC), "
                              "distributed (NCCL broadcast); auto picks by rollout.colocate",
                              choices=("auto", "tensor", "distributed"))
    weight_sync_master: str | None = option(
        None, "host:port of the learner's NCCL weight-update group (distributed sync); default "
        "MASTER_ADDR (for remote servers when loopback: this node's routable one), a free port")
    router_url: str | None = option(None, "send generation through this running sglang-router")
    launch_router: bool = option(False, "start an sglang-router over the launched servers")
    router_policy: str = option("cache_aware", "sglang-router load-balancing policy")
    server_log_dir: str | None = option(None, "where launched servers write their logs; default "
                                        "RUN_DIR/sglang")
    backoff: float = option(0.5, "first retry delay in seconds (doubles, capped at 10 s)", ge=0)
    api_key_env: str | None = option(
        None, "name of the environment variable holding SGLang's --api-key: launched servers "
        "and router get it, every request sends it as 'Authorization: Bearer'; the key itself "
        "is never written to the config, logs or metrics")
    weight_sync_delta: str = option("off", "send only what changed since the servers' last "
        "acknowledged sync (docs/weight-sync.md); auto: while the last sync's changed share is "
        "below weight_sync_delta_threshold", choices=("auto", "on", "off"))
    weight_sync_delta_threshold: float = option(0.5, "auto: changed share below which the "
                                                "next sync is a delta", gt=0, le=1)
    weight_sync_delta_base: str = option("copy", "copy: a CPU copy of the sent weights (deltas); "
                                         "hash: a digest per tensor (unchanged ones are skipped)",
                                         choices=("copy", "hash"))
    weight_precision: str = option(
        "bf16", "weights the rollout engine computes with: bf16 (the learner's) or fp8 (block "
        "FP8: e4m3, 128x128 blocks, fp32 scales; launched servers start from an FP8 copy of "
        "model.path in RUN_DIR/fp8_model, every sync quantizes on the learner, the embedded "
        "engine dequantizes: W8A16; docs/precision.md)", choices=("bf16", "fp8"))
    fp8_bf16_layers: int = option(0, "weight_precision fp8: the first and last this many "
                                  "decoder layers stay BF16", ge=0)
    bucket_bytes: int = option(512 * 2**20, "size bound of one weight-sync bucket (a larger "
                               "tensor travels alone in its own bucket)", ge=1)
    mode: str = option("sync", "sync: generate, then train; async: a producer keeps generating "
                       "with the newest weights while the learner trains on finished groups",
                       choices=("sync", "async"))
    max_staleness: int = option(1, "async: nothing trained at step t was generated by weights "
                                "older than t - max_staleness (0: on-policy, 1: one step off); "
                                "generation is throttled, stale groups are never dropped", ge=0)
    update_in_flight: str = option(
        "continue", "async: responses in flight when new weights arrive are continued under "
        "them (partial rollout; each token keeps its weight version) or aborted and generated "
        "again from the prompt", choices=("continue", "abort"))
    chunk_tokens: int = option(64, "async: most tokens per generation request; weight updates "
                               "meet in-flight responses at these boundaries", ge=1)
    speculative: SpeculativeConfig = option(
        default_factory=SpeculativeConfig, doc="speculative rollouts drafted by the model's MTP "
        "head (megatron_gspo/config/speculative_rollouts.py)")


@dataclass
class AlgorithmConfig:
    loss: str = option("gspo", "policy loss: gspo, gspo_token, grpo, sapo (soft gate, arXiv "
                       "2511.20347), cispo (clipped IS weight, arXiv 2506.13585) or gmpo "
                       "(geometric mean, arXiv 2507.20673)", choices=LOSSES)
    eps_low: float | None = option(None, "lower clip range; default 3e-4 (GSPO) / 0.2 (GRPO) / 1.0 "
                                   "= no lower bound (CISPO) / 0.4 in log space (GMPO); not "
                                   "used by SAPO", gt=0)
    eps_high: float | None = option(None, "upper clip range; default 4e-4 (GSPO) / 0.28 (GRPO, "
                                    "CISPO) / 0.4 in log space (GMPO); not used by SAPO", gt=0)
    advantage_scale: str = option("std", "divide group-centred rewards by the group std, or not",
                                  choices=("std", "none"))
    advantage_eps: float = option(1e-6, "added to the group std (> 0: no 0/0 on equal rewards)",
                                  gt=0)
    grpo_aggregation: str = option(
        "seq-mean-token-mean", "GRPO loss aggregation: mean of token means, token-mean (DAPO) "
        "or seq-mean-token-sum-norm (Dr. GRPO: token sums over N x rollout.max_new_tokens; "
        "with advantage_scale none)",
        choices=("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"))
    logratio_bound: float = option(20.0, "bound on log-ratios before exp (at most 50: e^50 "
                                   "times the largest advantage stays finite in float32)",
                                   gt=0, le=50)
    mini_batches: int = option(4, "optimizer steps per rollout batch (global mini-batches)", ge=1)
    micro_batch_tokens: int = option(4096, "token budget of one packed micro-batch", ge=1)
    mtp_loss_weight: float = option(0.0, "weight of the MTP head's draft-training loss "
                                    "(cross-entropy on the rollout tokens; its gradient reaches "
                                    "only the head); 0: the head stays frozen", ge=0)
    mtp_lr: float = option(0.0, "peak learning rate of the MTP head (it sees only its own loss, "
                           "and Adam makes mtp_loss_weight an on / off switch more than a "
                           "scale: this sets how fast it learns); 0: optimizer.lr", ge=0)
    kl_coef: float = option(0.0, "weight beta of the KL to the frozen reference policy; 0 = off "
                            "(no reference model is built)", ge=0)
    kl_estimator: str = option("k3", "per-token KL estimator with d = logp - ref_logp: k1 = d, "
                               "k2 = d^2/2, k3 = exp(-d)-1+d", choices=("k1", "k2", "k3"))
    kl_in: str = option("loss", "where the KL goes: added to the loss (aggregated like the policy "
                        "term) or subtracted from the reward before advantages",
                        choices=("loss", "reward"))
    entropy_coef: float = option(0.0, "weight of the entropy bonus subtracted from the loss; "
                                 "0 = off", ge=0)
    sapo_tau_pos: float = option(1.0, "`sapo`: gate temperature of tokens with a positive "
                                 "advantage", gt=0)
    sapo_tau_neg: float = option(1.05, "`sapo`: gate temperature of tokens with a negative (or "
                                 "zero) advantage", gt=0)

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) with per-loss defaults filled in."""
        lo, hi = DEFAULT_CLIP[self.loss]
        return (self.eps_low if self.eps_low is not None else lo,
                self.eps_high if self.eps_high is not None else hi)

    def audit_range(self) -> tuple[float, float, str]:
        """(eps_low, eps_high, level) of the precision audit, in ratio space: the loss's clip
        range (GMPO's log-space range converted; SAPO, unclipped: GRPO's token range), at the
        level of its ratio ("sequence" for gspo / gspo_token / gmpo, else "token")."""
        if self.loss == "sapo":
            return 0.2, 0.28, "token"
        lo, hi = self.clip_range()
        if self.loss == "gmpo":
            return -math.expm1(-lo), math.expm1(hi), "sequence"
        return lo, hi, "token" if self.loss in ("grpo", "cispo") else "sequence"


@dataclass
class PrecisionConfig:
    old_logprobs: str = option("auto", "source of pi_old: learner recompute, engine, or audited",
                               choices=("recompute", "rollout", "auto"))
    audit_fraction: float = option(0.25, "share of steps audited when reusing engine log-probs "
                                   "(step 0 and each step s where floor(s x f) grows: 0.25 "
                                   "audits steps 0, 4, 8, ...)", ge=0, le=1)
    tolerance: float = option(0.05, "max share of audited sequences whose mismatch exceeds the "
                              "clip range before `auto` recomputes", ge=0, le=1)
    mismatch_scale: float = option(1.0, "a sequence is out of range when |d_i| > scale x clip eps",
                                   gt=0)
    recheck_interval: int = option(5, "in fallback, audit every N steps to decide on returning",
                                   ge=1)
    correction: str = option(
        "none", "correction of engine mismatch, on every step that computes the learner's log-"
        "probs: each step with old_logprobs recompute (or auto falling back), else only audited "
        "steps (audit_fraction; 0 never audits: refused). mask (drop sequences), tis (truncated "
        "weight), mis (drop sequences whose weight exceeds the cap), icepop (drop tokens outside "
        "a ratio band)", choices=("none", "mask", "tis", "mis", "icepop"))
    mask_bound: float = option(1e-3, "`mask`: drop sequences with |d_i| above this", gt=0)
    tis_cap: float = option(2.0, "`tis` / `mis`: cap C of the weight exp(d_i), d_i = mean "
                            "log-ratio learner/engine (min(exp(d_i), C), or dropped above C); "
                            "at least 1, the weight of a sequence both agree on", ge=1)
    icepop_low: float = option(0.5, "`icepop`: drop tokens with pi_learner/pi_engine below this",
                               gt=0, lt=1)
    icepop_high: float = option(5.0, "`icepop`: drop tokens with pi_learner/pi_engine above this",
                                gt=1)
    offpolicy_mask_delta: float | None = option(
        None, "DeepSeek-V3.2 off-policy sequence masking in every training forward: drop "
        "negative-advantage sequences whose mean log(pi_old/pi_theta) exceeds this; null = off",
        gt=0)


@dataclass
class DataConfig:
    train_path: str | None = option(None, "prompt dataset: a .jsonl or .parquet file, a "
                                    "directory saved with datasets' save_to_disk, or a Hugging "
                                    "Face dataset name")
    train_split: str = option("train", "split of train_path when it is a Hugging Face dataset "
                              "(or a saved DatasetDict)")
    eval_split: str = option("test", "split of eval_path / eval_sets entries that are Hugging "
                             "Face datasets (or saved DatasetDicts)")
    dataset_config: str | None = option(None, "configuration name of Hugging Face datasets "
                                        "loaded by name (e.g. 'main' for gsm8k)")
    eval_path: str | None = option(None, "evaluation prompts (same forms as train_path); "
                                   "metrics under eval/")
    eval_sets: dict[str, str] = option({}, "more evaluation sets, {name: path}; metrics under "
                                       "eval/<name>/")
    prompt_key: str = option("prompt", "field holding the prompt text or chat messages")
    label_key: str | None = option("answer", "field holding the reference answer for the "
                                   "reward; null for unlabeled datasets (the reward gets None)")
    system_prompt: str | None = option(None, "system message prepended to every chat")
    apply_chat_template: bool = option(True, "render prompts with the tokenizer's chat template")
    max_prompt_length: int = option(1024, "prompts longer than this (tokens) are bad rows", ge=1)
    skip_bad_rows: bool = option(False, "skip and count bad rows instead of failing")
    shuffle: bool = option(True, "shuffle prompts each epoch (seeded by train.seed)")


@dataclass
class RewardConfig:
    name: str = option("math", "registered reward name or `module:function`")
    kwargs: dict[str, Any] = option({}, "keyword arguments passed to the reward function (or "
                                    "to the reward service as \"kwargs\")")
    url: str | None = option(None, "HTTP reward service scoring batches of samples instead of "
                             "reward.name (schema: docs/rewards.md)")
    url_batch_size: int = option(64, "reward service: samples per request", ge=1)
    url_concurrency: int = option(8, "reward service: requests in flight at once", ge=1)
    url_timeout: float = option(60.0, "reward service: seconds one request may take in all "
                                "(connect and the whole reply)", gt=0)
    url_retries: int = option(3, "reward service: retries after a 5xx status, a connection "
                              "error or a timeout", ge=0)
    url_backoff: float = option(0.5, "reward service: seconds before the first retry, doubled "
                                "for each further one", ge=0)
    overlong_filter: bool = option(False, "DAPO overlong filtering: no loss on responses cut "
                                   "off at rollout.max_new_tokens (they still count in their "
                                   "group's reward statistics)")
    overlong_buffer: int = option(0, "DAPO soft overlong punishment: the last this many tokens "
                                  "before rollout.max_new_tokens cost up to "
                                  "reward.overlong_penalty, linearly; 0 = off", ge=0)
    overlong_penalty: float = option(1.0, "DAPO soft overlong punishment: penalty at the "
                                     "generation limit (at most 1e15, the reward bound)",
                                     gt=0, le=1e15)


@dataclass
class AgentConfig:
    enabled: bool = option(False, "multi-turn episodes with an environment")
    environment: str = option("calculator", "registered environment name or `module:Class`")
    max_turns: int = option(4, "maximum model turns per episode", ge=1)
    max_total_tokens: int = option(2048, "maximum episode length in tokens", ge=1)
    turn_timeout: float = option(60.0, "seconds per model turn", gt=0)
    episode_timeout: float = option(600.0, "seconds per episode", gt=0)
    advantage: str = option("episode", "episode-level (GSPO) or turn-level (GSPO-token)",
                            choices=("episode", "turn"))
    turn_discount: float = option(1.0, "discount of later-turn rewards", ge=0, le=1)
    python_tool: bool = option(False, "enable the sandboxed Python tool (needs Landlock; its "
                               "limits, e.g. max_disk_mb: the byte quota of a call's temp dir, "
                               "64 MiB, go in env_kwargs.python_kwargs; see README)")
    env_kwargs: dict[str, Any] = option({}, "constructor arguments of the environment (tool "
                                        "timeouts, output caps, sandbox limits, ...); its "
                                        "python_kwargs are checked as PythonToolLimits")
    turn_normalization: str = option("pooled", "turn-level advantages: normalise all turns of a "
                                     "group together, or per turn index",
                                     choices=("pooled", "per_turn"))
    enable_thinking: bool = option(False, "Qwen3 chat template with thinking enabled")
    stop_on_tool_call_end: bool = option(True, "end a model turn at the tool-call end token")
    max_concurrent: int = option(256, "episodes in flight at once", ge=1)
    chat_template: str = option(
        "tokenizer", "how episodes are rendered: tokenizer (its own chat template; each "
        "environment turn is the suffix the template adds, and a template that rewrites earlier "
        "turns is an error), builtin (Qwen3/ChatML renderer) or a path to a .jinja template")
    tool_parser: str = option(
        "hermes", "tool-call format of model turns: hermes (Qwen3 <tool_call> blocks), "
        "llama3_json (Llama 3.1 JSON), mistral ([TOOL_CALLS]) or module:function returning a "
        "megatron_gspo.agent.chat.ParsedAction")

    def __post_init__(self):
        if isinstance(self.env_kwargs, dict) and "python_kwargs" in self.env_kwargs:
            check_python_limits(self.env_kwargs["python_kwargs"],
                                "agent.env_kwargs.python_kwargs")


@dataclass
class TrainConfig:
    max_steps: int = option(100, "RL steps (rollout + updates) to run", ge=1)
    seed: int = option(1234, "seed of data order, sampling and init", ge=0, le=2**31 - 1)
    resume: str = option("auto", "auto: continue from the newest intact checkpoint (a damaged "
                         "one is moved aside); never: start fresh, an error if the run dir "
                         "already holds checkpoints or metrics", choices=("auto", "never"))
    resume_changes: list[str] = option([], "resume: keys (section.key, or a section) allowed to "
                                       "differ from the checkpoint's config where that changes "
                                       "what it means, e.g. [optimizer.lr]; other such changes "
                                       "are refused (docs/reliability.md)")
    prompts_per_step: int = option(32, "prompts per rollout batch", ge=1)
    eval_interval: int = option(0, "evaluate every N steps (0 disables)", ge=0)
    eval_prompts: int = option(64, "prompts per evaluation (per eval set)", ge=1)
    eval_temperature: float = option(0.0, "evaluation temperature: 0 = greedy, > 0 = sampled",
                                     ge=0.0)
    eval_samples: int = option(1, "responses per eval prompt (n of mean@n and pass@k; > 1 needs "
                               "train.eval_temperature > 0)", ge=1)
    eval_pass_k: list[int] = option([], "the k values of pass@k (each <= train.eval_samples); "
                                    "empty: 1, 2, 4, ... up to eval_samples, and eval_samples")
    eval_pass_threshold: float = option(1.0, "an eval response counts as correct for pass@k "
                                        "when its reward is at least this")
    deterministic: bool = option(False, "reproducible runs (slower): torch/cuDNN/cuBLAS/NCCL/"
                                 "Megatron-Core determinism, a sampling seed per SGLang sample "
                                 "(launched GPU servers: --enable-deterministic-inference)")
    max_skipped_steps: int = option(
        3, "stop with an error after this many steps in a row whose optimizer updates were all "
        "skipped for a non-finite loss or gradient (0: never stop)", ge=0)


@dataclass
class LoggingConfig:
    tensorboard: bool = option(True, "write tensorboard event files to RUN_DIR/tensorboard")
    wandb_project: str | None = option(None, "log to this Weights & Biases project")
    wandb_name: str | None = option(None, "Weights & Biases run name")
    progress_bar: bool = option(True, "progress bar with ETA on rank 0")
    log_samples: int = option(2, "responses printed to the log per step", ge=0)


@dataclass
class MoeConfig:
    routing_replay: str = option(
        "none", "MoE routing replay: none (live routing); r2 (replay the learner's own routing "
        "recorded at the step's start weights in every training forward); r3 (replay the "
        "rollout engine's routing in every policy forward). Needs an MoE model",
        choices=("none", "r2", "r3"))
    engine_routing: bool = option(
        True, "MoE models: ask the rollout engine for the experts each token was routed to "
        "(r3 replays them; the moe/routing_agreement metrics compare them with the learner's); "
        "SGLang servers need --enable-return-routed-experts")


@dataclass
class CheckpointConfig:
    interval: int = option(0, "save every N steps (0: only at the end)", ge=0)
    dir: str | None = option(None, "checkpoint directory; default RUN_DIR/checkpoints")
    keep_last: int = option(2, "complete checkpoints kept (older ones deleted)", ge=1)
    checksums: bool = option(True, "store sha256 of every checkpoint file in COMPLETE and verify "
                             "it on resume (False: sizes only; saves one read of each file)")
    async_save: bool = option(False, "learner files written by forked writers while training "
                              "goes on (Megatron-Core async); COMPLETE once all are fsynced")
