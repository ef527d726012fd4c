/*
 * resnet.h: torchvision's ResNet-18 (BasicBlocks, two to a stage, stages of width w, 2w, 4w, 8w;
 * w = 64 is ResNet-18 itself) written with kiln's layers, for the examples (imagefolder,
 * profile_step). Names are torchvision's ("conv1", "layer2.0.downsample.1", "fc"), so that
 * weights saved by one load in the other. Header-only: static functions.
 */
#ifndef KILN_EXAMPLES_RESNET_H
#define KILN_EXAMPLES_RESNET_H

#include <stdio.h>

#include "kiln.h"

/* A BasicBlock: conv 3x3 (stride s) -> BN -> ReLU -> conv 3x3 -> BN, plus the input (through a
 * 1x1 stride-s conv and BN where the shape changes), then ReLU. */
typedef struct resnet_block {
  kiln_conv2d_layer conv1, conv2, down; /* down: when has_down */
  kiln_batch_norm_layer bn1, bn2, down_bn;
  int has_down;
} resnet_block;

typedef struct resnet {
  kiln_conv2d_layer stem;
  kiln_batch_norm_layer stem_bn;
  resnet_block blocks[8];
  kiln_linear fc;
  int small_stem; /* 1: a 3x3 stride-1 stem and no max pool, for small images (32x32) */
} resnet;

/* A convolution without bias, kernel k, stride s, padding k / 2, its filters drawn as
 * torchvision draws them (kaiming normal, fan out, ReLU's gain). */
static kiln_status resnet_conv(kiln_conv2d_layer *l, kiln_params *p, const char *name, int64_t cin,
                               int64_t cout, int k, int s) {
  kiln_status st = kiln_conv2d_layer_init(l, p,
                                          &(kiln_conv2d_layer_options){.name = name,
                                                                       .in = cin,
                                                                       .out = cout,
                                                                       .kernel = k,
                                                                       .stride = s,
                                                                       .padding = k / 2,
                                                                       .no_bias = 1});
  if (st == KILN_OK)
    st = kiln_init_kaiming_normal(l->weight, 0, KILN_FAN_OUT, KILN_NONLINEARITY_RELU);
  return st;
}

/* Batch norm with torch's momentum 0.1 and eps 1e-5 (zero fields), weight 1, bias 0. */
static kiln_status resnet_bn(kiln_batch_norm_layer *l, kiln_params *p, const char *name,
                             int64_t features) {
  return kiln_batch_norm_layer_init(
      l, p, &(kiln_batch_norm_layer_options){.name = name, .features = features});
}

/* The model's parameters in p: base width w (64: ResNet-18), `classes` outputs. */
static kiln_status resnet_init(resnet *r, kiln_params *p, int64_t w, int64_t classes,
                               int small_stem) {
  r->small_stem = small_stem;
  kiln_status st = resnet_conv(&r->stem, p, "conv1", 3, w, small_stem ? 3 : 7, small_stem ? 1 : 2);
  if (st == KILN_OK) st = resnet_bn(&r->stem_bn, p, "bn1", w);
  int64_t cin = w;
  for (int k = 0; k < 8 && st == KILN_OK; k++) {
    resnet_block *b = &r->blocks[k];
    int stage = k / 2, s = stage > 0 && k % 2 == 0 ? 2 : 1;
    int64_t width = w << stage;
    char name[6][48];
    const char *part[6] = {"conv1", "bn1", "conv2", "bn2", "downsample.0", "downsample.1"};
    for (int i = 0; i < 6; i++)
      snprintf(name[i], sizeof name[i], "layer%d.%d.%s", stage + 1, k % 2, part[i]);
    st = resnet_conv(&b->conv1, p, name[0], cin, width, 3, s);
    if (st == KILN_OK) st = resnet_bn(&b->bn1, p, name[1], width);
    if (st == KILN_OK) st = resnet_conv(&b->conv2, p, name[2], width, width, 3, 1);
    if (st == KILN_OK) st = resnet_bn(&b->bn2, p, name[3], width);
    b->has_down = s != 1 || cin != width; /* the first block of stages 2-4 */
    if (b->has_down && st == KILN_OK) st = resnet_conv(&b->down, p, name[4], cin, width, 1, s);
    if (b->has_down && st == KILN_OK) st = resnet_bn(&b->down_bn, p, name[5], width);
    cin = width;
  }
  if (st == KILN_OK)
    st = kiln_linear_init(&r->fc, p,
                          &(kiln_linear_options){.name = "fc", .in = cin, .out = classes});
  return st;
}

/* x (B, H, W, 3) to (B, classes) logits. The stem takes H and W down 4x (7x7/2 conv, 3x3/2 max
 * pool; the small stem keeps them), stages 2-4 halve them each: 224 -> 56 -> 28 -> 14 -> 7. */
static kiln_tensor *resnet_forward(const resnet *r, kiln_tensor *x) {
  const kiln_pool2d_options pool = {
      .kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1};
  kiln_tensor *h = kiln_conv2d_layer_forward(&r->stem, x);
  h = kiln_relu(kiln_batch_norm_layer_forward(&r->stem_bn, h));
  if (!r->small_stem) h = kiln_max_pool2d(h, &pool);
  for (int k = 0; k < 8; k++) {
    const resnet_block *b = &r->blocks[k];
    kiln_tensor *y = kiln_conv2d_layer_forward(&b->conv1, h);
    y = kiln_relu(kiln_batch_norm_layer_forward(&b->bn1, y));
    y = kiln_batch_norm_layer_forward(&b->bn2, kiln_conv2d_layer_forward(&b->conv2, y));
    kiln_tensor *id =
        b->has_down
            ? kiln_batch_norm_layer_forward(&b->down_bn, kiln_conv2d_layer_forward(&b->down, h))
            : h;
    h = kiln_relu(kiln_add(y, id));
  }
  return kiln_linear_forward(&r->fc, kiln_global_avg_pool2d(h)); /* (B, classes) */
}

#endif
