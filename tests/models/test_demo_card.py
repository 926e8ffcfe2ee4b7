"""The demo models' cards: their sample conversations come from the real server (`server.py`
answering POST /v1/chat/completions), and the card says so with the request parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.demo_model.card import (
    MAX_TOKENS,
    ModelReport,
    PromptSample,
    Reply,
    SampledScores,
    ServerSamples,
    describe_server_settings,
    render_card,
    server_samples,
)
from scripts.demo_model.evaluate import GreetedScore, WordScore

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
MODEL_NAMES = ("demo-mini", "demo-flagship")
PROVENANCE = "Produced by the server in this repository: `server.py` started with"
SPEC = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "seq_len": 128,
    "max_steps": 10,
    "learning_rate": 0.002,
    "decay_steps": 10,
    "warmup_steps": 2,
    "batch_size": 4,
}
KNOWN = {"num_known": 6500, "num_scored": 400, "num_right": 390, "misses": []}
SUMMARY = {
    "spec": SPEC,
    "wall_time_s": 60.0,
    "num_tokens_seen": 5120,
    "cpu": "AMD EPYC, bfloat16 autocast",
    "known_words": KNOWN,
    "unfamiliar_words": {
        "less_common": {"num_scored": 100, "num_right": 63, "misses": []},
        "rare": {"num_scored": 100, "num_right": 81, "misses": []},
    },
    "data": {"num_words": 10, "num_fortunes": 3},
}


def _fake_report() -> ModelReport:
    samples = ServerSamples(
        prompts=(PromptSample("Hello!", Reply("Hi there.", "stop"), Reply("Quote\n-- Someone", "length"), 0),),
        chats=((("Hello!", Reply("Hi there.", "stop")), ("Use it in a sentence.", Reply("No.", "content_filter"))),),
        server_settings=describe_server_settings(),
    )
    greeted = GreetedScore(55, 50, (("Hi, who are you?", "The noun who means ..."),))
    sampled = (
        SampledScores("the model's default (temperature 0.6, top-p 0.9)", WordScore(100, 98, ()), greeted),
        SampledScores("OpenAI's default (temperature 1, top-p 1)", WordScore(100, 91, ()), GreetedScore(55, 40, ())),
    )
    quoted = WordScore(100, 88, ())
    return ModelReport("demo-test", 30.0, 31.0, 1_000_000, 2_000_000, samples, greeted, quoted, sampled)


def test_card_says_samples_come_from_the_server_with_request_parameters():
    report = _fake_report()
    text = render_card(report, [report], SUMMARY, (100, 10), {"demo-test": SUMMARY})
    assert PROVENANCE in text
    assert "default `config.toml`" in text and "safety screening on" in text
    assert "`POST /v1/chat/completions`" in text and '`"model": "demo-test"`' in text
    assert f'`"max_tokens": {MAX_TOKENS}`' in text and '`"temperature": 0`' in text
    assert "sampled (no `temperature` or `top_p`: the model's defaults" in text and "chat template" in text
    assert "transformers" not in text.split("## Sample conversations")[1]
    assert "> **demo-test (greedy):** Hi there." in text
    assert f"> **demo-test (sampled, seed 0):** Quote\\\n> -- Someone *(cut off at {MAX_TOKENS} tokens)*" in text
    chat = text.split("### Multi-turn chats")[1]
    assert "> **user:** Hello!\n>\n> **demo-test:** Hi there.\n>\n> **user:** Use it in a sentence." in chat
    assert "> **demo-test:** No. *(finish_reason: content_filter)*" in chat


def test_card_shows_the_scores_at_the_default_sampling_and_at_openais():
    report = _fake_report()
    section = render_card(report, [report], SUMMARY, (100, 10), {"demo-test": SUMMARY}).split("### Sampling defaults")[
        1
    ]
    assert "| demo-test | the model's default (temperature 0.6, top-p 0.9) | 98/100 (98%) | 50/55 (91%) |" in section
    assert "| demo-test | OpenAI's default (temperature 1, top-p 1) | 91/100 (91%) | 40/55 (73%) |" in section


def test_settings_description_names_overrides_and_safety_off():
    text = describe_server_settings(("--set", "safety.enabled=false"))
    assert "plus `safety.enabled=false`" in text and "safety screening off" in text


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_committed_cards_show_server_samples_and_multi_turn_chats(name):
    text = (MODELS_DIR / name / "README.md").read_text(encoding="utf-8")
    samples = text.split("## Sample conversations")[1].split("## Training data")[0]
    assert PROVENANCE in samples and "Generated with `transformers`" not in text
    assert samples.count(f"> **{name} (greedy):**") == samples.count(f"> **{name} (sampled, seed ") >= 5
    chats = samples.split("### Multi-turn chats")[1]
    assert chats.count("> **user:**") >= 4 and chats.count(f"> **{name}:**") >= 4


@pytest.mark.slow
def test_server_samples_greedy_replies_equal_transformers(tmp_path, loaded_models):
    """The card's HTTP path end to end: server.py serving demo-mini, replies as transformers'."""
    from scripts.demo_model.evaluate import sample_reply

    model_dir = MODELS_DIR / "demo-mini"
    args = ("--model", str(model_dir), "--set", "engine.device=cpu", "--set", "engine.dtype=float32")
    samples = server_samples(["demo-mini"], ["Hello!"], [["Hello!", "What does garden mean?"]], args)
    sample = samples["demo-mini"]
    model, tokenizer = loaded_models("demo-mini")
    hello = [{"role": "user", "content": "Hello!"}]
    assert sample.prompts[0].greedy == Reply(sample_reply(model, tokenizer, hello), "stop")
    assert sample.prompts[0].sampled.finish_reason in ("stop", "length") and sample.prompts[0].sampled.text
    (first, first_reply), (second, second_reply) = sample.chats[0]
    assert (first, first_reply) == ("Hello!", sample.prompts[0].greedy)
    history = [*hello, {"role": "assistant", "content": first_reply.text}, {"role": "user", "content": second}]
    assert second_reply.text == sample_reply(model, tokenizer, history)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_committed_cards_give_the_web_ui_a_description_and_three_example_prompts(name):
    from api.model_info import card_summary

    summary = card_summary(str(MODELS_DIR / name))
    assert summary.description and len(summary.example_prompts) == 3
    samples = (MODELS_DIR / name / "README.md").read_text(encoding="utf-8").split("### Single questions")[1]
    assert all(f"> **user:** {prompt}" in samples for prompt in summary.example_prompts)  # answers shown


def test_rendered_card_has_the_try_line_and_states_the_measured_known_word_share():
    report = _fake_report()
    text = render_card(report, [report], SUMMARY, (100, 10), {"demo-test": SUMMARY})
    lead = text.split("## Architecture")[0]
    assert 'Try: "Hello!", "What does water mean?", "Tell me a fortune."' in lead
    assert "first WordNet sense of 6,500 common English words" in lead
    assert "answered 390 of a sample of 400 of them with the first sense (97.5%" in lead
    assert "| demo-test | 1.0M | 390/400 (97.5%) | 88/100 | 50/55 (90.9%) | 63/100 | 81/100 | 30.00 | 31.00 |" in text
    assert "frequency ranks 4,000 to 60,000" in text
    assert "Greeted first messages:" in text
    assert "same weights bit for bit on the same kind of CPU (this build: AMD EPYC, bfloat16 autocast)" in text
