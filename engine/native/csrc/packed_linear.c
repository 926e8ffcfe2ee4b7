/* y = x W^T (+ bias) for CPUs, with W packed once into column panels: fp32, or int8 with a
 * scale per 32 weights (weight-only quantization, like llama.cpp's Q8_0).
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
 * w = q * scale of its column's group of 32 k. Work is split over panels with OpenMP; each panel
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
#define GROUP 32                /* k per int8 scale (Q8_0's block) */
#define PREFETCH_BYTES 4096     /* prefetch the panel this far ahead, into L2 (prefetcht1: 5% faster than L1) */

int64_t packed_linear_panel(void) { return PANEL; }

/* out[r, 0:PANEL] = x[r, :] . panel for r < MR; one k row of the panel feeds 2 * MR FMAs. The
 * compiler unrolls the r loops for each constant MR, keeping the accumulators in registers.
 * scales == 0: fp32 panel; else an int8 panel whose rows are widened and scaled per group. */
#define MICRO_KERNEL(MR)                                                                                             \
    static void micro_##MR(const float *x, int64_t k, const void *panel, const float *scales, const float *bias,     \
                           float *out, int64_t n, vmask m0, vmask m1)                                               \
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

typedef void (*MicroKernel)(const float *, int64_t, const void *, const float *, const float *, float *, int64_t,
                            vmask, vmask);
static const MicroKernel MICRO[ROWS + 1] = {
    0, micro_1, micro_2, micro_3, micro_4, micro_5, micro_6,
#if ROWS == 12
    micro_7, micro_8, micro_9, micro_10, micro_11, micro_12,
#endif
};

/* An int8 panel widened to fp32 once: exactly the values the int8 micro-kernel computes in
 * registers (q * its group's scale), so the fp32 micro-kernel on them gives the same sums. */
static void widen_panel(const int8_t *qp, const float *scales, int64_t k, float *out)
{
    for (int64_t k0 = 0; k0 < k; k0 += GROUP) {
        const float *s = scales + (k0 / GROUP) * PANEL;
        const vf s0 = vload(s), s1 = vload(s + VL);
        const int64_t end = k - k0 < GROUP ? k : k0 + GROUP;
        for (int64_t kk = k0; kk < end; kk++) {
            vstore(out + kk * PANEL, vmul(vload_i8(qp + kk * PANEL), s0));
            vstore(out + kk * PANEL + VL, vmul(vload_i8(qp + kk * PANEL + VL), s1));
        }
    }
}

/* out[m, n] = x[m, k] . W^T + bias (bias may be NULL). scales NULL: wp holds fp32 panels; else
 * int8 panels with their scales (see the layout above). With int8 panels and at least
 * WIDEN_ONCE_ROWS rows, each thread widens a panel into its own fp32 buffer once and runs the
 * fp32 micro-kernels on it, instead of widening it again for every block of ROWS rows: a batch
 * then runs at the fp32 kernel's speed (the widening costs about as much as the FMAs it feeds),
 * while one or a few rows still read a quarter of the bytes. The sums are the same either way. */
#define WIDEN_ONCE_ROWS (2 * ROWS)
void packed_linear(const float *x, const void *wp, const float *scales, const float *bias, float *out, int64_t m,
                   int64_t n, int64_t k)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, groups = (k + GROUP - 1) / GROUP;
    const int64_t panel_bytes = k * PANEL * (scales ? 1 : (int64_t)sizeof(float));
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
                widen_panel((const int8_t *)panel, panel_scales, k, widened);
                panel = widened;
                panel_scales = 0;
            }
            for (int64_t i = 0; i < m; i += ROWS) {
                const int64_t rows = m - i < ROWS ? m - i : ROWS;
                MICRO[rows](x + i * k, k, panel, panel_scales, panel_bias, out + i * n + p * PANEL, n, m0, m1);
            }
        }
        free(widened);
    }
}
