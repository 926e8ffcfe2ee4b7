/* Decode attention over the paged KV cache, for CPUs.
 *
 * One query token per sequence reads its whole context straight from the block pool through
 * its block table: no gather copy. Work is split over (sequence, KV head) with OpenMP; the
 * query heads of a GQA group share each K/V row while it is in L1. fp32 only.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void paged_decode_attention_f32(
    const float *q,               /* [num_seqs, num_heads, head_dim] */
    const float *k_cache,         /* [num_slots, num_kv_heads, head_dim] */
    const float *v_cache,         /* [num_slots, num_kv_heads, head_dim] */
    const int32_t *block_tables,  /* [num_seqs, max_blocks] */
    const int32_t *context_lens,  /* [num_seqs] */
    float *out,                   /* [num_seqs, num_heads, head_dim] */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t max_blocks, int64_t block_size, int64_t max_context_len, float scale)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats between consecutive slots */
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * group * max_context_len);
        float *acc = malloc(sizeof(float) * group * head_dim);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
            const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
            const int64_t len = context_lens[s];
            const float *qg = q + (s * num_heads + h * group) * head_dim;
            const int32_t *table = block_tables + s * max_blocks;
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                const float *kb = k_cache + ((int64_t)table[t0 / block_size] * block_size) * row + h * head_dim;
                for (int64_t j = 0; j < n; j++) {
                    const float *kp = kb + j * row;
                    for (int64_t g = 0; g < group; g++) {
                        const float *qp = qg + g * head_dim;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; d++) dot += qp[d] * kp[d];
                        scores[g * len + t0 + j] = dot * scale;
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *sg = scores + g * len;
                float top = sg[0];
                for (int64_t t = 1; t < len; t++) top = sg[t] > top ? sg[t] : top;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; t++) {
                    sg[t] = expf(sg[t] - top);
                    sum += sg[t];
                }
                const float inv = 1.0f / sum;
#pragma omp simd
                for (int64_t t = 0; t < len; t++) sg[t] *= inv;
            }
            for (int64_t i = 0; i < group * head_dim; i++) acc[i] = 0.0f;
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                const float *vb = v_cache + ((int64_t)table[t0 / block_size] * block_size) * row + h * head_dim;
                for (int64_t j = 0; j < n; j++) {
                    const float *vp = vb + j * row;
                    for (int64_t g = 0; g < group; g++) {
                        const float p = scores[g * len + t0 + j];
                        float *ap = acc + g * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) ap[d] += p * vp[d];
                    }
                }
            }
            float *og = out + (s * num_heads + h * group) * head_dim;
            for (int64_t i = 0; i < group * head_dim; i++) og[i] = acc[i];
        }
        free(scores);
        free(acc);
    }
}
