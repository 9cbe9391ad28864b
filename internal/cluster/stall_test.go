package cluster

import (
	"fmt"
	"testing"
	"time"

	"github.com/overlayd/overlayd/peerdb"
)

// TestStalledHostCostsNothing: what a false death costs. A host that
// stalls (its gossip neither sent nor received, as under SIGSTOP or a
// frozen VM) long enough to be declared dead by every other host, and is
// back within FailedGrace as the same process, keeps its records in force
// everywhere (sampled continuously, never removed from a Watcher), and
// its death and return make no host report a single record to its
// Watcher: nothing is fetched or programmed again. The cost on each host
// is a sync request and the returning host's snapshot.
func TestStalledHostCostsNothing(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "st", hosts("127.0.0.", 131, 4), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	v, obs := nodes[3], nodes[:3]
	var keys []peerdb.Key
	for i := range 50 {
		p := v.peer(fmt.Sprintf("e%d", i), fmt.Sprintf("10.131.0.%d", i+2))
		v.publish(131, p)
		keys = append(keys, v.key(131, p.EndpointID))
	}
	for i, n := range obs {
		n.publish(131, n.peer("o", fmt.Sprintf("10.131.1.%d", i+2)))
	}
	waitConverged(t, 10*time.Second, nodes)
	before := map[string]Stats{}
	for _, n := range nodes {
		before[n.name] = n.c.Status().Stats
	}
	smp := startSampler(obs, keys)

	v.tr.held.Store(true) // the stall
	took := waitDeadWithin(t, 15*time.Second, obs, v.name)
	v.tr.held.Store(false)
	back := waitAliveAs(t, 15*time.Second, obs, v)
	waitMembers(t, 15*time.Second, nodes)
	waitConverged(t, 10*time.Second, nodes)
	// On a starved machine the failure detector may flap once more after
	// the stall; wait until every failure it counted has its return.
	waitFor(t, 15*time.Second, "every failure followed by a return", func() (bool, string) {
		for _, n := range obs {
			st, b := n.c.Status().Stats, before[n.name]
			if f, r := st.MemberFailures-b.MemberFailures, st.MemberReturns-b.MemberReturns; f != r {
				return false, fmt.Sprintf("%s: %d failures, %d returns", n.name, f, r)
			}
		}
		return true, ""
	})
	samples, misses := smp.finish()
	t.Logf("declared dead after a stall of %v, alive again everywhere %v after it ended (%d samples)", took, back, samples)
	if len(misses) != 0 {
		t.Errorf("records out of force during the false death: %v", misses)
	}
	for _, n := range nodes {
		st, b := n.c.Status().Stats, before[n.name]
		if n != v {
			// At least the stall's death and return; on a starved machine
			// the failure detector may flap once more (another false
			// death), which must cost nothing either: every failure is
			// followed by a return, and the checks below still hold.
			failures, returns := st.MemberFailures-b.MemberFailures, st.MemberReturns-b.MemberReturns
			if failures < 1 || returns != failures {
				t.Errorf("%s: failures %d->%d, returns %d->%d: want at least one failure, each followed by a return", n.name, b.MemberFailures, st.MemberFailures, b.MemberReturns, st.MemberReturns)
			}
			for _, k := range keys {
				if r := n.w.removalsOf(k); r != 0 {
					t.Errorf("%s: %v removed %d times", n.name, k, r)
				}
			}
		}
		if calls, ks := st.PeersChangedCalls-b.PeersChangedCalls, st.PeersChangedKeys-b.PeersChangedKeys; calls != 0 || ks != 0 {
			t.Errorf("%s: the false death made %d Watcher calls with %d keys; want none (no record changed)", n.name, calls, ks)
		}
		if st.FailedGraceExpired != b.FailedGraceExpired {
			t.Errorf("%s: a grace expired", n.name)
		}
	}
	checkAllViolations(t, nodes)
}
