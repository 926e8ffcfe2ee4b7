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
 * w = q * scale of its column's group of 32 k. Work is split over panels with OpenMP; each panel
 * is read from memory once and reused from cache for every block of ROWS input rows. int8
 * weights are widened to fp32 in registers (activations stay fp32): a quarter of the bytes
 * read, the same arithmetic as fp32 on the dequantized weights.
 *
 * int4 (w4a8, as llama.cpp's Q4_0 x Q8_0 on CPUs): the activations are quantized too, per row and
 * group of 32 k (int8, scale max|x| / 127), and each group's products are summed as integers
 * (vpdpbusd with VNNI, vpmaddubsw without), then scaled by both scales in fp32. Widening 4-bit
 * weights to fp32 cost more than reading them (int4 ran no faster than int8); integer dot
 * products do 4 products an instruction a lane. Panels: K padded to a multiple of 32 (with q = 0),
 * [ceil(N / PANEL)][K / 8][PANEL][4] bytes: column c's 4 bytes of a block of 8 k hold k + i in the
 * low nibble and k + 4 + i in the high one (i = 0..3), each as q + 8 (0..15), so one vector load
 * and two masks give VL columns' weights for 4 k each, the layout vpdpbusd reads. Same scales.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* out[r, 0:PANEL] = x[r, :] . panel for r < MR; one k row of the panel feeds 2 * MR FMAs. The
 * compiler unrolls the r loops for each constant MR, keeping the accumulators in registers.
 * scales == 0: fp32 panel; else an int8 panel whose rows are widened and scaled per group. */
#define MICRO_KERNEL(MR)                                                                                             \
    static void micro_##MR(const float *x, int64_t k, const void *panel, const float *scales,                      \
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

/* ---- int4 weights x int8 activations (w4a8) ---- */
#if VL == 16
#define W4_ROWS 4 /* 4 int and 4 float accumulators a row: 16 of 32 registers */
#else
#define W4_ROWS 2 /* 8 accumulators beside the 4 weight vectors and constants: AVX2's 16 registers */
#endif
#define vi_dot16_u8s8(acc, a, b) vi_add16(acc, vi_maddubs(a, b))
#define KB 8 /* k per 4-byte column block of an int4 panel */
#define vi_same(acc) (acc)

/* x [k] -> q [kpad] int8 (zero past k), per group of 32: scale sa[g] = max|x| / 127 and the sum
 * of the group's q (asum[g], for the weights' +8 offset). Rounds half to even, as torch.round. */
static void quantize_act_groups(const float *x, int64_t k, int64_t groups, int8_t *q, float *sa, int32_t *asum)
{
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * GROUP, end = k - k0 < GROUP ? k : k0 + GROUP;
        float peak = 0.0f;
        for (int64_t i = k0; i < end; i++) peak = fmaxf(peak, fabsf(x[i]));
        const float scale = peak / 127.0f;
        int32_t sum = 0;
        for (int64_t i = k0; i < k0 + GROUP; i++) {
            /* clamped before the cast: a NaN or inf input gives +-127, not undefined behaviour */
            const float r = i < end && peak > 0.0f ? nearbyintf(x[i] / scale) : 0.0f;
            const int8_t v = (int8_t)fminf(fmaxf(r, -127.0f), 127.0f);
            q[i] = v;
            sum += v;
        }
        sa[g] = scale;
        asum[g] = sum;
    }
}

/* out[r, 0:PANEL] for r < MR from the rows' quantized activations (xq [MR][kpad], sa and asum
 * [MR][groups]) and one int4 panel: per group, the integer sums of q_w * q_a (the weights read as
 * q + 8, so 8 * asum comes off), then times the weight's and the row's scales in fp32. DOT adds
 * the products of 4 bytes a lane to an accumulator and FINISH makes it 32-bit sums: vpdpbusd and
 * nothing, or (no VNNI) vpmaddubsw into 16-bit pair sums, added up over the group and widened
 * once: 16 products of (q + 8) <= 15 and |q_a| <= 127 sum to at most 30,480, so they never wrap. */
