/*
 * timeline.c: the trace-event JSON of a timeline (timeline.h), written from plain records and
 * read back for the report. The format is Chrome's trace-event format, which ui.perfetto.dev
 * and chrome://tracing open: an object whose "traceEvents" are complete ("X") events with ts
 * and dur in microseconds, and metadata ("M") events naming the processes and threads.
 *
 *   pid  device activity (kernels, copies, memsets): KILN__TL_GPU_PID plus the CUDA device
 *        (CUPTI's device id), named "GPU n" (Perfetto treats pid 0 as the kernel's, and a device
 *        number could be an OS process's); a CUDA runtime call: the OS process that made it,
 *        named "host"
 *   tid  device activity: CUPTI's stream id (one track per stream, named "stream n"); a call:
 *        the OS thread
 *
 * Each step gets an "X" event of category "step" on every stream it ran on, spanning its
 * records there, so that the kernels nest inside their step. ts counts from otherData's
 * origin_ns, the earliest record's start on CUPTI's clock. Host-only: no CUDA, no context.
 */
#include "timeline.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/util.h"

/* ---------------------------------------------------------------- writing */

static const char *cat_name(kiln__tl_cat c) {
  switch (c) {
  case KILN__TL_KERNEL: return "kernel";
  case KILN__TL_MEMCPY: return "memcpy";
  case KILN__TL_MEMSET: return "memset";
  case KILN__TL_API: return "cuda_api";
  case KILN__TL_STEP: return "step";
  }
  return "other";
}

/* The length of the valid UTF-8 sequence at s (0: not one). */
static int utf8_len(const unsigned char *s) {
  int n = s[0] < 0x80             ? 1
          : (s[0] & 0xe0) == 0xc0 ? 2
          : (s[0] & 0xf0) == 0xe0 ? 3
          : (s[0] & 0xf8) == 0xf0 ? 4
                                  : 0;
  if (n == 2 && s[0] < 0xc2) return 0; /* overlong */
  for (int k = 1; k < n; k++)
    if ((s[k] & 0xc0) != 0x80) return 0;
  return n;
}

/* s as a JSON string: quotes, backslashes and control characters escaped, bytes that are not
 * UTF-8 written as U+FFFD. */
static void put_str(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p;) {
    if (*p == '"' || *p == '\\') {
      fputc('\\', f);
      fputc(*p++, f);
    } else if (*p < 0x20) {
      fprintf(f, "\\u%04x", *p++);
    } else {
      int n = utf8_len(p);
      if (n == 0) {
        fputs("\\ufffd", f);
        p++;
      } else {
        fwrite(p, 1, (size_t)n, f);
        p += n;
      }
    }
  }
  fputc('"', f);
}

/* A time in microseconds from ns, exactly (three decimals). */
static void put_us(FILE *f, uint64_t ns) {
  fprintf(f, "%" PRIu64 ".%03u", ns / 1000, (unsigned)(ns % 1000));
}

/* An args member: the separator, then "key": */
static void key(FILE *f, bool *first, const char *k) {
  fputs(*first ? "" : ",", f);
  *first = false;
  put_str(f, k);
  fputc(':', f);
}

static void arg_str(FILE *f, bool *first, const char *k, const char *v) {
  if (!v) return;
  key(f, first, k);
  put_str(f, v);
}

static void arg_u64(FILE *f, bool *first, const char *k, uint64_t v) {
  key(f, first, k);
  fprintf(f, "%" PRIu64, v);
}

static void arg_dbl(FILE *f, bool *first, const char *k, double v) {
  if (!isfinite(v)) return;
  key(f, first, k);
  fprintf(f, "%.6g", v);
}

static void arg_dim3(FILE *f, bool *first, const char *k, const int32_t d[3]) {
  key(f, first, k);
  fprintf(f, "[%d,%d,%d]", d[0], d[1], d[2]);
}

