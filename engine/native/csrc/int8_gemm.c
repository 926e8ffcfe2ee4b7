/* int8 x int8 -> int32 matmul from weights packed once, for the safety encoder's w8a8 layers
 * (gateway/safety/embedder.py). torch._int_mm (oneDNN) reorders its weight on every call: on
 * CPUs without VNNI that costs more than the arithmetic for a short text (a 16-token encoder
 * pass took 10 ms, against 3 ms with float activations), and on every CPU it is ~40 us per call
 * for a few rows. Here the weight is packed once and a call costs its arithmetic.
 *
 * The sums are exact integers, the same as torch._int_mm's: activations are signed int8 (-127..127)
 * read as unsigned (x + 128, for the u8 x s8 instructions) with 128 * (column sum of the weight)
 * taken off again; weights must lie in -63..63 (7 bits), so that the 16-bit pair sums of the
 * instructions without VNNI (vpmaddubsw) never saturate: 2 * 255 * 63 < 32767.
 *
 * Packed layout, per block of NB output columns (NB = 2 vectors of int32: 32 with AVX-512, 16 with
 * AVX2): [k / 4][NB][4] bytes, so that one vector load gives VL columns' weights for 4 inputs.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define NB (2 * VL) /* output columns per packed block */
#define MR 6 /* rows per register block: 12 accumulators (with AVX2, 4 rows measured slower) */
#define W_MAX 63

int64_t int8_gemm_block(void) { return NB; }

/* w [k, n] int8 (torch._int_mm's layout) -> packed [n / NB][k / 4][NB][4]; colsum128[n] = 128 *
 * sum_k w[k][c]. Returns 0, or -1 when k % 4, n % NB or a weight outside -63..63 forbid it. */
int int8_gemm_pack(const int8_t *w, int8_t *packed, int32_t *colsum128, int64_t k, int64_t n)
{
    if (k % 4 || n % NB) return -1;
    for (int64_t i = 0; i < k * n; i++)
        if (w[i] > W_MAX || w[i] < -W_MAX) return -1;
    for (int64_t c = 0; c < n; c++) {
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) sum += w[i * n + c];
        colsum128[c] = 128 * sum;
    }
    for (int64_t b = 0; b < n / NB; b++)
        for (int64_t g = 0; g < k / 4; g++)
            for (int64_t c = 0; c < NB; c++)
                for (int64_t j = 0; j < 4; j++)
                    packed[((b * (k / 4) + g) * NB + c) * 4 + j] = w[(g * 4 + j) * n + b * NB + c];
    return 0;
}

#define vi_dot_u8s8(acc, a, b) vi_add(acc, vi_widen16(vi_maddubs(a, b)))

/* One block of NB columns for `rows` rows (rows <= MR) from x (row stride k) into out (row stride
 * n); each 4 activations are read as unsigned on the way (x + 128: a XOR of the broadcast). */
#define GEMM_BLOCK_FN(NAME, DOT, ATTRIBUTES)                                                                \
    ATTRIBUTES static inline __attribute__((always_inline)) void NAME(                                       \
        const int8_t *x, const int8_t *wb, const int32_t *colsum128, int32_t *out, int64_t n, int64_t k,    \
        const int rows)                                                                                     \
    {                                                                                                       \
        vi acc0[MR], acc1[MR];                                                                              \
        const vi flip = vi_set1((int32_t)0x80808080);                                                       \
        for (int r = 0; r < MR; r++) acc0[r] = acc1[r] = vi_zero();                                         \
        for (int64_t g = 0; g < k / 4; g++) {                                                               \
            const vi w0 = vi_load(wb + g * NB * 4), w1 = vi_load(wb + g * NB * 4 + VL * 4);                 \
            for (int r = 0; r < MR; r++) {                                                                  \
                if (r >= rows) break;                                                                       \
                int32_t four;                                                                               \
                memcpy(&four, x + r * k + g * 4, 4);                                                        \
                const vi a = vi_xor(vi_set1(four), flip); /* x + 128: four unsigned bytes */                \
                acc0[r] = DOT(acc0[r], a, w0);                                                              \
                acc1[r] = DOT(acc1[r], a, w1);                                                              \
            }                                                                                               \
        }                                                                                                   \
        const vi s0 = vi_load(colsum128), s1 = vi_load(colsum128 + VL);                                     \
        for (int r = 0; r < MR; r++) {                                                                      \
            if (r >= rows) break;                                                                           \
            vi_store(out + r * n, vi_sub(acc0[r], s0));                                                     \
            vi_store(out + r * n + VL, vi_sub(acc1[r], s1));                                                \
        }                                                                                                   \
    }
GEMM_BLOCK_FN(block_maddubs, vi_dot_u8s8, )
GEMM_BLOCK_FN(block_vnni, vi_dpbusd, VNNI_TARGET)

/* Every block of NB columns and MR rows, split over the threads. SPECIALIZE: full blocks inline the
 * block with rows = MR, so its row loops have constant bounds and the 12 accumulators stay in
 * registers: the VNNI kernel 1.25-1.3x faster than with a bound known only at run time. The
 * vpmaddubsw sequence keeps the run-time bound: unrolled, its temporaries do not fit beside the
 * accumulators in AVX2's 16 registers (10% slower, measured). */
#define GEMM_FN(NAME, BLOCK, ATTRIBUTES, SPECIALIZE)                                                        \
    ATTRIBUTES static void NAME(const int8_t *x, const int8_t *packed, const int32_t *colsum128,            \
                                int32_t *out, int64_t m, int64_t n, int64_t k)                              \
    {                                                                                                       \
        const int64_t blocks = n / NB, row_blocks = (m + MR - 1) / MR;                                      \
        _Pragma("omp parallel for schedule(static) collapse(2) if (m * n * k >= 1 << 20)")                 \
        for (int64_t b = 0; b < blocks; b++)                                                                \
            for (int64_t rb = 0; rb < row_blocks; rb++) {                                                   \
                const int64_t m0 = rb * MR;                                                                 \
                const int8_t *wb = packed + b * (k / 4) * NB * 4;                                           \
                const int8_t *x0 = x + m0 * k;                                                              \
                int32_t *o = out + m0 * n + b * NB;                                                         \
                if (SPECIALIZE && m - m0 >= MR)                                                             \
                    BLOCK(x0, wb, colsum128 + b * NB, o, n, k, MR);                                         \
                else                                                                                        \
                    BLOCK(x0, wb, colsum128 + b * NB, o, n, k, (int)(m - m0 < MR ? m - m0 : MR));           \
            }                                                                                               \
    }
GEMM_FN(gemm_maddubs, block_maddubs, , 0)
GEMM_FN(gemm_vnni, block_vnni, VNNI_TARGET, 1)

/* out [m, n] int32 = x [m, k] int8 (-127..127) @ w [k, n], w packed by int8_gemm_pack. vnni: the CPU
 * has VNNI for this vector width (AVX512-VNNI, or AVX-VNNI in the AVX2 build). */
void int8_gemm(const int8_t *x, const int8_t *packed, const int32_t *colsum128, int32_t *out, int64_t m, int64_t n,
               int64_t k, int64_t vnni)
{
    if (vnni)
        gemm_vnni(x, packed, colsum128, out, m, n, k);
    else
        gemm_maddubs(x, packed, colsum128, out, m, n, k);
}
