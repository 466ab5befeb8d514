/* LD_PRELOAD helper for bench/cpp_errors.py: on SIGSEGV/SIGABRT/SIGBUS, print the native stack to stderr, then die
 * of the same signal. Why: on the H200 image a refused call of our C++ ops crashes the process, and Python's
 * faulthandler shows only the Python frames. Built with `cc -shared -fPIC -o segv_trace.so segv_trace.c`. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig, siginfo_t *info, void *ctx) {
  (void)ctx;
  void *frames[64];
  int n = backtrace(frames, 64);
  char num[12];
  int len = 0;
  do { num[len++] = (char)('0' + sig % 10); sig /= 10; } while (sig && len < 11);
  write(2, "segv_trace: signal ", 19);
  while (len) write(2, &num[--len], 1);
  write(2, "; native frames:\n", 17);
  backtrace_symbols_fd(frames, n, 2);
  raise(info ? info->si_signo : SIGSEGV);  /* SA_RESETHAND restored the default action */
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGABRT, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
}
