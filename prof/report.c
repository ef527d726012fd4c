/*
 * report.c: the HTML report of several traces of the same work (timeline.h): for each trace one
 * step, the one whose device span is the median of its steps; the steps' timelines one above the
 * other on one time axis (each from its step's first device record), their device time by kind
 * of kernel, and for each step its kernels by time with their share of the step, memory traffic
 * and achieved rates. One self-contained file: inline CSS and SVG, no script, nothing fetched
 * (an SVG <title> is the tooltip of each kernel). kiln_trace_report reads traces from their JSON
 * files and writes it. Host-only: no CUDA; the context only receives the error.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "timeline.h"

/* The kinds of launch, in the legend's order, with their colours (kiln__tl_group's kinds, then
 * the device records that are not kiln's kernels). */
static const struct kind_colour {
  const char *kind, *label, *colour;
} kinds[] = {
    {"gemm", "product (cuBLAS)", "#4e79a7"},
    {"conv", "implicit GEMM (conv)", "#2f6f9f"},
    {"elementwise", "elementwise", "#f28e2b"},
    {"reduction", "reduction", "#e15759"},
    {"rows", "row program", "#ff9d9a"},
    {"moments", "batch-norm sums", "#b07aa1"},
    {"window", "window (pool, im2col)", "#edc948"},
    {"update", "optimizer update", "#59a14f"},
    {"gather", "gather", "#9c755f"},
    {"augment", "augment", "#bab0ac"},
    {"memcpy", "memcpy", "#76b7b2"},
    {"memset", "memset", "#8cd17d"},
    {"other", "other kernel", "#79706e"},
};
#define NKINDS ((int)(sizeof kinds / sizeof kinds[0]))
#define IDLE_COLOUR "#e4e4e4"

static int kind_index(const kiln__tl_event *e) {
  const char *k = e->cat == KILN__TL_MEMCPY    ? "memcpy"
                  : e->cat == KILN__TL_MEMSET  ? "memset"
                  : e->group && e->group->kind ? e->group->kind
                                               : "other";
  for (int i = 0; i < NKINDS; i++)
    if (strcmp(kinds[i].kind, k) == 0) return i;
  return NKINDS - 1;
}

static void put_html(FILE *f, const char *s) {
  for (; s && *s; s++) {
    switch (*s) {
    case '&': fputs("&amp;", f); break;
    case '<': fputs("&lt;", f); break;
    case '>': fputs("&gt;", f); break;
    case '"': fputs("&quot;", f); break;
    case '\'': fputs("&#39;", f); break;
    default: fputc(*s, f);
    }
  }
}

/* A duration: "850 ns", "12.3 µs", "1.25 ms". */
static void fmt_time(char *buf, size_t n, double ns) {
  if (ns < 1e3)
    snprintf(buf, n, "%.0f ns", ns);
  else if (ns < 1e6)
    snprintf(buf, n, "%.*f \xc2\xb5s", ns < 1e4 ? 2 : ns < 1e5 ? 1 : 0, ns / 1e3);
  else
    snprintf(buf, n, "%.*f ms", ns < 1e7 ? 3 : 2, ns / 1e6);
}

static void fmt_bytes(char *buf, size_t n, double b) {
  if (b <= 0)
    snprintf(buf, n, "-");
  else if (b < 1e6)
    snprintf(buf, n, "%.1f KB", b / 1e3);
  else if (b < 1e9)
    snprintf(buf, n, "%.1f MB", b / 1e6);
  else
    snprintf(buf, n, "%.2f GB", b / 1e9);
}

static bool is_device(const kiln__tl_event *e) {
  return e->cat == KILN__TL_KERNEL || e->cat == KILN__TL_MEMCPY || e->cat == KILN__TL_MEMSET;
}

/* ---------------------------------------------------------------- one step of a run */

typedef struct step_view {
  const kiln__tl_run *run;
  const char *label;
  int64_t step;
  int nsteps;                /* steps in the trace */
  const kiln__tl_event **ev; /* its device records, by start */
  size_t n;
  uint64_t t0, t1;        /* its span */
  double busy, kernel_ns; /* time some record ran; the sum of the kernels' times */
  uint64_t bytes;         /* kiln's estimate, all groups */
  uint32_t tids[8];       /* its streams (lanes), the first 8 */
  int ntids;
  double by_kind[NKINDS];
  size_t kernels, copies;
} step_view;

