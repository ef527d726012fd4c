/*
 * test_gpu_dist.c: kiln's NCCL declarations (dist/dist.h) against the real library, on GPUs. A
 * world of 1 through kiln_dist_init with NCCL asked for: the communicator made from the id
 * kiln_dist_init holds, all-reduces of f32 and bf16 device buffers on the context's stream, and
 * one captured in a CUDA graph and replayed. Two ranks on two GPUs, forked, meeting at the
 * rendezvous: their sums and averages, eager and captured. NCCL is found as kiln finds it
 * (KILN_NCCL_LIBRARY, libnccl.so.2), else in Python's nvidia-nccl package (PyTorch's); each test
 * skips, saying why, without a GPU (two for the second) or without NCCL.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dist/dist.h"
#include "helpers.h"

enum { N = 4099 }; /* not a multiple of anything NCCL chunks by */

/* The NCCL library to load: NULL for kiln's own search (KILN_NCCL_LIBRARY, libnccl.so.2), or
 * the pip package's copy; false when there is none. */
static bool find_nccl(char *path, size_t n, const char **use) {
  *use = NULL;
  const char *env = getenv("KILN_NCCL_LIBRARY");
  if (env && *env) return true;
  void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (lib) {
    dlclose(lib);
    return true;
  }
  FILE *p =
      popen("python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null", "r");
  if (!p) return false;
  char dir[800] = "";
  bool got = fgets(dir, sizeof dir, p) != NULL;
  pclose(p);
  if (!got) return false;
  dir[strcspn(dir, "\n")] = '\0';
  snprintf(path, n, "%s/lib/libnccl.so.2", dir);
  if (access(path, R_OK) != 0) return false;
  *use = path;
  return true;
}

#define CUDA_OK(x)                                                                                 \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    cr_assert_eq(e_, cudaSuccess, "%s: %s", #x, cudaGetErrorString(e_));                           \
  } while (0)

#define NCCL_OK(n, x)                                                                              \
  do {                                                                                             \
    int r_ = (x);                                                                                  \
    char w_[200];                                                                                  \
    cr_assert_eq(r_, KILN__NCCL_SUCCESS, "%s: %s", #x,                                             \
                 kiln__nccl_result_string((n), r_, w_, sizeof w_));                                \
  } while (0)

