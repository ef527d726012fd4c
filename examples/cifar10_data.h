/*
 * cifar10_data.h: where the CIFAR-10 example finds its data, and reading it, through a cache of
 * the decoded images, before the GPU is touched (a missing or broken data set is reported as such
 * on any machine).
 *
 * The folder is the one given on the command line, else $KILN_CIFAR10. The training set is the
 * batches data_batch_1 .. data_batch_5 found there (all five for the real thing; a sample holding
 * fewer is read as it is, and the count says so), the test set test_batch; each file is raw,
 * .gz or .xz, as kiln_cifar10_read reads them. Decoding the .xz files takes seconds per file, so
 * the decoded split is kept in a cache file, cifar10-<split>-<hash of the folder>.cache in the
 * cache folder ($KILN_CACHE_DIR, else ~/.cache/kiln, or --cache DIR). A cache file is trusted only
 * when everything checks: its magic and version, its size against its image count, the source
 * files it was made from (names, sizes and modification times, a hash in its header) and a
 * checksum of its contents; otherwise the files are decoded again and the cache rewritten (a
 * temporary file renamed over it). The cache layout, little-endian:
 *
 *   bytes 0-7    "KILNC10" and a version byte (1)
 *   bytes 8-15   n, the images
 *   bytes 16-23  the source key (cache_source_key)
 *   bytes 24-31  the checksum of the rest (cache_contents_checksum)
 *   then         n labels, then n images of 32 x 32 x 3 bytes, channels last
 */
#ifndef KILN_EXAMPLES_CIFAR10_DATA_H
#define KILN_EXAMPLES_CIFAR10_DATA_H

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kiln.h"

#define CIFAR10_PIXELS (32 * 32 * 3)
#define CIFAR10_CACHE_HEADER 32
#define CIFAR10_CACHE_MAX_N 60000

/* The data folder: given (the command line's, or NULL), else $KILN_CIFAR10, else NULL. */
static inline const char *cifar10_data_dir(const char *given) {
  if (given) return given;
  const char *env = getenv("KILN_CIFAR10");
  return env && *env ? env : NULL;
}

/* The cache folder: given (--cache), else $KILN_CACHE_DIR, else $HOME/.cache/kiln; written into
 * buf. NULL when there is none (no HOME). */
static inline const char *cifar10_cache_dir(const char *given, char *buf, size_t n) {
  const char *env = getenv("KILN_CACHE_DIR"), *home = getenv("HOME");
  if (given)
    snprintf(buf, n, "%s", given);
  else if (env && *env)
    snprintf(buf, n, "%s", env);
  else if (home && *home)
    snprintf(buf, n, "%s/.cache/kiln", home);
  else
    return NULL;
  return buf;
}

/* ---------------------------------------------------------------- hashing */

/* FNV-1a over n bytes, from h. */
static inline uint64_t cache_fnv(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}

static inline uint64_t cache_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* A 64-bit checksum of n bytes: four lanes of 8-byte words, each lane multiplied and rotated per
 * word, then the lanes, the tail and the length folded together. Not cryptographic: it tells a
 * truncated, torn or corrupted cache file from a whole one. */
static inline uint64_t cache_checksum(const unsigned char *p, size_t n) {
  const uint64_t k1 = 0x9e3779b97f4a7c15ULL, k2 = 0xbf58476d1ce4e5b9ULL;
  uint64_t lane[4] = {k1, k2, k1 ^ k2, k1 + k2};
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; k++) {
      uint64_t w;
      memcpy(&w, p + i + 8 * k, 8);
      lane[k] = cache_rotl(lane[k] + w * k2, 29) * k1;
    }
  uint64_t h = (uint64_t)n * k1;
  for (int k = 0; k < 4; k++)
    h = cache_rotl(h ^ lane[k], 27) * k2 + k1;
  h = cache_fnv(p + i, n - i, h);
  h ^= h >> 31;
  return h * k1;
}

static inline void cache_put64(unsigned char *p, uint64_t v) {
  for (int k = 0; k < 8; k++)
    p[k] = (unsigned char)(v >> (8 * k));
}
static inline uint64_t cache_get64(const unsigned char *p) {
  uint64_t v = 0;
  for (int k = 0; k < 8; k++)
    v |= (uint64_t)p[k] << (8 * k);
  return v;
}

