"""A backend that sends a model's requests to other OpenAI-compatible servers (docs/scale-out.md)."""
