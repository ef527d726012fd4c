/*
 * prof.h: kiln's timeline recorder, what fusion/ and runtime/ see of prof/. A trace (ctx->prof,
 * kiln_trace_begin) is a session (session.c) fed from two sides:
 *
 *   the host   fusion/ says which launch each CUDA call belongs to before it makes them: an
 *              eager group (kiln__prof_enter with the group's description, interned once) or a
 *              step graph's replay (with the graph's groups and how many device records each
 *              group's captured nodes make); runtime/ says when a step begins. Each such region
 *              is an id pushed as CUPTI's external correlation id, so that CUPTI ties every CUDA
 *              call made inside it, and through it the kernels, copies and memsets it launched,
 *              to the launch (kiln__prof_api).
 *   the device CUPTI's activity records (cupti.c converts them to kiln__prof_rec) arrive in
 *              buffers on CUPTI's thread and are kept, the last KILN_TRACE_STEPS steps of them.
 *
 * At the end the records are resolved into timeline events (timeline.h): an eager launch's
 * records through their correlation ids; a replay's records, all of one cudaGraphLaunch, in
 * order on the stream, the first group's count of them to the first group and so on (a graph
 * captured from one stream runs its nodes in capture order), each checked against the kernel's
 * name (a misnamed record keeps its place and says so: session.c's by_count). cupti.c loads CUPTI
 * with dlopen, holds the process's one active session (CUPTI's buffer callbacks take no user
 * pointer), and starts and ends traces for runtime/.
 *
 * Tracing off (ctx->prof NULL), none of this runs: every hook is behind that test.
 */
#ifndef KILN_PROF_H
#define KILN_PROF_H

#include "../core/internal.h"
#include "timeline.h"

typedef struct kiln__prof kiln__prof;

/* ---------------------------------------------------------------- the context's side (cupti.c) */

/* Starts a trace of ctx to path: loads CUPTI, checks the GPU, opens the file, enables CUPTI's
 * activity records. On failure nothing is left running and why says what is missing. */
kiln_status kiln__prof_begin(kiln_ctx *ctx, const char *path, char *why, size_t n);
/* Ends ctx's trace: waits for its stream, collects the records, writes the file. */
kiln_status kiln__prof_end(kiln_ctx *ctx, char *why, size_t n);
/* Loads CUPTI (once a process): $KILN_CUPTI_LIBRARY when set, else libcupti.so.13, libcupti.so
 * and the toolkit's copy; false with why naming what was tried. */
bool kiln__prof_load(char *why, size_t n);

/* The mode and step kiln is in: "unfused" (fusion off), "graph" (step graphs on) or "fused";
 * the step is the context's, counted from 0 at its first kiln_step_begin (-1 before it). */
static inline const char *kiln__prof_mode(const kiln_ctx *ctx) {
  return !ctx->fusion ? "unfused" : ctx->graphs ? "graph" : "fused";
}
static inline int64_t kiln__prof_step_of(const kiln_ctx *ctx) { return (int64_t)ctx->gen - 2; }

/* ---------------------------------------------------------------- sessions (session.c) */

/* What the session asks of CUPTI (cupti.c's, or a test's stand-ins): push and pop an external
 * correlation id on the calling thread (0: done), and a runtime call's name by its id. */
typedef struct kiln__prof_api {
  int (*push)(uint64_t id);
  int (*pop)(void);
  const char *(*api_name)(uint32_t cbid);
} kiln__prof_api;

/* A new session; keep is KILN_TRACE_STEPS ("100": the last 100 steps; "10-20": steps 10 to 20;
 * NULL or "": the last 100). NULL with why on a bad keep or out of host memory. */
kiln__prof *kiln__prof_new(const kiln__prof_api *api, const char *keep, char *why, size_t n);
void kiln__prof_free(kiln__prof *p);

#define KILN__PROF_NONE UINT32_MAX

/* A group described once: find gives the id of the description added under key (a hash of
 * what identifies the launch, cheap to make), KILN__PROF_NONE when there is none; add interns g
 * (its strings copied) under key. */
