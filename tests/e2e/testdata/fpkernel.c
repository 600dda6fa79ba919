// Subject of tests/e2e/fastpath_kernel_test.go: a session process holding what fork does
// not copy or would share, so that a checkpoint and a restore of it can be checked.
//
// Started in a bash session with `export __db_id; exec /workspace/fpkernel`, it takes the
// shell's place (same PID, same terminal) and speaks the session protocol itself: it reads
// the lines the daemon types (" __db_b=$'...'", " __db_b+=$'...'", " __db_id=ID;
// __db_c=$'...' ..."; internal/session/bash.go), runs the decoded command and answers with
// its output and the sentinel "\x1eDBX:ID:0\x1e". Built with gcc -static (the sandbox's
// image has its own libc).
//
// It holds: /workspace/fpk-r.txt open for reading and /workspace/fpk-w.txt for writing, at
// known offsets; a 4 KiB MAP_SHARED PROT_WRITE mapping of /workspace/fpk-map.bin (its fd
// closed); ITIMER_REAL (250 ms) and ITIMER_VIRTUAL (100 ms) interval timers; POSIX timer
// 1 (CLOCK_MONOTONIC, SIGRTMIN+1, 300 ms; timer 0 was deleted) and timer 2 (SIGRTMIN+3,
// blocked, fired once: its signal pending); SIGUSR1 (kill) and SIGRTMIN+2 (sigqueue
// values 21, 22) pending and blocked. Commands:
//   state          one line: offsets, mapping, timers, counts, pending set, pid
//   change TEXT    read a byte, write TEXT to fpk-w.txt, write TEXT into the mapping
//   mapwrite TEXT  write TEXT into the mapping
//   unblock        unblock the pending signals; answer what the handlers saw
//   waitreal, waitpt, spin
//                  wait (2 s at most) for the next SIGALRM / timer 1 signal, or burn CPU
//                  until the next SIGVTALRM; answer "fired" or "timeout"
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define MAPLEN 4096

static volatile int alrm, vt, pt1, usr1, rt2n, pt3, pt3tid;
static volatile long pt3val;
static volatile int rt2[8];
static int fdr, fdw;
static char *map;
static timer_t t1;

static void on_sig(int sig, siginfo_t *si, void *uc) {
	(void)uc;
	if (sig == SIGALRM) alrm++;
	else if (sig == SIGVTALRM) vt++;
	else if (sig == SIGUSR1) usr1++;
	else if (sig == SIGRTMIN + 1) pt1++;
	else if (sig == SIGRTMIN + 2) {
		if (rt2n < 8) rt2[rt2n++] = si->si_value.sival_int;
	} else if (sig == SIGRTMIN + 3) {
		pt3++;
		pt3tid = si->si_timerid;
		pt3val = (long)si->si_value.sival_ptr;
	}
}

static sigset_t blocked(void) {
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGUSR1);
	sigaddset(&s, SIGRTMIN + 2);
	sigaddset(&s, SIGRTMIN + 3);
	return s;
}

static long usec(struct timeval tv) { return tv.tv_sec * 1000000L + tv.tv_usec; }
static long nsec(struct timespec ts) { return ts.tv_sec * 1000000000L + ts.tv_nsec; }

static void die(const char *what) {
	perror(what);
	exit(1);
}