Test(gpu_dist, a_world_of_one_through_nccl) {
  TH_GPU_CTX(ctx);
  char lib[1024];
  const char *use;
  if (!find_nccl(lib, sizeof lib, &use)) {
    th_ctx_free(ctx);
    cr_skip_test("needs NCCL: no KILN_NCCL_LIBRARY, no libnccl.so.2, no nvidia-nccl package");
  }
  kiln_dist *d = kiln_dist_init(&(kiln_dist_options){.nccl = 1, .nccl_library = use});
  cr_assert_eq(kiln_dist_status(d), KILN_OK, "%s", kiln_dist_error(d));
  const kiln__nccl *n = kiln__dist_nccl(d);
  cr_assert_geq(n->version, KILN__NCCL_MIN_VERSION);
  CUDA_OK(cudaSetDevice(0));
  kiln__nccl_comm comm = NULL;
  NCCL_OK(n, n->comm_init_rank(&comm, 1, *kiln__dist_id(d), 0));

  float *x = NULL, *y = NULL, host[N], back[N];
  for (int i = 0; i < N; i++)
    host[i] = (float)i * 0.37f - 100.0f;
  CUDA_OK(cudaMalloc((void **)&x, sizeof host));
  CUDA_OK(cudaMalloc((void **)&y, sizeof host));
  CUDA_OK(cudaMemcpy(x, host, sizeof host, cudaMemcpyHostToDevice));
  cudaStream_t s = (cudaStream_t)kiln_ctx_stream(ctx);
  /* in place, the average over one rank: the values themselves */
  NCCL_OK(n, n->all_reduce(x, x, N, KILN__NCCL_FLOAT32, KILN__NCCL_AVG, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaMemcpy(back, x, sizeof back, cudaMemcpyDeviceToHost));
  cr_assert_eq(memcmp(back, host, sizeof host), 0);
  /* bf16, out of place */
  uint16_t h16[N], b16[N];
  for (int i = 0; i < N; i++)
    h16[i] = kiln_bf16_from_f32(host[i]);
  CUDA_OK(cudaMemcpy(y, h16, sizeof h16, cudaMemcpyHostToDevice));
  NCCL_OK(n, n->all_reduce(y, x, N, KILN__NCCL_BFLOAT16, KILN__NCCL_SUM, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaMemcpy(b16, x, sizeof b16, cudaMemcpyDeviceToHost));
  cr_assert_eq(memcmp(b16, h16, sizeof h16), 0);

  /* captured in a graph and replayed twice */
  CUDA_OK(cudaMemcpy(x, host, sizeof host, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(y, 0, sizeof host));
  cudaStream_t cs;
  CUDA_OK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CUDA_OK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
  NCCL_OK(n, n->all_reduce(x, y, N, KILN__NCCL_FLOAT32, KILN__NCCL_SUM, comm, cs));
  CUDA_OK(cudaStreamEndCapture(cs, &g));
  CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
  for (int k = 0; k < 2; k++)
    CUDA_OK(cudaGraphLaunch(ge, cs));
  CUDA_OK(cudaStreamSynchronize(cs));
  CUDA_OK(cudaMemcpy(back, y, sizeof back, cudaMemcpyDeviceToHost));
  cr_assert_eq(memcmp(back, host, sizeof host), 0);
  int async = -1;
  NCCL_OK(n, n->comm_get_async_error(comm, &async));
  cr_assert_eq(async, KILN__NCCL_SUCCESS);

  CUDA_OK(cudaGraphExecDestroy(ge));
  CUDA_OK(cudaGraphDestroy(g));
  CUDA_OK(cudaStreamDestroy(cs));
  NCCL_OK(n, n->comm_destroy(comm));
  CUDA_OK(cudaFree(x));
  CUDA_OK(cudaFree(y));
  kiln_dist_free(d);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- two ranks */

/* What a forked process reports. */
typedef struct report {
  int code; /* 0: as expected */
  char msg[512];
} report;

static pid_t spawn(void (*body)(void *, report *), void *arg, int *fd) {
  int p[2];
  cr_assert_eq(pipe(p), 0);
  pid_t parent = getpid(), pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(3);
    alarm(120);
    close(p[0]);
    report r;
    memset(&r, 0, sizeof r);
    body(arg, &r);
    _exit(write(p[1], &r, sizeof r) == (ssize_t)sizeof r ? 0 : 2);
  }
  close(p[1]);
  *fd = p[0];
  return pid;
}

static report reap(pid_t pid, int fd) {
  report r;
  memset(&r, 0, sizeof r);
  ssize_t got = read(fd, &r, sizeof r);
  close(fd);
  int st = 0;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  cr_assert(got == (ssize_t)sizeof r && WIFEXITED(st) && WEXITSTATUS(st) == 0,
            "a forked process ended badly (status %d)", st);
  return r;
}

/* The GPUs a process sees, counted in a child: the test process itself stays without CUDA, so
 * that the ranks it forks can use it. */
static void count_body(void *arg, report *r) {
  (void)arg;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  r->code = n;
}

typedef struct rank_arg {
  int rank, port;
  const char *lib;
} rank_arg;

#define FAIL(...)                                                                                  \
  do {                                                                                             \
    snprintf(r->msg, sizeof r->msg, __VA_ARGS__);                                                  \
    r->code = 1;                                                                                   \
    goto out;                                                                                      \
  } while (0)

static void rank_body(void *p, report *r) {
  rank_arg *a = p;
  kiln_dist_env env = {.launcher = KILN_DIST_LAUNCHER_TORCHRUN,
                       .rank = a->rank,
                       .world_size = 2,
                       .local_rank = a->rank,
                       .local_world_size = 2,
                       .master_addr = "127.0.0.1",
                       .master_port = a->port};
  kiln_dist *d =
      kiln_dist_init(&(kiln_dist_options){.env = &env, .timeout_s = 60, .nccl_library = a->lib});
  kiln__nccl_comm comm = NULL;
  float *x = NULL, *y = NULL;
  cudaStream_t s = NULL;
  char w[200];
  if (kiln_dist_status(d) != KILN_OK) FAIL("%s", kiln_dist_error(d));
  const kiln__nccl *n = kiln__dist_nccl(d);
  if (cudaSetDevice(kiln_dist_local_rank(d)) != cudaSuccess) FAIL("cudaSetDevice");
  int res = n->comm_init_rank(&comm, 2, *kiln__dist_id(d), a->rank);
  if (res) FAIL("ncclCommInitRank: %s", kiln__nccl_result_string(n, res, w, sizeof w));
  static float host[N], back[N];
  for (int i = 0; i < N; i++)
    host[i] = (float)((a->rank + 1) * (i % 97)); /* small integers: sums are exact */
  if (cudaMalloc((void **)&x, sizeof host) || cudaMalloc((void **)&y, sizeof host) ||
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) ||
      cudaMemcpy(x, host, sizeof host, cudaMemcpyHostToDevice))
    FAIL("CUDA set-up");
  /* eager: the sum (1 + 2) v and the average 1.5 v */
  res = n->all_reduce(x, y, N, KILN__NCCL_FLOAT32, KILN__NCCL_SUM, comm, s);
  if (!res) res = n->all_reduce(x, x, N, KILN__NCCL_FLOAT32, KILN__NCCL_AVG, comm, s);
  if (res) FAIL("ncclAllReduce: %s", kiln__nccl_result_string(n, res, w, sizeof w));
  if (cudaStreamSynchronize(s)) FAIL("sync");
  cudaMemcpy(back, y, sizeof back, cudaMemcpyDeviceToHost);
  for (int i = 0; i < N; i++)
    if (back[i] != (float)(3 * (i % 97))) FAIL("sum[%d] = %g, not %d", i, back[i], 3 * (i % 97));
  cudaMemcpy(back, x, sizeof back, cudaMemcpyDeviceToHost);
  for (int i = 0; i < N; i++)
    if (back[i] != 1.5f * (float)(i % 97)) FAIL("average[%d] = %g", i, back[i]);
  /* captured: the average of the averages, twice */
  cudaGraph_t g;
  cudaGraphExec_t ge;
  if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)) FAIL("capture");
  res = n->all_reduce(x, y, N, KILN__NCCL_FLOAT32, KILN__NCCL_AVG, comm, s);
  if (cudaStreamEndCapture(s, &g) || res) FAIL("captured ncclAllReduce: %d", res);
  if (cudaGraphInstantiate(&ge, g, 0) || cudaGraphLaunch(ge, s) || cudaGraphLaunch(ge, s) ||
      cudaStreamSynchronize(s))
    FAIL("graph launch");
  cudaMemcpy(back, y, sizeof back, cudaMemcpyDeviceToHost);
  for (int i = 0; i < N; i++)
    if (back[i] != 1.5f * (float)(i % 97)) FAIL("captured average[%d] = %g", i, back[i]);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
out:
  if (comm) kiln__dist_nccl(d)->comm_destroy(comm);
  cudaFree(x);
  cudaFree(y);
  if (s) cudaStreamDestroy(s);
  kiln_dist_free(d);
}

