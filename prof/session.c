/*
 * session.c: a trace being recorded (prof.h): the launch regions the host opened, the groups
 * and step graphs kiln described, and the records CUPTI delivered, kept for the last
 * KILN_TRACE_STEPS steps and resolved at the end into timeline events (timeline.h). It calls
 * CUPTI only through kiln__prof_api, so that the tests drive it with records of their own.
 *
 * Every launch region has a serial, pushed as its external correlation id. CUPTI reports, for
 * each CUDA call made inside a region, an external correlation record pairing the serial with
 * the call's correlation id; a kernel, copy or memset carries the correlation id of the call
 * that launched it, so two lookups give its region: the step, the mode and the group (an eager
 * launch) or the step graph (a replay, one call for all the graph's kernels).
 *
 * The records are bounded: when they outgrow twice what the last compaction kept, those of steps
 * outside the window go, with the regions and correlations that only they used. A record whose
 * region is not known (made on another thread, say) is kept until records after it go, and at
 * the end takes the step of the records around it in time.
 *
 * The host (hooks) and CUPTI's thread (ingest) both write here: one mutex, never held while
 * CUPTI is called (CUPTI may deliver a buffer, and so call ingest, from inside its calls).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "prof.h"

#define DEFAULT_KEEP 100
#define MIN_COMPACT 65536 /* records before the first compaction */

/* ---------------------------------------------------------------- small tables */

/* Strings, each kept once (malloc'd), found by hash. */
typedef struct strtab {
  char **slot;
  size_t cap, n;
} strtab;

/* uint64 -> uint64, open addressing; keys are stored plus one (0 is an empty slot). */
typedef struct u64map {
  uint64_t *key, *val;
  size_t cap, n;
} u64map;

static bool map_grow(u64map *m) {
  size_t cap = m->cap ? m->cap * 2 : 1024;
  uint64_t *k = calloc(cap, sizeof *k), *v = calloc(cap, sizeof *v);
  if (!k || !v) {
    free(k);
    free(v);
    return false;
  }
  for (size_t i = 0; i < m->cap; i++) {
    if (!m->key[i]) continue;
    size_t j = kiln__hash(&m->key[i], sizeof m->key[i], 0) & (cap - 1);
    while (k[j])
      j = (j + 1) & (cap - 1);
    k[j] = m->key[i];
    v[j] = m->val[i];
  }
  free(m->key);
  free(m->val);
  m->key = k;
  m->val = v;
  m->cap = cap;
  return true;
}

static bool map_put(u64map *m, uint64_t key, uint64_t val) {
  if (2 * (m->n + 1) > m->cap && !map_grow(m)) return false;
  uint64_t k = key + 1;
  size_t j = kiln__hash(&k, sizeof k, 0) & (m->cap - 1);
  while (m->key[j] && m->key[j] != k)
    j = (j + 1) & (m->cap - 1);
  if (!m->key[j]) m->n++;
  m->key[j] = k;
  m->val[j] = val;
  return true;
}

static bool map_get(const u64map *m, uint64_t key, uint64_t *val) {
  if (!m->cap) return false;
  uint64_t k = key + 1;
  size_t j = kiln__hash(&k, sizeof k, 0) & (m->cap - 1);
  for (; m->key[j]; j = (j + 1) & (m->cap - 1))
    if (m->key[j] == k) {
      *val = m->val[j];
      return true;
    }
  return false;
}

static void map_free(u64map *m) {
  free(m->key);
  free(m->val);
  memset(m, 0, sizeof *m);
}

/* The kept copy of s (NULL for NULL, or out of host memory). */
static const char *intern(strtab *t, const char *s) {
  if (!s) return NULL;
  if (2 * (t->n + 1) > t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 256;
    char **slot = calloc(cap, sizeof *slot);
    if (!slot) return NULL;
    for (size_t i = 0; i < t->cap; i++) {
      if (!t->slot[i]) continue;
      size_t j = kiln__hash(t->slot[i], strlen(t->slot[i]), 0) & (cap - 1);
      while (slot[j])
        j = (j + 1) & (cap - 1);
      slot[j] = t->slot[i];
    }
    free(t->slot);
    t->slot = slot;
    t->cap = cap;
  }
  size_t j = kiln__hash(s, strlen(s), 0) & (t->cap - 1);
  for (; t->slot[j]; j = (j + 1) & (t->cap - 1))
    if (strcmp(t->slot[j], s) == 0) return t->slot[j];
  char *c = kiln__strf("%s", s);
  if (!c) return NULL;
  t->slot[j] = c;
  t->n++;
  return c;
}

