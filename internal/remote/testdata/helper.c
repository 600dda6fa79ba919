// Test helper for package remote: a process that blocks in a known syscall (or spins in
// user code) and reports what it saw on stdout, one line per event. Built by the tests
// with gcc. Usage: helper MODE [ARG]
//   read      loop: read(0) and print "read RET ERRNO DATA" (exits at EOF)
//   sleep MS  nanosleep(MS) (raw syscall: -ERESTART_RESTARTBLOCK when interrupted),
//             print "sleep RET ERRNO ELAPSED_MS"
//   ppoll MS  ppoll(stdin, MS) (-ERESTARTNOHAND), print "ppoll RET ERRNO ELAPSED_MS"
//   sig       SA_SIGINFO handlers for SIGUSR1 and SIGRTMIN (no SA_RESTART); loop: read(0)
//             and print what the handlers saw
//   spin      spin in user code forever
//   offstack  the sig loop on an mmap'ed stack (as a thread or sigaltstack would be), so
//             the memory below rsp is not known to be dead: scratch must go elsewhere
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

static long long now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void ready(void) {
	printf("ready %d\n", getpid());
	fflush(stdout);
}

static void read_loop(void) {
	char buf[256];
	for (;;) {
		ssize_t n = read(0, buf, sizeof buf - 1);
		int e = n < 0 ? errno : 0;
		if (n > 0 && buf[n - 1] == '\n') buf[n - 1] = 0;
		else if (n >= 0) buf[n] = 0;
		else buf[0] = 0;
		printf("read %zd %d %s\n", n, e, buf);
		fflush(stdout);
		if (n == 0) exit(0);
	}
}

static volatile int usr1, usr1pid, usr1code, rt;
static volatile int rtvals[16];

static void on_sig(int sig, siginfo_t *si, void *uc) {
	(void)uc;
	if (sig == SIGUSR1) {
		usr1++;
		usr1pid = si->si_pid;
		usr1code = si->si_code;
	} else if (rt < 16) {
		rtvals[rt++] = si->si_value.sival_int;
	}
}

static void install_handlers(void) {
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_sig;
	sa.sa_flags = SA_SIGINFO;
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGRTMIN, &sa, NULL);
}

static void sig_loop(void) {
	char buf[256];
	for (;;) {
		ssize_t n = read(0, buf, sizeof buf);
		int e = n < 0 ? errno : 0;
		printf("sig usr1=%d usr1pid=%d usr1code=%d rt=%d rtvals=", usr1, usr1pid, usr1code, rt);
		for (int i = 0; i < rt; i++) printf(i ? ",%d" : "%d", rtvals[i]);
		printf(" read=%zd errno=%d\n", n, e);
		fflush(stdout);
		if (n == 0) exit(0);
	}
}

static void off_stack_body(void) { sig_loop(); }

int main(int argc, char **argv) {
	if (argc < 2) return 2;
	const char *mode = argv[1];
	long ms = argc > 2 ? atol(argv[2]) : 0;
	if (!strcmp(mode, "read")) {
		ready();
		read_loop();
	} else if (!strcmp(mode, "sleep")) {
		ready();
		struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
		long long t0 = now_ms();
		long r = syscall(SYS_nanosleep, &ts, NULL);
		int e = r < 0 ? errno : 0;
		printf("sleep %ld %d %lld\n", r, e, now_ms() - t0);
	} else if (!strcmp(mode, "ppoll")) {
		ready();
		struct pollfd p = {0, POLLIN, 0};
		struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
		long long t0 = now_ms();
		int r = ppoll(&p, 1, &ts, NULL);
		int e = r < 0 ? errno : 0;
		printf("ppoll %d %d %lld\n", r, e, now_ms() - t0);
	} else if (!strcmp(mode, "sig")) {
		install_handlers();
		ready();
		sig_loop();
	} else if (!strcmp(mode, "spin")) {
		ready();
		volatile unsigned long x = 0;
		for (;;) x++;
	} else if (!strcmp(mode, "offstack")) {
		// A 64 KiB stack above a PROT_NONE guard page, far from the main stack.
		size_t sz = 64 << 10;
		char *m = mmap(NULL, sz + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m == MAP_FAILED) return 3;
		mprotect(m, 4096, PROT_NONE);
		static ucontext_t main_uc, uc;
		getcontext(&uc);
		uc.uc_stack.ss_sp = m + 4096;
		uc.uc_stack.ss_size = sz;
		uc.uc_link = &main_uc;
		makecontext(&uc, off_stack_body, 0);
		install_handlers();
		ready();
		swapcontext(&main_uc, &uc);
	} else {
		return 2;
	}
	fflush(stdout);
	return 0;
}
