/* kernels.h: the CUDA kernel table, one line a kernel (the CPU kernel's name without gt_):
 * X(name) has a launcher gtc_k_<name>; S(name) also a sizes function gtc_s_<name>. The
 * table in runtime.cu and the declarations below are made from this list alone. */
#ifndef GTC_KERNELS_H
#define GTC_KERNELS_H

#define GTC_KERNELS(X, S)                                                                      \
    X(add_fwd_f32) X(sub_fwd_f32) X(mul_fwd_f32) X(div_fwd_f32)                                \
    X(scale_fwd_f32) X(fill_fwd_f32) X(relu_fwd_f32) X(silu_fwd_f32) X(tanh_fwd_f32)          \
    X(softplus_fwd_f32) X(log1mexp_fwd_f32) X(exp_fwd_f32) X(log_fwd_f32) X(sqrt_fwd_f32)     \
    X(sqr_fwd_f32) X(relu_bwd_f32) X(silu_bwd_f32)                                             \
    X(swiglu_fwd_f32) X(swiglu_bwd_f32) X(geglu_fwd_f32) X(geglu_bwd_f32) X(dropout_fwd_f32)  \
    X(swiglu_oai_fwd_f32) X(swiglu_oai_bwd_f32)                                                \
    S(sum_fwd_f32) S(sumsq_fwd_f32) X(sum_rows_fwd_f32) X(repeat_fwd_f32) X(repeat_bwd_f32)   \
    X(rms_norm_fwd_f32) X(rms_norm_bwd_f32) X(softmax_fwd_f32) X(softmax_bwd_f32)             \
    S(cross_entropy_fwd_f32) S(cross_entropy_bwd_f32) X(rope_fwd_f32) X(rope_bwd_f32)         \
    X(get_rows_fwd_f32) X(get_rows_bwd_f32) X(copy_fwd_f32) X(copy_fwd_f16) X(copy_fwd_bf16)  \
    X(set_rows_fwd_f32) X(view_bwd_f32) X(adamw_step_fwd_f32) X(sgd_step_fwd_f32)             \
    X(max_pool2d_fwd_f32) X(max_pool2d_bwd_f32) X(im2col_fwd_f32) X(im2col_bwd_f32)           \
    S(attention_fwd_f32) S(attention_bwd_f32)                                                  \
    X(conv2d_fwd_f32) S(conv2d_weight_bwd_f32) S(conv2d_input_bwd_f32)                         \
    X(moe_topk_fwd_i32) X(moe_weights_fwd_f32) X(moe_weights_bwd_f32)                          \
    X(moe_matmul_fwd_f32) X(moe_matmul_input_bwd_f32) X(moe_matmul_weight_bwd_f32)             \
    S(moe_matmul_fwd_f32_f16) S(moe_matmul_fwd_f32_bf16) S(moe_matmul_fwd_f32_q4_0)            \
    S(moe_matmul_fwd_f32_q4_1) S(moe_matmul_fwd_f32_q5_0) S(moe_matmul_fwd_f32_q5_1)           \
    S(moe_matmul_fwd_f32_q8_0) S(moe_matmul_fwd_f32_q2_k) S(moe_matmul_fwd_f32_q3_k)           \
    S(moe_matmul_fwd_f32_q4_k) S(moe_matmul_fwd_f32_q5_k) S(moe_matmul_fwd_f32_q6_k) S(moe_matmul_fwd_f32_mxfp4)           \
    S(moe_matmul_input_bwd_f32_f16) S(moe_matmul_input_bwd_f32_bf16)                           \
    S(moe_matmul_input_bwd_f32_q4_0) S(moe_matmul_input_bwd_f32_q4_1)                          \
    S(moe_matmul_input_bwd_f32_q5_0) S(moe_matmul_input_bwd_f32_q5_1)                          \
    S(moe_matmul_input_bwd_f32_q8_0) S(moe_matmul_input_bwd_f32_q2_k)                          \
    S(moe_matmul_input_bwd_f32_q3_k) S(moe_matmul_input_bwd_f32_q4_k)                          \
    S(moe_matmul_input_bwd_f32_q5_k) S(moe_matmul_input_bwd_f32_q6_k) S(moe_matmul_input_bwd_f32_mxfp4)                          \
    X(causal_conv1d_fwd_f32) X(causal_conv1d_input_bwd_f32) X(causal_conv1d_weight_bwd_f32)    \
    S(delta_rule_fwd_f32) S(delta_rule_bwd_f32)                                                \
    S(matmul_fwd_f32)                                                                          \
    S(matmul_fwd_f32_f16) S(matmul_fwd_f32_bf16) S(matmul_fwd_f32_q4_0) S(matmul_fwd_f32_q4_1) \
    S(matmul_fwd_f32_q5_0) S(matmul_fwd_f32_q5_1) S(matmul_fwd_f32_q8_0)                       \
    S(matmul_fwd_f32_q2_k) S(matmul_fwd_f32_q3_k) S(matmul_fwd_f32_q4_k)                       \
    S(matmul_fwd_f32_q5_k) S(matmul_fwd_f32_q6_k) S(matmul_fwd_f32_mxfp4)                                              \
    X(get_rows_fwd_f32_f16) X(get_rows_fwd_f32_bf16) X(get_rows_fwd_f32_q4_0)                  \
    X(get_rows_fwd_f32_q4_1) X(get_rows_fwd_f32_q5_0) X(get_rows_fwd_f32_q5_1)                 \
    X(get_rows_fwd_f32_q8_0) X(get_rows_fwd_f32_q2_k) X(get_rows_fwd_f32_q3_k)                 \
    X(get_rows_fwd_f32_q4_k) X(get_rows_fwd_f32_q5_k) X(get_rows_fwd_f32_q6_k) X(get_rows_fwd_f32_mxfp4)                 \
    S(linear_cross_entropy_fwd_f32) S(linear_cross_entropy_fwd_f32_f16)                        \
    S(linear_cross_entropy_fwd_f32_bf16) S(linear_cross_entropy_fwd_f32_q4_0)                  \
    S(linear_cross_entropy_fwd_f32_q4_1) S(linear_cross_entropy_fwd_f32_q5_0)                  \
    S(linear_cross_entropy_fwd_f32_q5_1) S(linear_cross_entropy_fwd_f32_q8_0)                  \
    S(linear_cross_entropy_fwd_f32_q2_k) S(linear_cross_entropy_fwd_f32_q3_k)                  \
    S(linear_cross_entropy_fwd_f32_q4_k) S(linear_cross_entropy_fwd_f32_q5_k)                  \
    S(linear_cross_entropy_fwd_f32_q6_k) S(linear_cross_entropy_fwd_f32_mxfp4)                                                       \
    S(matmul_lora_fwd_f32) S(matmul_lora_fwd_f32_f16) S(matmul_lora_fwd_f32_bf16) \
    S(matmul_lora_fwd_f32_q4_0) S(matmul_lora_fwd_f32_q4_1) S(matmul_lora_fwd_f32_q5_0) \
    S(matmul_lora_fwd_f32_q5_1) S(matmul_lora_fwd_f32_q8_0) S(matmul_lora_fwd_f32_q2_k) \
    S(matmul_lora_fwd_f32_q3_k) S(matmul_lora_fwd_f32_q4_k) S(matmul_lora_fwd_f32_q5_k) \
    S(matmul_lora_fwd_f32_q6_k) S(matmul_lora_fwd_f32_mxfp4)

#define GTC_DECLARE_K(name) extern "C" int gtc_k_##name(const gt_node *node, const gt_ctx *ctx);
#define GTC_DECLARE_S(name) GTC_DECLARE_K(name) \
    extern "C" int gtc_s_##name(const gt_node *node, int64_t *scratch, int64_t *work);
GTC_KERNELS(GTC_DECLARE_K, GTC_DECLARE_S)

#endif
