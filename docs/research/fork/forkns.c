// forkns: design spike for DeltaBox fork (issue 26). Run as root (see README.md).
//
// A "family" is one user namespace U_S (root = host uid 100000) owning one PID
// namespace P_S (the holder) whose only members are the family init (finit) and
// templates. A 50 MB python3 is started in P_S (where a sandbox's processes live
// today), a template is forked from it by ptrace-injected clone3, and the template
// is then forked into N sibling PID namespaces P_live_i (children of P_S, each with
// its own user, mount, net, IPC and UTS namespaces and its own PID 1) with clone3
// set_tid = the python's PID: branch 0 is the source's new home, 1..N-1 the branches.
//
//   forkns fanout N      the fast path, timed, then ps and isolation checks
//   forkns attack        run inside a branch: what it can see, signal, ptrace
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TOP "/tmp/forkspike"
#define UIDBASE 100000

static void die(const char *m) { perror(m); exit(1); }
static double now_ms(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}
static void writefile(const char *p, const char *s) {
	int fd = open(p, O_WRONLY);
	if (fd < 0 || write(fd, s, strlen(s)) != (ssize_t)strlen(s)) {
		fprintf(stderr, "write %s: %s\n", p, strerror(errno));
		exit(1);
	}
	close(fd);
}
static int pidfd_open_(pid_t p) { return syscall(SYS_pidfd_open, p, 0); }

// ---- fd passing between the daemon and finit ----
static void send_fd(int sock, int val, int fd) {
	char cbuf[CMSG_SPACE(sizeof(int))] = {0};
	struct iovec iov = {&val, sizeof val};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
	if (fd >= 0) {
		m.msg_control = cbuf;
		m.msg_controllen = sizeof cbuf;
		struct cmsghdr *c = CMSG_FIRSTHDR(&m);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(c), &fd, sizeof fd);
	}
	if (sendmsg(sock, &m, 0) < 0) die("sendmsg");
}
static int recv_fd(int sock, int *val) {
	char cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec iov = {val, sizeof *val};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
	if (recvmsg(sock, &m, 0) <= 0) die("recvmsg");
	struct cmsghdr *c = CMSG_FIRSTHDR(&m);
	int fd = -1;
	if (c && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof fd);
	return fd;
}
// host pid of a pidfd, from its fdinfo
static pid_t pidfd_pid(int pfd) {
	char p[64], line[256];
	snprintf(p, sizeof p, "/proc/self/fdinfo/%d", pfd);
	FILE *f = fopen(p, "r");
	pid_t r = -1;
	while (f && fgets(line, sizeof line, f))
		if (sscanf(line, "Pid: %d", &r) == 1) break;
	if (f) fclose(f);
	return r;
}

// ---- the family init (PID 1 of P_S) and the branch inits (PID 1 of P_live_i) ----
static char stack[8][1 << 16];
static int syncpipe[2], readypipe[2];
static int branch_index;

static int branch_init(void *arg) {
	(void)arg;
	char c = 'm';
	// finit is not dumpable, nor are we (inherited): /proc/self would be host root's and
	// finit could not write our uid_map. Be dumpable until mapped, then not again.
	prctl(PR_SET_DUMPABLE, 1);
	if (write(readypipe[1], &c, 1) != 1) _exit(1);
	if (read(syncpipe[0], &c, 1) != 1) _exit(1);
	if (setresgid(0, 0, 0) || setresuid(0, 0, 0)) _exit(2);
	prctl(PR_SET_DUMPABLE, 0);
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) _exit(3);
	// a /proc of this PID namespace: the parent's proc is fully visible, so a proc
	// instance may be mounted from a child user namespace (mount_too_revealing)
	if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL)) _exit(4);
	char src[128];
	snprintf(src, sizeof src, TOP "/b%d", branch_index);
	if (mount(src, TOP "/io", NULL, MS_BIND, NULL)) _exit(5);
	sethostname("branch", 6);
	c = 'r';
	if (write(readypipe[1], &c, 1) != 1) _exit(6);
	for (;;)
		if (waitpid(-1, NULL, __WALL) < 0 && errno == ECHILD) pause();
}

