/*
 * test_cpu_timeline.c: timeline traces without a GPU (issue 26). The trace-event JSON written
 * from made-up records, parsed back with cJSON (valid, every record once, names, arguments,
 * steps nesting their records); the recorder's session driven with CUPTI's records as a test
 * makes them (eager launches through correlation ids, step graph replays by capture order and by
 * name, the ring of steps, a range of steps); CUPTI's record structs converted; the HTML report
 * (self-contained, the median step, every kernel drawn, names escaped) and profile_step
 * --report; the errors without CUPTI or a GPU; and no CUPTI loaded when nothing is traced.
 */
#include <cjson/cJSON.h>
#include <cupti_activity.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "internal.h"
#include "prof/prof.h"
#include "prof/timeline.h"

TestSuite(timeline, .fini = th_remove_tmpdirs);

/* ---------------------------------------------------------------- helpers */

static cJSON *parse_file(const char *path) {
  char *text = th_read_whole(path, NULL);
  cJSON *doc = cJSON_Parse(text);
  cr_assert_not_null(doc, "%s does not parse as JSON", path);
  free(text);
  return doc;
}

static const cJSON *get(const cJSON *o, const char *k) {
  return cJSON_GetObjectItemCaseSensitive(o, k);
}
static double num(const cJSON *o, const char *k) {
  const cJSON *v = get(o, k);
  cr_assert(cJSON_IsNumber(v), "no number %s", k);
  return v->valuedouble;
}
static const char *str(const cJSON *o, const char *k) {
  const cJSON *v = get(o, k);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* The X event of category cat whose args.correlation is corr (asserting there is exactly one). */
static const cJSON *event_of(const cJSON *evs, const char *cat, uint32_t corr) {
  const cJSON *e, *found = NULL;
  cJSON_ArrayForEach(e, evs) {
    const cJSON *args = get(e, "args");
    if (!str(e, "ph") || strcmp(str(e, "ph"), "X") != 0 || strcmp(str(e, "cat"), cat) != 0 ||
        !get(args, "correlation") || (uint32_t)num(args, "correlation") != corr)
      continue;
    cr_assert_null(found, "correlation %u appears twice", corr);
    found = e;
  }
  cr_assert_not_null(found, "no %s event of correlation %u", cat, corr);
  return found;
}

/* ---------------------------------------------------------------- the JSON */

static const kiln__tl_group g_add = {.name = "k_add_relu_f32_v4_0123abcd",
                                     .kind = "elementwise",
                                     .nodes = "#12 add [128,512] f32 (in registers)\n"
                                              "#13 relu [128,512] f32",
                                     .index = 3,
                                     .bytes_read = 524288,
                                     .bytes_written = 262144,
                                     .grid = {256, 1, 1},
                                     .block = 256};
static const kiln__tl_group g_mm = {.name = "cublasLt_gemm_bias_relu_128x512x784",
                                    .kind = "gemm",
                                    .nodes = "#5 matmul [128,512] f32",
                                    .index = 1,
                                    .bytes_read = 1000000,
                                    .bytes_written = 262144,
                                    .flops = 2ull * 128 * 512 * 784};

/* Seven records of two steps: two launches (one of two kernels), a copy, a memset, a call, and
 * a kernel whose name needs escaping. */
static size_t sample_events(kiln__tl_event *ev) {
  const uint64_t t = 1700000000000000000ull; /* CUPTI's clock: big numbers */
  size_t n = 0;
  ev[n++] = (kiln__tl_event){.cat = KILN__TL_MEMCPY,
                             .start = t + 1000,
                             .end = t + 3000,
                             .tid = 13,
                             .name = "memcpy HtoD",
                             .step = 0,
                             .mode = "fused",
                             .bytes = 4096,
                             .copy = "HtoD",
                             .correlation = 1};
  ev[n++] = (kiln__tl_event){.cat = KILN__TL_KERNEL,
                             .start = t + 5000,
                             .end = t + 9000,
                             .tid = 13,
                             .name = g_mm.name,
                             .kernel = "sm90_xmma_gemm_f32f32",
                             .step = 0,
                             .mode = "fused",
                             .launch = "eager",
                             .group = &g_mm,
                             .launch_id = 7,
                             .part = 1,
                             .parts = 2,
                             .carrier = true,
                             .group_ns = 6000,
                             .correlation = 2,
                             .grid = {4, 2, 1},
                             .block = {128, 1, 1},
                             .smem = 4096,
                             .registers = 96};
  ev[n++] = (kiln__tl_event){.cat = KILN__TL_KERNEL,
                             .start = t + 9500,
                             .end = t + 11500,
                             .tid = 13,
                             .name = g_mm.name,
                             .kernel = "splitKreduce_kernel",
                             .step = 0,
                             .mode = "fused",
                             .launch = "eager",
                             .group = &g_mm,
                             .launch_id = 7,
                             .part = 2,
                             .parts = 2,
                             .group_ns = 6000,
                             .correlation = 3,
                             .grid = {1, 1, 1},
                             .block = {256, 1, 1}};
  ev[n++] = (kiln__tl_event){.cat = KILN__TL_KERNEL,
                             .start = t + 12000,
                             .end = t + 12999,
                             .tid = 13,
                             .name = g_add.name,
                             .step = 0,
                             .mode = "fused",
                             .launch = "eager",
                             .group = &g_add,
                             .launch_id = 8,
                             .part = 1,
                             .parts = 1,
                             .carrier = true,
                             .group_ns = 999,
                             .correlation = 4,
                             .grid = {256, 1, 1},
                             .block = {256, 1, 1}};
  ev[n++] = (kiln__tl_event){.cat = KILN__TL_API,
                             .start = t + 500,
                             .end = t + 2500,
                             .pid = 4242,
                             .tid = 77,
                             .name = "cudaMemcpyAsync",
                             .step = 0,
                             .correlation = 5};
  ev[n++] = (kiln__tl_event){.cat = KILN__TL_MEMSET,
                             .start = t + 20000,
                             .end = t + 20400,
                             .tid = 13,
                             .name = "memset",
                             .step = 1,
                             .mode = "fused",
                             .bytes = 1024,
                             .copy = "device",
                             .correlation = 6};
  ev[n++] = (kiln__tl_event){.cat = KILN__TL_KERNEL,
                             .start = t + 21000,
                             .end = t + 23000,
                             .tid = 13,
                             .name = "odd \"name\" \\ with\ttab <&> \xff end",
                             .step = 1,
                             .correlation = 7,
                             .grid = {1, 1, 1},
                             .block = {32, 1, 1}};
  return n;
}

Test(timeline, json_is_valid_and_has_every_record_once) {
  kiln__tl_event ev[16];
  size_t n = sample_events(ev);
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "timeline");
  snprintf(path, sizeof path, "%s/t.json", dir);
  FILE *f = fopen(path, "w");
  kiln__tl_meta meta = {.mode = "fused",
                        .device = "Test GPU",
                        .keep = "the last 100 steps",
                        .first_step = 0,
                        .last_step = 1,
                        .dropped = 2};
  cr_assert(kiln__tl_write_json(f, ev, n, &meta));
  fclose(f);
  cJSON *doc = parse_file(path);
  const cJSON *other = get(doc, "otherData"), *evs = get(doc, "traceEvents");
  cr_assert(cJSON_IsArray(evs));
  cr_assert_str_eq(str(other, "mode"), "fused");
  cr_assert_str_eq(str(other, "device"), "Test GPU");
  cr_assert_eq(num(other, "dropped_records"), 2);
  cr_assert_eq(num(other, "records"), (double)n);
  const uint64_t origin = 1700000000000000000ull + 500; /* the earliest start */
  cr_assert_float_eq(num(other, "origin_ns"), (double)origin, 1e3);
  /* every record once, at its time: ts and dur in microseconds from the origin */
  int x = 0, steps = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, evs) {
    const char *ph = str(e, "ph");
    cr_assert(ph && (strcmp(ph, "X") == 0 || strcmp(ph, "M") == 0), "event with ph %s", ph);
    if (strcmp(ph, "X") != 0) continue;
    if (strcmp(str(e, "cat"), "step") == 0)
      steps++;
    else
      x++;
  }
  cr_assert_eq(x, (int)n, "%d record events for %zu records", x, n);
  cr_assert_eq(steps, 2, "one span per step and stream (steps 0 and 1 on stream 13)");
  for (size_t i = 0; i < n; i++) {
    const char *cat = ev[i].cat == KILN__TL_KERNEL   ? "kernel"
                      : ev[i].cat == KILN__TL_MEMCPY ? "memcpy"
                      : ev[i].cat == KILN__TL_MEMSET ? "memset"
                                                     : "cuda_api";
    const cJSON *j = event_of(evs, cat, ev[i].correlation);
    cr_assert_eq(num(j, "ts"), (double)(ev[i].start - origin) / 1e3, "ts of record %zu", i);
    cr_assert_eq(num(j, "dur"), (double)(ev[i].end - ev[i].start) / 1e3);
    cr_assert_eq(num(j, "pid"), ev[i].pid + (ev[i].cat == KILN__TL_API ? 0 : KILN__TL_GPU_PID),
                 "a device's pid is past any process's, never 0");
    cr_assert_eq(num(j, "tid"), ev[i].tid);
    cr_assert_eq(num(get(j, "args"), "step"), ev[i].step);
    if (ev[i].cat != KILN__TL_KERNEL || ev[i].correlation != 7) {
      cr_assert_str_eq(str(j, "name"), ev[i].name);
    }
  }
  /* the escaped name comes back as it was, its byte that is no UTF-8 as U+FFFD */
  cr_assert_str_eq(str(event_of(evs, "kernel", 7), "name"),
                   "odd \"name\" \\ with\ttab <&> \xef\xbf\xbd end");
  /* kiln's arguments: the group, its nodes and ops, traffic and rate over all its parts */
  const cJSON *a = get(event_of(evs, "kernel", 4), "args");
  cr_assert_str_eq(str(a, "mode"), "fused");
  cr_assert_str_eq(str(a, "launch"), "eager");
  cr_assert_eq(num(a, "launch_id"), 8);
  cr_assert_eq(num(a, "group"), 3);
  cr_assert_str_eq(str(a, "kind"), "elementwise");
  cr_assert_str_eq(str(a, "ops"), "add relu");
  const cJSON *nodes = get(a, "nodes");
  cr_assert_eq(cJSON_GetArraySize(nodes), 2);
  cr_assert_str_eq(cJSON_GetArrayItem(nodes, 0)->valuestring,
                   "#12 add [128,512] f32 (in registers)");
  cr_assert_str_eq(cJSON_GetArrayItem(nodes, 1)->valuestring, "#13 relu [128,512] f32");
  cr_assert_eq(num(a, "bytes_read"), 524288);
  cr_assert_eq(num(a, "bytes_written"), 262144);
  cr_assert_float_eq(num(a, "GB/s"), 786432.0 / 999, 1e-3 * 786432.0 / 999);
  cr_assert_eq(cJSON_GetArrayItem(get(a, "grid"), 0)->valuedouble, 256);
  cr_assert_null(get(a, "kernel"), "a generated kernel's own name is kiln's");
  /* a product of two kernels: kiln's name on both, each its kernel's, traffic on the first */
  const cJSON *p1 = get(event_of(evs, "kernel", 2), "args"),
              *p2 = get(event_of(evs, "kernel", 3), "args");
  cr_assert_str_eq(str(event_of(evs, "kernel", 3), "name"), g_mm.name);
  cr_assert_str_eq(str(p1, "kernel"), "sm90_xmma_gemm_f32f32");
  cr_assert_str_eq(str(p2, "kernel"), "splitKreduce_kernel");
  cr_assert_eq(num(p1, "part"), 1);
  cr_assert_eq(num(p2, "part"), 2);
  cr_assert_eq(num(p2, "parts"), 2);
  cr_assert_eq(num(p1, "flops"), (double)g_mm.flops);
  cr_assert_float_eq(num(p1, "TFLOP/s"), (double)g_mm.flops / 6000 / 1e3, 1e-3);
  cr_assert_null(get(p2, "bytes_read"), "a group's traffic is written once");
  cr_assert_eq(num(p1, "carrier"), 1, "the record that carries it says so");
  cr_assert_null(get(p2, "carrier"));
  cr_assert_eq(num(p1, "registers"), 96);
  const cJSON *cp = get(event_of(evs, "memcpy", 1), "args");
  cr_assert_eq(num(cp, "bytes"), 4096);
  cr_assert_str_eq(str(cp, "copy"), "HtoD");
  /* names of the processes and threads; steps nest their records */
  bool gpu = false, host = false, stream = false;
  cJSON_ArrayForEach(e, evs) {
    if (strcmp(str(e, "ph"), "M") != 0) continue;
    const char *what = str(get(e, "args"), "name");
    if (strcmp(str(e, "name"), "process_name") == 0 && num(e, "pid") == KILN__TL_GPU_PID)
      gpu = strcmp(what, "GPU 0: Test GPU") == 0;
    if (strcmp(str(e, "name"), "process_name") == 0 && num(e, "pid") == 4242)
      host = strcmp(what, "host (process 4242)") == 0;
    if (strcmp(str(e, "name"), "thread_name") == 0 && num(e, "tid") == 13)
      stream = strcmp(what, "stream 13") == 0;
  }
  cr_assert(gpu && host && stream, "process and thread names");
  cJSON_ArrayForEach(e, evs) {
    if (strcmp(str(e, "ph"), "X") != 0 || strcmp(str(e, "cat"), "step") != 0) continue;
    double t0 = num(e, "ts"), t1 = t0 + num(e, "dur"), step = num(get(e, "args"), "step");
    int inside = 0;
    const cJSON *r;
    cJSON_ArrayForEach(r, evs) {
      if (strcmp(str(r, "ph"), "X") != 0 || strcmp(str(r, "cat"), "step") == 0 ||
          num(r, "pid") != num(e, "pid") || num(r, "tid") != num(e, "tid") ||
          num(get(r, "args"), "step") != step)
        continue;
      cr_assert(num(r, "ts") >= t0 && num(r, "ts") + num(r, "dur") <= t1,
                "a record of step %.0f outside its span", step);
      inside++;
    }
    cr_assert_eq(inside, step == 0 ? 4 : 2, "step %.0f spans %d records", step, inside);
  }
  cJSON_Delete(doc);
}

