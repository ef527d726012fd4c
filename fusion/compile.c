/*
 * compile.c: the one place kernels are compiled. NVRTC compiles a rendered source for the
 * device's architecture, with the device files (the .cuh files of fusion/device, embedded at
 * build time) given to it as named headers; cubins are cached in memory (per context) and on
 * disk ($KILN_CACHE_DIR, default ~/.cache/kiln), keyed by a hash of the source, the device files,
 * the architecture and the NVRTC version. A cache file carries a header with its key, length and
 * checksum: a truncated or corrupted one is detected, rebuilt and never loaded.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../core/cuda_check.h"
#include "fusion.h"

/* Buckets of the in-memory cache (a power of two: keys are masked into it). */
#define KCACHE_BUCKETS 256
/* Device files NVRTC is given as headers (fusion/device holds 7). */
#define KILN__MAX_DEVICE_FILES 32
/* The largest cubin read back from the disk cache; anything larger is a corrupt entry. */
#define KCACHE_MAX_CUBIN ((uint64_t)256 << 20)

struct kiln__kernel {
  uint64_t key;
  char name[96];
  cudaLibrary_t lib;
  cudaKernel_t fn;
  struct kiln__kernel *next;
};

struct kiln__kcache {
  kiln__kernel *bucket[KCACHE_BUCKETS];
  char *cache_dir, *dump_dir;
  int nvrtc_version;
  uint64_t key_seed;   /* hash of the device files, architecture and NVRTC version */
  bool headers_dumped; /* the device files were written to dump_dir */
  bool warned;         /* the cache directory proved unusable, and a warning said so */
};

static char *env_dup(const char *name) {
  const char *v = getenv(name);
  return (v && *v) ? strdup(v) : NULL;
}

static char *default_cache_dir(void) {
  char *dir = env_dup("KILN_CACHE_DIR");
  if (dir) return dir;
  const char *home = getenv("HOME");
  if (!home || !*home) return NULL;
  size_t n = strlen(home) + 32;
  dir = malloc(n);
  if (dir) snprintf(dir, n, "%s/.cache/kiln", home);
  return dir;
}

kiln__kcache *kiln__kcache_new(void) {
  kiln__kcache *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->cache_dir = default_cache_dir();
  c->dump_dir = env_dup("KILN_DUMP_KERNELS");
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  c->nvrtc_version = major * 1000 + minor;
  return c;
}

void kiln__kcache_free(kiln__kcache *c, bool has_gpu) {
  if (!c) return;
  for (int i = 0; i < KCACHE_BUCKETS; i++) {
    kiln__kernel *k = c->bucket[i];
    while (k) {
      kiln__kernel *n = k->next;
      if (has_gpu && k->lib) cudaLibraryUnload(k->lib);
      free(k);
      k = n;
    }
  }
  free(c->cache_dir);
  free(c->dump_dir);
  free(c);
}

const void *kiln__kernel_fn(const kiln__kernel *k) { return (const void *)k->fn; }

#define CACHE_MAGIC "KILNCUB2" /* 2: sources include the device files by name */

typedef struct cache_header {
  char magic[8];
  uint64_t key;
  uint32_t arch, nvrtc;
  uint64_t size, checksum;
} cache_header;

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* "a/b" + suffix or "a" + "/" + b + suffix, malloc'd (NULL out of memory). */
static int mkdir_p(const char *dir) {
  char *tmp = strdup(dir);
  if (!tmp) return -1;
  int r = 0;
  for (char *p = tmp + 1; *p && r == 0; p++) {
    if (*p == '/') {
      *p = 0;
      if (mkdir(tmp, 0755) != 0 && errno != EEXIST) r = -1;
      *p = '/';
    }
  }
  if (r == 0 && mkdir(tmp, 0755) != 0 && errno != EEXIST) r = -1;
  free(tmp);
  return r;
}

/* An unusable cache directory costs every process its compiles: say so, once per context. */
static void cache_warn(kiln__kcache *c, const char *what) {
  if (c->warned) return;
  c->warned = true;
  fprintf(stderr,
          "kiln: warning: the kernel cache %s is not usable (%s): kernels are compiled again by "
          "every process (set KILN_CACHE_DIR to a writable folder)\n",
          c->cache_dir, what);
}