static void strtab_free(strtab *t) {
  for (size_t i = 0; i < t->cap; i++)
    free(t->slot[i]);
  free(t->slot);
  memset(t, 0, sizeof *t);
}

/* ---------------------------------------------------------------- the session */

typedef struct launch {
  int64_t step;
  uint32_t id; /* a group (EAGER, FIRST_RUN) or a program (REPLAY) */
  kiln__prof_how how;
  const char *mode;
} launch;

typedef struct program {
  int n;
  uint32_t *groups;
  int32_t *records;
} program;

struct kiln__prof {
  pthread_mutex_t lock;
  const kiln__prof_api *api;
  uint64_t serial;
  bool range; /* keep steps [first, last]; else the last `keep` steps */
  int64_t first, last, keep;
  char keep_text[64];
  int64_t step; /* the current step, and mode */
  const char *mode;
  strtab strs;
  kiln__tl_group *groups;
  int ngroups, capgroups;
  u64map group_of_key;
  program *programs;
  int nprograms, capprograms;
  /* launch regions: serial s is launches[s - launch_base]; serial 0 is pushed for launches
   * outside a range of steps (their records are dropped) */
  launch *launches;
  size_t nlaunch, caplaunch;
  uint64_t launch_base, next_serial;
  uint64_t base; /* the step's region, pushed (0: none) */
  kiln__prof_rec *recs;
  size_t nrecs, caprecs, next_compact;
  u64map ext_of_corr; /* CUPTI correlation id -> serial */
  uint64_t t_drop;    /* records of unknown region that started before this are old */
  uint64_t dropped;
  kiln__tl_event *ev; /* the result */
  size_t nev;
};

/* Sessions' serials, unique in the process (a step graph outlives a trace and may meet the next
 * one): the one counter of the process, under its lock. */
static uint64_t next_session = 1;
static pthread_mutex_t session_lock = PTHREAD_MUTEX_INITIALIZER;

kiln__prof *kiln__prof_new(const kiln__prof_api *api, const char *keep, char *why, size_t n) {
  kiln__prof *p = calloc(1, sizeof *p);
  if (!p) {
    snprintf(why, n, "out of host memory");
    return NULL;
  }
  p->api = api;
  p->keep = DEFAULT_KEEP;
  p->step = -1;
  p->next_serial = 1;
  p->launch_base = 1;
  p->next_compact = MIN_COMPACT;
  if (keep && *keep) {
    char *end;
    long long a = strtoll(keep, &end, 10), b = a;
    bool ok = end != keep && a >= 0;
    if (ok && *end == '-') {
      const char *q = end + 1;
      b = strtoll(q, &end, 10);
      ok = end != q && b >= a;
      p->range = true;
    }
    if (!ok || *end || (!p->range && a < 1)) {
      snprintf(why, n,
               "KILN_TRACE_STEPS=%s: give a count of steps to keep (the last 100: \"100\") or a "
               "range of steps (\"10-20\")",
               keep);
      free(p);
      return NULL;
    }
    p->first = a;
    p->last = b;
    p->keep = p->range ? 0 : a;
  }
  if (p->range)
    snprintf(p->keep_text, sizeof p->keep_text, "steps %" PRId64 "-%" PRId64, p->first, p->last);
  else
    snprintf(p->keep_text, sizeof p->keep_text, "the last %" PRId64 " steps", p->keep);
  pthread_mutex_init(&p->lock, NULL);
  pthread_mutex_lock(&session_lock);
  p->serial = next_session++;
  pthread_mutex_unlock(&session_lock);
  return p;
}