/* The group's trace nodes (one a line) as an array, and their ops as one string. */
static void arg_nodes(FILE *f, bool *first, const char *nodes) {
  key(f, first, "nodes");
  fputc('[', f);
  kiln__sb ops = {0};
  for (const char *p = nodes; *p;) {
    size_t n = strcspn(p, "\n");
    char *line = malloc(n + 1);
    if (line) {
      memcpy(line, p, n);
      line[n] = 0;
      fputs(p == nodes ? "" : ",", f);
      put_str(f, line);
      /* "#12 add [128,512] f32": the op is the second word */
      const char *op = strchr(line, ' ');
      if (op) {
        op++;
        kiln__sb_printf(&ops, "%s%.*s", ops.n ? " " : "", (int)strcspn(op, " "), op);
      }
      free(line);
    }
    p += n + (p[n] == '\n');
  }
  fputc(']', f);
  if (ops.s) arg_str(f, first, "ops", ops.s);
  kiln__sb_free(&ops);
}

static void put_args(FILE *f, const kiln__tl_event *e) {
  bool first = true;
  fputc('{', f);
  if (e->step >= -1) {
    key(f, &first, "step");
    fprintf(f, "%" PRId64, e->step);
  }
  arg_str(f, &first, "mode", e->mode);
  arg_str(f, &first, "launch", e->launch);
  if (e->launch_id) arg_u64(f, &first, "launch_id", e->launch_id);
  const kiln__tl_group *g = e->group;
  if (g) {
    arg_u64(f, &first, "group", (uint64_t)g->index);
    arg_str(f, &first, "kind", g->kind);
    if (g->nodes && *g->nodes) arg_nodes(f, &first, g->nodes);
  }
  if (e->parts > 1) {
    arg_u64(f, &first, "part", (uint64_t)e->part);
    arg_u64(f, &first, "parts", (uint64_t)e->parts);
    if (e->carrier) arg_u64(f, &first, "carrier", 1);
  }
  double ns = e->group_ns > 0 ? e->group_ns : (double)(e->end - e->start);
  /* a group's traffic and work are written once, on its first kernel; rates are over the time of
   * all its records */
  if (g && e->carrier) {
    if (g->bytes_read || g->bytes_written) {
      arg_u64(f, &first, "bytes_read", g->bytes_read);
      arg_u64(f, &first, "bytes_written", g->bytes_written);
      if (ns > 0) arg_dbl(f, &first, "GB/s", (double)(g->bytes_read + g->bytes_written) / ns);
    }
    if (g->flops) {
      arg_u64(f, &first, "flops", g->flops);
      if (ns > 0) arg_dbl(f, &first, "TFLOP/s", (double)g->flops / ns / 1e3);
    }
  }
  if (e->cat == KILN__TL_MEMCPY || e->cat == KILN__TL_MEMSET) {
    arg_u64(f, &first, "bytes", e->bytes);
    arg_str(f, &first, e->cat == KILN__TL_MEMCPY ? "copy" : "memory", e->copy);
    if (e->end > e->start)
      arg_dbl(f, &first, "GB/s", (double)e->bytes / (double)(e->end - e->start));
  }
  if (e->cat == KILN__TL_KERNEL) {
    arg_str(f, &first, "kernel", e->kernel);
    arg_dim3(f, &first, "grid", e->grid);
    arg_dim3(f, &first, "block", e->block);
    arg_u64(f, &first, "smem", e->smem);
    arg_u64(f, &first, "registers", e->registers);
  }
  if (e->correlation) arg_u64(f, &first, "correlation", e->correlation);
  if (e->graph_node) arg_u64(f, &first, "graph_node", e->graph_node);
  if (e->graph_id) arg_u64(f, &first, "graph_id", e->graph_id);
  arg_str(f, &first, "graph_mismatch", e->graph_mismatch);
  fputc('}', f);
}

/* Starts the next element of traceEvents. */
static void next(FILE *f, bool *first) {
  fputs(*first ? "\n" : ",\n", f);
  *first = false;
}

/* The JSON pid of a record of the host or a device (pid: the OS process, or the device). */
static uint32_t json_pid(bool host, uint32_t pid) { return host ? pid : KILN__TL_GPU_PID + pid; }

static void put_event(FILE *f, bool *first, const kiln__tl_event *e, uint64_t origin) {
  next(f, first);
  fputs("{\"ph\":\"X\",\"cat\":", f);
  put_str(f, cat_name(e->cat));
  fputs(",\"name\":", f);
  put_str(f, e->name ? e->name : "?");
  fprintf(f, ",\"pid\":%" PRIu32 ",\"tid\":%" PRIu32 ",\"ts\":",
          json_pid(e->cat == KILN__TL_API, e->pid), e->tid);
  put_us(f, e->start >= origin ? e->start - origin : 0);
  fputs(",\"dur\":", f);
  put_us(f, e->end > e->start ? e->end - e->start : 0);
  fputs(",\"args\":", f);
  put_args(f, e);
  fputc('}', f);
}

