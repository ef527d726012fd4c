/*
 * test_cpu_device.c: the device files (fusion/device) and the op table agree: every file is
 * embedded as it is on disk and compiles on its own with NVRTC, every attribute an op expression
 * names exists, and the device
 * functions an expression calls take each attribute under its own name, at its position.
 */
#include <ctype.h>
#include <nvrtc.h>
#include <string.h>

#include "fusion/fusion.h"
#include "helpers.h"

Test(device, every_file_is_embedded_as_on_disk) {
  const char *names[] = {
      "anomaly.cuh",  "augment.cuh", "bf16.cuh",  "conv.cuh",   "conv_direct.cuh", "conv_few.cuh",
      "conv_tma.cuh", "custom.cuh",  "defs.cuh",  "igemm.cuh",  "kargs.cuh",       "math.cuh",
      "mma.cuh",      "moments.cuh", "optim.cuh", "philox.cuh", "pool2.cuh",       "prelude.cuh",
      "reduce.cuh",   "wgmma.cuh",   "window.cuh"};
  int n = (int)(sizeof names / sizeof names[0]);
  cr_assert_eq(kiln__device_nfiles, n, "%d embedded device files, %d expected", kiln__device_nfiles,
               n);
  for (int i = 0; i < n; i++) {
    cr_assert_str_eq(kiln__device_files[i].name, names[i], "embedded in name order");
    char path[1024];
    snprintf(path, sizeof path, "%s/fusion/device/%s", KILN_SOURCE_DIR, names[i]);
    char *disk = th_read_whole(path, NULL);
    cr_assert_str_eq(kiln__device_files[i].text, disk, "%s differs from its embedded copy",
                     names[i]);
    free(disk);
  }
}

/* Every device file compiles on its own with NVRTC, as kiln compiles kernels (the other device
 * files as named headers, C++17), for sm_80 and sm_90: no file leans on what another includer
 * happened to include first. */
Test(device, every_file_compiles_on_its_own_with_nvrtc) {
  const char *hdr[64], *inc[64];
  cr_assert_leq(kiln__device_nfiles, 64);
  for (int i = 0; i < kiln__device_nfiles; i++) {
    hdr[i] = kiln__device_files[i].text;
    inc[i] = kiln__device_files[i].name;
  }
  for (int i = 0; i < kiln__device_nfiles; i++)
    for (int arch = 80; arch <= 90; arch += 10) {
      char src[128], opt[64];
      snprintf(src, sizeof src, "#include \"%s\"\n", kiln__device_files[i].name);
      snprintf(opt, sizeof opt, "--gpu-architecture=sm_%d", arch);
      const char *opts[] = {opt, "--std=c++17"};
      nvrtcProgram prog;
      cr_assert_eq(nvrtcCreateProgram(&prog, src, "alone.cu", kiln__device_nfiles, hdr, inc),
                   NVRTC_SUCCESS);
      nvrtcResult r = nvrtcCompileProgram(prog, 2, opts);
      size_t n = 0;
      nvrtcGetProgramLogSize(prog, &n);
      char *log = malloc(n + 1);
      cr_assert_not_null(log);
      log[0] = 0;
      nvrtcGetProgramLog(prog, log);
      cr_expect_eq(r, NVRTC_SUCCESS, "%s for sm_%d: %s\n%s", kiln__device_files[i].name, arch,
                   nvrtcGetErrorString(r), log);
      free(log);
      nvrtcDestroyProgram(&prog);
    }
}

/* The text of all device files, one after another. */
static char *device_text(void) {
  size_t len = 1;
  for (int i = 0; i < kiln__device_nfiles; i++)
    len += strlen(kiln__device_files[i].text) + 1;
  char *s = malloc(len);
  cr_assert_not_null(s);
  s[0] = 0;
  for (int i = 0; i < kiln__device_nfiles; i++)
    strcat(strcat(s, kiln__device_files[i].text), "\n");
  return s;
}

/* The parameter names of the device function fn ("kiln_adam"), defined as KILN__FN ... fn(...);
 * returns how many. */
static int params_of(const char *text, const char *fn, char names[][32], int max) {
  size_t fl = strlen(fn);
  for (const char *p = strstr(text, "KILN__FN "); p; p = strstr(p + 1, "KILN__FN ")) {
    const char *open = strchr(p, '(');
    const char *name = open;
    while (name > p && (isalnum((unsigned char)name[-1]) || name[-1] == '_'))
      name--;
    if ((size_t)(open - name) != fl || strncmp(name, fn, fl) != 0) continue;
    int n = 0;
    const char *q = open + 1;
    while (*q && *q != ')') {
      const char *end = q;
      while (*end && *end != ',' && *end != ')')
        end++;
      const char *e = end;
      while (e > q && !(isalnum((unsigned char)e[-1]) || e[-1] == '_'))
        e--;
      const char *b = e;
      while (b > q && (isalnum((unsigned char)b[-1]) || b[-1] == '_'))
        b--;
      cr_assert(n < max);
      snprintf(names[n], 32, "%.*s", (int)(e - b), b);
      n++;
      q = *end == ',' ? end + 1 : end;
    }
    return n;
  }
  return -1;
}

