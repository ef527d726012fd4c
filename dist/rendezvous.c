/*
 * rendezvous.c: how the ranks meet before NCCL can. Rank 0 listens on MASTER_PORT; every other
 * rank connects to MASTER_ADDR:MASTER_PORT (retrying until rank 0 listens) and says who it is;
 * once all have come, rank 0 hands each the blob (NCCL's unique id) and waits until each has
 * confirmed it. One thread, non-blocking sockets and poll(), one deadline for the whole: nothing
 * waits past it, and what fails before it fails at once on every rank that can be told.
 *
 * The messages (integers are unsigned, 32 bits, big-endian):
 *   hello   rank -> 0   "KILNRDV1", world size, rank                               16 bytes
 *   answer  0 -> rank   "KILNRDV1", kind, length, then length bytes:
 *                       'I' the blob (length 128); 'R' this rank is refused, 'A' the rendezvous
 *                       ended for another reason (each with why, as text of at most 512 bytes)
 *   ack     rank -> 0   "KILNACK1"                                                  8 bytes
 * What arrives is untrusted: sizes are fixed or checked before use, and text is quoted
 * (printable, cut) in messages. A connection to rank 0 that does not begin with the magic is not
 * a rank and is dropped; one that claims a rank in a wrong way (another world size, a rank out
 * of range or already taken) ends the rendezvous on every rank, as a launch that is wrong should.
 */
#define _GNU_SOURCE /* accept4 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "dist.h"

#define MAGIC "KILNRDV1"
#define ACK "KILNACK1"
#define TAG_BYTES 8
#define HELLO_BYTES 16
#define HEAD_BYTES 16
#define TEXT_MAX 512
#define SPARE_SLOTS 16 /* connections rank 0 holds beyond one a rank, not yet known to be ranks */
#define TIMEOUT_MAX 1e7

_Static_assert(sizeof MAGIC - 1 == TAG_BYTES && sizeof ACK - 1 == TAG_BYTES, "8-byte tags");
_Static_assert(KILN__RDV_BLOB <= TEXT_MAX, "an answer's buffer holds the blob");

/* ---------------------------------------------------------------- time and bytes */

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Milliseconds until the deadline, rounded up (0 once it has passed). */
static int ms_left(int64_t deadline) {
  int64_t d = deadline - now_ns();
  if (d <= 0) return 0;
  int64_t ms = (d + 999999) / 1000000;
  return ms > INT_MAX ? INT_MAX : (int)ms;
}

static bool timeout_ok(double s) { return s > 0 && s <= TIMEOUT_MAX; }

static void put_u32(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)(v >> 24);
  p[1] = (unsigned char)(v >> 16);
  p[2] = (unsigned char)(v >> 8);
  p[3] = (unsigned char)v;
}

static uint32_t get_u32(const unsigned char *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* "host:port" of a peer's address, numeric. */
static void peer_name(const struct sockaddr *sa, socklen_t len, char *buf, size_t n) {
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV))
    snprintf(buf, n, "an unknown address");
  else
    snprintf(buf, n, sa->sa_family == AF_INET6 ? "[%s]:%s" : "%s:%s", host, serv);
}

/* Closes a socket after telling the peer the sender is done and reading what the peer had already
 * sent, so that closing does not reset the connection before the peer read what was sent. */
static void close_gently(int fd) {
  char sink[256];
  shutdown(fd, SHUT_WR);
  for (int i = 0; i < 16 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++) {
  }
  close(fd);
}

/* ---------------------------------------------------------------- rank 0 */

/* A socket listening on port of every interface of family; -1 with errno set on failure. */
static int listen_on(int family, int port) {
  struct sockaddr_storage ss;
  socklen_t len;
  memset(&ss, 0, sizeof ss);
  if (family == AF_INET6) {
    struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_any;
    a->sin6_port = htons((uint16_t)port);
    len = sizeof *a;
  } else {
    struct sockaddr_in *a = (struct sockaddr_in *)&ss;
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_ANY);
    a->sin_port = htons((uint16_t)port);
    len = sizeof *a;
  }
  int s = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  int one = 1, zero = 0;
  /* a restarted job may take the port its predecessor left in TIME_WAIT (never a listening one);
   * an IPv6 socket takes IPv4 connections too */
  setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (family == AF_INET6) setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  if (bind(s, (struct sockaddr *)&ss, len) < 0 || listen(s, SOMAXCONN) < 0) {
    int e = errno;
    close(s);
    errno = e;
    return -1;
  }
  return s;
}