static int cmp_start(const void *a, const void *b) {
  const kiln__tl_event *x = *(const kiln__tl_event *const *)a,
                       *y = *(const kiln__tl_event *const *)b;
  return (x->start > y->start) - (x->start < y->start);
}

typedef struct step_span {
  int64_t step;
  uint64_t t0, t1;
} step_span;

static int cmp_span_len(const void *a, const void *b) {
  const step_span *x = a, *y = b;
  uint64_t lx = x->t1 - x->t0, ly = y->t1 - y->t0;
  if (lx != ly) return lx < ly ? -1 : 1;
  return (x->step > y->step) - (x->step < y->step);
}

/* Picks run's median step and gathers its device records; false out of host memory. */
static bool view_of(const kiln__tl_run *run, const char *label, step_view *v) {
  memset(v, 0, sizeof *v);
  v->run = run;
  v->label = label;
  step_span *sp = malloc((run->n ? run->n : 1) * sizeof *sp);
  if (!sp) return false;
  int ns = 0;
  for (size_t i = 0; i < run->n; i++) {
    const kiln__tl_event *e = &run->ev[i];
    if (!is_device(e)) continue;
    int64_t s = e->step >= 0 ? e->step : -1;
    int k = ns - 1;
    while (k >= 0 && sp[k].step != s)
      k--;
    if (k < 0) {
      k = ns++;
      sp[k] = (step_span){s, e->start, e->end};
    }
    if (e->start < sp[k].t0) sp[k].t0 = e->start;
    if (e->end > sp[k].t1) sp[k].t1 = e->end;
  }
  /* records of no step count only when there is no step at all */
  int keep = 0;
  bool steps = false;
  for (int k = 0; k < ns; k++)
    steps |= sp[k].step >= 0;
  for (int k = 0; k < ns; k++)
    if (!steps || sp[k].step >= 0) sp[keep++] = sp[k];
  v->nsteps = steps ? keep : 0;
  if (keep == 0) {
    free(sp);
    return true; /* nothing ran on the device */
  }
  qsort(sp, (size_t)keep, sizeof *sp, cmp_span_len);
  v->step = sp[(keep - 1) / 2].step;
  free(sp);
  v->ev = malloc(run->n * sizeof *v->ev);
  if (!v->ev) return false;
  for (size_t i = 0; i < run->n; i++) {
    const kiln__tl_event *e = &run->ev[i];
    if (is_device(e) && (e->step >= 0 ? e->step : -1) == v->step) v->ev[v->n++] = e;
  }
  qsort(v->ev, v->n, sizeof *v->ev, cmp_start);
  v->t0 = v->ev[0]->start;
  uint64_t cover = v->t0; /* the union of the records' intervals, in start order */
  for (size_t i = 0; i < v->n; i++) {
    const kiln__tl_event *e = v->ev[i];
    if (e->end > v->t1) v->t1 = e->end;
    uint64_t s = e->start > cover ? e->start : cover;
    if (e->end > s) v->busy += (double)(e->end - s);
    if (e->end > cover) cover = e->end;
    double d = e->end > e->start ? (double)(e->end - e->start) : 0;
    v->by_kind[kind_index(e)] += d;
    if (e->cat == KILN__TL_KERNEL) {
      v->kernels++;
      v->kernel_ns += d;
    } else {
      v->copies++;
    }
    if (e->group && e->carrier) v->bytes += e->group->bytes_read + e->group->bytes_written;
    int t = 0;
    while (t < v->ntids && v->tids[t] != e->tid)
      t++;
    if (t == v->ntids && v->ntids < 8) v->tids[v->ntids++] = e->tid;
  }
  return true;
}

/* ---------------------------------------------------------------- the timeline */

#define SVG_W 1320
#define LABEL_W 170
#define PLOT_W (SVG_W - LABEL_W - 24)
#define LANE_H 30
#define RUN_GAP 22
#define AXIS_H 26

/* A tick step of 1, 2 or 5 times a power of ten, about span / 10. */
static double tick_step(double span) {
  double raw = span / 10, p = pow(10, floor(log10(raw > 0 ? raw : 1)));
  return raw <= p ? p : raw <= 2 * p ? 2 * p : raw <= 5 * p ? 5 * p : 10 * p;
}

