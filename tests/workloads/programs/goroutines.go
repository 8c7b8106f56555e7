// A Go job: goroutines mix seeded numbers step by step and hand their parts back over channels.
package main

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"
)

func mix(seed uint64, rounds int) uint64 {
	x := seed
	for i := 0; i < rounds; i++ {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
	}
	return x
}

func main() {
	steps, _ := strconv.Atoi(os.Args[1])
	paceMs, _ := strconv.Atoi(os.Args[2])
	progress, err := os.OpenFile("progress.log", os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		panic(err)
	}
	result, err := os.Create("result.txt")
	if err != nil {
		panic(err)
	}
	const workers = 8
	state := uint64(42)
	for step := 0; step < steps; step++ {
		parts := make([]chan uint64, workers)
		var wg sync.WaitGroup
		for w := 0; w < workers; w++ {
			parts[w] = make(chan uint64, 1)
			wg.Add(1)
			go func(w int, seed uint64) {
				defer wg.Done()
				buf := make([]uint64, 4096) // garbage for the collector
				buf[0] = mix(seed, 300000)
				parts[w] <- buf[0]
			}(w, state*31+uint64(w))
		}
		wg.Wait()
		acc := uint64(0)
		for w := 0; w < workers; w++ {
			acc = acc*1000003 + <-parts[w]
		}
		state = acc
		fmt.Fprintf(result, "%d %016x\n", step, state)
		fmt.Fprintf(progress, "step %d\n", step)
		time.Sleep(time.Duration(paceMs) * time.Millisecond)
	}
	if err := result.Close(); err != nil {
		panic(err)
	}
}
