/*
 * test_cpu_safetensors.c: the safetensors reader and writer without a GPU: every class of bad
 * file gives its own clear error, written files read back, and a save killed half-way leaves the
 * previous file whole.
 */
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "internal.h"
#include "io/safetensors.h"

/* Builds a file: 8-byte length, the header text as given, then ndata bytes (value 0x3c). */
static uint8_t *build(const char *header, size_t ndata, size_t *len) {
  size_t hl = strlen(header);
  *len = 8 + hl + ndata;
  uint8_t *b = malloc(*len);
  cr_assert_not_null(b);
  for (int i = 0; i < 8; i++)
    b[i] = (uint8_t)((uint64_t)hl >> (8 * i));
  memcpy(b + 8, header, hl);
  memset(b + 8 + hl, 0x3c, ndata);
  return b;
}

/* Asserts that the file is refused with a format error whose message contains want. */
static void refused(const uint8_t *buf, size_t len, const char *want) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln__st_file f;
  kiln_status s = kiln__st_parse(ctx, "kiln_params_load", "x.safetensors", buf, len, &f);
  cr_assert_eq(s, KILN_ERR_FORMAT, "accepted a bad file (want an error with '%s')", want);
  const char *e = kiln_ctx_error(ctx);
  cr_assert(strstr(e, "kiln_params_load: x.safetensors: ") == e, "message: %s", e);
  cr_assert(strstr(e, want) != NULL, "message '%s' lacks '%s'", e, want);
  cr_assert_eq(f.n, 0);
  cr_assert_null(f.json);
  th_ctx_free(ctx);
}

static void refused_header(const char *header, size_t ndata, const char *want) {
  size_t len;
  uint8_t *b = build(header, ndata, &len);
  refused(b, len, want);
  free(b);
}

Test(safetensors, good_file_parses) {
  kiln_ctx *ctx = th_cpu_ctx();
  size_t len;
  uint8_t *b = build("{\"__metadata__\":{\"epoch\":\"3\"},\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],"
                     "\"data_offsets\":[0,24]},\"b\":{\"dtype\":\"BF16\",\"shape\":[3],"
                     "\"data_offsets\":[24,30]}}",
                     30, &len);
  kiln__st_file f;
  cr_assert_eq(kiln__st_parse(ctx, "t", "x", b, len, &f), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(f.n, 2);
  const kiln__st_entry *w = kiln__st_find(&f, "w"), *bb = kiln__st_find(&f, "b");
  cr_assert(w && bb);
  cr_assert_eq(w->dtype, KILN_DTYPE_F32);
  cr_assert_eq(w->ndim, 2);
  cr_assert_eq(w->shape[1], 3);
  cr_assert_eq(bb->dtype, KILN_DTYPE_BF16);
  cr_assert_eq(bb->begin, 24);
  cr_assert_str_eq(cJSON_GetObjectItem(f.metadata, "epoch")->valuestring, "3");
  kiln__st_free(&f);
  free(b);
  th_ctx_free(ctx);
}

Test(safetensors, truncated_header) {
  uint8_t tiny[5] = {1, 2, 3, 4, 5};
  refused(tiny, sizeof tiny, "truncated");
  size_t len;
  uint8_t *b = build("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, &len);
  refused(b, 30, "runs past the end of the file");
  free(b);
}

Test(safetensors, bad_json) {
  refused_header("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]", 4, "bad JSON");
  refused_header("[1,2,3]", 0, "not a JSON object");
}

Test(safetensors, wrong_offsets) {
  refused_header("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4,
                 "needs 8 bytes, its data_offsets give 4");
  refused_header("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4,
                 "outside the 4 bytes");
  refused_header("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4,
                 "bad data_offsets");
  refused_header("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0.5,4]}}", 4,
                 "bad data_offsets");
}

Test(safetensors, overlapping_and_out_of_range_data) {
  refused_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                 12, "overlaps");
  refused_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
                 "outside the 4 bytes of data (truncated?)");
  refused_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8,
                 "a hole before it");
  refused_header("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 9,
                 "5 bytes of data follow the last tensor");
}

