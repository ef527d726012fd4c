/*
 * kiln_imagefolder.h: image folders and their loader, a part of kiln's public header: include
 * kiln.h, which includes this.
 */
#ifndef KILN_IMAGEFOLDER_H_PUBLIC
#define KILN_IMAGEFOLDER_H_PUBLIC

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- image folders */

/*
 * A folder of images sorted into class folders, as torchvision's ImageFolder reads it:
 * root/<class>/.../<file>.jpg (.jpeg, .png; any case). The class folders are sorted by name
 * (byte order) and numbered from 0 in that order; each class's files (searched through its
 * subfolders, 16 deep at most, symbolic links followed) are sorted as torchvision sorts them, by
 * folder and then by name, and the samples are the classes' files one class after another.
 * Unlike torchvision, names starting with '.' are passed over (a ".ipynb_checkpoints" folder is
 * no class), only JPEG and PNG files are samples (other extensions are passed over), and a folder
 * named like an image file is a bad file. Opening reads the folders and each file's size only: a
 * large folder opens in the time of a directory listing. Images are decoded when loaded
 * (libjpeg-turbo, libpng) to 8-bit RGB, as PIL's convert("RGB") gives them: gray repeated,
 * palettes looked up, 16-bit samples cut to their high byte, alpha dropped, a PNG's gamma
 * ignored.
 *
 * A bad file (0 bytes, not a regular file, larger than max_file_bytes, not a JPEG or PNG by its
 * first bytes, truncated or corrupted, a CMYK JPEG, more than max_pixels pixels) is never
 * trusted: with KILN_IMAGE_BAD_SKIP (the default) it is reported on stderr by name and why, once,
 * listed (kiln_image_folder_bad), and left out (found at opening) or replaced in its batch by the
 * next good sample of the folder's order, with that sample's label (found while loading, so that
 * every batch keeps its size); with KILN_IMAGE_BAD_FAIL the open or the load fails with an error
 * naming the file. A class folder with no image is an error, as in torchvision.
 */
typedef enum kiln_image_bad {
  KILN_IMAGE_BAD_SKIP = 0, /* report, list and skip or replace */
  KILN_IMAGE_BAD_FAIL,     /* the call that meets it fails, naming the file */
} kiln_image_bad;
typedef struct kiln_image_folder_options {
  int64_t max_pixels;     /* 0: 1 << 26 (8192 x 8192) */
  int64_t max_file_bytes; /* 0: 1 << 28 (256 MiB) */
  kiln_image_bad bad;
  int quiet; /* 1: bad files are listed, not printed */
} kiln_image_folder_options;
typedef struct kiln_image_folder kiln_image_folder;
/* NULL options: every field zero. NULL with the error set when root cannot be read, holds no
 * class folder, or a class holds no image (and on a bad file with KILN_IMAGE_BAD_FAIL). Runs on
 * the host (a no_gpu context too). */
kiln_image_folder *kiln_image_folder_open(kiln_ctx *ctx, const char *root,
                                          const kiln_image_folder_options *o);
int64_t kiln_image_folder_size(const kiln_image_folder *f); /* the samples */
int kiln_image_folder_classes(const kiln_image_folder *f);
const char *kiln_image_folder_class_name(const kiln_image_folder *f, int c); /* NULL: no class */
/* Sample i's file and label (its class); NULL and -1 for an i out of range. */
const char *kiln_image_folder_path(const kiln_image_folder *f, int64_t i);
int kiln_image_folder_label(const kiln_image_folder *f, int64_t i);
/* The bad files found so far (at opening and by loaders): how many, and the k-th's path and why
 * (NULL for a k out of range). */
int64_t kiln_image_folder_bad_count(const kiln_image_folder *f);
const char *kiln_image_folder_bad(const kiln_image_folder *f, int64_t k, const char **why);
/* Decodes sample i on the host: *pixels (malloc'd, the caller frees it) of (*rows, *cols, 3)
 * 8-bit RGB. A bad file is an error naming it (and is listed), whatever the options say. */
kiln_status kiln_image_folder_read(kiln_image_folder *f, int64_t i, uint8_t **pixels, int *rows,
                                   int *cols);
/* Frees the folder; its loaders must be freed first (else an error, and the folder is kept). */
void kiln_image_folder_free(kiln_image_folder *f);

