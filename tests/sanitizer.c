/*
 * sanitizer.c: LeakSanitizer's suppressions for a Criterion test (KILN_SANITIZE builds link it
 * into every one), chosen by process. Criterion runs each test in a worker process of its own,
 * where every leak is reported; the runner process around them runs no test code, and keeps
 * allocations of Criterion's until exit (now and then a timeout's record), so its leaks are
 * suppressed. A suppression file could not tell the two apart: a suppression matches any frame
 * of a leak's stack, and Criterion's frames lie below every test's own.
 */
#include <criterion/criterion.h>

const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) {
  /* NULL in the runner, the test in a worker */
  return criterion_current_test ? "" : "leak:libcriterion\nleak:criterion_\nleak:cri_\n";
}