void kiln__prof_free(kiln__prof *p) {
  if (!p) return;
  for (int i = 0; i < p->nprograms; i++) {
    free(p->programs[i].groups);
    free(p->programs[i].records);
  }
  free(p->programs);
  free(p->groups);
  map_free(&p->group_of_key);
  map_free(&p->ext_of_corr);
  free(p->launches);
  free(p->recs);
  free(p->ev);
  strtab_free(&p->strs);
  pthread_mutex_destroy(&p->lock);
  free(p);
}

uint64_t kiln__prof_serial(const kiln__prof *p) { return p->serial; }

uint32_t kiln__prof_group_find(kiln__prof *p, uint64_t key) {
  uint64_t id;
  pthread_mutex_lock(&p->lock);
  bool found = map_get(&p->group_of_key, key, &id);
  pthread_mutex_unlock(&p->lock);
  return found ? (uint32_t)id : KILN__PROF_NONE;
}

uint32_t kiln__prof_group_add(kiln__prof *p, uint64_t key, const kiln__tl_group *g) {
  uint32_t id = KILN__PROF_NONE;
  pthread_mutex_lock(&p->lock);
  if (KILN__GROW(p->groups, p->capgroups, p->ngroups + 1)) {
    kiln__tl_group c = *g;
    c.name = intern(&p->strs, g->name);
    c.kind = intern(&p->strs, g->kind);
    c.nodes = intern(&p->strs, g->nodes ? g->nodes : "");
    if (c.name && c.kind && c.nodes && map_put(&p->group_of_key, key, (uint64_t)p->ngroups)) {
      id = (uint32_t)p->ngroups;
      p->groups[p->ngroups++] = c;
    }
  }
  pthread_mutex_unlock(&p->lock);
  return id;
}

uint32_t kiln__prof_program(kiln__prof *p, int n, const uint32_t *groups, const int32_t *records) {
  uint32_t id = KILN__PROF_NONE;
  pthread_mutex_lock(&p->lock);
  if (KILN__GROW(p->programs, p->capprograms, p->nprograms + 1)) {
    program *g = &p->programs[p->nprograms];
    g->n = n;
    g->groups = malloc((size_t)(n ? n : 1) * sizeof *g->groups);
    g->records = malloc((size_t)(n ? n : 1) * sizeof *g->records);
    if (g->groups && g->records) {
      memcpy(g->groups, groups, (size_t)n * sizeof *groups);
      memcpy(g->records, records, (size_t)n * sizeof *records);
      id = (uint32_t)p->nprograms++;
    } else {
      free(g->groups);
      free(g->records);
    }
  }
  pthread_mutex_unlock(&p->lock);
  return id;
}

/* The steps kept: [*lo, *hi]. */
static void window(const kiln__prof *p, int64_t *lo, int64_t *hi) {
  if (p->range) {
    *lo = p->first;
    *hi = p->last;
  } else {
    *lo = p->step - p->keep + 1;
    *hi = INT64_MAX;
  }
}

/* A new region's serial (0 for a launch outside the range kept, or out of host memory). */
static uint64_t new_region(kiln__prof *p, kiln__prof_how how, uint32_t id, int64_t step,
                           const char *mode) {
  if (p->range && (step < p->first || step > p->last)) return 0;
  if (p->nlaunch == p->caplaunch) {
    size_t cap = p->caplaunch ? 2 * p->caplaunch : 4096;
    launch *l = realloc(p->launches, cap * sizeof *l);
    if (!l) return 0;
    p->launches = l;
    p->caplaunch = cap;
  }
  p->launches[p->nlaunch++] = (launch){.step = step, .id = id, .how = how, .mode = mode};
  return p->next_serial++;
}

void kiln__prof_enter(kiln__prof *p, kiln__prof_how how, uint32_t id, int64_t step,
                      const char *mode) {
  pthread_mutex_lock(&p->lock);
  uint64_t s = id == KILN__PROF_NONE ? 0 : new_region(p, how, id, step, intern(&p->strs, mode));
  pthread_mutex_unlock(&p->lock);
  p->api->push(s);
}

void kiln__prof_leave(kiln__prof *p) { p->api->pop(); }

void kiln__prof_step(kiln__prof *p, int64_t step, const char *mode) {
  pthread_mutex_lock(&p->lock);
  p->step = step;
  p->mode = intern(&p->strs, mode);
  uint64_t s = new_region(p, KILN__PROF_STEP, 0, step, p->mode);
  pthread_mutex_unlock(&p->lock);
  if (p->base) p->api->pop();
  p->api->push(s);
  p->base = s ? s : UINT64_MAX; /* pushed, even when it is 0 */
}

