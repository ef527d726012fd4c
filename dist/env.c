/*
 * env.c: who this process is, as its launcher said in the environment. torchrun (and the
 * launchers that mimic it) set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
 * MASTER_PORT; Open MPI's mpirun sets OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK and _LOCAL_SIZE,
 * and the rendezvous's host and port come from MASTER_ADDR and MASTER_PORT (mpirun -x), or are
 * 127.0.0.1 and 29500 when every rank runs on one machine. The values come from outside: each is
 * checked whole (digits only, in its range) and quoted, cut and made printable, in messages.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"

#define MPI_DEFAULT_ADDR "127.0.0.1"
#define MPI_DEFAULT_PORT 29500
#define BIG (1LL << 40) /* past every range here, short of overflow */

/* The variables of one launcher. */
typedef struct names {
  const char *rank, *world, *local_rank, *local_world;
} names;
static const names torchrun = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
static const names mpi = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};

/* A whole number of decimal digits only, at most hi: false when v is not one. */
static bool whole(const char *v, long long hi, long long *out) {
  if (!v || !*v) return false;
  long long x = 0;
  for (const char *p = v; *p; p++) {
    if (*p < '0' || *p > '9') return false;
    x = x * 10 + (*p - '0');
    if (x > hi) return false;
  }
  *out = x;
  return true;
}

/* Reads variable name (value v) as a whole number in lo..hi into *out: an error naming it and
 * its value otherwise. */
static kiln_status number(const char *fn, const char *name, const char *v, long lo, long hi,
                          int *out, char *err, size_t err_size) {
  char q[64];
  long long x;
  if (!whole(v, BIG, &x))
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: %s=\"%s\" is not a whole number (%ld..%ld)", fn, name,
                           kiln__dist_quote(v, q, sizeof q), lo, hi);
  if (x < lo || x > hi)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: %s=\"%s\" is outside %ld..%ld", fn,
                           name, kiln__dist_quote(v, q, sizeof q), lo, hi);
  *out = (int)x;
  return KILN_OK;
}

/* A host name or address kiln can pass to getaddrinfo: 1 to 255 printable characters, no blank;
 * an IPv6 address may come in brackets, which are dropped. false when it is not one. */
static bool host_ok(const char *v, char *out, size_t n) {
  size_t len = strlen(v);
  if (len >= 2 && v[0] == '[' && v[len - 1] == ']') {
    v++;
    len -= 2;
  }
  if (len == 0 || len >= n || len > 255) return false;
  for (size_t i = 0; i < len; i++)
    if (v[i] <= ' ' || v[i] > '~') return false;
  memcpy(out, v, len);
  out[len] = '\0';
  return true;
}

