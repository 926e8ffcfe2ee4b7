/* Decode attention over the paged KV cache, for CPUs.
 *
 * One query token per sequence reads its whole context straight from the block pool through
 * its block table: no gather copy. Work is split over (sequence, KV head) with OpenMP; the
 * query heads of a GQA group share each K/V block while it is in L1. fp32 only. An AVX-512
 * path is used where the compiler targets it (block_size, head_dim multiples of 16); it keeps
 * four independent FMA chains in flight, since one chain is bound by FMA latency.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef struct {
    int64_t group, head_dim, num_kv_heads, row, block_size;
    float scale;
} Dims;

/* Blocks sit at random places in the pool, beyond the hardware prefetcher's reach: while block b
 * is scored, ask for the K and V of block b + PREFETCH_BLOCKS (V is read again after the softmax).
 * Several blocks ahead, as prefetcht2 (into the outer caches, which can track more requests in
 * flight than L1), keep enough memory requests going: 25% faster than one block ahead into L1 at
 * batch 32 on the 2-core VM. */
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 1
#endif

static void prefetch_block(const float *k_cache, const float *v_cache, const int32_t *table, int64_t b, int64_t h,
                           const Dims *d)
{
    const int64_t bs = d->block_size;
    const char *k = (const char *)(k_cache + ((int64_t)table[b] * d->num_kv_heads + h) * d->head_dim * bs);
    for (int64_t off = 0; off < d->head_dim * bs * (int64_t)sizeof(float); off += 64) __builtin_prefetch(k + off, 0, PREFETCH_LOCALITY);
    const float *vb = v_cache + (int64_t)table[b] * bs * d->row + h * d->head_dim;
    for (int64_t j = 0; j < bs; j++)
        for (int64_t off = 0; off < d->head_dim * (int64_t)sizeof(float); off += 64)
            __builtin_prefetch((const char *)(vb + j * d->row) + off, 0, PREFETCH_LOCALITY);
}

/* scores[g * len + t] = scale * q_g . k_t for every token t of the context. K blocks are stored
 * transposed, [head][dim][token], so 16 tokens' scores come out of one vector FMA chain with no
 * horizontal reductions. */
static void qk_scores(const float *qg, const float *k_cache, const float *v_cache, const int32_t *table, int64_t h,
                      int64_t len, const Dims *d, float *scores)
{
    const int64_t bs = d->block_size, num_blocks = (len + bs - 1) / bs;
    for (int64_t b = 0; b < PREFETCH_BLOCKS && b < num_blocks; b++) prefetch_block(k_cache, v_cache, table, b, h, d);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const float *kt = k_cache + ((int64_t)table[t0 / bs] * d->num_kv_heads + h) * d->head_dim * bs;
        if (t0 / bs + PREFETCH_BLOCKS < num_blocks) prefetch_block(k_cache, v_cache, table, t0 / bs + PREFETCH_BLOCKS, h, d);
        int64_t g = 0;
#if defined(__AVX512F__)
        /* Four query heads at a time: each 16-token row of K feeds four FMA chains. */
        for (; bs % 16 == 0 && g + 4 <= d->group; g += 4) {
            const float *q4 = qg + g * d->head_dim;
            const __m512 scale = _mm512_set1_ps(d->scale);
            for (int64_t j0 = 0; j0 < n; j0 += 16) {
                __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(),
                       acc3 = _mm512_setzero_ps();
                for (int64_t c = 0; c < d->head_dim; c++) {
                    const __m512 kv = _mm512_loadu_ps(kt + c * bs + j0);
                    acc0 = _mm512_fmadd_ps(_mm512_set1_ps(q4[c]), kv, acc0);
                    acc1 = _mm512_fmadd_ps(_mm512_set1_ps(q4[d->head_dim + c]), kv, acc1);
                    acc2 = _mm512_fmadd_ps(_mm512_set1_ps(q4[2 * d->head_dim + c]), kv, acc2);
                    acc3 = _mm512_fmadd_ps(_mm512_set1_ps(q4[3 * d->head_dim + c]), kv, acc3);
                }
                const int64_t m = n - j0 < 16 ? n - j0 : 16;
                const __mmask16 mask = (__mmask16)((1u << m) - 1);
                float *out = scores + g * len + t0 + j0;
                _mm512_mask_storeu_ps(out, mask, _mm512_mul_ps(acc0, scale));
                _mm512_mask_storeu_ps(out + len, mask, _mm512_mul_ps(acc1, scale));
                _mm512_mask_storeu_ps(out + 2 * len, mask, _mm512_mul_ps(acc2, scale));
                _mm512_mask_storeu_ps(out + 3 * len, mask, _mm512_mul_ps(acc3, scale));
            }
        }
#endif
        for (; g < d->group; g++) {
            const float *qp = qg + g * d->head_dim;
            float *out = scores + g * len + t0;
#if defined(__AVX512F__)
            if (bs % 16 == 0) {
                const __m512 scale = _mm512_set1_ps(d->scale);
                for (int64_t j0 = 0; j0 < n; j0 += 16) {
                    /* Four partial sums over the head dimension: independent FMA chains. */
                    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                    const float *kj = kt + j0;
                    for (int64_t c = 0; c < d->head_dim; c += 4)
                        for (int u = 0; u < 4; u++)
                            acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(qp[c + u]), _mm512_loadu_ps(kj + (c + u) * bs), acc[u]);
                    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
                    const int64_t m = n - j0 < 16 ? n - j0 : 16;
                    _mm512_mask_storeu_ps(out + j0, (__mmask16)((1u << m) - 1), _mm512_mul_ps(sum, scale));
                }
                continue;
            }
#endif
            for (int64_t j = 0; j < n; j++) {
                float dot = 0.0f;
                for (int64_t c = 0; c < d->head_dim; c++) dot += qp[c] * kt[c * bs + j];
                out[j] = dot * d->scale;
            }
        }
    }
}

