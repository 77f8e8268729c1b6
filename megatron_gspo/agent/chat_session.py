"""Per-episode chat rendering for the episode runner: the built-in Qwen3 renderer or the
tokenizer's own chat template (`agent.chat_template`).

Both produce only the text between model turns: the prompt that opens the episode and, after
each model turn, the environment's turn (plus the next generation prompt). The model's tokens
are never re-rendered or re-tokenised.

Template path: the prompt is `tokenizer.apply_chat_template(messages, tools=...,
add_generation_prompt=True)`. After a model turn the chat gets the assistant message (content
and tool calls as the tool parser reads them, the text between `<think>` tags as
`reasoning_content`) and the environment's messages; the environment's turn is the suffix that
the template adds after the conversation so far:

    before = template(history + [assistant])                 # no generation prompt
    after  = template(history + [assistant] + observation)   # with generation prompt
    environment turn = rest of the assistant turn's closing + after[len(before):]

where "rest of the closing" is the part of the template's end-of-assistant-turn text (for
example `<|im_end|>\\n`) that the model did not generate itself (a turn that stopped at
`</tool_call>`, or whose last token was `<|im_end|>` and still needs the newline). `after` must
start with `before`, in text and in tokens, and `before` with what the previous turn rendered: a
template that rewrites earlier turns when one is added (Qwen3's own template drops the reasoning
and the empty think block of earlier assistant turns) cannot extend an episode token by token
and stops the run with one `ChatTemplateError` line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megatron_gspo.agent.chat import QWEN3, ChatFormat, render_messages, render_observation
from megatron_gspo.agent.tool_parsers import ToolParser


class ChatTemplateError(ValueError):
    """The chat template cannot extend an episode token by token (ends the run)."""


class TemplateRenderError(ValueError):
    """The chat template raised while rendering one conversation (fails that episode only)."""


def _first_line(e: BaseException) -> str:
    text = " ".join((str(e).strip().splitlines() or [""])[0].split())
    line = getattr(e, "lineno", None)
    where = f" (template line {line})" if line else ""
    return f"{type(e).__name__}: {text[:300]}{where}"


class BuiltinChat:
    """The built-in Qwen3/ChatML renderer (`megatron_gspo.agent.chat`)."""

    def __init__(self, fmt: ChatFormat = QWEN3, enable_thinking: bool = False):
        self.fmt = fmt
        self.enable_thinking = enable_thinking
        self.turn_end = fmt.im_end

    def session(self) -> BuiltinChat:
        return self  # stateless

    def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """Prompt text of the episode."""
        return render_messages(messages, tools, enable_thinking=self.enable_thinking,
                               fmt=self.fmt)

    def observe(self, model_text: str, last_token: str, observation: list[dict[str, Any]]) -> str:
        """Text of the environment's turn after a model turn (see module docstring)."""
        return render_observation(observation, model_closed_turn=last_token == self.fmt.im_end,
                                  enable_thinking=self.enable_thinking, fmt=self.fmt)


_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class TemplateChat:
    """The tokenizer's chat template (or one given as Jinja text).

    Args:
        tokenizer: Hugging Face tokenizer with `apply_chat_template`.
        parser: tool-call parser (builds the assistant message's `tool_calls`).
        enable_thinking: passed to the template (Qwen3 templates read it).
        template: Jinja text replacing the tokenizer's own template (None: the tokenizer's).
    Raises:
        ChatTemplateError: no template, or it does not say how an assistant turn ends.
    """

    def __init__(self, tokenizer: Any, parser: ToolParser, *, enable_thinking: bool = False,
                 template: str | None = None):
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("agent.chat_template: the tokenizer has no chat template; "
                                    "set agent.chat_template=builtin or a .jinja file")
        self.tokenizer = tokenizer
        self.parser = parser
        self.enable_thinking = enable_thinking
        self.template = template
        probe = "PROBE_CONTENT_7f3a"
        try:
            text = self.render([{"role": "user", "content": "x"},
                                {"role": "assistant", "content": probe}], None, gen=False)
        except TemplateRenderError as e:
            raise ChatTemplateError(f"agent.chat_template: {e}") from None
        if probe not in text:
            raise ChatTemplateError("chat template does not render an assistant message's "
                                    "content; cannot tell where a model turn ends")
        self.closing = text[text.rindex(probe) + len(probe):]
        self.turn_end = self._first_token(self.closing) if self.closing else tokenizer.eos_token

    def _first_token(self, text: str) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.decode(ids[:1], skip_special_tokens=False)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
               gen: bool) -> str:
        """The template's text for `messages` (tools omitted when empty)."""
        kwargs: dict[str, Any] = {"enable_thinking": self.enable_thinking}
        if self.template is not None:
            kwargs["chat_template"] = self.template
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=gen, tokenize=False,
                **kwargs)
        except Exception as e:  # noqa: BLE001 - Jinja syntax/undefined errors, raise_exception
            roles = ", ".join(str(m.get("role")) for m in messages[-3:])
            raise TemplateRenderError(f"the chat template failed on a conversation ending in "
                                      f"[{roles}]: {_first_line(e)}") from None

    def session(self) -> TemplateSession:
        return TemplateSession(self)


