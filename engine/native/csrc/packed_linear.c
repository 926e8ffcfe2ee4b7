/* y = x W^T (+ bias) for CPUs, with W packed once into column panels: fp32, or int8 or int4
 * with a scale per 32 weights (weight-only quantization, like llama.cpp's Q8_0 and Q4_0).
 *
 * Why: at the batch sizes a decode step has (1 to a few dozen rows) a BLAS sgemm spends most of
 * its time re-packing the weight matrix on every call, and the weights stream from memory
 * (the whole model is read once per step). Packing once at load time and computing straight
 * from the panels, with the next rows of the panel prefetched while the current ones are used,
 * beats torch's F.linear at every batch size a decode step has (bench/RESULTS.md).
 *
 * Layout (kernels.py packs): W [N, K] becomes [ceil(N / PANEL)][K][PANEL], PANEL = two vectors
 * (32 columns with AVX-512, 16 with AVX2), zero-padded past N. int8 panels hold the quantized
 * weights in the same order and, beside them, scales [ceil(N / PANEL)][ceil(K / 32)][PANEL]:
 * w = q * scale of its column's group of 32 k. int4 panels hold two k a byte: [..][ceil(K / 2)]
 * [PANEL], k = 2j in the low nibble and 2j + 1 in the high one, each as q + 8 (0..15), with the
 * same scales. Work is split over panels with OpenMP; each panel
 * is read from memory once and reused from cache for every block of ROWS input rows. int8
 * weights are widened to fp32 in registers (activations stay fp32): a quarter of the bytes
 * read, the same arithmetic as fp32 on the dequantized weights.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

#define PANEL (2 * VL)
#if VL == 16
#define ROWS 12 /* 24 accumulators in 32 vector registers */
#else
#define ROWS 6 /* 12 accumulators in 16 vector registers */
#endif
#define GROUP 32                /* k per scale (Q8_0's and Q4_0's block) */
#define PREFETCH_BYTES 4096     /* prefetch the panel this far ahead, into L2 (prefetcht1: 5% faster than L1) */

int64_t packed_linear_panel(void) { return PANEL; }

/* One byte row of an int4 panel (PANEL columns, two k) -> the weights of k (b0, b1: columns
 * 0..VL-1 and VL..PANEL-1) and of k + 1 (c0, c1), each (nibble - 8) * scale. */
static inline void widen_u4(const uint8_t *row, vf s0, vf s1, vf *b0, vf *b1, vf *c0, vf *c1)
{
    const vf m0 = vmul(s0, vset1(-8.0f)), m1 = vmul(s1, vset1(-8.0f)); /* (n - 8) s = n s - 8 s */
#if VL == 16
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)row), low4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
#define U8_TO_F(x) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x))
    *b0 = vfma(U8_TO_F(_mm256_castsi256_si128(lo)), s0, m0);
    *b1 = vfma(U8_TO_F(_mm256_extracti128_si256(lo, 1)), s1, m1);
    *c0 = vfma(U8_TO_F(_mm256_castsi256_si128(hi)), s0, m0);
    *c1 = vfma(U8_TO_F(_mm256_extracti128_si256(hi, 1)), s1, m1);
#else
    const __m128i bytes = _mm_loadu_si128((const __m128i *)row), low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
#define U8_TO_F(x) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x))
    *b0 = vfma(U8_TO_F(lo), s0, m0);
    *b1 = vfma(U8_TO_F(_mm_srli_si128(lo, 8)), s1, m1);
    *c0 = vfma(U8_TO_F(hi), s0, m0);
    *c1 = vfma(U8_TO_F(_mm_srli_si128(hi, 8)), s1, m1);
#endif
#undef U8_TO_F
}

/* out[r, 0:PANEL] = x[r, :] . panel for r < MR; one k row of the panel feeds 2 * MR FMAs. The
 * compiler unrolls the r loops for each constant MR, keeping the accumulators in registers.
 * scales == 0: fp32 panel; else an int8 (bits 8) or int4 (bits 4) panel whose rows are widened
 * and scaled per group. */
