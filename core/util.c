/*
 * util.c: hashing, splitmix64, growable arrays and strings, regular files (see util.h).
 */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

uint64_t kiln__hash(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  if (h == 0) h = 0xcbf29ce484222325ULL; /* the FNV-1a offset basis */
  for (size_t i = 0; i < n; i++)
    h = (h ^ b[i]) * 0x100000001b3ULL; /* the FNV-1a prime */
  return h;
}

uint64_t kiln__splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

double kiln__splitmix64_unit(uint64_t *state) {
  return (double)(kiln__splitmix64(state) >> 11) * 0x1.0p-53;
}

bool kiln__grow_(void **p, int *cap, int need, size_t size) {
  if (need <= *cap) return true;
  int c = *cap ? *cap : 16;
  while (c < need) {
    if (c > (1 << 29)) return false; /* the next doubling would overflow an int */
    c *= 2;
  }
  void *q = realloc(*p, (size_t)c * size);
  if (!q) return false;
  *p = q;
  *cap = c;
  return true;
}

/* Room for more bytes after the n held; false (and oom set) when there is no host memory. */
static bool sb_reserve(kiln__sb *b, size_t more) {
  if (b->oom) return false;
  if (b->n + more < b->cap) return true;
  size_t cap = b->cap ? b->cap * 2 : 4096;
  while (cap <= b->n + more)
    cap *= 2;
  char *s = realloc(b->s, cap);
  if (!s) {
    b->oom = true;
    return false;
  }
  b->s = s;
  b->cap = cap;
  return true;
}

void kiln__sb_put(kiln__sb *b, const void *p, size_t n) {
  if (!sb_reserve(b, n)) return;
  memcpy(b->s + b->n, p, n);
  b->n += n;
  b->s[b->n] = 0;
}

void kiln__sb_printf(kiln__sb *b, const char *fmt, ...) {
  for (;;) {
    if (b->oom) return;
    va_list ap;
    va_start(ap, fmt);
    size_t room = b->cap - b->n;
    int k = vsnprintf(b->s ? b->s + b->n : NULL, room, fmt, ap);
    va_end(ap);
    if (k < 0) {
      b->oom = true;
      return;
    }
    if ((size_t)k < room) {
      b->n += (size_t)k;
      return;
    }
    sb_reserve(b, (size_t)k + 1);
  }
}

void kiln__sb_free(kiln__sb *b) {
  free(b->s);
  memset(b, 0, sizeof *b);
}

char *kiln__strf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  char *s = n < 0 ? NULL : malloc((size_t)n + 1);
  if (s) {
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
  }
  return s;
}

FILE *kiln__fopen_regular(const char *path, bool *irregular, uint64_t *size) {
  *irregular = false;
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return NULL;
  struct stat st;
  FILE *f = NULL;
  if (fstat(fd, &st) == 0) {
    *irregular = !S_ISREG(st.st_mode);
    if (!*irregular) f = fdopen(fd, "rb"); /* O_NONBLOCK does nothing to a regular file */
    if (size) *size = (uint64_t)st.st_size;
  }
  if (!f) {
    int e = errno;
    close(fd);
    errno = e;
  }
  return f;
}
