/*
 * render.h: what the renderer's files share. The renderer turns a spec (lower.c) into CUDA C
 * source, a kernel name, a launch shape and an argument plan (which tensor each pointer slot
 * binds to, where each attribute slot comes from); it only renders: it compiles nothing,
 * allocates no device memory and reads no device address. One file per kernel family, each
 * taking its part of a spec and filling a kiln__rendered:
 *   render.c          kiln__render, which picks the family
 *   emit.c            the shared parts below
 *   render_ew.c       elementwise programs, multi-tensor updates, row gathers
 *   render_reduce.c   reductions, row programs, batch norm's column sums
 *   render_window.c   sliding windows: im2col, col2im, pooling and its gradients
 *   render_conv.c     convolutions' products as implicit GEMMs (device/igemm.cuh, conv.cuh,
 *                     conv_tma.cuh)
 *   render_conv_few.c the direct and halo-tile ones (conv_direct.cuh, conv_few.cuh), and the
 *                     operands and names of every convolution kernel
 *   render_augment.c  image augmentation (fusion/device/augment.cuh)
 *   render_custom.c   custom ops' kernels: the user's source and a wrapper (device/custom.cuh)
 * The kernel bodies that are the same for every shape live in the device files (fusion/device); a
 * renderer writes the constants of a shape and the code that fusion makes per group (an elementwise
 * program, an epilogue).
 */
#ifndef KILN_RENDER_H
#define KILN_RENDER_H

#include "fusion.h"

/* The tensors a kernel reads and writes, each through a.ptr[k]. */
typedef struct kiln__operands {
  int n;
  const kiln_tensor *t[KILN__KMAX_PTR];
  bool lin[KILN__KMAX_PTR];
  /* an elementwise operand indexed by the space's last dims alone ('m': offset i % P<k>) or by
   * its first dims alone ('d': i / P<k>), P<k> the product of the last dims' sizes; 0 when its
   * offset is i (lin) or needs the coordinates */
  char tail[KILN__KMAX_PTR];
  bool store[KILN__KMAX_PTR];
  /* a window epilogue's operand broadcast over an image: 'c' one value a channel (indexed by the
   * channel), 's' one value in all (index 0), 0 neither */
  char bcast[KILN__KMAX_PTR];
  /* a row program's operand read or written once per row: the row-shaped space it is indexed
   * over (NULL: the program's whole iteration space) */
  const kiln_tensor *row[KILN__KMAX_PTR];
} kiln__operands;

/* How an elementwise program's nodes read their inputs and where their attributes live. */
typedef struct kiln__wiring {
  int val[KILN__MAX_GROUP][KILN__MAX_IN];  /* input q of node j: the value of node val (or -1) */
  int opnd[KILN__MAX_GROUP][KILN__MAX_IN]; /* or operand opnd */
  int8_t aslot[KILN__MAX_GROUP][KILN__MAX_ATTRS]; /* attribute a: its kernel slot (-1: unused) */
  int store_slot[KILN__MAX_GROUP]; /* operand written with node j's value, -1 for none */
  bool coords;                     /* some read needs the element's coordinates */
} kiln__wiring;

/* A window kernel's elementwise epilogue: the nodes after the window op in its group (node 0 of
 * p), computed for each lane of the op's result, lane l at output coordinates (n, h, w, c + l)
 * (image-side outputs) or (n, oh, ow, c + l). */