/* ---------------------------------------------------------------- the session */

/* CUPTI as a test plays it: the external ids pushed on this thread, and the records a CUDA call
 * and the work it launches make. */
static struct {
  uint64_t stack[16];
  int depth;
  uint32_t corr;
} fake;
static int fake_push(uint64_t id) {
  cr_assert_lt(fake.depth, 16);
  fake.stack[fake.depth++] = id;
  return 0;
}
static int fake_pop(void) {
  cr_assert_gt(fake.depth, 0, "a pop without a push");
  fake.depth--;
  return 0;
}
static const char *fake_name(uint32_t cbid) {
  return cbid == 211 ? "cudaLaunchKernel_v7000" : cbid == 311 ? "cudaGraphLaunch_v10000" : NULL;
}
static const kiln__prof_api fake_api = {fake_push, fake_pop, fake_name};

/* A CUDA call at time t: the correlation of the innermost region open (as CUPTI makes it, before
 * the call's record) and the call's record; its correlation id. */
static uint32_t call(kiln__prof *p, uint32_t cbid, uint64_t t) {
  uint32_t c = ++fake.corr;
  if (fake.depth > 0)
    kiln__prof_ingest(p, &(kiln__prof_rec){.kind = KILN__PROF_EXTERNAL,
                                           .correlation = c,
                                           .external = fake.stack[fake.depth - 1]});
  kiln__prof_ingest(p, &(kiln__prof_rec){.kind = KILN__PROF_RUNTIME,
                                         .correlation = c,
                                         .cbid = cbid,
                                         .start = t,
                                         .end = t + 100,
                                         .device = 4242,
                                         .stream = 1});
  return c;
}
static void kernel(kiln__prof *p, uint32_t corr, const char *name, uint64_t t0, uint64_t t1,
                   uint64_t node) {
  kiln__prof_ingest(p, &(kiln__prof_rec){.kind = KILN__PROF_KERNEL,
                                         .correlation = corr,
                                         .name = name,
                                         .start = t0,
                                         .end = t1,
                                         .stream = 13,
                                         .graph_node = node,
                                         .grid = {1, 1, 1},
                                         .block = {128, 1, 1}});
}
static void memset_rec(kiln__prof *p, uint32_t corr, uint64_t t0, uint64_t node) {
  kiln__prof_ingest(p, &(kiln__prof_rec){.kind = KILN__PROF_MEMSET,
                                         .correlation = corr,
                                         .start = t0,
                                         .end = t0 + 50,
                                         .stream = 13,
                                         .bytes = 64,
                                         .copy = "device",
                                         .graph_node = node});
}