static int by_start(const void *a, const void *b) {
  const kiln__tl_event *x = *(const kiln__tl_event *const *)a,
                       *y = *(const kiln__tl_event *const *)b;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  if (x->end != y->end) return x->end > y->end ? -1 : 1; /* the longer first: it encloses */
  if (x->pid != y->pid) return x->pid < y->pid ? -1 : 1;
  return (x->tid > y->tid) - (x->tid < y->tid);
}

/* Steps' spans per stream: sorted by step, device and stream. */
static int by_track(const void *a, const void *b) {
  const kiln__tl_event *x = a, *y = b;
  if (x->step != y->step) return x->step < y->step ? -1 : 1;
  if (x->pid != y->pid) return x->pid < y->pid ? -1 : 1;
  if (x->tid != y->tid) return x->tid < y->tid ? -1 : 1;
  return (x->start > y->start) - (x->start < y->start);
}

static bool is_device(const kiln__tl_event *e) {
  return e->cat == KILN__TL_KERNEL || e->cat == KILN__TL_MEMCPY || e->cat == KILN__TL_MEMSET;
}

/* One span per step and stream over the device records of steps >= 0 (*n of them, malloc'd). */
static kiln__tl_event *step_spans(const kiln__tl_event *ev, size_t n, size_t *ns) {
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    m += is_device(&ev[i]) && ev[i].step >= 0;
  *ns = 0;
  kiln__tl_event *s = malloc((m ? m : 1) * sizeof *s);
  if (!s) return NULL;
  for (size_t i = 0; i < n; i++)
    if (is_device(&ev[i]) && ev[i].step >= 0) s[(*ns)++] = ev[i];
  qsort(s, *ns, sizeof *s, by_track);
  size_t out = 0;
  for (size_t i = 0; i < *ns; i++) {
    if (out > 0 && s[out - 1].step == s[i].step && s[out - 1].pid == s[i].pid &&
        s[out - 1].tid == s[i].tid) {
      if (s[i].end > s[out - 1].end) s[out - 1].end = s[i].end;
      continue;
    }
    kiln__tl_event span = {.cat = KILN__TL_STEP,
                           .start = s[i].start,
                           .end = s[i].end,
                           .pid = s[i].pid,
                           .tid = s[i].tid,
                           .step = s[i].step,
                           .mode = s[i].mode};
    s[out++] = span;
  }
  *ns = out;
  return s;
}

/* The names of the processes and threads the events use. */
static void put_names(FILE *f, bool *first, const kiln__tl_event *const *ord, size_t n,
                      const char *device) {
  typedef struct track {
    uint32_t pid, tid;
    bool host;
  } track;
  track *t = malloc((n ? n : 1) * sizeof *t);
  if (!t) return;
  size_t nt = 0;
  for (size_t i = 0; i < n; i++) {
    bool host = ord[i]->cat == KILN__TL_API, seen = false;
    for (size_t k = nt; k-- > 0 && !seen;)
      seen = t[k].pid == ord[i]->pid && t[k].tid == ord[i]->tid && t[k].host == host;
    if (!seen) t[nt++] = (track){ord[i]->pid, ord[i]->tid, host};
  }
  for (size_t k = 0; k < nt; k++) {
    bool named = false; /* the process, once */
    for (size_t j = 0; j < k && !named; j++)
      named = t[j].pid == t[k].pid && t[j].host == t[k].host;
    if (!named) {
      char name[160];
      if (t[k].host)
        snprintf(name, sizeof name, "host (process %" PRIu32 ")", t[k].pid);
      else
        snprintf(name, sizeof name, "GPU %" PRIu32 "%s%s", t[k].pid, device ? ": " : "",
                 device ? device : "");
      next(f, first);
      fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%" PRIu32 ",\"args\":{\"name\":",
              json_pid(t[k].host, t[k].pid));
      put_str(f, name);
      fprintf(f,
              "}},\n{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%" PRIu32
              ",\"args\":{\"sort_index\":%d}}",
              json_pid(t[k].host, t[k].pid), t[k].host ? 1000 : (int)(t[k].pid % 1000));
    }
    next(f, first);
    fprintf(f,
            "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%" PRIu32 ",\"tid\":%" PRIu32
            ",\"args\":{\"name\":\"%s %" PRIu32 "\"}}",
            json_pid(t[k].host, t[k].pid), t[k].tid, t[k].host ? "thread" : "stream", t[k].tid);
  }
  free(t);
}

