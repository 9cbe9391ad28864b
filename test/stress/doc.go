// Package stress is overlayd's concurrency-soundness harness: a seeded random
// workload drives one driver from many goroutines on a real kernel (inside
// throwaway namespaces), and at every quiet point an oracle compares what the
// kernel holds with what a simple sequential model, fed by the driver's trace
// of the operations that succeeded (in the order the driver linearised them),
// says it must hold. Everything lives in the _test.go files; see README.md in
// this directory for how to run it, replay a seed and run a soak.
package stress
