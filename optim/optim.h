/*
 * optim.h: what io/ (checkpoints) reads of an optimizer and restores into it.
 */
#ifndef KILN_OPTIM_H
#define KILN_OPTIM_H

#include "../core/internal.h"

/* The parameter list the optimizer updates. */
const kiln_params *kiln__optim_params(const kiln_optim *o);
/* "sgd", "adam", "adamw" or "muon". */
const char *kiln__optim_kind(const kiln_optim *o);
/* State tensor which (0, 1) of parameter i, or NULL; *name is its name in a checkpoint. */
kiln_tensor *kiln__optim_state(const kiln_optim *o, int i, int which, const char **name);
/* How many updates parameter i has had. */
int64_t kiln__optim_count(const kiln_optim *o, int i);
void kiln__optim_restore(kiln_optim *o, int64_t steps, const int64_t *counts);

#endif