void kiln__prof_stop(kiln__prof *p) {
  if (p->base) p->api->pop();
  p->base = 0;
}

void kiln__prof_dropped(kiln__prof *p, uint64_t n) {
  pthread_mutex_lock(&p->lock);
  p->dropped += n;
  pthread_mutex_unlock(&p->lock);
}

/* ---------------------------------------------------------------- records */

/* The region a record was launched in: 1 and *l when known, 0 when CUPTI tied it to no region
 * of this session, -1 when it was launched outside the range of steps kept (serial 0). */
static int region_of(const kiln__prof *p, const kiln__prof_rec *r, const launch **l) {
  uint64_t s;
  bool found = map_get(&p->ext_of_corr, r->correlation, &s);
  if (!found && r->runtime_correlation)
    found = map_get(&p->ext_of_corr, r->runtime_correlation, &s);
  *l = NULL;
  if (!found) return 0;
  if (s == 0) return -1;
  if (s < p->launch_base || s - p->launch_base >= p->nlaunch) return 0; /* pruned */
  *l = &p->launches[s - p->launch_base];
  return 1;
}

/* Drops the records, regions and correlations of steps outside the window. */
static void compact(kiln__prof *p) {
  int64_t lo, hi;
  window(p, &lo, &hi);
  const launch *l;
  uint64_t t_drop = p->t_drop;
  for (size_t i = 0; i < p->nrecs; i++) {
    int k = region_of(p, &p->recs[i], &l);
    if ((k < 0 || (k > 0 && (l->step < lo || l->step > hi))) && p->recs[i].end > t_drop)
      t_drop = p->recs[i].end;
  }
  size_t out = 0;
  for (size_t i = 0; i < p->nrecs; i++) {
    int k = region_of(p, &p->recs[i], &l);
    bool keep = k > 0 ? l->step >= lo && l->step <= hi : k == 0 && p->recs[i].start >= p->t_drop;
    if (keep) p->recs[out++] = p->recs[i];
  }
  p->nrecs = out;
  p->t_drop = t_drop;
  /* regions of old steps, from the front (their steps only grow) */
  size_t front = 0;
  while (front < p->nlaunch && p->launches[front].step < lo)
    front++;
  if (front) {
    memmove(p->launches, p->launches + front, (p->nlaunch - front) * sizeof *p->launches);
    p->nlaunch -= front;
    p->launch_base += front;
  }
  /* correlations of pruned regions */
  u64map keep = {0};
  bool ok = true;
  for (size_t i = 0; i < p->ext_of_corr.cap && ok; i++) {
    uint64_t s = p->ext_of_corr.val[i];
    if (p->ext_of_corr.key[i] && s >= p->launch_base)
      ok = map_put(&keep, p->ext_of_corr.key[i] - 1, s);
  }
  if (ok) {
    map_free(&p->ext_of_corr);
    p->ext_of_corr = keep;
  } else {
    map_free(&keep);
  }
  p->next_compact = 2 * p->nrecs > MIN_COMPACT ? 2 * p->nrecs : MIN_COMPACT;
}

static bool grow_recs(kiln__prof *p) {
  size_t cap = p->caprecs ? 2 * p->caprecs : 4096;
  kiln__prof_rec *r = realloc(p->recs, cap * sizeof *r);
  if (!r) return false;
  p->recs = r;
  p->caprecs = cap;
  return true;
}

void kiln__prof_ingest(kiln__prof *p, const kiln__prof_rec *r) {
  pthread_mutex_lock(&p->lock);
  if (r->kind == KILN__PROF_EXTERNAL) {
    map_put(&p->ext_of_corr, r->correlation, r->external);
  } else if (p->nrecs < p->caprecs || grow_recs(p)) {
    kiln__prof_rec c = *r;
    c.name = intern(&p->strs, r->name);
    p->recs[p->nrecs++] = c;
  } else {
    p->dropped++;
  }
  if (p->nrecs > p->next_compact) compact(p);
  pthread_mutex_unlock(&p->lock);
}