/*
 * Batches of an image folder on the device, (B, height, width, 3), channels last, and labels
 * (B) i32. Host threads read and decode each batch's files while the GPU runs the step before
 * (batch k + 1 is decoded while step k runs), and copy to pinned host memory only the pixels
 * that the batch's transform reads; kiln_image_loader_next queues their copy to the device and
 * records one kernel that resizes, crops, flips and normalises every image of the batch (the
 * antialiased bilinear filter of PIL and of torchvision's antialias=True, in f32, not rounded to
 * bytes between steps as uint8 pipelines are). The transforms:
 * - KILN_IMAGE_TRAIN, torchvision's RandomResizedCrop(size, scale, ratio) and
 *   RandomHorizontalFlip(): a box of a random area fraction in [scale_min, scale_max] of the
 *   image and a random aspect ratio, log-uniform in [ratio_min, ratio_max] (ten tries, then the
 *   whole image cut to the nearest allowed ratio, centred), resized to height x width, flipped
 *   left-right with probability 1/2 (no_flip: never); the draws come from (seed, epoch, sample);
 * - KILN_IMAGE_EVAL, Resize(resize) and CenterCrop((height, width)): the shorter side resized to
 *   `resize` (the longer in proportion, truncated), then the centre height x width; an image
 *   whose longer side would then exceed 2^24 pixels is a bad file.
 * then (v / 255 - mean[c]) / std[c]. The order is shuffled per epoch from (seed, epoch), or the
 * folder's; the last partial batch is dropped with drop_last. Call kiln_image_loader_next first
 * in a step (a copy queued after recorded work splits the step's graph, as
 * kiln_tensor_copy_from_host does). A step that fails gives its batch back: the next call
 * returns the same batch. With a no_gpu context the files are read, decoded and placed as with
 * a GPU, and the copies dropped.
 * Memory: two pinned host buffers and one device buffer of staged pixels, first three times a
 * batch's output pixels each, doubled when a batch needs more (at most 2 GiB a batch: a larger
 * one is an error naming the batch); a larger device buffer is a new persistent tensor, so the
 * steps that read it are captured again (the old graphs are freed). *y of a full batch is the
 * loader's own labels tensor, rewritten by the next call: read it in the step, never free it.
 */
typedef enum kiln_image_transform {
  KILN_IMAGE_TRAIN = 0, /* random resized crop and flip */
  KILN_IMAGE_EVAL,      /* resize and centre crop */
} kiln_image_transform;
typedef struct kiln_image_loader_options {
  int64_t batch;     /* required */
  int height, width; /* the images made, 0: 224 each */
  kiln_image_transform transform;
  int shuffle, drop_last;
  uint64_t seed;
  float scale_min, scale_max; /* KILN_IMAGE_TRAIN's area fractions, 0: 0.08 and 1 */
  float ratio_min, ratio_max; /* its aspect ratios (width / height), 0: 3/4 and 4/3 */
  int no_flip;
  int resize; /* KILN_IMAGE_EVAL's shorter side, 0: the crop's larger side * 8 / 7 (256 for 224) */
  float mean[3], std[3]; /* all zero: ImageNet's, (0.485, 0.456, 0.406) and (0.229, 0.224, 0.225) */
  kiln_dtype dtype;      /* the images' dtype: KILN_DTYPE_F32 (0) or KILN_DTYPE_BF16 */
  int threads;           /* decoding threads, 0: the machine's processors (at most 32) */
} kiln_image_loader_options;
typedef struct kiln_image_loader kiln_image_loader;
kiln_image_loader *kiln_image_loader_new(kiln_image_folder *f, const kiln_image_loader_options *o);
/* Starts an epoch: its order, and the decoding of its first batch. */
void kiln_image_loader_start(kiln_image_loader *l, int epoch);
/* The epoch's next batch: 1 with *x (B, height, width, 3) and *y (B) i32; 0 at the end of the
 * epoch or with the error set (a bad file with KILN_IMAGE_BAD_FAIL, naming it). */
int kiln_image_loader_next(kiln_image_loader *l, kiln_tensor **x, kiln_tensor **y);
int64_t kiln_image_loader_batches(const kiln_image_loader *l);
/* What the loader did so far: images made, files decoded (replacements included) and the seconds
 * the decoding threads spent on them (summed over threads), the seconds kiln_image_loader_next
 * waited for decoding (0 when loading keeps up with the steps), and the bytes queued to the
 * device; and how many decoding threads it has. decoded / decode_seconds * threads is what
 * loading can give, in images a second, with every thread busy. */
typedef struct kiln_image_loader_stats {
  int threads;
  int64_t images, decoded;
  double decode_seconds, wait_seconds;
  int64_t bytes_copied;
} kiln_image_loader_stats;
kiln_image_loader_stats kiln_image_loader_stats_get(const kiln_image_loader *l);
void kiln_image_loader_free(kiln_image_loader *l);

#ifdef __cplusplus
}
#endif
#endif
