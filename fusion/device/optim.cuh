/*
 * optim.cuh: the optimizers' update rules, one element at a time. Each takes the parameter and
 * its state by reference and the op's attributes under the names ops.def gives them. (Muon's
 * orthogonalisation is matrix products, recorded as ops; only its in-place writes are here.)
 */
#ifndef KILN_OPTIM_CUH
#define KILN_OPTIM_CUH

#include "defs.cuh"

/* SGD as torch.optim.SGD without momentum */
KILN__FN void kiln_sgd(float &p, float g, float lr, float weight_decay) {
  float d = g;
  if (weight_decay != 0.f) d = d + weight_decay * p;
  p = p - lr * d;
}

/* SGD with momentum as torch.optim.SGD: weight decay, then momentum with dampening (first: the
 * buffer starts as the gradient), Nesterov */
KILN__FN void kiln_sgd_momentum(float &p, float g, float &buf, float lr, float momentum,
                                float dampening, float weight_decay, int nesterov, float first) {
  float d = g;
  if (weight_decay != 0.f) d = d + weight_decay * p;
  buf = first != 0.f ? d : momentum * buf + (1.f - dampening) * d;
  d = nesterov ? d + momentum * buf : buf;
  p = p - lr * d;
}

/* Adam and AdamW as torch.optim.Adam/AdamW (single-tensor): step_size = lr / (1 - beta1^t) and
 * bc2_sqrt = sqrt(1 - beta2^t) come from the host; decoupled: AdamW's weight decay */
KILN__FN void kiln_adam(float &p, float g, float &m, float &v, float lr, float beta1, float beta2,
                        float eps, float weight_decay, float step_size, float bc2_sqrt,
                        int decoupled) {
  if (weight_decay != 0.f) {
    if (decoupled)
      p = p * (1.f - lr * weight_decay);
    else
      g = g + weight_decay * p;
  }
  float w = 1.f - beta1;
  m = w < 0.5f ? m + w * (g - m) : g - (g - m) * (1.f - w); /* torch's lerp */
  v = v * beta2 + (1.f - beta2) * g * g;
  float denom = sqrtf(v) / bc2_sqrt + eps;
  p = p - step_size * (m / denom);
}

/* Adam and AdamW with the bias corrections from t, the update's number (1 for the first), read on
 * the device: 1 - beta^t as -expm1(t log beta), which keeps its digits when beta^t is near 1 */
KILN__FN void kiln_adam_counted(float &p, float g, float &m, float &v, float t, float lr,
                                float beta1, float beta2, float eps, float weight_decay,
                                int decoupled) {
  const float bc1 = -expm1f(t * logf(beta1)), bc2 = -expm1f(t * logf(beta2));
  kiln_adam(p, g, m, v, lr, beta1, beta2, eps, weight_decay, lr / bc1, sqrtf(bc2), decoupled);
}

/* found_inf: found becomes 1 where g is NaN or Inf (every such writer writes the same value) */
KILN__FN void kiln_found_inf(float g, float &found) {
  if (!isfinite(g)) found = 1.f;
}

/* Muon's momentum buffer, buf = momentum buf + g (it starts at zero) */
KILN__FN void kiln_muon_momentum(float &buf, float g, float momentum) { buf = momentum * buf + g; }

/* Muon's parameter step as torch.optim.Muon: the decoupled weight decay with the rate, then the
 * orthogonalised update x with the rate adjusted to the matrix's shape (lr scale) */
KILN__FN void kiln_muon(float &p, float x, float lr, float scale, float weight_decay) {
  if (weight_decay != 0.f) p = p * (1.f - lr * weight_decay);
  p = p - (lr * scale) * x;
}

#endif