class TemplateSession:
    """One episode's conversation on the template path (see module docstring)."""

    def __init__(self, chat: TemplateChat):
        self.chat = chat
        self.history: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.rendered = ""  # the template's text of `history` (no generation prompt)
        self._ids = 0

    def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """Prompt text of the episode."""
        self.history, self.tools = list(messages), list(tools)
        self.rendered = self.chat.render(self.history, self.tools, gen=False)
        return self.chat.render(self.history, self.tools, gen=True)

    def _call_id(self) -> str:
        self._ids += 1
        return f"call{self._ids:05d}"  # 9 alphanumerics: Mistral templates insist on that

    def _assistant(self, model_text: str) -> dict[str, Any]:
        parsed = self.chat.parser.parse(model_text)
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        think = _THINK.search(model_text)
        if think:  # Qwen3-style templates keep it for turns after the last user query
            msg["reasoning_content"] = think.group(1).strip("\n")
        if parsed.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id or self._call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls
            ]
        return msg

    def observe(self, model_text: str, last_token: str, observation: list[dict[str, Any]]) -> str:
        """Text of the environment's turn after a model turn.

        Args:
            model_text: the model's turn, decoded with special tokens.
            last_token: the text of the model's last token.
            observation: the environment's messages (`tool` results and/or `user` text).
        Returns:
            the text to tokenise and append with loss mask 0.
        Raises:
            ChatTemplateError: the template rewrites earlier turns (one line).
        """
        asst = self._assistant(model_text)
        calls = [c["id"] for c in asst.get("tool_calls", [])]
        obs: list[dict[str, Any]] = []
        n_tool = 0
        for m in observation:
            m = dict(m)
            if m.get("role") == "tool":
                if not m.get("tool_call_id"):
                    m["tool_call_id"] = calls[n_tool] if n_tool < len(calls) else self._call_id()
                n_tool += 1
            obs.append(m)
        render = self.chat.render
        before = render(self.history + [asst], self.tools, gen=False)
        self._check(self.rendered, before, "the model's turn is added")
        after = render(self.history + [asst] + obs, self.tools, gen=True)
        self._check(before, after, "the environment's turn is added")
        tok = self.chat.tokenizer
        b_ids = tok.encode(before, add_special_tokens=False)
        if tok.encode(after, add_special_tokens=False)[: len(b_ids)] != b_ids:
            raise ChatTemplateError(
                "chat template: the environment's turn changes the tokens of the text before "
                "it (the tokenizer merges across the turn boundary); the episode cannot be "
                "extended token by token")
        self.history += [asst] + obs
        self.rendered = render(self.history, self.tools, gen=False)
        closing = self.chat.closing
        rest = closing[len(last_token):] if last_token and closing.startswith(last_token) \
            else closing
        return rest + after[len(before):]

    @staticmethod
    def _check(old: str, new: str, when: str) -> None:
        if new.startswith(old):
            return
        i = _first_difference(old, new)
        raise ChatTemplateError(
            f"chat template is not append-only: when {when} it renders earlier turns "
            f"differently from character {i} ({old[max(0, i - 30):i + 30]!r} becomes "
            f"{new[max(0, i - 30):i + 30]!r}); typically the template drops the reasoning or "
            "the empty think block of earlier assistant turns or moves the tool list; use an "
            "append-only template (agent.chat_template=PATH.jinja, e.g. the one in "
            "megatron_gspo.agent.chat.QWEN3_CHAT_TEMPLATE) or agent.chat_template=builtin")


def make_chat(spec: str, tokenizer: Any, parser: ToolParser, *, fmt: ChatFormat = QWEN3,
              enable_thinking: bool = False) -> BuiltinChat | TemplateChat:
    """The renderer for `agent.chat_template`: `tokenizer`, `builtin` or a `.jinja` file.

    Raises:
        ChatTemplateError: a missing template or file (one line).
    """
    if spec == "builtin":
        return BuiltinChat(fmt, enable_thinking)
    if spec == "tokenizer":
        return TemplateChat(tokenizer, parser, enable_thinking=enable_thinking)
    path = Path(spec)
    if spec.endswith(".jinja") and path.is_file():
        return TemplateChat(tokenizer, parser, enable_thinking=enable_thinking,
                            template=path.read_text())
    raise ChatTemplateError(f"agent.chat_template: {spec!r} is not 'tokenizer', 'builtin' or "
                            "an existing .jinja file")
