/*
 * test_cpu_dist.c: several GPUs' set-up, without a GPU or NCCL (issue 25): the rendezvous between
 * forked processes on loopback (eight ranks, ranks that start before rank 0 listens, a dead rank
 * named on every rank by the deadline, a wrong world size, a duplicate rank, a second rank 0, a
 * rank that goes away, connections that are not ranks, a port in use, a server that is not
 * kiln's), each without a file descriptor left open; NCCL's loader on a missing library and on a
 * stand-in (fake_nccl.c) whose functions are called through kiln's table; kiln_dist_init from a
 * world of 1 without network to three processes sharing rank 0's id. The launchers' environment,
 * a rank's shard of an epoch and the gradient buckets are test_cpu_dist_pure.c's.
 *
 * Ports never collide between test runs: rank 0 binds port 0 and the others are told the port
 * the system gave. Forked ranks report through a pipe, die with the test process
 * (PR_SET_PDEATHSIG) and are all waited for.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "data/shard.h"
#include "dist/dist.h"
#include "helpers.h"

#define HOST "127.0.0.1"

/* ---------------------------------------------------------------- helpers */

/* The process's open file descriptors (-1 when they cannot be counted). */
static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

static int open_fds(void) {
  int n = count_fds();
  cr_assert_geq(n, 0, "/proc/self/fd cannot be read");
  return n;
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* What a forked rank reports. */
typedef struct result {
  int status;
  int fds_left; /* descriptors the call left open */
  unsigned char blob[KILN__RDV_BLOB];
  char msg[1024];
} result;

typedef struct child {
  pid_t pid;
  int fd; /* the pipe's reading end */
} child;

/* Forks a process that runs body(arg, &r) and sends r back; it dies with the test process. */
static child spawn(void (*body)(void *arg, result *r), void *arg) {
  int p[2];
  cr_assert_eq(pipe(p), 0);
  pid_t parent = getpid();
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(3);
    alarm(60); /* a backstop: every wait here has a deadline far below */
    close(p[0]);
    result r;
    memset(&r, 0, sizeof r);
    int fds = count_fds();
    body(arg, &r);
    r.fds_left = count_fds() - fds;
    ssize_t w = write(p[1], &r, sizeof r);
    _exit(w == (ssize_t)sizeof r ? 0 : 2);
  }
  close(p[1]);
  return (child){pid, p[0]};
}

/* Waits for the child and reads its result (asserting it ended well). */
static result reap(child c) {
  result r;
  memset(&r, 0, sizeof r);
  size_t got = 0;
  while (got < sizeof r) {
    ssize_t k = read(c.fd, (char *)&r + got, sizeof r - got);
    if (k <= 0) break;
    got += (size_t)k;
  }
  close(c.fd);
  int st = 0;
  cr_assert_eq(waitpid(c.pid, &st, 0), c.pid);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "a forked rank ended badly (status %d)", st);
  cr_assert_eq(got, sizeof r, "a forked rank sent no result");
  cr_assert_eq(r.fds_left, 0, "a forked rank left %d descriptors open (%s)", r.fds_left, r.msg);
  return r;
}

/* A joining rank. */
typedef struct join_arg {
  int port, rank, world;
  double timeout_s, delay_s;
} join_arg;

static void join_body(void *p, result *r) {
  join_arg *a = p;
  if (a->delay_s > 0) usleep((useconds_t)(a->delay_s * 1e6));
  r->status = kiln__rdv_join("test", HOST, a->port, a->rank, a->world, r->blob, a->timeout_s,
                             r->msg, sizeof r->msg);
}

static child spawn_join(join_arg *a) { return spawn(join_body, a); }

