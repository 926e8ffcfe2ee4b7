"""One tiny checkpoint per served family for the engine tests (a module of its own, so test
files import it by a name no other test folder's conftest shadows)."""

from __future__ import annotations

SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 48,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.5,
}
# One checkpoint per served family (transformers' own config class), small enough to test in
# seconds, with every feature the family adds switched on at a size that changes the output.
FAMILY_VARIANTS = {
    "qwen3": dict(model_type="qwen3", head_dim=32, seed=10),
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=16,
        num_hidden_layers=3,
        layer_types=SLIDING,
        sliding_window=24,
        query_pre_attn_scalar=20,
        final_logit_softcapping=5.0,
        seed=11,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
    ),
    # Gemma 3 at 4B and up: Gemma3ForConditionalGeneration, its language model under
    # 'language_model.' (served text only), the wrapper's config spelling out the text model.
    "gemma3-multimodal": dict(
        model_type="gemma3",
        head_dim=16,
        num_hidden_layers=3,
        layer_types=SLIDING,
        sliding_window=24,
        query_pre_attn_scalar=20,
        seed=19,
    ),
    "gemma2": dict(
        model_type="gemma2",
        head_dim=16,
        num_hidden_layers=3,
        layer_types=SLIDING,
        sliding_window=24,
        query_pre_attn_scalar=20,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        seed=12,
    ),
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5, sliding_window=40, seed=13),
    "phi3-longrope": dict(
        model_type="phi3",
        seed=14,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + i / 10 for i in range(6)],
            "long_factor": [2.0 + i for i in range(6)],
        },
    ),
    "smollm3": dict(model_type="smollm3", num_hidden_layers=3, no_rope_layer_interval=2, seed=15),
    # Ministral 8B: sliding and global layers interleaved, one rope for all
    "ministral": dict(
        model_type="ministral", num_hidden_layers=3, layer_types=SLIDING, sliding_window=24, head_dim=16, seed=23
    ),
    "mistral-sliding": dict(model_type="mistral", sliding_window=24, head_dim=16, seed=16),
    # Hunyuan dense: q/k norms after rope, and its releases' NTK-alpha rope ("dynamic" with alpha)
    "hunyuan": dict(
        model_type="hunyuan_v1_dense",
        head_dim=16,
        seed=26,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0},
    ),
    # Ministral 3: YaRN, and queries scaled past the original context (48 here: the workload crosses it)
    "ministral3": dict(model_type="ministral3", head_dim=16, seed=24, rope_parameters=MINISTRAL3_ROPE),
    # its releases: Mistral3ForConditionalGeneration, the language model beside a Pixtral tower
    "ministral3-multimodal": dict(model_type="mistral3", head_dim=16, seed=25, rope_parameters=MINISTRAL3_ROPE),
    "granite": dict(
        model_type="granite",
        embedding_multiplier=4.0,
        attention_multiplier=0.3,
        residual_multiplier=0.6,
        logits_scaling=2.5,
        seed=17,
    ),
    "olmo2": dict(model_type="olmo2", seed=18),
    # ERNIE 4.5 0.3B's layout: interleaved rope, heads * head_dim twice the hidden size, tied embeddings
    "ernie4_5": dict(model_type="ernie4_5", head_dim=32, tie_word_embeddings=True, seed=24),
    # GLM-4 0414's layout: interleaved rope on half of each head, q/k/v biases, fused gate_up_proj,
    # norms on attention's and the MLP's outputs too
    "glm4": dict(model_type="glm4", head_dim=16, partial_rotary_factor=0.5, seed=25),
    # EXAONE 4.0 32B's layout: three sliding layers with rope to one global layer without
    "exaone4": dict(
        model_type="exaone4", num_hidden_layers=4, sliding_window=24, sliding_window_pattern=4, head_dim=16, seed=21
    ),
    # EXAONE 4.0 1.2B: every layer global, with rope
    "exaone4-global": dict(model_type="exaone4", sliding_window=None, layer_types=["full_attention"] * 2, seed=22),
    "olmo3": dict(
        model_type="olmo3",
        num_hidden_layers=3,
        layer_types=SLIDING,
        sliding_window=24,
        seed=20,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-yarn": dict(
        model_type="llama",
        seed=19,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    "llama-dynamic": dict(
        model_type="llama", seed=20, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    ),
}
