/* The small per-layer operations of a step, fused, for CPUs (fp32).
 *
 * A decode step runs each of these on a few rows of a few hundred floats: in eager PyTorch
 * each is several ops, and each op costs more to dispatch (about 10 us) than its arithmetic.
 * One call here does the whole operation: RMSNorm (optionally adding the residual first),
 * SiLU(gate) * up or GELU-tanh(gate) * up, and RoPE on q and k with the new K/V written into
 * the paged cache.
 * Numerics follow transformers' Llama in fp32: RMSNorm's mean of squares is accumulated in
 * fp32 (its order of summation differs, as any two kernels' do).
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* Parallel only when there is enough work to pay for waking the other threads. */
#define PARALLEL_MIN_FLOATS 32768

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight. With residual: x[r] += residual[r] first
 * (x is updated in place, as the residual stream), then normalised into out. */
void rms_norm_f32(float *x, const float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
                  float eps)
{
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        if (residual) {
            const float *res = residual + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) xr[i] += res[i];
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* gate_up [rows, 2 * dim] (gate | up) -> out [rows, dim] = silu(gate) * up. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t dim)
{
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * dim, *u = g + dim;
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* gate_up [rows, 2 * dim] (gate | up) -> out [rows, dim] = gelu_tanh(gate) * up, GELU's tanh
 * approximation as PyTorch's gelu(approximate="tanh") (Gemma's gelu_pytorch_tanh). */
void gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t dim)
{
    const float k0 = 0.7978845608028654f, k1 = 0.044715f; /* sqrt(2 / pi) */
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * dim, *u = g + dim;
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) {
            const float x = g[i];
            o[i] = 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x))) * u[i];
        }
    }
}

/* qkv [tokens, (heads + 2 * kv_heads) * head_dim]: rotate the q and k heads in place (rotate-half
 * RoPE on each head's first rotary_dim features, the rest passing through (Phi-3's partial
 * rotary); cos/sin tables [max_positions, rotary_dim] with both halves filled; cos_table 0: a
 * layer without RoPE, nothing rotated), then copy each token's
 * k and v into the paged cache at its slot: k_cache [blocks, kv_heads, head_dim, block_size]
 * (transposed), v_cache [slots, kv_heads, head_dim]. */
void rope_and_cache_f32(float *qkv, const int64_t *positions, const float *cos_table, const float *sin_table,
                        float *k_cache, float *v_cache, const int64_t *slots, int64_t tokens, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, int64_t block_size)
{
    const int64_t width = (heads + 2 * kv_heads) * head_dim, half = rotary_dim / 2;
    /* Each token's k lands in head_dim scattered cache lines (K blocks are transposed): memory-
     * bound from a few tokens on, so both threads help early. */
#pragma omp parallel for schedule(static) if (tokens >= 8)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * width;
        const float *c = cos_table ? cos_table + positions[t] * rotary_dim : 0;
        const float *s = cos_table ? sin_table + positions[t] * rotary_dim : 0;
        for (int64_t h = 0; cos_table && h < heads + kv_heads; h++) {
            float *x = row + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] - b * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
        const int64_t slot = slots[t], block = slot / block_size, offset = slot % block_size;
        const float *k = row + heads * head_dim, *v = k + kv_heads * head_dim;
        for (int64_t h = 0; h < kv_heads; h++) {
            float *kb = k_cache + ((block * kv_heads + h) * head_dim) * block_size + offset;
            for (int64_t i = 0; i < head_dim; i++) kb[i * block_size] = k[h * head_dim + i];
        }
        float *vs = v_cache + slot * kv_heads * head_dim;
        for (int64_t i = 0; i < kv_heads * head_dim; i++) vs[i] = v[i];
    }
}