uint32_t kiln__prof_group_find(kiln__prof *p, uint64_t key);
uint32_t kiln__prof_group_add(kiln__prof *p, uint64_t key, const kiln__tl_group *g);
/* A step graph: its n groups' ids, and the device records each group's captured nodes make
 * (kernels, copies, memsets; -1 where that is not known). */
uint32_t kiln__prof_program(kiln__prof *p, int n, const uint32_t *groups, const int32_t *records);
/* A number no other session of the process has: a step graph keeps its program's id with the
 * serial of the session it belongs to. */
uint64_t kiln__prof_serial(const kiln__prof *p);

typedef enum kiln__prof_how {
  KILN__PROF_STEP,      /* the base region of a step: CUDA calls outside any launch */
  KILN__PROF_EAGER,     /* a group launched by an eager flush */
  KILN__PROF_FIRST_RUN, /* a group launched by a step graph's first run, before its capture */
  KILN__PROF_REPLAY,    /* a step graph's replay (id: a program) */
} kiln__prof_how;

/* A launch region begins (id: a group's, or for REPLAY a program's) or ends. */
void kiln__prof_enter(kiln__prof *p, kiln__prof_how how, uint32_t id, int64_t step,
                      const char *mode);
void kiln__prof_leave(kiln__prof *p);
/* A step begins (or the trace does): the base region becomes step's. stop pops it (the trace
 * ends). */
void kiln__prof_step(kiln__prof *p, int64_t step, const char *mode);
void kiln__prof_stop(kiln__prof *p);

/* One CUPTI record, as plain C (cupti.c's kiln__prof_convert). */
typedef enum kiln__prof_kind {
  KILN__PROF_KERNEL = 1,
  KILN__PROF_MEMCPY,
  KILN__PROF_MEMSET,
  KILN__PROF_RUNTIME,  /* a CUDA runtime call (host) */
  KILN__PROF_EXTERNAL, /* correlation: external id -> CUPTI correlation id */
} kiln__prof_kind;

typedef struct kiln__prof_rec {
  kiln__prof_kind kind;
  uint32_t device, stream; /* RUNTIME: the OS process and thread */
  uint32_t correlation;
  uint32_t runtime_correlation; /* MEMCPY: the runtime call's (CUPTI gives both) */
  uint32_t cbid;                /* RUNTIME: which call */
  uint64_t start, end;          /* ns */
  uint64_t bytes;               /* MEMCPY, MEMSET */
  const char *copy; /* MEMCPY: "HtoD", "DtoH", ...; MEMSET: the memory's kind ("device") */
  uint64_t graph_node, external;
  uint32_t graph_id;
  int32_t grid[3], block[3];
  uint32_t smem, registers;
  const char *name; /* KERNEL: CUPTI's (copied when kept) */
} kiln__prof_rec;

/* CUPTI's activity record (a CUpti_Activity *) as a plain one; false for the kinds kiln does
 * not keep (the driver calls, whose only use is their external correlation records). */
bool kiln__prof_convert(const void *activity, kiln__prof_rec *out);
/* Keeps a record (from CUPTI's thread); old steps' records go as new ones come. */
void kiln__prof_ingest(kiln__prof *p, const kiln__prof_rec *r);
/* Records CUPTI dropped for want of buffer space, for the file. */
void kiln__prof_dropped(kiln__prof *p, uint64_t n);
/* The records kept, resolved (valid until kiln__prof_free): sorted by start, with meta. False
 * out of host memory. */
bool kiln__prof_events(kiln__prof *p, const kiln__tl_event **ev, size_t *n, kiln__tl_meta *meta);
/* How many records are kept now (for the ring's tests). */
size_t kiln__prof_kept(kiln__prof *p);

/* A kernel's name for people: a mangled C++ name's qualified function name
 * ("_ZN7cutlass6KernelI..." -> "cutlass::Kernel"), any other name itself. */
void kiln__prof_short_name(const char *name, char *buf, size_t n);

#endif