/* ---------------------------------------------------------------- the batch files */

/* The file kiln_cifar10_read would read for the batch stem in dir: the first of stem.bin,
 * stem.bin.gz, stem.bin.xz that exists (path and st filled), or 0 when none does. */
static inline int cifar10_batch_file(const char *dir, const char *stem, char *path, size_t n,
                                     struct stat *st) {
  static const char *const suffix[3] = {".bin", ".bin.gz", ".bin.xz"};
  for (int k = 0; k < 3; k++) {
    snprintf(path, n, "%s/%s%s", dir, stem, suffix[k]);
    if (stat(path, st) == 0) return 1;
  }
  return 0;
}

/* The source key of a split: a hash of the folder's real path and of each batch file's name,
 * size and modification time, and of the cache's version. */
static inline uint64_t cache_source_key(const char *dir, int nstems, const char *const *stems) {
  char real[PATH_MAX], path[PATH_MAX + 64];
  uint64_t h = cache_fnv("kiln-cifar10-cache-1", 20, 0xcbf29ce484222325ULL);
  const char *d = realpath(dir, real) ? real : dir;
  h = cache_fnv(d, strlen(d) + 1, h);
  for (int i = 0; i < nstems; i++) {
    struct stat st;
    if (!cifar10_batch_file(dir, stems[i], path, sizeof path, &st)) continue;
    const char *name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    int64_t v[3] = {(int64_t)st.st_size, (int64_t)st.st_mtim.tv_sec, (int64_t)st.st_mtim.tv_nsec};
    h = cache_fnv(name, strlen(name) + 1, h);
    h = cache_fnv(v, sizeof v, h);
  }
  return h;
}

/* Creates dir and its parents (as mkdir -p); 0 on success. */
static inline int cache_mkdirs(const char *dir) {
  char p[PATH_MAX];
  if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) return -1;
  for (char *s = p + 1;; s++) {
    if (*s != '/' && *s != '\0') continue;
    char c = *s;
    *s = '\0';
    if (mkdir(p, 0755) != 0 && errno != EEXIST) return -1;
    *s = c;
    if (c == '\0') return 0;
  }
}

/* ---------------------------------------------------------------- the cache file */

/* The checksum of a split's contents: its labels' and its images'. */
static inline uint64_t cache_contents_checksum(const kiln_cifar10 *c) {
  uint64_t a = cache_checksum(c->labels, (size_t)c->n);
  uint64_t b = cache_checksum(c->images, (size_t)c->n * CIFAR10_PIXELS);
  return cache_rotl(a, 17) ^ b;
}

/* Why a cache path that is not a regular file is not used. */
static inline const char *cache_not_regular(const struct stat *st) {
  return S_ISDIR(st->st_mode)    ? "it is a directory, not a file"
         : S_ISFIFO(st->st_mode) ? "it is a FIFO, not a regular file"
                                 : "it is not a regular file";
}

/* Reads a split from the cache file path when it is whole and made from the source key; 1 with
 * *c filled, else 0 with why (a short reason; "" when the file does not exist). */
