/* Every function the kernels library exports: each kernel file includes this, so the compiler
 * checks its definitions against it, and decode_step.c calls them. kernels.py's ctypes table
 * must match it (tests/engine/test_kernel_header.py checks both). Returning int: 0 on success,
 * -1 when scratch memory could not be allocated (kernels.py raises MemoryError). */
#ifndef NATIVE_KERNELS_H
#define NATIVE_KERNELS_H
#include <stdint.h>

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                                const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t max_blocks, int64_t block_size,
                                int64_t max_context_len, float scale, int64_t window, float softcap);
int64_t packed_linear_panel(void);
void packed_linear_use_vnni(int64_t on);
int packed_linear(const float *x, const void *wp, const float *scales, const float *bias, float *out, int64_t m,
                  int64_t n, int64_t k, int64_t bits);
void rms_norm_f32(float *x, const float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
                  float eps);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t dim);
void gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t dim);
void rope_and_cache_f32(float *qkv, const int64_t *positions, const float *cos_table, const float *sin_table,
                        float *k_cache, float *v_cache, const int64_t *slots, int64_t tokens, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, int64_t block_size);
int decode_layers_f32(float *x, const int64_t *positions, const int64_t *const *slots,
                      const int32_t *const *block_tables, const int32_t *context_lens, int64_t max_blocks,
                      int64_t max_context_len, int64_t tokens, const int64_t *layers, int64_t num_layers,
                      int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                      int64_t block_size, int64_t gelu, float eps, float scale, float softcap, float *scratch);
void quantize_rows_i8(const float *x, int8_t *q, float *scale, int64_t rows, int64_t cols);
void dequant_i32_f32(const int32_t *acc, const float *row_scale, const float *col_scale, const float *bias,
                     float *out, int8_t *q, float *q_scale, int64_t rows, int64_t cols, int64_t gelu);
void dequant_add_layer_norm_f32(const int32_t *acc, const float *row_scale, const float *col_scale,
                                const float *bias, const float *residual, const float *ln_weight,
                                const float *ln_bias, float *out, int8_t *q, float *q_scale, int64_t rows,
                                int64_t cols, float eps);
int window_attention_f32(const float *qkv, const int64_t *starts, const int64_t *lens, float *out,
                         int64_t num_windows, int64_t heads, int64_t head_dim, float scale);
int64_t int8_gemm_block(void);
int int8_gemm_pack(const int8_t *w, int8_t *packed, int32_t *colsum128, int64_t k, int64_t n);
void int8_gemm(const int8_t *x, const int8_t *packed, const int32_t *colsum128, int32_t *out, int64_t m, int64_t n,
               int64_t k, int64_t vnni);
void gated_delta_decode_f32(float *states, const int64_t *slots, const float *q, const float *k, const float *v,
                            const float *beta, const float *log_decay, float *out, int64_t rows, int64_t heads,
                            int64_t dk, int64_t dv);
#endif
