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

static void *compile(kiln_ctx *ctx, kiln__kcache *c, const char *name, const char *source,
                     const char *comment, bool sm90a, size_t *size) {
  const char *headers[KILN__MAX_DEVICE_FILES], *names[KILN__MAX_DEVICE_FILES];
  KILN_ASSERT(kiln__device_nfiles <= KILN__MAX_DEVICE_FILES);
  for (int i = 0; i < kiln__device_nfiles; i++) {
    headers[i] = kiln__device_files[i].text;
    names[i] = kiln__device_files[i].name;
  }
  nvrtcProgram prog;
  if (KILN_NVRTC_FAILED(
          ctx, nvrtcCreateProgram(&prog, source, name, kiln__device_nfiles, headers, names)))
    return NULL;
  char arch[64];
  snprintf(arch, sizeof arch, "--gpu-architecture=sm_%d%s", ctx->arch, sm90a ? "a" : "");
  const char *opts[] = {arch, "--std=c++17", "-w"};
  nvrtcResult r = nvrtcCompileProgram(prog, 3, opts);
  void *cubin = NULL;
  if (r != NVRTC_SUCCESS) {
    size_t len = 0;
    nvrtcGetProgramLogSize(prog, &len);
    char *log = malloc(len + 1);
    if (log) {
      log[0] = 0;
      nvrtcGetProgramLog(prog, log);
      log[len] = 0;
    }
    const char *dir = c->dump_dir ? c->dump_dir : "/tmp/kiln-failed-kernels";
    char *path = write_source(ctx, c, dir, name, source, comment, sm90a);
    kiln__error(ctx, KILN_ERR_CUDA, "kiln: NVRTC could not compile %s (source: %s): %s\n%s", name,
                path ? path : "(not written)", nvrtcGetErrorString(r), log ? log : "");
    free(path);
    free(log);
    nvrtcDestroyProgram(&prog);
    return NULL;
  }
  if (!KILN_NVRTC_FAILED(ctx, nvrtcGetCUBINSize(prog, size))) {
    cubin = malloc(*size);
    if (cubin && KILN_NVRTC_FAILED(ctx, nvrtcGetCUBIN(prog, cubin))) {
      free(cubin);
      cubin = NULL;
    }
  }
  nvrtcDestroyProgram(&prog);
  return cubin;
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

kiln__kernel *kiln__compile(kiln_ctx *ctx, const char *name, const char *source,
                            const char *comment, bool sm90a, unsigned smem) {
  kiln__kcache *c = ctx->fusion_state->kernels;
  KILN_ASSERT(!sm90a || ctx->arch == 90);
  uint64_t key = kiln__hash(source, strlen(source), key_seed(ctx, c) ^ (sm90a ? 0x9a : 0));
  for (kiln__kernel *k = c->bucket[key & (KCACHE_BUCKETS - 1)]; k; k = k->next) {
    if (k->key == key) {
      ctx->stats.cache_hits++;
      return k;
    }
  }
  if (c->dump_dir) free(write_source(ctx, c, c->dump_dir, name, source, comment, sm90a));
  kiln__kernel *k = calloc(1, sizeof *k);
  if (!k) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln: out of host memory loading %s", name);
    return NULL;
  }
  k->key = key;
  snprintf(k->name, sizeof k->name, "%s", name);
  size_t size = 0;
  void *cubin = cache_read(ctx, c, key, &size);
  if (cubin) {
    /* a cached cubin whose bytes check out but which does not load (damaged before it was
     * written, or by a foreign writer) is dropped and compiled again */
    if (!ctx->has_gpu || load(ctx, k, cubin, name, smem)) {
      ctx->stats.cache_hits++;
      ctx->stats.disk_hits++;
      free(cubin);
      goto loaded;
    }
    free(cubin);
    cache_remove(c, key);
  }
  double t0 = now_ms();
  cubin = compile(ctx, c, name, source, comment, sm90a, &size);
  ctx->stats.compile_ms += now_ms() - t0;
  if (!cubin) {
    free(k);
    return NULL;
  }
  ctx->stats.kernels_compiled++;
  if (ctx->has_gpu &&
      (KILN_CUDA_FAILED(ctx, cudaLibraryLoadData(&k->lib, cubin, NULL, NULL, 0, NULL, NULL, 0)) ||
       KILN_CUDA_FAILED(ctx, cudaLibraryGetKernel(&k->fn, k->lib, name)) ||
       (smem > 48 * 1024 &&
        KILN_CUDA_FAILED(
            ctx, cudaKernelSetAttributeForDevice(k->fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)smem, ctx->device))))) {
    if (k->lib) cudaLibraryUnload(k->lib);
    free(cubin);
    free(k);
    return NULL;
  }
  cache_write(ctx, c, key, cubin, size);
  free(cubin);
loaded:
  k->next = c->bucket[key & (KCACHE_BUCKETS - 1)];
  c->bucket[key & (KCACHE_BUCKETS - 1)] = k;
  return k;
}