static const char *PY =
    "import os\n"
    "os.dup2(os.open('" TOP "/io/in', os.O_RDWR), 10)\n"
    "os.dup2(os.open('" TOP "/io/out', os.O_RDWR), 11)\n"
    "buf = bytearray(os.urandom(1 << 20)) * 50\n"
    "d = {i: str(i) for i in range(10000)}\n"
    "n = 0\n"
    "while True:\n"
    "    cmd = os.read(10, 64).strip()\n"
    "    n += 1\n"
    "    os.write(11, b'pid=%d ppid=%d n=%d mb=%d host=%s %s\\n' % (os.getpid(), os.getppid(), n, len(buf) >> 20, os.uname().nodename.encode(), cmd))\n";

static int family_init(void *arg) {
	int sock = *(int *)arg;
	char c;
	if (read(syncpipe[0], &c, 1) != 1) _exit(1);
	if (setresgid(0, 0, 0) || setresuid(0, 0, 0)) _exit(2);
	prctl(PR_SET_DUMPABLE, 0);
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) _exit(3);
	if (mount("proc", "/proc", "proc", 0, NULL)) _exit(4);
	if (mount(TOP "/src", TOP "/io", NULL, MS_BIND, NULL)) _exit(5);
	sethostname("source", 6);
	for (;;) {
		int cmd;
		struct iovec iov = {&cmd, sizeof cmd};
		struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
		// reap: templates' children are ours (CLONE_PARENT) and have exit_signal 0
		while (waitpid(-1, NULL, __WALL | WNOHANG) > 0)
			;
		if (recvmsg(sock, &m, 0) <= 0) _exit(0);
		if (cmd == -1) { // start the python
			pid_t p = fork();
			if (p == 0) {
				execl("/usr/bin/python3", "python3", "-c", PY, NULL);
				_exit(127);
			}
			int pfd = pidfd_open_(p);
			send_fd(sock, p, pfd);
			close(pfd);
			continue;
		}
		// a branch init: new user, PID, mount, net, IPC, UTS namespaces
		branch_index = cmd;
		if (pipe(syncpipe) || pipe(readypipe)) _exit(7);
		int pfd = -1;
		int flags = CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC |
		            CLONE_NEWUTS | CLONE_PIDFD | SIGCHLD;
		pid_t p = clone(branch_init, stack[cmd % 8] + sizeof stack[0], flags, NULL, &pfd);
		if (p < 0) _exit(8);
		char path[64];
		if (read(readypipe[0], &c, 1) != 1) _exit(10);
		// identity relative to U_S: the branch's root is the family's root (host 100000)
		snprintf(path, sizeof path, "/proc/%d/uid_map", p);
		writefile(path, "0 0 65536");
		snprintf(path, sizeof path, "/proc/%d/gid_map", p);
		writefile(path, "0 0 65536");
		c = 'g';
		if (write(syncpipe[1], &c, 1) != 1) _exit(9);
		if (read(readypipe[0], &c, 1) != 1) _exit(10);
		close(syncpipe[0]), close(syncpipe[1]), close(readypipe[0]), close(readypipe[1]);
		send_fd(sock, p, pfd);
		close(pfd);
	}
}

