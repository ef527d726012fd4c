/*
 * timeline.h: a step's timeline as plain C records, and the two files made from them: the
 * Chrome / Perfetto trace-event JSON (timeline.c) and the HTML report that puts several traces
 * one above the other (report.c). Nothing here knows CUPTI, CUDA or a context: the recorder
 * (prof/session.c, fed by prof/cupti.c) turns CUPTI's activity records into these, and the tests
 * make them up. The JSON is read back (timeline.c, with cJSON) for the report.
 *
 * Times are nanoseconds on CUPTI's clock; the JSON writes microseconds from an origin.
 */
#ifndef KILN_TIMELINE_H
#define KILN_TIMELINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* What kiln knows of one launch (a group of the plan), recorded on the host at launch or
 * capture: none of it comes from the device. */
typedef struct kiln__tl_group {
  const char *name;  /* kiln's name: the generated kernel's, or the BLAS call's */
  const char *kind;  /* "elementwise", "reduction", "rows", "update", "gather", "window", "conv",
                      * "moments", "augment", "gemm" */
  const char *nodes; /* the trace nodes it covers, one a line: "#12 add [128,512] f32" */
  int32_t index;     /* its place among the groups of its flush or step graph */
  uint64_t bytes_read, bytes_written; /* kiln's estimate (0: none) */
  uint64_t flops;                     /* a product's 2 m n k (0: not a product) */
  uint32_t grid[3], block, smem;      /* the launch kiln asked for (0: a library call) */
} kiln__tl_group;

typedef enum kiln__tl_cat {
  KILN__TL_KERNEL,
  KILN__TL_MEMCPY,
  KILN__TL_MEMSET,
  KILN__TL_API,  /* a CUDA runtime call on the host */
  KILN__TL_STEP, /* a step's span on one stream (made by the writer, or read back) */
} kiln__tl_cat;

/* The trace-event pid of device 0's records: past Linux's largest process id (2^22). */
#define KILN__TL_GPU_PID 4194304u

/* One record of the timeline. */
typedef struct kiln__tl_event {
  kiln__tl_cat cat;
  uint64_t start, end; /* ns */
  uint32_t pid, tid;   /* device activity: the CUDA device and CUPTI's stream id; API: the OS
                        * process and thread */
  const char *name;    /* kiln's name for the launch, else the kernel's or the call's own */
  const char *kernel;  /* the kernel's own name where it differs from name (a cuBLAS kernel) */
  int64_t step;        /* the step it belongs to (from 0); -1: before the first step */
  const char *mode;    /* "unfused", "fused" or "graph": the context's mode; NULL: unknown */
  const char *launch;  /* "eager", "graph first run" or "graph replay"; NULL: not kiln's */
  const kiln__tl_group *group; /* kiln's launch it belongs to, or NULL */
  uint64_t launch_id;          /* eager: the launch's serial; replay: the replay's (0: none) */
  int part, parts;  /* its place among the device records of its group (1-based; 0: none) */
  bool carrier;     /* the one of them that carries the group's traffic and work: its first kernel
                     * (a generated kernel's launch sets memory before it), else its first record */
  double group_ns;  /* the device time of all the group's records (rates are over it) */
  uint64_t bytes;   /* memcpy, memset: bytes moved */
  const char *copy; /* memcpy: "HtoD", "DtoH", "DtoD", ...; memset: the memory kind */
  uint32_t correlation;
  uint64_t graph_node; /* from a graph launch: CUPTI's node id (0: none) */
  uint32_t graph_id;
  int32_t grid[3], block[3];  /* kernel: as the device ran it */
  uint32_t smem, registers;   /* kernel: static + dynamic shared memory, registers a thread */
  const char *graph_mismatch; /* a replay whose records did not match its capture: why */
} kiln__tl_event;

/* What the file says besides its events (its "otherData"). */
typedef struct kiln__tl_meta {
  const char *mode;              /* the context's mode at the trace's last step */
  const char *device;            /* the GPU's name, or NULL */
  const char *cupti;             /* the libcupti loaded, or NULL */
  const char *keep;              /* "the last 100 steps", "steps 10-20" */
  int64_t first_step, last_step; /* the steps kept (-2: none) */
  uint64_t dropped;              /* records CUPTI dropped (no buffer space) */
  uint64_t unattributed;         /* device records of kiln's launches that were given to no group */
} kiln__tl_meta;

/* Writes the events (any order; written sorted by start) as a trace-event JSON object:
 * "traceEvents" with a name for every process and thread, one "X" event a record, one "X" event
 * a step and stream spanning that step's records there, and meta as "otherData". False when
 * writing failed or host memory ran out. */
bool kiln__tl_write_json(FILE *f, const kiln__tl_event *ev, size_t n, const kiln__tl_meta *meta);

/* A trace read back from its JSON (for the report): its events, their groups and strings point
 * into the parsed document, which the run owns. */
typedef struct kiln__tl_run {
  char *title;
  void *doc; /* the parsed cJSON document */
  kiln__tl_event *ev;
  size_t n;
  kiln__tl_group *groups; /* one per event with kiln's group (ev[i].group points here) */
  const char *mode, *device;
} kiln__tl_run;

/* Reads the trace at path; false with the reason in why. */
bool kiln__tl_read_json(const char *path, kiln__tl_run *run, char *why, size_t n);
void kiln__tl_run_free(kiln__tl_run *run);

/* The HTML report of runs (traces of the same work, in different modes, say): for each, the
 * step whose device span is the median of its steps; the steps' timelines one above the other
 * on one time axis, and each step's kernels by time (share of the step, memory traffic, GB/s).
 * Self-contained: inline CSS and SVG, no script, nothing fetched. False when writing failed or
 * host memory ran out. */
bool kiln__tl_report(FILE *f, const char *title, const kiln__tl_run *runs, int nruns);

#endif
