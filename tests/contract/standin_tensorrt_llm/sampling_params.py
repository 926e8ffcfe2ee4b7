"""STAND-IN for `tensorrt_llm.SamplingParams` and `GuidedDecodingParams` (tests only): the documented 1.x fields."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    """As tensorrt_llm/sampling_params.py (1.x): only one guide may be set."""

    json: str | dict | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def _validate(self) -> None:
        num_guides = sum(bool(getattr(self, f.name)) for f in fields(self))
        if num_guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {num_guides}.")


@dataclass
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int | None = 32
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_perf_metrics: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    guided_decoding: Any = None

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.n > 1 and self.greedy:
            raise ValueError("n > 1 under greedy decoding needs TLLM_ALLOW_N_GREEDY_DECODING=1")
        if self.top_p is not None and not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        self.logprobs = self.logprobs and int(self.logprobs)  # as 1.x: 0 means none

    @property
    def greedy(self) -> bool:
        """As in 1.2: no sampling knobs at all, top_k 1, top_p 0 or temperature 0."""
        if self.use_beam_search:
            return False
        return (
            (self.temperature is None and self.top_p is None and self.top_k is None)
            or self.top_k == 1
            or self.top_p == 0.0
            or self.temperature == 0
        )
