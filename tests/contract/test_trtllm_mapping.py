"""The adapter's pure translations: sampling fields, LLM arguments, finish reasons, stats, stop text."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from contract_harness import load_standin
from engine.detokenizer import StopStringFilter
from engine.trtllm.backend import TrtllmBackend, load_api
from engine.trtllm.mapping import (
    llm_kwargs,
    map_finish_reason,
    parse_iteration_stats,
    sampling_kwargs,
    supported_kwargs,
)
from engine.types import FinishReason, SamplingParams
from settings import TrtllmConfig


def test_greedy_maps_to_top_k_one_without_temperature_or_top_p():
    kwargs = sampling_kwargs(SamplingParams(max_tokens=5, temperature=0.0), eos_token_ids=())
    assert kwargs["top_k"] == 1 and kwargs["max_tokens"] == 5
    assert "temperature" not in kwargs and "top_p" not in kwargs


def test_sampling_fields_are_passed_through_explicitly():
    sampling = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=3,
        stop=("END",),
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        min_tokens=2,
        repetition_penalty=1.1,
    )
    kwargs = sampling_kwargs(sampling, eos_token_ids=())
    expected = {
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 3,
        "stop": ["END"],
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "n": 1,
        "ignore_eos": False,
    }
    assert {k: kwargs[k] for k in expected} == expected


def test_top_p_is_explicit_when_sampling_so_version_1_0_does_not_read_it_as_greedy():
    kwargs = sampling_kwargs(SamplingParams(max_tokens=4, temperature=1.0), eos_token_ids=())
    assert kwargs["top_p"] == 1.0 and "top_k" not in kwargs


def test_eos_ids_beyond_the_tokenizers_become_stop_token_ids_unless_eos_is_ignored():
    sampling = SamplingParams(max_tokens=4, stop_token_ids=(7,))
    assert sampling_kwargs(sampling, eos_token_ids=(2, 7, 9))["stop_token_ids"] == [7, 2, 9]
    ignoring = SamplingParams(max_tokens=4, stop_token_ids=(7,), ignore_eos=True)
    kwargs = sampling_kwargs(ignoring, eos_token_ids=(2, 9))
    assert kwargs["stop_token_ids"] == [7] and kwargs["ignore_eos"] is True


def test_finish_reasons_map_to_ours_and_unknown_ones_to_none():
    assert map_finish_reason("stop") is FinishReason.STOP
    assert map_finish_reason("length") is FinishReason.LENGTH
    assert map_finish_reason("cancelled") is FinishReason.ABORT
    assert map_finish_reason("timeout") is FinishReason.LENGTH
    assert map_finish_reason("not_finished") is None
    assert map_finish_reason(None) is None


def test_iteration_stats_parse_from_a_json_string_or_a_dict():
    entry = {
        "numActiveRequests": 3,
        "numQueuedRequests": 2,
        "iterLatencyMS": 4.5,
        "gpuMemUsage": 1e9,
        "inflightBatchingStats": {"numPausedRequests": 1},
        "kvCacheStats": {"maxNumBlocks": 100, "freeNumBlocks": 60, "usedNumBlocks": 40},
    }
    for raw in (entry, json.dumps(entry)):
        stats = parse_iteration_stats(raw)
        assert stats.num_queued == 2
        assert (stats.num_kv_blocks_total, stats.num_kv_blocks_free) == (100, 60)


def test_iteration_stats_derive_free_blocks_from_newer_alloc_total_blocks():
    stats = parse_iteration_stats({"kvCacheStats": {"maxNumBlocks": 50, "allocTotalBlocks": 20}})
    assert stats.num_kv_blocks_free == 30
    assert parse_iteration_stats("not json") is None
    assert parse_iteration_stats([1, 2]) is None


def test_stop_filter_holds_back_a_possible_stop_prefix_then_releases_it():
    stop = StopStringFilter(("END",))
    assert stop.update("Hello E", final=False) == "Hello"
    assert stop.update("Hello EN", final=False) == " "
    assert stop.update("Hello ENOUGH", final=False) == "ENOU"
    assert stop.update("Hello ENOUGH", final=True) == "GH"
    assert not stop.stopped


def test_stop_filter_cuts_at_a_stop_string_split_across_updates():
    stop = StopStringFilter(("\n\n", "###"))
    sent = stop.update("one\n", final=False)
    sent += stop.update("one\n\ntwo", final=False)
    assert sent == "one" and stop.stopped and stop.matched == "\n\n"
    assert stop.update("one\n\ntwo three", final=True) == ""


def test_stop_filter_names_the_stop_string_found_first_in_the_text():
    stop = StopStringFilter(("later", "soon"))
    assert stop.update("it comes soon, later", final=True) == "it comes " and stop.matched == "soon"
    assert StopStringFilter(("x",)).matched is None


def test_stop_filter_never_resends_when_the_final_text_is_shorter():
    stop = StopStringFilter(())
    assert stop.update("abcdef", final=False) == "abcdef"
    assert stop.update("abc", final=True) == ""


def test_stop_filter_holds_an_incomplete_utf8_character():
    stop = StopStringFilter(())
    assert stop.update("caf\ufffd", final=False) == "caf"
    assert stop.update("café", final=False) == "é"


def test_supported_kwargs_drops_keywords_the_installed_version_does_not_take():
    def generate_async(inputs, sampling_params=None, streaming=False):
        return None

    assert supported_kwargs(generate_async, {"streaming": True, "cache_salt": "x"}) == {"streaming": True}


def test_llm_kwargs_carry_every_configured_limit_and_turn_stats_on(monkeypatch):
    package, llmapi = load_standin()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    config = TrtllmConfig(
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        max_batch_size=32,
        max_num_tokens=4096,
        kv_cache_free_gpu_memory_fraction=0.8,
        kv_cache_host_bytes=1 << 30,
        enable_block_reuse=False,
        enable_chunked_prefill=False,
        scheduler_policy="max_utilization",
    )
    kwargs = llm_kwargs(load_api(), Path("/models/m"), config, max_seq_len=2048)
    assert kwargs["model"] == "/models/m"
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (2, 2)
    assert (kwargs["max_batch_size"], kwargs["max_num_tokens"], kwargs["max_seq_len"]) == (32, 4096, 2048)
    kv = kwargs["kv_cache_config"]
    assert (kv.free_gpu_memory_fraction, kv.enable_block_reuse, kv.host_cache_size) == (0.8, False, 1 << 30)
    assert kwargs["scheduler_config"].capacity_scheduler_policy is llmapi.CapacitySchedulerPolicy.MAX_UTILIZATION
    assert kwargs["enable_chunked_prefill"] is False and kwargs["enable_iter_perf_stats"] is True
    default_kv = llm_kwargs(load_api(), Path("/m"), TrtllmConfig(), max_seq_len=64)["kv_cache_config"]
    assert default_kv.host_cache_size is None


def test_max_model_len_is_the_smaller_of_the_model_and_trtllm_max_seq_len(tiny_model_dir):
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    capped = TrtllmBackend(tiny_model_dir, TrtllmConfig(max_seq_len=128), tokenizer, max_model_len=512)
    assert capped.max_model_len == 128
    assert TrtllmBackend(tiny_model_dir, TrtllmConfig(), tokenizer, max_model_len=512).max_model_len == 512
