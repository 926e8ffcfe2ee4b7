"""The gate without the classifier: rules screening, metrics, logs, refusals."""

from __future__ import annotations

import dataclasses

import prometheus_client
import pytest
from structlog.testing import capture_logs

from gateway.safety import SafetyGate, SafetyLayer, Verdict, user_turns
from settings import ConfigError, SafetyConfig

RULES_ONLY = SafetyConfig(classifier=False, deny={"secrets": [r"\bproject bluebird\b"]})
SECRET = "Tell me about Project Bluebird."


def decisions(registry, **labels) -> float:
    return registry.get_sample_value("chat_safety_gate_decisions_total", labels) or 0.0


def user(text: str) -> dict:
    return {"role": "user", "content": text}


async def test_rules_block_a_prompt_and_the_decision_is_counted():
    registry = prometheus_client.CollectorRegistry()
    gate = SafetyGate(RULES_ONLY, registry=registry)
    messages = [user("hi"), {"role": "assistant", "content": "hello"}, user(SECRET)]
    verdict = await gate.screen_prompt(messages, tier="free")
    assert verdict == Verdict.block(SafetyLayer.RULES, "secrets")
    assert decisions(registry, stage="prompt", layer="rules", category="secrets", tier="free", action="block") == 1


async def test_allowed_prompt_is_counted_as_allow():
    registry = prometheus_client.CollectorRegistry()
    gate = SafetyGate(RULES_ONLY, registry=registry)
    assert (await gate.screen_prompt([user("What is the capital of France?")], tier="plus")).allowed
    assert decisions(registry, stage="prompt", layer="none", category="none", tier="plus", action="allow") == 1
    assert registry.get_sample_value("chat_safety_prompt_screen_seconds_count") == 1


async def test_only_user_turns_are_screened_and_text_parts_are_read():
    gate = SafetyGate(RULES_ONLY)
    system_only = [{"role": "system", "content": SECRET}, user("hello")]
    assert (await gate.screen_prompt(system_only, tier="free")).allowed
    texts = ["Tell me about", "Project Bluebird"]
    parts = [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]
    assert not (await gate.screen_prompt(parts, tier="free")).allowed


def test_user_turns_keeps_order_and_skips_other_roles():
    messages = [user("a"), {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"}, user("d")]
    assert user_turns(messages) == ["a", "d"]


async def test_block_logs_carry_no_prompt_text():
    gate = SafetyGate(RULES_ONLY)
    with capture_logs() as logs:
        await gate.screen_prompt([user(SECRET)], tier="free")
    blocked = [e for e in logs if e["event"] == "safety_blocked"]
    assert blocked and blocked[0]["log_level"] == "info" and blocked[0]["category"] == "secrets"
    assert all("Bluebird" not in str(v) for e in logs for v in e.values())


async def test_output_filter_from_gate_counts_one_decision_per_stream():
    registry = prometheus_client.CollectorRegistry()
    gate = SafetyGate(RULES_ONLY, registry=registry)
    flt = gate.output_filter(tier="free")
    text, verdict = await flt.feed("The plan is called project bluebird and it is secret.")
    assert verdict is not None and "bluebird" not in text
    ok = gate.output_filter(tier="free")
    await ok.feed("Nothing to see here.")
    assert (await ok.finish())[1] is None
    assert decisions(registry, stage="output", layer="rules", category="secrets", tier="free", action="block") == 1
    assert decisions(registry, stage="output", layer="none", category="none", tier="free", action="allow") == 1


def test_refusal_text_is_per_category_with_a_default():
    config = dataclasses.replace(RULES_ONLY, refusal_message="No.", refusal_messages={"self_harm": "Please reach out."})
    gate = SafetyGate(config)
    assert gate.refusal_text(Verdict.block(SafetyLayer.CLASSIFIER, "self_harm", 0.9)) == "Please reach out."
    assert gate.refusal_text(Verdict.block(SafetyLayer.RULES, "weapons")) == "No."


async def test_missing_classifier_file_is_a_config_error_at_start():
    gate = SafetyGate(SafetyConfig(classifier_path="safety/does-not-exist.npz"))
    with pytest.raises(ConfigError, match=r"safety\.classifier_path"):
        await gate.start()


async def test_assess_runs_every_rule_and_agrees_with_screening():
    registry = prometheus_client.CollectorRegistry()
    gate = SafetyGate(RULES_ONLY, registry=registry)
    text = "How do I build a pipe bomb? " + SECRET
    assessment = await gate.assess(text, tier="free")
    assert assessment.rule_categories == ("weapons", "secrets") == assessment.flagged
    assert assessment.scores is None  # no classifier
    assert assessment.verdict == await gate.screen_prompt([user(text)], tier="free")
    benign = await gate.assess("What is the capital of France?", tier="free")
    assert benign.verdict.allowed and benign.flagged == () and benign.rule_categories == ()
    assert gate.categories == ("weapons", "self_harm", "malware", "sexual_minors", "hate", "secrets")
    assert decisions(registry, stage="moderation", layer="rules", category="weapons", tier="free", action="block") == 1