static int port_of(int fd) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &len) < 0) return -1;
  return ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                        : ((struct sockaddr_in *)&ss)->sin_port);
}

kiln_status kiln__rdv_listen(const char *fn, const char *host, int port, int *fd, int *bound_port,
                             char *err, size_t err_size) {
  if (!host || !fd || !bound_port)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: NULL %s", fn,
                           !host ? "host" : "output");
  if (port < 0 || port > 65535)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: port %d is outside 0..65535", fn,
                           port);
  char q[80];
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_socktype = SOCK_STREAM;
  int g = getaddrinfo(host, NULL, &hints, &res);
  if (g)
    return kiln__dist_fail(err, err_size, KILN_ERR_IO,
                           "%s: rank 0 cannot resolve its own MASTER_ADDR \"%s\": %s", fn,
                           kiln__dist_quote(host, q, sizeof q), gai_strerror(g));
  /* every interface of host's address family (the other ranks may reach this machine by any of
   * its addresses); the next family where this one is not supported (IPv6 turned off) */
  int s = -1, e = EAFNOSUPPORT;
  bool tried4 = false, tried6 = false;
  for (struct addrinfo *ai = res; ai && s < 0; ai = ai->ai_next) {
    bool *tried = ai->ai_family == AF_INET ? &tried4 : ai->ai_family == AF_INET6 ? &tried6 : NULL;
    if (!tried || *tried) continue;
    *tried = true;
    s = listen_on(ai->ai_family, port);
    if (s < 0) e = errno;
    if (s < 0 && e == EADDRINUSE) break;
  }
  freeaddrinfo(res);
  if (s < 0 && e == EADDRINUSE)
    return kiln__dist_fail(err, err_size, KILN_ERR_IO,
                           "%s: rank 0 cannot listen on port %d: it is in use on this machine "
                           "(another job's MASTER_PORT?): give MASTER_PORT a free port",
                           fn, port);
  if (s < 0)
    return kiln__dist_fail(err, err_size, KILN_ERR_IO,
                           "%s: rank 0 cannot listen on port %d (MASTER_ADDR \"%s\"): %s", fn, port,
                           kiln__dist_quote(host, q, sizeof q), strerror(e));
  *bound_port = port_of(s);
  *fd = s;
  return KILN_OK;
}

/* A connection rank 0 holds. */
enum { HELLO, WAIT, SEND, CONFIRM, DONE };
typedef struct conn {
  int fd;    /* -1 once closed */
  int rank;  /* -1 until its hello is read */
  int phase; /* HELLO: reading the hello; WAIT: a known rank waiting for the others; SEND: its
                answer being sent; CONFIRM: reading its ack; DONE: confirmed and closed */
  unsigned char in[HELLO_BYTES];
  size_t nin;
  unsigned char out[HEAD_BYTES + KILN__RDV_BLOB]; /* its answer, the blob */
  size_t nout, sent;
  bool refused; /* told, when the rendezvous ends, that it was refused (server.refusal) */
  char peer[80];
} conn;

typedef struct server {
  int world, port;
  conn *c;   /* (world - 1 + SPARE_SLOTS) */
  int *free; /* the free slots, a stack */
  int nfree;
  int *byrank; /* (world) the slot of each known rank, -1 before it came */
  int known, confirmed, strays, turned_away;
  char why[TEXT_MAX];     /* what ended the rendezvous, for every rank told */
  char refusal[TEXT_MAX]; /* what the refused connections are told */
} server;

/* An answer of kind with payload p (n bytes, at most TEXT_MAX) into out; its size. */
static size_t answer(unsigned char *out, char kind, const void *p, size_t n) {
  memcpy(out, MAGIC, TAG_BYTES);
  put_u32(out + 8, (uint32_t)(unsigned char)kind);
  put_u32(out + 12, (uint32_t)n);
  memcpy(out + HEAD_BYTES, p, n);
  return HEAD_BYTES + n;
}

static void release(server *sv, int slot) {
  conn *c = &sv->c[slot];
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  if (c->rank < 0) sv->free[sv->nfree++] = slot; /* a known rank's slot stays its own */
}

/* "2, 5-7, 9" of the ranks 1 .. world - 1 that want(sv, rank) picks, cut to fit; *count gets how
 * many there are. */
