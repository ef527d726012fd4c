/*
 * cupti.c: CUPTI, loaded at run time, and traces started and ended for runtime/ (prof.h).
 *
 * kiln does not link libcupti: kiln_trace_begin dlopens it (the file $KILN_CUPTI_LIBRARY names,
 * else libcupti.so.13, libcupti.so, then the toolkit's copy that the build found) and looks up
 * the eleven functions it calls, with the types of the toolkit's headers, checking that the
 * library's API version is the headers' major version (CUPTI's records change layout between
 * major versions). Nothing here runs unless a trace is asked for.
 *
 * The state below is the process's, an exception to "no globals": CUPTI's activity records are
 * the whole process's and its buffer callbacks take no user pointer, so the one session being
 * recorded (one context traces at a time) is found here. The completed-buffer callback runs on
 * CUPTI's thread (or inside cuptiActivityFlushAll); it takes the lock, which is never held
 * while CUPTI is called from here.
 */
#include <cuda_runtime_api.h>
#include <cupti_activity.h>
#include <cupti_callbacks.h>
#include <cupti_version.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "prof.h"

#ifndef KILN_CUPTI_PATH
#define KILN_CUPTI_PATH "/usr/local/cuda/lib64/libcupti.so"
#endif
#define BUFFER_BYTES ((size_t)8 << 20) /* one activity buffer */
#define KILN_EXTERNAL_KIND CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2

static struct {
  pthread_mutex_t lock;
  bool loaded, registered;
  void *lib;
  char path[512];
  __typeof__(cuptiGetVersion) *get_version;
  __typeof__(cuptiGetResultString) *result_string;
  __typeof__(cuptiActivityEnable) *enable;
  __typeof__(cuptiActivityDisable) *disable;
  __typeof__(cuptiActivityRegisterCallbacks) *register_callbacks;
  __typeof__(cuptiActivityFlushAll) *flush_all;
  __typeof__(cuptiActivityGetNextRecord) *next_record;
  __typeof__(cuptiActivityGetNumDroppedRecords) *num_dropped;
  __typeof__(cuptiActivityPushExternalCorrelationId) *push;
  __typeof__(cuptiActivityPopExternalCorrelationId) *pop;
  __typeof__(cuptiGetCallbackName) *callback_name;
  /* the trace being recorded (busy from its begin to its end) */
  bool busy;
  kiln__prof *active;
  FILE *out;
  char out_path[512];
  char device[256];
} cupti = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* The activity kinds a trace enables: the device's work, the runtime calls (kept for the host
 * track), the driver calls (whose records kiln does not keep: without them CUPTI makes no
 * external correlation for the copies and memsets the driver launches) and the correlations. */
static const CUpti_ActivityKind trace_kinds[] = {
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
    CUPTI_ACTIVITY_KIND_MEMCPY,
    CUPTI_ACTIVITY_KIND_MEMSET,
    CUPTI_ACTIVITY_KIND_RUNTIME,
    CUPTI_ACTIVITY_KIND_DRIVER,
    CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
};
static const char *const trace_kind_names[] = {
    "CONCURRENT_KERNEL", "MEMCPY", "MEMSET", "RUNTIME", "DRIVER", "EXTERNAL_CORRELATION"};
#define NKINDS ((int)(sizeof trace_kinds / sizeof trace_kinds[0]))

/* ---------------------------------------------------------------- loading */