static void put_tooltip(FILE *f, const kiln__tl_event *e) {
  char d[32];
  fmt_time(d, sizeof d, (double)(e->end - e->start));
  fputs("<title>", f);
  put_html(f, e->name ? e->name : "?");
  fprintf(f, "\n%s", d);
  if (e->parts > 1) fprintf(f, " (part %d of %d)", e->part, e->parts);
  if (e->kernel) {
    fputs("\nkernel: ", f);
    put_html(f, e->kernel);
  }
  const kiln__tl_group *g = e->group;
  if (g) {
    fputs("\nkind: ", f);
    put_html(f, g->kind);
    if (g->bytes_read + g->bytes_written && e->carrier) {
      char r[32], w[32];
      fmt_bytes(r, sizeof r, (double)g->bytes_read);
      fmt_bytes(w, sizeof w, (double)g->bytes_written);
      fprintf(f, "\nread %s, written %s", r, w);
      if (e->end > e->start && e->parts <= 1)
        fprintf(f, ", %.0f GB/s",
                (double)(g->bytes_read + g->bytes_written) / (double)(e->end - e->start));
    }
    if (g->nodes && *g->nodes) {
      fputs("\n", f);
      put_html(f, g->nodes);
    }
  }
  if (e->bytes) {
    char b[32];
    fmt_bytes(b, sizeof b, (double)e->bytes);
    fprintf(f, "\n%s", b);
  }
  fputs("</title>", f);
}

static void put_timeline(FILE *f, const step_view *v, int nv) {
  double smax = 1;
  int lanes = 0;
  for (int r = 0; r < nv; r++) {
    if (v[r].n && (double)(v[r].t1 - v[r].t0) > smax) smax = (double)(v[r].t1 - v[r].t0);
    lanes += v[r].ntids ? v[r].ntids : 1;
  }
  int h = AXIS_H + lanes * LANE_H + nv * RUN_GAP + AXIS_H;
  fprintf(f,
          "<svg class=\"timeline\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 %d %d\" "
          "width=\"%d\" height=\"%d\" font-family=\"system-ui, sans-serif\" font-size=\"11\">\n",
          SVG_W, h, SVG_W, h);
  /* the axis: ticks and grid lines over the whole height */
  double step = tick_step(smax);
  /* the ticks in one unit, with the decimals the step needs */
  double unit = step >= 1e6 ? 1e6 : step >= 1e3 ? 1e3 : 1;
  const char *uname = unit == 1e6 ? "ms" : unit == 1e3 ? "\xc2\xb5s" : "ns";
  int dec = step / unit >= 1 ? 0 : step / unit >= 0.1 ? 1 : 2;
  for (double t = 0; t <= smax * 1.0001; t += step) {
    double x = LABEL_W + t / smax * PLOT_W;
    char lab[32];
    snprintf(lab, sizeof lab, "%.*f %s", dec, t / unit, uname);
    fprintf(f,
            "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#ddd\"/>"
            "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\" fill=\"#555\">%s</text>"
            "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\" fill=\"#555\">%s</text>\n",
            x, AXIS_H - 6, x, h - AXIS_H + 6, x, AXIS_H - 10, t == 0 ? "0" : lab, x, h - 4,
            t == 0 ? "0" : lab);
  }
  int y = AXIS_H;
  for (int r = 0; r < nv; r++) {
    const step_view *s = &v[r];
    y += RUN_GAP / 2;
    int nl = s->ntids ? s->ntids : 1;
    char span[32];
    fmt_time(span, sizeof span, (double)(s->t1 - s->t0));
    fprintf(f, "<text x=\"4\" y=\"%d\" font-weight=\"600\" font-size=\"13\">", y + 12);
    put_html(f, s->label);
    fprintf(f, "</text><text x=\"4\" y=\"%d\" fill=\"#555\">", y + 26);
    if (s->n)
      fprintf(f, "step %" PRId64 ": %s", s->step, span);
    else
      fputs("no device records", f);
    fputs("</text>\n", f);
    fprintf(f,
            "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"#f4f4f4\" "
            "stroke=\"#ccc\"/>\n",
            LABEL_W, y, s->n ? (double)(s->t1 - s->t0) / smax * PLOT_W : 0.0, nl * LANE_H);
    for (size_t i = 0; i < s->n; i++) {
      const kiln__tl_event *e = s->ev[i];
      int lane = 0;
      while (lane < s->ntids && s->tids[lane] != e->tid)
        lane++;
      if (lane == s->ntids) lane = 0;
      double x = LABEL_W + (double)(e->start - s->t0) / smax * PLOT_W;
      double w = (double)(e->end - e->start) / smax * PLOT_W;
      if (w < 0.6) w = 0.6; /* every record stays visible */
      int ly = y + lane * LANE_H + 3;
      fprintf(f, "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\">", x, ly, w,
              LANE_H - 6, kinds[kind_index(e)].colour);
      put_tooltip(f, e);
      fputs("</rect>\n", f);
      size_t fit = (size_t)(w / 6.3);
      if (fit >= 6 && e->name) { /* a label where it fits */
        size_t len = strlen(e->name);
        fprintf(f, "<text x=\"%.2f\" y=\"%d\" fill=\"#fff\" pointer-events=\"none\">", x + 3,
                ly + LANE_H / 2);
        char buf[256];
        snprintf(buf, sizeof buf, "%.*s%s", (int)(len > fit ? fit - 1 : len), e->name,
                 len > fit ? "\xe2\x80\xa6" : "");
        put_html(f, buf);
        fputs("</text>\n", f);
      }
    }
    y += nl * LANE_H + RUN_GAP / 2;
  }
  fputs("</svg>\n", f);
}