// ---- ptrace injection ----
static unsigned long sysinsn; // address of a `syscall` instruction in the tracees
static long inject(pid_t t, long nr, long a1, long a2, long a3, long a4, long a5) {
	struct user_regs_struct r;
	if (ptrace(PTRACE_GETREGS, t, 0, &r)) die("GETREGS");
	r.rip = sysinsn;
	r.rax = nr;
	r.orig_rax = -1;
	r.rdi = a1, r.rsi = a2, r.rdx = a3, r.r10 = a4, r.r8 = a5;
	if (ptrace(PTRACE_SETREGS, t, 0, &r)) die("SETREGS");
	for (int i = 0; i < 2; i++) { // syscall-entry stop, then syscall-exit stop
		int st;
		if (ptrace(PTRACE_SYSCALL, t, 0, 0)) die("PTRACE_SYSCALL");
		for (;;) {
			if (waitpid(t, &st, __WALL) < 0) die("waitpid inject");
			if (WIFSTOPPED(st) && (WSTOPSIG(st) == (SIGTRAP | 0x80))) break;
			if (!WIFSTOPPED(st)) { fprintf(stderr, "tracee %d gone\n", t); exit(1); }
			// an event stop (clone): the syscall-exit stop follows
			if (ptrace(PTRACE_SYSCALL, t, 0, 0)) die("PTRACE_SYSCALL2");
		}
	}
	if (ptrace(PTRACE_GETREGS, t, 0, &r)) die("GETREGS2");
	return (long)r.rax;
}
// write bytes below the tracee's red zone; returns their address
static unsigned long poke(pid_t t, const struct user_regs_struct *saved, unsigned long off, const void *b, size_t n) {
	unsigned long addr = (saved->rsp - 4096 - off) & ~15UL;
	struct iovec l = {(void *)b, n}, r = {(void *)addr, n};
	if (process_vm_writev(t, &l, 1, &r, 1, 0) != (ssize_t)n) die("process_vm_writev");
	return addr;
}
// resume as the interrupted syscall: restart it the way the kernel would
static void resume_regs(pid_t t, struct user_regs_struct r) {
	long rax = (long)r.rax;
	if (rax == -512 || rax == -513 || rax == -514) { // ERESTARTSYS/NOINTR/NOHAND
		r.rax = r.orig_rax;
		r.rip -= 2;
	} else if (rax == -516) { // ERESTART_RESTARTBLOCK
		r.rax = SYS_restart_syscall;
		r.rip -= 2;
	}
	if (ptrace(PTRACE_SETREGS, t, 0, &r)) die("SETREGS resume");
}
static void waitstop(pid_t t) {
	int st;
	if (waitpid(t, &st, __WALL) < 0 || !WIFSTOPPED(st)) {
		fprintf(stderr, "waitstop %d: status %x\n", t, st);
		exit(1);
	}
}

struct clone_args_ {
	uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid,
	    set_tid_size, cgroup;
};
// clone3 injected into tracee t (CLONE_PARENT: the child is finit's, which reaps it);
// the copy is auto-attached (PTRACE_O_TRACECLONE) and left in its first stop
static pid_t auto_child; // set by the clone event
static long inject_clone3_traced(pid_t t, const struct user_regs_struct *saved, pid_t *tids, int ntid, uint64_t flags) {
	struct clone_args_ ca = {.flags = flags | CLONE_PARENT, .exit_signal = 0};
	if (ntid) {
		ca.set_tid = poke(t, saved, 256, tids, sizeof(pid_t) * ntid);
		ca.set_tid_size = ntid;
	}
	unsigned long a = poke(t, saved, 0, &ca, sizeof ca);
	struct user_regs_struct r;
	if (ptrace(PTRACE_GETREGS, t, 0, &r)) die("GETREGS");
	r.rip = sysinsn, r.rax = SYS_clone3, r.orig_rax = -1, r.rdi = a, r.rsi = sizeof ca;
	if (ptrace(PTRACE_SETREGS, t, 0, &r)) die("SETREGS");
	auto_child = -1;
	int exits = 0, entered = 0;
	while (!exits) {
		int st;
		if (ptrace(PTRACE_SYSCALL, t, 0, 0)) die("PTRACE_SYSCALL");
		if (waitpid(t, &st, __WALL) < 0) die("waitpid clone3");
		if (WIFSTOPPED(st) && WSTOPSIG(st) == (SIGTRAP | 0x80)) {
			if (entered) exits = 1;
			entered = 1;
		} else if (WIFSTOPPED(st) && (st >> 16) == PTRACE_EVENT_CLONE) {
			unsigned long m;
			ptrace(PTRACE_GETEVENTMSG, t, 0, &m);
			auto_child = m;
		}
	}
	if (ptrace(PTRACE_GETREGS, t, 0, &r)) die("GETREGS2");
	if ((long)r.rax > 0 && auto_child > 0) waitstop(auto_child);
	return (long)r.rax;
}


