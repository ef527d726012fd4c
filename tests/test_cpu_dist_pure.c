/*
 * test_cpu_dist_pure.c: the pure functions of several GPUs' training (issue 25), without a GPU: the
 * launchers' environment (torchrun's, Open MPI's, none) with every bad value named; a rank's shard
 * of an epoch (data/shard.c) against PyTorch's DistributedSampler; the gradient buckets
 * (dist/bucket.c) against PyTorch DDP's rule. The rendezvous, NCCL's loader and kiln_dist_init
 * are test_cpu_dist.c's.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "data/shard.h"
#include "dist/dist.h"
#include "helpers.h"

#define ASSERT_HAS(s, part) cr_assert(strstr((s), (part)), "\"%s\" lacks \"%s\"", (s), (part))

/* ---------------------------------------------------------------- environment */

/* A made-up environment: name=value pairs. */
typedef struct vars {
  const char *kv[24];
} vars;

static const char *lookup(void *user, const char *name) {
  const vars *v = user;
  size_t n = strlen(name);
  for (int i = 0; v->kv[i]; i++)
    if (strncmp(v->kv[i], name, n) == 0 && v->kv[i][n] == '=') return v->kv[i] + n + 1;
  return NULL;
}

static kiln_status parse(vars v, kiln_dist_env *env, char *err, size_t n) {
  return kiln__dist_env_parse("kiln_dist_env_read", lookup, &v, env, err, n);
}

/* Parses v expecting an error that mentions each of the parts; env must stay as it was. */
static void parse_fails(vars v, const char *part1, const char *part2) {
  kiln_dist_env env, before;
  memset(&env, 0x5a, sizeof env);
  before = env;
  char err[1024] = "";
  cr_assert_eq(parse(v, &env, err, sizeof err), KILN_ERR_INVALID, "no error for %s", part1);
  ASSERT_HAS(err, "kiln_dist_env_read: ");
  ASSERT_HAS(err, part1);
  if (part2) ASSERT_HAS(err, part2);
  cr_assert_eq(memcmp(&env, &before, sizeof env), 0, "a failed parse changed env");
  for (const char *p = err; *p; p++)
    cr_assert(*p >= ' ' && *p <= '~', "a byte outside printable ASCII in \"%s\"", err);
}

Test(dist_env, no_launcher_is_one_process) {
  kiln_dist_env env;
  char err[256];
  cr_assert_eq(parse((vars){{"PATH=/bin", "MASTER_PORT=junk", NULL}}, &env, err, sizeof err),
               KILN_OK, "%s", err);
  cr_assert_eq(env.launcher, KILN_DIST_LAUNCHER_NONE);
  cr_assert_eq(env.rank, 0);
  cr_assert_eq(env.world_size, 1);
  cr_assert_eq(env.local_rank, 0);
  cr_assert_str_empty(env.master_addr);
  cr_assert_eq(env.master_port, 0);
}