bool kiln__tl_write_json(FILE *f, const kiln__tl_event *ev, size_t n, const kiln__tl_meta *meta) {
  size_t ns = 0;
  kiln__tl_event *spans = step_spans(ev, n, &ns);
  const kiln__tl_event **ord = malloc((n + ns + 1) * sizeof *ord);
  if (!spans || !ord) {
    free(spans);
    free(ord);
    return false;
  }
  for (size_t i = 0; i < n; i++)
    ord[i] = &ev[i];
  for (size_t i = 0; i < ns; i++)
    ord[n + i] = &spans[i];
  size_t total = n + ns;
  qsort(ord, total, sizeof *ord, by_start);
  uint64_t origin = total ? ord[0]->start : 0;
  fputs("{\"displayTimeUnit\":\"ns\",\n\"otherData\":{\"producer\":\"kiln\"", f);
  if (meta) {
    fputs(",\"mode\":", f);
    put_str(f, meta->mode ? meta->mode : "");
    if (meta->device) {
      fputs(",\"device\":", f);
      put_str(f, meta->device);
    }
    if (meta->cupti) {
      fputs(",\"cupti_library\":", f);
      put_str(f, meta->cupti);
    }
    fputs(",\"keep\":", f);
    put_str(f, meta->keep ? meta->keep : "");
    fprintf(f,
            ",\"first_step\":%" PRId64 ",\"last_step\":%" PRId64 ",\"dropped_records\":%" PRIu64
            ",\"unattributed\":%" PRIu64,
            meta->first_step, meta->last_step, meta->dropped, meta->unattributed);
  }
  fprintf(f, ",\"records\":%zu,\"origin_ns\":%" PRIu64 ",", n, origin);
  fputs("\"pid\":\"device records: 4194304 + the CUDA device; CUDA calls: the OS process\","
        "\"tid\":\"device records: CUPTI's stream id; CUDA calls: the OS thread\"},\n"
        "\"traceEvents\":[",
        f);
  bool first = true;
  put_names(f, &first, ord, total, meta ? meta->device : NULL);
  for (size_t i = 0; i < total; i++)
    put_event(f, &first, ord[i], origin);
  fputs("\n]}\n", f);
  free(ord);
  free(spans);
  return fflush(f) == 0 && !ferror(f);
}

/* ---------------------------------------------------------------- reading */

static const cJSON *member(const cJSON *o, const char *k) {
  return cJSON_GetObjectItemCaseSensitive(o, k);
}
static const char *str_of(const cJSON *o, const char *k) {
  const cJSON *v = member(o, k);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}
static double num_of(const cJSON *o, const char *k, double dflt) {
  const cJSON *v = member(o, k);
  return cJSON_IsNumber(v) ? v->valuedouble : dflt;
}

static kiln__tl_cat cat_of(const char *c) {
  if (!c) return KILN__TL_KERNEL;
  if (strcmp(c, "memcpy") == 0) return KILN__TL_MEMCPY;
  if (strcmp(c, "memset") == 0) return KILN__TL_MEMSET;
  if (strcmp(c, "cuda_api") == 0) return KILN__TL_API;
  if (strcmp(c, "step") == 0) return KILN__TL_STEP;
  return KILN__TL_KERNEL;
}

static uint64_t ns_of(double us) { return us > 0 ? (uint64_t)llround(us * 1e3) : 0; }

void kiln__tl_run_free(kiln__tl_run *run) {
  if (!run) return;
  if (run->groups)
    for (size_t i = 0; i < run->n; i++)
      free((void *)(uintptr_t)run->groups[i].nodes); /* nodes_of's */
  free(run->groups);
  free(run->ev);
  free(run->title);
  cJSON_Delete(run->doc);
  memset(run, 0, sizeof *run);
}