// ---- handing a namespace fd to a tracee (as internal/fastpath/handoff.go does) ----
// setns through a pidfd or /proc/PID/ns needs ptrace access to the namespace's holder,
// which a non-dumpable init refuses to the sandbox's root; so the daemon opens the nsfs
// fd and sends it on a socketpair made in the template by injection.
static int hand_rx, hand_tx; // rx: the tracee's fd number; tx: the daemon's copy of the other end
static void hand_setup(pid_t t, const struct user_regs_struct *saved) {
	int zero[2] = {-1, -1};
	unsigned long a = poke(t, saved, 1536, zero, sizeof zero);
	long r = inject(t, SYS_socketpair, AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, a, 0);
	if (r) { fprintf(stderr, "socketpair in template: %s\n", strerror(-r)); exit(1); }
	int sv[2];
	struct iovec l = {sv, sizeof sv}, rm = {(void *)a, sizeof sv};
	if (process_vm_readv(t, &l, 1, &rm, 1, 0) != sizeof sv) die("process_vm_readv");
	int pfd = pidfd_open_(t);
	hand_rx = sv[0];
	hand_tx = syscall(SYS_pidfd_getfd, pfd, sv[1], 0);
	if (hand_tx < 0) die("pidfd_getfd");
	close(pfd);
	inject(t, SYS_close, sv[1], 0, 0, 0, 0);
}
// the tracee t (the template or a copy, which inherits hand_rx) receives nsfd; returns its fd number there
static long hand(pid_t t, const struct user_regs_struct *saved, int nsfd) {
	send_fd(hand_tx, 0, nsfd);
	unsigned long base = (saved->rsp - 4096 - 2048) & ~15UL;
	unsigned long ctl = base, data = base + 32, iov = base + 40, msg = base + 64;
	uint64_t iovv[2] = {data, 4};
	struct { uint64_t name; uint32_t namelen, pad; uint64_t iov, iovlen, control, controllen; int32_t flags, pad2; } m = {
		0, 0, 0, iov, 1, ctl, CMSG_SPACE(sizeof(int)), 0, 0};
	struct iovec l1[2] = {{iovv, sizeof iovv}, {&m, sizeof m}}, r1[2] = {{(void *)iov, sizeof iovv}, {(void *)msg, sizeof m}};
	if (process_vm_writev(t, l1, 2, r1, 2, 0) != (ssize_t)(sizeof iovv + sizeof m)) die("process_vm_writev msg");
	long r = inject(t, SYS_recvmsg, hand_rx, msg, 0, 0, 0);
	if (r < 0) { fprintf(stderr, "recvmsg in tracee: %s\n", strerror(-r)); exit(1); }
	int fd;
	struct iovec l = {&fd, sizeof fd}, rm = {(void *)(ctl + 16), sizeof fd};
	if (process_vm_readv(t, &l, 1, &rm, 1, 0) != sizeof fd) die("process_vm_readv fd");
	return fd;
}
static int nsfd(pid_t p, const char *ns) {
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/ns/%s", p, ns);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) die(path);
	return fd;
}

static void sh(const char *cmd) {
	printf("$ %s\n", cmd);
	fflush(stdout);
	if (system(cmd)) {}
}

static int ask(int in, int out, const char *msg, char *ans, size_t n) {
	if (write(in, msg, strlen(msg)) < 0) return -1;
	ssize_t k = read(out, ans, n - 1);
	if (k <= 0) return -1;
	ans[k] = 0;
	return 0;
}