Test(device, expressions_pass_attributes_to_parameters_of_the_same_name) {
  char *text = device_text();
  int calls = 0;
  for (int op = 0; op < KILN__OP_COUNT; op++) {
    const char *e = kiln__ops[op].expr;
    /* every $name an expression uses is an attribute of its op ($idx, $c and $0.. aside) */
    for (const char *c = strchr(e, '$'); c; c = strchr(c + 1, '$')) {
      size_t len = 0;
      while (isalnum((unsigned char)c[1 + len]) || c[1 + len] == '_')
        len++;
      if (isdigit((unsigned char)c[1]) || (len == 3 && !strncmp(c + 1, "idx", 3)) ||
          (len == 3 && !strncmp(c + 1, "err", 3)))
        continue;
      kiln__attr_kind kind;
      int slot;
      if (len == 1 && c[1] == 'c') {
        cr_assert(kiln__attr_find((kiln__op)op, "axis", 4, &kind, &slot) && kind == KILN__ATTR_I,
                  "%s uses $c but has no int attribute axis", kiln__ops[op].name);
        continue;
      }
      cr_assert(kiln__attr_find((kiln__op)op, c + 1, len, &kind, &slot),
                "%s's expression names $%.*s, which it has no attribute for", kiln__ops[op].name,
                (int)len, c + 1);
    }
    /* a call kiln_f(args): argument k, when it is an attribute, is parameter k's name */
    const char *call = strstr(e, "kiln_");
    if (!call) continue;
    char fn[64];
    size_t fl = strcspn(call, "(");
    snprintf(fn, sizeof fn, "%.*s", (int)fl, call);
    char params[16][32];
    int np = params_of(text, fn, params, 16);
    cr_assert(np > 0, "%s calls %s, which no device file defines", kiln__ops[op].name, fn);
    const char *a = call + fl + 1;
    for (int k = 0; *a && *a != ')'; k++) {
      while (*a == ' ')
        a++;
      size_t len = strcspn(a, ",)");
      cr_assert(k < np, "%s passes more arguments than %s takes", kiln__ops[op].name, fn);
      if (a[0] == '$' && !isdigit((unsigned char)a[1]) && strncmp(a, "$idx", 4) != 0) {
        /* $c and $err are passed to parameters called c and err too */
        cr_assert(strlen(params[k]) == len - 1 && !strncmp(params[k], a + 1, len - 1),
                  "%s passes $%.*s as argument %d of %s, whose parameter is named %s",
                  kiln__ops[op].name, (int)len - 1, a + 1, k, fn, params[k]);
        calls++;
      }
      a += len;
      if (*a == ',') a++;
    }
  }
  cr_assert_geq(calls, 17, "the SGD, Adam and dropout calls name %d attributes", calls);
  free(text);
}

Test(device, attributes_have_names_and_fit_the_node) {
  for (int op = 0; op < KILN__OP_COUNT; op++) {
    int count[3] = {0, 0, 0};
    for (int a = 0; a < kiln__ops[op].nattr; a++) {
      const kiln__attr *at = &kiln__ops[op].attrs[a];
      cr_assert(strcmp(at->name, "idx") && strcmp(at->name, "c") && strcmp(at->name, "err"),
                "%s: reserved name %s", kiln__ops[op].name, at->name);
      kiln__attr_kind kind;
      int slot;
      cr_assert(kiln__attr_find((kiln__op)op, at->name, strlen(at->name), &kind, &slot));
      cr_assert_eq(kind, at->kind);
      cr_assert_eq(slot, count[at->kind], "%s.%s is in slot %d", kiln__ops[op].name, at->name,
                   slot);
      count[at->kind] += at->count;
    }
    cr_assert(count[KILN__ATTR_F] <= KILN__NF && count[KILN__ATTR_I] <= KILN__NI &&
              count[KILN__ATTR_U] <= KILN__NU);
  }
  /* the accessors and the name lookup agree */
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *a = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4, 4));
  kiln_tensor *y = kiln_clamp(a, -1.f, 2.f);
  const kiln__node *n = &ctx->trace.nodes[ctx->trace.n - 1];
  kiln__attr_kind kind;
  int slot;
  cr_assert(kiln__attr_find(KILN__OP_CLAMP, "hi", 2, &kind, &slot));
  cr_assert(y && n->f[slot] == 2.f && KILN__F(n, CLAMP, hi) == 2.f &&
            KILN__F(n, CLAMP, lo) == -1.f);
  kiln_tensor_free(a);
  kiln_ctx_free(ctx);
}