static char *cache_path(const kiln__kcache *c, uint64_t key) {
  char name[32];
  snprintf(name, sizeof name, "%016" PRIx64, key);
  return kiln__strf("%s/%s.cubin", c->cache_dir, name);
}

/* Reads a cache entry; NULL when it is missing or does not check out. Only a regular file is
 * read, opened without blocking (a FIFO at its path cannot hang the process). */
static void *cache_read(const kiln_ctx *ctx, const kiln__kcache *c, uint64_t key, size_t *size) {
  if (!c->cache_dir) return NULL;
  char *path = cache_path(c, key);
  bool irregular;
  FILE *f = path ? kiln__fopen_regular(path, &irregular, NULL) : NULL;
  free(path);
  if (!f) return NULL;
  cache_header h;
  void *data = NULL;
  if (fread(&h, sizeof h, 1, f) != 1 || memcmp(h.magic, CACHE_MAGIC, 8) != 0 || h.key != key ||
      h.arch != (uint32_t)ctx->arch || h.nvrtc != (uint32_t)c->nvrtc_version || h.size == 0 ||
      h.size > KCACHE_MAX_CUBIN)
    goto bad;
  data = malloc(h.size);
  if (!data || fread(data, 1, h.size, f) != h.size || fgetc(f) != EOF ||
      kiln__hash(data, h.size, 0) != h.checksum)
    goto bad;
  fclose(f);
  *size = h.size;
  return data;
bad:
  free(data);
  fclose(f);
  return NULL;
}

static void cache_remove(const kiln__kcache *c, uint64_t key) {
  char *path = c->cache_dir ? cache_path(c, key) : NULL;
  if (path) unlink(path);
  free(path);
}

static void cache_write(const kiln_ctx *ctx, kiln__kcache *c, uint64_t key, const void *data,
                        size_t size) {
  if (!c->cache_dir) return;
  if (mkdir_p(c->cache_dir) != 0) return cache_warn(c, strerror(errno));
  char *path = cache_path(c, key);
  char *tmp = path ? kiln__strf("%s.tmp.%ld", path, (long)getpid()) : NULL;
  FILE *f = tmp ? fopen(tmp, "wb") : NULL;
  if (!f) {
    if (tmp) cache_warn(c, strerror(errno));
    free(path);
    free(tmp);
    return;
  }
  cache_header h;
  memcpy(h.magic, CACHE_MAGIC, 8);
  h.key = key;
  h.arch = (uint32_t)ctx->arch;
  h.nvrtc = (uint32_t)c->nvrtc_version;
  h.size = size;
  h.checksum = kiln__hash(data, size, 0);
  bool ok = fwrite(&h, sizeof h, 1, f) == 1 && fwrite(data, 1, size, f) == size;
  ok = (fflush(f) == 0) && ok;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp, path) != 0) {
    cache_warn(c, strerror(errno));
    unlink(tmp);
  }
  free(path);
  free(tmp);
}

/* Writes the device files into dir (once per cache): a dumped kernel compiles on its own. */
static void write_headers(kiln__kcache *c, const char *dir) {
  if (dir == c->dump_dir && c->headers_dumped) return;
  for (int i = 0; i < kiln__device_nfiles; i++) {
    char *path = kiln__strf("%s/%s", dir, kiln__device_files[i].name);
    FILE *f = path ? fopen(path, "w") : NULL;
    free(path);
    if (!f) return;
    fputs(kiln__device_files[i].text, f);
    fclose(f);
  }
  if (dir == c->dump_dir) c->headers_dumped = true;
}

/* Writes the kernel's source where a user can read it; returns the path written (malloc'd) or
 * NULL. */
static char *write_source(const kiln_ctx *ctx, kiln__kcache *c, const char *dir, const char *name,
                          const char *source, const char *comment, bool sm90a) {
  if (!dir || mkdir_p(dir) != 0) return NULL;
  write_headers(c, dir);
  char *path = kiln__strf("%s/%s.cu", dir, name);
  FILE *f = path ? fopen(path, "w") : NULL;
  if (!f) {
    free(path);
    return NULL;
  }
  const char *a = sm90a ? "a" : "";
  fprintf(f, "// %s: generated by kiln for sm_%d%s (nvcc -I%s -arch=sm_%d%s -c %s.cu)\n", name,
          ctx->arch, a, dir, ctx->arch, a, name);
  if (comment && *comment) fputs(comment, f);
  fputs(source, f);
  fclose(f);
  return path;
}