static inline int cache_load(const char *path, uint64_t key, kiln_cifar10 *c, char *why,
                             size_t nwhy) {
  why[0] = '\0';
  /* a regular file only: opened without blocking (a FIFO would wait for a writer for ever), then
   * checked */
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ENOENT) snprintf(why, nwhy, "cannot open it: %s", strerror(errno));
    return 0;
  }
  struct stat st;
  FILE *f = NULL;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || !(f = fdopen(fd, "rb"))) {
    int e = errno;
    if (fstat(fd, &st) == 0 && !S_ISREG(st.st_mode))
      snprintf(why, nwhy, "%s", cache_not_regular(&st));
    else
      snprintf(why, nwhy, "cannot open it: %s", strerror(e));
    close(fd);
    return 0;
  }
  unsigned char h[CIFAR10_CACHE_HEADER];
  kiln_cifar10 got = {0};
  int ok = 0;
  if (fread(h, 1, sizeof h, f) != sizeof h) {
    snprintf(why, nwhy, "shorter than its header");
    goto done;
  }
  uint64_t n = cache_get64(h + 8);
  if (memcmp(h, "KILNC10\001", 8) != 0) {
    snprintf(why, nwhy, "not a cache file of this version");
    goto done;
  }
  if (n < 1 || n > CIFAR10_CACHE_MAX_N ||
      (uint64_t)st.st_size != CIFAR10_CACHE_HEADER + n * (1 + CIFAR10_PIXELS)) {
    snprintf(why, nwhy, "%lld bytes for %llu images", (long long)st.st_size, (unsigned long long)n);
    goto done;
  }
  if (cache_get64(h + 16) != key) {
    snprintf(why, nwhy, "made from other files");
    goto done;
  }
  got.n = (int64_t)n;
  got.labels = malloc((size_t)n);
  got.images = malloc((size_t)n * CIFAR10_PIXELS);
  if (!got.labels || !got.images) {
    snprintf(why, nwhy, "out of host memory");
    goto done;
  }
  if (fread(got.labels, 1, (size_t)n, f) != (size_t)n ||
      fread(got.images, CIFAR10_PIXELS, (size_t)n, f) != (size_t)n) {
    snprintf(why, nwhy, "a short read");
    goto done;
  }
  if (cache_contents_checksum(&got) != cache_get64(h + 24)) {
    snprintf(why, nwhy, "its checksum does not match its contents");
    goto done;
  }
  for (uint64_t i = 0; i < n; i++)
    if (got.labels[i] > 9) {
      snprintf(why, nwhy, "image %llu has label %u", (unsigned long long)i, got.labels[i]);
      goto done;
    }
  *c = got;
  ok = 1;
done:
  if (!ok) kiln_cifar10_free(&got);
  fclose(f);
  return ok;
}

/* Writes c to the cache file path (a temporary file beside it, renamed over it); 0 on success,
 * else -1 with why. Something other than a regular file at path is left as it is. */
static inline int cache_store(const char *path, uint64_t key, const kiln_cifar10 *c, char *why,
                              size_t nwhy) {
  struct stat st;
  if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
    snprintf(why, nwhy, "%s, left as it is", cache_not_regular(&st));
    return -1;
  }
  unsigned char h[CIFAR10_CACHE_HEADER];
  memcpy(h, "KILNC10\001", 8);
  cache_put64(h + 8, (uint64_t)c->n);
  cache_put64(h + 16, key);
  cache_put64(h + 24, cache_contents_checksum(c));
  char tmp[PATH_MAX + 96];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
  FILE *f = fopen(tmp, "wb");
  int ok = f && fwrite(h, 1, sizeof h, f) == sizeof h &&
           fwrite(c->labels, 1, (size_t)c->n, f) == (size_t)c->n &&
           fwrite(c->images, CIFAR10_PIXELS, (size_t)c->n, f) == (size_t)c->n && fflush(f) == 0 &&
           fsync(fileno(f)) == 0;
  int e = errno;
  if (f && fclose(f) != 0 && ok) {
    ok = 0;
    e = errno;
  }
  if (ok && rename(tmp, path) != 0) {
    ok = 0;
    e = errno;
  }
  if (!ok) {
    remove(tmp);
    snprintf(why, nwhy, "%s", strerror(e));
    return -1;
  }
  return 0;
}

/* ---------------------------------------------------------------- reading a split */

static inline double cifar10_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Reads the batches stems (in order) of dir into *c, concatenated, with the no-GPU context h.
 * 0 on success, else -1 with the error on h. */
static inline int cifar10_decode(kiln_ctx *h, const char *dir, int nstems, const char *const *stems,
                                 kiln_cifar10 *c) {
  memset(c, 0, sizeof *c);
  for (int i = 0; i < nstems; i++) {
    kiln_cifar10 part;
    if (kiln_cifar10_read(h, dir, stems[i], &part) != KILN_OK) {
      kiln_cifar10_free(c);
      return -1;
    }
    if (i == 0) {
      *c = part;
      continue;
    }
    uint8_t *im = realloc(c->images, (size_t)(c->n + part.n) * CIFAR10_PIXELS);
    if (im) c->images = im;
    uint8_t *lb = im ? realloc(c->labels, (size_t)(c->n + part.n)) : NULL;
    if (lb) c->labels = lb;
    if (!im || !lb) {
      kiln_cifar10_free(&part);
      kiln_cifar10_free(c);
      fprintf(stderr, "cifar10: out of host memory\n");
      exit(1);
    }
    memcpy(c->images + (size_t)c->n * CIFAR10_PIXELS, part.images, (size_t)part.n * CIFAR10_PIXELS);
    memcpy(c->labels + c->n, part.labels, (size_t)part.n);
    c->n += part.n;
    kiln_cifar10_free(&part);
  }
  return 0;
}

