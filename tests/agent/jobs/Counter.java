// A JVM job with default flags: the JVM maps /tmp/hsperfdata_<user>/<pid> for its performance counters.
import java.io.FileWriter;
import java.io.IOException;

public class Counter {
    public static void main(String[] args) throws IOException, InterruptedException {
        int steps = Integer.parseInt(args[0]);
        long sum = 0;
        try (FileWriter progress = new FileWriter("progress.log", true)) {
            for (int step = 0; step < steps; step++) {
                sum += (long) step * step;
                progress.write("step " + step + " " + sum + "\n");
                progress.flush();
                Thread.sleep(100);
            }
        }
    }
}
