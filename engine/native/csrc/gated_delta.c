/* One decode step of Qwen3.5's Gated DeltaNet layers (engine/native/linear_attention.py), for CPUs (fp32).
 *
 * Per sequence and value head, the state S [dk, dv] (a row of the state pool, updated in place):
 *
 *     S <- g S + k d^T,  d = beta (v - g S^T k)        o = S^T q
 *
 * PyTorch runs this as five whole-pool operations plus a gather and a scatter of the sequences'
 * rows, so each state crosses memory about ten times. Here each (sequence, head) block, 64 KB at
 * Qwen3.5's 128 x 128, is read once for S^T k and read and written once for the update and
 * o = S^T q together, while it sits in cache; blocks are spread over the threads.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

void gated_delta_decode_f32(float *states, const int64_t *slots, const float *q, const float *k, const float *v,
                            const float *beta, const float *log_decay, float *out, int64_t rows, int64_t heads,
                            int64_t dk, int64_t dv)
{
#pragma omp parallel for schedule(static) if (rows * heads > 1)
    for (int64_t b = 0; b < rows * heads; b++) {
        const int64_t r = b / heads, h = b % heads;
        float *s = states + (slots[r] * heads + h) * dk * dv;
        const float *qb = q + b * dk, *kb = k + b * dk, *vb = v + b * dv;
        const float g = expf(log_decay[b]), be = beta[b];
        float mem[dv], delta[dv], o[dv];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) mem[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            const float ki = kb[i];
            const float *si = s + i * dv;
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) mem[j] += ki * si[j];
        }
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            delta[j] = be * (vb[j] - g * mem[j]);
            o[j] = 0.0f;
        }
        for (int64_t i = 0; i < dk; i++) {
            const float ki = kb[i], qi = qb[i];
            float *si = s + i * dv;
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                const float updated = g * si[j] + ki * delta[j];
                si[j] = updated;
                o[j] += qi * updated;
            }
        }
        float *ob = out + b * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) ob[j] = o[j];
    }
}
