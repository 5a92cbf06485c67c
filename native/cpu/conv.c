/* conv.c: placeholder, being written. */
#include "internal.h"
int gt_im2col_fwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "im2col: not implemented yet"); }
int gt_im2col_bwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "im2col: not implemented yet"); }
int gt_max_pool2d_fwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "max_pool2d: not implemented yet"); }
int gt_max_pool2d_bwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "max_pool2d: not implemented yet"); }
