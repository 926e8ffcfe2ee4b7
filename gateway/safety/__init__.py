"""The safety gate: rules, an embedding classifier and an optional guard model, applied to
prompts before the engine and to answers while they stream. See gate.py for the entry point.
"""

from gateway.safety.gate import SafetyGate, load_classifier, user_turns
from gateway.safety.guard import GUARD_ERROR, GuardModel
from gateway.safety.output import OutputFilter
from gateway.safety.types import CATEGORIES, SafetyLayer, Stage, Verdict

__all__ = [
    "CATEGORIES", "GUARD_ERROR", "GuardModel", "OutputFilter", "SafetyGate", "SafetyLayer", "Stage", "Verdict",
    "load_classifier", "user_turns",
]