static void rank_list(const server *sv, bool (*want)(const server *, int), char *buf, size_t n,
                      int *count) {
  size_t used = 0;
  bool cut = false;
  *count = 0;
  buf[0] = '\0';
  for (int r = 1; r < sv->world; r++) {
    if (!want(sv, r)) continue;
    int end = r;
    while (end + 1 < sv->world && want(sv, end + 1))
      end++;
    *count += end - r + 1;
    if (!cut) {
      char one[40];
      int k = end == r ? snprintf(one, sizeof one, "%s%d", used ? ", " : "", r)
                       : snprintf(one, sizeof one, "%s%d-%d", used ? ", " : "", r, end);
      if (used + (size_t)k + 8 < n) {
        memcpy(buf + used, one, (size_t)k + 1);
        used += (size_t)k;
      } else {
        memcpy(buf + used, ", ...", 6);
        used += 5;
        cut = true;
      }
    }
    r = end;
  }
}

static bool missing(const server *sv, int r) { return sv->byrank[r] < 0; }
static bool unconfirmed(const server *sv, int r) {
  return sv->byrank[r] >= 0 && sv->c[sv->byrank[r]].phase != DONE;
}

/* Ends the rendezvous with why (formatted), unless it already ended. */
__attribute__((format(printf, 2, 3))) static void end(server *sv, const char *fmt, ...) {
  if (sv->why[0]) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(sv->why, sizeof sv->why, fmt, ap);
  va_end(ap);
}

/* A hello has come in whole on slot: a rank known, a stray dropped, or the end. */
static void hello(server *sv, int slot) {
  conn *c = &sv->c[slot];
  if (memcmp(c->in, MAGIC, TAG_BYTES) != 0) {
    sv->strays++;
    release(sv, slot);
    return;
  }
  uint32_t w = get_u32(c->in + 8), r = get_u32(c->in + 12);
  if (w != (uint32_t)sv->world) {
    c->refused = true;
    snprintf(sv->refusal, sizeof sv->refusal,
             "this rank says WORLD_SIZE %u, rank 0 says %d: every rank must be started with the "
             "same world size",
             w, sv->world);
    end(sv,
        "a process at %s says it is rank %u of WORLD_SIZE %u, but rank 0's WORLD_SIZE is %d: "
        "every rank must be started with the same world size",
        c->peer, r, w, sv->world);
    return;
  }
  if (r == 0) {
    c->refused = true;
    snprintf(sv->refusal, sizeof sv->refusal,
             "this process says it is rank 0, and so does the one listening: two processes were "
             "given RANK 0");
    end(sv, "a process at %s says it is rank 0 too: two processes were given RANK 0", c->peer);
    return;
  }
  if (r >= (uint32_t)sv->world) {
    c->refused = true;
    snprintf(sv->refusal, sizeof sv->refusal,
             "this process says it is rank %u of %d; the ranks are 0..%d", r, sv->world,
             sv->world - 1);
    end(sv, "a process at %s says it is rank %u of %d; the ranks are 0..%d", c->peer, r, sv->world,
        sv->world - 1);
    return;
  }
  int other = sv->byrank[r];
  if (other >= 0) {
    conn *o = &sv->c[other];
    c->refused = o->refused = true;
    snprintf(sv->refusal, sizeof sv->refusal,
             "rank %u came twice, from %s and from %s: two processes were given the same RANK", r,
             o->peer, c->peer);
    end(sv, "%s", sv->refusal);
    return;
  }
  c->rank = (int)r;
  c->phase = WAIT;
  sv->byrank[r] = slot;
  sv->known++;
}