/* Looks up every function; false with why naming the first one missing. */
static bool lookup(void *lib, const char *path, char *why, size_t n) {
  struct {
    const char *name;
    void *slot; /* the function pointer to set */
  } fns[] = {
      {"cuptiGetVersion", &cupti.get_version},
      {"cuptiGetResultString", &cupti.result_string},
      {"cuptiActivityEnable", &cupti.enable},
      {"cuptiActivityDisable", &cupti.disable},
      {"cuptiActivityRegisterCallbacks", &cupti.register_callbacks},
      {"cuptiActivityFlushAll", &cupti.flush_all},
      {"cuptiActivityGetNextRecord", &cupti.next_record},
      {"cuptiActivityGetNumDroppedRecords", &cupti.num_dropped},
      {"cuptiActivityPushExternalCorrelationId", &cupti.push},
      {"cuptiActivityPopExternalCorrelationId", &cupti.pop},
      {"cuptiGetCallbackName", &cupti.callback_name},
  };
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
    void *sym = dlsym(lib, fns[i].name);
    if (!sym) {
      snprintf(why, n, "%s has no %s: it is not the CUPTI kiln needs (CUDA %d's libcupti)", path,
               fns[i].name, CUPTI_API_VERSION / 10000);
      return false;
    }
    memcpy(fns[i].slot, &sym, sizeof sym); /* POSIX: a function's address as a void * */
  }
  return true;
}

bool kiln__prof_load(char *why, size_t n) {
  pthread_mutex_lock(&cupti.lock);
  if (cupti.loaded) {
    pthread_mutex_unlock(&cupti.lock);
    return true;
  }
  const char *env = getenv("KILN_CUPTI_LIBRARY");
  const char *tries[3] = {"libcupti.so.13", "libcupti.so", KILN_CUPTI_PATH};
  int ntries = 3;
  if (env && *env) {
    tries[0] = env;
    ntries = 1;
  }
  char tried[640] = "";
  size_t k = 0;
  void *lib = NULL;
  const char *path = NULL;
  for (int i = 0; i < ntries && !lib; i++) {
    lib = dlopen(tries[i], RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      path = tries[i];
    } else if (k < sizeof tried) {
      const char *e = dlerror();
      int w = snprintf(tried + k, sizeof tried - k, "%s%.150s", k ? "; " : "", e ? e : tries[i]);
      k += w > 0 ? (size_t)w : 0;
    }
  }
  bool ok = lib != NULL;
  if (!ok && env && *env)
    snprintf(why, n,
             "CUPTI could not be loaded from KILN_CUPTI_LIBRARY=%s (%s). Point KILN_CUPTI_LIBRARY "
             "at the CUDA toolkit's libcupti.so (in its lib64, or extras/CUPTI/lib64), or unset "
             "it to search the usual places",
             env, tried);
  else if (!ok)
    snprintf(why, n,
             "CUPTI (libcupti, the CUDA toolkit's profiling library) could not be loaded (%s). It "
             "ships with the toolkit, in its lib64 or extras/CUPTI/lib64: set KILN_CUPTI_LIBRARY "
             "to its path, or put its folder on LD_LIBRARY_PATH",
             tried);
  ok = ok && lookup(lib, path, why, n);
  uint32_t version = 0;
  if (ok && (cupti.get_version(&version) != CUPTI_SUCCESS ||
             version / 10000 != CUPTI_API_VERSION / 10000)) {
    snprintf(why, n,
             "%s has CUPTI API version %u; kiln was built with CUDA %d's (%u), whose activity "
             "records it reads: point KILN_CUPTI_LIBRARY at CUDA %d's libcupti",
             path, version, CUPTI_API_VERSION / 10000, CUPTI_API_VERSION,
             CUPTI_API_VERSION / 10000);
    ok = false;
  }
  if (ok) {
    cupti.lib = lib;
    cupti.loaded = true;
    snprintf(cupti.path, sizeof cupti.path, "%s", path);
  } else if (lib) {
    dlclose(lib);
  }
  pthread_mutex_unlock(&cupti.lock);
  return ok;
}

/* ---------------------------------------------------------------- records */

