// Test subject for package fastpath: maps 1 MiB of private anonymous memory, writes
// argv[2] pages of it, marks it with madvise(argv[1]) (0: none; 10: MADV_DONTFORK; 18:
// MADV_WIPEONFORK) and waits. Its fds are the test's /dev/null (it closes any other the
// test's environment leaked).
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv) {
	if (argc < 3) return 2;
	for (int i = 3; i < 1024; i++) close(i);
	int advice = atoi(argv[1]), pages = atoi(argv[2]);
	char *m = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED) return 3;
	memset(m, 7, (size_t)pages * 4096);
	if (advice && madvise(m, 1 << 20, advice)) return 4;
	for (;;) pause();
}
