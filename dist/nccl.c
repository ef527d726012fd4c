/*
 * nccl.c: NCCL, loaded at run time. kiln never links libnccl: NCCL is not in the archives CI and
 * most machines reach, and a world of one process needs none. kiln__nccl_load dlopens the library
 * (a path given, $KILN_NCCL_LIBRARY, else libnccl.so.2, NCCL's soname), looks up the functions
 * kiln calls with the types of NCCL's documented C API (dist.h) and checks its version. Each
 * kiln_dist loads its own reference (dlopen counts them), so no state is the process's.
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"

_Static_assert(sizeof(kiln__nccl_id) == KILN__NCCL_ID_BYTES, "ncclUniqueId is 128 bytes");

/* How to get NCCL, the end of every message that says it did not load. */
#define HOW_TO_INSTALL                                                                             \
  "kiln loads NCCL at run time: install it from NVIDIA's CUDA repository (apt-get install "        \
  "libnccl2; libnccl-dev has the headers) or with pip (pip install nvidia-nccl-cu13, or "          \
  "nvidia-nccl-cu12 for CUDA 12: the library is in the package's lib/ folder, python3 -c "         \
  "\"import nvidia.nccl as m; print(list(m.__path__)[0])\" prints the package's), then "           \
  "let the loader find libnccl.so.2 (LD_LIBRARY_PATH) or name the file in KILN_NCCL_LIBRARY"

void kiln__nccl_version_string(int code, char *buf, size_t n) {
  if (code >= 10000)
    snprintf(buf, n, "%d.%d.%d", code / 10000, code / 100 % 100, code % 100);
  else
    snprintf(buf, n, "%d.%d.%d", code / 1000, code / 100 % 10, code % 100);
}

const char *kiln__nccl_result_string(const kiln__nccl *nccl, int result, char *buf, size_t n) {
  const char *words = nccl && nccl->get_error_string ? nccl->get_error_string(result) : NULL;
  char q[160];
  snprintf(buf, n, "%s (%d)", words ? kiln__dist_quote(words, q, sizeof q) : "unknown result",
           result);
  return buf;
}

/* Looks up every function into t; false with the message naming the first one missing. */
static bool lookup(const char *fn, void *lib, const char *path, kiln__nccl *t, char *err,
                   size_t err_size) {
  struct {
    const char *name;
    void *slot; /* the function pointer to set */
    bool optional;
  } fns[] = {
      {"ncclGetVersion", &t->get_version, false},
      {"ncclGetErrorString", &t->get_error_string, false},
      {"ncclGetUniqueId", &t->get_unique_id, false},
      {"ncclCommInitRank", &t->comm_init_rank, false},
      {"ncclCommDestroy", &t->comm_destroy, false},
      {"ncclCommAbort", &t->comm_abort, false},
      {"ncclCommGetAsyncError", &t->comm_get_async_error, false},
      {"ncclAllReduce", &t->all_reduce, false},
      {"ncclBroadcast", &t->broadcast, false},
      {"ncclGroupStart", &t->group_start, false},
      {"ncclGroupEnd", &t->group_end, false},
      {"ncclGetLastError", &t->get_last_error, true},
  };
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
    void *sym = dlsym(lib, fns[i].name);
    if (!sym && !fns[i].optional) {
      kiln__dist_fail(err, err_size, KILN_ERR_STATE,
                      "%s: %s has no %s: it is not an NCCL kiln can use (2.10 or later); %s", fn,
                      path, fns[i].name, HOW_TO_INSTALL);
      return false;
    }
    memcpy(fns[i].slot, &sym, sizeof sym); /* POSIX: a function's address as a void * */
  }
  return true;
}

kiln_status kiln__nccl_load(const char *fn, const char *path, kiln__nccl *nccl, char *err,
                            size_t err_size) {
  if (!nccl) return kiln__dist_fail(err, err_size, KILN_ERR_INVALID, "%s: NULL table", fn);
  const char *env = getenv("KILN_NCCL_LIBRARY");
  const char *from = "";
  if (path && *path) {
    from = "";
  } else if (env && *env) {
    path = env;
    from = " (KILN_NCCL_LIBRARY)";
  } else {
    path = "libnccl.so.2";
  }
  if (strlen(path) >= sizeof nccl->path)
    return kiln__dist_fail(err, err_size, KILN_ERR_INVALID,
                           "%s: the NCCL library's path%s is %zu bytes long, over %zu", fn, from,
                           strlen(path), sizeof nccl->path - 1);
  dlerror(); /* clears an earlier message */
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *why = dlerror();
    return kiln__dist_fail(err, err_size, KILN_ERR_STATE, "%s: %s%s did not load: %s; %s", fn, path,
                           from, why ? why : "no reason given", HOW_TO_INSTALL);
  }
  kiln__nccl t;
  memset(&t, 0, sizeof t);
  if (!lookup(fn, lib, path, &t, err, err_size)) {
    dlclose(lib);
    return KILN_ERR_STATE;
  }
  int version = 0, r = t.get_version(&version);
  char words[200], have[32], need[32];
  if (r != KILN__NCCL_SUCCESS) {
    kiln__dist_fail(err, err_size, KILN_ERR_STATE, "%s: ncclGetVersion of %s failed: %s", fn, path,
                    kiln__nccl_result_string(&t, r, words, sizeof words));
    dlclose(lib);
    return KILN_ERR_STATE;
  }
  if (version < KILN__NCCL_MIN_VERSION) {
    kiln__nccl_version_string(version, have, sizeof have);
    kiln__nccl_version_string(KILN__NCCL_MIN_VERSION, need, sizeof need);
    kiln__dist_fail(err, err_size, KILN_ERR_STATE,
                    "%s: %s is NCCL %s (version code %d); kiln needs %s or later; %s", fn, path,
                    have, version, need, HOW_TO_INSTALL);
    dlclose(lib);
    return KILN_ERR_STATE;
  }
  t.lib = lib;
  t.version = version;
  memcpy(t.path, path, strlen(path) + 1);
  *nccl = t;
  return KILN_OK;
}

void kiln__nccl_unload(kiln__nccl *nccl) {
  if (!nccl) return;
  if (nccl->lib) dlclose(nccl->lib);
  memset(nccl, 0, sizeof *nccl);
}