/* Rank 0's listener on a port the system picks. */
static int listener(int *port) {
  int fd;
  char err[512];
  cr_assert_eq(kiln__rdv_listen("test", HOST, 0, &fd, port, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_gt(*port, 0);
  return fd;
}

/* A socket bound to a free loopback port that nobody listens on (connections are refused). */
static int bound_only(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_geq(fd, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  socklen_t len = sizeof a;
  cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  *port = ntohs(a.sin_port);
  return fd;
}

static void blob_fill(unsigned char *b, unsigned seed) {
  for (int i = 0; i < KILN__RDV_BLOB; i++)
    b[i] = (unsigned char)(seed * 31u + (unsigned)i * 7u);
}

#define ASSERT_HAS(s, part) cr_assert(strstr((s), (part)), "\"%s\" lacks \"%s\"", (s), (part))

/* ---------------------------------------------------------------- rendezvous */

Test(rendezvous, eight_ranks_get_rank_0s_blob) {
  int before = open_fds(), port;
  int fd = listener(&port);
  unsigned char blob[KILN__RDV_BLOB];
  blob_fill(blob, 42);
  child c[7];
  join_arg a[7];
  for (int r = 1; r < 8; r++) {
    a[r - 1] = (join_arg){port, r, 8, 10.0, 0.01 * ((r * 3) % 7)}; /* arriving out of order */
    c[r - 1] = spawn_join(&a[r - 1]);
  }
  char err[1024] = "";
  kiln_status s = kiln__rdv_serve("test", fd, 8, blob, 10.0, err, sizeof err);
  close(fd);
  for (int r = 1; r < 8; r++) {
    result res = reap(c[r - 1]);
    cr_assert_eq(res.status, KILN_OK, "rank %d: %s", r, res.msg);
    cr_assert_eq(memcmp(res.blob, blob, sizeof blob), 0, "rank %d got another blob", r);
  }
  cr_assert_eq(s, KILN_OK, "%s", err);
  cr_assert_eq(open_fds(), before, "a socket was left open");
}

Test(rendezvous, ranks_may_start_before_rank_0_listens) {
  int before = open_fds(), port;
  int fd = bound_only(&port); /* bound, not listening: the ranks' connections are refused */
  join_arg a1 = {port, 1, 3, 10.0, 0}, a2 = {port, 2, 3, 10.0, 0};
  child c1 = spawn_join(&a1), c2 = spawn_join(&a2);
  usleep(300 * 1000);
  cr_assert_eq(listen(fd, 16), 0);
  unsigned char blob[KILN__RDV_BLOB];
  blob_fill(blob, 7);
  char err[1024] = "";
  cr_assert_eq(kiln__rdv_serve("test", fd, 3, blob, 10.0, err, sizeof err), KILN_OK, "%s", err);
  close(fd);
  result r1 = reap(c1), r2 = reap(c2);
  cr_assert_eq(r1.status, KILN_OK, "%s", r1.msg);
  cr_assert_eq(r2.status, KILN_OK, "%s", r2.msg);
  cr_assert_eq(memcmp(r1.blob, blob, sizeof blob), 0);
  cr_assert_eq(memcmp(r2.blob, blob, sizeof blob), 0);
  cr_assert_eq(open_fds(), before);
}

Test(rendezvous, a_dead_rank_is_named_by_the_deadline) {
  int before = open_fds(), port;
  int fd = listener(&port);
  unsigned char blob[KILN__RDV_BLOB];
  blob_fill(blob, 1);
  join_arg a = {port, 1, 3, 5.0, 0};
  child c = spawn_join(&a); /* rank 2 never starts */
  char err[1024] = "";
  double t0 = seconds();
  kiln_status s = kiln__rdv_serve("test", fd, 3, blob, 1.0, err, sizeof err);
  double took = seconds() - t0;
  close(fd);
  result r = reap(c);
  cr_assert_eq(s, KILN_ERR_STATE);
  char want[200];
  snprintf(want, sizeof want,
           "test: rank 0 of 3: rank 2 (1 of 3) did not arrive within 1.0 s at port %d", port);
  cr_assert_str_eq(err, want);
  cr_assert(took >= 0.95 && took < 3.0, "rank 0 waited %.2f s for a 1 s deadline", took);
  /* rank 1 hears it from rank 0 at once, not at its own deadline */
  cr_assert_eq(r.status, KILN_ERR_STATE);
  ASSERT_HAS(r.msg, "test: rank 1 of 3: rank 0 at 127.0.0.1:");
  ASSERT_HAS(r.msg, "ended the rendezvous: rank 2 (1 of 3) did not arrive within 1.0 s");
  cr_assert_eq(open_fds(), before);
}

Test(rendezvous, missing_ranks_are_listed_as_ranges) {
  int port;
  int fd = listener(&port);
  unsigned char blob[KILN__RDV_BLOB] = {0};
  join_arg a1 = {port, 1, 7, 5.0, 0}, a3 = {port, 3, 7, 5.0, 0};
  child c1 = spawn_join(&a1), c3 = spawn_join(&a3);
  char err[1024] = "";
  cr_assert_eq(kiln__rdv_serve("test", fd, 7, blob, 0.7, err, sizeof err), KILN_ERR_STATE);
  close(fd);
  ASSERT_HAS(err, "ranks 2, 4-6 (4 of 7) did not arrive within 0.7 s");
  cr_assert_eq(reap(c1).status, KILN_ERR_STATE);
  cr_assert_eq(reap(c3).status, KILN_ERR_STATE);
}

Test(rendezvous, rank_0_never_listening_is_named_by_the_deadline) {
  int before = open_fds(), port;
  int fd = bound_only(&port);
  unsigned char blob[KILN__RDV_BLOB];
  memset(blob, 9, sizeof blob);
  char err[1024] = "";
  double t0 = seconds();
  kiln_status s = kiln__rdv_join("test", HOST, port, 2, 4, blob, 0.5, err, sizeof err);
  double took = seconds() - t0;
  close(fd);
  cr_assert_eq(s, KILN_ERR_STATE);
  char want[200];
  snprintf(want, sizeof want,
           "test: rank 2 of 4: could not reach rank 0 at 127.0.0.1:%d within 0.5 s (last: "
           "Connection refused)",
           port);
  cr_assert_str_eq(err, want);
  cr_assert(took >= 0.45 && took < 2.0, "waited %.2f s for a 0.5 s deadline", took);
  for (int i = 0; i < KILN__RDV_BLOB; i++)
    cr_assert_eq(blob[i], 9, "a failed join wrote the blob");
  cr_assert_eq(open_fds(), before);
}

Test(rendezvous, a_wrong_world_size_ends_it_at_once) {
  int before = open_fds(), port;
  int fd = listener(&port);
  unsigned char blob[KILN__RDV_BLOB] = {0};
  join_arg bad = {port, 1, 3, 10.0, 0};
  child c = spawn_join(&bad);
  char err[1024] = "";
  double t0 = seconds();
  kiln_status s = kiln__rdv_serve("test", fd, 2, blob, 10.0, err, sizeof err);
  close(fd);
  result r = reap(c);
  cr_assert(seconds() - t0 < 5.0, "it waited for the deadline");
  cr_assert_eq(s, KILN_ERR_STATE);
  ASSERT_HAS(err, "test: rank 0 of 2: a process at 127.0.0.1:");
  ASSERT_HAS(err, "says it is rank 1 of WORLD_SIZE 3, but rank 0's WORLD_SIZE is 2");
  cr_assert_eq(r.status, KILN_ERR_STATE);
  ASSERT_HAS(r.msg, "test: rank 1 of 3: rank 0 at 127.0.0.1:");
  ASSERT_HAS(r.msg, "refused this rank: this rank says WORLD_SIZE 3, rank 0 says 2");
  cr_assert_eq(open_fds(), before);
}

Test(rendezvous, a_duplicate_rank_ends_it_at_once) {
  int before = open_fds(), port;
  int fd = listener(&port);
  unsigned char blob[KILN__RDV_BLOB] = {0};
  join_arg one = {port, 1, 3, 10.0, 0};
  child c1 = spawn_join(&one), c2 = spawn_join(&one);
  char err[1024] = "";
  double t0 = seconds();
  kiln_status s = kiln__rdv_serve("test", fd, 3, blob, 10.0, err, sizeof err);
  close(fd);
  result r1 = reap(c1), r2 = reap(c2);
  cr_assert(seconds() - t0 < 5.0, "it waited for the deadline");
  cr_assert_eq(s, KILN_ERR_STATE);
  ASSERT_HAS(err, "test: rank 0 of 3: rank 1 came twice, from 127.0.0.1:");
  ASSERT_HAS(err, "two processes were given the same RANK");
  cr_assert_eq(r1.status, KILN_ERR_STATE);
  cr_assert_eq(r2.status, KILN_ERR_STATE);
  ASSERT_HAS(r1.msg, "refused this rank: rank 1 came twice");
  ASSERT_HAS(r2.msg, "refused this rank: rank 1 came twice");
  cr_assert_eq(open_fds(), before);
}

/* Sends a hello by hand: rank rank of world, then closes or stays (for hold_s seconds). */
typedef struct raw_arg {
  int port;
  const char *bytes; /* NULL: a kiln hello */
  size_t n;
  unsigned rank, world;
  double hold_s;
} raw_arg;

static void raw_body(void *p, result *r) {
  raw_arg *a = p;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_port = htons((uint16_t)a->port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    r->status = -1;
    return;
  }
  unsigned char hello[16] = "KILNRDV1";
  for (int i = 0; i < 4; i++) {
    hello[8 + i] = (unsigned char)(a->world >> (24 - 8 * i));
    hello[12 + i] = (unsigned char)(a->rank >> (24 - 8 * i));
  }
  const void *what = a->bytes ? (const void *)a->bytes : (const void *)hello;
  size_t n = a->bytes ? a->n : sizeof hello;
  r->status = send(fd, what, n, MSG_NOSIGNAL) == (ssize_t)n ? 0 : -1;
  if (a->hold_s > 0) usleep((useconds_t)(a->hold_s * 1e6));
  close(fd);
}

Test(rendezvous, a_second_rank_0_and_a_rank_out_of_range_are_refused) {
  int port;
  int fd = listener(&port);
  unsigned char blob[KILN__RDV_BLOB] = {0};
  char err[1024] = ""; /* kiln__rdv_join refuses to be rank 0 itself */
  cr_assert_eq(kiln__rdv_join("test", HOST, port, 0, 3, blob, 1.0, err, sizeof err),
               KILN_ERR_INVALID);
  raw_arg r0 = {port, NULL, 0, 0, 3, 0.3};
  child c = spawn(raw_body, &r0);
  cr_assert_eq(kiln__rdv_serve("test", fd, 3, blob, 10.0, err, sizeof err), KILN_ERR_STATE);
  ASSERT_HAS(err, "says it is rank 0 too: two processes were given RANK 0");
  cr_assert_eq(reap(c).status, 0);
  raw_arg r9 = {port, NULL, 0, 9, 3, 0.3};
  c = spawn(raw_body, &r9);
  cr_assert_eq(kiln__rdv_serve("test", fd, 3, blob, 10.0, err, sizeof err), KILN_ERR_STATE);
  ASSERT_HAS(err, "says it is rank 9 of 3; the ranks are 0..2");
  cr_assert_eq(reap(c).status, 0);
  close(fd);
}

Test(rendezvous, a_rank_that_goes_away_ends_it_at_once) {
  int before = open_fds(), port;
  int fd = listener(&port);
  unsigned char blob[KILN__RDV_BLOB] = {0};
  raw_arg gone = {port, NULL, 0, 1, 3, 0}; /* says rank 1, then closes */
  child c = spawn(raw_body, &gone);
  char err[1024] = "";
  double t0 = seconds();
  cr_assert_eq(kiln__rdv_serve("test", fd, 3, blob, 10.0, err, sizeof err), KILN_ERR_STATE);
  cr_assert(seconds() - t0 < 5.0, "it waited for the deadline");
  ASSERT_HAS(err, "test: rank 0 of 3: rank 1 (at 127.0.0.1:");
  ASSERT_HAS(err, ") went away before every rank had arrived");
  close(fd);
  cr_assert_eq(reap(c).status, 0);
  cr_assert_eq(open_fds(), before);
}

Test(rendezvous, connections_that_are_not_ranks_are_dropped) {
  int before = open_fds(), port;
  int fd = listener(&port);
  unsigned char blob[KILN__RDV_BLOB];
  blob_fill(blob, 3);
  static const char http[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  raw_arg junk = {port, http, sizeof http - 1, 0, 0, 0.5};
  raw_arg silent = {port, "", 0, 0, 0, 1.0}; /* connects and says nothing */
  child cj = spawn(raw_body, &junk), cs = spawn(raw_body, &silent);
  join_arg a = {port, 1, 2, 10.0, 0.2};
  child c = spawn_join(&a);
  char err[1024] = "";
  cr_assert_eq(kiln__rdv_serve("test", fd, 2, blob, 10.0, err, sizeof err), KILN_OK, "%s", err);
  close(fd);
  result r = reap(c);
  cr_assert_eq(r.status, KILN_OK, "%s", r.msg);
  cr_assert_eq(memcmp(r.blob, blob, sizeof blob), 0);
  reap(cj);
  reap(cs);
  cr_assert_eq(open_fds(), before);
}

Test(rendezvous, a_port_in_use_is_named) {
  int before = open_fds(), port;
  int holder = socket(AF_INET, SOCK_STREAM, 0); /* another program's listener, on every address */
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
  cr_assert_eq(bind(holder, (struct sockaddr *)&a, sizeof a), 0);
  cr_assert_eq(listen(holder, 4), 0);
  socklen_t len = sizeof a;
  cr_assert_eq(getsockname(holder, (struct sockaddr *)&a, &len), 0);
  port = ntohs(a.sin_port);
  int fd = -1, got = -1;
  char err[1024] = "";
  cr_assert_eq(kiln__rdv_listen("test", HOST, port, &fd, &got, err, sizeof err), KILN_ERR_IO);
  char want[160];
  snprintf(want, sizeof want, "test: rank 0 cannot listen on port %d: it is in use on this machine",
           port);
  ASSERT_HAS(err, want);
  ASSERT_HAS(err, "give MASTER_PORT a free port");
  cr_assert_eq(fd, -1);
  cr_assert_eq(got, -1);
  close(holder);
  cr_assert_eq(open_fds(), before);
}

/* A server that is not kiln's: answers every connection with an HTTP error. */
static void http_server_body(void *p, result *r) {
  int fd = *(int *)p;
  int c = accept(fd, NULL, NULL);
  static const char reply[] = "HTTP/1.1 400 Bad Request\r\n\r\n";
  r->status = c >= 0 && send(c, reply, sizeof reply - 1, MSG_NOSIGNAL) > 0 ? 0 : -1;
  usleep(200 * 1000);
  if (c >= 0) close(c);
}

Test(rendezvous, a_server_that_is_not_kiln_is_named) {
  int port;
  int fd = bound_only(&port);
  cr_assert_eq(listen(fd, 4), 0);
  child c = spawn(http_server_body, &fd);
  unsigned char blob[KILN__RDV_BLOB];
  char err[1024] = "";
  cr_assert_eq(kiln__rdv_join("test", HOST, port, 1, 2, blob, 5.0, err, sizeof err),
               KILN_ERR_STATE);
  ASSERT_HAS(err,
             "answered bytes that are not kiln's rendezvous: is MASTER_PORT another program's?");
  close(fd);
  cr_assert_eq(reap(c).status, 0);
}

Test(rendezvous, bad_arguments) {
  unsigned char blob[KILN__RDV_BLOB];
  char err[512];
  cr_assert_eq(kiln__rdv_join("t", HOST, 1, 1, 1, blob, 1, err, sizeof err), KILN_ERR_INVALID);
  cr_assert_eq(kiln__rdv_join("t", HOST, 1, 2, 2, blob, 1, err, sizeof err), KILN_ERR_INVALID);
  cr_assert_eq(kiln__rdv_join("t", HOST, 0, 1, 2, blob, 1, err, sizeof err), KILN_ERR_INVALID);
  cr_assert_eq(kiln__rdv_join("t", HOST, 1, 1, 2, blob, 0, err, sizeof err), KILN_ERR_INVALID);
  cr_assert_eq(kiln__rdv_join("t", HOST, 1, 1, 2, blob, NAN, err, sizeof err), KILN_ERR_INVALID);
  cr_assert_eq(kiln__rdv_join("t", NULL, 1, 1, 2, blob, 1, err, sizeof err), KILN_ERR_INVALID);
  cr_assert_eq(kiln__rdv_serve("t", 0, 1, blob, 1, err, sizeof err), KILN_ERR_INVALID);
  ASSERT_HAS(err, "world size 1 is outside 2..65536");
  cr_assert_eq(kiln__rdv_serve("t", -1, 2, blob, 1, err, sizeof err), KILN_ERR_INVALID);
  int fd, port;
  cr_assert_eq(kiln__rdv_listen("t", HOST, 70000, &fd, &port, err, sizeof err), KILN_ERR_INVALID);
  cr_assert_eq(kiln__rdv_listen("t", NULL, 0, &fd, &port, err, sizeof err), KILN_ERR_INVALID);
  /* (names that do not resolve are not tried here: the answer may wait on a DNS server) */
}

/* ---------------------------------------------------------------- NCCL's loader */

Test(nccl_loader, a_missing_library_says_how_to_install_nccl) {
  kiln__nccl t;
  memset(&t, 0, sizeof t);
  char err[1024] = "";
  unsetenv("KILN_NCCL_LIBRARY");
  cr_assert_eq(kiln__nccl_load("f", "/nonexistent/libnccl.so.2", &t, err, sizeof err),
               KILN_ERR_STATE);
  ASSERT_HAS(err, "f: /nonexistent/libnccl.so.2 did not load: ");
  ASSERT_HAS(err, "apt-get install libnccl2");
  ASSERT_HAS(err, "pip install nvidia-nccl-cu13, or nvidia-nccl-cu12");
  ASSERT_HAS(err, "KILN_NCCL_LIBRARY");
  cr_assert_null(t.lib);
  cr_assert_null(t.get_unique_id);
  /* KILN_NCCL_LIBRARY is read when no path is given, and named */
  setenv("KILN_NCCL_LIBRARY", "/nonexistent/nccl-from-env.so", 1);
  cr_assert_eq(kiln__nccl_load("f", NULL, &t, err, sizeof err), KILN_ERR_STATE);
  ASSERT_HAS(err, "f: /nonexistent/nccl-from-env.so (KILN_NCCL_LIBRARY) did not load");
  unsetenv("KILN_NCCL_LIBRARY");
  cr_assert_eq(kiln__nccl_load("f", NULL, NULL, err, sizeof err), KILN_ERR_INVALID);
}

Test(nccl_loader, a_stand_in_is_called_through_the_table) {
  kiln__nccl t;
  memset(&t, 0, sizeof t);
  char err[1024] = "", words[200];
  cr_assert_eq(kiln__nccl_load("f", KILN_FAKE_NCCL, &t, err, sizeof err), KILN_OK, "%s", err);
  cr_assert_not_null(t.lib);
  cr_assert_str_eq(t.path, KILN_FAKE_NCCL);
  cr_assert_eq(t.version, 22703);
  int *calls = dlsym(t.lib, "fake_nccl_calls");
  cr_assert_not_null(calls, "the table's library is not the stand-in");
  int before = *calls;

  kiln__nccl_id id;
  cr_assert_eq(t.get_unique_id(&id), KILN__NCCL_SUCCESS);
  char want[64];
  snprintf(want, sizeof want, "fake-nccl pid %ld ", (long)getpid());
  cr_assert_eq(strncmp(id.internal, want, strlen(want)), 0, "id \"%.40s\"", id.internal);
  kiln__nccl_comm comm = NULL, other = NULL;
  cr_assert_eq(t.comm_init_rank(&comm, 1, id, 0), KILN__NCCL_SUCCESS); /* the id by value */
  cr_assert_not_null(comm);
  float send[5] = {1, -2, 3.5f, 4, 1e30f}, recv[5] = {0};
  cr_assert_eq(t.all_reduce(send, recv, 5, KILN__NCCL_FLOAT32, KILN__NCCL_AVG, comm, NULL), 0);
  cr_assert_eq(memcmp(send, recv, sizeof send), 0);
  uint16_t half_send[3] = {0x3f80, 0x4000, 0xc040}, half_recv[4] = {0, 0, 0, 0xbeef};
  cr_assert_eq(
      t.all_reduce(half_send, half_recv, 3, KILN__NCCL_BFLOAT16, KILN__NCCL_SUM, comm, NULL), 0);
  cr_assert_eq(memcmp(half_send, half_recv, sizeof half_send), 0);
  cr_assert_eq(half_recv[3], 0xbeef, "bf16 is 2 bytes an element");
  int64_t big_send[2] = {1LL << 40, -7}, big_recv[2] = {0, 0};
  cr_assert_eq(t.broadcast(big_send, big_recv, 2, KILN__NCCL_INT64, 0, comm, NULL), 0);
  cr_assert_eq(big_recv[0], 1LL << 40);
  cr_assert_eq(big_recv[1], -7);
  cr_assert_eq(t.all_reduce(send, recv, 5, 42, KILN__NCCL_SUM, comm, NULL),
               KILN__NCCL_INVALID_ARGUMENT);
  cr_assert_str_eq(kiln__nccl_result_string(&t, KILN__NCCL_INVALID_ARGUMENT, words, sizeof words),
                   "invalid argument (4)");
  cr_assert_not_null(t.get_last_error);
  cr_assert_str_eq(t.get_last_error(NULL), "fake NCCL: unknown data type");
  cr_assert_eq(t.group_start(), 0);
  cr_assert_eq(t.group_end(), 0);
  cr_assert_eq(t.group_end(), KILN__NCCL_INVALID_USAGE);
  int async = -1;
  cr_assert_eq(t.comm_get_async_error(comm, &async), 0);
  cr_assert_eq(async, KILN__NCCL_SUCCESS);
  cr_assert_eq(t.comm_init_rank(&other, 1, id, 0), 0);
  cr_assert_eq(t.comm_abort(other), 0);
  cr_assert_eq(t.comm_destroy(comm), 0);
  cr_assert_eq(*calls - before, 15, "%d calls reached the stand-in", *calls - before);
  kiln__nccl_unload(&t);
  cr_assert_null(t.lib);
  kiln__nccl_unload(&t); /* a zeroed table is fine */
}

Test(nccl_loader, a_library_without_a_function_or_too_old_is_refused) {
  kiln__nccl t;
  memset(&t, 0, sizeof t);
  char err[1024] = "";
  cr_assert_eq(kiln__nccl_load("f", KILN_FAKE_NCCL_PARTIAL, &t, err, sizeof err), KILN_ERR_STATE);
  ASSERT_HAS(err, "has no ncclCommAbort: it is not an NCCL kiln can use (2.10 or later)");
  cr_assert_null(t.lib);
  setenv("FAKE_NCCL_VERSION", "2803", 1);
  cr_assert_eq(kiln__nccl_load("f", KILN_FAKE_NCCL, &t, err, sizeof err), KILN_ERR_STATE);
  ASSERT_HAS(err, "is NCCL 2.8.3 (version code 2803); kiln needs 2.10.0 or later");
  setenv("FAKE_NCCL_VERSION", "20906", 1);
  cr_assert_eq(kiln__nccl_load("f", KILN_FAKE_NCCL, &t, err, sizeof err), KILN_ERR_STATE);
  ASSERT_HAS(err, "is NCCL 2.9.6 (version code 20906)");
  setenv("FAKE_NCCL_VERSION", "21003", 1);
  cr_assert_eq(kiln__nccl_load("f", KILN_FAKE_NCCL, &t, err, sizeof err), KILN_OK, "%s", err);
  kiln__nccl_unload(&t);
  unsetenv("FAKE_NCCL_VERSION");
}

Test(nccl_loader, version_codes) {
  char b[32];
  kiln__nccl_version_string(22703, b, sizeof b);
  cr_assert_str_eq(b, "2.27.3");
  kiln__nccl_version_string(21000, b, sizeof b);
  cr_assert_str_eq(b, "2.10.0");
  kiln__nccl_version_string(2803, b, sizeof b);
  cr_assert_str_eq(b, "2.8.3");
  cr_assert_eq(KILN__NCCL_VERSION(2, 8, 3), 2803);
  cr_assert_eq(KILN__NCCL_VERSION(2, 27, 3), 22703);
  cr_assert_eq(KILN__NCCL_MIN_VERSION, 21000);
}

/* ---------------------------------------------------------------- kiln_dist_init */

static void clear_launcher_env(void) {
  static const char *const names[] = {"RANK",
                                      "WORLD_SIZE",
                                      "LOCAL_RANK",
                                      "LOCAL_WORLD_SIZE",
                                      "MASTER_ADDR",
                                      "MASTER_PORT",
                                      "OMPI_COMM_WORLD_RANK",
                                      "OMPI_COMM_WORLD_SIZE",
                                      "KILN_NCCL_LIBRARY",
                                      "KILN_DIST_TIMEOUT"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    unsetenv(names[i]);
}

Test(dist_init, one_process_needs_no_nccl_and_no_network) {
  clear_launcher_env();
  int before = open_fds();
  kiln_dist *d = kiln_dist_init(NULL);
  cr_assert_not_null(d);
  cr_assert_eq(kiln_dist_status(d), KILN_OK, "%s", kiln_dist_error(d));
  cr_assert_null(kiln_dist_error(d));
  cr_assert_eq(kiln_dist_rank(d), 0);
  cr_assert_eq(kiln_dist_world_size(d), 1);
  cr_assert_eq(kiln_dist_local_rank(d), 0);
  cr_assert_eq(kiln_dist_nccl_version(d), 0);
  cr_assert_null(kiln__dist_nccl(d)->lib);
  cr_assert_eq(open_fds(), before, "a world of 1 opened a socket or a library's file");
  kiln_dist_free(d);
  kiln_dist_free(NULL);
  cr_assert_eq(kiln_dist_status(NULL), KILN_ERR_INVALID);
  cr_assert_str_eq(kiln_dist_error(NULL), "kiln_dist_error: NULL handle");
  cr_assert_eq(kiln_dist_rank(NULL), -1);
}

Test(dist_init, a_larger_world_without_nccl_says_how_to_install_it) {
  clear_launcher_env();
  kiln_dist_env env = {.launcher = KILN_DIST_LAUNCHER_TORCHRUN,
                       .rank = 1,
                       .world_size = 4,
                       .local_rank = 1,
                       .master_addr = HOST,
                       .master_port = 9};
  int before = open_fds();
  kiln_dist *d = kiln_dist_init(
      &(kiln_dist_options){.env = &env, .nccl_library = "/nonexistent/libnccl.so.2"});
  cr_assert_eq(kiln_dist_status(d), KILN_ERR_STATE);
  const char *e = kiln_dist_error(d);
  ASSERT_HAS(e, "kiln_dist_init: rank 1 of 4 needs NCCL: /nonexistent/libnccl.so.2 did not load");
  ASSERT_HAS(e, "libnccl2");
  ASSERT_HAS(e, "nvidia-nccl-cu12");
  cr_assert_eq(kiln_dist_rank(d), -1);
  cr_assert_eq(kiln_dist_world_size(d), -1);
  cr_assert_eq(kiln_dist_local_rank(d), -1);
  cr_assert_null(kiln__dist_nccl(d));
  kiln_dist_free(d);
  cr_assert_eq(open_fds(), before);
  /* and where NCCL is not installed, the default name does not load either */
  void *real = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (real) {
    dlclose(real);
    return; /* a machine with NCCL: nothing more to see here */
  }
  d = kiln_dist_init(&(kiln_dist_options){.env = &env});
  cr_assert_eq(kiln_dist_status(d), KILN_ERR_STATE);
  ASSERT_HAS(kiln_dist_error(d),
             "kiln_dist_init: rank 1 of 4 needs NCCL: libnccl.so.2 did not load");
  kiln_dist_free(d);
}

Test(dist_init, one_process_with_nccl_asked_for) {
  clear_launcher_env();
  kiln_dist *d = kiln_dist_init(&(kiln_dist_options){.nccl = 1, .nccl_library = KILN_FAKE_NCCL});
  cr_assert_eq(kiln_dist_status(d), KILN_OK, "%s", kiln_dist_error(d));
  cr_assert_eq(kiln_dist_nccl_version(d), 22703);
  cr_assert_eq(kiln_dist_world_size(d), 1);
  const kiln__nccl_id *id = kiln__dist_id(d);
  cr_assert_eq(strncmp(id->internal, "fake-nccl pid", 13), 0);
  kiln_dist_free(d);
  /* ncclGetUniqueId failing is named, with NCCL's words */
  setenv("FAKE_NCCL_FAIL_UNIQUE_ID", "1", 1);
  d = kiln_dist_init(&(kiln_dist_options){.nccl = 1, .nccl_library = KILN_FAKE_NCCL});
  cr_assert_eq(kiln_dist_status(d), KILN_ERR_STATE);
  cr_assert_str_eq(kiln_dist_error(d),
                   "kiln_dist_init: rank 0 of 1: ncclGetUniqueId failed: unhandled system error "
                   "(2): fake NCCL: no network interface found (made up)");
  cr_assert_eq(kiln_dist_nccl_version(d), 0);
  kiln_dist_free(d);
  unsetenv("FAKE_NCCL_FAIL_UNIQUE_ID");
}

Test(dist_init, bad_options_are_named) {
  clear_launcher_env();
  kiln_dist *d = kiln_dist_init(&(kiln_dist_options){.nccl = 2});
  cr_assert_eq(kiln_dist_status(d), KILN_ERR_INVALID);
  ASSERT_HAS(kiln_dist_error(d), "kiln_dist_init: options.nccl 2 is neither 0");
  kiln_dist_free(d);
  d = kiln_dist_init(&(kiln_dist_options){.timeout_s = -1});
  cr_assert_str_eq(kiln_dist_error(d),
                   "kiln_dist_init: timeout_s -1 is not a number of seconds in (0, 1e+07]");
  kiln_dist_free(d);
  setenv("KILN_DIST_TIMEOUT", "soon", 1);
  d = kiln_dist_init(NULL);
  cr_assert_str_eq(kiln_dist_error(d), "kiln_dist_init: KILN_DIST_TIMEOUT=\"soon\" is not a "
                                       "number of seconds in (0, 1e+07]");
  kiln_dist_free(d);
  unsetenv("KILN_DIST_TIMEOUT");
  setenv("RANK", "7", 1);
  setenv("WORLD_SIZE", "2", 1);
  d = kiln_dist_init(NULL);
  cr_assert_str_eq(kiln_dist_error(d), "kiln_dist_init: RANK=\"7\" is not below WORLD_SIZE=2");
  kiln_dist_free(d);
  kiln_dist_env env = {.rank = 3, .world_size = 2};
  d = kiln_dist_init(&(kiln_dist_options){.env = &env});
  ASSERT_HAS(kiln_dist_error(d), "kiln_dist_init: env.rank 3 is outside 0..1");
  kiln_dist_free(d);
}

/* A rank of a world started as torchrun would: its variables set, then kiln_dist_init(NULL). */
typedef struct init_arg {
  int port, rank, world;
} init_arg;

static void init_body(void *p, result *r) {
  init_arg *a = p;
  char v[32];
  snprintf(v, sizeof v, "%d", a->rank);
  setenv("RANK", v, 1);
  setenv("LOCAL_RANK", v, 1);
  snprintf(v, sizeof v, "%d", a->world);
  setenv("WORLD_SIZE", v, 1);
  snprintf(v, sizeof v, "%d", a->port);
  setenv("MASTER_PORT", v, 1);
  setenv("MASTER_ADDR", "localhost", 1);
  setenv("KILN_NCCL_LIBRARY", KILN_FAKE_NCCL, 1);
  setenv("KILN_DIST_TIMEOUT", "10", 1);
  kiln_dist *d = kiln_dist_init(NULL);
  r->status = kiln_dist_status(d);
  if (r->status == KILN_OK) {
    memcpy(r->blob, kiln__dist_id(d), sizeof r->blob);
    r->status = kiln_dist_rank(d) == a->rank && kiln_dist_world_size(d) == a->world &&
                        kiln_dist_local_rank(d) == a->rank && kiln_dist_nccl_version(d) == 22703
                    ? KILN_OK
                    : -2;
  } else {
    snprintf(r->msg, sizeof r->msg, "%s", kiln_dist_error(d));
  }
  kiln_dist_free(d);
}

/* A free port, for a test that has rank 0 bind it itself (a listener on port 0, closed). */
static int free_port(void) {
  int port, fd = listener(&port);
  close(fd);
  return port;
}

Test(dist_init, three_processes_share_rank_0s_id) {
  clear_launcher_env();
  int before = open_fds();
  for (int attempt = 0;; attempt++) {
    int port = free_port();
    init_arg a1 = {port, 1, 3}, a2 = {port, 2, 3};
    child c1 = spawn(init_body, &a1), c2 = spawn(init_body, &a2);
    kiln_dist_env env = {.launcher = KILN_DIST_LAUNCHER_TORCHRUN,
                         .rank = 0,
                         .world_size = 3,
                         .master_addr = "localhost",
                         .master_port = port};
    kiln_dist *d = kiln_dist_init(
        &(kiln_dist_options){.env = &env, .timeout_s = 10, .nccl_library = KILN_FAKE_NCCL});
    result r1 = reap(c1), r2 = reap(c2);
    if (kiln_dist_status(d) == KILN_ERR_IO && attempt < 3 && strstr(kiln_dist_error(d), "in use")) {
      kiln_dist_free(d); /* another process took the port between our close and rank 0's bind */
      continue;
    }
    cr_assert_eq(kiln_dist_status(d), KILN_OK, "%s", kiln_dist_error(d));
    cr_assert_eq(r1.status, KILN_OK, "rank 1: %s", r1.msg);
    cr_assert_eq(r2.status, KILN_OK, "rank 2: %s", r2.msg);
    const kiln__nccl_id *id = kiln__dist_id(d);
    char want[64];
    snprintf(want, sizeof want, "fake-nccl pid %ld ", (long)getpid());
    cr_assert_eq(strncmp(id->internal, want, strlen(want)), 0, "rank 0 made \"%.40s\"",
                 id->internal);
    cr_assert_eq(memcmp(r1.blob, id, sizeof r1.blob), 0, "rank 1 holds another id");
    cr_assert_eq(memcmp(r2.blob, id, sizeof r2.blob), 0, "rank 2 holds another id");
    kiln_dist_free(d);
    break;
  }
  cr_assert_eq(open_fds(), before);
}

Test(dist_init, a_dead_rank_fails_rank_0_by_the_deadline) {
  clear_launcher_env();
  int before = open_fds();
  setenv("KILN_DIST_TIMEOUT", "0.5", 1);
  kiln_dist_env env = {.launcher = KILN_DIST_LAUNCHER_TORCHRUN,
                       .world_size = 2,
                       .master_addr = HOST,
                       .master_port = free_port()};
  kiln_dist *d = kiln_dist_init(&(kiln_dist_options){.env = &env, .nccl_library = KILN_FAKE_NCCL});
  cr_assert_eq(kiln_dist_status(d), KILN_ERR_STATE, "%s", kiln_dist_error(d));
  char want[160];
  snprintf(want, sizeof want,
           "kiln_dist_init: rank 0 of 2: rank 1 (1 of 2) did not arrive within 0.5 s at port %d",
           env.master_port);
  cr_assert_str_eq(kiln_dist_error(d), want);
  cr_assert_null(kiln__dist_nccl(d), "a failed handle holds NCCL");
  cr_assert_eq(kiln_dist_nccl_version(d), 0);
  kiln_dist_free(d);
  unsetenv("KILN_DIST_TIMEOUT");
  cr_assert_eq(open_fds(), before);
}
