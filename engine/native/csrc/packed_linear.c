/* y = x W^T (+ bias) for CPUs, with W packed once into column panels.
 *
 * Why: at the batch sizes a decode step has (1 to a few dozen rows) a BLAS sgemm spends most of
 * its time re-packing the weight matrix on every call, and the weights stream from memory
 * (the whole model is read once per step). Packing once at load time and computing straight
 * from the panels, with the next rows of the panel prefetched while the current ones are used,
 * runs the reference model's matmuls at batch 32 about 1.5x faster than torch's F.linear
 * (bench/RESULTS.md). Same memory as the original weights.
 *
 * Layout: W [N, K] becomes [ceil(N / 32)][K][32]: panel p holds output columns 32p..32p+31,
 * one 128-byte row per k, zero-padded past N. Work is split over panels with OpenMP; each
 * panel is read from memory once and reused from cache for every block of 12 input rows.
 * fp32 only; AVX-512 only (packed_linear_available() says whether this build has it).
 */
#include <stdint.h>

#include "kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PANEL 32     /* output columns per panel: two 16-float vectors */
#define ROWS 12      /* input rows per micro-kernel call: 24 accumulators in 32 vector registers */
#define PREFETCH 32  /* prefetch the panel this many k rows ahead, into L2 (prefetcht1: 5% faster than into L1 on the 2-core VM) */

int packed_linear_available(void)
{
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* wp[p][k][c] = w[32p + c][k] (zero where 32p + c >= n). */
void pack_linear_weight_f32(const float *w, float *wp, int64_t n, int64_t k)
{
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t row = p * PANEL + c;
                wp[(p * k + kk) * PANEL + c] = row < n ? w[row * k + kk] : 0.0f;
            }
}

#if defined(__AVX512F__)
/* out[r, 0:32] = x[r, :] . panel for r < MR; one k row of the panel feeds 2 * MR FMAs. The
 * compiler unrolls the r loops for each constant MR, keeping the accumulators in registers. */
#define MICRO_KERNEL(MR)                                                                                           \
    static void micro_##MR(const float *x, int64_t k, const float *panel, const float *bias, float *out, int64_t n, \
                           __mmask16 m0, __mmask16 m1)                                                             \
    {                                                                                                              \
        __m512 lo[MR], hi[MR];                                                                                     \
        for (int r = 0; r < MR; r++) lo[r] = hi[r] = _mm512_setzero_ps();                                          \
        for (int64_t kk = 0; kk < k; kk++) {                                                                       \
            const float *row = panel + kk * PANEL;                                                                 \
            _mm_prefetch((const char *)(row + PREFETCH * PANEL), _MM_HINT_T1);                                     \
            _mm_prefetch((const char *)(row + PREFETCH * PANEL + 16), _MM_HINT_T1);                                \
            const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16);                                \
            for (int r = 0; r < MR; r++) {                                                                         \
                const __m512 a = _mm512_set1_ps(x[r * k + kk]);                                                    \
                lo[r] = _mm512_fmadd_ps(a, b0, lo[r]);                                                             \
                hi[r] = _mm512_fmadd_ps(a, b1, hi[r]);                                                             \
            }                                                                                                      \
        }                                                                                                          \
        const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();                         \
        const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();                    \
        for (int r = 0; r < MR; r++) {                                                                             \
            _mm512_mask_storeu_ps(out + r * n, m0, _mm512_add_ps(lo[r], bias0));                                   \
            _mm512_mask_storeu_ps(out + r * n + 16, m1, _mm512_add_ps(hi[r], bias1));                              \
        }                                                                                                          \
    }
MICRO_KERNEL(1) MICRO_KERNEL(2) MICRO_KERNEL(3) MICRO_KERNEL(4) MICRO_KERNEL(5) MICRO_KERNEL(6)
MICRO_KERNEL(7) MICRO_KERNEL(8) MICRO_KERNEL(9) MICRO_KERNEL(10) MICRO_KERNEL(11) MICRO_KERNEL(12)

typedef void (*MicroKernel)(const float *, int64_t, const float *, const float *, float *, int64_t, __mmask16,
                            __mmask16);
static const MicroKernel MICRO[ROWS + 1] = {0,       micro_1, micro_2, micro_3,  micro_4,  micro_5, micro_6,
                                            micro_7, micro_8, micro_9, micro_10, micro_11, micro_12};

static __mmask16 lane_mask(int64_t lanes)
{
    return lanes >= 16 ? (__mmask16)0xFFFF : lanes <= 0 ? (__mmask16)0 : (__mmask16)((1u << lanes) - 1);
}
#endif

/* out[m, n] = x[m, k] . W^T + bias (bias may be NULL); wp from pack_linear_weight_f32. */
void packed_linear_f32(const float *x, const float *wp, const float *bias, float *out, int64_t m, int64_t n,
                       int64_t k)
{
#if defined(__AVX512F__)
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t cols = n - p * PANEL;
        const __mmask16 m0 = lane_mask(cols), m1 = lane_mask(cols - 16);
        const float *panel = wp + p * k * PANEL;
        const float *panel_bias = bias ? bias + p * PANEL : 0;
        for (int64_t i = 0; i < m; i += ROWS) {
            const int64_t rows = m - i < ROWS ? m - i : ROWS;
            MICRO[rows](x + i * k, k, panel, panel_bias, out + i * n + p * PANEL, n, m0, m1);
        }
    }
#else
    (void)x, (void)wp, (void)bias, (void)out, (void)m, (void)n, (void)k;
#endif
}
