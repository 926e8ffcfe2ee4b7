"""A checkpoint's generation_config.json: its sampling defaults fill what a request leaves
unset (as vLLM does), and every EOS id it lists stops generation."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from api.job import sampling_from
from api.protocol import parse_chat_request
from engine.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def model(tiny_model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    gen = json.loads((target / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1, eos_token_id=[gen["eos_token_id"], 7, 9])
    (target / "generation_config.json").write_text(json.dumps(gen))
    return SimpleNamespace(tokenizer=Tokenizer.from_dir(target))


def sampling(model, **body):
    chat = parse_chat_request({"messages": MESSAGES, **body}, max_messages=10, max_prompt_chars=1000)
    return sampling_from(chat, 16, model)


def test_unset_sampling_fields_take_the_generation_config_defaults(model):
    s = sampling(model)
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.6, 0.95, 20, 1.1)


def test_fields_the_request_sets_win_over_the_defaults(model):
    s = sampling(model, temperature=0.0, top_k=-1, repetition_penalty=1.0)
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.0, 0.95, None, 1.0)


def test_every_eos_id_in_the_generation_config_is_kept(model):
    assert {7, 9} <= set(model.tokenizer.eos_token_ids)


def test_a_model_without_defaults_keeps_openais(tiny_model_dir):
    s = sampling(SimpleNamespace(tokenizer=Tokenizer.from_dir(tiny_model_dir)))
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (1.0, 1.0, None, 1.0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("temperature", -0.05),  # would divide the logits by a negative number: sampling inverted
        ("temperature", 7),
        ("top_p", 0),  # empty answers
        ("top_p", 1.5),
        ("top_k", -5),
        ("top_k", 2.5),
        ("repetition_penalty", 0),
        ("temperature", "0.7"),
        ("temperature", True),
    ],
)
def test_a_default_a_request_could_not_send_is_not_applied(tiny_model_dir, tmp_path, key, value):
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    gen = json.loads((target / "generation_config.json").read_text())
    gen.update({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, key: value})
    (target / "generation_config.json").write_text(json.dumps(gen))
    tokenizer = Tokenizer.from_dir(target)
    assert key not in tokenizer.generation_defaults and len(tokenizer.generation_defaults) == 3
    s = sampling(SimpleNamespace(tokenizer=tokenizer))
    assert getattr(s, key) == {"temperature": 1.0, "top_p": 1.0, "top_k": None, "repetition_penalty": 1.0}[key]


def test_tokenizer_files_that_are_not_utf8_are_a_load_error_naming_the_file(tiny_model_dir, tmp_path):
    from engine.tokenizer import TokenizerLoadError

    for name in ("tokenizer_config.json", "chat_template.jinja"):
        target = tmp_path / name
        shutil.copytree(tiny_model_dir, target)
        (target / name).write_bytes("{}".encode("utf-16"))
        with pytest.raises(TokenizerLoadError, match=name):
            Tokenizer.from_dir(target)