static kiln__prof *session(const char *keep) {
  memset(&fake, 0, sizeof fake);
  char why[256];
  kiln__prof *p = kiln__prof_new(&fake_api, keep, why, sizeof why);
  cr_assert_not_null(p, "%s", why);
  return p;
}

static uint32_t add_group(kiln__prof *p, uint64_t key, const char *name, const char *kind) {
  kiln__tl_group g = {.name = name, .kind = kind, .nodes = "#1 add [4] f32", .index = (int)key};
  cr_assert_eq(kiln__prof_group_find(p, key), KILN__PROF_NONE);
  uint32_t id = kiln__prof_group_add(p, key, &g);
  cr_assert_neq(id, KILN__PROF_NONE);
  cr_assert_eq(kiln__prof_group_find(p, key), id, "a group is found by its key");
  return id;
}

/* The events of the session, each found by its correlation and category. */
static const kiln__tl_event *find(const kiln__tl_event *ev, size_t n, kiln__tl_cat cat,
                                  uint32_t corr, int part) {
  const kiln__tl_event *found = NULL;
  for (size_t i = 0; i < n; i++)
    if (ev[i].cat == cat && ev[i].correlation == corr && (part == 0 || ev[i].part == part)) {
      cr_assert_null(found, "correlation %u part %d twice", corr, part);
      found = &ev[i];
    }
  cr_assert_not_null(found, "no event of correlation %u part %d", corr, part);
  return found;
}

