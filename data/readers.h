/*
 * readers.h: the byte-level parts of the data readers, apart from files and devices so that they
 * can be fuzzed (tests/fuzz/) and reused by other formats. No CUDA.
 */
#ifndef KILN_READERS_H
#define KILN_READERS_H

#include <stddef.h>
#include <stdint.h>

/* Inflates gzip data (every member of it): a malloc'd buffer of *len bytes, or NULL with why
 * filled (truncation, corruption, trailing garbage, out of memory). */
uint8_t *kiln__gunzip(const uint8_t *raw, size_t rlen, size_t *len, char *why, size_t wlen);
/* Checks an idx file of ndim dims of unsigned bytes held in buf and copies its data out (the
 * product of dims bytes); NULL with why filled when anything does not check out. */
uint8_t *kiln__idx_parse(const uint8_t *buf, size_t len, int ndim, uint32_t *dims, char *why,
                         size_t wlen);

#endif