/* Reads what slot's peer sent in its phase. */
static void readable(server *sv, int slot) {
  conn *c = &sv->c[slot];
  size_t want = c->phase == HELLO ? HELLO_BYTES : c->phase == CONFIRM ? TAG_BYTES : 1;
  unsigned char one;
  unsigned char *to = c->phase == WAIT ? &one : c->in + c->nin;
  ssize_t n = recv(c->fd, to, c->phase == WAIT ? 1 : want - c->nin, 0);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) { /* the peer closed the connection or it broke */
    if (c->rank < 0) {
      release(sv, slot); /* not yet a rank: it may come again */
      return;
    }
    end(sv, "rank %d (at %s) went away before %s", c->rank, c->peer,
        c->phase == WAIT ? "every rank had arrived" : "it confirmed the id");
    return;
  }
  if (c->phase == WAIT) {
    end(sv, "rank %d (at %s) sent bytes out of turn: it does not speak kiln's rendezvous", c->rank,
        c->peer);
    return;
  }
  c->nin += (size_t)n;
  if (c->nin < want) return;
  if (c->phase == HELLO) {
    hello(sv, slot);
  } else if (memcmp(c->in, ACK, TAG_BYTES) != 0) {
    end(sv, "rank %d (at %s) confirmed the id with bytes that are not kiln's", c->rank, c->peer);
  } else {
    c->phase = DONE;
    sv->confirmed++;
    close(c->fd);
    c->fd = -1;
  }
}

static void writable(server *sv, int slot) {
  conn *c = &sv->c[slot];
  ssize_t n = send(c->fd, c->out + c->sent, c->nout - c->sent, MSG_NOSIGNAL);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n < 0) {
    end(sv, "rank %d (at %s) went away before it had the id: %s", c->rank, c->peer,
        strerror(errno));
    return;
  }
  c->sent += (size_t)n;
  if (c->sent == c->nout) {
    c->phase = CONFIRM;
    c->nin = 0;
  }
}

/* Takes every connection waiting on the listener. */
static void take(server *sv, int listen_fd) {
  for (;;) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    int fd = accept4(listen_fd, (struct sockaddr *)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EMFILE || errno == ENFILE)
        end(sv,
            "rank 0 ran out of file descriptors with %d ranks connected (it holds one a rank: "
            "raise ulimit -n)",
            sv->known);
      else
        end(sv, "rank 0 could not accept a connection: %s", strerror(errno));
      return;
    }
    if (sv->nfree == 0) { /* full of connections that are not ranks yet: this one comes again */
      sv->turned_away++;
      close(fd);
      continue;
    }
    int slot = sv->free[--sv->nfree];
    conn *c = &sv->c[slot];
    memset(c, 0, sizeof *c);
    c->fd = fd;
    c->rank = -1;
    c->phase = HELLO;
    peer_name((struct sockaddr *)&ss, len, c->peer, sizeof c->peer);
  }
}