Test(timeline, eager_launches_resolve_through_correlation_ids) {
  kiln__prof *p = session(NULL);
  uint32_t ga = add_group(p, 1, "k_add_f32_aa", "elementwise");
  uint32_t gm = add_group(p, 2, "cublas_gemm_4x4x4", "gemm");
  uint32_t gz = add_group(p, 3, "k_index_add_f32_bb", "gather");
  kiln__prof_step(p, 0, "fused");
  uint32_t up = call(p, 35, 1000); /* the step values' copy: the step's, no group's */
  kiln__prof_ingest(p, &(kiln__prof_rec){.kind = KILN__PROF_MEMCPY,
                                         .correlation = up,
                                         .start = 1200,
                                         .end = 1300,
                                         .stream = 13,
                                         .bytes = 256,
                                         .copy = "HtoD"});
  kiln__prof_enter(p, KILN__PROF_EAGER, gm, 0, "fused");
  uint32_t c1 = call(p, 211, 2000), c2 = call(p, 211, 2100);
  kiln__prof_leave(p);
  kiln__prof_enter(p, KILN__PROF_EAGER, ga, 0, "fused");
  uint32_t c3 = call(p, 13, 2200), c4 = call(p, 211, 2300); /* a memset, then the kernel */
  kiln__prof_leave(p);
  kiln__prof_enter(p, KILN__PROF_EAGER, gz, 0, "fused");
  uint32_t c5 = call(p, 13, 2400), c6 = call(p, 211, 2500); /* its memset the driver's kernel */
  kiln__prof_leave(p);
  kernel(p, c1, "_ZN7cutlass6KernelINS_4gemmEEEvNT_6ParamsE", 3000, 4000, 0);
  kernel(p, c2, "splitKreduce_kernel", 4100, 4300, 0);
  memset_rec(p, c3, 4400, 0);
  kernel(p, c4, "k_add_f32_aa", 4500, 4600, 0);
  kernel(p, 999, "someone_elses_kernel", 4700, 4800, 0); /* no region: its step by time */
  kernel(p, c5, "memset32_aligned1D", 4850, 4870, 0);
  kernel(p, c6, "k_index_add_f32_bb", 4900, 5000, 0);
  kiln__prof_step(p, 1, "fused");
  kiln__prof_stop(p);
  cr_assert_eq(fake.depth, 0, "every push popped");
  const kiln__tl_event *ev;
  size_t n;
  kiln__tl_meta meta;
  cr_assert(kiln__prof_events(p, &ev, &n, &meta));
  cr_assert_eq(n, 15, "7 calls and 8 device records, not %zu", n);
  for (size_t i = 1; i < n; i++)
    cr_assert_leq(ev[i - 1].start, ev[i].start, "sorted by start");
  const kiln__tl_event *k1 = find(ev, n, KILN__TL_KERNEL, c1, 0),
                       *k2 = find(ev, n, KILN__TL_KERNEL, c2, 0);
  cr_assert_str_eq(k1->name, "cublas_gemm_4x4x4", "kiln's name for the call's kernels");
  cr_assert_str_eq(k1->kernel, "cutlass::Kernel");
  cr_assert_str_eq(k2->kernel, "splitKreduce_kernel");
  cr_assert_eq(k1->part * 10 + k1->parts, 12);
  cr_assert_eq(k2->part * 10 + k2->parts, 22);
  cr_assert_float_eq(k1->group_ns, 1200, 1e-9, "the group's time is both kernels'");
  cr_assert_eq(k1->launch_id, k2->launch_id);
  cr_assert_str_eq(k1->launch, "eager");
  cr_assert_str_eq(k1->mode, "fused");
  cr_assert_eq(k1->step, 0);
  const kiln__tl_event *ms = find(ev, n, KILN__TL_MEMSET, c3, 0),
                       *k4 = find(ev, n, KILN__TL_KERNEL, c4, 0);
  cr_assert_eq(ms->group, k4->group, "a launch's memset belongs to its group");
  cr_assert_str_eq(k4->name, "k_add_f32_aa");
  cr_assert_null(k4->kernel, "kiln's name is the kernel's own");
  cr_assert_eq(k4->part, 2);
  cr_assert(k4->carrier && !ms->carrier, "the kernel carries the traffic, not the memset");
  cr_assert(k1->carrier && !k2->carrier, "a library call's first kernel carries it");
  /* a memset the driver runs as a kernel: the kernel named as the group carries it */
  const kiln__tl_event *k5 = find(ev, n, KILN__TL_KERNEL, c5, 0),
                       *k6 = find(ev, n, KILN__TL_KERNEL, c6, 0);
  cr_assert(k5->group == k6->group && k6->group);
  cr_assert(k6->carrier && !k5->carrier);
  cr_assert_neq(k4->launch_id, k1->launch_id);
  const kiln__tl_event *cp = find(ev, n, KILN__TL_MEMCPY, up, 0);
  cr_assert_null(cp->group);
  cr_assert_null(cp->launch);
  cr_assert_eq(cp->step, 0);
  cr_assert_str_eq(cp->name, "memcpy HtoD");
  const kiln__tl_event *other = find(ev, n, KILN__TL_KERNEL, 999, 0);
  cr_assert_eq(other->step, 0, "a record of no region takes the step around it");
  cr_assert_null(other->group);
  cr_assert_str_eq(find(ev, n, KILN__TL_API, c1, 0)->name, "cudaLaunchKernel");
  cr_assert_eq(meta.unattributed, 0);
  cr_assert_eq(meta.first_step, 0);
  cr_assert_eq(meta.last_step, 0);
  kiln__prof_free(p);
}

/* A step graph's replay: one call, its kernels in capture order, given to the groups by the
 * capture's count of their records; by name when the count is off or unknown, or when a
 * generated kernel's place holds no kernel. */
Test(timeline, replays_resolve_by_capture_order_and_by_name) {
  kiln__prof *p = session("10");
  uint32_t g[4] = {add_group(p, 1, "k_first", "elementwise"), add_group(p, 2, "cublas_mm", "gemm"),
                   add_group(p, 3, "k_scatter", "gather"), add_group(p, 4, "cublas_mm2", "gemm")};
  int32_t rec_ok[3] = {1, 2, 2}, rec_unknown[4] = {1, -1, -1, 2};
  uint32_t prog = kiln__prof_program(p, 3, g, rec_ok);
  uint32_t g2[4] = {g[0], g[1], g[3], g[2]}; /* two products in a row */
  uint32_t prog2 = kiln__prof_program(p, 4, g2, rec_unknown);
  kiln__prof_step(p, 3, "graph");
  kiln__prof_enter(p, KILN__PROF_REPLAY, prog, 3, "graph");
  uint32_t r1 = call(p, 311, 100);
  kiln__prof_leave(p);
  /* delivered out of order; two records start together (ordered by graph node) */
  kernel(p, r1, "k_scatter", 900, 950, 14);
  memset_rec(p, r1, 800, 13);
  kernel(p, r1, "k_first", 200, 300, 10);
  kernel(p, r1, "gemm_main", 400, 600, 11);
  kernel(p, r1, "gemm_tail", 400, 700, 12);
  /* the next step: the product launched three kernels this time */
  kiln__prof_step(p, 4, "graph");
  kiln__prof_enter(p, KILN__PROF_REPLAY, prog, 4, "graph");
  uint32_t r2 = call(p, 311, 2000);
  kiln__prof_leave(p);
  kernel(p, r2, "k_first", 2100, 2200, 20);
  for (int k = 0; k < 3; k++)
    kernel(p, r2, "gemm_part", 2300 + 100 * (uint64_t)k, 2350 + 100 * (uint64_t)k,
           21 + (uint64_t)k);
  memset_rec(p, r2, 2700, 24);
  kernel(p, r2, "k_scatter", 2800, 2900, 25);
  /* a program whose counts are unknown, with a product right before its end */
  kiln__prof_step(p, 5, "graph");
  kiln__prof_enter(p, KILN__PROF_REPLAY, prog2, 5, "graph");
  uint32_t r3 = call(p, 311, 4000);
  kiln__prof_leave(p);
  kernel(p, r3, "k_first", 4100, 4200, 30);
  kernel(p, r3, "gemm_x", 4300, 4400, 31);
  kernel(p, r3, "gemm_y", 4500, 4600, 32);
  kernel(p, r3, "k_scatter", 4700, 4800, 33);
  /* the right count, but a memset where the capture put k_first: matched by name */
  kiln__prof_step(p, 6, "graph");
  kiln__prof_enter(p, KILN__PROF_REPLAY, prog, 6, "graph");
  uint32_t r4 = call(p, 311, 6000);
  kiln__prof_leave(p);
  memset_rec(p, r4, 6050, 40);
  kernel(p, r4, "gemm_tail", 6300, 6400, 41);
  kernel(p, r4, "k_first", 6500, 6600, 42);
  memset_rec(p, r4, 6700, 43);
  kernel(p, r4, "k_scatter", 6800, 6900, 44);
  kiln__prof_stop(p);
  const kiln__tl_event *ev;
  size_t n;
  kiln__tl_meta meta;
  cr_assert(kiln__prof_events(p, &ev, &n, &meta));
  int seen[4] = {0};
  for (size_t i = 0; i < n; i++) {
    const kiln__tl_event *e = &ev[i];
    if (e->cat == KILN__TL_API) continue;
    cr_assert(e->group || e->correlation == r3 || e->correlation == r4, "%s at %llu has no group",
              e->name, (unsigned long long)e->start);
    cr_assert_str_eq(e->launch, "graph replay");
    cr_assert_str_eq(e->mode, "graph");
    if (e->correlation == r1) {
      seen[0]++;
      cr_assert_null(e->graph_mismatch);
      if (e->start == 200) cr_assert_str_eq(e->name, "k_first");
      if (e->start == 400) {
        cr_assert_str_eq(e->name, "cublas_mm");
        cr_assert_str_eq(e->kernel, e->graph_node == 11 ? "gemm_main" : "gemm_tail");
        cr_assert_eq(e->part, e->graph_node == 11 ? 1 : 2);
        cr_assert_eq(e->carrier, e->graph_node == 11, "a product's traffic on its first kernel");
        cr_assert_float_eq(e->group_ns, 500, 1e-9);
      }
      if (e->start >= 800) cr_assert_str_eq(e->group->name, "k_scatter");
      cr_assert_eq(e->step, 3);
    } else if (e->correlation == r2) {
      seen[1]++;
      cr_assert_not_null(e->graph_mismatch, "a replay that did not match its capture says so");
      if (e->start >= 2300 && e->start < 2700) cr_assert_str_eq(e->name, "cublas_mm");
      if (e->start >= 2700) cr_assert_str_eq(e->group->name, "k_scatter");
    } else if (e->correlation == r4) {
      seen[3]++;
      cr_assert(e->graph_mismatch && strstr(e->graph_mismatch, "holds a copy or a memset"));
      if (e->start < 6500)
        cr_assert_null(e->group, "records before the first generated kernel are no group's");
      else
        cr_assert_str_eq(e->group->name, e->start == 6500 ? "k_first" : "k_scatter");
      if (e->start == 6700) cr_assert_eq(e->part * 10 + e->parts, 12, "k_scatter's memset");
      /* a generated kernel's traffic on it, not on the memset its launch makes first */
      if (e->start >= 6700) cr_assert_eq(e->carrier, e->start == 6800, "at %llu", e->start);
    } else {
      seen[2]++;
      /* two products between two generated kernels: whose records are whose is not known */
      if (e->start == 4300 || e->start == 4500) {
        cr_assert_null(e->group);
        cr_assert_str_eq(e->name, e->start == 4300 ? "gemm_x" : "gemm_y");
      } else {
        cr_assert_str_eq(e->group->name, e->start == 4100 ? "k_first" : "k_scatter");
      }
    }
  }
  cr_assert_eq(seen[0] * 1000 + seen[1] * 100 + seen[2] * 10 + seen[3], 5645,
               "every record of the replays");
  cr_assert_eq(meta.unattributed, 4, "gemm_x and gemm_y; the memset and gemm_tail");
  cr_assert_eq(meta.first_step, 3);
  cr_assert_eq(meta.last_step, 6);
  kiln__prof_free(p);
}

