/*
 * fake_nccl.c: a stand-in for libnccl.so.2 that test_cpu_dist loads in NCCL's place, so that
 * kiln's loader (dist/nccl.c) and kiln_dist_init are tested where NCCL is not installed. It
 * exports the functions kiln looks up, with NCCL's documented signatures and result codes, and
 * stub behaviour: a unique id that names the process that made it, communicators of one rank
 * whose all-reduce and broadcast copy host memory (the sum or average over one rank), and a
 * count of the calls (fake_nccl_calls). Built twice: FAKE_NCCL_PARTIAL leaves ncclCommAbort out.
 * FAKE_NCCL_VERSION (a version code) changes what ncclGetVersion says; FAKE_NCCL_FAIL_UNIQUE_ID
 * makes ncclGetUniqueId fail as a system error.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
  char internal[128];
} fake_id;

typedef struct fake_comm {
  int magic, nranks, rank;
  fake_id id;
} fake_comm;

#define COMM_MAGIC 0x6e63636c
#define ID_TAG "fake-nccl"

int fake_nccl_calls;

int ncclGetVersion(int *version);
const char *ncclGetErrorString(int result);
const char *ncclGetLastError(fake_comm *comm);
int ncclGetUniqueId(fake_id *id);
int ncclCommInitRank(fake_comm **comm, int nranks, fake_id id, int rank);
int ncclCommDestroy(fake_comm *comm);
#ifndef FAKE_NCCL_PARTIAL
int ncclCommAbort(fake_comm *comm);
#endif
int ncclCommGetAsyncError(fake_comm *comm, int *result);
int ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, fake_comm *comm,
                  void *stream);
int ncclBroadcast(const void *send, void *recv, size_t count, int dtype, int root, fake_comm *comm,
                  void *stream);
int ncclGroupStart(void);
int ncclGroupEnd(void);

static char last_error[256];
static int group_depth;
static unsigned serial;

static int fail(int result, const char *why) {
  snprintf(last_error, sizeof last_error, "fake NCCL: %s", why);
  return result;
}

int ncclGetVersion(int *version) {
  fake_nccl_calls++;
  if (!version) return fail(4, "NULL version");
  const char *v = getenv("FAKE_NCCL_VERSION");
  *version = v ? atoi(v) : 22703; /* 2.27.3 */
  return 0;
}

const char *ncclGetErrorString(int result) {
  fake_nccl_calls++;
  switch (result) {
  case 0: return "no error";
  case 1: return "unhandled cuda error";
  case 2: return "unhandled system error";
  case 3: return "internal error";
  case 4: return "invalid argument";
  case 5: return "invalid usage";
  case 6: return "remote process exited or there was a network error";
  case 7: return "NCCL operation in progress";
  }
  return "unknown result code";
}

const char *ncclGetLastError(fake_comm *comm) {
  (void)comm;
  fake_nccl_calls++;
  return last_error;
}

int ncclGetUniqueId(fake_id *id) {
  fake_nccl_calls++;
  if (!id) return fail(4, "NULL id");
  if (getenv("FAKE_NCCL_FAIL_UNIQUE_ID")) return fail(2, "no network interface found (made up)");
  memset(id, 0, sizeof *id);
  snprintf(id->internal, sizeof id->internal, "%s pid %ld id %u", ID_TAG, (long)getpid(), ++serial);
  return 0;
}

int ncclCommInitRank(fake_comm **comm, int nranks, fake_id id, int rank) {
  fake_nccl_calls++;
  if (!comm || nranks < 1 || rank < 0 || rank >= nranks) return fail(4, "bad communicator size");
  if (strncmp(id.internal, ID_TAG, strlen(ID_TAG)) != 0) return fail(4, "not a fake NCCL id");
  fake_comm *c = calloc(1, sizeof *c);
  if (!c) return fail(2, "out of memory");
  c->magic = COMM_MAGIC;
  c->nranks = nranks;
  c->rank = rank;
  c->id = id;
  *comm = c;
  return 0;
}

static int comm_ok(const fake_comm *c) { return c && c->magic == COMM_MAGIC; }

int ncclCommDestroy(fake_comm *comm) {
  fake_nccl_calls++;
  if (!comm_ok(comm)) return fail(4, "bad communicator");
  comm->magic = 0;
  free(comm);
  return 0;
}

#ifndef FAKE_NCCL_PARTIAL
int ncclCommAbort(fake_comm *comm) {
  fake_nccl_calls++;
  if (!comm_ok(comm)) return fail(4, "bad communicator");
  comm->magic = 0;
  free(comm);
  return 0;
}
#endif

int ncclCommGetAsyncError(fake_comm *comm, int *result) {
  fake_nccl_calls++;
  if (!comm_ok(comm) || !result) return fail(4, "bad communicator");
  *result = 0;
  return 0;
}

/* The bytes of one element of NCCL's data type (0 for an unknown one). */
static size_t type_size(int dtype) {
  static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2}; /* int8 .. bfloat16 */
  return dtype >= 0 && dtype < (int)(sizeof sizes / sizeof sizes[0]) ? sizes[dtype] : 0;
}

/* One rank's collective: its result is its own data. */
static int copy(const void *send, void *recv, size_t count, int dtype, fake_comm *comm,
                void *stream) {
  if (!comm_ok(comm)) return fail(4, "bad communicator");
  if (comm->nranks != 1) return fail(5, "the fake reduces over one rank only");
  if (stream) return fail(5, "the fake works on host memory, without a stream");
  size_t size = type_size(dtype);
  if (!size) return fail(4, "unknown data type");
  if (count && (!send || !recv)) return fail(4, "NULL buffer");
  if (count) memmove(recv, send, count * size);
  return 0;
}

int ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, fake_comm *comm,
                  void *stream) {
  fake_nccl_calls++;
  if (op < 0 || op > 4) return fail(4, "unknown reduction");
  return copy(send, recv, count, dtype, comm, stream);
}

int ncclBroadcast(const void *send, void *recv, size_t count, int dtype, int root, fake_comm *comm,
                  void *stream) {
  fake_nccl_calls++;
  if (comm_ok(comm) && (root < 0 || root >= comm->nranks)) return fail(4, "bad root");
  return copy(send, recv, count, dtype, comm, stream);
}

int ncclGroupStart(void) {
  fake_nccl_calls++;
  group_depth++;
  return 0;
}

int ncclGroupEnd(void) {
  fake_nccl_calls++;
  if (group_depth == 0) return fail(5, "ncclGroupEnd without ncclGroupStart");
  group_depth--;
  return 0;
}