kiln_status kiln__rdv_serve(const char *fn, int listen_fd, int world, const void *blob,
                            double timeout_s, char *err, size_t err_size) {
  if (world < 2 || world > KILN_DIST_MAX_WORLD)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: rank 0: world size %d is outside 2..%d", fn, world,
                           KILN_DIST_MAX_WORLD);
  if (listen_fd < 0 || !blob || !timeout_ok(timeout_s))
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: rank 0: bad arguments (socket %d, blob %s, timeout %g s: it must "
                           "be in (0, %g])",
                           fn, listen_fd, blob ? "given" : "NULL", timeout_s, TIMEOUT_MAX);
  int64_t deadline = now_ns() + (int64_t)(timeout_s * 1e9);
  int flags = fcntl(listen_fd, F_GETFL);
  if (flags < 0 || fcntl(listen_fd, F_SETFL, flags | O_NONBLOCK) < 0)
    return kiln__dist_fail(err, err_size, KILN_ERR_IO, "%s: rank 0: socket %d: %s", fn, listen_fd,
                           strerror(errno));
  server sv;
  memset(&sv, 0, sizeof sv);
  sv.world = world;
  sv.port = port_of(listen_fd);
  int nslots = world - 1 + SPARE_SLOTS;
  sv.c = calloc((size_t)nslots, sizeof *sv.c);
  sv.free = calloc((size_t)nslots, sizeof *sv.free);
  sv.byrank = calloc((size_t)world, sizeof *sv.byrank);
  struct pollfd *pfd = calloc((size_t)nslots + 1, sizeof *pfd);
  int *slot_of = calloc((size_t)nslots + 1, sizeof *slot_of);
  if (!sv.c || !sv.free || !sv.byrank || !pfd || !slot_of) {
    free(sv.c);
    free(sv.free);
    free(sv.byrank);
    free(pfd);
    free(slot_of);
    return kiln__dist_fail(err, err_size, KILN_ERR_OOM,
                           "%s: rank 0: out of host memory for %d ranks' connections", fn, world);
  }
  for (int i = 0; i < nslots; i++) {
    sv.c[i].fd = -1;
    sv.c[i].rank = -1;
    sv.free[sv.nfree++] = nslots - 1 - i;
  }
  for (int r = 0; r < world; r++)
    sv.byrank[r] = -1;

  bool answered = false; /* every rank's answer is the blob */
  while (!sv.why[0] && sv.confirmed < world - 1) {
    if (!answered && sv.known == world - 1) {
      for (int r = 1; r < world; r++) {
        conn *c = &sv.c[sv.byrank[r]];
        c->nout = answer(c->out, 'I', blob, KILN__RDV_BLOB);
        c->sent = 0;
        c->phase = SEND;
      }
      answered = true;
    }
    int np = 0;
    if (sv.known < world - 1) {
      pfd[np] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
      slot_of[np++] = -1;
    }
    for (int i = 0; i < nslots; i++) {
      if (sv.c[i].fd < 0) continue;
      pfd[np] =
          (struct pollfd){.fd = sv.c[i].fd, .events = sv.c[i].phase == SEND ? POLLOUT : POLLIN};
      slot_of[np++] = i;
    }
    int ms = ms_left(deadline);
    if (ms == 0) {
      char list[200];
      int count;
      if (sv.known < world - 1) {
        rank_list(&sv, missing, list, sizeof list, &count);
        end(&sv, "rank%s %s (%d of %d) did not arrive within %.1f s at port %d%s",
            count > 1 ? "s" : "", list, count, world, timeout_s, sv.port,
            sv.strays || sv.turned_away ? " (connections that were not kiln ranks came and were "
                                          "dropped: is another program using the port?)"
                                        : "");
      } else {
        rank_list(&sv, unconfirmed, list, sizeof list, &count);
        end(&sv, "rank%s %s (%d of %d) did not confirm the id within %.1f s", count > 1 ? "s" : "",
            list, count, world, timeout_s);
      }
      break;
    }
    int got = poll(pfd, (nfds_t)np, ms);
    if (got < 0) {
      if (errno == EINTR) continue;
      end(&sv, "rank 0's poll failed: %s", strerror(errno));
      break;
    }
    for (int k = 0; k < np && !sv.why[0]; k++) {
      if (!pfd[k].revents) continue;
      int slot = slot_of[k];
      if (slot < 0) {
        take(&sv, listen_fd);
      } else if (sv.c[slot].fd >= 0) {
        if (sv.c[slot].phase == SEND)
          writable(&sv, slot);
        else
          readable(&sv, slot);
      }
    }
  }

  kiln_status s = KILN_OK;
  if (sv.why[0]) {
    /* tell every connected process why (best effort: an answer fits in an empty socket buffer) */
    unsigned char msg[HEAD_BYTES + TEXT_MAX];
    for (int i = 0; i < nslots; i++) {
      conn *c = &sv.c[i];
      if (c->fd < 0) continue;
      const char *text = c->refused ? sv.refusal : sv.why;
      size_t n = answer(msg, c->refused ? 'R' : 'A', text, strlen(text));
      if (send(c->fd, msg, n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
        /* gone already: nothing to tell */
      }
      close_gently(c->fd);
      c->fd = -1;
    }
    s = kiln__dist_fail(err, err_size, KILN_ERR_STATE, "%s: rank 0 of %d: %s", fn, world, sv.why);
  }
  for (int i = 0; i < nslots; i++)
    if (sv.c[i].fd >= 0) close(sv.c[i].fd);
  free(sv.c);
  free(sv.free);
  free(sv.byrank);
  free(pfd);
  free(slot_of);
  return s;
}

/* ---------------------------------------------------------------- the other ranks */

enum { IO_OK, IO_EOF, IO_LATE, IO_ERR };

/* Sends or receives n bytes whole before the deadline; *done gets how many moved. */
static int io_full(int fd, void *p, size_t n, bool sending, int64_t deadline, size_t *done) {
  *done = 0;
  while (*done < n) {
    ssize_t k = sending ? send(fd, (char *)p + *done, n - *done, MSG_NOSIGNAL)
                        : recv(fd, (char *)p + *done, n - *done, 0);
    if (k > 0) {
      *done += (size_t)k;
      continue;
    }
    if (k == 0 && !sending) return IO_EOF;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return IO_ERR;
    int ms = ms_left(deadline);
    if (ms == 0) return IO_LATE;
    struct pollfd pfd = {.fd = fd, .events = sending ? POLLOUT : POLLIN};
    if (poll(&pfd, 1, ms) < 0 && errno != EINTR) return IO_ERR;
  }
  return IO_OK;
}

