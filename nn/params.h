/*
 * params.h: what nn/'s layers need of a parameter list beyond kiln.h.
 */
#ifndef KILN_PARAMS_H
#define KILN_PARAMS_H

#include "../core/internal.h"

/* Removes the last parameter added and frees its tensor (a layer's init undoing itself). */
void kiln__params_pop(kiln_params *p);

#endif
