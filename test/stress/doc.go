// Package stress (its tests build with the tag testhooks, which gives the
// driver its trace) is overlayd's concurrency-soundness harness: a seeded random
// workload drives one driver from many goroutines on a real kernel (inside
// throwaway namespaces), with an in-memory source of remote records that the
// workers change and then notify the driver about (as the control plane
// does), and a real encryption owner with its keys established. At every
// quiet point an oracle compares what the kernel holds (links, neighbours,
// FDB, nftables, xfrm) with what a simple sequential model says it must hold:
// the model is fed by the driver's trace of the operations that succeeded
// (in the order the driver linearised them) and by the source's records,
// which each network must then hold exactly, level-triggered, refusing what
// does not fit. Everything lives in the _test.go files; see README.md in
// this directory for what is checked, how to run it, replay a seed and run a
// soak, and the defects it found.
package stress