Test(gpu_dist, two_ranks_on_two_gpus) {
  int fd;
  pid_t pid = spawn(count_body, NULL, &fd);
  int gpus = reap(pid, fd).code;
  if (gpus < 2) cr_skip_test("needs two GPUs (this machine has %d)", gpus);
  char lib[1024];
  const char *use;
  if (!find_nccl(lib, sizeof lib, &use))
    cr_skip_test("needs NCCL: no KILN_NCCL_LIBRARY, no libnccl.so.2, no nvidia-nccl package");
  /* a free port: a listener on port 0, closed (rank 0 binds it again at once) */
  int probe = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  cr_assert_eq(bind(probe, (struct sockaddr *)&sa, sizeof sa), 0);
  cr_assert_eq(getsockname(probe, (struct sockaddr *)&sa, &len), 0);
  close(probe);
  rank_arg a0 = {0, ntohs(sa.sin_port), use}, a1 = {1, ntohs(sa.sin_port), use};
  int f0, f1;
  pid_t p0 = spawn(rank_body, &a0, &f0), p1 = spawn(rank_body, &a1, &f1);
  report r0 = reap(p0, f0), r1 = reap(p1, f1);
  cr_assert_eq(r0.code, 0, "rank 0: %s", r0.msg);
  cr_assert_eq(r1.code, 0, "rank 1: %s", r1.msg);
}