/* The nodes array of args as one string, a node a line (malloc'd), or NULL. */
static char *nodes_of(const cJSON *args) {
  const cJSON *a = member(args, "nodes"), *v;
  if (!cJSON_IsArray(a)) return NULL;
  kiln__sb b = {0};
  cJSON_ArrayForEach(v, a) {
    if (cJSON_IsString(v)) kiln__sb_printf(&b, "%s%s", b.n ? "\n" : "", v->valuestring);
  }
  if (b.oom) kiln__sb_free(&b);
  return b.s;
}

bool kiln__tl_read_json(const char *path, kiln__tl_run *run, char *why, size_t n) {
  memset(run, 0, sizeof *run);
  bool irregular;
  uint64_t size = 0;
  FILE *f = kiln__fopen_regular(path, &irregular, &size);
  if (!f) {
    snprintf(why, n, "%s: %s", path, irregular ? "not a regular file" : "cannot be opened");
    return false;
  }
  char *text = malloc(size + 1);
  size_t got = text ? fread(text, 1, size, f) : 0;
  fclose(f);
  if (!text || got != size) {
    free(text);
    snprintf(why, n, "%s: %s", path, text ? "could not be read" : "out of host memory");
    return false;
  }
  text[size] = 0;
  cJSON *doc = cJSON_Parse(text);
  free(text);
  const cJSON *evs = cJSON_IsArray(doc) ? doc : member(doc, "traceEvents");
  if (!doc || !cJSON_IsArray(evs)) {
    snprintf(why, n, "%s: not a trace-event JSON file (%s)", path,
             doc ? "no traceEvents array" : "it does not parse");
    cJSON_Delete(doc);
    return false;
  }
  run->doc = doc;
  const cJSON *other = member(doc, "otherData");
  run->mode = str_of(other, "mode");
  run->device = str_of(other, "device");
  size_t cap = (size_t)cJSON_GetArraySize(evs);
  run->ev = calloc(cap ? cap : 1, sizeof *run->ev);
  run->groups = calloc(cap ? cap : 1, sizeof *run->groups);
  if (!run->ev || !run->groups) {
    kiln__tl_run_free(run);
    snprintf(why, n, "%s: out of host memory", path);
    return false;
  }
  const cJSON *e;
  cJSON_ArrayForEach(e, evs) {
    const char *ph = str_of(e, "ph");
    if (!ph || strcmp(ph, "X") != 0) continue;
    const cJSON *args = member(e, "args");
    kiln__tl_event *x = &run->ev[run->n];
    x->cat = cat_of(str_of(e, "cat"));
    x->name = str_of(e, "name");
    x->pid = (uint32_t)num_of(e, "pid", 0);
    if (x->cat != KILN__TL_API && x->pid >= KILN__TL_GPU_PID) x->pid -= KILN__TL_GPU_PID;
    x->tid = (uint32_t)num_of(e, "tid", 0);
    x->start = ns_of(num_of(e, "ts", 0));
    x->end = x->start + ns_of(num_of(e, "dur", 0));
    x->step = (int64_t)num_of(args, "step", -2);
    x->mode = str_of(args, "mode");
    x->launch = str_of(args, "launch");
    x->kernel = str_of(args, "kernel");
    x->launch_id = (uint64_t)num_of(args, "launch_id", 0);
    x->part = (int)num_of(args, "part", 0);
    x->parts = (int)num_of(args, "parts", 0);
    /* one of several records carries its group's traffic; one alone does */
    x->carrier = x->parts <= 1 || member(args, "carrier");
    x->bytes = (uint64_t)num_of(args, "bytes", 0);
    if (member(args, "kind") || member(args, "group")) {
      kiln__tl_group *g = &run->groups[run->n];
      g->name = x->name;
      g->kind = str_of(args, "kind");
      g->nodes = nodes_of(args);
      g->index = (int32_t)num_of(args, "group", -1);
      g->bytes_read = (uint64_t)num_of(args, "bytes_read", 0);
      g->bytes_written = (uint64_t)num_of(args, "bytes_written", 0);
      g->flops = (uint64_t)num_of(args, "flops", 0);
      x->group = g;
    }
    run->n++;
  }
  const char *base = strrchr(path, '/');
  run->title = kiln__strf("%s", base ? base + 1 : path);
  if (!run->title) {
    kiln__tl_run_free(run);
    snprintf(why, n, "%s: out of host memory", path);
    return false;
  }
  return true;
}
