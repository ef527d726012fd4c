/*
 * dist.c: kiln_dist_init and its handle. It reads who this process is (env.c), loads NCCL where
 * the world needs it (nccl.c), has rank 0 make NCCL's unique id and hands it to every rank over
 * the rendezvous (rendezvous.c). The handle keeps its own sticky error, as a context does, since
 * it exists before any context; a failed one holds nothing. The communicator on the context's
 * device is for runtime/ to make from kiln__dist_nccl and kiln__dist_id.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"

#define DEFAULT_TIMEOUT_S 300.0
#define TIMEOUT_MAX_S 1e7

struct kiln_dist {
  kiln_status status;
  char error[1024];
  kiln_dist_env env;
  kiln__nccl nccl;  /* lib NULL: none loaded */
  kiln__nccl_id id; /* rank 0's, on every rank (zeros without NCCL) */
};

kiln_status kiln__dist_fail(char *err, size_t err_size, kiln_status s, const char *fmt, ...) {
  if (err && err_size) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
  }
  return s;
}

const char *kiln__dist_quote(const char *s, char *buf, size_t n) {
  if (!n) return buf;
  if (!s) {
    snprintf(buf, n, "(unset)");
    return buf;
  }
  size_t len = strlen(s), k = 0;
  bool cut = len >= n;
  size_t keep = cut ? (n > 4 ? n - 4 : 0) : len;
  for (; k < keep; k++) {
    unsigned char c = (unsigned char)s[k];
    buf[k] = c >= ' ' && c <= '~' ? (char)c : '?';
  }
  if (cut && n > 4) {
    memcpy(buf + k, "...", 3);
    k += 3;
  }
  buf[k < n ? k : n - 1] = '\0';
  return buf;
}

static const char *from_environ(void *user, const char *name) {
  (void)user;
  return getenv(name);
}

/* The rendezvous's deadline in seconds: the option, else $KILN_DIST_TIMEOUT, else 300. */
static kiln_status timeout_of(const char *fn, double opt, double *out, char *err, size_t n) {
  char q[64];
  if (opt != 0) {
    if (!(opt > 0 && opt <= TIMEOUT_MAX_S))
      return kiln__dist_fail(err, n, KILN_ERR_INVALID,
                             "%s: timeout_s %g is not a number of seconds in (0, %g]", fn, opt,
                             TIMEOUT_MAX_S);
    *out = opt;
    return KILN_OK;
  }
  const char *v = getenv("KILN_DIST_TIMEOUT");
  if (!v) {
    *out = DEFAULT_TIMEOUT_S;
    return KILN_OK;
  }
  char *endp = NULL;
  double t = strtod(v, &endp);
  if (!*v || *endp || !(t > 0 && t <= TIMEOUT_MAX_S))
    return kiln__dist_fail(err, n, KILN_ERR_INVALID,
                           "%s: KILN_DIST_TIMEOUT=\"%s\" is not a number of seconds in (0, %g]", fn,
                           kiln__dist_quote(v, q, sizeof q), TIMEOUT_MAX_S);
  *out = t;
  return KILN_OK;
}

/* Everything kiln_dist_init does, into d; on failure the message is in d->error and the caller
 * drops what d holds. */
static kiln_status join(kiln_dist *d, const kiln_dist_options *o) {
  static const char fn[] = "kiln_dist_init";
  char *err = d->error;
  size_t n = sizeof d->error;
  kiln_status s;
  kiln_dist_env env;
  if ((s = o->env ? kiln__dist_env_check(fn, o->env, &env, err, n)
                  : kiln__dist_env_parse(fn, from_environ, NULL, &env, err, n)))
    return s;
  double timeout_s = DEFAULT_TIMEOUT_S;
  if ((s = timeout_of(fn, o->timeout_s, &timeout_s, err, n))) return s;
  if (o->nccl != 0 && o->nccl != 1)
    return kiln__dist_fail(err, n, KILN_ERR_INVALID,
                           "%s: options.nccl %d is neither 0 (NCCL beyond one process) nor 1 "
                           "(NCCL always)",
                           fn, o->nccl);
  char who[96];
  snprintf(who, sizeof who, "%s: rank %d of %d", fn, env.rank, env.world_size);
  if (env.world_size > 1 || o->nccl == 1) {
    char need[160];
    snprintf(need, sizeof need, "%s needs NCCL%s", who,
             env.world_size > 1 ? "" : " (options.nccl = 1)");
    if ((s = kiln__nccl_load(need, o->nccl_library, &d->nccl, err, n))) return s;
    if (env.rank == 0) {
      int r = d->nccl.get_unique_id(&d->id);
      if (r != KILN__NCCL_SUCCESS) {
        char words[200], last[200];
        const char *more = d->nccl.get_last_error ? d->nccl.get_last_error(NULL) : NULL;
        return kiln__dist_fail(err, n, KILN_ERR_STATE, "%s: ncclGetUniqueId failed: %s%s%s", who,
                               kiln__nccl_result_string(&d->nccl, r, words, sizeof words),
                               more && *more ? ": " : "",
                               more && *more ? kiln__dist_quote(more, last, sizeof last) : "");
      }
    }
  }
  if (env.world_size > 1 && (s = kiln__rdv_run(fn, &env, &d->id, timeout_s, err, n))) return s;
  d->env = env;
  return KILN_OK;
}

kiln_dist *kiln_dist_init(const kiln_dist_options *opts) {
  kiln_dist *d = calloc(1, sizeof *d);
  if (!d) return NULL;
  kiln_dist_options o;
  memset(&o, 0, sizeof o);
  if (opts) o = *opts;
  kiln_status s = join(d, &o);
  if (s != KILN_OK) {
    kiln__nccl_unload(&d->nccl);
    memset(&d->id, 0, sizeof d->id);
    d->status = s;
  }
  return d;
}

kiln_status kiln_dist_status(const kiln_dist *d) { return d ? d->status : KILN_ERR_INVALID; }

const char *kiln_dist_error(const kiln_dist *d) {
  if (!d) return "kiln_dist_error: NULL handle";
  return d->status == KILN_OK ? NULL : d->error;
}

static bool good(const kiln_dist *d) { return d && d->status == KILN_OK; }
int kiln_dist_rank(const kiln_dist *d) { return good(d) ? d->env.rank : -1; }
int kiln_dist_world_size(const kiln_dist *d) { return good(d) ? d->env.world_size : -1; }
int kiln_dist_local_rank(const kiln_dist *d) { return good(d) ? d->env.local_rank : -1; }
int kiln_dist_nccl_version(const kiln_dist *d) { return good(d) ? d->nccl.version : 0; }

const kiln__nccl *kiln__dist_nccl(const kiln_dist *d) { return good(d) ? &d->nccl : NULL; }
const kiln__nccl_id *kiln__dist_id(const kiln_dist *d) { return good(d) ? &d->id : NULL; }

void kiln_dist_free(kiln_dist *d) {
  if (!d) return;
  kiln__nccl_unload(&d->nccl);
  free(d);
}