/* Reads one split (the batches stems of dir) through the cache in cache_dir (NULL: no cache) and
 * prints where it came from; exits with status 1, saying why, when the files cannot be read. */
static inline void cifar10_split_read(const char *prog, kiln_ctx *h, const char *dir,
                                      const char *cache_dir, const char *split, int nstems,
                                      const char *const *stems, kiln_cifar10 *c) {
  char path[PATH_MAX + 64], why[256], real[PATH_MAX];
  uint64_t key = cache_source_key(dir, nstems, stems);
  double t0 = cifar10_now_s();
  if (cache_dir) {
    const char *d = realpath(dir, real) ? real : dir;
    snprintf(path, sizeof path, "%s/cifar10-%s-%016llx.cache", cache_dir, split,
             (unsigned long long)cache_fnv(d, strlen(d), 0xcbf29ce484222325ULL));
    if (cache_load(path, key, c, why, sizeof why)) {
      printf("%s: %lld %s images from the cache %s (%.2f s)\n", prog, (long long)c->n, split, path,
             cifar10_now_s() - t0);
      return;
    }
    if (why[0]) printf("%s: not using the cache %s: %s\n", prog, path, why);
  }
  if (cifar10_decode(h, dir, nstems, stems, c) != 0) {
    fprintf(stderr, "%s: reading the data set: %s (name its folder, or set KILN_CIFAR10)\n", prog,
            kiln_ctx_error(h));
    exit(1);
  }
  printf("%s: %lld %s images decoded from %s (%.2f s)", prog, (long long)c->n, split, dir,
         cifar10_now_s() - t0);
  if (cache_dir) {
    if (cache_mkdirs(cache_dir) != 0)
      printf("; no cache: cannot make %s: %s", cache_dir, strerror(errno));
    else if (cache_store(path, key, c, why, sizeof why) != 0)
      printf("; no cache: cannot write %s: %s", path, why);
    else
      printf("; cached in %s", path);
  }
  printf("\n");
}

/* Reads the training set (the data_batch_N present in dir, at least one) and the test set of dir
 * into host memory, through the cache (cache_dir NULL: none). On failure prints why (the
 * reader's message names the file) and exits with status 1. */
static inline void cifar10_data_read(const char *prog, const char *dir, const char *cache_dir,
                                     kiln_cifar10 *train, kiln_cifar10 *test) {
  static const char *const names[5] = {"data_batch_1", "data_batch_2", "data_batch_3",
                                       "data_batch_4", "data_batch_5"};
  static const char *const test_name[1] = {"test_batch"};
  const char *stems[5];
  int nstems = 0;
  char path[PATH_MAX + 64];
  struct stat st;
  for (int i = 0; i < 5; i++)
    if (cifar10_batch_file(dir, names[i], path, sizeof path, &st)) stems[nstems++] = names[i];
  kiln_ctx *h = kiln_ctx_new(&(kiln_ctx_options){.no_gpu = 1});
  if (!h) {
    fprintf(stderr, "%s: out of host memory\n", prog);
    exit(1);
  }
  if (nstems == 0) { /* let the reader name what is missing */
    stems[0] = names[0];
    nstems = 1;
  }
  cifar10_split_read(prog, h, dir, cache_dir, "train", nstems, stems, train);
  if (nstems < 5) {
    printf("%s: only %d of the 5 training batches are in %s (", prog, nstems, dir);
    for (int i = 0; i < nstems; i++)
      printf("%s%s", i ? ", " : "", stems[i]);
    printf("): training on %lld images\n", (long long)train->n);
  }
  cifar10_split_read(prog, h, dir, cache_dir, "test", 1, test_name, test);
  kiln_ctx_free(h);
}

#endif
