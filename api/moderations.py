"""POST /v1/moderations: OpenAI's moderation API, answered by the safety gate (gateway/safety/).

Each input is assessed as the gate screens a prompt whose only user turn it is (SafetyGate.assess:
the same deny/allow rules and thresholds, through the gate's micro-batcher, never on the event
loop), so `flagged` is true exactly when that prompt would be refused. The gate's categories are
mapped onto OpenAI's where they correspond (OPENAI_KEYS); OpenAI's others are false and 0.0, and
the gate's own findings (its categories, scores and rule matches) come in each result's
`safety_gate`. One request against the caller's per-minute request limit; nothing is billed.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiohttp import web

from api.chat import json_dumps, read_json
from api.connections import reads_body_itself
from api.errors import bad_request, not_found
from api.fields import kind_of
from api.state import PRINCIPAL, REQUEST_ID, STATE
from gateway.safety import Assessment, SafetyGate
from settings import ModerationsConfig

log = structlog.get_logger(__name__)

MODEL = "safety-gate"  # the `model` every answer names: what assessed it
_MODEL_ALIASES = ("omni-moderation", "text-moderation")  # OpenAI's names (and dated ones) are served by the gate
_KNOWN = frozenset({"model", "input"})

# OpenAI's categories, every field of the `openai` SDK's Moderation.categories, in its order.
OPENAI_CATEGORIES: tuple[str, ...] = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/instructions",
    "self-harm/intent",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)
# The gate's categories -> the OpenAI categories whose definitions cover them. A sub-category's
# text is its parent's too (instructions for a bomb are illicit), so weapons also mark illicit and
# sexual_minors sexual; those parents are judged only as far as these sub-categories reach. An
# operator's rule category named after one of OpenAI's (deny."violence") maps to that one.
OPENAI_KEYS: dict[str, tuple[str, ...]] = {
    "weapons": ("illicit", "illicit/violent"),
    "malware": ("illicit",),
    "self_harm": ("self-harm",),
    "sexual_minors": ("sexual", "sexual/minors"),
    "hate": ("hate",),
}
RULE_SCORE = 1.0  # what a deny rule's match scores in OpenAI's category_scores: a rule is certain


def openai_keys(category: str) -> tuple[str, ...]:
    return OPENAI_KEYS.get(category, (category,) if category in OPENAI_CATEGORIES else ())


def parse_inputs(raw: object, cfg: ModerationsConfig) -> tuple[str, ...]:
    """The request body -> one text per result; a 400 naming the field for anything else."""
    if not isinstance(raw, dict):
        raise bad_request(f"The request body must be a JSON object, got {kind_of(raw)}.", param=None)
    for key in raw:
        if key not in _KNOWN:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    _check_model(raw.get("model"))
    texts = _inputs(raw.get("input"), cfg.max_inputs)
    num_chars = sum(len(t) for t in texts)
    if num_chars > cfg.max_chars:
        raise bad_request(
            f"'input' holds {num_chars} characters; at most {cfg.max_chars} are read in one request "
            "(moderations.max_chars). Send them in several requests.",
            param="input",
            code="string_above_max_length",
        )
    return texts


def _check_model(value: object) -> None:
    """Optional; this gate, or any of OpenAI's moderation models (which it stands in for)."""
    if value is None:
        return
    if not isinstance(value, str) or not value:
        got = "an empty string" if value == "" else kind_of(value)
        raise bad_request(f"'model' must be a model name string, got {got}.", param="model")
    if value != MODEL and not value.startswith(_MODEL_ALIASES):
        raise not_found(
            f"The model '{value}' does not exist or you do not have access to it (moderation: '{MODEL}', "
            f"or OpenAI's omni-moderation-* and text-moderation-* names).",
            code="model_not_found",
            param="model",
        )


