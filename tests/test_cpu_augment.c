/*
 * test_cpu_augment.c: image augmentation (kiln_augment) on a no-GPU context: the node it records
 * (its modes as int attributes, the seed, a fresh Philox offset per call and the epoch as step
 * values, the indices as a second input), misuse failing with a message that names the function
 * and the values and recording nothing, the loader's batch indices (a gather whose start is a
 * step value), the plan (a kernel of its own), and every variant's generated kernel compiling
 * under NVRTC, its source readable.
 */
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

TestSuite(augment, .fini = th_remove_tmpdirs);

static kiln_augment_options opts(int pad, kiln_augment_border border, kiln_augment_flip flip) {
  return (kiln_augment_options){.pad = pad, .border = border, .flip = flip};
}

/* ---------------------------------------------------------------- recording */

Test(augment, records_one_node_with_step_values) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_manual_seed(ctx, 11);
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 8, 6, 3));
  kiln_augment_options o = opts(2, KILN_AUGMENT_BORDER_REFLECT, KILN_AUGMENT_FLIP_RANDOM);
  kiln_tensor *y = kiln_augment(x, &o);
  cr_assert_not_null(y, "%s", th_err(ctx));
  th_assert_shape(y, KILN_SHAPE(4, 8, 6, 3));
  cr_assert_eq(kiln_tensor_dtype(y), KILN_DTYPE_F32);
  cr_assert(!kiln_tensor_requires_grad(y));
  const kiln__node *n = th_node(ctx, -1);
  cr_assert_eq(n->op, KILN__OP_AUGMENT);
  cr_assert_eq(n->nin, 1);
  cr_assert_eq(n->in[0], x);
  cr_assert_eq(n->out, y);
  cr_assert_eq(KILN__I(n, AUGMENT, pad), 2);
  cr_assert_eq(KILN__I(n, AUGMENT, flip), KILN_AUGMENT_FLIP_RANDOM);
  cr_assert_eq(KILN__I(n, AUGMENT, border), KILN_AUGMENT_BORDER_REFLECT);
  cr_assert_eq(KILN__U(n, AUGMENT, seed), 11u);
  cr_assert_eq(KILN__U(n, AUGMENT, offset), 0u);
  cr_assert_eq(KILN__U(n, AUGMENT, epoch), 0u);

  /* each call takes the next offset of the context's stream, shared with dropout */
  cr_assert_not_null(kiln_augment(x, &o));
  cr_assert_eq(KILN__U(th_node(ctx, -1), AUGMENT, offset), 1u);
  cr_assert_not_null(kiln_dropout(th_f32(ctx, KILN_SHAPE(5)), 0.5f, 1));
  cr_assert_eq(KILN__U(th_node(ctx, -1), DROPOUT, offset), 2u);
  kiln_manual_seed(ctx, 12);
  cr_assert_not_null(kiln_augment(x, &o));
  cr_assert_eq(KILN__U(th_node(ctx, -1), AUGMENT, seed), 12u);
  cr_assert_eq(KILN__U(th_node(ctx, -1), AUGMENT, offset), 0u, "kiln_manual_seed restarts it");

  /* NULL options: no augmentation, still one node (and an offset) */
  cr_assert_not_null(kiln_augment(x, NULL));
  n = th_node(ctx, -1);
  cr_assert_eq(n->op, KILN__OP_AUGMENT);
  cr_assert(KILN__I(n, AUGMENT, pad) == 0 && KILN__I(n, AUGMENT, flip) == 0 &&
            KILN__I(n, AUGMENT, border) == 0);
  cr_assert_eq(KILN__U(n, AUGMENT, offset), 1u);

  /* the alternating flip reads the indices, a second input, and the epoch */
  kiln_tensor *idx = th_i32(ctx, KILN_SHAPE(4));
  o = (kiln_augment_options){.flip = KILN_AUGMENT_FLIP_ALTERNATE, .idx = idx, .epoch = 3};
  cr_assert_not_null(kiln_augment(x, &o), "%s", th_err(ctx));
  n = th_node(ctx, -1);
  cr_assert_eq(n->nin, 2);
  cr_assert_eq(n->in[1], idx);
  cr_assert_eq(KILN__U(n, AUGMENT, epoch), 3u);
  cr_assert_eq(KILN__I(n, AUGMENT, flip), KILN_AUGMENT_FLIP_ALTERNATE);

  /* a view that is not contiguous is copied first */
  int32_t n0 = th_tlen(ctx);
  kiln_tensor *t = kiln_transpose(x, 1, 2);
  o = opts(1, KILN_AUGMENT_BORDER_ZERO, KILN_AUGMENT_FLIP_ALL);
  y = kiln_augment(t, &o);
  cr_assert_not_null(y, "%s", th_err(ctx));
  th_assert_shape(y, KILN_SHAPE(4, 6, 8, 3));
  TH_ASSERT_OPS_FROM(ctx, n0, KILN__OP_PERMUTE, KILN__OP_COPY, KILN__OP_AUGMENT);

  /* the gradient of what follows it stops there: its input is data */
  kiln_tensor *w = th_param(ctx, KILN_SHAPE(3));
  kiln_tensor *loss = th_sum_all(kiln_mul(kiln_augment(x, NULL), w));
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
  th_assert_ok(ctx);
  th_free_scratch();
  th_ctx_free(ctx);
}

