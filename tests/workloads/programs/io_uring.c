/* A job holding an io_uring instance (as Node's libuv or a database may): CRIU cannot dump one. */
#include <linux/io_uring.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int steps = atoi(argv[1]);
    int pace_ms = atoi(argv[2]);
    struct io_uring_params params;
    memset(&params, 0, sizeof params);
    int ring = (int)syscall(__NR_io_uring_setup, 8, &params);
    if (ring < 0) {
        perror("io_uring_setup");
        return 1;
    }
    FILE *progress = fopen("progress.log", "a");
    FILE *result = fopen("result.txt", "w");
    if (!progress || !result) return 1;
    unsigned long long x = 42;
    for (int step = 0; step < steps; step++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        fprintf(result, "%d %016llx\n", step, x);
        fprintf(progress, "step %d\n", step);
        fflush(progress);
        usleep(pace_ms * 1000);
    }
    fclose(result);
    close(ring);
    return 0;
}