static const char *copy_name(uint8_t kind) {
  switch (kind) {
  case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
  case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
  case CUPTI_ACTIVITY_MEMCPY_KIND_HTOA: return "HtoA";
  case CUPTI_ACTIVITY_MEMCPY_KIND_ATOH: return "AtoH";
  case CUPTI_ACTIVITY_MEMCPY_KIND_ATOA: return "AtoA";
  case CUPTI_ACTIVITY_MEMCPY_KIND_ATOD: return "AtoD";
  case CUPTI_ACTIVITY_MEMCPY_KIND_DTOA: return "DtoA";
  case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
  case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
  case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "PtoP";
  default: return "copy";
  }
}

static const char *memory_name(unsigned kind) {
  switch (kind) {
  case CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE: return "pageable";
  case CUPTI_ACTIVITY_MEMORY_KIND_PINNED: return "pinned";
  case CUPTI_ACTIVITY_MEMORY_KIND_DEVICE: return "device";
  case CUPTI_ACTIVITY_MEMORY_KIND_ARRAY: return "array";
  case CUPTI_ACTIVITY_MEMORY_KIND_MANAGED: return "managed";
  default: return "memory";
  }
}

bool kiln__prof_convert(const void *activity, kiln__prof_rec *o) {
  const CUpti_Activity *a = activity;
  memset(o, 0, sizeof *o);
  switch (a->kind) {
  case CUPTI_ACTIVITY_KIND_KERNEL:
  case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
    const CUpti_ActivityKernel10 *k = activity;
    o->kind = KILN__PROF_KERNEL;
    o->start = k->start;
    o->end = k->end;
    o->device = k->deviceId;
    o->stream = k->streamId;
    o->correlation = k->correlationId;
    o->grid[0] = k->gridX;
    o->grid[1] = k->gridY;
    o->grid[2] = k->gridZ;
    o->block[0] = k->blockX;
    o->block[1] = k->blockY;
    o->block[2] = k->blockZ;
    o->smem = (uint32_t)(k->staticSharedMemory + k->dynamicSharedMemory);
    o->registers = k->registersPerThread;
    o->graph_node = k->graphNodeId;
    o->graph_id = k->graphId;
    o->name = k->name;
    return true;
  }
  case CUPTI_ACTIVITY_KIND_MEMCPY: {
    const CUpti_ActivityMemcpy6 *m = activity;
    o->kind = KILN__PROF_MEMCPY;
    o->start = m->start;
    o->end = m->end;
    o->device = m->deviceId;
    o->stream = m->streamId;
    o->correlation = m->correlationId;
    o->runtime_correlation = m->runtimeCorrelationId;
    o->bytes = m->bytes;
    o->copy = copy_name(m->copyKind);
    o->graph_node = m->graphNodeId;
    o->graph_id = m->graphId;
    return true;
  }
  case CUPTI_ACTIVITY_KIND_MEMSET: {
    const CUpti_ActivityMemset4 *m = activity;
    o->kind = KILN__PROF_MEMSET;
    o->start = m->start;
    o->end = m->end;
    o->device = m->deviceId;
    o->stream = m->streamId;
    o->correlation = m->correlationId;
    o->bytes = m->bytes;
    o->copy = memory_name(m->memoryKind);
    o->graph_node = m->graphNodeId;
    o->graph_id = m->graphId;
    return true;
  }
  case CUPTI_ACTIVITY_KIND_RUNTIME: {
    const CUpti_ActivityAPI *c = activity;
    o->kind = KILN__PROF_RUNTIME;
    o->start = c->start;
    o->end = c->end;
    o->device = c->processId;
    o->stream = c->threadId;
    o->correlation = c->correlationId;
    o->cbid = c->cbid;
    return true;
  }
  case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
    const CUpti_ActivityExternalCorrelation *x = activity;
    if (x->externalKind != KILN_EXTERNAL_KIND) return false;
    o->kind = KILN__PROF_EXTERNAL;
    o->correlation = x->correlationId;
    o->external = x->externalId;
    return true;
  }
  default: return false;
  }
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, BUFFER_BYTES);
  *size = *buffer ? BUFFER_BYTES : 0;
  *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t *buffer,
                                      size_t size, size_t valid) {
  (void)context;
  (void)stream;
  (void)size;
  pthread_mutex_lock(&cupti.lock);
  CUpti_Activity *rec = NULL;
  kiln__prof_rec r;
  while (cupti.active && valid > 0 && cupti.next_record(buffer, valid, &rec) == CUPTI_SUCCESS)
    if (kiln__prof_convert(rec, &r)) kiln__prof_ingest(cupti.active, &r);
  pthread_mutex_unlock(&cupti.lock);
  free(buffer);
}