/* Each step's device time by kind, as stacked bars on the timeline's scale, and the legend. */
static void put_kinds(FILE *f, const step_view *v, int nv) {
  double smax = 1;
  for (int r = 0; r < nv; r++)
    if (v[r].n && (double)(v[r].t1 - v[r].t0) > smax) smax = (double)(v[r].t1 - v[r].t0);
  int bar = 18, h = nv * (bar + 8) + 8;
  fprintf(f,
          "<svg class=\"kinds\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 %d %d\" "
          "width=\"%d\" height=\"%d\" font-family=\"system-ui, sans-serif\" font-size=\"11\">\n",
          SVG_W, h, SVG_W, h);
  for (int r = 0; r < nv; r++) {
    int y = 4 + r * (bar + 8);
    fprintf(f, "<text x=\"4\" y=\"%d\">", y + 13);
    put_html(f, v[r].label);
    fputs("</text>\n", f);
    double x = LABEL_W;
    for (int k = 0; k < NKINDS; k++) {
      if (v[r].by_kind[k] <= 0) continue;
      double w = v[r].by_kind[k] / smax * PLOT_W;
      char t[32];
      fmt_time(t, sizeof t, v[r].by_kind[k]);
      fprintf(f,
              "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\"><title>%s: %s "
              "(%.1f%% of the step)</title></rect>\n",
              x, y, w, bar, kinds[k].colour, kinds[k].label, t,
              100 * v[r].by_kind[k] / (double)(v[r].t1 - v[r].t0));
      x += w;
    }
    /* the rest of the span: nothing ran (the bar ends where the step's timeline does, when
     * records do not overlap) */
    double span = v[r].n ? (double)(v[r].t1 - v[r].t0) : 0, idle = span - v[r].busy;
    char t[32];
    if (idle > 0) {
      fmt_time(t, sizeof t, idle);
      fprintf(f,
              "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\"><title>nothing "
              "running: %s (%.1f%% of the step)</title></rect>\n",
              x, y, idle / smax * PLOT_W, bar, IDLE_COLOUR, t, 100 * idle / span);
      x += idle / smax * PLOT_W;
    }
    fmt_time(t, sizeof t, span);
    if (v[r].n && x + 200 < SVG_W)
      fprintf(f, "<text x=\"%.1f\" y=\"%d\" fill=\"#555\">%s, %.1f%% busy</text>\n", x + 6, y + 13,
              t, 100 * v[r].busy / span);
  }
  fputs("</svg>\n<div class=\"legend\">", f);
  for (int k = 0; k < NKINDS; k++) {
    bool used = false;
    for (int r = 0; r < nv; r++)
      used |= v[r].by_kind[k] > 0;
    if (used)
      fprintf(f, "<span><i style=\"background:%s\"></i>%s</span>", kinds[k].colour, kinds[k].label);
  }
  fprintf(f, "<span><i style=\"background:%s\"></i>nothing running</span></div>\n", IDLE_COLOUR);
}

/* ---------------------------------------------------------------- tables */

typedef struct kernel_row {
  const char *name;
  const kiln__tl_event *first;
  int kind;
  size_t launches;
  double ns;
  uint64_t bytes, flops;
} kernel_row;

static int cmp_row(const void *a, const void *b) {
  const kernel_row *x = a, *y = b;
  if (x->ns != y->ns) return x->ns > y->ns ? -1 : 1;
  return strcmp(x->name, y->name);
}

#define TOP_ROWS 15

