/* Decode attention over the paged KV cache, for CPUs.
 *
 * One query token per sequence reads its whole context straight from the block pool through
 * its block table: no gather copy. Work is split over (sequence, KV head) with OpenMP; the
 * query heads of a GQA group share each K/V block while it is in L1. fp32 only. A vector path
 * (simd.h: AVX-512 or AVX2, whichever this build targets) is used where block_size and head_dim
 * are multiples of the vector width; it keeps four independent FMA chains in flight, since one
 * chain is bound by FMA latency.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

#if VL == 16
#define HEADS_PER_PASS 4
#else
#define HEADS_PER_PASS 1
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
 * transposed, [head][dim][token], so VL tokens' scores come out of one vector FMA chain with no
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
#if defined(HAS_SIMD)
        /* Four query heads at a time: each VL-token row of K feeds four FMA chains. */
        for (; bs % VL == 0 && g + 4 <= d->group; g += 4) {
            const float *q4 = qg + g * d->head_dim;
            const vf scale = vset1(d->scale);
            for (int64_t j0 = 0; j0 < n; j0 += VL) {
                vf acc0 = vzero(), acc1 = vzero(), acc2 = vzero(), acc3 = vzero();
                for (int64_t c = 0; c < d->head_dim; c++) {
                    const vf kv = vload(kt + c * bs + j0);
                    acc0 = vfma(vset1(q4[c]), kv, acc0);
                    acc1 = vfma(vset1(q4[d->head_dim + c]), kv, acc1);
                    acc2 = vfma(vset1(q4[2 * d->head_dim + c]), kv, acc2);
                    acc3 = vfma(vset1(q4[3 * d->head_dim + c]), kv, acc3);
                }
                const vmask mask = vmask_first(n - j0);
                float *out = scores + g * len + t0 + j0;
                vstore_masked(out, mask, vmul(acc0, scale));
                vstore_masked(out + len, mask, vmul(acc1, scale));
                vstore_masked(out + 2 * len, mask, vmul(acc2, scale));
                vstore_masked(out + 3 * len, mask, vmul(acc3, scale));
            }
        }
#endif
        for (; g < d->group; g++) {
            const float *qp = qg + g * d->head_dim;
            float *out = scores + g * len + t0;
#if defined(HAS_SIMD)
            if (bs % VL == 0 && d->head_dim % 4 == 0) {
                const vf scale = vset1(d->scale);
                for (int64_t j0 = 0; j0 < n; j0 += VL) {
                    /* Four partial sums over the head dimension: independent FMA chains. */
                    vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
                    const float *kj = kt + j0;
                    for (int64_t c = 0; c < d->head_dim; c += 4)
                        for (int u = 0; u < 4; u++) acc[u] = vfma(vset1(qp[c + u]), vload(kj + (c + u) * bs), acc[u]);
                    const vf sum = vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3]));
                    vstore_masked(out + j0, vmask_first(n - j0), vmul(sum, scale));
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

/* In place, each of `rows` rows of `len` scores: the first `skip` (before a sliding window)
 * become 0, the rest softmax(softcap * tanh(score / softcap)) (softcap 0: plain softmax). */