typedef struct kiln__win_epi {
  const kiln__ew_prog *p;
  const kiln__operands *o;
  const kiln__wiring *w;
  const int64_t *shape; /* the output's */
  bool image;
  /* image-side, with vec: the caller's variable that holds the lanes' pixel (n, h, w) as one
   * index, from which the four lanes' elements are indexed (pixel * C + c); NULL, or lane by
   * lane: from n, h and w */
  const char *pixel;
  bool vec; /* four lanes, and every operand of the epilogue dense like the output: each read
             * and written four values at a time */
  /* with vec: the operands read one value a channel are in X<k>[4] already, loaded before the
   * caller's loop at the four channels every lane group of the thread has
   * (kiln__hoist_channel_loads), and those read element by element too, loaded rows ahead
   * (kiln__ahead_rows) */
  bool hoist;
  /* with vec: the index expression (a variable of the caller's, or NULL) of the rings XR<k>[]
   * from which the operands read element by element are unpacked, fetched by the caller before
   * the window op's own loads (render_window.c's emit_ahead) */
  const char *ring;
  /* batch norm's gradient sums over the epilogue's node `value` (g), at most four lanes: lane l
   * adds g to kiln_ms[l] and g (x - mean) invstd to kiln_ms[4 + l], x read at the lane's element
   * of a dense operand, mean and invstd at its channel; operand `out`, where the caller writes
   * the sums, is no store of the epilogue's (value 0: none, node 0 being the window op) */
  struct {
    int value, x, mean, invstd, out;
  } mom;
  /* with vec: the window op's values are bf16 already (a product's tile staged as bf16), taken as
   * they are, not rounded to bf16 again (a conversion and a shift a value saved) */
  bool rounded;
} kiln__win_epi;

/* ---------------------------------------------------------------- operands and wiring */

/* A dtype's type in memory (kiln_bf16: bf16.cuh) and in registers, where bf16 values are floats. */
const char *kiln__ctype(kiln_dtype dt);
const char *kiln__rtype(kiln_dtype dt);
/* Strides of t over an iteration space of nd dims, broadcasting from the right (0 where t is
 * stretched). */
void kiln__align_strides(const kiln_tensor *t, int nd, const int64_t *shape, long long *st);
/* Whether t is contiguous with n elements. */
bool kiln__dense(const kiln_tensor *t, int64_t n);
/* Bytes of t a kernel touches: each element once, broadcast dims counted once. */
uint64_t kiln__footprint(const kiln_tensor *t);
/* Adds the bytes each operand is read or written with to r's traffic. */
void kiln__tally_bytes(const kiln__operands *o, kiln__rendered *r);
/* The operand slot of t (read, or written when store; row: a row program's per-row space). */
int kiln__operand(kiln__operands *o, const kiln_tensor *t, bool store, const kiln_tensor *row);
/* Gives node n's used attributes the next kernel slots (*nf, *ni, *nu), recording them in aslot. */
void kiln__wire_attrs(kiln__argplan *ap, const kiln__node *n, int8_t *aslot, int *nf, int *ni,
                      int *nu);
/* Assigns operands, value names and attribute slots for prog. In a row program (row non-NULL)
 * row[j] says node j computes one value per row; a reduction's output is one value per row too. */
void kiln__wire(const kiln__ew_prog *p, const bool *row, kiln__operands *o, kiln__wiring *w,
                kiln__argplan *ap, int *nf, int *ni, int *nu);

/* ---------------------------------------------------------------- emitting code */

/* The name of node j's input q in the kernel: a value (v3) or an operand (x1). */
void kiln__in_name(const kiln__wiring *w, int j, int q, char *buf, size_t n);
/* Writes an op-table expression with node j's names and attribute slots. */
void kiln__expand(kiln__sb *b, const char *tpl, const kiln__wiring *w, int j, const kiln__node *nd);
/* Node j's value v<j>, an op-table expression (a bf16 value rounded as its store would). */
void kiln__emit_node_value(kiln__sb *b, const char *ind, const kiln__wiring *w, int j,
                           const kiln__node *nd);
/* Operand k's offset: i (lin), i % P<k> or i / P<k> (tail), or from the coordinates c0.. */
void kiln__offset_expr(kiln__sb *b, int k, int nd, bool lin, char tail);
/* The loads, values and stores of prog for one element, indented by ind (vec: from and to the
 * four-lane arrays L<k>[e] and S<k>[e]). */
void kiln__emit_element(kiln__sb *b, const kiln__ew_prog *p, const kiln__operands *o,
                        const kiln__wiring *w, const char *ind, int nd, bool vec);
