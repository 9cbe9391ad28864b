// Package intree drives Docker's in-tree overlay driver (moby's
// libnetwork/drivers/overlay) through the same scenarios as overlayd's
// driver benchmarks (driver/bench_test.go), so that both can be measured
// side by side in one run on one machine: see compare.sh.
//
// It is a module of its own so that moby never becomes a dependency of
// overlayd; it only imports moby's driver and times its calls.
package intree
