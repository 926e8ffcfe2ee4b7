/* Every decoder layer of a decode-only step in one call (fp32, CPU).
 *
 * A step in which every row is one sequence's next token needs no prefill attention, so the
 * whole stack of layers can run here, calling the other kernels in turn, instead of about ten
 * calls per layer from Python (a few microseconds each, a tenth of a small step). Same
 * operations, same order as model.py's general path (_layer), for every served family: where
 * the norms sit (pre, sandwich, post), q/k norms per head or over the whole projection, partial
 * or per-layer RoPE, sliding-window layers (in a hybrid model, with their own KV group's block
 * tables and slots), soft-capped attention, SiLU or GELU-tanh.
 */
#include <string.h>

#include "kernels.h"

/* Per layer, the addresses (0: the layer has none) or values of: */
enum {
    F_INPUT_NORM,     /* RMSNorm before attention (0: OLMo 2) */
    F_QKV,            /* packed qkv, then its bias */
    F_QKV_BIAS,
    F_O_PROJ,         /* packed o_proj */
    F_POST_NORM,      /* RMSNorm before the MLP (0: OLMo 2) */
    F_GATE_UP,        /* packed gate_up, down */
    F_DOWN,
    F_K_CACHE,        /* this layer's KV cache */
    F_V_CACHE,
    F_QKV_SCALES,     /* int8 scales of qkv, o_proj, gate_up, down (0: that weight is fp32) */
    F_O_SCALES,
    F_GATE_UP_SCALES,
    F_DOWN_SCALES,
    F_Q_NORM,         /* q and k RMSNorm weights, before RoPE */
    F_K_NORM,
    F_QK_NORM_WHOLE,  /* 1: over the whole q (k) projection (OLMo 2); 0: per head (Qwen3, Gemma 3) */
    F_COS,            /* RoPE tables [max_positions, rotary_dim] (0: a layer without RoPE, SmolLM3) */
    F_SIN,
    F_ROTARY_DIM,     /* features rotated per head (Phi-3: part of head_dim) */
    F_ATTN_OUT_NORM,  /* RMSNorm on attention's output, before the residual add (Gemma, OLMo 2) */
    F_MLP_OUT_NORM,   /* RMSNorm on the MLP's output, before the residual add (Gemma, OLMo 2) */
    F_WINDOW,         /* sliding window (0: the whole context) */
    F_KV_GROUP,       /* 1: the sliding KV group's block tables and slots (hybrid models); 0: the global */
    F_BITS,           /* the quantized weights' bits (8: int8, 4: int4; unused for fp32) */
    FIELDS
};

static void add_rows(float *x, const float *delta, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] += delta[i];
}

/* qkv rows [tokens, qkv_width]: q and k RMSNormed in place, per head or over the whole projection. */
static void qk_norm(float *qkv, const int64_t *w, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    float eps)
{
    const float *q_norm = (const float *)w[F_Q_NORM], *k_norm = (const float *)w[F_K_NORM];
    const int64_t q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    const int whole = w[F_QK_NORM_WHOLE] != 0;
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * qkv_width;
        rms_norm_f32(row, 0, q_norm, row, whole ? 1 : heads, whole ? q_width : head_dim, eps);
        rms_norm_f32(row + q_width, 0, k_norm, row + q_width, whole ? 1 : kv_heads, whole ? kv_heads * head_dim : head_dim,
                     eps);
    }
}

/* x [tokens, hidden]: the residual stream, updated in place to the last layer's output.
 * slots[g], block_tables[g]: KV group g's (g = 1 only in hybrid models; both groups' tables have
 * max_blocks columns). gelu: the MLP's activation is GELU-tanh, else SiLU. softcap 0: none.
 * scratch: at least tokens * (3 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim
 * + 3 * intermediate) floats. */