/* CUPTI has named replayed kernels after others (H100, 2026-12-05: air's moments kernels after a
 * kernel of a context freed before; H200: kernels of air's own): a replay whose counts add up
 * keeps every record in its place, whatever its name, and a misnamed record says so; that holds
 * for a name of another of the program's kernels too (step 8). */
Test(timeline, replays_keep_their_order_when_cupti_misnames_a_kernel) {
  kiln__prof *p = session("10");
  uint32_t g[3] = {add_group(p, 1, "k_first", "elementwise"), add_group(p, 2, "k_moments", "rows"),
                   add_group(p, 3, "k_last", "elementwise")};
  int32_t recs[3] = {1, 2, 1};
  uint32_t prog = kiln__prof_program(p, 3, g, recs);
  const char *names[2] = {"k_softmax_rows_c4d5d926", "k_last"}; /* where k_moments ran */
  uint32_t r[2];
  for (int s = 0; s < 2; s++) {
    uint64_t t = 1000 * (uint64_t)s;
    kiln__prof_step(p, 7 + s, "graph");
    kiln__prof_enter(p, KILN__PROF_REPLAY, prog, 7 + s, "graph");
    r[s] = call(p, 311, t + 100);
    kiln__prof_leave(p);
    kernel(p, r[s], "k_first", t + 200, t + 300, 10 * (uint64_t)s + 1);
    memset_rec(p, r[s], t + 350, 10 * (uint64_t)s + 2);
    kernel(p, r[s], names[s], t + 400, t + 500, 10 * (uint64_t)s + 3);
    kernel(p, r[s], "k_last", t + 600, t + 700, 10 * (uint64_t)s + 4);
  }
  kiln__prof_stop(p);
  const kiln__tl_event *ev;
  size_t n;
  kiln__tl_meta meta;
  cr_assert(kiln__prof_events(p, &ev, &n, &meta));
  int seen = 0;
  for (size_t i = 0; i < n; i++) {
    const kiln__tl_event *e = &ev[i];
    if (e->cat == KILN__TL_API) continue;
    seen++;
    int s = e->correlation == r[1];
    uint64_t at = e->start - 1000 * (uint64_t)s;
    cr_assert_not_null(e->group, "%s at %llu", e->name, (unsigned long long)e->start);
    const char *want = at == 200 ? "k_first" : at == 600 ? "k_last" : "k_moments";
    cr_assert_str_eq(e->group->name, want);
    if (at == 400) {
      cr_assert_str_eq(e->name, "k_moments", "kiln's name for the record");
      cr_assert_str_eq(e->kernel, names[s], "CUPTI's beside it");
      cr_assert(e->graph_mismatch && strstr(e->graph_mismatch, names[s]) &&
                    strstr(e->graph_mismatch, "where the capture put k_moments"),
                "%s", e->graph_mismatch ? e->graph_mismatch : "(none)");
      cr_assert_eq(e->part * 10 + e->parts, 22);
      cr_assert(e->carrier);
    } else {
      cr_assert_null(e->graph_mismatch, "%s", e->graph_mismatch);
    }
  }
  cr_assert_eq(seen, 8);
  cr_assert_eq(meta.unattributed, 0);
  kiln__prof_free(p);
}

/* steps [0, nsteps), each of `launches` eager launches of one kernel */
static void run_steps(kiln__prof *p, uint32_t g, int nsteps, int launches, size_t bound) {
  uint64_t t = 1000;
  for (int s = 0; s < nsteps; s++) {
    kiln__prof_step(p, s, "fused");
    for (int k = 0; k < launches; k++) {
      kiln__prof_enter(p, KILN__PROF_EAGER, g, s, "fused");
      uint32_t c = call(p, 211, t);
      kiln__prof_leave(p);
      kernel(p, c, "k_step", t + 500, t + 900, 0);
      t += 1000;
      if (bound)
        cr_assert_leq(kiln__prof_kept(p), bound, "step %d: %zu records kept", s,
                      kiln__prof_kept(p));
    }
  }
  kiln__prof_stop(p);
}

