/*
 * readers.h: the byte-level parts of the data readers, apart from files and devices so that they
 * can be fuzzed (tests/fuzz/) and reused by other formats. No CUDA.
 */
#ifndef KILN_READERS_H
#define KILN_READERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Inflates gzip data (every member of it) into a malloc'd buffer of *len bytes, at most max_out:
 * more is an error, unless prefix is set (then the first max_out bytes are what it gives). NULL
 * with why filled on truncation, corruption, trailing garbage or out of memory. */
uint8_t *kiln__gunzip(const uint8_t *raw, size_t rlen, size_t max_out, bool prefix, size_t *len,
                      char *why, size_t wlen);
/* Inflates a gzipped idx file of ndim dims, reading its header first and inflating no more than
 * the header declares: a small file that would inflate to gigabytes is refused early. */
uint8_t *kiln__idx_gunzip(const uint8_t *raw, size_t rlen, int ndim, size_t *len, char *why,
                          size_t wlen);
/* Checks an idx file of ndim dims of unsigned bytes held in buf and copies its data out (the
 * product of dims bytes); NULL with why filled when anything does not check out. */
uint8_t *kiln__idx_parse(const uint8_t *buf, size_t len, int ndim, uint32_t *dims, char *why,
                         size_t wlen);

#endif
