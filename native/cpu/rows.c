/* rows.c: placeholder, being written. */
#include "internal.h"
int gt_get_rows_fwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "get_rows: not implemented yet"); }
int gt_get_rows_bwd_f32(const gt_node *n, const gt_ctx *c) { (void)n; (void)c; return GT_FAIL(GT_ERR_UNSUPPORTED, "get_rows: not implemented yet"); }
