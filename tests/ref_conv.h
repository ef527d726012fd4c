/*
 * ref_conv.h: float64 host references for the image ops, written from PyTorch's definitions and
 * not from kiln: 2-D convolution over (N, H, W, C) images with PyTorch-layout weights
 * (Cout, Cin / groups, kh, kw), max and average pooling, global pooling, batch and layer
 * normalisation (with PyTorch's running statistics), and flatten in PyTorch's (C, H, W) order.
 * Each forward reference has a backward one: the gradients of sum(y * g) for a given g.
 * Every geometry here is explicit (strides of 1, not 0): the tests turn kiln's options, whose
 * zero fields mean defaults, into these.
 */
#ifndef KILN_TEST_REF_CONV_H
#define KILN_TEST_REF_CONV_H

#include "ref.h"

/* ---------------------------------------------------------------- geometry */

/* A window's geometry, every field explicit: kernel, stride, zero padding on each side,
 * dilation, and (convolution only) groups. */
typedef struct ref_win {
  int kh, kw;
  int sh, sw;
  int ph, pw;
  int dh, dw;
  int groups;
} ref_win;

/* floor((in + 2 pad - dil (k - 1) - 1) / stride) + 1, or 0 when the window does not fit. */
int64_t ref_out_size(int64_t in, int k, int stride, int pad, int dil);
/* An image (N, H, W, C) and the window: its output (N, OH, OW, cout). */
kiln_shape ref_win_out(kiln_shape x, const ref_win *w, int64_t cout);
/* "k3x3 s2x2 p1x1 d1x1 g1", for messages. */
void ref_win_str(const ref_win *w, char *buf, size_t n);

/* A float buffer as a malloc'd double one. */
double *ref_to_double(const float *p, int64_t n);

/* ---------------------------------------------------------------- convolution */

/* y (N, OH, OW, Cout) = conv(x (N, H, W, Cin), w (Cout, Cin / groups, kh, kw)) + b (Cout, or
 * NULL), as torch.nn.functional.conv2d on the NCHW permutation of x. */
void ref_conv2d(const double *x, kiln_shape xs, const double *w, int64_t cout, const double *b,
                const ref_win *g, double *y);
/* The gradients of sum(y * gy): dx like x, dw like w, db (Cout) (each may be NULL). */
void ref_conv2d_backward(const double *x, kiln_shape xs, const double *w, int64_t cout,
                         const ref_win *g, const double *gy, double *dx, double *dw, double *db);

/* ---------------------------------------------------------------- pooling */

/* Max pooling of x (N, H, W, C): padding is -infinity, dilation as in the convolution. */
void ref_max_pool2d(const double *x, kiln_shape xs, const ref_win *g, double *y);
/* Its gradient goes to the first maximum of each window, scanning rows then columns (PyTorch's);
 * windows that overlap add up. */
void ref_max_pool2d_backward(const double *x, kiln_shape xs, const ref_win *g, const double *gy,
                             double *dx);
/* Average pooling (no dilation): exclude_pad 0 divides by kh * kw (PyTorch's count_include_pad,
 * floor mode), 1 by the number of the window's elements inside the image. */
void ref_avg_pool2d(const double *x, kiln_shape xs, const ref_win *g, int exclude_pad, double *y);
void ref_avg_pool2d_backward(kiln_shape xs, const ref_win *g, int exclude_pad, const double *gy,
                             double *dx);
/* The mean (max 0) or the maximum (max 1) over H and W: (N, H, W, C) to (N, C); the maximum's
 * gradient goes to the first maximum in (h, w) order. */
void ref_global_pool(const double *x, kiln_shape xs, int max, double *y);
void ref_global_pool_backward(const double *x, kiln_shape xs, int max, const double *gy,
                              double *dx);

/* ---------------------------------------------------------------- normalisation */

/* Batch normalisation of x (M, C), M the product of every axis but the last. w and b (C) or NULL
 * (no affine). training: the batch's mean and biased variance normalise, and running statistics
 * given (rmean, rvar, or NULL) become (1 - momentum) running + momentum batch, the variance
 * unbiased (M / (M - 1)). Not training: the running statistics normalise (the batch's when they
 * are NULL), and nothing is updated. */
void ref_batch_norm(const double *x, int64_t m, int64_t c, const double *w, const double *b,
                    double *rmean, double *rvar, int training, double momentum, double eps,
                    double *y);
/* The gradients of sum(y * gy) in the mode the forward ran in: dx (M, C), dw and db (C) (each
 * may be NULL). rmean and rvar are the running statistics the eval forward read. */
void ref_batch_norm_backward(const double *x, int64_t m, int64_t c, const double *w,
                             const double *rmean, const double *rvar, int training, double eps,
                             const double *gy, double *dx, double *dw, double *db);

/* Layer normalisation of x (M, C) over its last axis; w and b (C) or NULL. */
void ref_layer_norm(const double *x, int64_t m, int64_t c, const double *w, const double *b,
                    double eps, double *y);
void ref_layer_norm_backward(const double *x, int64_t m, int64_t c, const double *w, double eps,
                             const double *gy, double *dx, double *dw, double *db);

/* ---------------------------------------------------------------- flatten */

/* (N, H, W, C) to (N, C * H * W) in PyTorch's order: y[n, (c H + h) W + w] = x[n, h, w, c]. */
void ref_flatten_nhwc(const double *x, kiln_shape xs, double *y);

/* ref_expect_close of the gradient kiln accumulated in t (shape s); which names t in messages. */
void ref_expect_grad(kiln_ctx *ctx, kiln_tensor *t, kiln_shape s, const double *want, double atol,
                     double rtol, const char *what, const char *which);
/* Records loss = sum(y * g) for a g of y's shape with values in [-1, 1) from seed, and its
 * backward pass, and runs it; returns g's values as doubles (malloc'd) and frees g. */
double *ref_backward_weighted(kiln_ctx *ctx, kiln_tensor *y, uint64_t seed, const char *what);

#endif