static bool put_table(FILE *f, const step_view *v) {
  kernel_row *rows = calloc(v->n ? v->n : 1, sizeof *rows);
  if (!rows) return false;
  size_t nr = 0;
  for (size_t i = 0; i < v->n; i++) {
    const kiln__tl_event *e = v->ev[i];
    const char *name = e->name ? e->name : "?";
    size_t k = 0;
    while (k < nr && strcmp(rows[k].name, name) != 0)
      k++;
    if (k == nr) rows[nr++] = (kernel_row){.name = name, .first = e, .kind = kind_index(e)};
    kernel_row *r = &rows[k];
    /* a launch once: at its first record, or at its first kernel where memory was set before
     * it (memsets have rows of their own) */
    if (e->part <= 1 || (e->carrier && e->cat == KILN__TL_KERNEL)) r->launches++;
    r->ns += (double)(e->end - e->start);
    if (e->group && e->carrier) {
      r->bytes += e->group->bytes_read + e->group->bytes_written;
      r->flops += e->group->flops;
    }
    if (e->cat != KILN__TL_KERNEL) r->bytes += e->bytes;
  }
  qsort(rows, nr, sizeof *rows, cmp_row);
  double span = v->n ? (double)(v->t1 - v->t0) : 1;
  char t[32], b[32], busy[32], tk[32], moved[32];
  fmt_time(t, sizeof t, span);
  fmt_time(busy, sizeof busy, v->busy);
  fmt_time(tk, sizeof tk, v->kernel_ns);
  fmt_bytes(moved, sizeof moved, (double)v->bytes);
  fputs("<div class=\"run\"><h2>", f);
  put_html(f, v->label);
  fputs("</h2>\n<p>", f);
  if (v->n)
    fprintf(f,
            "step %" PRId64 " (the median of %d): %s from its first device record to its last; "
            "%zu kernels (%s), %zu copies and memsets; the device busy %s (%.1f%%); kiln's "
            "kernels move %s.",
            v->step, v->nsteps, t, v->kernels, tk, v->copies, busy, 100 * v->busy / span, moved);
  else
    fputs("no device records.", f);
  fputs("</p>\n<table><tr><th>#</th><th "
        "class=\"name\">kernel</th><th>launches</th><th>time</th><th>share</th>"
        "<th>memory</th><th>GB/s</th><th>TFLOP/s</th></tr>\n",
        f);
  double rest = 0;
  size_t rest_n = 0;
  for (size_t k = 0; k < nr; k++) {
    const kernel_row *r = &rows[k];
    if (k >= TOP_ROWS) {
      rest += r->ns;
      rest_n += r->launches;
      continue;
    }
    fmt_time(t, sizeof t, r->ns);
    fmt_bytes(b, sizeof b, (double)r->bytes);
    fprintf(f, "<tr><td>%zu</td><td class=\"name\"><i style=\"background:%s\"></i><span title=\"",
            k + 1, kinds[r->kind].colour);
    put_html(f, r->name);
    if (r->first->group && r->first->group->nodes) {
      fputs("\n", f);
      put_html(f, r->first->group->nodes);
    }
    fputs("\">", f);
    char shown[64];
    size_t len = strlen(r->name);
    snprintf(shown, sizeof shown, "%.*s%s", (int)(len > 52 ? 51 : len), r->name,
             len > 52 ? "\xe2\x80\xa6" : "");
    put_html(f, shown);
    fprintf(f, "</span></td><td>%zu</td><td>%s</td><td>%.1f%%</td><td>%s</td>", r->launches, t,
            100 * r->ns / span, b);
    if (r->bytes && r->ns > 0)
      fprintf(f, "<td>%.0f</td>", (double)r->bytes / r->ns);
    else
      fputs("<td>-</td>", f);
    if (r->flops && r->ns > 0)
      fprintf(f, "<td>%.1f</td></tr>\n", (double)r->flops / r->ns / 1e3);
    else
      fputs("<td>-</td></tr>\n", f);
  }
  if (rest_n) {
    fmt_time(t, sizeof t, rest);
    fprintf(f,
            "<tr class=\"rest\"><td></td><td>%zu other kernels</td><td>%zu</td><td>%s</td>"
            "<td>%.1f%%</td><td></td><td></td><td></td></tr>\n",
            nr - TOP_ROWS, rest_n, t, 100 * rest / span);
  }
  fputs("</table></div>\n", f);
  free(rows);
  return true;
}