/* One source to compile, off the main thread: its cubin from the disk cache or NVRTC, or NVRTC's
 * failure. Nothing here touches the context's error or statistics: the main thread reports. */
typedef struct job {
  const char *name, *source;
  bool sm90a;
  uint64_t key;
  void *cubin;
  size_t size;
  bool from_disk;
  nvrtcResult err; /* NVRTC_SUCCESS, or what failed (with log) */
  const char *what;
  char *log;
  kiln__kernel *k; /* set by the main thread */
} job;

/* Compiles j->source with NVRTC (thread-safe: NVRTC compiles programs of different threads
 * concurrently). */
static void nvrtc_compile(const kiln_ctx *ctx, job *j) {
  const char *headers[KILN__MAX_DEVICE_FILES], *names[KILN__MAX_DEVICE_FILES];
  KILN_ASSERT(kiln__device_nfiles <= KILN__MAX_DEVICE_FILES);
  for (int i = 0; i < kiln__device_nfiles; i++) {
    headers[i] = kiln__device_files[i].text;
    names[i] = kiln__device_files[i].name;
  }
  nvrtcProgram prog;
  j->what = "nvrtcCreateProgram";
  j->err = nvrtcCreateProgram(&prog, j->source, j->name, kiln__device_nfiles, headers, names);
  if (j->err != NVRTC_SUCCESS) return;
  char arch[64];
  snprintf(arch, sizeof arch, "--gpu-architecture=sm_%d%s", ctx->arch, j->sm90a ? "a" : "");
  const char *opts[] = {arch, "--std=c++17", "-w"};
  j->what = "nvrtcCompileProgram";
  j->err = nvrtcCompileProgram(prog, 3, opts);
  if (j->err != NVRTC_SUCCESS) {
    size_t len = 0;
    nvrtcGetProgramLogSize(prog, &len);
    j->log = malloc(len + 1);
    if (j->log) {
      j->log[0] = 0;
      nvrtcGetProgramLog(prog, j->log);
      j->log[len] = 0;
    }
  } else {
    j->what = "nvrtcGetCUBIN";
    j->err = nvrtcGetCUBINSize(prog, &j->size);
    if (j->err == NVRTC_SUCCESS) {
      j->cubin = malloc(j->size);
      if (!j->cubin)
        j->err = NVRTC_ERROR_OUT_OF_MEMORY;
      else if ((j->err = nvrtcGetCUBIN(prog, j->cubin)) != NVRTC_SUCCESS) {
        free(j->cubin);
        j->cubin = NULL;
      }
    }
  }
  nvrtcDestroyProgram(&prog);
}

static void run_job(const kiln_ctx *ctx, const kiln__kcache *c, job *j) {
  j->cubin = cache_read(ctx, c, j->key, &j->size);
  j->from_disk = j->cubin != NULL;
  if (!j->from_disk) nvrtc_compile(ctx, j);
}

typedef struct pool {
  const kiln_ctx *ctx;
  const kiln__kcache *c;
  job *jobs;
  int n, next;
  pthread_mutex_t lock;
} pool;

static void *worker(void *arg) {
  pool *p = arg;
  for (;;) {
    pthread_mutex_lock(&p->lock);
    int i = p->next++;
    pthread_mutex_unlock(&p->lock);
    if (i >= p->n) return NULL;
    run_job(p->ctx, p->c, &p->jobs[i]);
  }
}

/* Threads for n jobs: KILN_COMPILE_THREADS, else the host's processors, at most n and
 * KILN__COMPILE_THREADS_MAX. */
#define KILN__COMPILE_THREADS_MAX 32
static int threads_for(int n) {
  const char *env = getenv("KILN_COMPILE_THREADS");
  long t = env && *env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
  if (t < 1) t = 1;
  if (t > KILN__COMPILE_THREADS_MAX) t = KILN__COMPILE_THREADS_MAX;
  return (int)(t < n ? t : n);
}

