/*
 * conv_cases.h: the convolution cases the GPU tests share (test_gpu_ops_conv.c checks each against
 * float64, test_gpu_conv_switches.c each switch against its absence): a case's geometry and its
 * explicit window, and the tables of the implicit-GEMM, TMA-fed and direct kernels' cases.
 */
#ifndef KILN_TESTS_CONV_CASES_H
#define KILN_TESTS_CONV_CASES_H

#include <cuda_runtime_api.h>

#include "ref_conv.h"

typedef struct conv_case {
  const char *desc;
  int64_t n, h, w, cin, cout;
  int kh, kw;
  kiln_conv2d_options o; /* zero fields: kiln's defaults */
  int bias;
  int null_opts; /* pass NULL for the options (o all zeros) */
  int gc;        /* also check against finite differences (small cases) */
} conv_case;

/* The explicit geometry of a case, the defaults of kiln.h filled in. */
static inline ref_win conv_win(const conv_case *c) {
  const kiln_conv2d_options *o = &c->o;
  return (ref_win){.kh = c->kh,
                   .kw = c->kw,
                   .sh = o->stride_h ? o->stride_h : 1,
                   .sw = o->stride_w ? o->stride_w : 1,
                   .ph = o->pad_h,
                   .pw = o->pad_w,
                   .dh = o->dilation_h ? o->dilation_h : 1,
                   .dw = o->dilation_w ? o->dilation_w : 1,
                   .groups = o->groups ? o->groups : 1};
}

/* Skips the calling test without a GPU, or on a device other than sm_90 (the TMA-fed kernels are
 * sm_90a's). */
static inline void skip_unless_sm90(void) {
  TH_GPU_CTX(probe); /* skips without a GPU */
  th_ctx_free(probe);
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  if (major != 9 || minor != 0)
    cr_skip_test("the TMA-fed kernels are sm_90a's; this device is sm_%d%d", major, minor);
}

/* brace lists, so that the tables below are constant initializers */
#define CO(...)                                                                                    \
  { __VA_ARGS__ }

/* bf16 convolutions with at most 64 output channels, whose forward product and weight gradient
 * run as implicit GEMMs on sm_90 (fusion/device/conv.cuh, with KILN_CONV_FEW=0 where a forward
 * product would come from a halo tile; elsewhere im2col and cuBLAS), and two
 * wider ones whose data gradient does (the forward product of dY with the filters flipped): pixel
 * counts and reductions that are not multiples of the tiles, output channels that fill part of a
 * tile, stride 2, padding 0 to 2, dilation, batch 1, and two cases with enough pixels for the
 * weight gradient to split its reduction across blocks (summed inside the kernel). */