#define W4_MICRO(NAME, DOT, FINISH, ATTRIBUTES, MR)                                                                    \
    ATTRIBUTES static void NAME##_##MR(const int8_t *xq, const float *sa, const int32_t *asum, int64_t kpad,        \
                                       const uint8_t *panel, const float *scales, const float *bias, float *out,    \
                                       int64_t n, vmask m0, vmask m1)                                               \
    {                                                                                                                \
        const int64_t groups = kpad / GROUP;                                                                         \
        const vi low4 = vi_set1_8(0x0F);                                                                             \
        vf f0[MR], f1[MR];                                                                                           \
        for (int r = 0; r < MR; r++) f0[r] = f1[r] = vzero();                                                        \
        for (int64_t g = 0; g < groups; g++) {                                                                       \
            vi i0[MR], i1[MR];                                                                                       \
            for (int r = 0; r < MR; r++) i0[r] = i1[r] = vi_zero();                                                  \
            for (int64_t b = 0; b < GROUP / KB; b++) {                                                               \
                const uint8_t *wp = panel + (g * (GROUP / KB) + b) * PANEL * 4;                                      \
                _mm_prefetch((const char *)wp + PREFETCH_BYTES, _MM_HINT_T1);                                        \
                const vi w0 = vi_load(wp), w1 = vi_load(wp + VL * 4);                                                \
                const vi l0 = vi_and(w0, low4), h0 = vi_and(vi_srli16(w0, 4), low4);                                 \
                const vi l1 = vi_and(w1, low4), h1 = vi_and(vi_srli16(w1, 4), low4);                                 \
                for (int r = 0; r < MR; r++) {                                                                       \
                    int32_t lo4, hi4;                                                                                \
                    memcpy(&lo4, xq + r * kpad + g * GROUP + b * KB, 4);                                             \
                    memcpy(&hi4, xq + r * kpad + g * GROUP + b * KB + 4, 4);                                         \
                    const vi a = vi_set1(lo4), c = vi_set1(hi4);                                                     \
                    i0[r] = DOT(DOT(i0[r], l0, a), h0, c);                                                           \
                    i1[r] = DOT(DOT(i1[r], l1, a), h1, c);                                                           \
                }                                                                                                    \
            }                                                                                                        \
            const vf s0 = vload(scales + g * PANEL), s1 = vload(scales + g * PANEL + VL);                            \
            for (int r = 0; r < MR; r++) {                                                                           \
                const vi off = vi_set1(8 * asum[r * groups + g]);                                                    \
                const vf row_scale = vset1(sa[r * groups + g]);                                                      \
                f0[r] = vfma(vi_to_f(vi_sub(FINISH(i0[r]), off)), vmul(s0, row_scale), f0[r]);                       \
                f1[r] = vfma(vi_to_f(vi_sub(FINISH(i1[r]), off)), vmul(s1, row_scale), f1[r]);                       \
            }                                                                                                        \
        }                                                                                                            \
        const vf bias0 = bias ? vload_masked(m0, bias) : vzero();                                                    \
        const vf bias1 = bias ? vload_masked(m1, bias + VL) : vzero();                                               \
        for (int r = 0; r < MR; r++) {                                                                               \
            vstore_masked(out + r * n, m0, vadd(f0[r], bias0));                                                      \
            vstore_masked(out + r * n + VL, m1, vadd(f1[r], bias1));                                                 \
        }                                                                                                            \
    }
typedef void (*W4Micro)(const int8_t *, const float *, const int32_t *, int64_t, const uint8_t *, const float *,
                        const float *, float *, int64_t, vmask, vmask);
W4_MICRO(w4_maddubs, vi_dot16_u8s8, vi_widen16, , 1) W4_MICRO(w4_maddubs, vi_dot16_u8s8, vi_widen16, , 2)
W4_MICRO(w4_vnni, vi_dpbusd, vi_same, VNNI_TARGET, 1) W4_MICRO(w4_vnni, vi_dpbusd, vi_same, VNNI_TARGET, 2)
#if W4_ROWS == 4
W4_MICRO(w4_maddubs, vi_dot16_u8s8, vi_widen16, , 3) W4_MICRO(w4_maddubs, vi_dot16_u8s8, vi_widen16, , 4)
W4_MICRO(w4_vnni, vi_dpbusd, vi_same, VNNI_TARGET, 3) W4_MICRO(w4_vnni, vi_dpbusd, vi_same, VNNI_TARGET, 4)
static const W4Micro W4_MADDUBS[W4_ROWS + 1] = {0, w4_maddubs_1, w4_maddubs_2, w4_maddubs_3, w4_maddubs_4};
static const W4Micro W4_VNNI[W4_ROWS + 1] = {0, w4_vnni_1, w4_vnni_2, w4_vnni_3, w4_vnni_4};
#else
static const W4Micro W4_MADDUBS[W4_ROWS + 1] = {0, w4_maddubs_1, w4_maddubs_2};
static const W4Micro W4_VNNI[W4_ROWS + 1] = {0, w4_vnni_1, w4_vnni_2};
#endif

