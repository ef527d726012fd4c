/*
 * optimizer.h: the optimizer's structure, shared by the files of optim/: optim.c (the optimizers,
 * groups, schedules) and nonfinite.c (skipping steps whose gradients are not finite, and the
 * counts of updates kept on the device while that is on).
 */
#ifndef KILN_OPTIMIZER_H
#define KILN_OPTIMIZER_H

#include "../core/internal.h"

typedef enum kiln__optim_algo {
  KILN__OPTIM_SGD,
  KILN__OPTIM_ADAM,
  KILN__OPTIM_ADAMW,
  KILN__OPTIM_MUON
} kiln__optim_algo;

struct kiln_optim {
  kiln__optim_algo kind;
  kiln_ctx *ctx;
  kiln__anchor *anchor;
  kiln_params *params;
  kiln_sgd_options sgd;
  kiln_adam_options adam;
  kiln_muon_options muon;
  float lr;
  int64_t steps;
  int n;
  kiln_tensor **s1, **s2; /* momentum buffer (SGD, Muon); Adam's m and v */
  int64_t *count;         /* updates each parameter has had */
  /* parameter groups (kiln_optim_add_group), per parameter: the rate's scale, the weight decay
   * when wd_set (else the optimizer's), whether this optimizer leaves it alone, and the group
   * that holds it (1, 2, ... in the order the groups were made; 0: the optimizer's own) */
  float *lr_scale, *wd;
  bool *wd_set, *excluded;
  int *group;
  int ngroups;      /* groups made so far */
  bool *mark;       /* kiln_optim_step's scratch: parameters recorded */
  kiln_tensor **up; /* Muon's step's scratch: each parameter's update X, then weight factor */
  bool scheduled;
  kiln_schedule schedule;
  uint64_t undo_mark; /* the step's undo log holds its state (core/undo.c) */
  /* kiln_optim_skip_nonfinite, while it is on (else NULL): the step's flag, the steps skipped,
   * and each trained parameter's count of updates applied, one value each on the device (the
   * counts that count[] holds while the option is off) */
  kiln_tensor *found, *skipped, **applied;
};

/* Which parameters a step updates (optim.c: those with a gradient that the optimizer trains). */
typedef bool (*kiln__updates_fn)(const kiln_optim *o, int i);
/* With the option on, records the start of a step: the flag cleared, then set by the gradient of
 * every parameter that upd takes, and the skipped steps counted. */
bool kiln__guard_check(kiln_optim *o, kiln__updates_fn upd);
/* With the option on, records the end of a step: the counts of the parameters upd takes
 * advanced, unless the step was skipped. */
bool kiln__guard_advance(kiln_optim *o, kiln__updates_fn upd);
/* Parameter i starts afresh (a group excluded it): its count on the device becomes 0. */
void kiln__guard_restart(kiln_optim *o, int i);
/* count[] written to the device's counts (a checkpoint's, loaded). */
void kiln__guard_restore(kiln_optim *o);
/* Parameter i's count of updates: the device's while the option is on (read: waits for it). */
int64_t kiln__guard_count(const kiln_optim *o, int i);
/* Frees the option's tensors (with the context alive) and arrays. */
void kiln__guard_free(kiln_optim *o);

#endif