Test(timeline, a_ring_keeps_the_last_steps_and_stays_bounded) {
  kiln__prof *p = session(NULL); /* the last 100 */
  uint32_t g = add_group(p, 1, "k_step", "elementwise");
  const int steps = 300, launches = 300;
  /* kept: at most twice what the last compaction kept (100 steps of 600 records), plus one */
  run_steps(p, g, steps, launches, 2 * 100 * 2 * (size_t)launches + 1);
  const kiln__tl_event *ev;
  size_t n;
  kiln__tl_meta meta;
  cr_assert(kiln__prof_events(p, &ev, &n, &meta));
  cr_assert_eq(n, 100 * 2 * (size_t)launches, "%zu events", n);
  cr_assert_eq(meta.first_step, 200);
  cr_assert_eq(meta.last_step, 299);
  cr_assert_str_eq(meta.keep, "the last 100 steps");
  /* each record of the kept steps once */
  static unsigned char seen[300 * 300 * 2 + 8];
  for (size_t i = 0; i < n; i++) {
    cr_assert(ev[i].step >= 200 && ev[i].step <= 299);
    cr_assert_lt(ev[i].correlation, sizeof seen);
    seen[ev[i].correlation] += ev[i].cat == KILN__TL_KERNEL ? 1 : 16;
    if (ev[i].cat == KILN__TL_KERNEL) cr_assert_str_eq(ev[i].name, "k_step");
  }
  for (uint32_t c = 1; c <= fake.corr; c++) {
    int step = (int)((c - 1) / launches);
    cr_assert_eq(seen[c], step >= 200 ? 17 : 0, "correlation %u (step %d): %d", c, step, seen[c]);
  }
  kiln__prof_free(p);
}

Test(timeline, a_range_keeps_its_steps) {
  kiln__prof *p = session("10-20");
  uint32_t g = add_group(p, 1, "k_step", "elementwise");
  run_steps(p, g, 40, 10, 0);
  cr_assert_eq(fake.depth, 0);
  /* records of no region: one amid step 15's (kept, as step 15's), one after the range */
  kernel(p, 999998, "stray", 1000 + 155 * 1000 + 700, 1000 + 155 * 1000 + 800, 0);
  kernel(p, 999999, "stray", 1000 + 300 * 1000 + 700, 1000 + 300 * 1000 + 800, 0);
  const kiln__tl_event *ev;
  size_t n;
  kiln__tl_meta meta;
  cr_assert(kiln__prof_events(p, &ev, &n, &meta));
  cr_assert_eq(n, 11 * 2 * 10 + 1, "%zu events", n);
  for (size_t i = 0; i < n; i++) {
    cr_assert(ev[i].step >= 10 && ev[i].step <= 20, "step %lld kept", (long long)ev[i].step);
    cr_assert_neq(ev[i].correlation, 999999, "a record after the range was kept");
    if (ev[i].correlation == 999998) cr_assert_eq(ev[i].step, 15);
  }
  cr_assert_str_eq(meta.keep, "steps 10-20");
  kiln__prof_free(p);
}

Test(timeline, bad_trace_steps_are_errors) {
  const char *bad[] = {"abc", "0", "5-3", "-3", "10-", "7x", "3-x"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char why[256] = "";
    cr_assert_null(kiln__prof_new(&fake_api, bad[i], why, sizeof why), "%s accepted", bad[i]);
    cr_assert(strstr(why, "KILN_TRACE_STEPS=") && strstr(why, bad[i]), "%s: %s", bad[i], why);
  }
}

/* ---------------------------------------------------------------- CUPTI's records */

Test(timeline, cupti_records_convert) {
  CUpti_ActivityKernel10 k;
  memset(&k, 0, sizeof k);
  k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
  k.start = 100;
  k.end = 250;
  k.deviceId = 1;
  k.streamId = 13;
  k.correlationId = 77;
  k.gridX = 64;
  k.gridY = 2;
  k.gridZ = 1;
  k.blockX = 256;
  k.blockY = k.blockZ = 1;
  k.staticSharedMemory = 16;
  k.dynamicSharedMemory = 1024;
  k.registersPerThread = 40;
  k.graphNodeId = 5;
  k.graphId = 2;
  k.name = "k_add_f32";
  kiln__prof_rec r;
  cr_assert(kiln__prof_convert(&k, &r));
  cr_assert_eq(r.kind, KILN__PROF_KERNEL);
  cr_assert_eq(r.start * 1000 + r.end, 100 * 1000 + 250);
  cr_assert_eq(r.device * 100 + r.stream, 113);
  cr_assert_eq(r.correlation, 77);
  cr_assert_eq(r.grid[0] * 100 + r.grid[1] * 10 + r.grid[2], 6421);
  cr_assert_eq(r.block[0], 256);
  cr_assert_eq(r.smem, 1040);
  cr_assert_eq(r.registers, 40);
  cr_assert_eq(r.graph_node * 10 + r.graph_id, 52);
  cr_assert_str_eq(r.name, "k_add_f32");

  CUpti_ActivityMemcpy6 m;
  memset(&m, 0, sizeof m);
  m.kind = CUPTI_ACTIVITY_KIND_MEMCPY;
  m.copyKind = CUPTI_ACTIVITY_MEMCPY_KIND_DTOH;
  m.bytes = 4096;
  m.correlationId = 8;
  m.runtimeCorrelationId = 9;
  cr_assert(kiln__prof_convert(&m, &r));
  cr_assert_eq(r.kind, KILN__PROF_MEMCPY);
  cr_assert_str_eq(r.copy, "DtoH");
  cr_assert_eq(r.bytes, 4096);
  cr_assert_eq(r.correlation * 10 + r.runtime_correlation, 89);

  CUpti_ActivityMemset4 s;
  memset(&s, 0, sizeof s);
  s.kind = CUPTI_ACTIVITY_KIND_MEMSET;
  s.bytes = 64;
  s.memoryKind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
  cr_assert(kiln__prof_convert(&s, &r));
  cr_assert_eq(r.kind, KILN__PROF_MEMSET);
  cr_assert_str_eq(r.copy, "device");

  CUpti_ActivityAPI a;
  memset(&a, 0, sizeof a);
  a.kind = CUPTI_ACTIVITY_KIND_RUNTIME;
  a.cbid = 211;
  a.processId = 4242;
  a.threadId = 7;
  a.correlationId = 3;
  cr_assert(kiln__prof_convert(&a, &r));
  cr_assert_eq(r.kind, KILN__PROF_RUNTIME);
  cr_assert_eq(r.cbid, 211);
  cr_assert_eq(r.device * 10 + r.stream, 42427);
  a.kind = CUPTI_ACTIVITY_KIND_DRIVER;
  cr_assert(!kiln__prof_convert(&a, &r), "the driver calls only make correlations");

  CUpti_ActivityExternalCorrelation x;
  memset(&x, 0, sizeof x);
  x.kind = CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION;
  x.externalKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2;
  x.externalId = 1234567890123ull;
  x.correlationId = 55;
  cr_assert(kiln__prof_convert(&x, &r));
  cr_assert_eq(r.kind, KILN__PROF_EXTERNAL);
  cr_assert_eq(r.external, 1234567890123ull);
  cr_assert_eq(r.correlation, 55);
  x.externalKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;
  cr_assert(!kiln__prof_convert(&x, &r), "another tool's correlations are not kiln's");
}