static void setup(void) {
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_sig;
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	int sigs[] = {SIGALRM, SIGVTALRM, SIGUSR1, SIGRTMIN + 1, SIGRTMIN + 2, SIGRTMIN + 3};
	for (unsigned i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
		if (sigaction(sigs[i], &sa, NULL)) die("sigaction");

	char buf[5];
	if ((fdr = open("/workspace/fpk-r.txt", O_RDONLY)) < 0 || read(fdr, buf, 5) != 5) die("fpk-r.txt");
	if ((fdw = open("/workspace/fpk-w.txt", O_WRONLY | O_CREAT | O_TRUNC, 0644)) < 0 || write(fdw, "start\n", 6) != 6) die("fpk-w.txt");
	int fdm = open("/workspace/fpk-map.bin", O_RDWR | O_CREAT, 0644);
	if (fdm < 0 || ftruncate(fdm, MAPLEN)) die("fpk-map.bin");
	map = mmap(NULL, MAPLEN, PROT_READ | PROT_WRITE, MAP_SHARED, fdm, 0);
	if (map == MAP_FAILED) die("mmap");
	close(fdm);
	strcpy(map, "map-start");

	struct itimerval real = {{0, 250000}, {0, 250000}}, virt = {{0, 100000}, {0, 100000}};
	if (setitimer(ITIMER_REAL, &real, NULL) || setitimer(ITIMER_VIRTUAL, &virt, NULL)) die("setitimer");

	sigset_t b = blocked();
	sigprocmask(SIG_BLOCK, &b, NULL);
	struct sigevent ev;
	memset(&ev, 0, sizeof ev);
	ev.sigev_notify = SIGEV_SIGNAL;
	ev.sigev_signo = SIGRTMIN + 1;
	ev.sigev_value.sival_ptr = (void *)0x51;
	timer_t t0, t2;
	if (timer_create(CLOCK_MONOTONIC, &ev, &t0) || timer_create(CLOCK_MONOTONIC, &ev, &t1) || timer_delete(t0)) die("timer_create");
	struct itimerspec its = {{0, 300000000}, {0, 300000000}};
	if (timer_settime(t1, 0, &its, NULL)) die("timer_settime");
	ev.sigev_signo = SIGRTMIN + 3;
	ev.sigev_value.sival_ptr = (void *)0x53;
	if (timer_create(CLOCK_MONOTONIC, &ev, &t2)) die("timer_create 2");
	struct itimerspec once = {{0, 0}, {0, 1000000}};
	if (timer_settime(t2, 0, &once, NULL)) die("timer_settime 2");
	kill(getpid(), SIGUSR1);
	union sigval v;
	v.sival_int = 21;
	sigqueue(getpid(), SIGRTMIN + 2, v);
	v.sival_int = 22;
	sigqueue(getpid(), SIGRTMIN + 2, v);
	for (int i = 0; i < 200; i++) { // timer 2's signal, pending
		sigset_t p;
		sigpending(&p);
		if (sigismember(&p, SIGRTMIN + 3) == 1) break;
		usleep(1000);
	}
}

static void state(void) {
	struct itimerval real, virt;
	getitimer(ITIMER_REAL, &real);
	getitimer(ITIMER_VIRTUAL, &virt);
	struct itimerspec p1, p2;
	int ok1 = timer_gettime(t1, &p1) == 0, ok2 = timer_gettime((timer_t)2, &p2) == 0;
	sigset_t p;
	sigpending(&p);
	unsigned long long bits = 0;
	for (int s = 1; s <= 64; s++)
		if (sigismember(&p, s) == 1) bits |= 1ULL << (s - 1);
	char m[17];
	memcpy(m, map, 16);
	m[16] = 0;
	printf("rd=%ld wr=%ld map=%s real=%ld/%ld virt=%ld/%ld pt=%ld:%ld/%ld timers=%d,%d alrm=%d vt=%d pt1=%d pend=%llx pid=%d\n",
	       (long)lseek(fdr, 0, SEEK_CUR), (long)lseek(fdw, 0, SEEK_CUR), m,
	       usec(real.it_value), usec(real.it_interval), usec(virt.it_value), usec(virt.it_interval),
	       (long)t1, ok1 ? nsec(p1.it_value) : -1, ok1 ? nsec(p1.it_interval) : -1, ok1, ok2,
	       alrm, vt, pt1, bits, getpid());
}

static int wait_for(volatile int *counter, int spin) {
	int start = *counter;
	struct timespec t0, now;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		if (*counter != start) return 1;
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (nsec(now) - nsec(t0) > 2000000000L) return 0;
		if (!spin) usleep(1000);
	}
}

