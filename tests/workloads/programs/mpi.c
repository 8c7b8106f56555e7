/* An MPI job of 2 or more ranks in a ring: each step a rank sends 1 MiB to the next and takes the previous one's,
   then they sum a checksum; rank 0 writes the result. */
#include <inttypes.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define N (1 << 17)

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int steps = atoi(argv[1]);
    int pace_ms = atoi(argv[2]);
    uint64_t *mine = malloc(N * sizeof *mine), *theirs = malloc(N * sizeof *theirs);
    FILE *progress = NULL, *result = NULL;
    if (rank == 0) {
        progress = fopen("progress.log", "a");
        result = fopen("result.txt", "w");
    }
    for (long i = 0; i < N; i++) mine[i] = (uint64_t)(i + 1) * (rank + 7);
    int next = (rank + 1) % size, previous = (rank + size - 1) % size;
    for (int step = 0; step < steps; step++) {
        MPI_Sendrecv(mine, N, MPI_UINT64_T, next, step, theirs, N, MPI_UINT64_T, previous, step, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        uint64_t local = 0;
        for (long i = 0; i < N; i++) {
            mine[i] = mine[i] * 6364136223846793005u + theirs[(i * 7 + step) % N];
            local += mine[i] >> 3;
        }
        uint64_t total = 0;
        MPI_Allreduce(&local, &total, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
        if (rank == 0) {
            fprintf(result, "%d %016" PRIx64 "\n", step, total);
            fprintf(progress, "step %d\n", step);
            fflush(progress);
        }
        usleep(pace_ms * 1000);
    }
    if (rank == 0) fclose(result);
    MPI_Finalize();
    return 0;
}
