"""The model's generation_config.json stop ids (Gemma 3: eos_token_id [1, 106], 106 =
<end_of_turn>) stop rollouts without being set by hand: read where the tokenizer is loaded,
added to every request's stop ids, for the embedded engine and SGLang requests alike (issue 43,
item 10)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.loop import build
from megatron_gspo.rollout.engine import GenerateRequest, SamplingParams
from megatron_gspo.rollout.generation_config import generation_stop_ids

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen_cfg") / "model"
    shutil.copytree(TINY / "base", d)
    return d


def _cfg(model_dir):
    return load_config(TINY / "config.yaml", [f"model.path={model_dir}", "data.eval_path=null",
                                              "train.eval_interval=0"])


def _greedy(engine, prompt_ids, sp):
    req = GenerateRequest(prompt_ids=list(prompt_ids), sampling=replace(sp, n=1, temperature=0.0))
    return engine.generate([req])[0]


def test_a_generation_config_stop_id_stops_the_embedded_engine_and_reaches_sglang(model_dir):
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = build.tokenizer(_cfg(model_dir))
    prompt = tok.encode("What is 12+34?")
    engine = EmbeddedEngine(str(model_dir), dtype="float32", seed=1)
    free = _greedy(engine, prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    stops = {0, 2, tok.eos_token_id}
    k = next(i for i, t in enumerate(free.response_ids) if t not in stops)
    stop_id = free.response_ids[k]  # a token the greedy response holds: make it a stop id
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop_id]}))
    tok = build.tokenizer(_cfg(model_dir))
    sp = SamplingParams.for_rollouts(_cfg(model_dir).rollout, tok)
    assert stop_id in sp.stop_token_ids and 2 in sp.stop_token_ids
    assert stop_id in sp.to_sglang()["stop_token_ids"]  # what SGLang requests carry
    out = _greedy(engine, prompt, sp)
    assert out.response_ids[-1] == stop_id and out.finish_reason == "stop"
    assert len(out.response_ids) <= k + 1


@pytest.mark.parametrize("eos,ids", [(106, [106]), ([1, 106], [1, 106]), (None, [])])
def test_eos_token_id_is_an_int_or_a_list(model_dir, eos, ids):
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert generation_stop_ids(model_dir) == ids
    tok = build.tokenizer(_cfg(model_dir))
    assert set(ids) <= set(SamplingParams.for_rollouts(_cfg(model_dir).rollout, tok)
                           .stop_token_ids)


def test_no_generation_config_adds_nothing_and_a_bad_one_is_a_config_error(model_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    assert generation_stop_ids(bare) == []
    (model_dir / "generation_config.json").write_text('{"eos_token_id": "end"}')
    with pytest.raises(ConfigError, match=r"model.path: .*generation_config.json: eos_token_id "
                                          r"'end' is not a token id"):
        build.tokenizer(_cfg(model_dir))
    (model_dir / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="a JSON list, expected an object"):
        build.tokenizer(_cfg(model_dir))
