/*
 * kiln_dist.h: training on several GPUs, one process a GPU, a part of kiln's public header
 * (kiln.h includes it at its end; include kiln.h).
 *
 * An existing launcher starts the processes and tells each who it is through the environment:
 * torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or Open
 * MPI's mpirun (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE; MASTER_ADDR and
 * MASTER_PORT given with mpirun -x, or 127.0.0.1 and 29500 when every rank runs on one machine).
 * kiln_dist_init reads it, loads NCCL at run time (kiln never links it: libnccl.so.2, or the file
 * $KILN_NCCL_LIBRARY names) and hands NCCL's unique id from rank 0 to every rank over a small TCP
 * rendezvous on MASTER_ADDR:MASTER_PORT, with a deadline: a rank that never arrives is an error
 * naming it on every rank that waits, not a hang. A process started without a launcher is rank 0
 * of a world of 1 and needs neither NCCL nor the network.
 *
 *   kiln_dist *dist = kiln_dist_init(NULL);
 *   if (kiln_dist_status(dist) != KILN_OK) {
 *     fprintf(stderr, "%s\n", kiln_dist_error(dist));
 *     return 1;
 *   }
 *   kiln_ctx *ctx = kiln_ctx_new(&(kiln_ctx_options){.device = kiln_dist_local_rank(dist)});
 *   ...
 *   kiln_ctx_free(ctx);
 *   kiln_dist_free(dist);
 *
 * What exists now is this set-up, without a GPU. Still to come (they need GPUs to be tested):
 * the communicator on the context's device (ncclCommInitRank), the gradients' all-reduce in
 * buckets as nodes of the step graph, the loader's shard of each epoch by rank, synchronised batch
 * norm and checkpoints written by rank 0 (the README's "Several GPUs" says where each stands).
 *
 * Errors. These functions run before a context exists, so a kiln_dist keeps its own sticky error,
 * as a context does: kiln_dist_init returns a handle unless host memory runs out, and
 * kiln_dist_status / kiln_dist_error say whether it failed and why, naming the function, the
 * variable or rank and the values ("kiln_dist_init: rank 0 of 4: ranks 2-3 (2 of 4) did not
 * arrive within 300.0 s at port 29500"). A failed handle holds nothing (no socket, no library) and
 * its getters return -1. kiln_dist_env_read writes its message into a buffer of the caller's.
 */
#ifndef KILN_DIST_H
#define KILN_DIST_H

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest world size kiln accepts. */
#define KILN_DIST_MAX_WORLD 65536

typedef enum kiln_dist_launcher {
  KILN_DIST_LAUNCHER_NONE = 0, /* no launcher's variables: one process, a world of 1 */
  KILN_DIST_LAUNCHER_TORCHRUN, /* RANK and WORLD_SIZE (torchrun, and launchers that mimic it) */
  KILN_DIST_LAUNCHER_MPI,      /* Open MPI's OMPI_COMM_WORLD_* */
} kiln_dist_launcher;

/* Who this process is, as the launcher said. */
typedef struct kiln_dist_env {
  kiln_dist_launcher launcher;
  int rank, world_size;  /* 0 <= rank < world_size <= KILN_DIST_MAX_WORLD */
  int local_rank;        /* the rank among this machine's processes: the GPU it takes */
  int local_world_size;  /* this machine's processes; 0 when the launcher did not say */
  char master_addr[256]; /* rank 0's host, a name or an address; "" in a world of 1 */
  int master_port;       /* the rendezvous's port on it; 0 in a world of 1 */
} kiln_dist_env;

/*
 * Reads and checks the launcher's variables (above). RANK and WORLD_SIZE, when either is set,
 * take precedence over Open MPI's, and where both are set they must agree. Each value must be a
 * whole number in its range (0 <= RANK < WORLD_SIZE <= KILN_DIST_MAX_WORLD, LOCAL_RANK below
 * LOCAL_WORLD_SIZE when given, MASTER_PORT 1..65535), MASTER_ADDR a host name or address of
 * printable characters; MASTER_ADDR and MASTER_PORT are read only for a world above 1. Returns
 * KILN_OK and fills *env, or KILN_ERR_INVALID with a message in err (err_size bytes, cut to fit;
 * err may be NULL) naming the variable and its value ("kiln_dist_env_read: RANK=\"4\" is not
 * below WORLD_SIZE=4"), and then *env is left as it was.
 */
kiln_status kiln_dist_env_read(kiln_dist_env *env, char *err, size_t err_size);

typedef struct kiln_dist_options {
  /* Who this process is; NULL: kiln_dist_env_read. Checked as the environment is. */
  const kiln_dist_env *env;
  /* Seconds every rank waits at the rendezvous for the others; 0: $KILN_DIST_TIMEOUT, else 300
   * (torchrun's own rendezvous waits as long). */
  double timeout_s;
  /* 0: load NCCL when the world is larger than 1; 1: in a world of 1 too (the whole path on one
   * GPU, as the multi-GPU one runs). */
  int nccl;
  /* The NCCL library to load; NULL: $KILN_NCCL_LIBRARY, else libnccl.so.2 by the loader's search
   * (LD_LIBRARY_PATH, the system's library folders). */
  const char *nccl_library;
} kiln_dist_options;

typedef struct kiln_dist kiln_dist;

/*
 * Joins this process to the others the launcher started (above). NULL options: every field zero.
 * Rank 0 listens on MASTER_PORT (on every interface) and waits for the other ranks; each of them
 * connects to MASTER_ADDR:MASTER_PORT (retrying until rank 0 listens), and when all have come
 * rank 0 gives each NCCL's unique id and waits for every rank to confirm it. Before the deadline
 * the rendezvous fails at once, on every rank it reached, when a rank says another world size,
 * two processes say the same rank, or a rank that arrived goes away; at the deadline each waiting
 * rank fails naming the ranks missing (rank 0) or rank 0's address (the others). A MASTER_PORT
 * already in use on rank 0's machine is an error naming it. Without NCCL a world of 1 works and a
 * larger one fails, saying how to install NCCL (the README's "Several GPUs").
 */
kiln_dist *kiln_dist_init(const kiln_dist_options *opts);
kiln_status kiln_dist_status(const kiln_dist *d);
const char *kiln_dist_error(const kiln_dist *d); /* NULL when no error is set */
int kiln_dist_rank(const kiln_dist *d);
int kiln_dist_world_size(const kiln_dist *d);
int kiln_dist_local_rank(const kiln_dist *d);
/* NCCL's version code as ncclGetVersion gives it (22703 for 2.27.3); 0 when none was loaded. */
int kiln_dist_nccl_version(const kiln_dist *d);
void kiln_dist_free(kiln_dist *d);

#ifdef __cplusplus
}
#endif
#endif
