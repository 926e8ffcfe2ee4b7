/* The float work around int8 matmuls (activations quantized per row, int32 sums from
 * torch._int_mm), fused into one pass per row: the safety encoder's w8a8 layers
 * (gateway/safety/embedder.py) run each as int8 GEMMs with these between them.
 *
 * In eager PyTorch the same glue is a dozen ops per matmul (abs, amax, divide, round, cast;
 * int32 -> float, two scales, bias; GELU; residual add, LayerNorm), each a full pass over the
 * activations: measured, that glue took longer than the int8 GEMMs themselves. Here a row is
 * read once and stays in L1 while it is scaled, normalised and quantized for the next matmul.
 *
 * Numerics match the PyTorch glue they replace up to float rounding (the order of a row's sum,
 * a reciprocal for a division): an activation's scale is max|row| / 127, values round half to
 * even; GELU is the erf one, as BERT's (erf to within 1.5e-7); LayerNorm uses the biased variance.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

/* Parallel only when there is enough work to pay for waking the other threads. */
#define PARALLEL_MIN_VALUES 32768
/* A row dequantized only to be quantized again lives on the stack: at most this many values. */
#define MAX_STACK_ROW 8192
#define ACT_MAX 127.0f

static void quantize_row(const float *x, int8_t *q, float *scale, int64_t cols)
{
    float peak = 0.0f;
#pragma omp simd reduction(max : peak)
    for (int64_t i = 0; i < cols; i++) peak = fmaxf(peak, fabsf(x[i]));
    const float s = fmaxf(peak, 1e-12f) / ACT_MAX;
    const float inv = 1.0f / s;
    *scale = s;
#pragma omp simd
    for (int64_t i = 0; i < cols; i++) q[i] = (int8_t)fminf(fmaxf(nearbyintf(x[i] * inv), -ACT_MAX), ACT_MAX);
}

/* x [rows, cols] -> q [rows, cols] int8 and scale [rows]: x ~= q * scale per row. */
void quantize_rows_i8(const float *x, int8_t *q, float *scale, int64_t rows, int64_t cols)
{
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++) quantize_row(x + r * cols, q + r * cols, scale + r, cols);
}

/* acc [rows, cols] int32 sums of an int8 matmul -> y = acc * row_scale[r] * col_scale[c] + bias[c],
 * then GELU when `gelu`. y goes to out [rows, cols] when out is not NULL; when q is not NULL it is
 * also quantized per row into q [rows, cols] and q_scale [rows] (out may then be NULL when cols
 * <= MAX_STACK_ROW: the float row never leaves the stack). */
void dequant_i32_f32(const int32_t *acc, const float *row_scale, const float *col_scale, const float *bias,
                     float *out, int8_t *q, float *q_scale, int64_t rows, int64_t cols, int64_t gelu)
{
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        float stack[MAX_STACK_ROW];
        float *y = out ? out + r * cols : stack;
        const int32_t *a = acc + r * cols;
        const float rs = row_scale[r];
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) y[c] = (float)a[c] * rs * col_scale[c] + bias[c];
        if (gelu) { /* erf to within 1.5e-7 (Abramowitz and Stegun 7.1.26): glibc's vector erff
                     * took 4x as long, and GELU was most of this file's time with it */
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) {
                const float z = y[c] * 0.70710678118654752f, a = fminf(fabsf(z), 5.0f), t = 1.0f / (1.0f + 0.3275911f * a);
                const float p =
                    ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
                const float e = 1.0f - p * expf(-a * a); /* erf(|z|) */
                y[c] = 0.5f * y[c] * (1.0f + (z < 0.0f ? -e : e));
            }
        }
        if (q) quantize_row(y, q + r * cols, q_scale + r, cols);
    }
}

/* out = LayerNorm(residual + acc * row_scale[r] * col_scale[c] + bias[c]) * ln_weight + ln_bias, per
 * row ([rows, cols]; out may be residual itself); when q is not NULL, out is also quantized per row
 * into q and q_scale, the next matmul's input. */
void dequant_add_layer_norm_f32(const int32_t *acc, const float *row_scale, const float *col_scale,
                                const float *bias, const float *residual, const float *ln_weight,
                                const float *ln_bias, float *out, int8_t *q, float *q_scale, int64_t rows,
                                int64_t cols, float eps)
{
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *a = acc + r * cols;
        const float *res = residual + r * cols;
        float *y = out + r * cols;
        const float rs = row_scale[r];
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < cols; c++) {
            y[c] = res[c] + ((float)a[c] * rs * col_scale[c] + bias[c]);
            sum += y[c];
        }
        const float mean = sum / (float)cols;
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t c = 0; c < cols; c++) sq += (y[c] - mean) * (y[c] - mean);
        const float rstd = 1.0f / sqrtf(sq / (float)cols + eps);
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) y[c] = (y[c] - mean) * rstd * ln_weight[c] + ln_bias[c];
        if (q) quantize_row(y, q + r * cols, q_scale + r, cols);
    }
}

