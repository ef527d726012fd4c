/*
 * shard.c: a rank's shard of an epoch, with PyTorch's DistributedSampler's semantics. Every rank
 * shuffles the same order (the loader's seed is the same everywhere) and takes every world-th
 * index of it from its rank on; without drop_last the order is padded by its own first indices to
 * a multiple of the world, so every rank takes as many batches and none waits at an all-reduce
 * for another. Not yet wired into the loader (kiln_loader_start would keep its shard of the host
 * order and upload that); see the README's "Several GPUs".
 */
#include <stddef.h>

#include "shard.h"

int64_t kiln__shard_count(int64_t n, int world, bool drop_last) {
  if (n < 0 || world < 1) return -1;
  if (drop_last) return n / world;
  return n / world + (n % world != 0);
}

int64_t kiln__shard_order(const int32_t *order, int64_t n, int rank, int world, bool drop_last,
                          int32_t *out) {
  int64_t count = kiln__shard_count(n, world, drop_last);
  if (count < 0 || rank < 0 || rank >= world || n > INT64_MAX - world) return -1;
  if (count > 0 && (!order || !out)) return -1;
  /* i = rank + j * world < world * count <= n + world - 1, which fits */
  for (int64_t j = 0; j < count; j++) {
    int64_t i = rank + j * world;
    out[j] = order[i < n ? i : i % n];
  }
  return count;
}
