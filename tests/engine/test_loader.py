"""Checkpoint loading: sharded and 16-bit checkpoints, and clear errors naming the bad file."""

from __future__ import annotations

import copy
import json
import re
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


def test_a_stale_shard_index_beside_a_single_file_is_not_read(model_copy):
    """transformers loads model.safetensors first; the index left from a sharded save was refused here."""
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert ModelRunner(model_copy, CONFIG) is not None


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


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_quantized_weight_without_a_quantization_config_is_refused_by_name(model_copy, dtype):
    """Cast to float as it was, such a checkpoint loaded and every answer came back empty."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_copy / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].clamp(-1, 1).to(dtype)
    save_file(tensors, model_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{re.escape(name)} is stored as {str(dtype)[6:]}, a quantized weight"):
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
    families = r"llama, mistral, ministral, ministral3, qwen2, qwen3"
    with pytest.raises(ModelLoadError, match=rf"model_type 'deepseek_v3' is not one of {families}"):
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


def _edit_config(model_dir, **changes):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        # transformers 5 refuses these through huggingface_hub's strict dataclasses (their own error types)
        ({"max_position_embeddings": 4096.0}, "Field 'max_position_embeddings' expected int, got float"),
        ({"max_position_embeddings": "512"}, "Field 'max_position_embeddings' expected int"),
        ({"rms_norm_eps": None}, "Field 'rms_norm_eps' expected float"),
        ({"tie_word_embeddings": 1}, "Field 'tie_word_embeddings' expected bool"),
        ({"use_cache": None}, "Field 'use_cache' expected bool"),
        ({"bos_token_id": [1, 2]}, "Field 'bos_token_id'"),
        ({"initializer_range": 1}, "Field 'initializer_range' expected float"),
        ({"head_dim": 15}, "even rotary dimension"),
        ({"num_attention_heads": 3}, "not a multiple of the number of attention heads"),
        ({"torch_dtype": "fp16"}, "torch_dtype must name a dtype (bfloat16, float16, float32); got 'fp16'"),
        # ... and these it accepts, but the engine cannot run
        ({"max_position_embeddings": 0}, "max_position_embeddings must be 1 or more; got 0"),
        ({"max_position_embeddings": -5}, "max_position_embeddings must be 1 or more; got -5"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be 1 or more; got 0"),
        ({"vocab_size": 0}, "vocab_size must be 1 or more"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be more than 0 and less than 1"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "rope_theta must be a number more than 0"),
    ],
)
def test_a_config_value_the_engine_cannot_use_is_one_load_error_naming_config_json(model_copy, changes, message):
    """Each was a traceback at start (or a server refusing every request for a context of 0)."""
    if "torch_dtype" in changes:
        _edit_config(model_copy, dtype=None)
    _edit_config(model_copy, **changes)
    with pytest.raises(ModelLoadError) as info:
        load_model_args(model_copy)
    assert str(info.value).startswith(f"{model_copy / 'config.json'}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_dtype_of_auto_is_taken_as_unset(model_copy):
    _edit_config(model_copy, dtype=None, torch_dtype="auto")  # transformers looked up torch.auto
    assert load_model_args(model_copy).hidden_size > 0


def test_a_context_too_long_to_size_up_front_needs_max_model_len(model_copy):
    from engine.native.loader import MAX_POSITIONS_WITHOUT_MAX_MODEL_LEN, preflight

    _edit_config(model_copy, max_position_embeddings=10**9)  # rope tables of tens of GB, before any request
    with pytest.raises(ModelLoadError, match=r"max_position_embeddings 1000000000 is more than .*max_model_len"):
        preflight(model_copy)
    preflight(model_copy, max_model_len=4096)  # the engine sizes its tables for the configured context
    _edit_config(model_copy, max_position_embeddings=MAX_POSITIONS_WITHOUT_MAX_MODEL_LEN)
    preflight(model_copy)


def test_a_shard_index_placing_a_tensor_in_the_wrong_shard_is_named_before_loading(tiny_models, tmp_path):
    from engine.native.loader import preflight

    sharded = tmp_path / "sharded"
    tiny_models.reference(VARIANT).save_pretrained(sharded, max_shard_size="60KB")
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, shard in index["weight_map"].items() if shard == shards[0])
    index["weight_map"][name] = shards[1]
    index_file.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=rf"lists {re.escape(name)} in {shards[1]}, which lacks it; it is in"):
        preflight(sharded)
    with pytest.raises(ModelLoadError, match=rf"{shards[1]}: cannot read {re.escape(name)}"):
        ModelRunner(sharded, CONFIG)  # loading without the preflight: the same, not safetensors' own error


@pytest.mark.parametrize("native_kernels", [True, False])
def test_each_layer_is_prepared_as_it_is_read_so_the_load_never_holds_two_layers_as_read(
    tiny_models, monkeypatch, native_kernels
):
    """int8 from a float checkpoint: the load's peak is the quantized model plus one layer as read
    (a whole model in float32 first would need 28 GB for a 7B checkpoint served as int8)."""
    import weakref

    from engine.native import loader

    read: list[weakref.ref] = []
    alive_at_each_read: list[int] = []
    as_read = loader._LayerReader.layer

    def layer(self):
        alive_at_each_read.append(sum(ref() is not None for ref in read))
        out = as_read(self)
        read.extend(weakref.ref(t) for t in (out.qkv, out.o_proj, out.gate_up, out.down))
        return out

    monkeypatch.setattr(loader._LayerReader, "layer", layer)
    config = EngineConfig(device="cpu", kv_cache_bytes=1 << 20, quantization="int8", native_kernels=native_kernels)
    runner = ModelRunner(tiny_models.path(VARIANT), config)
    assert len(alive_at_each_read) == runner.args.num_layers >= 2
    assert alive_at_each_read == [0] * runner.args.num_layers


# config.json of google/gemma-3-4b-it as released: the text model spelled out only where it
# differs from Gemma3TextConfig's defaults (no vocab_size, head counts or rope bases).
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_a_gemma3_release_config_gets_its_text_models_defaults_as_transformers_reads_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_CONFIG))
    args = load_model_args(tmp_path)
    assert (args.model_type, args.vocab_size, args.hidden_size, args.num_layers) == ("gemma3_text", 262208, 2560, 34)
    assert (args.num_heads, args.num_kv_heads, args.head_dim) == (8, 4, 256)
    assert args.attention_scale == 256**-0.5 and args.embedding_multiplier == 2560**0.5
    # five sliding layers (window 1024, rope base 10,000) to one global (1,000,000, linear x8)
    windows = [layer.sliding_window for layer in args.layers]
    assert windows[:6] == [1024] * 5 + [None] and windows.count(None) == 5
    assert [layer.rope for layer in args.layers[:6]] == ["sliding_attention"] * 5 + ["full_attention"]
    ropes = {name: dict(params) for name, params in args.rope_parameters}
    assert ropes["full_attention"] == {"factor": 8.0, "rope_theta": 1_000_000.0, "rope_type": "linear"}
    assert ropes["sliding_attention"] == {"rope_theta": 10_000.0, "rope_type": "default"}
    assert args.max_position_embeddings == 131072