static void softmax_rows(float *scores, int64_t rows, int64_t len, int64_t skip, float softcap)
{
    for (int64_t g = 0; g < rows; g++) {
        float *sg = scores + g * len;
        for (int64_t t = 0; t < skip; t++) sg[t] = 0.0f;
        if (softcap > 0.0f) {
            const float inv_cap = 1.0f / softcap;
            for (int64_t t = skip; t < len; t++) sg[t] = softcap * tanhf(sg[t] * inv_cap);
        }
        float top = sg[skip];
        for (int64_t t = skip + 1; t < len; t++) top = sg[t] > top ? sg[t] : top;
        float sum = 0.0f;
        for (int64_t t = skip; t < len; t++) {
            sg[t] = expf(sg[t] - top);
            sum += sg[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = skip; t < len; t++) sg[t] *= inv;
    }
}

/* out_g = sum_t p[g, t] * v_t; one accumulator per (g, 16 dims) stays in a register. */
static void weighted_values(const float *probs, const float *v_cache, const int32_t *table, int64_t h, int64_t len,
                            const Dims *d, float *og)
{
#if defined(HAS_SIMD)
    if (d->head_dim == 64 && d->group % HEADS_PER_PASS == 0) {
        /* HEADS_PER_PASS query heads x 64 dims of accumulators in registers (16 of them with
         * AVX-512, 8 with AVX2): each V row is read once per pass instead of once per head and VL dims. */
        for (int64_t g0 = 0; g0 < d->group; g0 += HEADS_PER_PASS) {
            vf acc[HEADS_PER_PASS][64 / VL];
            for (int g = 0; g < HEADS_PER_PASS; g++)
                for (int c = 0; c < 64 / VL; c++) acc[g][c] = vzero();
            for (int64_t t0 = 0; t0 < len; t0 += d->block_size) {
                const int64_t n = len - t0 < d->block_size ? len - t0 : d->block_size;
                const float *vb = v_cache + (int64_t)table[t0 / d->block_size] * d->block_size * d->row + h * 64;
                for (int64_t j = 0; j < n; j++) {
                    const float *vr = vb + j * d->row;
                    vf v[64 / VL];
                    for (int c = 0; c < 64 / VL; c++) v[c] = vload(vr + c * VL);
                    for (int g = 0; g < HEADS_PER_PASS; g++) {
                        const vf pg = vset1(probs[(g0 + g) * len + t0 + j]);
                        for (int c = 0; c < 64 / VL; c++) acc[g][c] = vfma(pg, v[c], acc[g][c]);
                    }
                }
            }
            for (int g = 0; g < HEADS_PER_PASS; g++)
                for (int c = 0; c < 64 / VL; c++) vstore(og + (g0 + g) * 64 + c * VL, acc[g][c]);
        }
        return;
    }
    if (d->head_dim % VL == 0) {
        for (int64_t g = 0; g < d->group; g++) {
            const float *pg = probs + g * len;
            for (int64_t c = 0; c < d->head_dim; c += VL) {
                /* Four partial sums over tokens (t mod 4): independent FMA chains. */
                vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
                for (int64_t t0 = 0; t0 < len; t0 += d->block_size) {
                    const int64_t n = len - t0 < d->block_size ? len - t0 : d->block_size;
                    const float *vb =
                        v_cache + (int64_t)table[t0 / d->block_size] * d->block_size * d->row + h * d->head_dim + c;
                    const float *pb = pg + t0;
                    int64_t j = 0;
                    for (; j + 4 <= n; j += 4)
                        for (int u = 0; u < 4; u++) acc[u] = vfma(vset1(pb[j + u]), vload(vb + (j + u) * d->row), acc[u]);
                    for (; j < n; j++) acc[0] = vfma(vset1(pb[j]), vload(vb + j * d->row), acc[0]);
                }
                vstore(og + g * d->head_dim + c, vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
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

/* Returns 0, or -1 when the scores buffer cannot be allocated (nothing is written then).
 * window > 0: each query attends to its last `window` positions (itself included), reading
 * from the block holding the first of them (blocks before it may be released and reused: never
 * read); the positions of that block before the window get probability 0 (they were written,
 * so finite). softcap > 0: scores are soft-capped (Gemma 2) before the softmax. */
int paged_decode_attention_f32(
    const float *q,               /* [num_seqs, num_heads, head_dim] */
    const float *k_cache,         /* [num_blocks, num_kv_heads, head_dim, block_size] */
    const float *v_cache,         /* [num_slots, num_kv_heads, head_dim] */
    const int32_t *block_tables,  /* [num_seqs, max_blocks] */
    const int32_t *context_lens,  /* [num_seqs] */
    float *out,                   /* [num_seqs, num_heads, head_dim] */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t max_blocks, int64_t block_size, int64_t max_context_len, float scale, int64_t window, float softcap)
{
    const Dims d = {num_heads / num_kv_heads, head_dim, num_kv_heads, num_kv_heads * head_dim, block_size, scale};
    /* One scores row block per thread, allocated (and checked) before the parallel region: a
     * thread cannot report a failure out of it. A region never has more than max_threads. */
    const int64_t per_thread = d.group * max_context_len;
    float *all_scores = malloc(sizeof(float) * (size_t)(per_thread * omp_get_max_threads() + 1));
    if (!all_scores) return -1;
#pragma omp parallel
    {
        float *scores = all_scores + per_thread * omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
            const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
            const int64_t context_len = context_lens[s];
            const int64_t start = window > 0 && context_len > window ? context_len - window : 0;
            const int64_t first_block = start / block_size, len = context_len - first_block * block_size;
            const int64_t first_head = s * num_heads + h * d.group;
            const int32_t *table = block_tables + s * max_blocks + first_block;
            qk_scores(q + first_head * head_dim, k_cache, v_cache, table, h, len, &d, scores);
            softmax_rows(scores, d.group, len, start - first_block * block_size, softcap);
            weighted_values(scores, v_cache, table, h, len, &d, out + first_head * head_dim);
        }
    }
    free(all_scores);
    return 0;
}
