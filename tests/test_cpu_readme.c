/*
 * test_cpu_readme.c: what the README and kiln.h promise a new user, without a GPU: the MNIST
 * files shipped in data/mnist read back as MNIST (and load image-shaped, normalised by their own
 * statistics when asked), the examples find them by default from any folder, a loader whose
 * batch is larger than its data set gives one partial batch (none with drop_last) as PyTorch's
 * DataLoader, the kiln_graphs and kiln_fusion getters follow their setters and the environment,
 * and every kiln_*_free takes NULL.
 */
#include <limits.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "../examples/mnist_data.h"
#include "inspect.h"

TestSuite(readme, .fini = th_remove_tmpdirs);

/* ---------------------------------------------------------------- the shipped MNIST */

/* Asserts that m is the MNIST split of n images: 28x28, its first labels and its class counts
 * (the official ones, data/mnist/SOURCE.md). */
static void assert_mnist(const kiln_mnist *m, int64_t n, const int *first, const int64_t *counts) {
  cr_assert_eq(m->n, n);
  cr_assert_eq(m->rows, 28);
  cr_assert_eq(m->cols, 28);
  for (int i = 0; i < 10; i++)
    cr_assert_eq(m->labels[i], first[i], "label %d is %d, not %d", i, m->labels[i], first[i]);
  int64_t hist[10] = {0};
  for (int64_t i = 0; i < m->n; i++) {
    cr_assert_leq(m->labels[i], 9);
    hist[m->labels[i]]++;
  }
  for (int c = 0; c < 10; c++)
    cr_assert_eq(hist[c], counts[c], "class %d: %lld records, not %lld", c, (long long)hist[c],
                 (long long)counts[c]);
}

