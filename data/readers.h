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

/* Decompresses xz data (one stream, or several back to back, with or without stream padding) into
 * a malloc'd buffer of *len bytes, at most max_out: more is an error, as is decoding that needs
 * more than KILN__XZ_MEMLIMIT bytes of memory. NULL with why filled on truncation, corruption, a
 * failed integrity check, trailing garbage or out of memory. */
#define KILN__XZ_MEMLIMIT ((uint64_t)1 << 28)
uint8_t *kiln__unxz(const uint8_t *raw, size_t rlen, size_t max_out, size_t *len, char *why,
                    size_t wlen);

/* A CIFAR-10 binary record: a label byte 0..9, then the 32x32 image as 1024 red, 1024 green and
 * 1024 blue bytes, each plane row-major (channels first, CHW). */
#define KILN__CIFAR10_SIDE 32
#define KILN__CIFAR10_PIXELS (3 * KILN__CIFAR10_SIDE * KILN__CIFAR10_SIDE) /* 3072 */
#define KILN__CIFAR10_RECORD (1 + KILN__CIFAR10_PIXELS)                    /* 3073 */
/* Checks a decompressed CIFAR-10 batch of len bytes: at least one record, a whole number of
 * records, every label 0..9. *n gets the records; false with why filled (the size and the
 * remainder, or the first bad record's index and label) when anything does not check out. */
bool kiln__cifar10_check(const uint8_t *buf, size_t len, int64_t *n, char *why, size_t wlen);
/* Copies n checked records out of buf: images (n, 32, 32, 3), channels last (HWC), and labels
 * (n). */
void kiln__cifar10_unpack(const uint8_t *buf, int64_t n, uint8_t *images, uint8_t *labels);

/* Images in JPEG or PNG files (data/imagefile.c), told apart by their first bytes. */
typedef enum kiln__image_kind {
  KILN__IMAGE_UNKNOWN = 0,
  KILN__IMAGE_JPEG,
  KILN__IMAGE_PNG,
} kiln__image_kind;
kiln__image_kind kiln__image_sniff(const uint8_t *buf, size_t len);
/* Decodes a JPEG or PNG file held in buf to malloc'd 8-bit RGB pixels (*rows, *cols, 3), as
 * PIL's convert("RGB") gives them. An image of more than max_pixels pixels is refused from its
 * header, before anything is allocated. NULL with why filled for an empty, unknown, truncated or
 * corrupted file, a CMYK JPEG, or out of memory; *rows and *cols are what the header said (0 when
 * it said nothing). */
uint8_t *kiln__image_decode(const uint8_t *buf, size_t len, int64_t max_pixels, int *rows,
                            int *cols, char *why, size_t wlen);

#endif