static void run(char *cmd) {
	char *arg = strchr(cmd, ' ');
	if (arg) *arg++ = 0;
	if (!strcmp(cmd, "state")) {
		state();
	} else if (!strcmp(cmd, "change") && arg) {
		char c;
		if (read(fdr, &c, 1) != 1 || write(fdw, arg, strlen(arg)) < 0) printf("io error\n");
		memset(map, 0, 16);
		strncpy(map, arg, 16);
		state();
	} else if (!strcmp(cmd, "mapwrite") && arg) {
		memset(map, 0, 16);
		strncpy(map, arg, 16);
		printf("ok\n");
	} else if (!strcmp(cmd, "unblock")) {
		sigset_t b = blocked();
		sigprocmask(SIG_UNBLOCK, &b, NULL);
		printf("usr1=%d rt2=", usr1);
		for (int i = 0; i < rt2n; i++) printf(i ? ",%d" : "%d", rt2[i]);
		printf(" pt3=%d pt3tid=%d pt3val=%lx\n", pt3, pt3tid, pt3val);
	} else if (!strcmp(cmd, "waitreal")) {
		printf(wait_for(&alrm, 0) ? "fired\n" : "timeout\n");
	} else if (!strcmp(cmd, "waitpt")) {
		printf(wait_for(&pt1, 0) ? "fired\n" : "timeout\n");
	} else if (!strcmp(cmd, "spin")) {
		printf(wait_for(&vt, 1) ? "fired\n" : "timeout\n");
	} else {
		printf("unknown command %s\n", cmd);
	}
}

static int hex(int c) {
	if (c >= '0' && c <= '9') return c - '0';
	if (c >= 'a' && c <= 'f') return c - 'a' + 10;
	return 0;
}

// unquote appends to out (n bytes so far, size cap) the body of the $'...' word that
// starts after the first "$'" in s, decoded as bash decodes what the daemon sends: \n,
// \xHH, every other byte as itself.
static size_t unquote(const char *s, char *out, size_t n, size_t cap) {
	s = strstr(s, "$'");
	if (!s) return n;
	for (s += 2; *s && *s != '\'' && n + 1 < cap;) {
		if (s[0] == '\\' && s[1] == 'n') {
			out[n++] = '\n';
			s += 2;
		} else if (s[0] == '\\' && s[1] == 'x' && s[2] && s[3]) {
			out[n++] = (char)(hex(s[2]) << 4 | hex(s[3]));
			s += 4;
		} else {
			out[n++] = *s++;
		}
	}
	return n;
}

static void sentinel(const char *id) {
	printf("\036DBX:%s:0\036", id);
	fflush(stdout);
}

int main(void) {
	setup();
	setvbuf(stdout, NULL, _IOFBF, 1 << 16);
	const char *id = getenv("__db_id");
	sentinel(id ? id : "ready");
	static char line[1 << 16], cmd[1 << 16];
	size_t n = 0;
	while (fgets(line, sizeof line, stdin)) {
		line[strcspn(line, "\r\n")] = 0;
		if (!strncmp(line, " __db_b=", 8)) {
			n = unquote(line, cmd, 0, sizeof cmd);
		} else if (!strncmp(line, " __db_b+=", 9)) {
			n = unquote(line, cmd, n, sizeof cmd);
		} else if (!strncmp(line, " __db_id=", 9)) {
			char *rid = line + 9, *code = strchr(rid, ';');
			if (!code) continue;
			*code++ = 0;
			if (!strstr(code, "$__db_b")) n = 0;
			n = unquote(code, cmd, n, sizeof cmd);
			cmd[n] = 0;
			n = 0;
			run(cmd);
			sentinel(rid);
		}
	}
	return 0;
}