static const conv_case wgmma_cases[] = {
    {"24->64 3x3 pad 1 (air's first group)", 3, 11, 9, 24, 64, 3, 3, CO(.pad_h = 1, .pad_w = 1), 0,
     0, 0},
    {"8->32 3x3 stride 2 pad 1", 2, 9, 7, 8, 32, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"40->32 3x2 dilation (2,1) pad (2,1)", 2, 8, 9, 40, 32, 3, 2,
     CO(.dilation_h = 2, .pad_h = 2, .pad_w = 1), 0, 0, 0},
    {"64->64 2x2 stride 2", 3, 10, 10, 64, 64, 2, 2, CO(.stride_h = 2, .stride_w = 2), 0, 0, 0},
    {"16->40 5x5 pad 2, batch 1", 1, 13, 11, 16, 40, 5, 5, CO(.pad_h = 2, .pad_w = 2), 0, 0, 0},
    {"32->64 3x3 pad 1, 18432 pixels (split reduction)", 32, 24, 24, 32, 64, 3, 3,
     CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"24->16 3x3 (no padding), 14415 pixels (split reduction)", 15, 33, 33, 24, 16, 3, 3, CO(0), 0,
     0, 0},
    {"8->16 3x3 pad 1, 6x6 images, batch 32 (8 channels of a 64-wide tile)", 32, 6, 6, 8, 16, 3, 3,
     CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
    /* more output channels: im2col and cuBLAS forward, the data gradient on wgmma (sm_90) */
    {"128->96 3x3 pad 1", 4, 7, 7, 128, 96, 3, 3, CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"256->256 3x3 pad 1 on 3x3 images (air's last conv)", 8, 3, 3, 256, 256, 3, 3,
     CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
};

/* KILN_CONV_TMA=1: bf16 convolutions with input channels in stages of 64 run all three products
 * on the TMA-fed kernels (fusion/device/conv_tma.cuh), whatever their output channels; the data
 * gradient at stride 1 with output channels in stages of 64. Wide and narrow tiles, tiles that
 * the pixels or the channels fill in part, stride 2 (ResNet's downsampling and its 1x1
 * shortcut), dilation, no padding (the data gradient's window padded by 2), batch 1, several
 * stages a tap (192 and 256 channels) and a reduction split across blocks. */
static const conv_case tma_cases[] = {
    {"64->256 3x3 pad 1 (air's 15x15 conv)", 4, 15, 15, 64, 256, 3, 3, CO(.pad_h = 1, .pad_w = 1),
     0, 0, 0},
    {"256->256 3x3 pad 1 on 3x3 images (air's last conv)", 8, 3, 3, 256, 256, 3, 3,
     CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"64->128 3x3 stride 2 pad 1 (ResNet's downsampling)", 4, 14, 14, 64, 128, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"128->64 1x1 stride 2 (ResNet's shortcut)", 4, 14, 13, 128, 64, 1, 1,
     CO(.stride_h = 2, .stride_w = 2), 0, 0, 0},
    {"64->64 3x3 dilation 2 pad 2", 2, 9, 11, 64, 64, 3, 3,
     CO(.dilation_h = 2, .dilation_w = 2, .pad_h = 2, .pad_w = 2), 0, 0, 0},
    {"192->128 3x3 (no padding) on 9x11 images", 3, 9, 11, 192, 128, 3, 3, CO(0), 0, 0, 0},
    {"64->72 3x3 pad 1 (72 output channels)", 2, 7, 9, 64, 72, 3, 3, CO(.pad_h = 1, .pad_w = 1), 0,
     0, 0},
    {"64->64 5x5 pad 2, batch 1", 1, 13, 11, 64, 64, 5, 5, CO(.pad_h = 2, .pad_w = 2), 0, 0, 0},
    {"64->64 3x3 pad 1, 18432 pixels (split reduction)", 32, 24, 24, 64, 64, 3, 3,
     CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"64->192 3x3 pad 1 (a weight gradient tile's second dY panel past the channels)", 3, 10, 9, 64,
     192, 3, 3, CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
};

/* KILN_CONV_TMA_PHASES=1: strided bf16 convolutions whose data gradient runs one phase of dX at a
 * time on the TMA-fed kernel (conv_tma.cuh's kiln_conv_dgrad_tma_phase; plan_conv.c's
 * kiln__dgrad_phases: H and W the output's times the strides, channels in stages of 64): ResNet's
 * 3x3 downsampling (phases of 1, 2, 2 and 4 taps; 196 pixels a phase: a short last tile) and its
 * 1x1 shortcut (three phases without taps: zeros), a 5x5 window whose taps reach back (dY's box
 * corners at -1), a stride in one direction, a 2x2 window at stride 2 (a tap a phase), a 4x4
 * one into 256 output channels (four stages a tap), stride 3, and 128 channels both ways over
 * 1,024 pixels a phase (whole tiles). */
static const conv_case phase_cases[] = {
    {"64->128 3x3 stride 2 pad 1 (ResNet's downsampling)", 4, 14, 14, 64, 128, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"64->128 1x1 stride 2 on 14x12 images (ResNet's shortcut)", 3, 14, 12, 64, 128, 1, 1,
     CO(.stride_h = 2, .stride_w = 2), 0, 0, 0},
    {"64->64 5x5 stride 2 pad 2", 2, 10, 12, 64, 64, 5, 5,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 2, .pad_w = 2), 0, 0, 0},
    {"64->64 3x3 stride 2 down, 1 across, pad 1", 3, 8, 9, 64, 64, 3, 3,
     CO(.stride_h = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"64->64 2x2 stride 2", 5, 8, 6, 64, 64, 2, 2, CO(.stride_h = 2, .stride_w = 2), 0, 0, 0},
    {"64->256 4x4 stride 2 pad 1", 2, 8, 10, 64, 256, 4, 4,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"64->64 3x3 stride 3", 2, 9, 6, 64, 64, 3, 3, CO(.stride_h = 3, .stride_w = 3), 0, 0, 0},
    {"128->128 3x3 stride 2 pad 1, 1,024 pixels a phase", 16, 16, 16, 128, 128, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0},
};

/* bf16 convolutions of few values a window over channels that are not in
 * 16-byte chunks, nothing taking a gradient through them (a whitening layer), run their forward
 * product as one direct kernel (fusion/device/conv_direct.cuh; test_cpu_conv_tma's
 * tiny_convolutions_without_gradients_run_direct checks that the planner gives it these four
 * geometries), against float64 of the bf16 operands. */
static const conv_case direct_cases[] = {
    {"3->24 2x2 (airbench's whitening) on 32x32 images, 64 of them", 64, 32, 32, 3, 24, 2, 2, CO(0),
     0, 0, 0},
    {"3->16 3x3 stride 2 pad 1", 3, 13, 10, 3, 16, 3, 3,
     CO(.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"5->64 2x3 dilation 2 pad 1", 2, 9, 11, 5, 64, 2, 3,
     CO(.dilation_h = 2, .dilation_w = 2, .pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"3->8 1x3 pad (0, 1), batch 1", 1, 7, 5, 3, 8, 1, 3, CO(.pad_w = 1), 0, 0, 0},
};

/* KILN_CONV_FEW (on by default): bf16 convolutions at stride 1 from few input channels (in 16-byte
 * chunks) into 64 run their forward product on conv_few.cuh's halo-tile kernel (test_cpu_conv_tma's
 * few_channel_forward_products_run_from_a_halo_tile checks the planner gives it these): air's
 * first conv with more tiles than a grid's blocks (each block takes several), tiles past the
 * image on both sides (8x16 and 4x32), an odd number of 8-channel chunks a window (27, 25: the
 * last step's zero chunk), a 5x5 window, no padding, a 1x3 window two tiles wide, batch 1, and
 * ResNet-18's stem as kiln runs it (KILN_CONV_S2D: 4x4 over 16 channels, a pixel's halo stride
 * padded to three chunks; 32 channels: five; 48: seven). */
static const conv_case few_cases[] = {
    {"24->64 3x3 pad 1 (air's first conv) on 31x31 images, 40 of them", 40, 31, 31, 24, 64, 3, 3,
     CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"24->64 3x3 pad 1 on 9x7 images", 3, 9, 7, 24, 64, 3, 3, CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
    {"8->64 5x5 pad 2, batch 1", 1, 13, 11, 8, 64, 5, 5, CO(.pad_h = 2, .pad_w = 2), 0, 0, 0},
    {"32->64 3x3 (no padding) on 20x17 images", 2, 20, 17, 32, 64, 3, 3, CO(0), 0, 0, 0},
    {"16->64 1x3 pad (0, 1) on 5x40 images", 2, 5, 40, 16, 64, 1, 3, CO(.pad_w = 1), 0, 0, 0},
    {"16->64 4x4 (ResNet's stem on its 2x2 blocks) on 39x37 images", 2, 39, 37, 16, 64, 4, 4, CO(0),
     0, 0, 0},
    {"48->64 2x2 pad 1 on 9x7 images (six chunks a pixel, padded to seven)", 2, 9, 7, 48, 64, 2, 2,
     CO(.pad_h = 1, .pad_w = 1), 0, 0, 0},
};

#endif
