/* matmul.c: placeholder, being written. */
#include "internal.h"
int gt_matmul_fwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "matmul: not implemented yet"); }
int64_t gt_matmul_work_size(void) { return 0; }