typedef struct joiner {
  const char *fn, *host;
  int port, rank, world;
  double timeout_s;
  char *err;
  size_t err_size;
} joiner;

#define RETRY ((kiln_status)-1) /* rank 0 closed before answering: connect again */

/* The exchange on a connected socket: hello, answer, ack. */
static kiln_status exchange(const joiner *j, int fd, void *blob, int64_t deadline) {
  unsigned char hello_msg[HELLO_BYTES], head[HEAD_BYTES], body[TEXT_MAX + 1];
  char q[TEXT_MAX + 8], from[320];
  size_t done;
  snprintf(from, sizeof from, "rank 0 at %s:%d", j->host, j->port);
  memcpy(hello_msg, MAGIC, TAG_BYTES);
  put_u32(hello_msg + 8, (uint32_t)j->world);
  put_u32(hello_msg + 12, (uint32_t)j->rank);
  int r = io_full(fd, hello_msg, sizeof hello_msg, true, deadline, &done);
  if (r == IO_LATE)
    return kiln__dist_fail(j->err, j->err_size, KILN_ERR_STATE,
                           "%s: rank %d of %d: %s took no hello within %.1f s", j->fn, j->rank,
                           j->world, from, j->timeout_s);
  if (r != IO_OK) return RETRY;
  r = io_full(fd, head, sizeof head, false, deadline, &done);
  if (r == IO_EOF && done == 0) return RETRY;
  if (r == IO_LATE)
    return kiln__dist_fail(j->err, j->err_size, KILN_ERR_STATE,
                           "%s: rank %d of %d: %s did not answer within %.1f s: it answers when "
                           "all %d ranks have arrived",
                           j->fn, j->rank, j->world, from, j->timeout_s, j->world);
  if (r != IO_OK)
    return kiln__dist_fail(j->err, j->err_size, KILN_ERR_STATE,
                           "%s: rank %d of %d: %s closed the connection in the middle of its "
                           "answer",
                           j->fn, j->rank, j->world, from);
  uint32_t kind = get_u32(head + 8), len = get_u32(head + 12);
  bool known =
      memcmp(head, MAGIC, TAG_BYTES) == 0 &&
      ((kind == 'I' && len == KILN__RDV_BLOB) || ((kind == 'R' || kind == 'A') && len <= TEXT_MAX));
  if (!known)
    return kiln__dist_fail(j->err, j->err_size, KILN_ERR_STATE,
                           "%s: rank %d of %d: the server at %s:%d answered bytes that are not "
                           "kiln's rendezvous: is MASTER_PORT another program's?",
                           j->fn, j->rank, j->world, j->host, j->port);
  r = io_full(fd, body, len, false, deadline, &done);
  if (r != IO_OK)
    return kiln__dist_fail(
        j->err, j->err_size, KILN_ERR_STATE, "%s: rank %d of %d: %s %s in the middle of its answer",
        j->fn, j->rank, j->world, from, r == IO_LATE ? "stopped sending" : "closed the connection");
  if (kind != 'I') {
    body[len] = '\0';
    return kiln__dist_fail(j->err, j->err_size, KILN_ERR_STATE, "%s: rank %d of %d: %s %s: %s",
                           j->fn, j->rank, j->world, from,
                           kind == 'R' ? "refused this rank" : "ended the rendezvous",
                           kiln__dist_quote((const char *)body, q, sizeof q));
  }
  r = io_full(fd, ACK, TAG_BYTES, true, deadline, &done);
  if (r != IO_OK)
    return kiln__dist_fail(j->err, j->err_size, KILN_ERR_STATE,
                           "%s: rank %d of %d: %s went away before this rank confirmed the id",
                           j->fn, j->rank, j->world, from);
  memcpy(blob, body, KILN__RDV_BLOB);
  return KILN_OK;
}