/* The coordinates c0..c<nd-1> of the linear index idx over a.shape. */
void kiln__emit_coords(kiln__sb *b, const char *ind, int nd, const char *idx);
/* The lambda kiln_dy(i0, c, gv): the four values of prologue pro's last node from its element i0
 * (channel c), from the operands w gives it in o, their strides aligned in ap (render_window.c). */
void kiln__emit_prologue(kiln__sb *b, const kiln__ew_prog *pro, kiln__operands *o,
                         const kiln__wiring *w, kiln__argplan *ap);
/* Whether a kernel whose offsets and indices reach span needs 64-bit indices. */
bool kiln__wide_index(int64_t span);
/* "typedef int ix;" or "typedef long long ix;" */
void kiln__emit_index_type(kiln__sb *b, bool wide);

/* ---------------------------------------------------------------- naming and launching */

/* A kernel name from the ops it runs, like k_add_relu_f32, kept short. */
void kiln__stem_of(const kiln__ew_prog *p, const char *prefix, const char *suffix, char *stem,
                   size_t n);
/* The first statement of a kernel launched as a programmatic dependent (r->pdl), else "". */
const char *kiln__pdl_line(const kiln__rendered *r);
/* Names the kernel after its stem, the text pre and its body, and wraps the body into the
 * kernel's source, after the prelude and pre (declarations at file scope; NULL: none); binds the
 * operands o to the pointer slots. */
bool kiln__finish_with(kiln__sb *body, const char *stem, const kiln__operands *o, kiln__rendered *r,
                       const char *pre);
bool kiln__finish(kiln__sb *body, const char *stem, const kiln__operands *o, kiln__rendered *r);
/* kiln__finish_with for a kernel whose grid-stride loop covers a.n: frees body and pre, sets the
 * launch (KILN__BLOCK threads) and the traffic of operands o. */
bool kiln__finish_loop(kiln__sb *body, kiln__sb *pre, const char *stem, const kiln__operands *o,
                       const kiln__target *t, kiln__rendered *r);
/* Blocks for a grid-stride loop over threads. */
unsigned kiln__grid_for(const kiln__target *t, int64_t threads);

/* ---------------------------------------------------------------- windows */

/* The operands of a window op's kernel: its inputs (operands 0..) and output, or with an
 * epilogue the program's wiring (whose strides and dense flags the epilogue reads). Returns the
 * output's operand, -1 when the epilogue stores. */
int kiln__window_operands(const kiln__ew_prog *p, kiln__operands *o, kiln__wiring *wr,
                          kiln__rendered *r);
/* Into buf, the address of a max pool's window positions (ops.def's index: a byte a value, behind
 * the values of the pool's output y, operand `slot`), read (const) or written; returns buf. */
const char *kiln__pool_positions(char *buf, size_t len, const kiln_tensor *y, int slot, bool read);
/* Writes float name[V], a window op's lanes (of dtype dt), through the epilogue e. The code
 * reads the element's coordinates n, h and w (or oh and ow), c, and V and ix. */
void kiln__store_lanes(kiln__sb *b, const char *name, kiln_dtype dt, const kiln__win_epi *e);
/* Marks used[k] for each operand k that nodes [from, p->n) of p read (render_window.c). */
void kiln__prog_reads(const kiln__ew_prog *p, const kiln__wiring *w, int from, bool *used);
/* For an epilogue with hoist: loads each operand it reads one value a channel into X<k>[4] at
 * channels [c, c + 4) (c an expression; zeros where c is not below `limit`), indented by ind. */
void kiln__hoist_channel_loads(kiln__sb *b, const kiln__win_epi *e, const char *c,
                               const char *limit, const char *ind);
/* For an epilogue with hoist over an image (rows of shape[3] channels), in the caller's loop over
 * rows kiln_r = 0 .. `rows` - 1 (unrolled, so that the ring stays in registers): X<k>[4] of each
 * operand it reads element by element, at row row(kiln_r) (row a function-like name the caller
 * defines) and channels [c, c + 4), `depth` rows of it in flight in the ring XR<k>[depth] (as
 * loaded: kiln_fetch4), each loaded where ok(r) holds (zeros, never read, otherwise). With first,
 * the ring declared and its first `depth` rows issued, before the loop; else, in the loop's row
 * kiln_r, X<k> taken from the ring and row kiln_r + depth issued into its place. */