Test(readme, the_shipped_mnist_is_mnist) {
  static const int train_first[10] = {5, 0, 4, 1, 9, 2, 1, 3, 1, 4};
  static const int test_first[10] = {7, 2, 1, 0, 4, 1, 4, 9, 5, 9};
  static const int64_t train_counts[10] = {5923, 6742, 5958, 6131, 5842,
                                           5421, 5918, 6265, 5851, 5949};
  static const int64_t test_counts[10] = {980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009};
  const char *dir = KILN_SOURCE_DIR "/data/mnist";
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_mnist tr, te;
  cr_assert_eq(kiln_mnist_read(ctx, dir, "train", &tr), KILN_OK, "%s", th_err(ctx));
  assert_mnist(&tr, 60000, train_first, train_counts);
  cr_assert_eq(kiln_mnist_read(ctx, dir, "t10k", &te), KILN_OK, "%s", th_err(ctx));
  assert_mnist(&te, 10000, test_first, test_counts);
  /* the pixel mean of the training images is MNIST's 0.1307 */
  double sum = 0;
  for (int64_t i = 0; i < tr.n * 784; i++)
    sum += tr.images[i];
  double mean = sum / (255.0 * (double)(tr.n * 784));
  cr_assert(mean > 0.13065 && mean < 0.13075, "pixel mean %.5f", mean);
  kiln_mnist_free(&tr);
  kiln_mnist_free(&te);
  /* loaded with NAN for its statistics: image-shaped, normalised by MNIST's 0.1307 and 0.3081 */
  kiln_dataset *ds = kiln_mnist_load(ctx, dir, "train", NAN, NAN);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  th_assert_shape(kiln_dataset_images(ds), KILN_SHAPE(60000, 28, 28, 1));
  kiln_normalize n = kiln_dataset_normalization(ds);
  cr_assert_eq(n.channels, 1);
  cr_assert(fabsf(n.mean[0] - 0.1307f) < 5e-5f && fabsf(n.std[0] - 0.3081f) < 5e-5f,
            "mean %.5f std %.5f", n.mean[0], n.std[0]);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

Test(readme, the_examples_find_the_data_from_any_folder) {
  char cwd[4096], tmp[256];
  cr_assert_not_null(getcwd(cwd, sizeof cwd));
  unsetenv("KILN_MNIST");
  /* from a folder without data/mnist: the source tree's copy */
  cr_assert_eq(chdir(th_tmpdir(tmp, sizeof tmp, "readme-cwd")), 0);
  cr_assert_str_eq(mnist_data_dir(NULL), KILN_SOURCE_DIR "/data/mnist");
  cr_assert(mnist_data_present(mnist_data_dir(NULL)));
  /* from the source root: data/mnist, as the README's command names it */
  cr_assert_eq(chdir(KILN_SOURCE_DIR), 0);
  cr_assert_str_eq(mnist_data_dir(NULL), "data/mnist");
  cr_assert(mnist_data_present("data/mnist"));
  /* KILN_MNIST and then the command line's folder come first, whether or not they hold data */
  setenv("KILN_MNIST", tmp, 1);
  cr_assert_str_eq(mnist_data_dir(NULL), tmp);
  cr_assert_str_eq(mnist_data_dir("/elsewhere"), "/elsewhere");
  setenv("KILN_MNIST", "", 1); /* empty is unset */
  cr_assert_str_eq(mnist_data_dir(NULL), "data/mnist");
  cr_assert_not(mnist_data_present(tmp));
  unsetenv("KILN_MNIST");
  cr_assert_eq(chdir(cwd), 0);
}

/* ---------------------------------------------------------------- loaders */

/* A data set of n 2x2 images (pixel values 4 i .. 4 i + 3, label i % 10) on a no-GPU context. */
static kiln_dataset *tiny_dataset(kiln_ctx *ctx, int n) {
  uint8_t images[4 * 16], labels[16];
  cr_assert_leq(n, 16);
  for (int i = 0; i < 4 * n; i++)
    images[i] = (uint8_t)i;
  for (int i = 0; i < n; i++)
    labels[i] = (uint8_t)(i % 10);
  kiln_mnist m = {.n = n, .rows = 2, .cols = 2, .images = images, .labels = labels};
  kiln_dataset *ds = kiln_dataset_from_mnist(ctx, &m, 0.f, 1.f);
  cr_assert_not_null(ds, "%s", th_err(ctx));
  return ds;
}

/* Counts an epoch's batches and asserts their sizes: full ones of batch, then what is left. */
static int64_t epoch_batches(kiln_ctx *ctx, kiln_loader *l, int64_t n, int64_t batch,
                             int drop_last) {
  int64_t k = 0, seen = 0;
  kiln_loader_start(l, 0);
  for (;;) {
    kiln_step_begin(ctx);
    kiln_tensor *x, *y;
    if (!kiln_loader_next(l, &x, &y)) break;
    int64_t b = n - seen < batch ? n - seen : batch;
    th_assert_shape(x, KILN_SHAPE(b, 2, 2, 1)); /* image-shaped, channels last */
    th_assert_shape(y, KILN_SHAPE(b));
    cr_assert_eq(kiln_tensor_dtype(y), KILN_DTYPE_I32);
    cr_assert(!drop_last || b == batch, "drop_last gave a batch of %lld", (long long)b);
    seen += b;
    k++;
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(seen, drop_last ? n / batch * batch : n);
  return k;
}

Test(readme, a_batch_larger_than_the_data_set_is_one_partial_batch) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_dataset *ds = tiny_dataset(ctx, 5);
  /* batch, drop_last, then the batches PyTorch's DataLoader gives for 5 samples */
  static const int64_t cases[][3] = {{8, 0, 1}, {8, 1, 0},         {5, 0, 1},
                                     {5, 1, 1}, {2, 0, 3},         {2, 1, 2},
                                     {1, 0, 5}, {INT64_MAX, 0, 1}, {INT64_MAX, 1, 0}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int64_t batch = cases[i][0], want = cases[i][2];
    int drop_last = (int)cases[i][1];
    for (int shuffle = 0; shuffle < 2; shuffle++) {
      kiln_loader *l = kiln_loader_new(
          ds, &(kiln_loader_options){
                  .batch = batch, .shuffle = shuffle, .seed = 7, .drop_last = drop_last});
      cr_assert_not_null(l, "batch %lld: %s", (long long)batch, th_err(ctx));
      cr_assert_eq(kiln_loader_batches(l), want, "batch %lld drop_last %d: %lld batches",
                   (long long)batch, drop_last, (long long)kiln_loader_batches(l));
      cr_assert_eq(epoch_batches(ctx, l, 5, batch, drop_last), want);
      cr_assert_eq(epoch_batches(ctx, l, 5, batch, drop_last), want, "and again next epoch");
      kiln_loader_free(l);
    }
  }
  th_assert_ok(ctx);
  /* a batch of 0 or less is an error, naming the value */
  cr_assert_null(kiln_loader_new(ds, &(kiln_loader_options){.batch = 0}));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_loader_new", "batch 0");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_loader_new(ds, &(kiln_loader_options){.batch = -3, .drop_last = 1}));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_loader_new", "-3");
  kiln_ctx_clear_error(ctx);
  /* the options are checked as a layer's: flags are 0 or 1, and NULL names what is required */
  cr_assert_null(kiln_loader_new(ds, &(kiln_loader_options){.batch = 2, .shuffle = 2}));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_loader_new: shuffle 2 must be 0 or 1");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_loader_new(ds, &(kiln_loader_options){.batch = 2, .drop_last = -1}));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_loader_new: drop_last -1 must be 0 or 1");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_loader_new(ds, NULL));
  TH_ASSERT_ERROR(ctx, KILN_ERR_INVALID, "kiln_loader_new: NULL options (batch is required)");
  kiln_ctx_clear_error(ctx);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- getters and frees */