Test(timeline, kernel_names_for_people) {
  char b[128];
  kiln__prof_short_name("_ZN7cutlass6KernelINS_4gemm6kernel4GemmEEEvNT_6ParamsE", b, sizeof b);
  cr_assert_str_eq(b, "cutlass::Kernel");
  kiln__prof_short_name("_Z17gemv2T_kernel_valIiiLi128ELi16EEvT_", b, sizeof b);
  cr_assert_str_eq(b, "gemv2T_kernel_val");
  kiln__prof_short_name("k_add_relu_f32_v4_0123", b, sizeof b);
  cr_assert_str_eq(b, "k_add_relu_f32_v4_0123");
  kiln__prof_short_name("_Z99short", b, sizeof b);
  cr_assert_str_eq(b, "_Z99short", "a name that lies about its length stays as it is");
  kiln__prof_short_name("_ZN", b, sizeof b);
  cr_assert_str_eq(b, "_ZN");
}

/* ---------------------------------------------------------------- the report */

/* A trace of three steps (spans 10, 30 and 20 us: the median is step 2) written to path. */
static void write_run(const char *path, const char *mode, int kernels) {
  kiln__tl_event ev[64];
  static kiln__tl_group groups[64];
  static char names[64][64];
  size_t n = 0;
  const uint64_t span[3] = {10000, 30000, 20000};
  uint64_t t = 5000000;
  for (int s = 0; s < 3; s++, t += 100000) {
    for (int k = 0; k < kernels; k++) {
      snprintf(names[n], sizeof names[n], "k_s%d_%d_%s%s", s, k, mode, k == 1 ? "_<b>&" : "");
      groups[n] = (kiln__tl_group){.name = names[n],
                                   .kind = k % 3 == 0   ? "gemm"
                                           : k % 3 == 1 ? "elementwise"
                                                        : "reduction",
                                   .nodes = "#1 add [1024,256] bf16",
                                   .index = k,
                                   .bytes_read = 1000000,
                                   .bytes_written = 500000};
      uint64_t len = span[s] / (uint64_t)kernels;
      ev[n] = (kiln__tl_event){.cat = KILN__TL_KERNEL,
                               .start = t + (uint64_t)k * len,
                               .end = t + (uint64_t)k * len + len * 3 / 4,
                               .tid = 13,
                               .name = names[n],
                               .step = s,
                               .mode = mode,
                               .launch = "eager",
                               .group = &groups[n],
                               .launch_id = n + 1,
                               .part = 1,
                               .parts = 1,
                               .carrier = true,
                               .correlation = (uint32_t)n + 1};
      n++;
    }
  }
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  kiln__tl_meta meta = {.mode = mode, .device = "Test GPU", .first_step = 0, .last_step = 2};
  cr_assert(kiln__tl_write_json(f, ev, n, &meta));
  fclose(f);
}

static int count(const char *hay, const char *needle) {
  int c = 0;
  for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
    c++;
  return c;
}

Test(timeline, the_report_is_self_contained_and_shows_the_median_steps) {
  char dir[256], paths[3][512], html[512];
  th_tmpdir(dir, sizeof dir, "report");
  const char *modes[3] = {"unfused", "fused", "graph"};
  const int kernels[3] = {12, 6, 6};
  for (int r = 0; r < 3; r++) {
    snprintf(paths[r], sizeof paths[r], "%s/%s.json", dir, modes[r]);
    write_run(paths[r], modes[r], kernels[r]);
  }
  /* read back: the same records */
  kiln__tl_run run;
  char why[512];
  cr_assert(kiln__tl_read_json(paths[0], &run, why, sizeof why), "%s", why);
  size_t nk = 0;
  for (size_t i = 0; i < run.n; i++)
    if (run.ev[i].cat == KILN__TL_KERNEL) {
      nk++;
      cr_assert_not_null(run.ev[i].group);
      cr_assert_str_eq(run.ev[i].group->nodes, "#1 add [1024,256] bf16");
      cr_assert_eq(run.ev[i].group->bytes_read, 1000000);
      cr_assert(run.ev[i].carrier, "the record with the traffic carries it when read back");
    }
  cr_assert_eq(nk, 36);
  cr_assert_str_eq(run.mode, "unfused");
  kiln__tl_run_free(&run);

  snprintf(html, sizeof html, "%s/report.html", dir);
  kiln_ctx *ctx = th_cpu_ctx();
  const char *tp[3] = {paths[0], paths[1], paths[2]};
  cr_assert_eq(kiln_trace_report(ctx, html, "cnn: <fused> & unfused", 3, tp, modes), KILN_OK, "%s",
               th_err(ctx));
  char *h = th_read_whole(html, NULL);
  cr_assert(strncmp(h, "<!DOCTYPE html>", 15) == 0);
  cr_assert(strstr(h, "</html>"));
  /* nothing fetched, nothing run */
  const char *banned[] = {"<script", "<link", "src=", "href=", "@import", "url(", "<iframe"};
  for (size_t i = 0; i < sizeof banned / sizeof banned[0]; i++)
    cr_assert_null(strstr(h, banned[i]), "the report has %s", banned[i]);
  cr_assert_eq(count(h, "http"), count(h, "http://www.w3.org/2000/svg"),
               "no address but SVG's namespace");
  cr_assert_eq(count(h, "<svg"), 2, "the timelines and the time by kind");
  cr_assert(strstr(h, "cnn: &lt;fused&gt; &amp; unfused"), "the title, escaped");
  for (int r = 0; r < 3; r++) {
    char want[128];
    snprintf(want, sizeof want, "<h2>%s</h2>", modes[r]);
    cr_assert(strstr(h, want), "no table for %s", modes[r]);
    /* the median step (2) of each, every kernel of it drawn; the other steps not */
    for (int k = 0; k < kernels[r]; k++) {
      snprintf(want, sizeof want, "<title>k_s2_%d_%s", k, modes[r]);
      cr_assert(strstr(h, want), "%s's kernel %d of step 2 is not drawn", modes[r], k);
    }
    snprintf(want, sizeof want, "k_s0_0_%s", modes[r]);
    cr_assert_null(strstr(h, want), "step 0 is not the median");
    snprintf(want, sizeof want, "k_s1_0_%s", modes[r]);
    cr_assert_null(strstr(h, want), "step 1 is not the median");
  }
  cr_assert(strstr(h, "k_s2_1_unfused_&lt;b&gt;&amp;"), "kernel names escaped");
  cr_assert_null(strstr(h, "_<b>&"));
  cr_assert(strstr(h, "step 2 (the median of 3)"));
  free(h);
  /* a trace that is not one: an error that names it */
  char bad[512];
  snprintf(bad, sizeof bad, "%s/bad.json", dir);
  th_write_whole(bad, "{\"traceEvents\": 3}", 18);
  const char *bp[1] = {bad};
  cr_assert_eq(kiln_trace_report(ctx, html, NULL, 1, bp, NULL), KILN_ERR_FORMAT);
  cr_assert(strstr(kiln_ctx_error(ctx), bad), "%s", kiln_ctx_error(ctx));
  kiln_ctx_clear_error(ctx);
  th_ctx_free(ctx);
}

