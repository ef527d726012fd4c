/*
 * dist.h: what dist/ gives the rest of kiln and its tests. NCCL loaded at run time through its
 * stable C ABI (nccl.c), the launchers' environment (env.c), the rendezvous that hands NCCL's
 * unique id from rank 0 to every rank (rendezvous.c), the plan of the gradients' buckets
 * (bucket.c); kiln_dist_init (dist.c) joins them. No CUDA header here: a stream is a void *.
 *
 * These run before a context exists: each reports an error as its status and a message written
 * into the caller's buffer (err, err_size bytes; err may be NULL), that begins with fn, the public
 * function it serves. A failed call leaves its outputs as they were and holds nothing.
 */
#ifndef KILN_DIST_DIST_H
#define KILN_DIST_DIST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kiln.h"

/* Writes the message (cut to fit) and returns s. */
kiln_status kiln__dist_fail(char *err, size_t err_size, kiln_status s, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* A value from outside (the environment, the network, a library) fit to quote in a message: as
 * much of it as buf (n bytes) holds, every byte outside printable ASCII as '?', "..." after a
 * cut; NULL as "(unset)". Returns buf. */
const char *kiln__dist_quote(const char *s, char *buf, size_t n);

/* ---------------------------------------------------------------- NCCL (nccl.c) */

/* NCCL's types, declared from its documented API (nccl.h's ncclUniqueId, ncclComm_t,
 * ncclResult_t, ncclDataType_t, ncclRedOp_t); an enum argument is an int in the C ABI. */
#define KILN__NCCL_ID_BYTES 128
typedef struct kiln__nccl_id {
  char internal[KILN__NCCL_ID_BYTES];
} kiln__nccl_id;
typedef struct kiln__nccl_comm_s *kiln__nccl_comm; /* opaque, NCCL's */

enum {
  KILN__NCCL_SUCCESS = 0,
  KILN__NCCL_UNHANDLED_CUDA_ERROR = 1,
  KILN__NCCL_SYSTEM_ERROR = 2,
  KILN__NCCL_INTERNAL_ERROR = 3,
  KILN__NCCL_INVALID_ARGUMENT = 4,
  KILN__NCCL_INVALID_USAGE = 5,
  KILN__NCCL_REMOTE_ERROR = 6,
  KILN__NCCL_IN_PROGRESS = 7,
};
typedef enum kiln__nccl_dtype {
  KILN__NCCL_INT8 = 0,
  KILN__NCCL_UINT8 = 1,
  KILN__NCCL_INT32 = 2,
  KILN__NCCL_UINT32 = 3,
  KILN__NCCL_INT64 = 4,
  KILN__NCCL_UINT64 = 5,
  KILN__NCCL_FLOAT16 = 6,
  KILN__NCCL_FLOAT32 = 7,
  KILN__NCCL_FLOAT64 = 8,
  KILN__NCCL_BFLOAT16 = 9,
} kiln__nccl_dtype;
typedef enum kiln__nccl_op {
  KILN__NCCL_SUM = 0,
  KILN__NCCL_PROD = 1,
  KILN__NCCL_MAX = 2,
  KILN__NCCL_MIN = 3,
  KILN__NCCL_AVG = 4,
} kiln__nccl_op;

/* NCCL's version code (NCCL_VERSION(major, minor, patch): major * 10000 + minor * 100 + patch
 * from 2.9 on, major * 1000 + minor * 100 + patch before). kiln needs 2.10 or later: ncclAvg
 * and ncclBfloat16 came with it. */
#define KILN__NCCL_VERSION(x, y, z)                                                                \
  ((x) <= 2 && (y) <= 8 ? (x)*1000 + (y)*100 + (z) : (x)*10000 + (y)*100 + (z))
#define KILN__NCCL_MIN_VERSION KILN__NCCL_VERSION(2, 10, 0)

/* The functions kiln calls, looked up in the loaded library. */
typedef struct kiln__nccl {
  void *lib;      /* dlopen's handle; NULL when nothing is loaded */
  char path[512]; /* the file that was loaded, as it was named */
  int version;    /* ncclGetVersion's code */
  int (*get_version)(int *version);
  const char *(*get_error_string)(int result);
  int (*get_unique_id)(kiln__nccl_id *id);
  int (*comm_init_rank)(kiln__nccl_comm *comm, int nranks, kiln__nccl_id id, int rank);
  int (*comm_destroy)(kiln__nccl_comm comm);
  int (*comm_abort)(kiln__nccl_comm comm);
  int (*comm_get_async_error)(kiln__nccl_comm comm, int *result);
  int (*all_reduce)(const void *send, void *recv, size_t count, int dtype, int op,
                    kiln__nccl_comm comm, void *stream);
  int (*broadcast)(const void *send, void *recv, size_t count, int dtype, int root,
                   kiln__nccl_comm comm, void *stream);
  int (*group_start)(void);
  int (*group_end)(void);
  /* ncclGetLastError (NCCL 2.13 and later): NULL where the library has none */
  const char *(*get_last_error)(kiln__nccl_comm comm);
} kiln__nccl;

/* Loads NCCL into *nccl: the file path names, else $KILN_NCCL_LIBRARY, else libnccl.so.2 by the
 * dynamic loader's search. Fails (KILN_ERR_STATE) when it does not load, lacks a function kiln
 * calls or is older than 2.10, with a message that says why and how to install NCCL; *nccl is
 * then left as it was. */
kiln_status kiln__nccl_load(const char *fn, const char *path, kiln__nccl *nccl, char *err,
                            size_t err_size);
/* Unloads what kiln__nccl_load loaded and zeroes *nccl; a zeroed one is fine. */
void kiln__nccl_unload(kiln__nccl *nccl);
/* "2.27.3" from 22703 (and the codes before 2.9). */
void kiln__nccl_version_string(int code, char *buf, size_t n);
/* A result in words: NCCL's own (ncclGetErrorString) and the code, "unhandled system error
 * (run with NCCL_DEBUG=WARN for details) (2)". */
const char *kiln__nccl_result_string(const kiln__nccl *nccl, int result, char *buf, size_t n);

/* ---------------------------------------------------------------- environment (env.c) */

/* Reads a variable of the environment: NULL when it is unset. */
typedef const char *(*kiln__dist_getenv)(void *user, const char *name);

/* kiln_dist_env_read over the variables get gives (tests pass their own table). */
kiln_status kiln__dist_env_parse(const char *fn, kiln__dist_getenv get, void *user,
                                 kiln_dist_env *env, char *err, size_t err_size);
/* Checks an env as kiln__dist_env_parse checks what it reads (kiln_dist_options.env) and gives
 * it to *out as the parser would have (an IPv6 address's brackets dropped; no address or port in
 * a world of 1). */
kiln_status kiln__dist_env_check(const char *fn, const kiln_dist_env *env, kiln_dist_env *out,
                                 char *err, size_t err_size);

/* ---------------------------------------------------------------- rendezvous (rendezvous.c) */

/* What the rendezvous hands from rank 0 to every rank: NCCL's unique id. */
#define KILN__RDV_BLOB KILN__NCCL_ID_BYTES

/* Rank 0's listening socket on port (0: one the system picks) of every interface of host's
 * address family (host names rank 0, as MASTER_ADDR does); *fd and *bound_port get it. A port in
 * use is KILN_ERR_IO naming it. */
kiln_status kiln__rdv_listen(const char *fn, const char *host, int port, int *fd, int *bound_port,
                             char *err, size_t err_size);
/* Rank 0's side, on a listening socket (kiln__rdv_listen's; it stays the caller's, made
 * non-blocking): waits until ranks 1 .. world - 1 have each said who they are, gives each the
 * blob and waits until each confirmed it, all within timeout_s. */
kiln_status kiln__rdv_serve(const char *fn, int listen_fd, int world, const void *blob,
                            double timeout_s, char *err, size_t err_size);
/* Rank rank's side (0 < rank < world): connects to host:port, retrying until rank 0 listens,
 * says who it is, and receives the blob, all within timeout_s. */
kiln_status kiln__rdv_join(const char *fn, const char *host, int port, int rank, int world,
                           void *blob, double timeout_s, char *err, size_t err_size);
/* The rendezvous of env (world size above 1): rank 0 listens on master_port and serves blob, the
 * others join and receive it into blob. */
kiln_status kiln__rdv_run(const char *fn, const kiln_dist_env *env, void *blob, double timeout_s,
                          char *err, size_t err_size);

/* ---------------------------------------------------------------- gradient buckets (bucket.c) */

/* PyTorch DistributedDataParallel's bucket caps: the first bucket 1 MiB, the others 25 MiB. */
#define KILN__BUCKET_FIRST_CAP ((int64_t)1 << 20)
#define KILN__BUCKET_CAP ((int64_t)25 << 20)
/* Where a gradient starts in its bucket's buffer: a multiple of this (the caching allocator's
 * blocks are 512-byte aligned, so every gradient's view is 16-byte aligned for vector loads). */
#define KILN__BUCKET_ALIGN 256

/* The gradients of a parameter list grouped into buckets, each all-reduced as one flat buffer as
 * soon as backward has produced all of it. */
typedef struct kiln__bucket_plan {
  int ngrads, nbuckets;
  int *grad;        /* (ngrads) the gradients (their parameters' list indices), bucket by bucket,
                       in the order backward produces them */
  int *start;       /* (nbuckets + 1) bucket b holds grad[start[b] .. start[b + 1]) */
  int64_t *offset;  /* (ngrads) where grad[k] starts in its bucket's buffer, in bytes */
  int64_t *bytes;   /* (nbuckets) each buffer's size, the alignment's padding included */
  int64_t *payload; /* (nbuckets) its gradients' bytes, without the padding */
} kiln__bucket_plan;

/*
 * Plans the buckets of n gradients of sizes[i] bytes (i a parameter's index in its list), taken in
 * the order ready gives (a permutation of 0 .. n-1; NULL: n-1 down to 0, the reverse of
 * registration, the order backward produces a sequential network's gradients). PyTorch DDP's
 * rule (its compute_bucket_assignment_by_size, which its reducer runs on the order gradients were
 * ready in): gradients join the open bucket in order, and a bucket closes as soon as its
 * gradients' bytes reach its cap, first_cap for the first bucket and cap for the others (0: 1 MiB
 * and 25 MiB, DDP's defaults), so only a bucket's last gradient takes it to or past the cap and a
 * gradient larger than the cap closes the bucket it joins; the last bucket holds what is left.
 * Each gradient starts at a multiple of align bytes (0: KILN__BUCKET_ALIGN; a power of two),
 * which does not count towards the caps. KILN_ERR_INVALID for a negative size or cap, a bad
 * alignment, or a ready order that is not a permutation; KILN_ERR_OOM; *plan is then untouched.
 */
kiln_status kiln__bucket_plan_make(const char *fn, const int64_t *sizes, int n, const int *ready,
                                   int64_t first_cap, int64_t cap, int64_t align,
                                   kiln__bucket_plan *plan, char *err, size_t err_size);
/* Frees the plan's arrays and zeroes it; a zeroed plan is fine. */
void kiln__bucket_plan_free(kiln__bucket_plan *plan);

/* ---------------------------------------------------------------- kiln_dist (dist.c) */

/* NCCL as kiln_dist_init loaded it (lib NULL when it loaded none) and the unique id every rank
 * holds after the rendezvous (rank 0's), for the communicator runtime/ will make on the
 * context's device; NULL for a failed handle. */
const kiln__nccl *kiln__dist_nccl(const kiln_dist *d);
const kiln__nccl_id *kiln__dist_id(const kiln_dist *d);

#endif