Test(readme, the_mode_getters_follow_setters_and_environment) {
  unsetenv("KILN_GRAPH");
  unsetenv("KILN_FUSION");
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert_eq(kiln_graphs(ctx), 1, "graphs are on by default");
  cr_assert_eq(kiln_fusion(ctx), 1, "fusion is on by default");
  kiln_set_graphs(ctx, 0);
  cr_assert_eq(kiln_graphs(ctx), 0);
  cr_assert_eq(kiln_fusion(ctx), 1, "fusion is apart from graphs");
  kiln_set_graphs(ctx, 5);
  cr_assert_eq(kiln_graphs(ctx), 1, "any nonzero is on, and reads back as 1");
  kiln_set_fusion(ctx, 0);
  cr_assert_eq(kiln_fusion(ctx), 0);
  cr_assert_eq(kiln_graphs(ctx), 1);
  th_ctx_free(ctx);
  setenv("KILN_GRAPH", "0", 1);
  ctx = th_cpu_ctx();
  cr_assert_eq(kiln_graphs(ctx), 0, "KILN_GRAPH=0");
  cr_assert_eq(kiln_fusion(ctx), 1);
  th_ctx_free(ctx);
  unsetenv("KILN_GRAPH");
  cr_assert_eq(kiln_graphs(NULL), 0);
  cr_assert_eq(kiln_fusion(NULL), 0);
}

Test(readme, every_free_takes_null) {
  /* the frees called below are all that kiln.h declares (with kiln_imagefolder.h and
   * kiln_dist.h, which it includes): a new one must join them */
  static const char *const frees[] = {
      "kiln_ctx_free",    "kiln_tensor_free",       "kiln_params_free",       "kiln_optim_free",
      "kiln_meta_free",   "kiln_mnist_free",        "kiln_cifar10_free",      "kiln_dataset_free",
      "kiln_loader_free", "kiln_image_folder_free", "kiln_image_loader_free", "kiln_module_free",
      "kiln_dist_free"};
  size_t n1, n2, n3;
  char *h1 = th_read_whole(KILN_SOURCE_DIR "/include/kiln.h", &n1);
  char *h2 = th_read_whole(KILN_SOURCE_DIR "/include/kiln_imagefolder.h", &n2);
  char *h3 = th_read_whole(KILN_SOURCE_DIR "/include/kiln_dist.h", &n3);
  char *h = malloc(n1 + n2 + n3 + 1);
  cr_assert_not_null(h);
  memcpy(h, h1, n1);
  memcpy(h + n1, h2, n2);
  memcpy(h + n1 + n2, h3, n3 + 1);
  free(h1);
  free(h2);
  free(h3);
  int declared = 0;
  for (const char *p = strstr(h, "void kiln_"); p; p = strstr(p + 1, "void kiln_")) {
    const char *name = p + 5, *paren = strchr(name, '(');
    size_t len = paren ? (size_t)(paren - name) : 0;
    if (len < 5 || strncmp(name + len - 5, "_free", 5) != 0) continue;
    bool known = false;
    for (size_t i = 0; i < sizeof frees / sizeof frees[0]; i++)
      known |= strlen(frees[i]) == len && strncmp(frees[i], name, len) == 0;
    cr_assert(known, "kiln.h declares %.*s: call it with NULL here", (int)len, name);
    declared++;
  }
  cr_assert_eq(declared, (int)(sizeof frees / sizeof frees[0]));
  free(h);
  kiln_ctx_free(NULL);
  kiln_tensor_free(NULL);
  kiln_params_free(NULL);
  kiln_optim_free(NULL);
  kiln_meta_free(NULL);
  kiln_mnist_free(NULL);
  kiln_cifar10_free(NULL);
  kiln_dataset_free(NULL);
  kiln_loader_free(NULL);
  kiln_image_folder_free(NULL);
  kiln_image_loader_free(NULL);
  kiln_module_free(NULL);
  kiln_dist_free(NULL);
  /* and a zeroed MNIST split, as a failed read leaves it */
  kiln_mnist m;
  memset(&m, 0, sizeof m);
  kiln_mnist_free(&m);
  cr_assert_null(m.images);
}
