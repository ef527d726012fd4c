/*
 * kiln_evaluate.h: a classifier's loss and accuracy over a loader, a part of kiln's public header:
 * include kiln.h, which includes this.
 */
#ifndef KILN_EVALUATE_H_PUBLIC
#define KILN_EVALUATE_H_PUBLIC

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- evaluation */

/* A model's forward pass: a batch x (B, ...) to logits (B, C). kiln_module_call is one, for a
 * module (kiln_module); for a model of your own, write one that takes it as model. */
typedef kiln_tensor *(*kiln_forward_fn)(void *model, kiln_tensor *x);

typedef enum kiln_eval_loss {
  KILN_EVAL_CROSS_ENTROPY = 0, /* kiln_cross_entropy (torch's CrossEntropyLoss) */
  KILN_EVAL_NO_LOSS,           /* accuracy only: the result's loss is NAN */
} kiln_eval_loss;

/* Options, by the header's rule (NULL: every field zero): cross-entropy without label smoothing,
 * the forward pass in the dtypes its ops give. */
typedef struct kiln_eval_options {
  kiln_eval_loss loss;
  float label_smoothing; /* cross-entropy's, in [0, 1]; 0: none (torch's default) */
  /* KILN_DTYPE_BF16: each forward pass runs in a bf16 autocast region (kiln_autocast_begin),
   * opened and closed inside its step; 0 (KILN_DTYPE_F32): none */
  kiln_dtype autocast;
} kiln_eval_options;

typedef struct kiln_eval_result {
  double loss;     /* the mean over the samples of each one's loss; NAN with KILN_EVAL_NO_LOSS */
  double accuracy; /* correct / samples, in [0, 1] */
  int64_t correct; /* samples whose logits' argmax (the first on ties) is their label */
  int64_t samples; /* the samples of the epoch's batches (the partial one dropped with drop_last) */
} kiln_eval_result;

/*
 * Evaluates a classifier, as a PyTorch evaluation loop does under model.eval() and
 * torch.no_grad(): runs forward(model, x) on every batch of the loader's current epoch, in its
 * order, batch size and drop_last, from the first batch, without moving the loader
 * (kiln_loader_next goes on where it was), and sets *out to the mean loss and the accuracy.
 * Inside, it switches evaluation mode on (kiln_eval_begin: training off, no gradients) and off
 * again (kiln_eval_end: the training mode it found). Each batch is a step of its own: its loss
 * summed over the batch (cross-entropy with reduction SUM) and its count of correct predictions
 * (kiln_eq of the argmax and the i32 labels) are added to two sums on the device, so no step
 * waits for the host and every full batch replays one step graph (evaluating the same loader
 * again reuses it); the host reads the sums once at the end (and after every 2^24 samples, below
 * which an f32 count is exact). Its steps release the intermediates of earlier steps, as any
 * kiln_step_begin does.
 *
 * Errors (naming kiln_evaluate and the values; KILN_ERR_INVALID unless said): a NULL loader,
 * forward or out; a loader of another context; a loader whose epoch has no batch; an unknown
 * loss, a label_smoothing outside [0, 1], an autocast dtype other than 0 and bf16; a call inside
 * an open step that has recorded ops, or inside an open autocast region (KILN_ERR_STATE; a step
 * opened with nothing recorded yet, as a loop leaves it when its loader runs out, is taken as
 * closed); a forward that returns NULL without
 * an error of its own, or logits that are not (B, C) for a batch of B (KILN_ERR_SHAPE) or not of
 * a float dtype (KILN_ERR_DTYPE), or whose C changes from batch to batch (KILN_ERR_SHAPE); an
 * error of the forward pass's ops (theirs is the context's error); a label outside [0, C) with
 * cross-entropy (found on the device, reported when the sums are read); a context without a GPU
 * (KILN_ERR_STATE: its steps are recorded, planned and compiled, but nothing can be read). A
 * failed call leaves *out, the loader, the training mode and the no-grad depth as it found them.
 */
kiln_status kiln_evaluate(kiln_ctx *ctx, kiln_loader *loader, kiln_forward_fn forward, void *model,
                          const kiln_eval_options *o, kiln_eval_result *out);

#ifdef __cplusplus
}
#endif
#endif
