/*
 * imagefolder.h: what an image folder (imagefolder.c) shares with its loader (imageloader.c).
 */
#ifndef KILN_IMAGEFOLDER_H
#define KILN_IMAGEFOLDER_H

#include <pthread.h>

#include "../core/internal.h"

typedef struct strs {
  char **v;
  int64_t n, cap;
} strs;

struct kiln_image_folder {
  kiln_ctx *ctx;
  kiln_image_folder_options o;
  int nclass;
  char **classes;
  int64_t n;
  char **paths;   /* (n) */
  int32_t *label; /* (n) */
  uint8_t *bad;   /* (n): 1 once the sample's file was found bad (atomic bytes) */
  int loaders;
  pthread_mutex_t *mu; /* the bad lists, from loader threads (apart: const folders lock it) */
  strs bad_path, bad_why;
};

/* Reads and decodes sample i's file: pixels, or NULL with why filled. Thread-safe. */
uint8_t *kiln__image_folder_decode(const kiln_image_folder *f, int64_t i, int *rows, int *cols,
                                   char *why, size_t wlen);
/* Marks sample i bad; the first to do so (the return) lists it when list is set, and prints it
 * when print is set and the folder is not quiet. Thread-safe. */
bool kiln__image_folder_mark_bad(kiln_image_folder *f, int64_t i, const char *why, bool list,
                                 bool print);

#endif
