// A JVM job with default flags: a thread pool mixes seeded numbers step by step (and makes garbage for the GC).
import java.io.FileWriter;
import java.io.PrintWriter;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;

public class Work {
    static long mix(long seed, int rounds) {
        long x = seed;
        List<long[]> garbage = new ArrayList<>();
        for (int i = 0; i < rounds; i++) {
            x ^= x << 13;
            x ^= x >>> 7;
            x ^= x << 17;
            if (i % 1000 == 0) {
                garbage.add(new long[64]);
            }
        }
        return x + garbage.size();
    }

    public static void main(String[] args) throws Exception {
        int steps = Integer.parseInt(args[0]);
        long paceMs = Long.parseLong(args[1]);
        ExecutorService pool = Executors.newFixedThreadPool(4);
        long state = 42;
        try (PrintWriter progress = new PrintWriter(new FileWriter("progress.log", true), true);
             PrintWriter result = new PrintWriter(new FileWriter("result.txt"))) {
            for (int step = 0; step < steps; step++) {
                List<Future<Long>> parts = new ArrayList<>();
                for (int t = 0; t < 4; t++) {
                    final long seed = state * 31 + t;
                    parts.add(pool.submit(() -> mix(seed, 200_000)));
                }
                long acc = 0;
                for (Future<Long> part : parts) {
                    acc = acc * 1_000_003L + part.get();
                }
                state = acc;
                result.printf("%d %016x%n", step, state);
                progress.println("step " + step);
                Thread.sleep(paceMs);
            }
        }
        pool.shutdown();
    }
}
