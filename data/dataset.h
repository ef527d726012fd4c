/*
 * dataset.h: what data/'s files share of data sets (dataset.c): the host route with the name of
 * the public function it serves.
 */
#ifndef KILN_DATA_DATASET_H
#define KILN_DATA_DATASET_H

#include <stdbool.h>

#include "kiln.h"

/* kiln_dataset_from_host, its errors naming fn. */
kiln_dataset *kiln__dataset_from_host(kiln_ctx *ctx, const char *fn, kiln_host_type type,
                                      kiln_shape shape, const void *images, kiln_host_labels labels,
                                      const kiln_normalize *norm);

#endif
