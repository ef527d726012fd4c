/*
 * util.h: small host utilities every layer uses: hashing, the splitmix64 generator, growable
 * arrays, a growable string and opening regular files. No CUDA, no context.
 */
#ifndef KILN_UTIL_H
#define KILN_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* FNV-1a, 64-bit, continuing from h (0 starts a new hash). */
uint64_t kiln__hash(const void *p, size_t n, uint64_t h);

/* One step of splitmix64: advances *state and returns the next 64 random bits. */
uint64_t kiln__splitmix64(uint64_t *state);
/* A double in [0, 1) from the next 53 bits. */
double kiln__splitmix64_unit(uint64_t *state);

/* Makes room for need elements of size bytes in *p (capacity *cap, doubling from 16): false
 * when host memory runs out, and then *p and *cap are unchanged. */
bool kiln__grow_(void **p, int *cap, int need, size_t size);
#define KILN__GROW(arr, cap, need) kiln__grow_((void **)&(arr), &(cap), (need), sizeof *(arr))

/* A growable string for generated source and signatures; oom is set (and sticks) when host
 * memory runs out, after which appends do nothing. */
typedef struct kiln__sb {
  char *s;
  size_t n, cap;
  bool oom;
} kiln__sb;
void kiln__sb_printf(kiln__sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kiln__sb_put(kiln__sb *b, const void *p, size_t n); /* raw bytes */
void kiln__sb_free(kiln__sb *b);

/* A formatted string in malloc'd memory (the caller frees it); NULL out of host memory. */
char *kiln__strf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Opens path for reading when it is a regular file, and gives its size (size may be NULL). The
 * open does not block, so a FIFO or a device at the path cannot hang the process. NULL on
 * failure: *irregular says the path exists but is not a regular file; otherwise errno says why. */
FILE *kiln__fopen_regular(const char *path, bool *irregular, uint64_t *size);

#endif