size_t kiln__prof_kept(kiln__prof *p) {
  pthread_mutex_lock(&p->lock);
  size_t n = p->nrecs;
  pthread_mutex_unlock(&p->lock);
  return n;
}

/* ---------------------------------------------------------------- names */

void kiln__prof_short_name(const char *name, char *buf, size_t n) {
  snprintf(buf, n, "%s", name ? name : "?");
  if (!name || strncmp(name, "_Z", 2) != 0) return;
  /* _Z [N] (<length><identifier>)+ ... : the identifiers joined by "::" */
  const char *s = name + 2;
  bool nested = *s == 'N';
  s += nested;
  size_t k = 0;
  buf[0] = 0;
  while (*s >= '1' && *s <= '9') {
    char *end;
    unsigned long len = strtoul(s, &end, 10);
    if (strlen(end) < len) break;
    int w = snprintf(buf + k, n > k ? n - k : 0, "%s%.*s", k ? "::" : "", (int)len, end);
    k += (size_t)(w > 0 ? w : 0);
    s = end + len;
    if (!nested || k >= n) break;
  }
  if (k == 0 || k >= n) snprintf(buf, n, "%s", name);
}

/* ---------------------------------------------------------------- resolving */

/* A record while it is resolved. */
typedef struct item {
  size_t rec;
  uint64_t start, graph_node; /* the record's, for sorting */
  const launch *l;
  uint64_t serial;
  int64_t step;
  uint32_t group; /* KILN__PROF_NONE: none */
  int part, parts;
  bool carrier; /* its group's first kernel (its first record if none is): carries the traffic */
  double group_ns;
  const char *mismatch;
} item;

/* In order on a stream: by start, then (a graph's nodes starting together) by node. */
static int by_start(const void *a, const void *b) {
  const item *x = a, *y = b;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  if (x->graph_node != y->graph_node) return x->graph_node < y->graph_node ? -1 : 1;
  return (x->rec > y->rec) - (x->rec < y->rec);
}

static int by_region(const void *a, const void *b) {
  const item *x = a, *y = b;
  if (x->serial != y->serial) return x->serial < y->serial ? -1 : 1;
  return by_start(a, b);
}

static int ev_by_start(const void *a, const void *b) {
  const kiln__tl_event *x = a, *y = b;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  return (x->end < y->end) - (x->end > y->end);
}

static bool is_device(const kiln__prof_rec *r) {
  return r->kind == KILN__PROF_KERNEL || r->kind == KILN__PROF_MEMCPY ||
         r->kind == KILN__PROF_MEMSET;
}

static double dur(const kiln__prof_rec *r) {
  return r->end > r->start ? (double)(r->end - r->start) : 0;
}

/* A replay's records it[0 .. m), in order on the stream, to the groups of its program by the
 * capture's counts: false (it untouched) when the counts do not add up to m or a generated
 * kernel's place (its group's last record: a memset it zeroes with comes first, and may run as a
 * kernel of the driver's) holds no kernel. A step graph is captured from one stream, a chain that
 * every replay runs in the capture's order, so the place decides and the name only checks it:
 * CUPTI has been seen naming replayed kernels after others once loaded at the same address in
 * the process (H100, 2026-12-05: air's moments kernels after a kernel of the mlp's context, freed
 * before; on an H200 the same day, five records a step of air's graph mode, whose names were not
 * kept). A record whose name is not its group's says so. */
