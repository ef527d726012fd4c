/*
 * bucket.c: which gradients are all-reduced together. Data parallel training averages every
 * gradient over the ranks; one all-reduce a gradient pays NCCL's latency hundreds of times a
 * step, one for them all waits for the whole backward pass. PyTorch's DistributedDataParallel
 * groups them into buckets in the order backward produces them and starts each bucket's
 * all-reduce as soon as its last gradient is ready, overlapping the rest of backward; the plan
 * here is its assignment (the rule is in dist.h), with each gradient's place in its bucket's
 * flat buffer.
 */
#include <stdlib.h>
#include <string.h>

#include "dist.h"

kiln_status kiln__bucket_plan_make(const char *fn, const int64_t *sizes, int n, const int *ready,
                                   int64_t first_cap, int64_t cap, int64_t align,
                                   kiln__bucket_plan *plan, char *err, size_t err_size) {
  if (!plan || (n > 0 && !sizes) || n < 0)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: %s", fn,
                           !plan   ? "NULL plan"
                           : n < 0 ? "a negative gradient count"
                                   : "NULL sizes");
  if (first_cap < 0 || cap < 0)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: bucket caps %lld (first) and %lld must not be negative (0: 1 MiB "
                           "and 25 MiB)",
                           fn, (long long)first_cap, (long long)cap);
  if (align == 0) align = KILN__BUCKET_ALIGN;
  if (align < 0 || align > ((int64_t)1 << 30) || (align & (align - 1)))
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: alignment %lld is not a power of two up to 2^30", fn,
                           (long long)align);
  if (!first_cap) first_cap = KILN__BUCKET_FIRST_CAP;
  if (!cap) cap = KILN__BUCKET_CAP;
  for (int i = 0; i < n; i++)
    if (sizes[i] < 0)
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: gradient %d has a negative size, %lld bytes", fn, i,
                             (long long)sizes[i]);

  kiln__bucket_plan p;
  memset(&p, 0, sizeof p);
  size_t m = n > 0 ? (size_t)n : 1;
  p.ngrads = n;
  p.grad = malloc(m * sizeof *p.grad);
  p.start = malloc((m + 1) * sizeof *p.start);
  p.offset = malloc(m * sizeof *p.offset);
  p.bytes = malloc(m * sizeof *p.bytes);
  p.payload = malloc(m * sizeof *p.payload);
  unsigned char *seen = calloc(m, 1);
  if (!p.grad || !p.start || !p.offset || !p.bytes || !p.payload || !seen) {
    free(seen);
    kiln__bucket_plan_free(&p);
    return kiln__dist_fail(err, err_size, KILN_ERR_OOM,
                           "%s: out of host memory planning %d gradients", fn, n);
  }
  /* the order: a permutation, checked */
  for (int k = 0; k < n; k++) {
    int g = ready ? ready[k] : n - 1 - k;
    if (g < 0 || g >= n || seen[g]) {
      free(seen);
      kiln__bucket_plan_free(&p);
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: ready[%d] = %d is %s: the ready order must name each of the %d "
                             "gradients once",
                             fn, k, g, g < 0 || g >= n ? "out of range" : "a repeat", n);
    }
    seen[g] = 1;
    p.grad[k] = g;
  }
  free(seen);

  /* PyTorch's rule: fill the open bucket in order; close it once its bytes reach its cap */
  int64_t payload = 0, bytes = 0, limit = first_cap;
  p.start[0] = 0;
  for (int k = 0; k < n; k++) {
    int64_t size = sizes[p.grad[k]];
    int64_t at = bytes > INT64_MAX - (align - 1) ? -1 : (bytes + align - 1) & ~(align - 1);
    if (at < 0 || size > INT64_MAX - at) { /* (the payload is at most the bytes) */
      int g = p.grad[k];
      kiln__bucket_plan_free(&p);
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: a bucket's size overflows at gradient %d (%lld bytes)", fn, g,
                             (long long)size);
    }
    p.offset[k] = at;
    bytes = at + size;
    payload += size;
    bool last = k == n - 1;
    if (payload >= limit || last) {
      p.bytes[p.nbuckets] = bytes;
      p.payload[p.nbuckets] = payload;
      p.start[++p.nbuckets] = k + 1;
      payload = bytes = 0;
      limit = cap;
    }
  }
  *plan = p;
  return KILN_OK;
}

void kiln__bucket_plan_free(kiln__bucket_plan *plan) {
  if (!plan) return;
  free(plan->grad);
  free(plan->start);
  free(plan->offset);
  free(plan->bytes);
  free(plan->payload);
  memset(plan, 0, sizeof *plan);
}