/* Rows of one query block: each K or V vector loaded is used by this many rows. */
#define ATT_ROWS 8

/* Bidirectional attention within each window of a batch whose tokens lie back to back (an
 * encoder's): qkv [tokens, 3 * heads * head_dim] (q | k | v, head-major within each), window w
 * is rows [starts[w], starts[w] + lens[w]), out [tokens, heads * head_dim]. No padding and no
 * mask: each window attends over its own tokens only. head_dim must be a multiple of VL and at
 * most 256. Returns 0, or -1 when scratch memory could not be allocated. */
int window_attention_f32(const float *qkv, const int64_t *starts, const int64_t *lens, float *out,
                         int64_t num_windows, int64_t heads, int64_t head_dim, float scale)
{
    const int64_t hidden = heads * head_dim, width = 3 * hidden, nvec = head_dim / VL;
    int64_t max_len = 0;
    for (int64_t w = 0; w < num_windows; w++) max_len = lens[w] > max_len ? lens[w] : max_len;
    const int64_t padded = (max_len + VL - 1) / VL * VL;
    int failed = 0;
#pragma omp parallel if (num_windows * heads > 1)
    {
        /* per thread: K transposed [head_dim, padded], V [max_len, head_dim], scores [ATT_ROWS, padded],
         * the block's queries scaled [ATT_ROWS, head_dim] */
        float *scratch = malloc(sizeof(float) *
                                (size_t)(head_dim * padded + max_len * head_dim + ATT_ROWS * padded + ATT_ROWS * head_dim));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < num_windows * heads; task++) {
            if (!scratch) continue;
            const int64_t w = task / heads, h = task % heads, len = lens[w];
            const float *base = qkv + starts[w] * width + h * head_dim;
            float *kt = scratch, *v = kt + head_dim * padded, *s = v + max_len * head_dim, *qs = s + ATT_ROWS * padded;
            for (int64_t j = 0; j < len; j++) {
                const float *kj = base + j * width + hidden, *vj = kj + hidden;
                for (int64_t d = 0; d < head_dim; d++) kt[d * padded + j] = kj[d];
                for (int64_t d = 0; d < head_dim; d++) v[j * head_dim + d] = vj[d];
            }
            for (int64_t d = 0; d < head_dim; d++)
                for (int64_t j = len; j < padded; j++) kt[d * padded + j] = 0.0f;
            for (int64_t i0 = 0; i0 < len; i0 += ATT_ROWS) {
                const int64_t rows = len - i0 < ATT_ROWS ? len - i0 : ATT_ROWS;
                /* scores: s[r][j] = scale * q[i0 + r] . k[j] (rows past the window's end: zeros) */
                for (int64_t r = 0; r < ATT_ROWS; r++)
                    for (int64_t d = 0; d < head_dim; d++) qs[r * head_dim + d] = r < rows ? scale * base[(i0 + r) * width + d] : 0.0f;
                for (int64_t j = 0; j < padded; j += VL) {
                    vf acc[ATT_ROWS];
                    for (int64_t r = 0; r < ATT_ROWS; r++) acc[r] = vzero();
                    for (int64_t d = 0; d < head_dim; d++) {
                        const vf kv = vload(kt + d * padded + j);
                        for (int64_t r = 0; r < ATT_ROWS; r++) acc[r] = vfma(vset1(qs[r * head_dim + d]), kv, acc[r]);
                    }
                    for (int64_t r = 0; r < ATT_ROWS; r++) vstore(s + r * padded + j, acc[r]);
                }
                /* softmax over each row's len scores */
                float inv_sum[ATT_ROWS];
                for (int64_t r = 0; r < rows; r++) {
                    float *sr = s + r * padded, peak = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : peak)
                    for (int64_t j = 0; j < len; j++) peak = fmaxf(peak, sr[j]);
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < len; j++) {
                        sr[j] = expf(sr[j] - peak);
                        sum += sr[j];
                    }
                    inv_sum[r] = 1.0f / sum;
                }
                /* out[i0 + r] = sum_j p[r][j] v[j] */
                for (int64_t c = 0; c < nvec; c++) {
                    vf acc[ATT_ROWS];
                    for (int64_t r = 0; r < ATT_ROWS; r++) acc[r] = vzero();
                    for (int64_t j = 0; j < len; j++) {
                        const vf vv = vload(v + j * head_dim + c * VL);
                        for (int64_t r = 0; r < ATT_ROWS; r++) acc[r] = vfma(vset1(s[r * padded + j]), vv, acc[r]);
                    }
                    for (int64_t r = 0; r < rows; r++)
                        vstore(out + (starts[w] + i0 + r) * hidden + h * head_dim + c * VL, vmul(acc[r], vset1(inv_sum[r])));
                }
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