/* The session's view of CUPTI. */
static int api_push(uint64_t id) { return cupti.push(KILN_EXTERNAL_KIND, id) != CUPTI_SUCCESS; }
static int api_pop(void) {
  uint64_t last;
  return cupti.pop(KILN_EXTERNAL_KIND, &last) != CUPTI_SUCCESS;
}
static const char *api_name(uint32_t cbid) {
  const char *s = NULL;
  return cupti.callback_name(CUPTI_CB_DOMAIN_RUNTIME_API, cbid, &s) == CUPTI_SUCCESS ? s : NULL;
}
static const kiln__prof_api cupti_api = {.push = api_push, .pop = api_pop, .api_name = api_name};

static const char *result(CUptiResult r) {
  const char *s = NULL;
  if (cupti.result_string(r, &s) != CUPTI_SUCCESS || !s) return "unknown CUPTI error";
  return s;
}

/* ---------------------------------------------------------------- traces */

kiln_status kiln__prof_begin(kiln_ctx *ctx, const char *path, char *why, size_t n) {
  if (ctx->prof) {
    snprintf(why, n, "kiln_trace_begin: the context is being traced already: kiln_trace_end first");
    return KILN_ERR_STATE;
  }
  if (!path || !*path) {
    snprintf(why, n, "kiln_trace_begin: no path for the trace");
    return KILN_ERR_INVALID;
  }
  char lw[900];
  bool loaded = kiln__prof_load(lw, sizeof lw);
  if (!ctx->has_gpu) {
    snprintf(why, n,
             "kiln_trace_begin: the context has no GPU (a trace records what the device runs)%s%s",
             loaded ? "" : "; and ", loaded ? "" : lw);
    return KILN_ERR_STATE;
  }
  if (!loaded) {
    snprintf(why, n, "kiln_trace_begin: %s", lw);
    return KILN_ERR_STATE;
  }
  pthread_mutex_lock(&cupti.lock);
  bool busy = cupti.busy;
  cupti.busy = true;
  pthread_mutex_unlock(&cupti.lock);
  if (busy) {
    snprintf(why, n,
             "kiln_trace_begin: another context of this process is being traced (CUPTI's "
             "records are the whole process's): end its trace first");
    return KILN_ERR_STATE;
  }
  kiln_status s = KILN_OK;
  FILE *f = fopen(path, "w");
  kiln__prof *p = NULL;
  char pw[300];
  if (!f) {
    snprintf(why, n, "kiln_trace_begin: %s cannot be written: %s", path, strerror(errno));
    s = KILN_ERR_IO;
  } else if (!(p = kiln__prof_new(&cupti_api, getenv("KILN_TRACE_STEPS"), pw, sizeof pw))) {
    snprintf(why, n, "kiln_trace_begin: %s", pw);
    s = KILN_ERR_INVALID;
  }
  CUptiResult r = CUPTI_SUCCESS;
  if (s == KILN_OK && !cupti.registered) {
    r = cupti.register_callbacks(buffer_requested, buffer_completed);
    cupti.registered = r == CUPTI_SUCCESS;
    if (r != CUPTI_SUCCESS) {
      snprintf(why, n, "kiln_trace_begin: cuptiActivityRegisterCallbacks: %s", result(r));
      s = KILN_ERR_STATE;
    }
  }
  int on = 0;
  for (; s == KILN_OK && on < NKINDS; on++) {
    r = cupti.enable(trace_kinds[on]);
    if (r != CUPTI_SUCCESS) {
      snprintf(why, n,
               "kiln_trace_begin: cuptiActivityEnable(CUPTI_ACTIVITY_KIND_%s): %s (is another "
               "profiler, Nsight, attached?)",
               trace_kind_names[on], result(r));
      s = KILN_ERR_STATE;
      break;
    }
  }
  if (s != KILN_OK) {
    while (on-- > 0)
      cupti.disable(trace_kinds[on]);
    kiln__prof_free(p);
    if (f) {
      fclose(f);
      remove(path);
    }
    pthread_mutex_lock(&cupti.lock);
    cupti.busy = false;
    pthread_mutex_unlock(&cupti.lock);
    return s;
  }
  struct cudaDeviceProp prop;
  pthread_mutex_lock(&cupti.lock);
  cupti.active = p;
  cupti.out = f;
  snprintf(cupti.out_path, sizeof cupti.out_path, "%s", path);
  if (cudaGetDeviceProperties(&prop, ctx->device) == cudaSuccess)
    snprintf(cupti.device, sizeof cupti.device, "%s", prop.name);
  else
    cupti.device[0] = 0;
  pthread_mutex_unlock(&cupti.lock);
  ctx->prof = p;
  kiln__prof_step(p, kiln__prof_step_of(ctx), kiln__prof_mode(ctx));
  return KILN_OK;
}

