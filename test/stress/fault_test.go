//go:build faultinject && testhooks

package stress

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/overlayd/overlayd/driver"
)

// The harness must be able to fail: with each injected driver bug the oracle
// reports a divergence between kernel and model (not only the driver's own
// Audit, which cannot see a bug in the driver's intent), the same seed
// without the fault is clean, and the sequential replay of the faulty run's
// trace reproduces the divergence and shrinks it to a short log.
//
//	go test -race -tags 'lockcheck faultinject' -run '^TestFaultsAreCaught$' ./test/stress
func TestFaultsAreCaught(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fault driver.Fault
	}{
		{"DropPeerDeletes", driver.FaultDropPeerDeletes},
		{"LeaveKeepsLocal", driver.FaultLeaveKeepsLocal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Judged by the model against the kernel alone: the driver's
			// Audit, Status and EndpointInfo are left out of this run.
			cfg := runConfig{seed: 4242, workers: 16, ops: 16000, phaseOps: 20, label: ", fault " + tc.name, kernelOnly: true}
			var faulty *runResult
			t.Run("with-fault", func(t *testing.T) {
				driver.SetFault(tc.fault)
				defer driver.SetFault(driver.FaultNone)
				faulty = runStress(t, cfg)
			})
			defer os.Remove(faulty.traceFile) // kept by a failing run; this failure is expected
			if !faulty.failed {
				t.Fatalf("fault %s: %d operations, %d quiet points and the oracle saw nothing", tc.name, faulty.ops, faulty.phases)
			}
			if faulty.deadlock {
				t.Fatalf("fault %s: the run deadlocked instead:\n%s", tc.name, faulty.report)
			}
			oracle := false
			for _, d := range faulty.diffs {
				oracle = oracle || strings.HasPrefix(d, "kernel vs model:")
			}
			if !oracle {
				t.Fatalf("fault %s: the run failed, but not by a difference between kernel and model:\n%s", tc.name, faulty.report)
			}
			t.Logf("fault %s caught after %d operations (quiet point %d):\n%s", tc.name, faulty.ops, faulty.phases, head(faulty.report, 25))

			// The same seed without the fault, for the same operations, is
			// clean, with every check (Audit, Status, EndpointInfo) on.
			clean := cfg
			clean.ops, clean.kernelOnly = faulty.ops, false
			t.Run("without-fault", func(t *testing.T) {
				if res := runStress(t, clean); res.failed {
					t.Fatalf("the same seed without the fault fails too:\n%s", res.report)
				}
			})

			// Sequential replay of the faulty run's linearised trace.
			evs, err := readTrace(faulty.traceFile)
			if err != nil {
				t.Fatal(err)
			}
			var rr replayResult
			t.Run("replay", func(t *testing.T) {
				driver.SetFault(tc.fault)
				defer driver.SetFault(driver.FaultNone)
				rr = replayAndShrink(t, evs, 20*time.Second)
			})
			if rr.at < 0 {
				t.Fatalf("fault %s: the sequential replay of %d events did not reproduce the divergence", tc.name, len(evs))
			}
			t.Logf("fault %s, %s", tc.name, rr.report)
		})
	}
}
