"""The safety gate: rules and an embedding classifier, applied to
prompts before the engine and to answers while they stream. See gate.py for the entry point.
"""

from gateway.safety.gate import SafetyGate, load_classifier, user_turns
from gateway.safety.types import Assessment, SafetyLayer, Verdict

__all__ = ["Assessment", "SafetyGate", "SafetyLayer", "Verdict", "load_classifier", "user_turns"]