/* Returns 0, or -1 when attention could not allocate its scratch (x is then partly updated). */
int decode_layers_f32(float *x, const int64_t *positions, const int64_t *const *slots,
                      const int32_t *const *block_tables, const int32_t *context_lens, int64_t max_blocks,
                      int64_t max_context_len, int64_t tokens, const int64_t *layers, int64_t num_layers,
                      int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                      int64_t block_size, int64_t gelu, float eps, float scale, float softcap, float *scratch)
{
    const int64_t q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    float *h = scratch, *delta = h + tokens * hidden, *attn_proj = delta + tokens * hidden;
    float *qkv = attn_proj + tokens * hidden, *q = qkv + tokens * qkv_width, *attn = q + tokens * q_width;
    float *gate_up = attn + tokens * q_width, *act = gate_up + tokens * 2 * intermediate;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *w = layers + l * FIELDS;
        const float *input_norm = (const float *)w[F_INPUT_NORM], *post_norm = (const float *)w[F_POST_NORM];
        const float *attn_out_norm = (const float *)w[F_ATTN_OUT_NORM];
        const float *mlp_out_norm = (const float *)w[F_MLP_OUT_NORM];
        float *k_cache = (float *)w[F_K_CACHE], *v_cache = (float *)w[F_V_CACHE];
        const int64_t group = w[F_KV_GROUP];
        /* The previous layer's MLP output is added to x here, folded into this layer's first norm. */
        const float *in = h;
        if (input_norm)
            rms_norm_f32(x, l ? delta : 0, input_norm, h, tokens, hidden, eps);
        else {
            if (l) add_rows(x, delta, tokens * hidden);
            in = x;
        }
        if (packed_linear(in, (const void *)w[F_QKV], (const float *)w[F_QKV_SCALES], (const float *)w[F_QKV_BIAS],
                          qkv, tokens, qkv_width, hidden, w[F_BITS]))
            return -1;
        if (w[F_Q_NORM]) qk_norm(qkv, w, tokens, heads, kv_heads, head_dim, eps);
        rope_and_cache_f32(qkv, positions, (const float *)w[F_COS], (const float *)w[F_SIN], k_cache, v_cache,
                           slots[group], tokens, heads, kv_heads, head_dim, w[F_ROTARY_DIM], block_size);
        for (int64_t t = 0; t < tokens; t++) memcpy(q + t * q_width, qkv + t * qkv_width, sizeof(float) * q_width);
        if (paged_decode_attention_f32(q, k_cache, v_cache, block_tables[group], context_lens, attn, tokens, heads,
                                       kv_heads, head_dim, max_blocks, block_size, max_context_len, scale,
                                       w[F_WINDOW], softcap))
            return -1;
        if (packed_linear(attn, (const void *)w[F_O_PROJ], (const float *)w[F_O_SCALES], 0, attn_proj, tokens, hidden,
                          q_width, w[F_BITS]))
            return -1;
        if (attn_out_norm) rms_norm_f32(attn_proj, 0, attn_out_norm, attn_proj, tokens, hidden, eps);
        in = h;
        if (post_norm)
            rms_norm_f32(x, attn_proj, post_norm, h, tokens, hidden, eps);
        else {
            add_rows(x, attn_proj, tokens * hidden);
            in = x;
        }
        if (packed_linear(in, (const void *)w[F_GATE_UP], (const float *)w[F_GATE_UP_SCALES], 0, gate_up, tokens,
                          2 * intermediate, hidden, w[F_BITS]))
            return -1;
        if (gelu)
            gelu_tanh_mul_f32(gate_up, act, tokens, intermediate);
        else
            silu_mul_f32(gate_up, act, tokens, intermediate);
        if (packed_linear(act, (const void *)w[F_DOWN], (const float *)w[F_DOWN_SCALES], 0, delta, tokens, hidden,
                          intermediate, w[F_BITS]))
            return -1;
        if (mlp_out_norm) rms_norm_f32(delta, 0, mlp_out_norm, delta, tokens, hidden, eps);
    }
    if (num_layers) add_rows(x, delta, tokens * hidden);
    return 0;
}
