/*
 * shard.h: one rank's share of an epoch (shard.c), PyTorch's DistributedSampler over the order a
 * loader made for the epoch. Pure functions of the order, so every rank, given the same seed (and
 * so the same order), takes its own part and the parts fit together.
 */
#ifndef KILN_DATA_SHARD_H
#define KILN_DATA_SHARD_H

#include <stdbool.h>
#include <stdint.h>

/* How many of an epoch's n samples each of world ranks takes: ceil(n / world), the order padded
 * by repeating its first indices to world times that; with drop_last, floor(n / world), the tail
 * of the order dropped (DistributedSampler's num_samples). -1 for n < 0 or world < 1. */
int64_t kiln__shard_count(int64_t n, int world, bool drop_last);

/*
 * Rank's shard of the epoch's order (n indices) into out (kiln__shard_count entries):
 * out[j] = padded[rank + j * world], where padded is the order followed by its own first indices,
 * repeated as often as needed, up to world * count entries (with drop_last, the order cut to
 * that length) -- DistributedSampler's indices[rank:total_size:num_replicas]. When world divides
 * n, every index of the order is in exactly one rank's shard; otherwise without drop_last the
 * first world * count - n of the order are in two shards (more when n < world), and with it the
 * last n - world * count are in none. Returns the count, or -1 (out untouched) for a rank
 * outside 0..world-1, a negative n (or one within world of INT64_MAX), or NULL order or out with
 * samples to take.
 */
int64_t kiln__shard_order(const int32_t *order, int64_t n, int rank, int world, bool drop_last,
                          int32_t *out);

#endif