/* Runs every job: on the calling thread alone, or on a pool of threads with it. */
static void run_jobs(const kiln_ctx *ctx, const kiln__kcache *c, job *jobs, int n) {
  pool p = {.ctx = ctx, .c = c, .jobs = jobs, .n = n};
  int nt = threads_for(n);
  pthread_t th[KILN__COMPILE_THREADS_MAX];
  int started = 0;
  if (nt > 1 && pthread_mutex_init(&p.lock, NULL) == 0) {
    for (; started < nt - 1; started++) /* the calling thread is the last worker */
      if (pthread_create(&th[started], NULL, worker, &p) != 0) break;
    worker(&p);
    for (int t = 0; t < started; t++)
      pthread_join(th[t], NULL);
    pthread_mutex_destroy(&p.lock);
    return;
  }
  for (int i = 0; i < n; i++)
    run_job(ctx, c, &jobs[i]);
}

/* The device files, architecture and NVRTC version: part of every kernel's key. */
static uint64_t key_seed(const kiln_ctx *ctx, kiln__kcache *c) {
  if (c->key_seed == 0) {
    uint64_t h = 0;
    for (int i = 0; i < kiln__device_nfiles; i++) {
      h = kiln__hash(kiln__device_files[i].name, strlen(kiln__device_files[i].name) + 1, h);
      h = kiln__hash(kiln__device_files[i].text, strlen(kiln__device_files[i].text), h);
    }
    int tag[2] = {ctx->arch, c->nvrtc_version};
    c->key_seed = kiln__hash(tag, sizeof tag, h);
  }
  return c->key_seed;
}

/* Loads a cubin into k without touching the context's error, and lets its launches have smem
 * bytes of dynamic shared memory: false when it does not load. */
static bool load(const kiln_ctx *ctx, kiln__kernel *k, const void *cubin, const char *name,
                 unsigned smem) {
  if (cudaLibraryLoadData(&k->lib, cubin, NULL, NULL, 0, NULL, NULL, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    k->lib = NULL;
    return false;
  }
  if (cudaLibraryGetKernel(&k->fn, k->lib, name) != cudaSuccess ||
      (smem > 48 * 1024 &&
       cudaKernelSetAttributeForDevice(k->fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem, ctx->device) != cudaSuccess)) {
    (void)cudaGetLastError();
    cudaLibraryUnload(k->lib);
    k->lib = NULL;
    return false;
  }
  return true;
}

static kiln__kernel *memory_lookup(kiln__kcache *c, uint64_t key) {
  for (kiln__kernel *k = c->bucket[key & (KCACHE_BUCKETS - 1)]; k; k = k->next)
    if (k->key == key) return k;
  return NULL;
}

/* A job's kernel, on the main thread: its failure reported, or its cubin loaded (a cached one that
 * does not load is compiled again), written to the disk cache when compiled, and kept in memory.
 * NULL with the error set. */
static kiln__kernel *finish(kiln_ctx *ctx, kiln__kcache *c, job *j, const char *comment,
                            unsigned smem) {
  const char *name = j->name;
  if (c->dump_dir) free(write_source(ctx, c, c->dump_dir, name, j->source, comment, j->sm90a));
  kiln__kernel *k = calloc(1, sizeof *k);
  if (!k) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory loading %s", name);
    return NULL;
  }
  k->key = j->key;
  snprintf(k->name, sizeof k->name, "%s", name);
  if (j->from_disk) {
    /* a cached cubin whose bytes check out but which does not load (damaged before it was
     * written, or by a foreign writer) is dropped and compiled again */
    if (!ctx->has_gpu || load(ctx, k, j->cubin, name, smem)) {
      ctx->stats.cache_hits++;
      ctx->stats.disk_hits++;
      goto loaded;
    }
    free(j->cubin);
    j->cubin = NULL;
    cache_remove(c, j->key);
    j->from_disk = false;
    double t0 = now_ms();
    nvrtc_compile(ctx, j);
    ctx->stats.compile_ms += now_ms() - t0;
  }
  if (j->err == NVRTC_ERROR_COMPILATION) {
    const char *dir = c->dump_dir ? c->dump_dir : "/tmp/kiln-failed-kernels";
    char *path = write_source(ctx, c, dir, name, j->source, comment, j->sm90a);
    kiln__error(ctx, KILN_ERR_CUDA, "kiln: NVRTC could not compile %s (source: %s): %s\n%s", name,
                path ? path : "(not written)", nvrtcGetErrorString(j->err), j->log ? j->log : "");
    free(path);
    free(k);
    return NULL;
  }
  if (j->err != NVRTC_SUCCESS) {
    kiln__error(ctx, j->err == NVRTC_ERROR_OUT_OF_MEMORY ? KILN_ERR_OOM : KILN_ERR_CUDA,
                "kiln: %s failed for %s: %s", j->what, name, nvrtcGetErrorString(j->err));
    free(k);
    return NULL;
  }
  ctx->stats.kernels_compiled++;
  if (ctx->has_gpu &&
      (KILN_CUDA_FAILED(ctx,
                        cudaLibraryLoadData(&k->lib, j->cubin, NULL, NULL, 0, NULL, NULL, 0)) ||
       KILN_CUDA_FAILED(ctx, cudaLibraryGetKernel(&k->fn, k->lib, name)) ||
       (smem > 48 * 1024 &&
        KILN_CUDA_FAILED(
            ctx, cudaKernelSetAttributeForDevice(k->fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)smem, ctx->device))))) {
    if (k->lib) cudaLibraryUnload(k->lib);
    free(k);
    return NULL;
  }
  cache_write(ctx, c, j->key, j->cubin, j->size);
