/*
 * mnist_data.h: where the MNIST examples find their data, and reading it before the GPU is
 * touched, so that a missing or broken data set is reported as such on any machine.
 *
 * The folder is the one given on the command line, else $KILN_MNIST, else data/mnist under the
 * current directory, else the copy in the kiln source tree the example was built from
 * (KILN_SOURCE_DIR, set by CMake), so that a fresh clone trains with no setup from anywhere.
 */
#ifndef KILN_EXAMPLES_MNIST_DATA_H
#define KILN_EXAMPLES_MNIST_DATA_H

#include <stdio.h>
#include <stdlib.h>

#include "kiln.h"

/* 1 when dir holds MNIST's training images, raw or gzip. */
static inline int mnist_data_present(const char *dir) {
  static const char *const names[2] = {"train-images-idx3-ubyte", "train-images-idx3-ubyte.gz"};
  for (int i = 0; i < 2; i++) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", dir, names[i]) >= (int)sizeof path) return 0;
    FILE *f = fopen(path, "rb");
    if (f) {
      fclose(f);
      return 1;
    }
  }
  return 0;
}

/* The data folder: given (the command line's, or NULL), else $KILN_MNIST, else data/mnist, else
 * the source tree's data/mnist. */
static inline const char *mnist_data_dir(const char *given) {
  if (given) return given;
  const char *env = getenv("KILN_MNIST");
  if (env && *env) return env;
#ifdef KILN_SOURCE_DIR
  if (!mnist_data_present("data/mnist") && mnist_data_present(KILN_SOURCE_DIR "/data/mnist"))
    return KILN_SOURCE_DIR "/data/mnist";
#endif
  return "data/mnist";
}

/* Reads both splits of dir into host memory, with a context of its own that needs no GPU; on
 * failure prints why (kiln_mnist_read's message names the file) and exits with status 1. */
static inline void mnist_data_read(const char *prog, const char *dir, kiln_mnist *train,
                                   kiln_mnist *test) {
  kiln_ctx *h = kiln_ctx_new(&(kiln_ctx_options){.no_gpu = 1});
  if (!h || kiln_mnist_read(h, dir, "train", train) != KILN_OK ||
      kiln_mnist_read(h, dir, "t10k", test) != KILN_OK) {
    fprintf(stderr, "%s: reading the data set: %s (name its folder, or set KILN_MNIST)\n", prog,
            h ? kiln_ctx_error(h) : "out of host memory");
    exit(1);
  }
  kiln_ctx_free(h);
}

#endif