void kiln__ahead_rows(kiln__sb *b, const kiln__win_epi *e, bool first, const char *depth,
                      const char *rows, const char *row, const char *ok, const char *c,
                      const char *ind);
/* Whether a window epilogue may read and write four lanes at once (render_window.c). */
bool kiln__epilogue_fours(const kiln__ew_prog *p, const kiln__operands *o, const kiln__wiring *wr);

/* ---------------------------------------------------------------- the families */

bool kiln__render_ew(const kiln__target *t, const kiln__ew_prog *p, kiln__rendered *r);
bool kiln__render_updates(const kiln__target *t, const kiln__node *const *nodes, int T,
                          kiln__rendered *r);
/* Casts (f32 and bf16) each over its own shape, its input read through its view's strides, in
 * one launch: blockIdx.y picks the cast (render_ew.c). */
bool kiln__render_casts(const kiln__target *t, const kiln__node *const *nodes, int T,
                        kiln__rendered *r);
bool kiln__render_gather(const kiln__target *t, const kiln__node *n, kiln__rendered *r);
bool kiln__render_reduce(const kiln__target *t, const kiln__ew_prog *pro, const kiln__node *rn,
                         kiln__rendered *r);
bool kiln__render_rows(const kiln__target *t, const kiln__ew_prog *p, const kiln_tensor *F,
                       kiln__rendered *r);
bool kiln__render_moments(const kiln__target *t, const kiln__node *n, kiln__rendered *r);
/* mom: a moments node of mode 0 over a max pool's output that the kernel computes too
 * (plan_conv.c's kiln__pool_moments), or NULL; pro: the elementwise run that computes a max pool
 * gradient's dy where it reads it (kiln__pool_grad_prologue), or a max pool's image
 * (kiln__pool_fwd_prologue), or none (pro->n 0). */
bool kiln__render_window(const kiln__target *t, const kiln__ew_prog *p, const kiln__ew_prog *pro,
                         const kiln__node *mom, kiln__rendered *r);
bool kiln__render_conv(const kiln__target *t, const kiln__spec *s, kiln__rendered *r);
/* The operands of a convolution kernel, slot[0..2]: im2col node n's image X, the product's other
 * operand t and its result out; and into pre the device header and the geometry struct G for co
 * output channels (render_conv_few.c). */
void kiln__conv_operands(const kiln__node *n, const kiln_tensor *t, const kiln_tensor *out,
                         int64_t co, const char *header, kiln__operands *o, int slot[3], char *pre,
                         size_t len);
/* The kernel of body b (freed) named after stem, with o's operands and pre before it; its bytes
 * counted (render_conv_few.c). */
bool kiln__finish_conv(kiln__sb *b, const char *stem, const kiln__operands *o, kiln__rendered *r,
                       const char *pre);
/* render_conv_few.c: a tiny convolution's direct forward product (epi: the unary chain after it);
 * a few-channel convolution's forward product from a halo tile (pool: the max pool in its
 * epilogue, mom: batch norm's statistics, or NULL) and its weight gradient (pro: the run that
 * computes its dY, or none). */
bool kiln__render_conv_direct(const kiln__node *n, const kiln__gemm *mm, const kiln__ew_prog *epi,
                              kiln__rendered *r);
bool kiln__render_conv_few(const kiln__target *t, const kiln__node *n, const kiln__gemm *mm,
                           const kiln__node *pool, const kiln__node *mom, kiln__rendered *r);
bool kiln__render_conv_few_wgrad(const kiln__target *t, const kiln__node *n, const kiln__gemm *mm,
                                 const kiln__ew_prog *pro, kiln__rendered *r);
bool kiln__render_augment(const kiln__target *t, const kiln__node *n, kiln__rendered *r);
bool kiln__render_custom(const kiln__target *t, const kiln__node *n, kiln__rendered *r);

#endif