kiln_status kiln__prof_end(kiln_ctx *ctx, char *why, size_t n) {
  kiln__prof *p = ctx->prof;
  if (!p) {
    snprintf(why, n, "kiln_trace_end: the context is not being traced (kiln_trace_begin)");
    return KILN_ERR_STATE;
  }
  ctx->prof = NULL;
  /* the device's work done, its records complete; then delivered */
  cudaError_t e = cudaStreamSynchronize(ctx->stream);
  kiln__prof_stop(p);
  for (int k = NKINDS; k-- > 0;)
    cupti.disable(trace_kinds[k]);
  cupti.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  size_t dropped = 0;
  if (cupti.num_dropped(NULL, 0, &dropped) == CUPTI_SUCCESS) kiln__prof_dropped(p, dropped);
  pthread_mutex_lock(&cupti.lock);
  cupti.active = NULL;
  FILE *f = cupti.out;
  cupti.out = NULL;
  char path[512], device[256];
  snprintf(path, sizeof path, "%s", cupti.out_path);
  snprintf(device, sizeof device, "%s", cupti.device);
  pthread_mutex_unlock(&cupti.lock);
  const kiln__tl_event *ev = NULL;
  size_t nev = 0;
  kiln__tl_meta meta;
  kiln_status s = KILN_OK;
  if (!kiln__prof_events(p, &ev, &nev, &meta)) {
    snprintf(why, n, "kiln_trace_end: out of host memory resolving the trace for %s", path);
    s = KILN_ERR_OOM;
  } else {
    meta.device = device[0] ? device : NULL;
    meta.cupti = cupti.path;
    bool ok = kiln__tl_write_json(f, ev, nev, &meta);
    if (fclose(f) != 0 || !ok) {
      snprintf(why, n, "kiln_trace_end: writing %s failed", path);
      s = KILN_ERR_IO;
    }
    f = NULL;
  }
  if (f) fclose(f);
  if (s == KILN_OK && e != cudaSuccess) {
    snprintf(why, n, "kiln_trace_end: the stream failed (%s); the trace in %s is incomplete",
             cudaGetErrorString(e), path);
    s = KILN_ERR_CUDA;
  }
  kiln__prof_free(p);
  pthread_mutex_lock(&cupti.lock);
  cupti.busy = false;
  pthread_mutex_unlock(&cupti.lock);
  return s;
}
