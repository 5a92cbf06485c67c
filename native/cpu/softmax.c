/* softmax.c: placeholder, being written. */
#include "internal.h"
int gt_softmax_fwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "softmax: not implemented yet"); }
int gt_softmax_bwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "softmax: not implemented yet"); }
int gt_cross_entropy_fwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "cross_entropy: not implemented yet"); }
int gt_cross_entropy_bwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "cross_entropy: not implemented yet"); }
