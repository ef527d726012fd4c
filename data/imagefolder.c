/*
 * imagefolder.c: folders of JPEG and PNG images sorted into class folders (torchvision's
 * ImageFolder layout): the listing, the bad-file lists, and one sample read and decoded
 * (imagefile.c). Their loader is imageloader.c.
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "imagefolder.h"
#include "readers.h"

#define DEFAULT_MAX_PIXELS ((int64_t)1 << 26)
#define DEFAULT_MAX_FILE ((int64_t)1 << 28)
#define MAX_DEPTH 16 /* class folders' subfolders searched, at most */

/* ---------------------------------------------------------------- the folder */

static bool strs_push(strs *s, char *p) {
  if (!p) return false;
  if (s->n == s->cap) {
    int64_t cap = s->cap ? 2 * s->cap : 64;
    char **v = realloc(s->v, (size_t)cap * sizeof *v);
    if (!v) {
      free(p);
      return false;
    }
    s->v = v;
    s->cap = cap;
  }
  s->v[s->n++] = p;
  return true;
}

static void strs_free(strs *s) {
  for (int64_t i = 0; i < s->n; i++)
    free(s->v[i]);
  free(s->v);
  *s = (strs){0};
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* torchvision's order of a class's files: by folder (the paths up to their last '/', compared as
 * strings, as sorted(os.walk(...)) orders them), then by file name within a folder. */
static int by_folder_then_name(const void *a, const void *b) {
  const char *p = *(char *const *)a, *q = *(char *const *)b;
  const char *sp = strrchr(p, '/'), *sq = strrchr(q, '/');
  size_t lp = sp ? (size_t)(sp - p) : 0, lq = sq ? (size_t)(sq - q) : 0;
  int c = strncmp(p, q, lp < lq ? lp : lq);
  if (c == 0 && lp != lq) c = lp < lq ? -1 : 1; /* one folder is a prefix of the other's path */
  if (c != 0) return c;
  return strcmp(sp ? sp + 1 : p, sq ? sq + 1 : q);
}

static bool image_name(const char *name) {
  const char *dot = strrchr(name, '.');
  if (!dot) return false;
  char ext[8];
  size_t k = 0;
  for (const char *p = dot + 1; *p && k < sizeof ext - 1; p++)
    ext[k++] = (char)tolower((unsigned char)*p);
  ext[k] = 0;
  return strlen(dot + 1) == k &&
         (strcmp(ext, "jpg") == 0 || strcmp(ext, "jpeg") == 0 || strcmp(ext, "png") == 0);
}

/* Lists a bad file (under f->mu), printing it when print is set and the folder is not quiet. */
static void note_bad(kiln_image_folder *f, const char *path, const char *why, bool print) {
  pthread_mutex_lock(f->mu);
  if (strs_push(&f->bad_path, kiln__strf("%s", path)) &&
      !strs_push(&f->bad_why, kiln__strf("%s", why)))
    free(f->bad_path.v[--f->bad_path.n]); /* the two lists stay the same length */
  pthread_mutex_unlock(f->mu);
  if (print && !f->o.quiet) fprintf(stderr, "kiln: %s: %s: skipped\n", path, why);
}

bool kiln__image_folder_mark_bad(kiln_image_folder *f, int64_t i, const char *why, bool list,
                                 bool print) {
  /* two threads may meet the same bad file (one as a replacement): one lists it */
  bool first = __atomic_exchange_n(&f->bad[i], 1, __ATOMIC_RELAXED) == 0;
  if (first && list) note_bad(f, f->paths[i], why, print);
  return first;
}

/* A file that may be a sample: false with why filled when it is bad on its face. */
static bool file_ok(const kiln_image_folder *f, const struct stat *st, char *why, size_t wlen) {
  if (S_ISDIR(st->st_mode))
    snprintf(why, wlen, "a directory named as an image");
  else if (!S_ISREG(st->st_mode))
    snprintf(why, wlen, "not a regular file");
  else if (st->st_size == 0)
    snprintf(why, wlen, "an empty file");
  else if ((int64_t)st->st_size > f->o.max_file_bytes)
    snprintf(why, wlen, "%lld bytes is more than max_file_bytes (%lld)", (long long)st->st_size,
             (long long)f->o.max_file_bytes);
  else
    return true;
  return false;
}

/* Adds the image files under dir (depth folders deep) to out, sorted; false with the error set. */
static bool walk(kiln_image_folder *f, const char *dir, int depth, strs *out) {
  const char *fn = "kiln_image_folder_open";
  DIR *d = opendir(dir);
  if (!d)
    return !kiln__error(f->ctx, KILN_ERR_IO, "%s: %s: cannot read the folder: %s", fn, dir,
                        strerror(errno));
  strs names = {0};
  struct dirent *e;
  bool ok = true;
  while (ok && (e = readdir(d)))
    if (e->d_name[0] != '.') ok = strs_push(&names, kiln__strf("%s", e->d_name));
  closedir(d);
  if (!ok) {
    strs_free(&names);
    return !kiln__error(f->ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  }
  if (names.n) qsort(names.v, (size_t)names.n, sizeof *names.v, by_name);
  for (int64_t k = 0; ok && k < names.n; k++) {
    char *path = kiln__strf("%s/%s", dir, names.v[k]);
    struct stat st;
    char why[160];
    if (!path) {
      ok = !kiln__error(f->ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    } else if (stat(path, &st) != 0) {
      /* a dangling link: bad if named as an image, else not ours */
      if (image_name(names.v[k])) {
        snprintf(why, sizeof why, "cannot read it: %s", strerror(errno));
        goto bad;
      }
      free(path);
    } else if (S_ISDIR(st.st_mode) && !image_name(names.v[k])) {
      if (depth < MAX_DEPTH) ok = walk(f, path, depth + 1, out);
      free(path);
    } else if (!image_name(names.v[k])) {
      free(path);
    } else if (file_ok(f, &st, why, sizeof why)) {
      ok = strs_push(out, path) || !kiln__error(f->ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    } else {
    bad:
      if (f->o.bad == KILN_IMAGE_BAD_FAIL)
        ok = !kiln__error(f->ctx, KILN_ERR_FORMAT, "%s: %s: %s", fn, path, why);
      else
        note_bad(f, path, why, true);
      free(path);
    }
  }
  strs_free(&names);
  return ok;
}

kiln_image_folder *kiln_image_folder_open(kiln_ctx *ctx, const char *root,
                                          const kiln_image_folder_options *o) {
  const char *fn = __func__;
  if (!kiln__ok(ctx)) return NULL;
  static const kiln_image_folder_options none = {0};
  if (!o) o = &none;
  if (!root) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL root", fn), NULL;
  if (o->max_pixels < 0 || o->max_file_bytes < 0 ||
      (o->bad != KILN_IMAGE_BAD_SKIP && o->bad != KILN_IMAGE_BAD_FAIL))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: max_pixels %lld and max_file_bytes %lld must be >= 0 (0: the "
                       "default) and bad %d KILN_IMAGE_BAD_SKIP or _FAIL",
                       fn, (long long)o->max_pixels, (long long)o->max_file_bytes, (int)o->bad),
           NULL;
  kiln_image_folder *f = calloc(1, sizeof *f);
  if (!f) return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn), NULL;
  f->ctx = ctx;
  f->o = *o;
  if (!f->o.max_pixels) f->o.max_pixels = DEFAULT_MAX_PIXELS;
  if (!f->o.max_file_bytes) f->o.max_file_bytes = DEFAULT_MAX_FILE;
  if (!(f->mu = malloc(sizeof *f->mu))) {
    free(f);
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn), NULL;
  }
  pthread_mutex_init(f->mu, NULL);
  /* the class folders, sorted */
  strs classes = {0}, files = {0};
  DIR *d = opendir(root);
  bool ok = d != NULL;
  if (!d)
    kiln__error(ctx, KILN_ERR_IO, "%s: %s: cannot read the folder: %s", fn, root, strerror(errno));
  struct dirent *e;
  while (ok && (e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char *path = kiln__strf("%s/%s", root, e->d_name);
    struct stat st;
    if (path && stat(path, &st) == 0 && S_ISDIR(st.st_mode))
      ok = strs_push(&classes, kiln__strf("%s", e->d_name));
    ok = ok && path;
    free(path);
    if (!ok) kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  }
  if (d) closedir(d);
  if (ok && classes.n == 0)
    ok =
        !kiln__error(ctx, KILN_ERR_FORMAT,
                     "%s: %s holds no class folder (the layout is root/<class>/<image>)", fn, root);
  if (ok && classes.n > INT32_MAX)
    ok = !kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s: %lld classes", fn, root, (long long)classes.n);
  if (ok) qsort(classes.v, (size_t)classes.n, sizeof *classes.v, by_name); /* n > 0 */
  /* each class's files, sorted, one class after another */
  int32_t *label = NULL;
  int64_t labelled = 0;
  for (int64_t c = 0; ok && c < classes.n; c++) {
    char *dir = kiln__strf("%s/%s", root, classes.v[c]);
    int64_t before = files.n;
    ok = dir ? walk(f, dir, 0, &files)
             : !kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    if (ok && files.n > before)
      qsort(files.v + before, (size_t)(files.n - before), sizeof *files.v, by_folder_then_name);
    if (ok && files.n == before)
      ok = !kiln__error(ctx, KILN_ERR_FORMAT,
                        "%s: class folder %s holds no image (.jpg, .jpeg or .png) kiln can use", fn,
                        dir);
    free(dir);
    if (ok) {
      int32_t *l = realloc(label, (size_t)files.n * sizeof *l);
      if (!l) {
        ok = !kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
        break;
      }
      label = l;
      for (; labelled < files.n; labelled++)
        label[labelled] = (int32_t)c;
    }
  }
  if (ok && !(f->bad = calloc((size_t)files.n, 1)))
    ok = !kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  if (!ok) {
    strs_free(&classes);
    strs_free(&files);
    free(label);
    kiln_image_folder_free(f);
    return NULL;
  }
  f->nclass = (int)classes.n;
  f->classes = classes.v;
  f->n = files.n;
  f->paths = files.v;
  f->label = label;
  return f;
}

int64_t kiln_image_folder_size(const kiln_image_folder *f) { return f ? f->n : 0; }
int kiln_image_folder_classes(const kiln_image_folder *f) { return f ? f->nclass : 0; }

const char *kiln_image_folder_class_name(const kiln_image_folder *f, int c) {
  return f && c >= 0 && c < f->nclass ? f->classes[c] : NULL;
}

const char *kiln_image_folder_path(const kiln_image_folder *f, int64_t i) {
  return f && i >= 0 && i < f->n ? f->paths[i] : NULL;
}

int kiln_image_folder_label(const kiln_image_folder *f, int64_t i) {
  return f && i >= 0 && i < f->n ? f->label[i] : -1;
}

int64_t kiln_image_folder_bad_count(const kiln_image_folder *f) {
  if (!f) return 0;
  pthread_mutex_lock(f->mu);
  int64_t n = f->bad_path.n;
  pthread_mutex_unlock(f->mu);
  return n;
}

const char *kiln_image_folder_bad(const kiln_image_folder *f, int64_t k, const char **why) {
  if (why) *why = NULL;
  if (!f) return NULL;
  pthread_mutex_lock(f->mu);
  const char *p = NULL;
  if (k >= 0 && k < f->bad_path.n) {
    p = f->bad_path.v[k];
    if (why) *why = f->bad_why.v[k];
  }
  pthread_mutex_unlock(f->mu);
  return p;
}

uint8_t *kiln__image_folder_decode(const kiln_image_folder *f, int64_t i, int *rows, int *cols,
                                   char *why, size_t wlen) {
  bool irregular = false;
  uint64_t size = 0;
  *rows = *cols = 0;
  FILE *fp = kiln__fopen_regular(f->paths[i], &irregular, &size);
  if (!fp) {
    snprintf(why, wlen, "%s", irregular ? "not a regular file" : strerror(errno));
    return NULL;
  }
  uint8_t *buf = NULL;
  if (size == 0 || size > (uint64_t)f->o.max_file_bytes)
    snprintf(why, wlen, size ? "%llu bytes is more than max_file_bytes" : "an empty file",
             (unsigned long long)size);
  else if (!(buf = malloc((size_t)size)))
    snprintf(why, wlen, "out of host memory for %llu bytes", (unsigned long long)size);
  else if (fread(buf, 1, (size_t)size, fp) != (size_t)size)
    snprintf(why, wlen, "cannot read its %llu bytes", (unsigned long long)size);
  else {
    fclose(fp);
    uint8_t *px = kiln__image_decode(buf, (size_t)size, f->o.max_pixels, rows, cols, why, wlen);
    free(buf);
    return px;
  }
  fclose(fp);
  free(buf);
  return NULL;
}

kiln_status kiln_image_folder_read(kiln_image_folder *f, int64_t i, uint8_t **pixels, int *rows,
                                   int *cols) {
  if (!f) return KILN_ERR_INVALID;
  kiln_ctx *ctx = f->ctx;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!pixels || !rows || !cols)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL pixels, rows or cols", __func__);
  if (i < 0 || i >= f->n)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: sample %lld of a folder of %lld", __func__,
                       (long long)i, (long long)f->n);
  char why[256];
  int r, c;
  uint8_t *px = kiln__image_folder_decode(f, i, &r, &c, why, sizeof why);
  if (!px) {
    kiln__image_folder_mark_bad(f, i, why, true, false); /* the error names it */
    return kiln__error(ctx, KILN_ERR_FORMAT, "%s: %s: %s", __func__, f->paths[i], why);
  }
  *pixels = px;
  *rows = r;
  *cols = c;
  return KILN_OK;
}

void kiln_image_folder_free(kiln_image_folder *f) {
  if (!f) return;
  if (f->loaders > 0) { /* its loaders read it: they are freed first (kiln.h) */
    kiln__error(f->ctx, KILN_ERR_STATE,
                "kiln_image_folder_free: %d loaders of the folder are alive; free them first (the "
                "folder is kept)",
                f->loaders);
    return;
  }
  for (int c = 0; c < f->nclass; c++)
    free(f->classes[c]);
  free(f->classes);
  for (int64_t i = 0; i < f->n; i++)
    free(f->paths[i]);
  free(f->paths);
  free(f->label);
  free(f->bad);
  strs_free(&f->bad_path);
  strs_free(&f->bad_why);
  pthread_mutex_destroy(f->mu);
  free(f->mu);
  free(f);
}