/* In place: each row of scores becomes softmax(row). */
static void softmax_rows(float *scores, int64_t rows, int64_t len)
{
    for (int64_t g = 0; g < rows; g++) {
        float *sg = scores + g * len;
        float top = sg[0];
        for (int64_t t = 1; t < len; t++) top = sg[t] > top ? sg[t] : top;
        float sum = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            sg[t] = expf(sg[t] - top);
            sum += sg[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) sg[t] *= inv;
    }
}

/* out_g = sum_t p[g, t] * v_t; one accumulator per (g, 16 dims) stays in a register. */
static void weighted_values(const float *probs, const float *v_cache, const int32_t *table, int64_t h, int64_t len,
                            const Dims *d, float *og)
{
#if defined(__AVX512F__)
    if (d->head_dim == 64 && d->group % 4 == 0) {
        /* Four query heads x 64 dims = 16 accumulators in registers: each V row is read once
         * per four heads instead of once per head and 16 dims. */
        for (int64_t g0 = 0; g0 < d->group; g0 += 4) {
            __m512 acc[4][4];
            for (int g = 0; g < 4; g++)
                for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
            for (int64_t t0 = 0; t0 < len; t0 += d->block_size) {
                const int64_t n = len - t0 < d->block_size ? len - t0 : d->block_size;
                const float *vb = v_cache + (int64_t)table[t0 / d->block_size] * d->block_size * d->row + h * 64;
                for (int64_t j = 0; j < n; j++) {
                    const float *vr = vb + j * d->row;
                    const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16), v2 = _mm512_loadu_ps(vr + 32),
                                 v3 = _mm512_loadu_ps(vr + 48);
                    for (int g = 0; g < 4; g++) {
                        const __m512 pg = _mm512_set1_ps(probs[(g0 + g) * len + t0 + j]);
                        acc[g][0] = _mm512_fmadd_ps(pg, v0, acc[g][0]);
                        acc[g][1] = _mm512_fmadd_ps(pg, v1, acc[g][1]);
                        acc[g][2] = _mm512_fmadd_ps(pg, v2, acc[g][2]);
                        acc[g][3] = _mm512_fmadd_ps(pg, v3, acc[g][3]);
                    }
                }
            }
            for (int g = 0; g < 4; g++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(og + (g0 + g) * 64 + c * 16, acc[g][c]);
        }
        return;
    }
    if (d->head_dim % 16 == 0) {
        for (int64_t g = 0; g < d->group; g++) {
            const float *pg = probs + g * len;
            for (int64_t c = 0; c < d->head_dim; c += 16) {
                /* Four partial sums over tokens (t mod 4): independent FMA chains. */
                __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int64_t t0 = 0; t0 < len; t0 += d->block_size) {
                    const int64_t n = len - t0 < d->block_size ? len - t0 : d->block_size;
                    const float *vb =
                        v_cache + (int64_t)table[t0 / d->block_size] * d->block_size * d->row + h * d->head_dim + c;
                    const float *pb = pg + t0;
                    int64_t j = 0;
                    for (; j + 4 <= n; j += 4)
                        for (int u = 0; u < 4; u++)
                            acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(pb[j + u]), _mm512_loadu_ps(vb + (j + u) * d->row), acc[u]);
                    for (; j < n; j++)
                        acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(pb[j]), _mm512_loadu_ps(vb + j * d->row), acc[0]);
                }
                const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
                _mm512_storeu_ps(og + g * d->head_dim + c, sum);
            }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < d->group * d->head_dim; i++) og[i] = 0.0f;
    for (int64_t t0 = 0; t0 < len; t0 += d->block_size) {
        const int64_t n = len - t0 < d->block_size ? len - t0 : d->block_size;
        const float *vb = v_cache + (int64_t)table[t0 / d->block_size] * d->block_size * d->row + h * d->head_dim;
        for (int64_t j = 0; j < n; j++) {
            for (int64_t g = 0; g < d->group; g++) {
                const float p = probs[g * len + t0 + j];
                float *ap = og + g * d->head_dim;
                for (int64_t c = 0; c < d->head_dim; c++) ap[c] += p * vb[j * d->row + c];
            }
        }
    }
}

void paged_decode_attention_f32(
    const float *q,               /* [num_seqs, num_heads, head_dim] */
    const float *k_cache,         /* [num_blocks, num_kv_heads, head_dim, block_size] */
    const float *v_cache,         /* [num_slots, num_kv_heads, head_dim] */
    const int32_t *block_tables,  /* [num_seqs, max_blocks] */
    const int32_t *context_lens,  /* [num_seqs] */
    float *out,                   /* [num_seqs, num_heads, head_dim] */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t max_blocks, int64_t block_size, int64_t max_context_len, float scale)
{
    const Dims d = {num_heads / num_kv_heads, head_dim, num_kv_heads, num_kv_heads * head_dim, block_size, scale};
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * d.group * max_context_len);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
            const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
            const int64_t len = context_lens[s];
            const int64_t first_head = s * num_heads + h * d.group;
            const int32_t *table = block_tables + s * max_blocks;
            qk_scores(q + first_head * head_dim, k_cache, v_cache, table, h, len, &d, scores);
            softmax_rows(scores, d.group, len);
            weighted_values(scores, v_cache, table, h, len, &d, out + first_head * head_dim);
        }
        free(scores);
    }
}