#define MICRO_KERNEL(MR)                                                                                             \
    static void micro_##MR(const float *x, int64_t k, const void *panel, const float *scales, int64_t bits,         \
                           const float *bias, float *out, int64_t n, vmask m0, vmask m1)                            \
    {                                                                                                                \
        vf lo[MR], hi[MR];                                                                                           \
        for (int r = 0; r < MR; r++) lo[r] = hi[r] = vzero();                                                        \
        if (!scales) {                                                                                               \
            const float *wp = (const float *)panel;                                                                  \
            for (int64_t kk = 0; kk < k; kk++) {                                                                     \
                const float *row = wp + kk * PANEL;                                                                  \
                _mm_prefetch((const char *)row + PREFETCH_BYTES, _MM_HINT_T1);                                       \
                if (VL == 16) _mm_prefetch((const char *)row + PREFETCH_BYTES + 64, _MM_HINT_T1);                     \
                const vf b0 = vload(row), b1 = vload(row + VL);                                                      \
                for (int r = 0; r < MR; r++) {                                                                       \
                    const vf a = vset1(x[r * k + kk]);                                                               \
                    lo[r] = vfma(a, b0, lo[r]);                                                                      \
                    hi[r] = vfma(a, b1, hi[r]);                                                                      \
                }                                                                                                    \
            }                                                                                                        \
        } else if (bits == 4) {                                                                                      \
            const uint8_t *qp = (const uint8_t *)panel;                                                              \
            for (int64_t k0 = 0; k0 < k; k0 += GROUP) {                                                              \
                const float *s = scales + (k0 / GROUP) * PANEL;                                                      \
                const vf s0 = vload(s), s1 = vload(s + VL);                                                          \
                const int64_t end = k - k0 < GROUP ? k : k0 + GROUP;                                                 \
                for (int64_t kk = k0; kk < end; kk += 2) {                                                           \
                    const uint8_t *row = qp + (kk / 2) * PANEL;                                                      \
                    _mm_prefetch((const char *)row + PREFETCH_BYTES, _MM_HINT_T1);                                   \
                    vf b0, b1, c0, c1;                                                                               \
                    widen_u4(row, s0, s1, &b0, &b1, &c0, &c1);                                                       \
                    const int pair = kk + 1 < end;                                                                   \
                    for (int r = 0; r < MR; r++) {                                                                   \
                        const vf a = vset1(x[r * k + kk]);                                                           \
                        lo[r] = vfma(a, b0, lo[r]);                                                                  \
                        hi[r] = vfma(a, b1, hi[r]);                                                                  \
                        if (pair) {                                                                                  \
                            const vf a2 = vset1(x[r * k + kk + 1]);                                                  \
                            lo[r] = vfma(a2, c0, lo[r]);                                                             \
                            hi[r] = vfma(a2, c1, hi[r]);                                                             \
                        }                                                                                            \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
        } else {                                                                                                     \
            const int8_t *qp = (const int8_t *)panel;                                                                \
            for (int64_t k0 = 0; k0 < k; k0 += GROUP) {                                                              \
                const float *s = scales + (k0 / GROUP) * PANEL;                                                      \
                const vf s0 = vload(s), s1 = vload(s + VL);                                                          \
                const int64_t end = k - k0 < GROUP ? k : k0 + GROUP;                                                 \
                for (int64_t kk = k0; kk < end; kk++) {                                                              \
                    const int8_t *row = qp + kk * PANEL;                                                             \
                    _mm_prefetch((const char *)row + PREFETCH_BYTES, _MM_HINT_T1);                                   \
                    const vf b0 = vmul(vload_i8(row), s0), b1 = vmul(vload_i8(row + VL), s1);                        \
                    for (int r = 0; r < MR; r++) {                                                                   \
                        const vf a = vset1(x[r * k + kk]);                                                           \
                        lo[r] = vfma(a, b0, lo[r]);                                                                  \
                        hi[r] = vfma(a, b1, hi[r]);                                                                  \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        const vf bias0 = bias ? vload_masked(m0, bias) : vzero();                                                    \
        const vf bias1 = bias ? vload_masked(m1, bias + VL) : vzero();                                               \
        for (int r = 0; r < MR; r++) {                                                                               \
            vstore_masked(out + r * n, m0, vadd(lo[r], bias0));                                                      \
            vstore_masked(out + r * n + VL, m1, vadd(hi[r], bias1));                                                 \
        }                                                                                                            \
    }
MICRO_KERNEL(1) MICRO_KERNEL(2) MICRO_KERNEL(3) MICRO_KERNEL(4) MICRO_KERNEL(5) MICRO_KERNEL(6)
#if ROWS == 12
MICRO_KERNEL(7) MICRO_KERNEL(8) MICRO_KERNEL(9) MICRO_KERNEL(10) MICRO_KERNEL(11) MICRO_KERNEL(12)
#endif

typedef void (*MicroKernel)(const float *, int64_t, const void *, const float *, int64_t, const float *, float *,
                            int64_t, vmask, vmask);
static const MicroKernel MICRO[ROWS + 1] = {
    0, micro_1, micro_2, micro_3, micro_4, micro_5, micro_6,
#if ROWS == 12
    micro_7, micro_8, micro_9, micro_10, micro_11, micro_12,
#endif
};

/* A quantized panel widened to fp32 once: exactly the values the quantized micro-kernel
 * computes in registers (q * its group's scale), so the fp32 micro-kernel on them gives the
 * same sums. */
static void widen_panel(const void *panel, const float *scales, int64_t bits, int64_t k, float *out)
{
    const int8_t *qp = (const int8_t *)panel;
    for (int64_t k0 = 0; k0 < k; k0 += GROUP) {
        const float *s = scales + (k0 / GROUP) * PANEL;
        const vf s0 = vload(s), s1 = vload(s + VL);
        const int64_t end = k - k0 < GROUP ? k : k0 + GROUP;
        if (bits == 4) {
            for (int64_t kk = k0; kk < end; kk += 2) {
                vf b0, b1, c0, c1;
                widen_u4((const uint8_t *)panel + (kk / 2) * PANEL, s0, s1, &b0, &b1, &c0, &c1);
                vstore(out + kk * PANEL, b0);
                vstore(out + kk * PANEL + VL, b1);
                if (kk + 1 < end) {
                    vstore(out + (kk + 1) * PANEL, c0);
                    vstore(out + (kk + 1) * PANEL + VL, c1);
                }
            }
            continue;
        }
        for (int64_t kk = k0; kk < end; kk++) {
            vstore(out + kk * PANEL, vmul(vload_i8(qp + kk * PANEL), s0));
            vstore(out + kk * PANEL + VL, vmul(vload_i8(qp + kk * PANEL + VL), s1));
        }
    }
}

/* out[m, n] = x[m, k] . W^T + bias (bias may be NULL). scales NULL: wp holds fp32 panels; else
 * int8 (bits 8) or int4 (bits 4) panels with their scales (see the layout above). With int8 panels and at least
 * WIDEN_ONCE_ROWS rows, each thread widens a panel into its own fp32 buffer once and runs the
 * fp32 micro-kernels on it, instead of widening it again for every block of ROWS rows: a batch
 * then runs at the fp32 kernel's speed (the widening costs about as much as the FMAs it feeds),
 * while one or a few rows still read a quarter of the bytes. The sums are the same either way. */
#define WIDEN_ONCE_ROWS (2 * ROWS)
void packed_linear(const float *x, const void *wp, const float *scales, const float *bias, float *out, int64_t m,
                   int64_t n, int64_t k, int64_t bits)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, groups = (k + GROUP - 1) / GROUP;
    const int64_t panel_bytes = !scales ? k * PANEL * (int64_t)sizeof(float) : bits == 4 ? (k + 1) / 2 * PANEL : k * PANEL;
    const int widen_once = scales && m >= WIDEN_ONCE_ROWS;
#pragma omp parallel
    {
        /* NULL (no buffer, or the allocation failed): widen in registers as for a few rows. */
        float *widened = widen_once ? (float *)aligned_alloc(64, (size_t)((k * PANEL * 4 + 63) / 64 * 64)) : 0;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t cols = n - p * PANEL;
            const vmask m0 = vmask_first(cols), m1 = vmask_first(cols - VL);
            const void *panel = (const char *)wp + p * panel_bytes;
            const float *panel_scales = scales ? scales + p * groups * PANEL : 0;
            const float *panel_bias = bias ? bias + p * PANEL : 0;
            if (widened) {
                widen_panel(panel, panel_scales, bits, k, widened);
                panel = widened;
                panel_scales = 0;
            }
            for (int64_t i = 0; i < m; i += ROWS) {
                const int64_t rows = m - i < ROWS ? m - i : ROWS;
                MICRO[rows](x + i * k, k, panel, panel_scales, bits, panel_bias, out + i * n + p * PANEL, n, m0, m1);
            }
        }
        free(widened);
    }
}
