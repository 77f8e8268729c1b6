"""Episodes rendered through the tokenizer's own chat template (agent.chat_template: tokenizer).

- the multi-turn example's Qwen-style tokenizer: the template path gives exactly the tokens of
  the built-in renderer (prompts, tool responses, model-closed and open turns, thinking on/off);
- Llama-3.1-style and Mistral-style templates: an episode with a tool call and its result
  renders to the template's own text of the whole conversation, the model's tokens untouched;
- a template that rewrites earlier turns (Qwen3's own dropping the empty think block) and one
  that drops the system message (Mistral v0.3) stop the run with one clear line.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from megatron_gspo.agent import CalculatorEnv, ChatTemplateError, EpisodeRunner
from megatron_gspo.agent.chat_session import BuiltinChat, TemplateChat
from megatron_gspo.config import load_config
from megatron_gspo.data.datasets import PromptItem
from megatron_gspo.rollout.engine import SamplingParams
from tests.agent.agent_helpers import ScriptedEngine
from tests.agent.chat_families import QWEN3_OFFICIAL_TEMPLATE, llama31_tokenizer, mistral_tokenizer

EX = Path(__file__).resolve().parents[2] / "examples" / "multiturn_agent"
sys.path.insert(0, str(EX))
import task  # noqa: E402


@pytest.fixture(scope="module")
def qtok():
    return task.build_tokenizer()


def _rows():
    return [task.make_problem(random.Random(f"c{i}")) for i in range(4)]


@pytest.mark.parametrize("variant", ["good", "bad_call"])
@pytest.mark.parametrize("stop_on_call_end", [True, False])
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("env", ["example", "calculator"])
def test_example_template_path_gives_builtin_tokens(qtok, variant, stop_on_call_end, thinking,
                                                    env):
    from megatron_gspo.agent.loop import make_runner, rollout_episodes

    rows = _rows()
    exprs = {r["prompt"]: r for r in rows}

    def script(prompt_ids, _n):
        text = qtok.decode(prompt_ids)
        row = next(r for p, r in exprs.items() if p in text)
        turn = text.count("<|im_start|>assistant") - 1
        call = f'{{"name":"calculator","arguments":{{"expression":"{row["expression"]}"}}}}'
        if variant == "bad_call" and turn == 0:
            out = '<tool_call>{"name": calc</tool_call><|im_end|>'
        elif turn == 0 or (variant == "bad_call" and turn == 1):
            out = f"<tool_call>{call}</tool_call><|im_end|>"
        else:
            out = f"It is {row['label']}.<|im_end|>"
        return qtok.encode(out, add_special_tokens=False)

    envspec = f"{EX / 'env.py'}:ArithmeticAgentEnv" if env == "example" else "calculator"
    over = [f"agent.environment={envspec}", f"agent.stop_on_tool_call_end={stop_on_call_end}",
            f"agent.enable_thinking={thinking}", "rollout.group_size=2",
            "train.prompts_per_step=4", "agent.max_total_tokens=2048",
            "rollout.max_new_tokens=200"]
    if env == "calculator":
        over += ["agent.env_kwargs={tool_call_reward: 0.1}"]
    reqs = [PromptItem([], r["prompt"], r["label"], i) for i, r in enumerate(rows)]
    out = {}
    for mode in ("tokenizer", "builtin"):
        cfg = load_config(EX / "config_cpu.yaml", [*over, f"agent.chat_template={mode}"])
        runner = make_runner(cfg, ScriptedEngine(script), qtok)
        assert isinstance(runner.chat, TemplateChat if mode == "tokenizer" else BuiltinChat)
        out[mode], _ = rollout_episodes(cfg, ScriptedEngine(script), iter(reqs), qtok, step=0)
    assert load_config(EX / "config_cpu.yaml").agent.chat_template == "tokenizer"  # default
    assert len(out["tokenizer"]) == 8
    for a, b in zip(out["tokenizer"], out["builtin"], strict=True):
        assert a.prompt_ids == b.prompt_ids
        assert a.response_ids == b.response_ids
        assert a.loss_mask == b.loss_mask and a.turn_ids == b.turn_ids
        assert a.rollout_logprobs == b.rollout_logprobs
        assert a.turn_rewards == b.turn_rewards and a.metadata["stop_reason"] == "done"
    s = out["tokenizer"][0]
    text = qtok.decode(s.tokens)
    assert "<tool_response>" in text and s.reward >= 1.0
    assert len(s.turn_rewards) == (3 if variant == "bad_call" else 2)


def _run_one(tok, turns: list[str], env, **kw):
    eng = ScriptedEngine(lambda _p, n: tok.encode(turns[n], add_special_tokens=False))
    kw.setdefault("chat_template", "tokenizer")
    runner = EpisodeRunner(eng, tok, lambda: env, sampling=SamplingParams(max_new_tokens=200),
                           **kw)
    [s] = runner.run_batch_sync([{"prompt": "What is 6*7?", "label": "42"}])
    return s, runner


def _model_spans(tok, s) -> list[str]:
    spans, cur = [], []
    for t, m in zip(s.response_ids, s.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur)), cur.clear()
    if cur:
        spans.append(tok.decode(cur))
    return spans


def test_llama31_episode_with_tool_call_renders_like_the_template():
    tok = llama31_tokenizer()
    call = '{"name": "calculator", "parameters": {"expression": "6*7"}}<|eot_id|>'
    answer = "The answer is 42.<|eot_id|>"
    env = CalculatorEnv()
    s, runner = _run_one(tok, [call, answer], env, tool_parser="llama3_json")
    assert s.metadata["stop_reason"] == "done" and s.reward == 1.0
    assert s.metadata["tool_calls"] == 1 and "tool_errors/invalid_call" not in s.metadata
    assert runner.im_end_id == tok.convert_tokens_to_ids("<|eot_id|>")
    assert _model_spans(tok, s) == [call, answer]  # model tokens exactly as generated
    messages = [
        {"role": "system", "content": env.system_prompt},
        {"role": "user", "content": "What is 6*7?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator",
                                              "arguments": {"expression": "6*7"}}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
    ]
    want = tok.apply_chat_template(messages, tools=env.tool_schemas(), tokenize=False)
    assert tok.decode(s.tokens) == want
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>' in want
    assert "Given the following functions" in tok.decode(s.prompt_ids)


def test_mistral_episode_with_tool_call_renders_like_the_template():
    tok = mistral_tokenizer()
    call = ('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6*7"}, '
            '"id": "abc123xyz"}]</s>')
    answer = " The answer is 42.</s>"
    env = CalculatorEnv(system_prompt=None)
    s, _ = _run_one(tok, [call, answer], env, tool_parser="mistral")
    assert s.metadata["stop_reason"] == "done" and s.reward == 1.0
    assert _model_spans(tok, s) == [call, answer]
    messages = [
        {"role": "user", "content": "What is 6*7?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "abc123xyz", "type": "function",
             "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "abc123xyz"},
        {"role": "assistant", "content": "The answer is 42."},
    ]
    want = tok.apply_chat_template(messages, tools=env.tool_schemas(), tokenize=False)
    assert tok.decode(s.tokens) == want
    assert '[TOOL_RESULTS] {"content": 42, "call_id": "abc123xyz"}[/TOOL_RESULTS]' in want
    assert tok.decode(s.prompt_ids).startswith("<s>[AVAILABLE_TOOLS]")


def test_mistral_call_without_id_gets_one_the_template_accepts():
    tok = mistral_tokenizer()
    call = '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6*7"}}]</s>'
    s, _ = _run_one(tok, [call, " 42</s>"], CalculatorEnv(system_prompt=None),
                    tool_parser="mistral")
    assert s.reward == 1.0
    assert '"call_id": "call00001"}[/TOOL_RESULTS]' in tok.decode(s.tokens)


def test_mistral_system_message_is_rewritten_one_clear_error():
    tok = mistral_tokenizer()  # v0.3 folds the system message into the LAST user message only
    call = '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6*7"}}]</s>'
    with pytest.raises(ChatTemplateError, match="not append-only") as ei:
        _run_one(tok, [call, " 42</s>"], CalculatorEnv(), tool_parser="mistral")
    assert "\n" not in str(ei.value)


def test_template_that_drops_earlier_think_blocks_is_one_clear_error(qtok, tmp_path):
    path = tmp_path / "qwen3_official.jinja"
    path.write_text(QWEN3_OFFICIAL_TEMPLATE)
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"6*7"}}</tool_call>'
    eng = ScriptedEngine(lambda _p, n: qtok.encode([call, "42<|im_end|>"][n],
                                                   add_special_tokens=False))
    runner = EpisodeRunner(eng, qtok, CalculatorEnv, chat_template=str(path),
                           sampling=SamplingParams(max_new_tokens=200))
    with pytest.raises(ChatTemplateError) as ei:
        runner.run_batch_sync([{"prompt": "What is 6*7?", "label": "42"}])
    msg = str(ei.value)
    assert "not append-only" in msg and "think block" in msg and "\n" not in msg
    assert "assistant\\n<think>\\n\\n</think>\\n\\n<tool_call>" in msg  # what changed


def test_qwen3_official_template_with_thinking_keeps_reasoning_and_works(qtok, tmp_path):
    path = tmp_path / "qwen3_official.jinja"
    path.write_text(QWEN3_OFFICIAL_TEMPLATE)
    call = ('<think>\nI should call.\n</think>\n\n<tool_call>\n{"name": "calculator", '
            '"arguments": {"expression": "6*7"}}\n</tool_call>')
    answer = "<think>\nDone.\n</think>\n\nThe answer is 42.<|im_end|>"
    env = CalculatorEnv()
    s, _ = _run_one(qtok, [call, answer], env, chat_template=str(path), enable_thinking=True)
    assert s.metadata["stop_reason"] == "done" and s.reward == 1.0
    assert _model_spans(qtok, s) == [call, answer]
    messages = [
        {"role": "system", "content": env.system_prompt},
        {"role": "user", "content": "What is 6*7?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call.",
         "tool_calls": [{"type": "function", "function": {
             "name": "calculator", "arguments": {"expression": "6*7"}}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is 42.", "reasoning_content": "Done."},
    ]
    want = qtok.apply_chat_template(messages, tokenize=False, chat_template=path.read_text(),
                                    enable_thinking=True)
    assert qtok.decode(s.tokens) + "\n" == want  # the template closes the last turn with "\n"


def test_missing_template_and_bad_settings_are_config_errors(qtok):
    from megatron_gspo.loop.early_checks import ConfigError, _check_agent_chat
    from tests.agent.agent_helpers import ToyTokenizer

    cfg = load_config(EX / "config_cpu.yaml")
    _check_agent_chat(cfg, qtok)  # the example's settings pass
    with pytest.raises(ConfigError, match="agent.chat_template: the tokenizer has no chat "):
        _check_agent_chat(cfg, ToyTokenizer())
    _check_agent_chat(load_config(EX / "config_cpu.yaml", ["agent.chat_template=builtin"]),
                      ToyTokenizer())
    bad = load_config(EX / "config_cpu.yaml", ["agent.tool_parser=nope"])
    with pytest.raises(ConfigError, match="agent.tool_parser: unknown tool parser 'nope'"):
        _check_agent_chat(bad, qtok)
    bad = load_config(EX / "config_cpu.yaml", ["agent.chat_template=missing.jinja"])
    with pytest.raises(ConfigError, match="agent.chat_template: 'missing.jinja' is not"):
        _check_agent_chat(bad, qtok)


def test_shipped_example_tokenizer_carries_the_append_only_template():
    from transformers import AutoTokenizer

    from megatron_gspo.agent.chat import QWEN3_CHAT_TEMPLATE

    assert AutoTokenizer.from_pretrained(EX / "base").chat_template == QWEN3_CHAT_TEMPLATE
    assert task.CHAT_TEMPLATE == QWEN3_CHAT_TEMPLATE


def test_cli_reports_a_template_error_in_one_line(monkeypatch, capsys):
    import megatron_gspo.loop.train as train_mod
    from megatron_gspo import cli

    def run(*_a, **_k):
        raise ChatTemplateError("chat template is not append-only: (details)")

    monkeypatch.setattr(train_mod, "run", run)
    assert cli.main(["train", str(EX / "config_cpu.yaml")]) == 2
    err = capsys.readouterr().err
    assert err == ("megatron-gspo: ChatTemplateError: chat template is not append-only: "
                   "(details)\n")