static int do_fanout(int n) {
	char p[512];
	mkdir(TOP, 0755);
	const char *dirs[] = {"io", "src"};
	for (int i = 0; i < 2; i++) {
		snprintf(p, sizeof p, TOP "/%s", dirs[i]);
		mkdir(p, 0777);
	}
	int fin[64], fout[64];
	for (int i = -1; i < n; i++) {
		char d[96];
		if (i < 0) snprintf(d, sizeof d, TOP "/src");
		else snprintf(d, sizeof d, TOP "/b%d", i);
		mkdir(d, 0777);
		chown(d, UIDBASE, UIDBASE);
		snprintf(p, sizeof p, "%s/in", d);
		unlink(p), mkfifo(p, 0666), chown(p, UIDBASE, UIDBASE);
		int a = open(p, O_RDWR);
		snprintf(p, sizeof p, "%s/out", d);
		unlink(p), mkfifo(p, 0666), chown(p, UIDBASE, UIDBASE);
		int b = open(p, O_RDWR);
		fin[i + 1] = a, fout[i + 1] = b;
	}
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv)) die("socketpair");
	if (pipe(syncpipe)) die("pipe");
	static char fstack[1 << 16];
	pid_t finit = clone(family_init, fstack + sizeof fstack,
	                    CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | SIGCHLD, &sv[1]);
	if (finit < 0) die("clone finit");
	snprintf(p, sizeof p, "/proc/%d/uid_map", finit);
	writefile(p, "0 100000 65536");
	snprintf(p, sizeof p, "/proc/%d/gid_map", finit);
	writefile(p, "0 100000 65536");
	if (write(syncpipe[1], "g", 1) != 1) die("sync");
	int sock = sv[0];
	printf("family init: host pid %d (PID 1 of P_S, user ns root = host uid %d)\n", finit, UIDBASE);

	int cmd = -1, pyps;
	send_fd(sock, cmd, -1);
	int pypfd = recv_fd(sock, &pyps);
	pid_t py = pidfd_pid(pypfd);
	char ans[256];
	double t0 = now_ms();
	if (ask(fin[0], fout[0], "hello\n", ans, sizeof ans)) die("python did not answer");
	printf("source python: host pid %d, PID %d in P_S, ready after %.0f ms: %s", py, pyps, now_ms() - t0, ans);

	// ---- checkpoint: template = injected clone3 of the live python ----
	double tc = now_ms();
	if (ptrace(PTRACE_SEIZE, py, 0, PTRACE_O_TRACECLONE | PTRACE_O_TRACESYSGOOD | PTRACE_O_EXITKILL)) die("SEIZE");
	if (ptrace(PTRACE_INTERRUPT, py, 0, 0)) die("INTERRUPT");
	waitstop(py);
	struct user_regs_struct live;
	if (ptrace(PTRACE_GETREGS, py, 0, &live)) die("GETREGS live");
	long insn = ptrace(PTRACE_PEEKTEXT, py, live.rip - 2, 0);
	if ((insn & 0xffff) != 0x050f) { fprintf(stderr, "not stopped after a syscall insn\n"); return 1; }
	sysinsn = live.rip - 2;
	long tpl_ps = inject_clone3_traced(py, &live, NULL, 0, 0);
	pid_t tpl = auto_child;
	if (tpl_ps <= 0 || tpl <= 0) { fprintf(stderr, "template clone3: %ld\n", tpl_ps); return 1; }
	resume_regs(py, live);
	ptrace(PTRACE_DETACH, py, 0, 0);
	printf("template: host pid %d, PID %ld in P_S, made in %.2f ms (SEIZE..DETACH)\n", tpl, tpl_ps, now_ms() - tc);
	if (ask(fin[0], fout[0], "after-checkpoint\n", ans, sizeof ans)) die("python after ckpt");
	printf("source still answers: %s", ans);

	// ---- negative check: a template forked with CLONE_NEWPID cannot keep its PID ----
	{
		pid_t tid[2] = {pyps, 0};
		long r = inject_clone3_traced(tpl, &live, tid, 1, CLONE_NEWPID);
		printf("clone3(CLONE_NEWPID, set_tid=[%d]) from the template: %s\n", pyps,
		       r < 0 ? strerror(-r) : "ok?");
		tid[0] = 1;
		r = inject_clone3_traced(tpl, &live, tid, 1, CLONE_NEWPID);
		printf("clone3(CLONE_NEWPID, set_tid=[1]) from the template: %ld (%s): the copy is PID 1 of its own namespace\n",
		       r, r < 0 ? strerror(-r) : "ok");
		if (r > 0 && auto_child > 0) {
			kill(auto_child, SIGKILL);
			waitpid(auto_child, NULL, __WALL);
		}
	}

	hand_setup(tpl, &live);

	// ---- branch inits first (a warm pool would have them ready) ----
	pid_t binit[64];
	double tb = now_ms();
	for (int i = 0; i < n; i++) {
		send_fd(sock, i, -1);
		int v, pfd = recv_fd(sock, &v);
		(void)v;
		binit[i] = pidfd_pid(pfd);
		close(pfd);
	}
	double tinit = now_ms() - tb;

	// ---- fan-out: the template forked into each P_live_i at the same PID ----
	double tf = now_ms(), per[64], ready[64];
	pid_t child[64];
	for (int i = 0; i < n; i++) {
		double ti = now_ms();
		// in the template: setns(CLONE_NEWPID) to branch i's PID namespace (for its children)
		int f = nsfd(binit[i], "pid");
		long pfd = hand(tpl, &live, f);
		close(f);
		long r = inject(tpl, SYS_setns, pfd, CLONE_NEWPID, 0, 0, 0);
		inject(tpl, SYS_close, pfd, 0, 0, 0, 0);
		if (r) { fprintf(stderr, "setns pid in template: %s\n", strerror(-r)); return 1; }
		pid_t tid[1] = {pyps};
		long c = inject_clone3_traced(tpl, &live, tid, 1, 0);
		if (c < 0) { fprintf(stderr, "clone3 set_tid: %s\n", strerror(-c)); return 1; }
		pid_t ch = child[i] = auto_child;
		// in the copy: join the branch's user namespace first (its other namespaces are
		// owned by it), then mount, net, IPC, UTS; then reopen its two FIFOs on the
		// branch's own files
		const char *nss[5] = {"user", "mnt", "net", "ipc", "uts"};
		for (int k = 0; k < 5; k++) {
			int f = nsfd(binit[i], nss[k]);
			long fd = hand(ch, &live, f);
			close(f);
			r = inject(ch, SYS_setns, fd, 0, 0, 0, 0);
			inject(ch, SYS_close, fd, 0, 0, 0, 0);
			if (r) { fprintf(stderr, "setns %s in copy: %s\n", nss[k], strerror(-r)); return 1; }
		}
		inject(ch, SYS_close, hand_rx, 0, 0, 0, 0);
		const char *names[2] = {TOP "/io/in", TOP "/io/out"};
		for (int k = 0; k < 2; k++) {
			unsigned long s = poke(ch, &live, 512, names[k], strlen(names[k]) + 1);
			long fd = inject(ch, SYS_open, s, O_RDWR, 0, 0, 0);
			if (fd < 0) { fprintf(stderr, "open in copy: %s\n", strerror(-fd)); return 1; }
			inject(ch, SYS_dup2, fd, 10 + k, 0, 0, 0);
			inject(ch, SYS_close, fd, 0, 0, 0, 0);
		}
		resume_regs(ch, live);
		ptrace(PTRACE_DETACH, ch, 0, 0);
		per[i] = now_ms() - ti;
		char msg[32];
		snprintf(msg, sizeof msg, "branch-%d\n", i);
		if (ask(fin[i + 1], fout[i + 1], msg, ans, sizeof ans)) die("branch did not answer");
		ready[i] = now_ms() - tf;
		printf("branch %d: copy host pid %d, fork+inject %.2f ms, answered at %.2f ms: %s", i, ch, per[i], ready[i], ans);
	}
	double total = now_ms() - tf;
	printf("FANOUT n=%d: all answered in %.2f ms (%.2f ms/branch); branch inits made beforehand in %.2f ms (%.2f ms each)\n",
	       n, total, total / n, tinit, tinit / n);

	// memory: the copies share the template's pages until they write
	for (int i = 0; i < n; i += (n > 1 ? n - 1 : 1)) {
		char path[64], line[128];
		snprintf(path, sizeof path, "/proc/%d/smaps_rollup", child[i]);
		FILE *f = fopen(path, "r");
		while (f && fgets(line, sizeof line, f))
			if (!strncmp(line, "Rss:", 4) || !strncmp(line, "Pss:", 4) || !strncmp(line, "Private_Dirty:", 14))
				printf("branch %d %s", i, line);
		if (f) fclose(f);
	}

	// the source moves into branch 0: its old live process at level 1 ends
	kill(py, SIGKILL);
	usleep(100000);

	printf("\n--- what ps shows ---\n");
	snprintf(p, sizeof p, "nsenter -t %d -m -p ps -eo pid,ppid,user,stat,args | cut -c1-80", finit);
	printf("[holder P_S: family init + template + every copy: no live code may run here]\n");
	sh(p);
	for (int i = 0; i < 2 && i < n; i++) {
		printf("[branch %d]\n", i);
		snprintf(p, sizeof p, "nsenter -t %d -U -m -p --preserve-credentials ps -eo pid,ppid,user,stat,args | cut -c1-80", binit[i]);
		sh(p);
	}
	snprintf(p, sizeof p, "grep NSpid /proc/%d/status /proc/%d/status /proc/%d/status", tpl, child[0], n > 1 ? child[1] : child[0]);
	sh(p);

	// ---- attacks from branch 1 ----
	if (n >= 3) {
		char self[256];
		ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
		self[k > 0 ? k : 0] = 0;
		printf("\n--- attacks from branch 1 (root of its user namespace) ---\n");
		snprintf(p, sizeof p, "cp %s " TOP "/b1/forkns && nsenter -t %d -U -m -p -n -i -u " TOP "/io/forkns attack", self, binit[1]);
		sh(p);
		for (int i = 0; i < n; i++) {
			if (i == 1) continue;
			int alive = ask(fin[i + 1], fout[i + 1], "after-attack\n", ans, sizeof ans) == 0;
			printf("branch %d after branch 1's kill -9 -1: %s", i, alive ? ans : "NO ANSWER\n");
		}
		char st[256] = "", path[64];
		snprintf(path, sizeof path, "/proc/%d/stat", child[1]);
		FILE *f = fopen(path, "r");
		if (f) { if (!fgets(st, sizeof st, f)) st[0] = 0; fclose(f); }
		char *cp = strrchr(st, ')');
		printf("branch 1's python: %s\n", (!f || (cp && cp[2] == 'Z')) ? "killed by its own kill -9 -1 (a zombie until the holder's init reaps it)" : "ALIVE");
		printf("template: %s\n", kill(tpl, 0) == 0 ? "alive" : "GONE");
	}
	kill(finit, SIGKILL);
	waitpid(finit, NULL, 0);
	return 0;
}

