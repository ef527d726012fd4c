/*
 * cifar10_bytes.c: the byte-level half of the CIFAR-10 reader, apart from files and devices so
 * that it can be fuzzed (tests/fuzz/fuzz_cifar10.c): xz decompression with liblzma, and the checks
 * and the change of layout (CHW to HWC) of the binary batches' records. No CUDA.
 */
#include <lzma.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "readers.h"

/* The six bytes every xz stream starts with. */
static const uint8_t xz_magic[6] = {0xfd, '7', 'z', 'X', 'Z', 0x00};

/* What a liblzma error means for the data, written into why. */
static void xz_why(lzma_ret r, lzma_stream *s, size_t olen, char *why, size_t wlen) {
  switch (r) {
  case LZMA_BUF_ERROR:
    snprintf(why, wlen, "truncated: the xz data ends early (after %zu bytes decompressed)", olen);
    break;
  case LZMA_FORMAT_ERROR: snprintf(why, wlen, "not xz data (no xz stream header)"); break;
  case LZMA_OPTIONS_ERROR:
    snprintf(why, wlen, "unsupported xz options (a filter or header this liblzma does not know)");
    break;
  case LZMA_DATA_ERROR:
    snprintf(why, wlen, "corrupt xz data (after %zu bytes decompressed)", olen);
    break;
  case LZMA_MEMLIMIT_ERROR:
    snprintf(why, wlen,
             "decoding the xz data needs %llu MiB of memory, more than the %llu MiB allowed",
             (unsigned long long)(lzma_memusage(s) >> 20),
             (unsigned long long)(KILN__XZ_MEMLIMIT >> 20));
    break;
  case LZMA_MEM_ERROR: snprintf(why, wlen, "out of host memory"); break;
  default: snprintf(why, wlen, "xz decoder error %d", (int)r); break;
  }
}

uint8_t *kiln__unxz(const uint8_t *raw, size_t rlen, size_t max_out, size_t *len, char *why,
                    size_t wlen) {
  if (rlen == 0) {
    snprintf(why, wlen, "empty: no xz data");
    return NULL;
  }
  /* room for one byte more than max_out tells of output past it, and lets a stream of exactly
   * max_out bytes reach its end (the index and footer follow the last byte) */
  size_t limit = max_out < SIZE_MAX ? max_out + 1 : max_out;
  size_t ocap = limit;
  if (rlen <= SIZE_MAX / 8 && rlen * 2 + 4096 < ocap) ocap = rlen * 2 + 4096;
  uint8_t *out = malloc(ocap);
  if (!out) {
    snprintf(why, wlen, "out of host memory");
    return NULL;
  }
  lzma_stream s = LZMA_STREAM_INIT;
  const uint8_t *in = raw; /* the start of the stream to decode next */
  size_t left = rlen, olen = 0;
  bool started = false;
  for (;;) {
    if (!started) {
      lzma_ret r = lzma_stream_decoder(&s, KILN__XZ_MEMLIMIT, 0);
      if (r != LZMA_OK) {
        xz_why(r, &s, olen, why, wlen);
        goto fail;
      }
      started = true;
      s.next_in = in;
      s.avail_in = left;
    }
    if (olen == ocap) {
      size_t cap = ocap > limit / 2 ? limit : ocap * 2;
      uint8_t *o = realloc(out, cap);
      if (!o) {
        snprintf(why, wlen, "out of host memory");
        goto fail;
      }
      out = o;
      ocap = cap;
    }
    s.next_out = out + olen;
    s.avail_out = ocap - olen;
    lzma_ret r = lzma_code(&s, LZMA_FINISH);
    olen = ocap - s.avail_out;
    if (olen > max_out) {
      snprintf(why, wlen, "the xz data decompresses to more than %zu bytes", max_out);
      goto fail;
    }
    if (r == LZMA_OK) continue; /* progress; a call without any is answered LZMA_BUF_ERROR */
    if (r != LZMA_STREAM_END) {
      xz_why(r, &s, olen, why, wlen);
      goto fail;
    }
    /* after a stream: nothing, stream padding (zero bytes, a multiple of four), or another
     * stream; anything else is garbage */
    const uint8_t *p = s.next_in;
    size_t rest = s.avail_in, pad = 0;
    while (pad < rest && p[pad] == 0)
      pad++;
    if (pad == rest && pad % 4 == 0) break;
    if (pad % 4 == 0 && rest - pad >= sizeof xz_magic &&
        memcmp(p + pad, xz_magic, sizeof xz_magic) == 0) {
      lzma_end(&s);
      s = (lzma_stream)LZMA_STREAM_INIT;
      started = false;
      in = p + pad;
      left = rest - pad;
      continue;
    }
    snprintf(why, wlen, "%zu bytes of trailing garbage after the xz data", rest);
    goto fail;
  }
  lzma_end(&s);
  *len = olen;
  return out;
fail:
  lzma_end(&s);
  free(out);
  return NULL;
}

bool kiln__cifar10_check(const uint8_t *buf, size_t len, int64_t *n, char *why, size_t wlen) {
  const size_t rec = KILN__CIFAR10_RECORD;
  if (len == 0) {
    snprintf(why, wlen, "empty: no records (a record is %zu bytes: a label and a 32x32x3 image)",
             rec);
    return false;
  }
  if (len % rec != 0) {
    snprintf(why, wlen,
             "%zu bytes is not a whole number of %zu-byte records: %zu records and %zu bytes over "
             "(truncated, or not a CIFAR-10 binary batch)",
             len, rec, len / rec, len % rec);
    return false;
  }
  size_t count = len / rec; /* at most SIZE_MAX / 3073: an int64_t holds it */
  for (size_t i = 0; i < count; i++) {
    uint8_t label = buf[i * rec];
    if (label > 9) {
      snprintf(why, wlen, "record %zu: label %u (expected 0..9)", i, (unsigned)label);
      return false;
    }
  }
  *n = (int64_t)count;
  return true;
}

void kiln__cifar10_unpack(const uint8_t *buf, int64_t n, uint8_t *images, uint8_t *labels) {
  const size_t plane = KILN__CIFAR10_SIDE * KILN__CIFAR10_SIDE; /* 1024 */
  for (int64_t i = 0; i < n; i++) {
    const uint8_t *rec = buf + (size_t)i * KILN__CIFAR10_RECORD; /* label, then (3, 32, 32) */
    uint8_t *im = images + (size_t)i * KILN__CIFAR10_PIXELS;     /* (32, 32, 3) */
    labels[i] = rec[0];
    for (size_t p = 0; p < plane; p++)
      for (size_t c = 0; c < 3; c++)
        im[p * 3 + c] = rec[1 + c * plane + p];
  }
}