static bool by_count(kiln__prof *p, const program *g, item *it, size_t m) {
  size_t expect = 0;
  for (int k = 0; k < g->n; k++) {
    if (g->records[k] < 0) return false;
    expect += (size_t)g->records[k];
  }
  if (expect != m) return false;
  for (int k = 0, j = 0; k < g->n; j += g->records[k++]) {
    if (g->groups[k] >= (uint32_t)p->ngroups || g->records[k] == 0) continue;
    const kiln__tl_group *gr = &p->groups[g->groups[k]];
    const kiln__prof_rec *r = &p->recs[it[j + g->records[k] - 1].rec];
    if (strcmp(gr->kind, "gemm") != 0 && (r->kind != KILN__PROF_KERNEL || !r->name)) return false;
  }
  size_t j = 0;
  for (int k = 0; k < g->n; k++)
    for (int q = 0; q < g->records[k]; q++, j++) {
      it[j].group = g->groups[k];
      it[j].part = q + 1;
      it[j].parts = g->records[k];
      const kiln__tl_group *gr =
          g->groups[k] < (uint32_t)p->ngroups ? &p->groups[g->groups[k]] : NULL;
      const char *name = p->recs[it[j].rec].name;
      if (!gr || q + 1 < g->records[k] || strcmp(gr->kind, "gemm") == 0 ||
          strcmp(name, gr->name) == 0)
        continue;
      char why[400];
      snprintf(why, sizeof why,
               "CUPTI names this kernel %.120s where the capture put %.120s: the place decides",
               name, gr->name);
      it[j].mismatch = intern(&p->strs, why);
    }
  return true;
}

/* The same by name: each generated kernel is the next record of its name, with the copies and
 * memsets its capture counted right before it; the records between two generated kernels
 * belong to the one library call between them, if there is exactly one (else to none). */
static void by_name(kiln__prof *p, const program *g, item *it, size_t m) {
  int64_t expect = 0;
  for (int k = 0; k < g->n && expect >= 0; k++)
    expect = g->records[k] < 0 ? -1 : expect + g->records[k];
  char why[200];
  if (expect < 0)
    snprintf(why, sizeof why,
             "the capture did not count its nodes: the replay's %zu device records were matched "
             "by kernel name",
             m);
  else if (expect != (int64_t)m)
    snprintf(why, sizeof why,
             "the replay has %zu device records where its capture counted %" PRId64
             ": they were matched by kernel name",
             m, expect);
  else
    snprintf(why, sizeof why,
             "a generated kernel's place in the replay holds a copy or a memset: the records "
             "were matched by kernel name");
  const char *mismatch = intern(&p->strs, why);
  size_t cur = 0;
  int pending = -1, npending = 0;
  for (int k = 0; k <= g->n; k++) {
    /* a library call's group (or one kiln could not describe) waits for the next generated
     * kernel: the records before it are its */
    bool known = k < g->n && g->groups[k] < (uint32_t)p->ngroups;
    const kiln__tl_group *gr = known ? &p->groups[g->groups[k]] : NULL;
    if (k < g->n && (!known || strcmp(gr->kind, "gemm") == 0)) {
      pending = k;
      npending++;
      continue;
    }
    size_t j = gr ? cur : m; /* past the last group: the records left */
    while (gr && j < m &&
           !(p->recs[it[j].rec].name && strcmp(p->recs[it[j].rec].name, gr->name) == 0))
      j++;
    if (gr && j == m) continue; /* not found: this group stays unmatched */
    size_t from = j;
    for (int extra = gr && g->records[k] > 1 ? g->records[k] - 1 : 0;
         extra > 0 && from > cur && p->recs[it[from - 1].rec].kind != KILN__PROF_KERNEL; extra--)
      from--;
    if (npending == 1)
      for (size_t q = cur; q < from; q++) {
        it[q].group = g->groups[pending];
        it[q].part = (int)(q - cur) + 1;
        it[q].parts = (int)(from - cur);
      }
    if (gr) {
      for (size_t q = from; q <= j; q++) {
        it[q].group = g->groups[k];
        it[q].part = (int)(q - from) + 1;
        it[q].parts = (int)(j - from) + 1;
      }
      cur = j + 1;
    }
    pending = -1;
    npending = 0;
  }
  for (size_t j = 0; j < m; j++)
    it[j].mismatch = mismatch;
}