static const char *style =
    "body{font-family:system-ui,sans-serif;margin:16px 20px;color:#222;font-size:13px}"
    "h1{font-size:19px;margin:0 0 4px}h2{font-size:15px;margin:8px 0 4px}"
    "p.sub{color:#555;margin:0 0 10px}"
    "table{border-collapse:collapse;font-size:12px}"
    "td,th{padding:2px 7px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}"
    "th{background:#f4f4f4}th.name{text-align:left}"
    "td.name{text-align:left;font-family:ui-monospace,monospace}"
    "td.name i,.legend i{display:inline-block;width:10px;height:10px;margin-right:5px;"
    "vertical-align:-1px}"
    "tr.rest td{color:#777}.legend{margin:4px 0 12px 170px}.legend span{margin-right:14px;"
    "white-space:nowrap}"
    ".runs{display:flex;flex-wrap:wrap;gap:8px 28px}.run p{max-width:640px;color:#444}";

bool kiln__tl_report(FILE *f, const char *title, const kiln__tl_run *runs, int nruns) {
  step_view *v = calloc((size_t)(nruns > 0 ? nruns : 1), sizeof *v);
  bool ok = v != NULL;
  for (int r = 0; r < nruns && ok; r++)
    ok = view_of(&runs[r], runs[r].title ? runs[r].title : "trace", &v[r]);
  if (ok) {
    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>", f);
    put_html(f, title);
    fprintf(f, "</title>\n<style>%s</style></head><body>\n<h1>", style);
    put_html(f, title);
    fputs("</h1>\n<p class=\"sub\">One step of each trace (the one whose device span is the median "
          "of its steps), on one time axis from the step's first device record. Hover a kernel "
          "for its trace nodes, traffic and rate. Memory traffic is kiln's estimate for its "
          "kernels (each input element counted once) and the operands of its products.",
          f);
    const char *dev = NULL;
    for (int r = 0; r < nruns && !dev; r++)
      dev = runs[r].device;
    if (dev) {
      fputs(" Device: ", f);
      put_html(f, dev);
      fputs(".", f);
    }
    fputs("</p>\n", f);
    put_timeline(f, v, nruns);
    fputs("<p class=\"sub\">The same steps' device time by kind of launch, on the same scale, "
          "then the time nothing ran:</p>\n",
          f);
    put_kinds(f, v, nruns);
    fputs("<div class=\"runs\">\n", f);
    for (int r = 0; r < nruns && ok; r++)
      ok = put_table(f, &v[r]);
    fputs("</div>\n</body></html>\n", f);
  }
  for (int r = 0; v && r < nruns; r++)
    free(v[r].ev);
  free(v);
  return ok && fflush(f) == 0 && !ferror(f);
}

kiln_status kiln_trace_report(kiln_ctx *ctx, const char *html_path, const char *title, int n,
                              const char *const *trace_paths, const char *const *labels) {
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  if (!html_path || n < 1 || n > 64 || !trace_paths)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_trace_report: %s (an HTML path and 1 to 64 trace paths)",
                       !html_path     ? "no HTML path"
                       : !trace_paths ? "no trace paths"
                                      : "bad count");
  kiln__tl_run *runs = calloc((size_t)n, sizeof *runs);
  if (!runs) return kiln__error(ctx, KILN_ERR_OOM, "kiln_trace_report: out of host memory");
  kiln_status s = KILN_OK;
  for (int r = 0; r < n && s == KILN_OK; r++) {
    char why[512];
    if (!trace_paths[r])
      s = kiln__error(ctx, KILN_ERR_INVALID, "kiln_trace_report: trace path %d is NULL", r);
    else if (!kiln__tl_read_json(trace_paths[r], &runs[r], why, sizeof why))
      s = kiln__error(ctx, KILN_ERR_FORMAT, "kiln_trace_report: %s", why);
    else if (labels && labels[r]) {
      char *t = kiln__strf("%s", labels[r]);
      if (t) {
        free(runs[r].title);
        runs[r].title = t;
      }
    }
  }
  if (s == KILN_OK) {
    FILE *f = fopen(html_path, "w");
    if (!f) {
      s = kiln__error(ctx, KILN_ERR_IO, "kiln_trace_report: %s cannot be written", html_path);
    } else {
      bool ok = kiln__tl_report(f, title ? title : "kiln: step timelines", runs, n);
      if (fclose(f) != 0 || !ok)
        s = kiln__error(ctx, KILN_ERR_IO, "kiln_trace_report: writing %s failed", html_path);
    }
  }
  for (int r = 0; r < n; r++)
    kiln__tl_run_free(&runs[r]);
  free(runs);
  return s;
}
