/*
 * test_cpu_timeline.c: timeline traces without a GPU (issue 26). The trace-event JSON written
 * from made-up records, parsed back with cJSON (valid, every record once, names, arguments,
 * steps nesting their records); CUPTI's record structs converted (the recorder's session is
 * test_cpu_trace_session.c's); the HTML report
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
