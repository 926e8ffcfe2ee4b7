/* Every decoder layer of a decode-only step in one call (fp32, CPU).
 *
 * A step in which every row is one sequence's next token needs no prefill attention, so the
 * whole stack of layers can run here, calling the other kernels in turn, instead of about ten
 * calls per layer from Python (a few microseconds each, a tenth of a small step). Same
 * operations, same order, same results as model.py's _forward_fused.
 */
#include <string.h>

#include "kernels.h"

/* Per layer, the addresses of: input_norm, qkv (packed), qkv_bias (0: none), o_proj (packed),
 * post_norm, gate_up (packed), down (packed), k_cache, v_cache, then the int8 scales of qkv,
 * o_proj, gate_up and down (0: that weight is fp32), then q_norm and k_norm (per-head RMSNorm
 * weights applied before RoPE, as Qwen3 does; 0: none), then whether the layer uses RoPE
 * (SmolLM3 leaves it out of some layers). */
#define FIELDS 16

/* x [tokens, hidden]: the residual stream, updated in place to the last layer's output.
 * scratch: at least tokens * (3 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim
 * + 3 * intermediate) floats. */
/* Returns 0, or -1 when attention could not allocate its scratch (x is then partly updated). */
int decode_layers_f32(float *x, const int64_t *positions, const int64_t *slots, const float *cos_table,
                       const float *sin_table, const int32_t *block_tables, const int32_t *context_lens,
                       int64_t max_blocks, int64_t max_context_len, int64_t tokens, const int64_t *layers,
                       int64_t num_layers, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t intermediate, int64_t block_size, float eps, float scale, float *scratch)
{
    const int64_t q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    float *h = scratch, *delta = h + tokens * hidden, *attn_proj = delta + tokens * hidden;
    float *qkv = attn_proj + tokens * hidden, *q = qkv + tokens * qkv_width, *attn = q + tokens * q_width;
    float *gate_up = attn + tokens * q_width, *act = gate_up + tokens * 2 * intermediate;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *w = layers + l * FIELDS;
        const float *input_norm = (const float *)w[0], *qkv_w = (const float *)w[1], *qkv_b = (const float *)w[2];
        const float *o_w = (const float *)w[3], *post_norm = (const float *)w[4];
        const float *gate_up_w = (const float *)w[5], *down_w = (const float *)w[6];
        float *k_cache = (float *)w[7], *v_cache = (float *)w[8];
        const float *qkv_s = (const float *)w[9], *o_s = (const float *)w[10];
        const float *gate_up_s = (const float *)w[11], *down_s = (const float *)w[12];
        const float *q_norm = (const float *)w[13], *k_norm = (const float *)w[14];

        rms_norm_f32(x, l ? delta : 0, input_norm, h, tokens, hidden, eps);
        packed_linear(h, qkv_w, qkv_s, qkv_b, qkv, tokens, qkv_width, hidden);
        if (q_norm)  /* each head's q and k normalised in place: rows of head_dim */
            for (int64_t t = 0; t < tokens; t++) {
                float *row = qkv + t * qkv_width;
                rms_norm_f32(row, 0, q_norm, row, heads, head_dim, eps);
                rms_norm_f32(row + q_width, 0, k_norm, row + q_width, kv_heads, head_dim, eps);
            }
        rope_and_cache_f32(qkv, positions, w[15] ? cos_table : 0, sin_table, k_cache, v_cache, slots, tokens, heads,
                           kv_heads, head_dim, block_size);
        for (int64_t t = 0; t < tokens; t++) memcpy(q + t * q_width, qkv + t * qkv_width, sizeof(float) * q_width);
        if (paged_decode_attention_f32(q, k_cache, v_cache, block_tables, context_lens, attn, tokens, heads, kv_heads,
                                       head_dim, max_blocks, block_size, max_context_len, scale))
            return -1;
        packed_linear(attn, o_w, o_s, 0, attn_proj, tokens, hidden, q_width);
        rms_norm_f32(x, attn_proj, post_norm, h, tokens, hidden, eps);
        packed_linear(h, gate_up_w, gate_up_s, 0, gate_up, tokens, 2 * intermediate, hidden);
        silu_mul_f32(gate_up, act, tokens, intermediate);
        packed_linear(act, down_w, down_s, 0, delta, tokens, hidden, intermediate);
    }
    if (num_layers)
        for (int64_t i = 0; i < tokens * hidden; i++) x[i] += delta[i];
    return 0;
}