kiln_status kiln__dist_env_parse(const char *fn, kiln__dist_getenv get, void *user,
                                 kiln_dist_env *env, char *err, size_t err_size) {
  if (!env || !get)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: NULL %s", fn,
                           env ? "reader" : "env");
  kiln_dist_env e;
  memset(&e, 0, sizeof e);
  kiln_status s;
  char q[64];
  const names *nm;
  if (get(user, torchrun.rank) || get(user, torchrun.world)) {
    nm = &torchrun;
    e.launcher = KILN_DIST_LAUNCHER_TORCHRUN;
  } else if (get(user, mpi.rank) || get(user, mpi.world)) {
    nm = &mpi;
    e.launcher = KILN_DIST_LAUNCHER_MPI;
  } else {
    e.launcher = KILN_DIST_LAUNCHER_NONE; /* one process: rank 0 of 1 */
    e.world_size = 1;
    *env = e;
    return KILN_OK;
  }
  const char *vrank = get(user, nm->rank), *vworld = get(user, nm->world);
  const char *vlocal = get(user, nm->local_rank), *vlocal_world = get(user, nm->local_world);
  if (!vrank || !vworld)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: %s is set but %s is not: the launcher sets both", fn,
                           vrank ? nm->rank : nm->world, vrank ? nm->world : nm->rank);
  if ((s = number(fn, nm->world, vworld, 1, KILN_DIST_MAX_WORLD, &e.world_size, err, err_size)))
    return s;
  long long r;
  if (whole(vrank, BIG, &r) && r >= e.world_size)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: %s=\"%s\" is not below %s=%d", fn,
                           nm->rank, kiln__dist_quote(vrank, q, sizeof q), nm->world, e.world_size);
  if ((s = number(fn, nm->rank, vrank, 0, e.world_size - 1, &e.rank, err, err_size))) return s;
  if (vlocal_world && (s = number(fn, nm->local_world, vlocal_world, 1, e.world_size,
                                  &e.local_world_size, err, err_size)))
    return s;
  if (!vlocal)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: %s=%d is set but %s is not: the launcher sets it (the rank among "
                           "this machine's processes picks this process's GPU)",
                           fn, nm->world, e.world_size, nm->local_rank);
  int local_hi = e.local_world_size ? e.local_world_size - 1 : e.world_size - 1;
  if ((s = number(fn, nm->local_rank, vlocal, 0, local_hi, &e.local_rank, err, err_size))) return s;

  /* torchrun's variables under mpirun must tell the same story as Open MPI's */
  if (nm == &torchrun) {
    long long orank, oworld;
    const char *vorank = get(user, mpi.rank), *voworld = get(user, mpi.world);
    if (vorank && whole(vorank, BIG, &orank) && orank != e.rank)
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: RANK=%d and %s=\"%s\" disagree: which launcher started this "
                             "process?",
                             fn, e.rank, mpi.rank, kiln__dist_quote(vorank, q, sizeof q));
    if (voworld && whole(voworld, BIG, &oworld) && oworld != e.world_size)
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: WORLD_SIZE=%d and %s=\"%s\" disagree: which launcher started "
                             "this process?",
                             fn, e.world_size, mpi.world, kiln__dist_quote(voworld, q, sizeof q));
  }

  if (e.world_size > 1) {
    /* the rendezvous's place; Open MPI on one machine needs none */
    bool one_machine = nm == &mpi && e.local_world_size == e.world_size;
    const char *addr = get(user, "MASTER_ADDR"), *port = get(user, "MASTER_PORT");
    if (!addr && one_machine) addr = MPI_DEFAULT_ADDR;
    if (!addr)
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: %s=%d but MASTER_ADDR is not set: it names rank 0's host, where "
                             "the ranks meet (torchrun sets it; with mpirun, pass -x "
                             "MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<a free port>)",
                             fn, nm->world, e.world_size);
    if (!host_ok(addr, e.master_addr, sizeof e.master_addr))
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: MASTER_ADDR=\"%s\" is not a host name or address (1 to 255 "
                             "printable characters, no blank)",
                             fn, kiln__dist_quote(addr, q, sizeof q));
    if (!port && one_machine) {
      e.master_port = MPI_DEFAULT_PORT;
    } else if (!port) {
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: %s=%d but MASTER_PORT is not set: the port on rank 0's host "
                             "where the ranks meet (torchrun sets it; with mpirun, pass -x "
                             "MASTER_PORT=<a free port>)",
                             fn, nm->world, e.world_size);
    } else if ((s = number(fn, "MASTER_PORT", port, 1, 65535, &e.master_port, err, err_size))) {
      return s;
    }
  }
  *env = e;
  return KILN_OK;
}

kiln_status kiln__dist_env_check(const char *fn, const kiln_dist_env *e, kiln_dist_env *out,
                                 char *err, size_t err_size) {
  if (!e || !out) return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: NULL env", fn);
  kiln_dist_env c = *e;
  if (e->launcher < KILN_DIST_LAUNCHER_NONE || e->launcher > KILN_DIST_LAUNCHER_MPI)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: env.launcher %d is unknown", fn,
                           (int)e->launcher);
  if (e->world_size < 1 || e->world_size > KILN_DIST_MAX_WORLD)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: env.world_size %d is outside 1..%d", fn, e->world_size,
                           KILN_DIST_MAX_WORLD);
  if (e->rank < 0 || e->rank >= e->world_size)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: env.rank %d is outside 0..%d (env.world_size %d)", fn, e->rank,
                           e->world_size - 1, e->world_size);
  if (e->local_world_size < 0 || e->local_world_size > e->world_size)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: env.local_world_size %d is outside 0..%d (0: unknown)", fn,
                           e->local_world_size, e->world_size);
  int local_hi = e->local_world_size ? e->local_world_size - 1 : e->world_size - 1;
  if (e->local_rank < 0 || e->local_rank > local_hi)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: env.local_rank %d is outside 0..%d", fn, e->local_rank, local_hi);
  memset(c.master_addr, 0, sizeof c.master_addr);
  c.master_port = 0;
  if (e->world_size > 1) {
    char q[64];
    if (!memchr(e->master_addr, '\0', sizeof e->master_addr))
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: env.master_addr is not terminated within its %zu bytes", fn,
                             sizeof e->master_addr);
    if (!host_ok(e->master_addr, c.master_addr, sizeof c.master_addr))
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: env.master_addr \"%s\" is not a host name or address", fn,
                             kiln__dist_quote(e->master_addr, q, sizeof q));
    if (e->master_port < 1 || e->master_port > 65535)
      return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                             "%s: env.master_port %d is outside 1..65535", fn, e->master_port);
    c.master_port = e->master_port;
  }
  *out = c;
  return KILN_OK;
}

static const char *from_environ(void *user, const char *name) {
  (void)user;
  return getenv(name);
}

kiln_status kiln_dist_env_read(kiln_dist_env *env, char *err, size_t err_size) {
  return kiln__dist_env_parse(__func__, from_environ, NULL, env, err, err_size);
}