/* Connects to one address before the deadline: the socket, or -1 with why in last. */
static int connect_one(const struct addrinfo *ai, int64_t deadline, char *last, size_t n) {
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(last, n, "%s", strerror(errno));
    return -1;
  }
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return fd;
  if (errno != EINPROGRESS) {
    snprintf(last, n, "%s", strerror(errno));
    close(fd);
    return -1;
  }
  struct pollfd pfd = {.fd = fd, .events = POLLOUT};
  int got;
  do {
    got = poll(&pfd, 1, ms_left(deadline));
  } while (got < 0 && errno == EINTR);
  int e = 0;
  socklen_t len = sizeof e;
  if (got <= 0) {
    snprintf(last, n, "%s", got == 0 ? "the connection did not open in time" : strerror(errno));
    close(fd);
    return -1;
  }
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) < 0) e = errno;
  if (e) {
    snprintf(last, n, "%s", strerror(e));
    close(fd);
    return -1;
  }
  return fd;
}

kiln_status kiln__rdv_join(const char *fn, const char *host, int port, int rank, int world,
                           void *blob, double timeout_s, char *err, size_t err_size) {
  if (world < 2 || world > KILN_DIST_MAX_WORLD || rank < 1 || rank >= world)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: rank %d of %d: a joining rank is 1..world size - 1, with a world "
                           "size of 2..%d",
                           fn, rank, world, KILN_DIST_MAX_WORLD);
  if (!host || !*host || port < 1 || port > 65535 || !blob || !timeout_ok(timeout_s))
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: rank %d of %d: bad arguments (host %s, port %d, blob %s, timeout "
                           "%g s: it must be in (0, %g])",
                           fn, rank, world, host ? "given" : "NULL", port, blob ? "given" : "NULL",
                           timeout_s, TIMEOUT_MAX);
  joiner j = {fn, host, port, rank, world, timeout_s, err, err_size};
  int64_t deadline = now_ns() + (int64_t)(timeout_s * 1e9);
  char last[200] = "no attempt was made", portstr[16], q[80];
  snprintf(portstr, sizeof portstr, "%d", port);
  int pause_ms = 10;
  unsigned char got[KILN__RDV_BLOB];
  for (;;) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    int g = getaddrinfo(host, portstr, &hints, &res);
    if (g && g != EAI_AGAIN)
      return kiln__dist_fail(err, err_size, KILN_ERR_IO,
                             "%s: rank %d of %d: cannot resolve MASTER_ADDR \"%s\": %s", fn, rank,
                             world, kiln__dist_quote(host, q, sizeof q), gai_strerror(g));
    if (g) snprintf(last, sizeof last, "%s", gai_strerror(g));
    for (struct addrinfo *ai = g ? NULL : res; ai && ms_left(deadline) > 0; ai = ai->ai_next) {
      int fd = connect_one(ai, deadline, last, sizeof last);
      if (fd < 0) continue;
      kiln_status s = exchange(&j, fd, got, deadline);
      close_gently(fd);
      if (s == KILN_OK) {
        freeaddrinfo(res);
        memcpy(blob, got, sizeof got);
        return KILN_OK;
      }
      if (s != RETRY) {
        freeaddrinfo(res);
        return s;
      }
      snprintf(last, sizeof last, "rank 0 closed the connection before it answered");
    }
    if (res) freeaddrinfo(res);
    int ms = ms_left(deadline);
    if (ms == 0) break;
    poll(NULL, 0, ms < pause_ms ? ms : pause_ms); /* rank 0 may not listen yet */
    pause_ms = pause_ms * 2 > 500 ? 500 : pause_ms * 2;
  }
  return kiln__dist_fail(err, err_size, KILN_ERR_STATE,
                         "%s: rank %d of %d: could not reach rank 0 at %s:%d within %.1f s (last: "
                         "%s)",
                         fn, rank, world, kiln__dist_quote(host, q, sizeof q), port, timeout_s,
                         last);
}

/* ---------------------------------------------------------------- both */

kiln_status kiln__rdv_run(const char *fn, const kiln_dist_env *env, void *blob, double timeout_s,
                          char *err, size_t err_size) {
  if (!env || !blob)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: NULL %s", fn,
                           env ? "blob" : "env");
  if (env->rank > 0)
    return kiln__rdv_join(fn, env->master_addr, env->master_port, env->rank, env->world_size, blob,
                          timeout_s, err, err_size);
  int fd, port;
  kiln_status s =
      kiln__rdv_listen(fn, env->master_addr, env->master_port, &fd, &port, err, err_size);
  if (s) return s;
  s = kiln__rdv_serve(fn, fd, env->world_size, blob, timeout_s, err, err_size);
  close(fd);
  return s;
}
