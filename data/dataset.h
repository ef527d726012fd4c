/*
 * dataset.h: what data/'s files share of data sets and loaders (dataset.c): the host route with
 * the name of the public function it serves, and the loader's batches and sums that kiln_evaluate
 * (evaluate.c) reads without moving the loader.
 */
#ifndef KILN_DATA_DATASET_H
#define KILN_DATA_DATASET_H

#include <stdbool.h>

#include "kiln.h"

/* kiln_dataset_from_host, its errors naming fn. */
kiln_dataset *kiln__dataset_from_host(kiln_ctx *ctx, const char *fn, kiln_host_type type,
                                      kiln_shape shape, const void *images, kiln_host_labels labels,
                                      const kiln_normalize *norm);

kiln_ctx *kiln__loader_ctx(const kiln_loader *l);
/* The rows of the loader's full batches: its batch size, or the data set's when that is smaller. */
int64_t kiln__loader_rows(const kiln_loader *l);
/* Batch k (0 <= k < kiln_loader_batches) of the loader's current epoch, the batch kiln_loader_next
 * gives there, recorded without moving the loader; false with the error set (naming fn). */
bool kiln__loader_batch_at(kiln_loader *l, int64_t k, kiln_tensor **x, kiln_tensor **y,
                           const char *fn);
/* Two persistent f32 scalars the loader keeps for kiln_evaluate's sums (its loss and its count of
 * correct predictions), made on first use and freed with the loader, so that evaluating the same
 * loader again records the same step; false with the error set. */
bool kiln__loader_eval_sums(kiln_loader *l, kiln_tensor **loss, kiln_tensor **hits);

#endif