bool kiln__prof_events(kiln__prof *p, const kiln__tl_event **out, size_t *nout,
                       kiln__tl_meta *meta) {
  pthread_mutex_lock(&p->lock);
  free(p->ev);
  p->ev = NULL;
  p->nev = 0;
  int64_t lo, hi;
  window(p, &lo, &hi);
  item *it = calloc(p->nrecs ? p->nrecs : 1, sizeof *it);
  bool ok = it != NULL;
  size_t n = 0;
  for (size_t i = 0; ok && i < p->nrecs; i++) {
    const launch *l;
    int k = region_of(p, &p->recs[i], &l);
    if (k < 0) continue; /* outside the range of steps */
    it[n++] = (item){.rec = i,
                     .start = p->recs[i].start,
                     .graph_node = p->recs[i].graph_node,
                     .l = l,
                     .serial = l ? (uint64_t)(l - p->launches) + p->launch_base : 0,
                     .step = l ? l->step : INT64_MIN,
                     .group = KILN__PROF_NONE};
  }
  /* records of no known region (another thread's, say) take the step of the records before
   * them in time (or after, for the first ones), if they fall within the time of the steps kept
   * (a range's ends at its last record) */
  qsort(it, n, sizeof *it, by_start);
  uint64_t t_lo = UINT64_MAX, t_hi = 0;
  for (size_t i = 0; i < n; i++)
    if (it[i].l && it[i].step >= lo && it[i].step <= hi) {
      if (it[i].start < t_lo) t_lo = it[i].start;
      if (p->recs[it[i].rec].end > t_hi) t_hi = p->recs[it[i].rec].end;
    }
  if (!p->range) t_hi = UINT64_MAX;
  int64_t last = INT64_MIN;
  for (size_t i = 0; i < n; i++)
    if (it[i].step != INT64_MIN)
      last = it[i].step;
    else if (it[i].start < t_lo || it[i].start > t_hi)
      it[i].step = lo - 1; /* outside: dropped below */
    else
      it[i].step = last;
  last = INT64_MIN;
  for (size_t i = n; i-- > 0;)
    if (it[i].step == INT64_MIN)
      it[i].step = last == INT64_MIN ? -1 : last;
    else if (it[i].l)
      last = it[i].step;
  /* a launch's device records, together: its group (eager) or its program's groups (replay) */
  qsort(it, n, sizeof *it, by_region);
  for (size_t i = 0; ok && i < n;) {
    size_t j = i, m = 0;
    while (j < n && it[j].serial == it[i].serial)
      j++;
    item *dev = it + i;
    for (size_t q = i; q < j; q++) /* the device records first, API calls after */
      if (is_device(&p->recs[it[q].rec])) {
        item t = it[q];
        it[q] = dev[m];
        dev[m++] = t;
      }
    qsort(dev, m, sizeof *dev, by_start);
    const launch *l = it[i].l;
    if (l && l->how == KILN__PROF_REPLAY && l->id < (uint32_t)p->nprograms) {
      if (!by_count(p, &p->programs[l->id], dev, m)) by_name(p, &p->programs[l->id], dev, m);
    } else if (l && (l->how == KILN__PROF_EAGER || l->how == KILN__PROF_FIRST_RUN)) {
      for (size_t q = 0; q < m; q++) {
        dev[q].group = l->id;
        dev[q].part = (int)q + 1;
        dev[q].parts = (int)m;
      }
    }
    /* the device time of each group's records, for its rates, and the record that carries its
     * traffic: the kernel named as the group (a generated kernel comes after the memsets its
     * launch makes, which the driver may run as kernels of its own), else its first kernel (a
     * library call's), else its first record */
    for (size_t q = 0; q < m; q++) {
      if (dev[q].group == KILN__PROF_NONE || dev[q].part != 1) continue;
      const char *gname = dev[q].group < (uint32_t)p->ngroups ? p->groups[dev[q].group].name : NULL;
      double t = 0;
      size_t named = m, kernel = m;
      for (size_t r = q; r < m && r < q + (size_t)dev[q].parts; r++)
        if (dev[r].group == dev[q].group) {
          const kiln__prof_rec *rec = &p->recs[dev[r].rec];
          t += dur(rec);
          if (rec->kind != KILN__PROF_KERNEL) continue;
          if (kernel == m) kernel = r;
          if (named == m && gname && rec->name && strcmp(rec->name, gname) == 0) named = r;
        }
      for (size_t r = q; r < m && r < q + (size_t)dev[q].parts; r++)
        if (dev[r].group == dev[q].group) dev[r].group_ns = t;
      dev[named < m ? named : kernel < m ? kernel : q].carrier = true;
    }
    i = j;
  }
  /* the events, in the window */
  kiln__tl_event *ev = ok ? calloc(n ? n : 1, sizeof *ev) : NULL;
  ok = ev != NULL;
  uint64_t unattributed = 0;
  int64_t first = INT64_MAX, lastk = INT64_MIN;
  size_t ne = 0;
  for (size_t i = 0; ok && i < n; i++) {
    const item *x = &it[i];
    const kiln__prof_rec *r = &p->recs[x->rec];
    if (x->step < lo || x->step > hi) continue;
    kiln__tl_event *e = &ev[ne++];
    e->start = r->start;
    e->end = r->end;
    e->pid = r->device;
    e->tid = r->stream;
    e->step = x->step;
    e->mode = x->l ? x->l->mode : NULL;
    e->correlation = r->correlation;
    e->graph_node = r->graph_node;
    e->graph_id = r->graph_id;
    e->graph_mismatch = x->mismatch;
    if (x->l && x->l->how != KILN__PROF_STEP) {
      e->launch = x->l->how == KILN__PROF_REPLAY      ? "graph replay"
                  : x->l->how == KILN__PROF_FIRST_RUN ? "graph first run"
                                                      : "eager";
      e->launch_id = x->serial;
    }
    if (x->group != KILN__PROF_NONE && x->group < (uint32_t)p->ngroups) {
      e->group = &p->groups[x->group];
      e->part = x->part;
      e->parts = x->parts;
      e->carrier = x->carrier;
      e->group_ns = x->group_ns;
    } else if (e->launch && is_device(r)) {
      unattributed++;
    }
    char nm[256];
    switch (r->kind) {
    case KILN__PROF_KERNEL:
      e->cat = KILN__TL_KERNEL;
      kiln__prof_short_name(r->name, nm, sizeof nm);
      e->name = e->group ? e->group->name : intern(&p->strs, nm);
      e->kernel = e->group && strcmp(nm, e->group->name) != 0 ? intern(&p->strs, nm) : NULL;
      memcpy(e->grid, r->grid, sizeof e->grid);
      memcpy(e->block, r->block, sizeof e->block);
      e->smem = r->smem;
      e->registers = r->registers;
      break;
    case KILN__PROF_MEMCPY:
    case KILN__PROF_MEMSET:
      e->cat = r->kind == KILN__PROF_MEMCPY ? KILN__TL_MEMCPY : KILN__TL_MEMSET;
      snprintf(nm, sizeof nm, "%s%s%s", r->kind == KILN__PROF_MEMCPY ? "memcpy" : "memset",
               r->kind == KILN__PROF_MEMCPY && r->copy ? " " : "",
               r->kind == KILN__PROF_MEMCPY && r->copy ? r->copy : "");
      e->name = intern(&p->strs, nm);
      e->bytes = r->bytes;
      e->copy = r->copy;
      break;
    default: {
      e->cat = KILN__TL_API;
      const char *an = p->api->api_name ? p->api->api_name(r->cbid) : NULL;
      if (an) {
        snprintf(nm, sizeof nm, "%s", an);
        char *v = strstr(nm, "_v"); /* "cudaLaunchKernel_v7000": the version goes */
        if (v && v[2] >= '0' && v[2] <= '9' && strspn(v + 2, "0123456789") == strlen(v + 2)) *v = 0;
      } else {
        snprintf(nm, sizeof nm, "CUDA call %" PRIu32, r->cbid);
      }
      e->name = intern(&p->strs, nm);
    }
    }
    ok = e->name != NULL;
    if (is_device(r) && e->step < first) first = e->step;
    if (is_device(r) && e->step > lastk) lastk = e->step;
  }
  if (ok) qsort(ev, ne, sizeof *ev, ev_by_start);
  free(it);
  if (ok) {
    p->ev = ev;
    p->nev = ne;
    *out = ev;
    *nout = ne;
    *meta = (kiln__tl_meta){.mode = p->mode,
                            .keep = p->keep_text,
                            .first_step = first == INT64_MAX ? -2 : first,
                            .last_step = lastk == INT64_MIN ? -2 : lastk,
                            .dropped = p->dropped,
                            .unattributed = unattributed};
  } else {
    free(ev);
  }
  pthread_mutex_unlock(&p->lock);
  return ok;
}