Test(safetensors, wrong_dtype_shape_and_names) {
  refused_header("{\"w\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8,
                 "dtype F64");
  refused_header("{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
                 "bad size in its shape");
  refused_header("{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
                 "7 dims");
  refused_header("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                 "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                 8, "'w' appears twice");
  refused_header("{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "lacks a dtype");
  refused_header("{\"__metadata__\":{\"epoch\":3}}", 0, "not a string");
}

Test(safetensors, written_files_read_back) {
  kiln_ctx *ctx = th_cpu_ctx();
  char dir[] = "/tmp/kiln-st-XXXXXX", path[64];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/t.safetensors", dir);
  /* every dtype and rank 0..6 */
  kiln__st_out t[7];
  int64_t shapes[7][6];
  char names[7][8];
  void *data[7];
  for (int r = 0; r <= 6; r++) {
    for (int d = 0; d < r; d++)
      shapes[r][d] = 1 + (r + d) % 3;
    kiln_dtype dt = r % 3 == 0 ? KILN_DTYPE_F32 : (r % 3 == 1 ? KILN_DTYPE_BF16 : KILN_DTYPE_I32);
    size_t bytes = kiln_dtype_size(dt) * (size_t)kiln__numel(r, shapes[r]);
    data[r] = malloc(bytes);
    for (size_t k = 0; k < bytes; k++)
      ((uint8_t *)data[r])[k] = (uint8_t)(k * 7 + r);
    snprintf(names[r], sizeof names[r], "t%d", r);
    t[r] = (kiln__st_out){
        .name = names[r], .dtype = dt, .ndim = r, .shape = shapes[r], .data = data[r]};
  }
  cJSON *meta = cJSON_CreateObject();
  cJSON_AddStringToObject(meta, "note", "round trip");
  cr_assert_eq(kiln__st_write(ctx, "t", path, 7, t, meta), KILN_OK, "%s", kiln_ctx_error(ctx));
  size_t len;
  uint8_t *buf = (uint8_t *)th_read_whole(path, &len);
  uint64_t hl = 0;
  for (int i = 7; i >= 0; i--)
    hl = hl << 8 | buf[i];
  cr_assert_eq(hl % 8, 0, "the data section starts 8-byte aligned");
  kiln__st_file f;
  cr_assert_eq(kiln__st_parse(ctx, "t", path, buf, len, &f), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(f.n, 7);
  for (int r = 0; r <= 6; r++) {
    const kiln__st_entry *e = kiln__st_find(&f, names[r]);
    cr_assert_not_null(e);
    cr_assert_eq(e->ndim, r);
    cr_assert_eq(e->dtype, t[r].dtype);
    for (int d = 0; d < r; d++)
      cr_assert_eq(e->shape[d], shapes[r][d]);
    cr_assert_eq(memcmp(f.data + e->begin, data[r], e->end - e->begin), 0, "rank %d bytes", r);
    free(data[r]);
  }
  cr_assert_str_eq(cJSON_GetObjectItem(f.metadata, "note")->valuestring, "round trip");
  kiln__st_free(&f);
  cJSON_Delete(meta);
  free(buf);
  unlink(path);
  rmdir(dir);
  th_ctx_free(ctx);
}

/* One version of a 64 MiB file: every data byte is v. */
static kiln_status write_version(kiln_ctx *ctx, const char *path, uint8_t v, uint8_t *data,
                                 size_t n) {
  memset(data, v, n);
  int64_t shape[1] = {(int64_t)(n / 4)};
  kiln__st_out t = {.name = "w", .dtype = KILN_DTYPE_F32, .ndim = 1, .shape = shape, .data = data};
  return kiln__st_write(ctx, "t", path, 1, &t, NULL);
}

Test(safetensors, save_killed_midway_keeps_previous_file, .timeout = 300) {
  kiln_ctx *ctx = th_cpu_ctx();
  char dir[] = "/tmp/kiln-kill-XXXXXX", path[64];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
  size_t n = (size_t)64 << 20;
  uint8_t *data = malloc(n);
  cr_assert_not_null(data);
  cr_assert_eq(write_version(ctx, path, 1, data, n), KILN_OK, "%s", kiln_ctx_error(ctx));
  int kills_mid_write = 0;
  for (int round = 0; round < 6; round++) {
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
      for (uint8_t v = 2;; v = (uint8_t)(v % 200 + 2))
        write_version(ctx, path, v, data, n);
    }
    /* kill the writer while its temporary file is partly written (or, in odd rounds, at a
     * moment that may fall anywhere, between writes too) */
    char tmp[128];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)pid);
    struct stat sb;
    for (int wait = 0; wait < 5000; wait++) {
      struct timespec ts = {0, 200000L};
      nanosleep(&ts, NULL);
      if (round % 2 ? wait == 20 * round : stat(tmp, &sb) == 0 && sb.st_size > (off_t)(n / 4))
        break;
    }
    kill(pid, SIGKILL);
    int st;
    waitpid(pid, &st, 0);
    cr_assert(WIFSIGNALED(st), "the writer was killed");
    /* a half-written temporary file may be left; the target is always whole */
    if (stat(tmp, &sb) == 0) {
      kills_mid_write++;
      unlink(tmp);
    }
    size_t len;
    uint8_t *buf = (uint8_t *)th_read_whole(path, &len);
    kiln__st_file f;
    cr_assert_eq(kiln__st_parse(ctx, "t", path, buf, len, &f), KILN_OK,
                 "round %d: the checkpoint is damaged: %s", round, kiln_ctx_error(ctx));
    const kiln__st_entry *e = kiln__st_find(&f, "w");
    cr_assert_not_null(e);
    cr_assert_eq(e->end - e->begin, n);
    uint8_t v = f.data[e->begin];
    for (size_t k = 0; k < n; k += 4093)
      cr_assert_eq(f.data[e->begin + k], v, "mixed versions");
    cr_assert_eq(f.data[e->end - 1], v);
    kiln__st_free(&f);
    free(buf);
  }
  cr_log_info("%d of 6 kills landed in the middle of a write", kills_mid_write);
  cr_assert_gt(kills_mid_write, 0, "no kill landed mid-write: the test proved nothing");
  free(data);
  unlink(path);
  rmdir(dir);
  th_ctx_free(ctx);
}

/* An empty parameter list saves as a file of no tensors and loads back into an empty list
 * (under UBSan: nothing copied from a NULL list). */
Test(safetensors, an_empty_parameter_list_round_trips) {
  kiln_ctx *ctx = th_cpu_ctx();
  char dir[] = "/tmp/kiln-st-XXXXXX", path[64];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/empty.safetensors", dir);
  kiln_params *p = kiln_params_new(ctx);
  cr_assert_eq(kiln_params_save(p, path, KILN_DTYPE_F32), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_params_load(p, path), KILN_OK, "%s", kiln_ctx_error(ctx));
  cr_assert_eq(kiln_params_count(p), 0);
  kiln_params_free(p);
  remove(path);
  rmdir(dir);
  th_ctx_free(ctx);
}