def _inputs(value: object, max_inputs: int) -> tuple[str, ...]:
    """A string, an array of strings (one result each), or an array of multimodal parts (one result)."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise bad_request(
            "'input' must be a string, a non-empty array of strings, or a non-empty array of "
            f'{{"type": "text", "text": ...}} parts; got {"an empty array" if value == [] else kind_of(value)}.',
            param="input",
        )
    if len(value) > max_inputs:
        raise bad_request(
            f"'input' has {len(value)} items; at most {max_inputs} are allowed (moderations.max_inputs).",
            param="input",
            code="array_above_max_length",
        )
    if isinstance(value[0], dict):
        return (_multimodal_text(value),)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise bad_request(
                f"'input[{i}]' must be a string, as 'input[0]' is; got {kind_of(item)}.", param=f"input[{i}]"
            )
    return tuple(value)


def _multimodal_text(parts: list) -> str:
    """One multimodal input's text parts, joined with newlines as the gate joins a message's."""
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            raise bad_request(
                f"'input[{i}]' is an image: this server's moderation (its safety gate) reads text only and cannot "
                "assess images. Send the text parts alone.",
                param=f"input[{i}]",
                code="image_input_not_supported",
            )
        if kind != "text":
            got = kind_of(part) if not isinstance(part, dict) else f"type {kind!r}"
            raise bad_request(
                f"'input[{i}]' must be a part of type text (or image_url, not assessed here), as 'input[0]' is; "
                f"got {got}.",
                param=f"input[{i}]",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"'input[{i}].text' must be a string, got {kind_of(text)}.", param=f"input[{i}].text")
        texts.append(text)
    return "\n".join(texts)


def render_result(assessment: Assessment, gate: SafetyGate) -> dict:
    """One input's result in OpenAI's shape, with the gate's own findings in `safety_gate`."""
    flagged, scores = set(assessment.flagged), assessment.scores or {}
    categories = dict.fromkeys(OPENAI_CATEGORIES, False)
    category_scores = dict.fromkeys(OPENAI_CATEGORIES, 0.0)
    applied: dict[str, list[str]] = {key: [] for key in OPENAI_CATEGORIES}
    for category in gate.categories:
        score = RULE_SCORE if category in assessment.rule_categories else scores.get(category, 0.0)
        for key in openai_keys(category):
            categories[key] = categories[key] or category in flagged
            category_scores[key] = max(category_scores[key], score)
            applied[key] = ["text"]
    verdict = assessment.verdict
    return {
        "flagged": not verdict.allowed,
        "categories": categories,
        "category_scores": category_scores,
        "category_applied_input_types": applied,
        "safety_gate": {
            "categories": {c: c in flagged for c in gate.categories},
            "category_scores": assessment.scores,  # the classifier's; null when it is off
            "rule_matches": list(assessment.rule_categories),
            "layer": None if verdict.layer is None else verdict.layer.value,  # what a prompt's refusal would name
            "category": verdict.category,
        },
    }


@reads_body_itself
async def create_moderation(request: web.Request) -> web.Response:
    state = request.app[STATE]
    gate = state.safety
    if gate is None:
        raise not_found(
            "Moderation is not served here: safety.enabled is false, so this server screens nothing.",
            code="model_not_found",
        )
    started_s = time.monotonic()
    caller = state.charge_request(request[PRINCIPAL])  # before the body is read; not billed
    texts = parse_inputs(await read_json(request), state.settings.moderations)
    assessments = await asyncio.gather(*(gate.assess(text, tier=caller.tier_name) for text in texts))
    results = [render_result(a, gate) for a in assessments]
    log.info(
        "moderation_finished",
        tier=caller.tier_name,
        num_inputs=len(results),
        num_flagged=sum(r["flagged"] for r in results),
        total_ms=round((time.monotonic() - started_s) * 1000.0, 3),
    )
    body = {"id": "modr-" + request[REQUEST_ID].removeprefix("req_"), "model": MODEL, "results": results}
    return web.json_response(body, dumps=json_dumps, headers=state.limit_headers(caller))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/moderations", create_moderation)
