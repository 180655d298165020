/* LD_PRELOAD'ed on a machine without gdb: on SIGSEGV/SIGBUS/SIGABRT it prints the native backtrace (dladdr
 * names each frame's shared object and nearest exported symbol) to stderr, then re-raises the signal so the
 * process still dies of it (Python's faulthandler, chained after, prints the Python frames).
 *   gcc -shared -fPIC -O0 -o /tmp/segv_backtrace.so scripts/diagnostics/segv_backtrace.c -ldl
 *   LD_PRELOAD=/tmp/segv_backtrace.so python3 -X faulthandler ... */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig, siginfo_t *info, void *context) {
    (void)context;
    void *frames[64];
    int num_frames = backtrace(frames, 64);
    fprintf(stderr, "segv_backtrace: signal %d (%s) at address %p, %d frames\n", sig, strsignal(sig),
            info ? info->si_addr : NULL, num_frames);
    for (int i = 0; i < num_frames; i++) {
        Dl_info where;
        if (dladdr(frames[i], &where) && where.dli_fname) {
            fprintf(stderr, "  #%02d %p %s(%s+0x%lx) [base+0x%lx]\n", i, frames[i], where.dli_fname,
                    where.dli_sname ? where.dli_sname : "?",
                    (unsigned long)((char *)frames[i] - (char *)(where.dli_saddr ? where.dli_saddr : where.dli_fbase)),
                    (unsigned long)((char *)frames[i] - (char *)where.dli_fbase));
        } else {
            fprintf(stderr, "  #%02d %p ?\n", i, frames[i]);
        }
    }
    fflush(stderr);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_RESETHAND;
    sigaction(SIGSEGV, &action, NULL);
    sigaction(SIGBUS, &action, NULL);
}
