/*
 * test_cpu_trace_session.c: the timeline recorder's session (prof/session.c) without a GPU,
 * driven with CUPTI's records as a test makes them: eager launches through correlation ids, step
 * graph replays by capture order (misnamed records kept in place) and by name, the ring of steps,
 * a range of steps, bad step settings. The JSON and the report are test_cpu_timeline.c's.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "internal.h"
#include "prof/prof.h"
#include "prof/timeline.h"

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
