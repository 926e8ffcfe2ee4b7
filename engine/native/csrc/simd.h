/* One vector vocabulary for the kernels, so each kernel is written once and compiled once per
 * instruction set (kernels.py builds one library per KernelMode, with that set's -m flags):
 * AVX-512 (16 floats a vector, mask registers) or AVX2 + FMA (8 floats, masks as vectors).
 * Every kernel file that vectorises includes this; the C fallbacks need none of it.
 */
#ifndef NATIVE_SIMD_H
#define NATIVE_SIMD_H
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
typedef __mmask16 vmask;
#define vzero() _mm512_setzero_ps()
#define vset1(x) _mm512_set1_ps(x)
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vload_masked(m, p) _mm512_maskz_loadu_ps(m, p)
#define vstore_masked(p, m, v) _mm512_mask_storeu_ps(p, m, v)
/* VL int8 weights (one 16-byte load) as floats. */
#define vload_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
/* Integer vectors (VL int32 lanes, 4 * VL bytes), for the int8 dot products. VNNI_TARGET marks a
 * function that uses vi_dpbusd (VNNI at this width: AVX512-VNNI, AVX-VNNI in the AVX2 build);
 * callers choose it only where the CPU has it. */
typedef __m512i vi;
#define vi_zero() _mm512_setzero_si512()
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_store(p, v) _mm512_storeu_si512((void *)(p), v)
#define vi_set1(x) _mm512_set1_epi32(x)
#define vi_set1_8(x) _mm512_set1_epi8(x)
#define vi_sub(a, b) _mm512_sub_epi32(a, b)
#define vi_xor(a, b) _mm512_xor_si512(a, b)
#define vi_and(a, b) _mm512_and_si512(a, b)
#define vi_srli16(a, n) _mm512_srli_epi16(a, n)
#define vi_to_f(a) _mm512_cvtepi32_ps(a)
#define vi_maddubs(a, b) _mm512_maddubs_epi16(a, b) /* u8 a x s8 b, adjacent pairs summed to int16 */
#define vi_add16(a, b) _mm512_add_epi16(a, b)
#define vi_widen16(a) _mm512_madd_epi16(a, _mm512_set1_epi16(1)) /* int16 pairs summed to int32 */
#define vi_add(a, b) _mm512_add_epi32(a, b)
#define VNNI_TARGET __attribute__((target("avx512vnni")))
#define vi_dpbusd(acc, a, b) _mm512_dpbusd_epi32(acc, a, b)
static inline vmask vmask_first(int64_t lanes)
{
    return lanes >= VL ? (vmask)0xFFFF : lanes <= 0 ? (vmask)0 : (vmask)((1u << lanes) - 1);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
typedef __m256i vmask;
#define vzero() _mm256_setzero_ps()
#define vset1(x) _mm256_set1_ps(x)
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vload_masked(m, p) _mm256_maskload_ps(p, m)
#define vstore_masked(p, m, v) _mm256_maskstore_ps(p, m, v)
/* VL int8 weights (one 8-byte load) as floats. */
#define vload_i8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
/* Integer vectors (VL int32 lanes, 4 * VL bytes), for the int8 dot products. VNNI_TARGET marks a
 * function that uses vi_dpbusd (VNNI at this width: AVX512-VNNI, AVX-VNNI in the AVX2 build);
 * callers choose it only where the CPU has it. */
typedef __m256i vi;
#define vi_zero() _mm256_setzero_si256()
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_store(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define vi_set1(x) _mm256_set1_epi32(x)
#define vi_set1_8(x) _mm256_set1_epi8(x)
#define vi_sub(a, b) _mm256_sub_epi32(a, b)
#define vi_xor(a, b) _mm256_xor_si256(a, b)
#define vi_and(a, b) _mm256_and_si256(a, b)
#define vi_srli16(a, n) _mm256_srli_epi16(a, n)
#define vi_to_f(a) _mm256_cvtepi32_ps(a)
#define vi_maddubs(a, b) _mm256_maddubs_epi16(a, b) /* u8 a x s8 b, adjacent pairs summed to int16 */
#define vi_add16(a, b) _mm256_add_epi16(a, b)
#define vi_widen16(a) _mm256_madd_epi16(a, _mm256_set1_epi16(1)) /* int16 pairs summed to int32 */
#define vi_add(a, b) _mm256_add_epi32(a, b)
#define VNNI_TARGET __attribute__((target("avxvnni")))
#define vi_dpbusd(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
static inline vmask vmask_first(int64_t lanes)
{
    const int32_t n = lanes >= VL ? VL : lanes <= 0 ? 0 : (int32_t)lanes;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

#if defined(VL)
#define HAS_SIMD 1
#endif
#endif
