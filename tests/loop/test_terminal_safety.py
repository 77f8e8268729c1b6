"""Model text never reaches the operator's terminal as control sequences (issue 54, defect 10).

A byte-level BPE tokenizer (the kind Qwen3 and SmolLM2 use, built here with `tokenizers`)
decodes any byte a model samples, ESC and BEL included; `logging.log_samples` prints decoded
responses through `MetricsLogger.event`. Every control or format character is written escaped on
stderr and in events.log, while plain text (accents, CJK, emoji) passes unchanged.
"""

from __future__ import annotations

import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from megatron_gspo.data.sample import Sample
from megatron_gspo.loop import phases
from megatron_gspo.runtime.metrics import MetricsLogger, printable

ATTACKS = {
    "window title (OSC 0)": "\x1b]0;pwned\x07",
    "clipboard write (OSC 52)": "\x1b]52;c;ZWNobyBoaQ==\x07",
    "clear screen (CSI 2J)": "\x1b[2J\x1b[H",
    "C1 CSI": "\x9b31m",
    "bidi override": "abc\u202edef",
    "backspace over text": "safe\x08\x08\x08\x08rm -rf",
}


@pytest.fixture(scope="module")
def byte_level_tok():
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the answer is 42", "hello world"] * 20, vocab_size=300,
                            min_frequency=1, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_control_sequences_in_sampled_text_are_escaped(name, byte_level_tok, tmp_path, capfd):
    attack = ATTACKS[name]
    ids = byte_level_tok.encode("the answer " + attack + " is 42", add_special_tokens=False)
    assert attack in byte_level_tok.decode(ids)  # the tokenizer lets every byte through
    sample = Sample(prompt_ids=[1, 2], response_ids=ids, reward=1.0, index=0)
    log = MetricsLogger(tmp_path, tensorboard=False, progress_bar=False)
    log.event(phases.sample_preview([sample], byte_level_tok, 1, step=3))
    log.close()
    shown = capfd.readouterr().err
    written = (tmp_path / "events.log").read_text()
    for out in (shown, written):
        assert "the answer" in out and "is 42" in out
        assert not any(not c.isprintable() and c not in "\n" for c in out), repr(out)
    assert printable(attack) in written


def test_plain_text_passes_unchanged(tmp_path, capfd):
    text = "réponse: 答案是 42 ✓ 🎉\n\tnext line"
    assert printable(text) == text
    log = MetricsLogger(tmp_path, tensorboard=False, progress_bar=False)
    log.event(text)
    log.close()
    assert text in capfd.readouterr().err
    assert text in (tmp_path / "events.log").read_text()


def test_escapes_name_the_character():
    assert printable("\x1b]0;t\x07") == "\\x1b]0;t\\x07"
    assert printable("a\u202eb") == "a\\u202eb"
    assert printable("\U000e0001") == "\\U000e0001"  # a tag character (format, invisible)