/* packed_linear for int4 panels: the rows' activations quantized once (every thread reads all of
 * them), then the panels split over the threads. Returns -1 when scratch memory could not be
 * allocated (nothing written), else 0. */
static int w4_vnni; /* set by the loader (packed_linear_use_vnni): VNNI at this build's vector width */

void packed_linear_use_vnni(int64_t on) { w4_vnni = on != 0; }

static int packed_linear_w4a8(const float *x, const uint8_t *wp, const float *scales, const float *bias, float *out,
                              int64_t m, int64_t n, int64_t k)
{
    const W4Micro *micro = w4_vnni ? W4_VNNI : W4_MADDUBS;
    const int64_t panels = (n + PANEL - 1) / PANEL, groups = (k + GROUP - 1) / GROUP, kpad = groups * GROUP;
    const int64_t panel_bytes = kpad / 2 * PANEL;
    char *scratch = malloc((size_t)(m * kpad + m * groups * (int64_t)(sizeof(float) + sizeof(int32_t))));
    if (!scratch) return -1;
    int8_t *xq = (int8_t *)scratch;
    float *sa = (float *)(scratch + m * kpad); /* kpad is a multiple of 32: aligned for floats */
    int32_t *asum = (int32_t *)(sa + m * groups);
#pragma omp parallel if (m * n * k >= 1 << 18)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            quantize_act_groups(x + r * k, k, groups, xq + r * kpad, sa + r * groups, asum + r * groups);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t cols = n - p * PANEL;
            const vmask m0 = vmask_first(cols), m1 = vmask_first(cols - VL);
            const uint8_t *panel = wp + p * panel_bytes;
            const float *panel_scales = scales + p * groups * PANEL;
            const float *panel_bias = bias ? bias + p * PANEL : 0;
            for (int64_t i = 0; i < m; i += W4_ROWS) {
                const int64_t rows = m - i < W4_ROWS ? m - i : W4_ROWS;
                micro[rows](xq + i * kpad, sa + i * groups, asum + i * groups, kpad, panel, panel_scales, panel_bias,
                            out + i * n + p * PANEL, n, m0, m1);
            }
        }
    }
    free(scratch);
    return 0;
}

/* out[m, n] = x[m, k] . W^T + bias (bias may be NULL). scales NULL: wp holds fp32 panels; else
 * int8 (bits 8) or int4 (bits 4) panels with their scales (see the layout above). With int8 panels and at least
 * WIDEN_ONCE_ROWS rows, each thread widens a panel into its own fp32 buffer once and runs the
 * fp32 micro-kernels on it, instead of widening it again for every block of ROWS rows: a batch
 * then runs at the fp32 kernel's speed (the widening costs about as much as the FMAs it feeds),
 * while one or a few rows still read a quarter of the bytes. The sums are the same either way.
 * Returns 0, or -1 when an int4 call could not allocate its scratch memory (nothing written). */
#define WIDEN_ONCE_ROWS (2 * ROWS)
int packed_linear(const float *x, const void *wp, const float *scales, const float *bias, float *out, int64_t m,
                  int64_t n, int64_t k, int64_t bits)
{
    if (scales && bits == 4) return packed_linear_w4a8(x, (const uint8_t *)wp, scales, bias, out, m, n, k);
    const int64_t panels = (n + PANEL - 1) / PANEL, groups = (k + GROUP - 1) / GROUP;
    const int64_t panel_bytes = !scales ? k * PANEL * (int64_t)sizeof(float) : k * PANEL;
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
    return 0;
}
