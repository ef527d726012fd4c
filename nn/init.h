/*
 * init.h: what nn/init.c offers beyond kiln.h, for kiln_init_whitening and its tests: a
 * symmetric eigensolver (cyclic Jacobi), the uncentred covariance of image patches and the
 * whitening filters made from them, all on the host in float64.
 */
#ifndef KILN_INIT_H
#define KILN_INIT_H

#include "../core/internal.h"

/* What kiln__eigh_jacobi returns when it fails: BAD for n < 1, a NULL pointer, a value of the
 * upper triangle that is not finite or a norm that overflows; OOM out of host memory; NOCONV when
 * KILN__EIGH_SWEEPS sweeps do not converge. */
#define KILN__EIGH_BAD (-1)
#define KILN__EIGH_OOM (-2)
#define KILN__EIGH_NOCONV (-3)
#define KILN__EIGH_SWEEPS 100

/* The eigen-decomposition a = sum_i w[i] v_i v_i^T of the symmetric n x n matrix a (row-major;
 * only its upper triangle is read, as torch.linalg.eigh(a, UPLO="U")) by cyclic Jacobi rotations
 * in float64. w (n) receives the eigenvalues in descending order (ties keep the order of the
 * diagonal they end on) and v (n x n, row-major) the unit eigenvectors, eigenvector i in row i
 * (v[i * n + k]), each signed so that its component of largest magnitude (the first of equal
 * ones) is positive. Returns the number of sweeps made (0 for a diagonal matrix), or one of
 * KILN__EIGH_* with w and v untouched. */
int kiln__eigh_jacobi(int n, const double *a, double *w, double *v);

/* The uncentred covariance cov (K x K, K = C kh kw, row-major) of every kh x kw patch, stride 1,
 * without padding, of images (n, H, W, C) channels last: sum over patches of p p^T divided by
 * their count n (H - kh + 1) (W - kw + 1). A value is read as kiln_dataset_from_host reads it:
 * a byte as byte / 255 (KILN_HOST_U8) or a float as it is, then (x - mean[c]) / std[c] in float
 * under norm (NULL or 0 channels: none; 1: one mean and std for all). Patch element (c, dh, dw)
 * has index (c kh + dh) kw + dw, the order of a filter's (Cin, kh, kw) in a convolution weight.
 * Nothing is checked here (kiln__whitening_filters checks); false out of host memory. */
bool kiln__patch_covariance(kiln_host_type type, const int64_t shape[4], const void *images,
                            const kiln_normalize *norm, int kh, int kw, double *cov);

/* The whitening filters of kiln_init_whitening (kiln.h): filters (cout, C, kh, kw) row-major f32,
 * filter i < cout / 2 being eigenvector i of the patch covariance divided by sqrt(eigenvalue i +
 * eps) and filter cout / 2 + i its negative; eigenvalues (K, may be NULL) receives the
 * covariance's eigenvalues, descending. images (n, H, W, C) with C = shape.d[3]; eps as
 * kiln_init_whitening takes it (0: 5e-4). Every argument is checked, an error naming fn set on
 * ctx, and on failure filters and eigenvalues are untouched. */
kiln_status kiln__whitening_filters(kiln_ctx *ctx, const char *fn, kiln_host_type type,
                                    kiln_shape shape, const void *images,
                                    const kiln_normalize *norm, int64_t cout, int kh, int kw,
                                    float eps, float *filters, double *eigenvalues);

#endif
