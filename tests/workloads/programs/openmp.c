/* An OpenMP job: a parallel loop over a seeded array each step; integer sums, so any thread count agrees. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define N (1 << 20)

static uint64_t mix(uint64_t x) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
}

int main(int argc, char **argv) {
    int steps = atoi(argv[1]);
    int pace_ms = atoi(argv[2]);
    uint64_t *data = malloc(N * sizeof *data);
    FILE *progress = fopen("progress.log", "a");
    FILE *result = fopen("result.txt", "w");
    if (!data || !progress || !result) return 1;
    for (long i = 0; i < N; i++) data[i] = (uint64_t)i * 2654435761u + 42;
    for (int step = 0; step < steps; step++) {
        uint64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
        for (long i = 0; i < N; i++) {
            uint64_t x = data[i];
            for (int r = 0; r < 16; r++) x = mix(x + (uint64_t)step);
            data[i] = x;
            sum += x;
        }
        fprintf(result, "%d %016" PRIx64 "\n", step, sum);
        fprintf(progress, "step %d\n", step);
        fflush(progress);
        usleep(pace_ms * 1000);
    }
    fclose(result);
    return 0;
}