/* profile_step --report: the same report from the command line. */
Test(timeline, profile_step_writes_the_report) {
  char dir[256], paths[3][512], cmd[4096], html[600];
  th_tmpdir(dir, sizeof dir, "psreport");
  const char *modes[3] = {"unfused", "fused", "graph"};
  for (int r = 0; r < 3; r++) {
    snprintf(paths[r], sizeof paths[r], "%s/cnn_%s.json", dir, modes[r]);
    write_run(paths[r], modes[r], 4);
  }
  snprintf(html, sizeof html, "%s/cnn.html", dir);
  snprintf(cmd, sizeof cmd, "'%s/profile_step' --report '%s' '%s' '%s' '%s' > '%s/out' 2>&1",
           KILN_BINARY_DIR, html, paths[0], paths[1], paths[2], dir);
  int rc = system(cmd);
  cr_assert(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "profile_step --report failed: %s",
            th_read_whole(strcat(strcpy(cmd, dir), "/out"), NULL));
  char *h = th_read_whole(html, NULL);
  cr_assert(strstr(h, "<h2>cnn_unfused.json</h2>") || strstr(h, "<h2>unfused</h2>"));
  cr_assert(strstr(h, "<svg"));
  free(h);
  snprintf(cmd, sizeof cmd, "'%s/profile_step' --report '%s' '%s/none.json' > '%s/out' 2>&1",
           KILN_BINARY_DIR, html, dir, dir);
  rc = system(cmd);
  cr_assert(WIFEXITED(rc) && WEXITSTATUS(rc) == 1, "a missing trace is an error");
  snprintf(cmd, sizeof cmd, "%s/out", dir);
  char *out = th_read_whole(cmd, NULL);
  cr_assert(strstr(out, "none.json"), "the message names the missing trace: %s", out);
  free(out);
  /* tools/trace_summary.py reads the same files (where there is a python3) */
  snprintf(cmd, sizeof cmd,
           "command -v python3 > /dev/null || { echo 'median span 18.8 us over 3 steps (no "
           "python3)'; exit 0; }; "
           "python3 '%s/tools/trace_summary.py' '%s' > '%s/out' 2>&1",
           KILN_SOURCE_DIR, paths[1], dir);
  rc = system(cmd);
  snprintf(cmd, sizeof cmd, "%s/out", dir);
  out = th_read_whole(cmd, NULL);
  cr_assert(WIFEXITED(rc) && WEXITSTATUS(rc) == 0 &&
                strstr(out, "median span 18.8 us over 3 steps"),
            "trace_summary.py: %s", out);
  free(out);
}

/* ---------------------------------------------------------------- without CUPTI or a GPU */

/* Whether libcupti is mapped into this process (/proc files have no size: read by line). */
static bool cupti_mapped(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  cr_assert_not_null(f);
  char line[4096];
  bool mapped = false, any = false;
  while (fgets(line, sizeof line, f)) {
    any = true;
    mapped |= strstr(line, "libcupti") != NULL;
  }
  fclose(f);
  cr_assert(any, "/proc/self/maps is empty");
  return mapped;
}

Test(timeline, without_cupti_the_error_says_what_is_missing) {
  setenv("KILN_CUPTI_LIBRARY", "/nonexistent/libcupti.so.13", 1);
  char why[1024];
  cr_assert(!kiln__prof_load(why, sizeof why));
  cr_assert(strstr(why, "KILN_CUPTI_LIBRARY=/nonexistent/libcupti.so.13"), "%s", why);
  cr_assert(strstr(why, "libcupti"), "%s", why);
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "nocupti");
  snprintf(path, sizeof path, "%s/t.json", dir);
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert_eq(kiln_trace_begin(ctx, path), KILN_ERR_STATE);
  const char *e = kiln_ctx_error(ctx);
  cr_assert(strstr(e, "kiln_trace_begin") && strstr(e, "no GPU") &&
                strstr(e, "KILN_CUPTI_LIBRARY=/nonexistent/libcupti.so.13"),
            "%s", e);
  cr_assert_neq(access(path, F_OK), 0, "no file is written");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_trace_end(ctx), KILN_ERR_STATE);
  cr_assert(strstr(kiln_ctx_error(ctx), "not being traced"), "%s", kiln_ctx_error(ctx));
  kiln_ctx_clear_error(ctx);
  cr_assert(!cupti_mapped());
  th_ctx_free(ctx);
}

Test(timeline, without_a_gpu_the_error_says_so) {
  unsetenv("KILN_CUPTI_LIBRARY");
  char why[1024];
  if (!kiln__prof_load(why, sizeof why)) cr_skip_test("CUPTI is not installed here: %s", why);
  cr_assert(cupti_mapped());
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert_eq(kiln_trace_begin(ctx, "/tmp/kiln-never-written.json"), KILN_ERR_STATE);
  const char *e = kiln_ctx_error(ctx);
  cr_assert(strstr(e, "no GPU") && !strstr(e, "CUPTI"), "%s", e);
  cr_assert_eq(kiln_trace_begin(ctx, "/tmp/x.json"), KILN_ERR_STATE, "a failed context stays so");
  kiln_ctx_clear_error(ctx);
  th_ctx_free(ctx);
}

/* Tracing off: a step planned and compiled, tensors read and freed, and CUPTI never loaded. */
Test(timeline, nothing_traced_loads_no_cupti) {
  unsetenv("KILN_TRACE");
  cr_assert(!cupti_mapped());
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(64, 64));
  for (int s = 0; s < 3; s++) {
    kiln_step_begin(ctx);
    kiln_tensor *y = kiln_sum(kiln_relu(kiln_add(a, a)), KILN_ALL_AXES, 0);
    cr_assert_not_null(y);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  cr_assert_null(ctx->prof);
  kiln_tensor_free(a);
  th_ctx_free(ctx);
  cr_assert(!cupti_mapped(), "CUPTI was loaded with nothing traced");
}

/* KILN_TRACE where nothing can be traced: a warning, and the context goes on. */
Test(timeline, kiln_trace_without_a_gpu_is_a_warning) {
  char dir[256], path[512];
  th_tmpdir(dir, sizeof dir, "envtrace");
  snprintf(path, sizeof path, "%s/t.json", dir);
  setenv("KILN_TRACE", path, 1);
  setenv("KILN_CUPTI_LIBRARY", "/nonexistent/libcupti.so", 1);
  kiln_ctx *ctx = kiln_ctx_new(&(kiln_ctx_options){.no_gpu = 1});
  cr_assert_null(kiln_ctx_error(ctx), "%s", kiln_ctx_error(ctx));
  cr_assert_null(ctx->prof);
  th_ctx_free(ctx);
  cr_assert_neq(access(path, F_OK), 0);
  unsetenv("KILN_TRACE");
}
