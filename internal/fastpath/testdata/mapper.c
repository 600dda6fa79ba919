// Test subject for package fastpath: maps argv[1] shared and writable (4 KiB) and
// answers on its terminal, a line per command: "read" prints the mapping's first bytes,
// "write TEXT" writes TEXT there. It first closes every fd but its terminal (an fd the
// test's own environment leaked would make it ineligible), and blocks SIGUSR1 and
// SIGUSR2 (so that they stay pending).
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv) {
	if (argc < 2) return 2;
	for (int i = 3; i < 1024; i++) close(i);
	sigset_t b;
	sigemptyset(&b);
	sigaddset(&b, SIGUSR1);
	sigaddset(&b, SIGUSR2);
	sigprocmask(SIG_BLOCK, &b, NULL);
	int fd = open(argv[1], O_RDWR);
	if (fd < 0) return 3;
	char *m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m == MAP_FAILED) return 4;
	close(fd);
	setvbuf(stdout, NULL, _IOLBF, 0);
	printf("ready\n");
	char line[256];
	while (fgets(line, sizeof line, stdin)) {
		line[strcspn(line, "\r\n")] = 0;
		if (!strncmp(line, "write ", 6)) {
			memset(m, 0, 16);
			strncpy(m, line + 6, 15);
			printf("ok\n");
		} else {
			printf("map=%.16s\n", m);
		}
	}
	return 0;
}
