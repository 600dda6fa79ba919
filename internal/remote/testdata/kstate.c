// Test subject for the timer and signal wrappers of package remote: what fork does not
// copy (POSIX timers, pending signals). Reads commands on stdin, one per line, and
// answers one line each:
//   block     block SIGUSR1, SIGUSR2, SIGRTMIN and SIGRTMIN+1
//   unblock   unblock them (pending ones are delivered), then answer like state
//   timer     create two POSIX timers (CLOCK_MONOTONIC, SIGRTMIN+1, value 0xabc), delete
//             the first, arm the second for 100 s; answer "timer ID"
//   state     "usr1=N usr1pid=P usr1code=C usr2=N usr2code=C rt=V,V.. rt1=N rt1tid=T
//             rt1val=V pend=HEX"
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile int usr1, usr1pid, usr1code, usr2, usr2code, rt, rt1, rt1tid;
static volatile long rt1val;
static volatile int rtvals[16];

static void on_sig(int sig, siginfo_t *si, void *uc) {
	(void)uc;
	if (sig == SIGUSR1) {
		usr1++;
		usr1pid = si->si_pid;
		usr1code = si->si_code;
	} else if (sig == SIGUSR2) {
		usr2++;
		usr2code = si->si_code;
	} else if (sig == SIGRTMIN) {
		if (rt < 16) rtvals[rt++] = si->si_value.sival_int;
	} else if (sig == SIGRTMIN + 1) {
		rt1++;
		rt1tid = si->si_timerid;
		rt1val = (long)si->si_value.sival_ptr;
	}
}

static sigset_t set(void) {
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGUSR1);
	sigaddset(&s, SIGUSR2);
	sigaddset(&s, SIGRTMIN);
	sigaddset(&s, SIGRTMIN + 1);
	return s;
}

static void state(void) {
	sigset_t p;
	sigpending(&p);
	unsigned long long bits = 0;
	for (int s = 1; s <= 64; s++)
		if (sigismember(&p, s) == 1) bits |= 1ULL << (s - 1);
	printf("usr1=%d usr1pid=%d usr1code=%d usr2=%d usr2code=%d rt=", usr1, usr1pid, usr1code, usr2, usr2code);
	for (int i = 0; i < rt; i++) printf(i ? ",%d" : "%d", rtvals[i]);
	printf(" rt1=%d rt1tid=%d rt1val=%lx pend=%llx\n", rt1, rt1tid, rt1val, bits);
}

int main(void) {
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_sig;
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGUSR2, &sa, NULL);
	sigaction(SIGRTMIN, &sa, NULL);
	sigaction(SIGRTMIN + 1, &sa, NULL);
	setvbuf(stdout, NULL, _IOLBF, 0);
	printf("ready %d\n", getpid());
	char line[256];
	while (fgets(line, sizeof line, stdin)) {
		sigset_t s = set();
		if (!strncmp(line, "block", 5)) {
			sigprocmask(SIG_BLOCK, &s, NULL);
			printf("ok\n");
		} else if (!strncmp(line, "unblock", 7)) {
			sigprocmask(SIG_UNBLOCK, &s, NULL);
			state();
		} else if (!strncmp(line, "timer", 5)) {
			struct sigevent ev;
			memset(&ev, 0, sizeof ev);
			ev.sigev_notify = SIGEV_SIGNAL;
			ev.sigev_signo = SIGRTMIN + 1;
			ev.sigev_value.sival_ptr = (void *)0xabc;
			timer_t a, b;
			if (timer_create(CLOCK_MONOTONIC, &ev, &a) || timer_create(CLOCK_MONOTONIC, &ev, &b) || timer_delete(a)) {
				printf("timer error\n");
				continue;
			}
			struct itimerspec its = {{100, 0}, {100, 0}};
			timer_settime(b, 0, &its, NULL);
			printf("timer %ld\n", (long)b);
		} else {
			state();
		}
	}
	return 0;
}
