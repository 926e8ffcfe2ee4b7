"""Checkpoint loading: sharded and 16-bit checkpoints, and clear errors naming the bad file."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from engine.native.loader import ModelLoadError, load_model_args, load_model_weights
from engine.native.runner import ModelRunner
from settings import EngineConfig

VARIANT = "untied-gqa-theta"
CONFIG = EngineConfig(device="cpu", kv_cache_bytes=1 << 20)


@pytest.fixture
def model_copy(tiny_models, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_models.path(VARIANT), target)
    return target


def greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    from engine.native.llm_engine import LLMEngine
    from engine.types import GenerationRequest, SamplingParams

    engine = LLMEngine.from_model_dir(model_dir, CONFIG, eos_token_ids=())
    engine.add_request(GenerationRequest("r", tuple(prompt), SamplingParams(max_tokens=n, temperature=0.0)))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_sharded_checkpoint_with_index_loads_the_same_weights(tiny_models, tmp_path):
    sharded = tmp_path / "sharded"
    tiny_models.reference(VARIANT).save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").exists() and not (sharded / "model.safetensors").exists()
    args = load_model_args(sharded)
    a = load_model_weights(sharded, args, torch.float32, torch.device("cpu"))
    b = load_model_weights(tiny_models.path(VARIANT), args, torch.float32, torch.device("cpu"))
    assert torch.equal(a.layers[1].qkv, b.layers[1].qkv) and torch.equal(a.lm_head, b.lm_head)
    assert not torch.equal(a.lm_head, a.embed)  # untied


def test_bfloat16_checkpoint_is_upcast_and_matches_transformers(tiny_models, tmp_path):
    from transformers import LlamaForCausalLM

    bf16 = tmp_path / "bf16"
    copy.deepcopy(tiny_models.reference(VARIANT)).to(torch.bfloat16).save_pretrained(bf16)  # .to() is in place
    shutil.copy(tiny_models.path(VARIANT) / "config.json", bf16 / "config.json")
    runner = ModelRunner(bf16, CONFIG)
    assert runner.model.weights.embed.dtype == torch.float32
    hf = LlamaForCausalLM.from_pretrained(bf16, dtype=torch.float32).eval()
    prompt = [5, 17, 33, 80, 4, 9]
    expected = hf.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=10**9, pad_token_id=0
    )
    assert greedy(bf16, prompt, 12) == expected[0, len(prompt) :].tolist()


def test_rope_theta_is_read_from_either_layout(tiny_models):
    new = load_model_args(tiny_models.path("tied-gqa-parameters"))
    old = load_model_args(tiny_models.path("untied-gqa-theta"))
    llama3 = load_model_args(tiny_models.path("tied-gqa-llama3-rope"))
    assert new.rope_theta == old.rope_theta == 10000.0
    assert new.rope_type == old.rope_type == "default"
    assert llama3.rope_type == "llama3" and llama3.rope_theta == 500000.0 and llama3.rope("")["factor"] == 8.0


def test_missing_config_is_named(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: missing"):
        ModelRunner(model_copy, CONFIG)


def test_malformed_config_is_named(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: cannot parse JSON"):
        load_model_args(model_copy)


def test_config_missing_a_key_names_the_key(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="missing key 'hidden_size'"):
        load_model_args(model_copy)


def test_unsupported_rope_type_is_refused(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "mrope", "factor": 4.0}
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope type 'mrope'"):
        load_model_args(model_copy)


def test_missing_weights_are_named(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        ModelRunner(model_copy, CONFIG)


def test_missing_shard_is_named(tiny_models, tmp_path):
    sharded = tmp_path / "sharded"
    tiny_models.reference(VARIANT).save_pretrained(sharded, max_shard_size="60KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{shard.name}: missing"):
        ModelRunner(sharded, CONFIG)


def test_corrupt_safetensors_is_named(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read safetensors"):
        ModelRunner(model_copy, CONFIG)


def test_shape_mismatch_names_the_tensor(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp\.gate_proj\.weight has shape"):
        ModelRunner(model_copy, CONFIG)


def test_a_bias_the_engine_does_not_apply_is_refused(model_copy):
    # A Llama checkpoint with attention_bias=True has o_proj biases: loading it without them
    # would give wrong answers, so it must fail by name instead.
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_copy / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(
        tensors["model.layers.1.self_attn.o_proj.weight"].shape[0]
    )
    save_file(tensors, model_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias is not supported"):
        ModelRunner(model_copy, CONFIG)


def test_auto_dtype_keeps_a_16_bit_checkpoint_on_cuda_and_upcasts_on_the_cpu():
    from engine.native.runner import resolve_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_dtype("auto", cuda, torch.float16) == torch.float16
    assert resolve_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", cuda, torch.float32) == torch.bfloat16
    assert resolve_dtype("auto", cpu, torch.bfloat16) == torch.float32
    assert resolve_dtype("float16", cpu, torch.bfloat16) == torch.float16


def test_a_family_the_engine_does_not_serve_is_refused_by_name(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"model_type 'deepseek_v3' is not one of llama, mistral, qwen2, qwen3"):
        ModelRunner(model_copy, CONFIG)


def test_an_unsupported_activation_is_refused_by_name(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["hidden_act"] = "relu2"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="hidden_act 'relu2' is not supported"):
        load_model_args(model_copy)


def test_an_engine_on_cuda_keeps_sdpa_off_cudnn_and_the_switch_exists_in_this_torch():
    # The switch is process-wide; the runner flips it when it loads on CUDA (this checks the
    # torch API it uses exists at the pinned version, where no GPU is needed to set the flag).
    from engine.native.runner import use_cuda_attention_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        use_cuda_attention_backends()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