Test(augment, misuse_fails_naming_the_function_and_values) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 8, 6, 3));
  kiln_tensor *idx = th_i32(ctx, KILN_SHAPE(4));
  kiln_augment_options o = opts(2, KILN_AUGMENT_BORDER_ZERO, KILN_AUGMENT_FLIP_RANDOM);
  TH_EXPECT_FAIL(ctx, kiln_augment(th_f32(ctx, KILN_SHAPE(4, 8, 6)), &o), KILN_ERR_SHAPE,
                 "kiln_augment", "[4,8,6]", "(N, H, W, C)");
  TH_EXPECT_FAIL(ctx, kiln_augment(th_i32(ctx, KILN_SHAPE(4, 8, 6, 3)), &o), KILN_ERR_DTYPE,
                 "kiln_augment", "i32", "f32");
  TH_EXPECT_FAIL(ctx, kiln_augment(th_f32(ctx, KILN_SHAPE(4, 8, 6, 0)), &o), KILN_ERR_SHAPE,
                 "kiln_augment", "[4,8,6,0]", "no channels");
  o.pad = -1;
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_INVALID, "kiln_augment", "pad -1", ">= 0");
  o.pad = 8;
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_INVALID, "kiln_augment", "pad 8", "height 8",
                 "width 6");
  o.pad = 6; /* below the height, not below the width */
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_INVALID, "kiln_augment", "pad 6", "width 6");
  o = opts(1, KILN_AUGMENT_BORDER_ZERO, (kiln_augment_flip)7);
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_INVALID, "kiln_augment", "flip mode 7");
  o = opts(1, (kiln_augment_border)5, KILN_AUGMENT_FLIP_NONE);
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_INVALID, "kiln_augment", "border 5");
  o = opts(1, KILN_AUGMENT_BORDER_ZERO, KILN_AUGMENT_FLIP_ALTERNATE);
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_INVALID, "kiln_augment",
                 "KILN_AUGMENT_FLIP_ALTERNATE", "indices");
  o = opts(1, KILN_AUGMENT_BORDER_ZERO, KILN_AUGMENT_FLIP_RANDOM);
  o.idx = idx;
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_INVALID, "kiln_augment", "idx",
                 "only KILN_AUGMENT_FLIP_ALTERNATE");
  o.flip = KILN_AUGMENT_FLIP_ALTERNATE;
  o.idx = th_f32(ctx, KILN_SHAPE(4));
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_DTYPE, "kiln_augment", "[4] f32", "(4) i32");
  o.idx = th_i32(ctx, KILN_SHAPE(5));
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_SHAPE, "kiln_augment", "[5] i32", "(4) i32");
  o.idx = th_i32(ctx, KILN_SHAPE(2, 2));
  TH_EXPECT_FAIL(ctx, kiln_augment(x, &o), KILN_ERR_SHAPE, "kiln_augment", "[2,2] i32");
  /* images that require a gradient: an error that says what to do */
  o = opts(1, KILN_AUGMENT_BORDER_ZERO, KILN_AUGMENT_FLIP_NONE);
  TH_EXPECT_FAIL(ctx, kiln_augment(th_param(ctx, KILN_SHAPE(2, 4, 4, 3)), &o), KILN_ERR_INVALID,
                 "kiln_augment", "require a gradient", "kiln_detach");
  cr_assert_not_null(kiln_augment(kiln_detach(th_param(ctx, KILN_SHAPE(2, 4, 4, 3))), &o), "%s",
                     th_err(ctx));
  /* NULL images record nothing; a failed context records nothing */
  int32_t n0 = th_tlen(ctx);
  cr_assert_null(kiln_augment(NULL, &o));
  cr_assert_eq(th_tlen(ctx), n0);
  cr_assert_null(kiln_augment(x, &(kiln_augment_options){.pad = 99}));
  cr_assert_null(kiln_augment(x, &o), "a failed context records");
  cr_assert_eq(th_tlen(ctx), n0);
  kiln_ctx_clear_error(ctx);
  /* the largest pad, one below the smaller side, is fine; so is an image of one pixel */
  o.pad = 5;
  cr_assert_not_null(kiln_augment(x, &o), "%s", th_err(ctx));
  cr_assert_not_null(kiln_augment(th_f32(ctx, KILN_SHAPE(3, 1, 1, 2)), NULL), "%s", th_err(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- the loader's indices */

Test(augment, loader_indices_are_a_gather_with_a_step_value_start) {
  kiln_ctx *ctx = th_cpu_ctx();
  uint8_t images[10 * 4] = {0}, labels[10] = {0};
  kiln_mnist m = {.n = 10, .rows = 2, .cols = 2, .images = images, .labels = labels};
  kiln_dataset *ds = kiln_dataset_from_mnist(ctx, &m, 0.f, 1.f);
  kiln_loader *l = kiln_loader_new(ds, &(kiln_loader_options){.batch = 4, .shuffle = 1, .seed = 3});
  cr_assert_not_null(l, "%s", th_err(ctx));
  int32_t n0 = th_tlen(ctx);
  cr_assert_null(kiln_loader_indices(l));
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_loader_indices", "kiln_loader_next");
  cr_assert_eq(th_tlen(ctx), n0);
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln_loader_indices(NULL));

  const kiln_tensor *table = NULL, *order = NULL;
  int64_t want_start[3] = {0, 4, 8}, want_rows[3] = {4, 4, 2};
  for (int b = 0; b < 3; b++) {
    kiln_step_begin(ctx);
    kiln_tensor *x, *y;
    cr_assert(kiln_loader_next(l, &x, &y), "%s", th_err(ctx));
    kiln_tensor *idx = kiln_loader_indices(l);
    cr_assert_not_null(idx, "%s", th_err(ctx));
    th_assert_shape(idx, KILN_SHAPE(want_rows[b]));
    cr_assert_eq(kiln_tensor_dtype(idx), KILN_DTYPE_I32);
    const kiln__node *n = th_node(ctx, -1);
    cr_assert_eq(n->op, KILN__OP_INDEX_SELECT);
    /* the same table and order every batch, the batch's start as a step value */
    if (b == 0) {
      table = n->in[0];
      order = n->in[1];
    }
    cr_assert(n->in[0] == table && n->in[1] == order, "batch %d gathers from other tensors", b);
    cr_assert(n->in[0]->persistent && n->in[1]->persistent);
    cr_assert_eq(KILN__U(n, INDEX_SELECT, start), (uint64_t)want_start[b]);
    /* the images' gather reads the same order from the same start */
    const kiln__node *gx = kiln__producer(x);
    cr_assert_eq(gx->in[1], order);
    cr_assert_eq(KILN__U(gx, INDEX_SELECT, start), (uint64_t)want_start[b]);
    /* the alternating flip of the batch's images */
    kiln_tensor *img = kiln_reshape(x, KILN_SHAPE(want_rows[b], 2, 2, 1));
    kiln_augment_options o = {.flip = KILN_AUGMENT_FLIP_ALTERNATE, .idx = idx, .epoch = 1};
    cr_assert_not_null(kiln_augment(img, &o), "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  }
  /* a new epoch has no batch yet */
  kiln_loader_start(l, 1);
  cr_assert_null(kiln_loader_indices(l));
  kiln_ctx_clear_error(ctx);
  kiln_loader_free(l);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- plans and kernels */

Test(augment, is_a_kernel_of_its_own) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 8, 8, 3));
  kiln_augment_options o = opts(2, KILN_AUGMENT_BORDER_REFLECT, KILN_AUGMENT_FLIP_RANDOM);
  kiln_tensor *y = kiln_mul_scalar(kiln_augment(kiln_add_scalar(x, 1.f), &o), 2.f);
  cr_assert_not_null(y, "%s", th_err(ctx));
  for (int fuse = 0; fuse < 2; fuse++) {
    kiln__plan p;
    cr_assert(kiln__plan_build(ctx, ctx->trace.done, ctx->trace.n, fuse, &p), "%s", th_err(ctx));
    char why[512];
    const char *bad = kiln__plan_verify(ctx, &p, why, sizeof why);
    cr_assert_null(bad, "the plan breaks an invariant: %s", bad);
    kiln__sb got = {0};
    kiln__plan_describe(ctx, &p, &got);
    cr_assert_str_eq(got.s, "add_scalar | augment | mul_scalar");
    kiln__sb_free(&got);
    kiln__plan_free(&p);
  }
  th_free_scratch();
  th_ctx_free(ctx);
}

/* The dumped source of a kernel whose file name starts with prefix and whose text holds has
 * (asserted to exist). */
static char *source_of(const char *dir, const char *prefix, const char *has) {
  static char files[128][1200];
  int n = th_list_files(dir, ".cu", files, 128);
  for (int i = 0; i < n; i++) {
    const char *base = strrchr(files[i], '/') + 1;
    if (strncmp(base, prefix, strlen(prefix)) != 0) continue;
    char *text = th_read_whole(files[i], NULL);
    if (strstr(text, has)) return text;
    free(text);
  }
  cr_assert_fail("no dumped kernel named %s... holds '%s' (%d files in %s)", prefix, has, n, dir);
  return NULL;
}

Test(augment, every_variant_compiles_under_nvrtc, .timeout = 1200) {
  char dump[256];
  th_tmpdir(dump, sizeof dump, "dump");
  cr_assert_eq(setenv("KILN_DUMP_KERNELS", dump, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  /* pads 0 and 2, both borders, every flip; 3 channels (a pixel a thread), 4 (16 bytes a
   * thread), 1 and 6 (a channel a thread) */
  const int64_t chans[4] = {3, 4, 1, 6};
  int recorded = 0;
  for (int ci = 0; ci < 4; ci++) {
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(5, 7, 9, chans[ci]));
    kiln_tensor *idx = th_i32(ctx, KILN_SHAPE(5));
    for (int pad = 0; pad <= 2; pad += 2)
      for (int border = 0; border < 2; border++)
        for (int flip = 0; flip < 4; flip++) {
          kiln_augment_options o = opts(pad, (kiln_augment_border)border, (kiln_augment_flip)flip);
          if (flip == KILN_AUGMENT_FLIP_ALTERNATE) {
            o.idx = idx;
            o.epoch = pad + border;
          }
          cr_assert_not_null(kiln_augment(x, &o), "%s", th_err(ctx));
          recorded++;
        }
  }
  /* 4 channels at an offset that is not 16-byte aligned: scalar loads */
  kiln_tensor *flat = th_f32(ctx, KILN_SHAPE(1 + 2 * 5 * 5 * 4));
  kiln_tensor *odd =
      kiln_reshape(kiln_slice(flat, 0, 1, 1 + 2 * 5 * 5 * 4, 1), KILN_SHAPE(2, 5, 5, 4));
  cr_assert_not_null(kiln_augment(odd, &(kiln_augment_options){.pad = 1, .flip = 1}), "%s",
                     th_err(ctx));
  recorded++;
  cr_assert_eq(th_count_ops(ctx, 0, th_tlen(ctx), KILN__OP_AUGMENT), recorded);

  for (int fuse = 0; fuse < 2; fuse++) {
    kiln_set_fusion(ctx, fuse);
    kiln_exec_stats before, after;
    kiln_stats(ctx, &before);
    kiln_status s = kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n);
    cr_assert_eq(s, KILN_OK, "kiln__engine_compile (fusion %d): %s", fuse, th_err(ctx));
    kiln_stats(ctx, &after);
    uint64_t looked =
        after.kernels_compiled + after.cache_hits - before.kernels_compiled - before.cache_hits;
    cr_assert_eq(looked, (uint64_t)recorded, "fusion %d: %llu kernel lookups for %d augment nodes",
                 fuse, (unsigned long long)looked, recorded);
  }
  th_assert_ok(ctx);

  /* the sources say what they do: augment.cuh's function with the node's constants */
  char *src = source_of(dump, "k_augment_p2_reflect_flip_alt_f32_v4_", "C = 4;");
  cr_assert_not_null(strstr(src, "#include \"augment.cuh\""), "%s", src);
  cr_assert_not_null(strstr(src, "static constexpr ix H = 7, W = 9, C = 4;"), "%s", src);
  cr_assert_not_null(strstr(src, "PAD = 2, SHIFT_H = 0, SHIFT_W = 0;"), "%s", src);
  cr_assert_not_null(strstr(src, "REFLECT = true;"), "%s", src);
  cr_assert_not_null(strstr(src, "FLIP = 3;"), "%s", src);
  cr_assert_not_null(strstr(src, "VEC = true;"), "%s", src);
  cr_assert_not_null(strstr(src, "kiln_augment<G>((const float *)a.ptr[0], (const int *)a.ptr[1]"),
                     "alternating flips read the data-set indices:\n%s", src);
  cr_assert_not_null(strstr(src, "// trace nodes: #"), "%s", src);
  free(src);
  src = source_of(dump, "k_augment_p2_zero_flip_f32_", "C = 3;");
  cr_assert_not_null(strstr(src, "REFLECT = false;"), "%s", src);
  cr_assert_not_null(strstr(src, "V = 3;"), "%s", src);
  cr_assert_not_null(strstr(src, "VEC = false;"), "%s", src);
  cr_assert_not_null(strstr(src, "nullptr"), "no data-set indices:\n%s", src);
  free(src);
  src = source_of(dump, "k_augment_p0_flip_all_f32_", "C = 6;");
  cr_assert_not_null(strstr(src, "PAD = 0, SHIFT_H = 0, SHIFT_W = 0;"), "%s", src);
  cr_assert_not_null(strstr(src, "FLIP = 2;"), "%s", src);
  free(src);
  src = source_of(dump, "k_augment_p1_zero_flip_f32_", "C = 4;");
  cr_assert_not_null(strstr(src, "V = 4;"), "%s", src);
  cr_assert_not_null(strstr(src, "VEC = false;"),
                     "4 channels not 16-byte aligned: scalar loads\n%s", src);
  free(src);
  src = source_of(dump, "k_augment_p0_f32_v4_", "C = 4;");
  cr_assert_not_null(strstr(src, "PAD = 0, SHIFT_H = 0, SHIFT_W = 0;"), "%s", src);
  cr_assert_not_null(strstr(src, "FLIP = 0;"), "no flip, no translation: a copy\n%s", src);
  free(src);
  th_free_scratch();
  th_ctx_free(ctx);
  unsetenv("KILN_DUMP_KERNELS");
  th_remove_dir(dump);
}