Test(dist_env, torchrun) {
  kiln_dist_env env;
  char err[256];
  vars v = {{"RANK=5", "WORLD_SIZE=16", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4",
             "MASTER_ADDR=node-0.cluster", "MASTER_PORT=29500", NULL}};
  cr_assert_eq(parse(v, &env, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_eq(env.launcher, KILN_DIST_LAUNCHER_TORCHRUN);
  cr_assert_eq(env.rank, 5);
  cr_assert_eq(env.world_size, 16);
  cr_assert_eq(env.local_rank, 1);
  cr_assert_eq(env.local_world_size, 4);
  cr_assert_str_eq(env.master_addr, "node-0.cluster");
  cr_assert_eq(env.master_port, 29500);
  /* an IPv6 address in brackets, LOCAL_WORLD_SIZE absent */
  vars v6 = {
      {"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", "MASTER_ADDR=[::1]", "MASTER_PORT=1", NULL}};
  cr_assert_eq(parse(v6, &env, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_str_eq(env.master_addr, "::1");
  cr_assert_eq(env.local_world_size, 0);
  /* a world of 1 reads no address */
  vars one = {{"RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0", "MASTER_PORT=99999", NULL}};
  cr_assert_eq(parse(one, &env, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_eq(env.world_size, 1);
  cr_assert_eq(env.master_port, 0);
}

Test(dist_env, open_mpi) {
  kiln_dist_env env;
  char err[256];
  /* every rank on one machine: the rendezvous defaults to 127.0.0.1:29500 */
  vars v = {{"OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=3",
             "OMPI_COMM_WORLD_LOCAL_SIZE=4", NULL}};
  cr_assert_eq(parse(v, &env, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_eq(env.launcher, KILN_DIST_LAUNCHER_MPI);
  cr_assert_eq(env.rank, 3);
  cr_assert_eq(env.world_size, 4);
  cr_assert_eq(env.local_rank, 3);
  cr_assert_str_eq(env.master_addr, "127.0.0.1");
  cr_assert_eq(env.master_port, 29500);
  /* given ones win */
  vars given = {{"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE=4", "MASTER_ADDR=10.0.0.7", "MASTER_PORT=4000", NULL}};
  cr_assert_eq(parse(given, &env, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_str_eq(env.master_addr, "10.0.0.7");
  cr_assert_eq(env.master_port, 4000);
  /* torchrun's variables under mpirun, agreeing */
  vars both = {{"RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=1", "OMPI_COMM_WORLD_RANK=1",
                "OMPI_COMM_WORLD_SIZE=4", "MASTER_ADDR=h", "MASTER_PORT=7", NULL}};
  cr_assert_eq(parse(both, &env, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_eq(env.launcher, KILN_DIST_LAUNCHER_TORCHRUN);
}

Test(dist_env, bad_values_are_named) {
#define T(...) "RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=1", __VA_ARGS__, NULL
  parse_fails((vars){{"RANK=abc", "WORLD_SIZE=4", "LOCAL_RANK=0", NULL}}, "RANK=\"abc\"",
              "not a whole number");
  parse_fails((vars){{"RANK=4", "WORLD_SIZE=4", "LOCAL_RANK=0", NULL}}, "RANK=\"4\"",
              "not below WORLD_SIZE=4");
  parse_fails((vars){{"RANK=-1", "WORLD_SIZE=4", "LOCAL_RANK=0", NULL}}, "RANK=\"-1\"", NULL);
  parse_fails((vars){{"RANK=1 ", "WORLD_SIZE=4", "LOCAL_RANK=0", NULL}}, "RANK=\"1 \"", NULL);
  parse_fails((vars){{"RANK=", "WORLD_SIZE=4", "LOCAL_RANK=0", NULL}}, "RANK=\"\"", NULL);
  parse_fails((vars){{"RANK=0", "WORLD_SIZE=0", "LOCAL_RANK=0", NULL}}, "WORLD_SIZE=\"0\"",
              "1..65536");
  parse_fails((vars){{"RANK=0", "WORLD_SIZE=65537", "LOCAL_RANK=0", NULL}}, "WORLD_SIZE=\"65537\"",
              NULL);
  parse_fails((vars){{"RANK=0", "WORLD_SIZE=99999999999999999999999", "LOCAL_RANK=0", NULL}},
              "WORLD_SIZE=", "not a whole number");
  parse_fails((vars){{"RANK=0", NULL}}, "RANK is set but WORLD_SIZE is not", NULL);
  parse_fails((vars){{"WORLD_SIZE=2", NULL}}, "WORLD_SIZE is set but RANK is not", NULL);
  parse_fails((vars){{"RANK=1", "WORLD_SIZE=4", "MASTER_ADDR=h", "MASTER_PORT=1", NULL}},
              "LOCAL_RANK is not", NULL);
  parse_fails((vars){{T("LOCAL_WORLD_SIZE=1")}}, "LOCAL_RANK=\"1\"", "outside 0..0");
  parse_fails((vars){{"RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=8", NULL}},
              "LOCAL_WORLD_SIZE=\"8\"", "1..4");
  parse_fails((vars){{T("MASTER_PORT=29500")}}, "MASTER_ADDR is not set", "WORLD_SIZE=4");
  parse_fails((vars){{T("MASTER_ADDR=h")}}, "MASTER_PORT is not set", NULL);
  parse_fails((vars){{T("MASTER_ADDR=h", "MASTER_PORT=0")}}, "MASTER_PORT=\"0\"", "1..65535");
  parse_fails((vars){{T("MASTER_ADDR=h", "MASTER_PORT=65536")}}, "MASTER_PORT=\"65536\"", NULL);
  parse_fails((vars){{T("MASTER_ADDR=h", "MASTER_PORT=http")}}, "MASTER_PORT=\"http\"", NULL);
  parse_fails((vars){{T("MASTER_ADDR=", "MASTER_PORT=1")}}, "MASTER_ADDR=\"\"", NULL);
  parse_fails((vars){{T("MASTER_ADDR=two words", "MASTER_PORT=1")}}, "MASTER_ADDR=\"two words\"",
              NULL);
  /* control bytes are quoted as '?', long values cut */
  parse_fails((vars){{T("MASTER_ADDR=a\x1b[31mb", "MASTER_PORT=1")}}, "MASTER_ADDR=\"a?[31mb\"",
              NULL);
  static char long_rank[600];
  memset(long_rank, '7', sizeof long_rank - 1);
  memcpy(long_rank, "RANK=x", 6);
  parse_fails((vars){{long_rank, "WORLD_SIZE=4", "LOCAL_RANK=0", NULL}}, "RANK=\"x777", "...\"");
  /* two launchers that disagree */
  parse_fails((vars){{T("OMPI_COMM_WORLD_RANK=2", "MASTER_ADDR=h", "MASTER_PORT=1")}},
              "RANK=1 and OMPI_COMM_WORLD_RANK=\"2\" disagree", NULL);
  parse_fails((vars){{T("OMPI_COMM_WORLD_SIZE=8", "MASTER_ADDR=h", "MASTER_PORT=1")}},
              "WORLD_SIZE=4 and OMPI_COMM_WORLD_SIZE=\"8\" disagree", NULL);
  /* Open MPI across machines needs the rendezvous's place */
  parse_fails((vars){{"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=8",
                      "OMPI_COMM_WORLD_LOCAL_RANK=0", "OMPI_COMM_WORLD_LOCAL_SIZE=4", NULL}},
              "MASTER_ADDR is not set", "mpirun, pass -x MASTER_ADDR");
  parse_fails((vars){{"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=2", NULL}},
              "OMPI_COMM_WORLD_LOCAL_RANK is not", NULL);
#undef T
}

Test(dist_env, reads_the_process_environment) {
  static const char *const names[] = {"RANK",
                                      "WORLD_SIZE",
                                      "LOCAL_RANK",
                                      "LOCAL_WORLD_SIZE",
                                      "MASTER_ADDR",
                                      "MASTER_PORT",
                                      "OMPI_COMM_WORLD_RANK",
                                      "OMPI_COMM_WORLD_SIZE",
                                      "OMPI_COMM_WORLD_LOCAL_RANK",
                                      "OMPI_COMM_WORLD_LOCAL_SIZE"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    unsetenv(names[i]);
  kiln_dist_env env;
  char err[256];
  cr_assert_eq(kiln_dist_env_read(&env, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_eq(env.world_size, 1);
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "3", 1);
  setenv("LOCAL_RANK", "0", 1);
  setenv("MASTER_ADDR", "localhost", 1);
  setenv("MASTER_PORT", "1234", 1);
  cr_assert_eq(kiln_dist_env_read(&env, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_eq(env.rank, 2);
  cr_assert_eq(env.world_size, 3);
  cr_assert_str_eq(env.master_addr, "localhost");
  setenv("RANK", "3", 1);
  cr_assert_eq(kiln_dist_env_read(&env, err, sizeof err), KILN_ERR_INVALID);
  cr_assert_str_eq(err, "kiln_dist_env_read: RANK=\"3\" is not below WORLD_SIZE=3");
  /* a small buffer gets a cut message; none at all is fine */
  char small[12];
  cr_assert_eq(kiln_dist_env_read(&env, small, sizeof small), KILN_ERR_INVALID);
  cr_assert_str_eq(small, "kiln_dist_e");
  cr_assert_eq(kiln_dist_env_read(&env, NULL, 0), KILN_ERR_INVALID);
  cr_assert_eq(kiln_dist_env_read(NULL, err, sizeof err), KILN_ERR_INVALID);
}

Test(dist_env, a_given_env_is_checked) {
  kiln_dist_env e = {.launcher = KILN_DIST_LAUNCHER_TORCHRUN,
                     .rank = 1,
                     .world_size = 2,
                     .master_addr = "[::1]",
                     .master_port = 5000},
                out;
  char err[256];
  cr_assert_eq(kiln__dist_env_check("f", &e, &out, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_str_eq(out.master_addr, "::1");
  kiln_dist_env bad = e;
  bad.rank = 2;
  cr_assert_eq(kiln__dist_env_check("f", &bad, &out, err, sizeof err), KILN_ERR_INVALID);
  cr_assert_str_eq(err, "f: env.rank 2 is outside 0..1 (env.world_size 2)");
  bad = e;
  bad.master_port = 0;
  cr_assert_eq(kiln__dist_env_check("f", &bad, &out, err, sizeof err), KILN_ERR_INVALID);
  ASSERT_HAS(err, "env.master_port 0");
  bad = e;
  memset(bad.master_addr, 'x', sizeof bad.master_addr);
  cr_assert_eq(kiln__dist_env_check("f", &bad, &out, err, sizeof err), KILN_ERR_INVALID);
  ASSERT_HAS(err, "not terminated");
  bad = e;
  bad.launcher = (kiln_dist_launcher)7;
  cr_assert_eq(kiln__dist_env_check("f", &bad, &out, err, sizeof err), KILN_ERR_INVALID);
  bad = e;
  bad.local_rank = 2;
  cr_assert_eq(kiln__dist_env_check("f", &bad, &out, err, sizeof err), KILN_ERR_INVALID);
  ASSERT_HAS(err, "env.local_rank 2");
}

/* ---------------------------------------------------------------- shards */

/* DistributedSampler's num_samples, as its Python computes it. */
static int64_t torch_num_samples(int64_t n, int world, bool drop_last) {
  if (drop_last && n % world != 0) return (int64_t)ceil((double)(n - world) / world);
  return (int64_t)ceil((double)n / world);
}

/* DistributedSampler's indices for rank, built as its Python builds them: the list extended by
 * its own head (or by itself repeated), or cut, then indices[rank:total_size:num_replicas]. */
static int64_t torch_shard(const int32_t *order, int64_t n, int rank, int world, bool drop_last,
                           int32_t *out) {
  int64_t num = torch_num_samples(n, world, drop_last), total = num * world;
  int32_t *list = malloc((size_t)(total > n ? total : n) * sizeof *list + 1);
  cr_assert_not_null(list);
  memcpy(list, order, (size_t)n * sizeof *list);
  int64_t len = n;
  if (!drop_last) {
    int64_t pad = total - n;
    if (pad <= n) {
      memcpy(list + len, order, (size_t)pad * sizeof *list);
      len += pad;
    } else {
      int64_t times = (pad + n - 1) / n; /* (indices * ceil(pad / n))[:pad] */
      for (int64_t k = 0; k < times * n && len < total; k++)
        list[len++] = order[k % n];
    }
  } else {
    len = total;
  }
  cr_assert_eq(len, total);
  int64_t m = 0;
  for (int64_t i = rank; i < total; i += world)
    out[m++] = list[i];
  free(list);
  return m;
}

/* A seeded shuffle, as every rank makes it from the same seed. */
static void shuffled(int32_t *order, int64_t n, uint64_t seed) {
  th_rng r = {seed};
  for (int64_t i = 0; i < n; i++)
    order[i] = (int32_t)i;
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = (int64_t)(th_rng_next(&r) % (uint64_t)(i + 1));
    int32_t t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
}

Test(shard, counts_are_distributed_samplers) {
  for (int world = 1; world <= 9; world++)
    for (int64_t n = 0; n <= 50; n++)
      for (int dl = 0; dl < 2; dl++)
        cr_assert_eq(kiln__shard_count(n, world, dl), torch_num_samples(n, world, dl),
                     "n %lld world %d drop_last %d", (long long)n, world, dl);
  cr_assert_eq(kiln__shard_count(50000, 8, false), 6250);
  cr_assert_eq(kiln__shard_count(50001, 8, false), 6251);
  cr_assert_eq(kiln__shard_count(50001, 8, true), 6250);
  cr_assert_eq(kiln__shard_count(-1, 2, false), -1);
  cr_assert_eq(kiln__shard_count(10, 0, false), -1);
}

Test(shard, shards_are_distributed_samplers) {
  int32_t order[64], got[64], want[64];
  for (int64_t n = 1; n <= 40; n++) {
    shuffled(order, n, 1000 + (uint64_t)n);
    for (int world = 1; world <= 9; world++)
      for (int dl = 0; dl < 2; dl++)
        for (int rank = 0; rank < world; rank++) {
          int64_t m = kiln__shard_order(order, n, rank, world, dl, got);
          int64_t w = torch_shard(order, n, rank, world, dl, want);
          cr_assert_eq(m, w, "n %lld world %d rank %d drop_last %d", (long long)n, world, rank, dl);
          cr_assert_eq(memcmp(got, want, (size_t)m * sizeof *got), 0,
                       "n %lld world %d rank %d drop_last %d", (long long)n, world, rank, dl);
        }
  }
}

Test(shard, every_index_once_an_epoch_across_ranks) {
  enum { N = 1200 };
  static int32_t order[N], out[N];
  int seen[N];
  for (int epoch = 0; epoch < 3; epoch++) {
    shuffled(order, N, 77 + (uint64_t)epoch); /* the same on every rank */
    for (int world = 1; world <= 8; world++) {
      if (N % world) continue; /* 1, 2, 3, 4, 5, 6, 8 divide 1200 */
      memset(seen, 0, sizeof seen);
      for (int rank = 0; rank < world; rank++) {
        int64_t m = kiln__shard_order(order, N, rank, world, false, out);
        cr_assert_eq(m, N / world);
        for (int64_t j = 0; j < m; j++)
          seen[out[j]]++;
      }
      for (int i = 0; i < N; i++)
        cr_assert_eq(seen[i], 1, "world %d epoch %d: index %d taken %d times", world, epoch, i,
                     seen[i]);
    }
  }
  /* 1201 over 8: padding repeats the order's first 7 indices; drop_last leaves its last one */
  static int32_t order2[N + 1];
  shuffled(order2, N + 1, 5);
  memset(seen, 0, sizeof seen);
  int extra[N + 1];
  memset(extra, 0, sizeof extra);
  for (int rank = 0; rank < 8; rank++) {
    int64_t m = kiln__shard_order(order2, N + 1, rank, 8, false, out);
    cr_assert_eq(m, 151);
    for (int64_t j = 0; j < m; j++)
      extra[out[j]]++;
  }
  for (int i = 0; i <= N; i++) {
    int pos = -1;
    for (int k = 0; k <= N && pos < 0; k++)
      if (order2[k] == i) pos = k;
    cr_assert_eq(extra[i], pos < 7 ? 2 : 1, "index %d at %d taken %d times", i, pos, extra[i]);
  }
  memset(extra, 0, sizeof extra);
  for (int rank = 0; rank < 8; rank++) {
    int64_t m = kiln__shard_order(order2, N + 1, rank, 8, true, out);
    cr_assert_eq(m, 150);
    for (int64_t j = 0; j < m; j++)
      extra[out[j]]++;
  }
  for (int i = 0; i <= N; i++)
    cr_assert_eq(extra[i], i == order2[N] ? 0 : 1);
  /* fewer samples than ranks: the order goes round again */
  int32_t three[3] = {2, 0, 1}, one[1];
  int32_t want[8] = {2, 0, 1, 2, 0, 1, 2, 0};
  for (int rank = 0; rank < 8; rank++) {
    cr_assert_eq(kiln__shard_order(three, 3, rank, 8, false, one), 1);
    cr_assert_eq(one[0], want[rank]);
    cr_assert_eq(kiln__shard_order(three, 3, rank, 8, true, one), 0);
  }
}

Test(shard, bad_arguments_change_nothing) {
  int32_t order[4] = {0, 1, 2, 3}, out[4] = {9, 9, 9, 9};
  cr_assert_eq(kiln__shard_order(order, 4, 2, 2, false, out), -1);
  cr_assert_eq(kiln__shard_order(order, 4, -1, 2, false, out), -1);
  cr_assert_eq(kiln__shard_order(order, -4, 0, 2, false, out), -1);
  cr_assert_eq(kiln__shard_order(NULL, 4, 0, 2, false, out), -1);
  cr_assert_eq(kiln__shard_order(order, 4, 0, 2, false, NULL), -1);
  cr_assert_eq(kiln__shard_order(order, 4, 0, 0, false, out), -1);
  cr_assert_eq(kiln__shard_order(order, INT64_MAX - 1, 0, 2, false, out), -1);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(out[i], 9);
  cr_assert_eq(kiln__shard_order(NULL, 0, 0, 2, false, NULL), 0); /* an empty epoch */
}

/* ---------------------------------------------------------------- buckets */

/* PyTorch's compute_bucket_assignment_by_size for one dtype and device, written from its
 * description: gradients in ready order join the open bucket, which closes when its bytes reach
 * the current limit; the limits advance from the first to the second and stay there. bucket[k]
 * gets the bucket of the k-th gradient in ready order. */
static int torch_buckets(const int64_t *sizes, const int *ready, int n, int64_t first, int64_t cap,
                         int *bucket) {
  int b = 0;
  int64_t size = 0, limit = first;
  bool open = false;
  for (int k = 0; k < n; k++) {
    size += sizes[ready[k]];
    bucket[k] = b;
    open = true;
    if (size >= limit) {
      b++;
      size = 0;
      limit = cap;
      open = false;
    }
  }
  return b + open;
}

/* Checks the plan's invariants: each gradient once, in ready order, offsets aligned and in
 * bounds without overlap, the bytes and payloads adding up. */
static void check_plan(const kiln__bucket_plan *p, const int64_t *sizes, const int *ready, int n,
                       int64_t align) {
  cr_assert_eq(p->ngrads, n);
  cr_assert_eq(p->start[0], 0);
  cr_assert_eq(p->start[p->nbuckets], n);
  for (int k = 0; k < n; k++)
    cr_assert_eq(p->grad[k], ready ? ready[k] : n - 1 - k);
  for (int b = 0; b < p->nbuckets; b++) {
    cr_assert_lt(p->start[b], p->start[b + 1], "bucket %d is empty", b);
    int64_t end = 0, payload = 0;
    for (int k = p->start[b]; k < p->start[b + 1]; k++) {
      cr_assert_eq(p->offset[k] % align, 0);
      cr_assert_geq(p->offset[k], end, "gradients overlap in bucket %d", b);
      cr_assert_lt(p->offset[k] - end, align);
      end = p->offset[k] + sizes[p->grad[k]];
      payload += sizes[p->grad[k]];
    }
    cr_assert_eq(p->bytes[b], end);
    cr_assert_eq(p->payload[b], payload);
  }
}

Test(buckets, the_cnn_workloads_gradients) {
  /* conv 1->32 3x3, conv 32->64 3x3, fc 9216->128, fc 128->10, f32, weight then bias each */
  int64_t sizes[8] = {32 * 9 * 4,     32 * 4,  64 * 32 * 9 * 4, 64 * 4,
                      128 * 9216 * 4, 128 * 4, 10 * 128 * 4,    10 * 4};
  kiln__bucket_plan p;
  char err[256];
  cr_assert_eq(kiln__bucket_plan_make("f", sizes, 8, NULL, 0, 0, 0, &p, err, sizeof err), KILN_OK,
               "%s", err);
  /* backward gives fc2's bias first; the first bucket closes past 1 MiB with fc1's weight */
  cr_assert_eq(p.nbuckets, 2);
  int want[8] = {7, 6, 5, 4, 3, 2, 1, 0};
  cr_assert_eq(memcmp(p.grad, want, sizeof want), 0);
  cr_assert_eq(p.start[1], 4);
  cr_assert_eq(p.payload[0], 40 + 5120 + 512 + 4718592);
  int64_t off[8] = {0, 256, 5376, 5888, 0, 256, 73984, 74240};
  cr_assert_eq(memcmp(p.offset, off, sizeof off), 0);
  cr_assert_eq(p.bytes[0], 5888 + 4718592);
  cr_assert_eq(p.payload[1], 256 + 73728 + 128 + 1152);
  cr_assert_eq(p.bytes[1], 74240 + 1152);
  check_plan(&p, sizes, NULL, 8, KILN__BUCKET_ALIGN);
  kiln__bucket_plan_free(&p);
  kiln__bucket_plan_free(&p); /* a zeroed plan is fine */
}

Test(buckets, pytorchs_rule_on_random_models) {
  th_rng r = {2024};
  int64_t sizes[300];
  int ready[300], want[300];
  for (int trial = 0; trial < 400; trial++) {
    int n = 1 + th_rng_below(&r, 300);
    for (int i = 0; i < n; i++) /* mostly small (biases, norms), some large (weights) */
      sizes[i] = th_rng_chance(&r, 0.3) ? 4 * (int64_t)th_rng_below(&r, 3000000)
                                        : 4 * (int64_t)th_rng_below(&r, 2048);
    for (int i = 0; i < n; i++)
      ready[i] = i;
    for (int i = n - 1; i > 0; i--) { /* the order gradients were ready in, shuffled */
      int j = th_rng_below(&r, i + 1), t = ready[i];
      ready[i] = ready[j];
      ready[j] = t;
    }
    int64_t first = trial % 3 ? 0 : 1 + th_rng_below(&r, 4 << 20);
    int64_t cap = trial % 2 ? 0 : 1 + th_rng_below(&r, 30 << 20);
    int64_t align = (int64_t)1 << th_rng_below(&r, 10);
    kiln__bucket_plan p;
    char err[256];
    cr_assert_eq(
        kiln__bucket_plan_make("f", sizes, n, ready, first, cap, align, &p, err, sizeof err),
        KILN_OK, "%s", err);
    int nb = torch_buckets(sizes, ready, n, first ? first : 1 << 20, cap ? cap : 25 << 20, want);
    cr_assert_eq(p.nbuckets, nb, "trial %d", trial);
    for (int b = 0; b < p.nbuckets; b++)
      for (int k = p.start[b]; k < p.start[b + 1]; k++)
        cr_assert_eq(want[k], b, "trial %d: gradient %d in bucket %d, PyTorch's %d", trial, k, b,
                     want[k]);
    check_plan(&p, sizes, ready, n, align);
    /* every bucket but the last reached its cap, and did so only with its last gradient */
    for (int b = 0; b + 1 < p.nbuckets; b++) {
      int64_t limit = b == 0 ? (first ? first : 1 << 20) : (cap ? cap : 25 << 20);
      cr_assert_geq(p.payload[b], limit);
      cr_assert_lt(p.payload[b] - sizes[p.grad[p.start[b + 1] - 1]], limit);
    }
    kiln__bucket_plan_free(&p);
  }
}

Test(buckets, a_gradient_past_the_cap_and_empty_ones) {
  int64_t sizes[5] = {8, 0, 100 << 20, 16, 0};
  kiln__bucket_plan p;
  char err[256];
  cr_assert_eq(kiln__bucket_plan_make("f", sizes, 5, NULL, 64, 1024, 16, &p, err, sizeof err),
               KILN_OK, "%s", err);
  /* ready: 4 (0 B), 3 (16), 2 (100 MiB): the first bucket closes there; 1 and 0 are the last */
  cr_assert_eq(p.nbuckets, 2);
  cr_assert_eq(p.start[1], 3);
  cr_assert_eq(p.payload[0], 16 + (100 << 20));
  cr_assert_eq(p.payload[1], 8);
  check_plan(&p, sizes, NULL, 5, 16);
  kiln__bucket_plan_free(&p);
  cr_assert_eq(kiln__bucket_plan_make("f", NULL, 0, NULL, 0, 0, 0, &p, err, sizeof err), KILN_OK);
  cr_assert_eq(p.nbuckets, 0);
  cr_assert_eq(p.start[0], 0);
  kiln__bucket_plan_free(&p);
}

Test(buckets, bad_arguments_change_nothing) {
  int64_t sizes[3] = {4, 8, 12};
  kiln__bucket_plan p, before;
  memset(&p, 0x3c, sizeof p);
  before = p;
  char err[256];
  cr_assert_eq(
      kiln__bucket_plan_make("f", sizes, 3, (int[]){0, 1, 1}, 0, 0, 0, &p, err, sizeof err),
      KILN_ERR_INVALID);
  cr_assert_str_eq(err, "f: ready[2] = 1 is a repeat: the ready order must name each of the 3 "
                        "gradients once");
  cr_assert_eq(
      kiln__bucket_plan_make("f", sizes, 3, (int[]){0, 3, 1}, 0, 0, 0, &p, err, sizeof err),
      KILN_ERR_INVALID);
  ASSERT_HAS(err, "ready[1] = 3 is out of range");
  cr_assert_eq(
      kiln__bucket_plan_make("f", (int64_t[]){4, -8}, 2, NULL, 0, 0, 0, &p, err, sizeof err),
      KILN_ERR_INVALID);
  cr_assert_str_eq(err, "f: gradient 1 has a negative size, -8 bytes");
  cr_assert_eq(kiln__bucket_plan_make("f", sizes, 3, NULL, -1, 0, 0, &p, err, sizeof err),
               KILN_ERR_INVALID);
  cr_assert_eq(kiln__bucket_plan_make("f", sizes, 3, NULL, 0, 0, 24, &p, err, sizeof err),
               KILN_ERR_INVALID);
  ASSERT_HAS(err, "alignment 24 is not a power of two");
  cr_assert_eq(kiln__bucket_plan_make("f", (int64_t[]){INT64_MAX - 8, 64}, 2, NULL, INT64_MAX,
                                      INT64_MAX, 16, &p, err, sizeof err),
               KILN_ERR_INVALID);
  ASSERT_HAS(err, "overflows");
  cr_assert_eq(kiln__bucket_plan_make("f", sizes, -1, NULL, 0, 0, 0, &p, err, sizeof err),
               KILN_ERR_INVALID);
  cr_assert_eq(memcmp(&p, &before, sizeof p), 0, "a failed plan changed *plan");
}