loaded:
  k->next = c->bucket[j->key & (KCACHE_BUCKETS - 1)];
  c->bucket[j->key & (KCACHE_BUCKETS - 1)] = k;
  return k;
}

bool kiln__compile_all(kiln_ctx *ctx, int n, kiln__compile_req *r) {
  kiln__kcache *c = ctx->fusion_state->kernels;
  job *jobs = calloc((size_t)(n > 0 ? n : 1), sizeof *jobs);
  int *job_of = malloc((size_t)(n > 0 ? n : 1) * sizeof *job_of);
  if (!jobs || !job_of) {
    free(jobs);
    free(job_of);
    return !kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory compiling kernels");
  }
  /* the memory cache first; each other source once (a repeat is a hit, as if compiled before) */
  int nj = 0;
  for (int i = 0; i < n; i++) {
    KILN_ASSERT(!r[i].sm90a || ctx->arch == 90);
    uint64_t key =
        kiln__hash(r[i].source, strlen(r[i].source), key_seed(ctx, c) ^ (r[i].sm90a ? 0x9a : 0));
    job_of[i] = -1;
    r[i].k = memory_lookup(c, key);
    if (r[i].k) {
      ctx->stats.cache_hits++;
      continue;
    }
    for (int j = 0; j < nj && job_of[i] < 0; j++)
      if (jobs[j].key == key) job_of[i] = j;
    if (job_of[i] >= 0) continue;
    jobs[nj] = (job){.name = r[i].name, .source = r[i].source, .sm90a = r[i].sm90a, .key = key};
    job_of[i] = nj++;
  }
  double t0 = now_ms();
  run_jobs(ctx, c, jobs, nj);
  bool compiled = false;
  for (int j = 0; j < nj; j++)
    compiled = compiled || !jobs[j].from_disk;
  if (compiled) ctx->stats.compile_ms += now_ms() - t0;
  /* in order: the first failure is the one reported */
  bool ok = true;
  for (int i = 0; i < n; i++) {
    if (job_of[i] < 0) continue;
    job *j = &jobs[job_of[i]];
    if (ok && !j->k) { /* its first request */
      j->k = finish(ctx, c, j, r[i].comment, r[i].smem);
      ok = j->k != NULL;
      r[i].k = j->k;
    } else {
      r[i].k = j->k;
      if (j->k) ctx->stats.cache_hits++;
    }
  }
  for (int j = 0; j < nj; j++) {
    free(jobs[j].cubin);
    free(jobs[j].log);
  }
  free(jobs);
  free(job_of);
  return ok;
}

kiln__kernel *kiln__compile(kiln_ctx *ctx, const char *name, const char *source,
                            const char *comment, bool sm90a, unsigned smem) {
  kiln__compile_req r = {
      .name = name, .source = source, .comment = comment, .sm90a = sm90a, .smem = smem};
  return kiln__compile_all(ctx, 1, &r) ? r.k : NULL;
}