// inside a branch: what can root of the branch reach?
static int do_attack(void) {
	int visible = 0, signalable = 0, traceable = 0, pidfds = 0;
	char list[512] = "";
	DIR *d = opendir("/proc");
	struct dirent *e;
	while (d && (e = readdir(d)))
		if (e->d_name[0] >= '0' && e->d_name[0] <= '9') {
			visible++;
			if (strlen(list) < 400) strcat(list, e->d_name), strcat(list, " ");
		}
	for (pid_t p = 1; p < 32768; p++) {
		if (p == getpid()) continue;
		if (kill(p, 0) == 0) signalable++;
		int fd = pidfd_open_(p);
		if (fd >= 0) pidfds++, close(fd);
	}
	for (pid_t p = 2; p < 32768; p++) {
		if (p == getpid() || kill(p, 0) != 0) continue;
		if (ptrace(PTRACE_ATTACH, p, 0, 0) == 0) {
			traceable++;
			waitpid(p, NULL, __WALL);
			ptrace(PTRACE_DETACH, p, 0, 0);
		}
	}
	printf("  attacker pid %d uid %d: /proc lists %d pids (%s), kill(p,0) succeeds for %d pids, pidfd_open for %d, ptrace attach for %d\n",
	       getpid(), getuid(), visible, list, signalable, pidfds, traceable);
	int u = unshare(CLONE_NEWPID);
	printf("  unshare(CLONE_NEWPID) as branch root: %s\n", u ? strerror(errno) : "ok (the seccomp filter refuses this in DeltaBox)");
	printf("  kill(-1, SIGKILL)...\n");
	fflush(stdout);
	signal(SIGKILL, SIG_DFL);
	kill(-1, SIGKILL);
	return 0;
}

int main(int argc, char **argv) {
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc >= 2 && !strcmp(argv[1], "attack")) return do_attack();
	if (argc >= 3 && !strcmp(argv[1], "fanout")) return do_fanout(atoi(argv[2]));
	fprintf(stderr, "usage: forkns fanout N | attack\n");
	return 2;
}
